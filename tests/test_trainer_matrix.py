"""Every resume path through the Trainer, as one matrix: offload on/off, stage 1/2, DPU on/off, 1 <-> 2 ranks
(gloo), fp32/bf16, fp32/int8 moments (``offload_optimizer.state_dtype``).

Each run trains a tiny T5 for 4 steps at a global batch of 4 (1 rank x 4, or 2 ranks x 2: the same samples per
step); a checkpoint at step 2 is resumed with the cell's setup on the cell's rank count, with another random
init, and the final weights are compared with the uninterrupted run of the saving setup:

- exact (bit for bit): same rank count. Offload on/off and stage 1/2 run the same fused CPU Adam on the same
  fp32 masters, and the gradient reduction is the same, so the math of steps 3-4 is identical;
- close (rtol/atol 1e-5 fp32, 2e-2 bf16): another rank count. The gradients are the same samples averaged in
  another order (one process's batch mean vs the mean of two half-batch means), so only rounding differs.
DPU is kept on both sides of a cell: it changes the schedule of the math (the update of step t lands at t+1).
"""
from __future__ import annotations

import logging

import pytest
import torch

from _dist import run_distributed

Z = {"off2": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
     "off2-dpu": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                  "delayed_param_update": {"enabled": True, "warmup_steps": 1}},
     "z1": {"stage": 1}, "z2": {"stage": 2}}
INT8 = {"device": "cpu", "state_dtype": "int8"}
Z.update({"off2-int8": {"stage": 2, "offload_optimizer": INT8},
          "off2-int8-dpu": {**Z["off2-dpu"], "offload_optimizer": INT8}})
# without clipping, which hides it: transformers multiplies the loss by the rank count with
# average_tokens_across_devices (on by default), and T5 computes its own mean, so its gradients on 2 ranks are twice
# those on 1 and the saved moments are of another scale (said); per-rank averaging keeps one scale
Z.update({"off2-noclip": Z["off2"], "off2-noclip-peravg": Z["off2"]})

# name: (saved by (ranks, setup), resumed on (ranks, setup), dtype, expectation)
CELLS = {
    "2to2-offload-dpu-bf16": ((2, "off2-dpu"), (2, "off2-dpu"), "bf16", "exact"),
    "2to2-z1-to-offload-z2-fp32": ((2, "z1"), (2, "off2"), "fp32", "exact"),
    "2to1-offload-dpu-bf16": ((2, "off2-dpu"), (1, "off2-dpu"), "bf16", "close"),
    "2to1-z1-to-z2-fp32": ((2, "z1"), (1, "z2"), "fp32", "close"),
    "1to2-offload-fp32": ((1, "off2"), (2, "off2"), "fp32", "close"),
    "1to1-z2-to-offload-bf16": ((1, "z2"), (1, "off2"), "bf16", "exact"),
    "1to1-offload-to-z2-fp32": ((1, "off2"), (1, "z2"), "fp32", "exact"),
    # 8-bit moments (issue 14): int8 blocks never straddle a shard, so the state re-cuts exactly
    "2to2-int8-dpu-bf16": ((2, "off2-int8-dpu"), (2, "off2-int8-dpu"), "bf16", "exact"),
    "2to1-int8-dpu-bf16": ((2, "off2-int8-dpu"), (1, "off2-int8-dpu"), "bf16", "close"),
    "1to1-int8-fp32": ((1, "off2-int8"), (1, "off2-int8"), "fp32", "exact"),
    # int8 moments resumed as fp32 ones: converted with one log line; steps 3-4 then run exact AdamW
    # on the decoded moments instead of 8-bit ones, so the weights stay near the int8 run's
    "1to1-int8-to-fp32-moments-fp32": ((1, "off2-int8"), (1, "off2"), "fp32", "converted"),
    "2to1-offload-fp32-noclip": ((2, "off2-noclip"), (1, "off2-noclip"), "fp32", "rescaled"),
    "2to1-offload-fp32-noclip-per-rank-mean": ((2, "off2-noclip-peravg"), (1, "off2-noclip-peravg"), "fp32", "close"),
}


