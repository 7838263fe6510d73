"""A callback's control flags set on one rank only, --sharded_ddp on 2 gloo processes (trainer/agreed_control.py).

An outside probe: control.should_log on one rank aborted rank 0's process in gloo (exit -6, "Received data size
doesn't match expected size"), control.should_evaluate on one rank waited until the collective timeout (plain DDP
does both alike). Every rank now takes a flag any rank set, with one warning on rank 0 naming the ranks. The
collective timeout here is short, so that a hang fails in seconds, not in 30 minutes.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch

from _dist import run_distributed


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        if "control.should_" in record.getMessage():
            self.lines.append(record.getMessage())


def _one_sided(rank, world_size, out_dir, flag, who, when):
    """``flag`` set on rank ``who`` alone (``who`` -1: on both) at step 2, by a callback's ``when`` event
    (``on_step_end``, or ``on_log`` of a log every rank makes); ``"every_step"``: at every step."""
    from transformers import TrainerCallback

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    def set_it(state, control):
        if who in (rank, -1) and (state.global_step == 2 or when == "every_step"):
            setattr(control, flag, True)

    class Flag(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if when != "on_log":
                set_it(state, control)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if when == "on_log" and "loss" in (logs or {}):
                set_it(state, control)

    said = _Said()
    logging.getLogger("hf_zero_offload").addHandler(said)
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=f"{out_dir}/{flag}-{who}-{when}", per_device_train_batch_size=4, max_steps=4, use_cpu=True,
        ddp_backend="gloo", report_to=[], logging_steps=2 if when == "on_log" else 100, save_strategy="steps",
        save_steps=100, eval_strategy="steps", eval_steps=100, seed=0, disable_tqdm=True, sharded_ddp=True,
        zero_offload="zero2-offload")
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=ToyDataset(),
                                        eval_dataset=ToyDataset(8), callbacks=[Flag()])
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - what the test asserts against
        return {"error": f"{type(e).__name__}: {e}"}
    h = trainer.state.log_history
    return {"error": None, "step": trainer.state.global_step, "said": said.lines,
            "logged": [e["step"] for e in h if "loss" in e], "evaluated": [e["step"] for e in h if "eval_loss" in e],
            "saved": sorted(p.name for p in __import__("pathlib").Path(targs.output_dir).glob("checkpoint-*")),
            "params": [p.detach().clone() for p in trainer.model.parameters()]}


def _run(tmp_path, flag, who, when="on_step_end"):
    start = time.monotonic()
    out = run_distributed(_one_sided, str(tmp_path), flag, who, when, timeout=90, collective_timeout=20)
    assert time.monotonic() - start < 60, "a collective waited for a rank that never came"
    return out


_BOTH: dict = {}  # flag -> the run with it set on both ranks
_WHAT = {"should_log": ("logged", [2]), "should_evaluate": ("evaluated", [2, 4]),
         "should_save": ("saved", ["checkpoint-2", "checkpoint-4"])}


@pytest.mark.parametrize("flag, who", [("should_log", 0), ("should_log", 1), ("should_evaluate", 1),
                                       ("should_save", 0)])
def test_a_flag_set_on_one_rank_is_taken_by_every_rank_with_one_warning(tmp_path, flag, who):
    ours = _run(tmp_path, flag, who)
    assert [r["error"] for r in ours] == [None, None], ours
    key, expected = _WHAT[flag]
    for r in ours:  # (evaluation and the save also at the end: eval_steps/save_steps round up to max_steps)
        assert r["step"] == 4 and r[key] == expected, (key, r[key])
    other = 1 - who
    assert ours[0]["said"] == [f"hf_zero_offload: control.{flag} was set on rank {who} and not on rank {other} "
                               "(after on_step_end/on_epoch_end, step 2): every rank takes it, as the ranks of a "
                               "sharded run must log, evaluate, save and stop together (each takes part in the "
                               "collectives; one rank alone aborted or hung in them). A flag set on any rank is taken "
                               "by all; said once per flag and train()"], ours[0]["said"]
    assert ours[1]["said"] == []  # (said on rank 0 only)
    # logging, evaluating and saving change nothing the model trains on: as if both ranks had set the flag
    if flag not in _BOTH:  # the both-ranks run depends on the flag alone: should_log's two cases share it
        _BOTH[flag] = _run(tmp_path / "both", flag, -1)
    both = _BOTH[flag]
    assert both[0]["said"] == [] and both[0][key] == expected
    for a, b in zip(ours[0]["params"], both[0]["params"]):
        assert torch.equal(a, b)


def test_a_stop_asked_on_one_rank_stops_every_rank(tmp_path):
    ours = _run(tmp_path, "should_training_stop", 1)
    assert [(r["error"], r["step"]) for r in ours] == [(None, 2), (None, 2)], ours
    assert len(ours[0]["said"]) == 1 and "control.should_training_stop was set on rank 1 and not on rank 0" \
        in ours[0]["said"][0]


def test_a_flag_set_at_every_step_on_one_rank_is_said_once(tmp_path):
    ours = _run(tmp_path, "should_log", 0, "every_step")
    assert [r["logged"] for r in ours] == [[1, 2, 3, 4]] * 2, ours
    assert len(ours[0]["said"]) == 1 and "step 1" in ours[0]["said"][0]


def test_an_evaluation_asked_by_on_log_on_one_rank_is_taken_by_every_rank(tmp_path):
    """on_log of the point's own log runs inside it, after its flags were agreed: agreed again before evaluating."""
    ours = _run(tmp_path, "should_evaluate", 0, "on_log")
    assert [r["error"] for r in ours] == [None, None], ours
    assert [r["evaluated"] for r in ours] == [[2, 4]] * 2, ours
    assert len(ours[0]["said"]) == 1 and "(after on_log, step 2)" in ours[0]["said"][0], ours[0]["said"]
