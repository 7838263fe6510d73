"""load_best_model_at_end in a run that resumed a plain Trainer's checkpoint (its optimizer.pt taken over): the best
checkpoint can be one of the plain run's. Its state was looked for in a zero_offload/ it never had, and train()
failed at its very end (FileNotFoundError, every step done), the model holding the best weights and the engine the
last step's masters."""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from _t5 import OFFLOAD
from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments


class _Cfg(PretrainedConfig):
    model_type = "hzo_best_two_linears"


class _Two(PreTrainedModel):
    config_class = _Cfg

    def __init__(self, config):
        super().__init__(config)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.post_init()

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return {"loss": ((out - y) ** 2).mean(), "logits": out}


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, generator=g), "y": torch.randn(8, generator=g)} for _ in range(n)]


def _scores(*values):
    """compute_metrics giving ``values`` in turn: which evaluation is the best is the test's choice."""
    it = iter(values)
    return lambda _: {"score": next(it)}


def _train(out, zero, max_steps, scores, resume=None, **extra):
    torch.manual_seed(0)
    model = _Two(_Cfg())
    kw = dict(**extra, output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, save_strategy="steps",
              save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
              metric_for_best_model="score", greater_is_better=True, report_to="none", use_cpu=True,
              learning_rate=1e-2, disable_tqdm=True, label_names=["y"])
    args = ZeroOffloadTrainingArguments(zero_offload=OFFLOAD, **kw) if zero else TrainingArguments(**kw)
    trainer = (ZeroOffloadTrainer if zero else Trainer)(model=model, args=args, train_dataset=_data(),
                                                        eval_dataset=_data(4, seed=1), compute_metrics=scores)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.mark.parametrize("optimizer_pt", [True, False], ids=["its optimizer.pt", "no optimizer state"])
def test_the_best_checkpoint_of_the_plain_run_this_one_resumed_loads(tmp_path, caplog, optimizer_pt):
    _train(tmp_path / "run", False, 4, _scores(10.0, 5.0))  # the plain run: its checkpoint-2 scores best
    best = tmp_path / "run" / "checkpoint-2"
    if not optimizer_pt:  # (as a plain --save_only_model run leaves its checkpoints; ours resumes checkpoint-4)
        os.remove(best / "optimizer.pt")
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        model, trainer = _train(tmp_path / "run", True, 8, _scores(1.0, 1.0), resume=str(tmp_path / "run" /
                                                                                          "checkpoint-4"))
    assert trainer.state.best_model_checkpoint == str(best)
    weights = load_file(str(best / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    engine = trainer.zero_engine  # its masters are the best weights (a save or consolidate writes them)
    masters = engine.state_dict()["master"]
    flat = torch.cat([p.detach().reshape(-1) for g in engine.slot_params() for p in g])
    assert torch.equal(masters, flat)
    said = [r.getMessage() for r in caplog.records]
    if optimizer_pt:  # its moments and step counts too, as a resume takes them
        assert set(engine.state_dict()["param_steps"]) == {2}
        assert any(f"{best} is a plain Trainer's checkpoint: its optimizer's state" in m for m in said)
    else:
        assert set(engine.state_dict()["param_steps"]) == {8}
        (msg,) = [m for m in said if "load_best_model_at_end" in m]
        assert f"{best} holds no optimizer state" in msg and "stay the last step's" in msg, msg


def _two_ranks(rank, world_size, base):
    """The plain run under DDP, resumed by ZeRO-2 on both ranks; per case, (best as expected, weights of the best,
    masters equal to this rank's slice of the weights, the step counts)."""
    import torch.distributed as dist
    out = []
    for case, optimizer_pt in (("opt", True), ("none", False)):
        run = f"{base}/{case}"
        _train(run, False, 4, _scores(10.0, 5.0), ddp_backend="gloo")
        dist.barrier()
        if not optimizer_pt and rank == 0:
            os.remove(f"{run}/checkpoint-2/optimizer.pt")
        dist.barrier()
        model, trainer = _train(run, True, 8, _scores(1.0, 1.0), resume=f"{run}/checkpoint-4", ddp_backend="gloo",
                                sharded_ddp=True)
        weights = load_file(f"{run}/checkpoint-2/model.safetensors")
        engine, sd = trainer.zero_engine, trainer.zero_engine.state_dict()
        flat = torch.cat([p.detach().reshape(-1) for g in engine.slot_params() for p in g])
        out.append((trainer.state.best_model_checkpoint == f"{run}/checkpoint-2",
                    all(torch.equal(p, weights[n]) for n, p in model.named_parameters()),
                    torch.equal(sd["master"], flat[sd["shard_start"]:sd["shard_end"]]), sorted(set(sd["param_steps"]))))
    return out


def test_the_best_plain_checkpoint_loads_on_two_ranks(tmp_path):
    from _dist import run_distributed
    for rank in run_distributed(_two_ranks, str(tmp_path), timeout=300):
        assert rank == [(True, True, True, [2]), (True, True, True, [8])]