def _train(out: str, setup: str, dtype: str, ranks: int, resume_from: str | None = None, seed: int = 0):
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    model = tiny_t5(seed)
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=out, per_device_train_batch_size=4 // ranks, max_steps=4, use_cpu=True, report_to=[],
        logging_steps=1, save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True, learning_rate=3e-3,
        weight_decay=0.01, max_grad_norm=0.0 if "noclip" in setup else 1.0, warmup_steps=1, bf16=dtype == "bf16",
        average_tokens_across_devices=not setup.endswith("peravg"),
        zero_offload={"zero_optimization": Z[setup]}, **({"ddp_backend": "gloo"} if ranks > 1 else {}))
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=targs, train_dataset=ToyDataset())
    trainer.train(resume_from_checkpoint=resume_from)
    return [p.detach().float().clone() for p in model.parameters()]


def _name(saved, dtype):
    return f"full-{saved[0]}-{saved[1]}-{dtype}"


def _jobs(rank, world_size, base, jobs):
    """Several Trainer runs in one 2-process group (one spawn for all the 2-rank cells)."""
    return {key: _train(f"{base}/{key}", setup, dtype, world_size, resume_from) for key, setup, dtype, resume_from
            in jobs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs (their checkpoint-2 feeds the cells) and every 2-rank resume, computed once."""
    base = str(tmp_path_factory.mktemp("matrix"))
    out = {}
    fulls = {(saved, dtype) for saved, _, dtype, _ in CELLS.values()}
    for saved, dtype in sorted(fulls):
        if saved[0] == 1:
            out[_name(saved, dtype)] = _train(f"{base}/{_name(saved, dtype)}", saved[1], dtype, 1)
    jobs = [(_name(s, d), s[1], d, None) for s, d in sorted(fulls) if s[0] == 2]
    jobs += [(cell, resumed[1], dtype, f"{base}/{_name(saved, dtype)}/checkpoint-2")
             for cell, (saved, resumed, dtype, _) in CELLS.items() if resumed[0] == 2]
    out.update(run_distributed(_jobs, base, jobs, timeout=600)[0])
    return base, out


@pytest.mark.parametrize("cell", list(CELLS))
def test_resume_matrix(runs, cell, caplog):
    base, out = runs
    saved, resumed, dtype, expect = CELLS[cell]
    ckpt = f"{base}/{_name(saved, dtype)}/checkpoint-2"
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    got = out[cell] if resumed[0] == 2 else _train(f"{base}/{cell}", resumed[1], dtype, 1, ckpt, seed=1)
    if resumed[0] == 1:  # the one line saying what was restored, saved vs now
        (line,) = [r.getMessage() for r in caplog.records if "hf_zero_offload: resumed" in r.getMessage()]
        assert f"saved by {saved[0]} rank(s), loaded on 1" in line
    said = [r for r in caplog.records if "gradients 0.5 times those the saved moments hold" in r.getMessage()]
    assert len(said) == (resumed[0] == 1 and saved[0] == 2 and not resumed[1].endswith("peravg")), cell
    if expect == "converted":
        assert any("optimizer moments saved as int8 (code map 2) converted to state_dtype=fp32" in r.getMessage()
                   for r in caplog.records)
    want = out[_name(saved, dtype)]
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for i, (a, b) in enumerate(zip(want, got)):
        if expect == "exact":
            assert torch.equal(a, b), f"param {i}: max diff {(a - b).abs().max().item()}"
        elif expect == "converted":  # two steps of lr 3e-3 apart: far under one step's size
            torch.testing.assert_close(b, a, rtol=0, atol=1e-3, msg=f"param {i}")
        elif expect == "rescaled":  # moments of twice the gradients' scale: under one step of lr 3e-3 (1.2e-3 seen)
            torch.testing.assert_close(b, a, rtol=0, atol=3e-3, msg=f"param {i}")
        else:
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=f"param {i}")
