"""Resumes of models whose checkpoint weights transformers saves under older names than the model's own (ViT here;
Mixtral and Qwen2-MoE alike in transformers 5.x): the Trainer's resume loads the file by name and leaves those params
at their initialisation. The engine's masters set them (exact); a delayed (DPU) state's lagging weights, which only
the model file holds, are lost with the names: its step is published at once, and said (it resumed on a mix of
initial and lagging weights without a word, 9.4e-4 off an uninterrupted run, an outside probe)."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, ViTConfig, ViTForImageClassification

from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from hf_zero_offload.trainer.unloaded import unloaded_params

OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
DPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                             "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}


class Images(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _vit():
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                               num_labels=2, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


class _Weights(TrainerCallback):
    """The params the 4th step's forward runs on."""
    def __init__(self):
        self.at = None

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == 3:
            self.at = {k: v.detach().clone() for k, v in model.named_parameters()}


def _run(tmp_path, name, cfg, best=False, **kw):
    model = _vit()
    extra = dict(eval_strategy="steps", eval_steps=3, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=True, max_steps=6) if best else dict(max_steps=5)
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                                        learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
                                        save_strategy="steps", save_steps=3, zero_offload=cfg, seed=0, **extra)
    trainer = ZeroOffloadTrainer(model=model, args=args, train_dataset=Images(), eval_dataset=Images(16))
    seen = _Weights()
    trainer.add_callback(seen)
    trainer.train(**kw)
    return (trainer if best else model), seen.at


def _skip_unless_renamed(checkpoint):
    model = _vit()
    missing = model.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=False).missing_keys
    if not unloaded_params(model, missing):
        pytest.skip("this transformers saves ViT's weights under the model's own names")


@pytest.mark.parametrize("cfg", [OFFLOAD, DPU], ids=["sync", "dpu"])
def test_a_resume_whose_weight_names_transformers_renamed(tmp_path, caplog, cfg):
    full, full_at = _run(tmp_path, "full", cfg)
    _skip_unless_renamed(tmp_path / "full" / "checkpoint-3")
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    resumed, resumed_at = _run(tmp_path, "res", cfg, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    said = caplog.text
    assert "checkpoint-3's weight files hold" in said and "under other names" in said
    if cfg is OFFLOAD:  # the masters are the weights: exact
        assert "the engine's fp32 masters set them" in said
        for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
            assert torch.equal(a, b), name
    else:  # the step in flight published at once: the masters (one step early), not the initialisation
        assert "the delayed (DPU) step's lagging weights cannot be restored" in said
        init = dict(_vit().named_parameters())
        moved = [n for n, w in resumed_at.items() if torch.equal(w, init[n])]
        assert not moved, f"resumed on initial weights: {moved[:3]}"
        off = max((full_at[n] - w).abs().max().item() for n, w in resumed_at.items())
        assert 0 < off < 2e-2  # the lag of one step, no more


@pytest.mark.parametrize("cfg", [OFFLOAD, DPU], ids=["sync", "dpu"])
def test_the_best_models_load_with_weight_names_transformers_renamed(tmp_path, caplog, cfg):
    """load_best_model_at_end reads the best checkpoint's weights by name as the resume does: under DPU the renamed
    params kept the last step's weights beside the best checkpoint's others, a mix a later save_model wrote (a
    review). The model ends on the engine's masters, every param."""
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    trainer, _ = _run(tmp_path, "best", cfg, best=True)
    best = trainer.state.best_model_checkpoint
    _skip_unless_renamed(tmp_path / "best" / best.rsplit("/", 1)[-1])
    assert "weight files hold" in caplog.text and "best-model load" in caplog.text
    assert ("the delayed (DPU) step's lagging weights cannot be restored" in caplog.text) == (cfg is DPU)
    engine = trainer.zero_engine
    for g in engine._slots:
        for p, off, n in g:
            assert torch.equal(p.detach().reshape(-1), engine.master[off:off + n])


def test_a_plain_trainers_checkpoint_says_the_params_it_cannot_restore(tmp_path, caplog):
    """A plain Trainer's checkpoint (optimizer.pt, no state of ours) has no masters: those params stay at their
    initialisation as under the plain Trainer, now said by name."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=8, max_steps=3,
                             learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="steps",
                             save_steps=3, optim="adamw_torch", seed=0)
    Trainer(model=_vit(), args=args, train_dataset=Images()).train()
    _skip_unless_renamed(tmp_path / "plain" / "checkpoint-3")
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _run(tmp_path, "res", OFFLOAD, resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    assert "weight files hold" in caplog.text and "they keep the values they had before the resume" in caplog.text
