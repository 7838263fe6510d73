"""--sharded_ddp through the Trainer on 2 gloo ranks whose models or runs differ in what the engine does not own:
frozen params, buffers, and a rank that fails on its own."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from _dist import run_distributed


def _states_apart(rank, world_size, out_dir, case):
    """Rank 1's model given one more frozen param (``frozen``), its q and k registered last (``swapped``), an integer buffer of another dtype (``buffer``: the cast to the training
    dtype leaves it), or run with
    --ddp_broadcast_buffers false beside a buffer (``flag``)."""
    from _t5 import OFFLOAD, ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    model = tiny_t5()
    if case == "swapped" and rank == 1:  # q and k registered after v and o: the same shapes in another order
        attn = model.encoder.block[0].layer[0].SelfAttention
        q, k = attn.q, attn.k
        del attn.q, attn.k
        attn.q, attn.k = q, k
    if case == "frozen" and rank == 1:
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    if case in ("buffer", "flag"):
        model.register_buffer("counts", torch.zeros(4, dtype=torch.int32 if rank == 1 and case == "buffer"
                                                    else torch.int64))
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=f"{out_dir}/{case}", per_device_train_batch_size=4, max_steps=2, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="no", disable_tqdm=True, sharded_ddp=True, zero_offload=OFFLOAD,
        ddp_broadcast_buffers=not (case == "flag" and rank == 1))
    try:
        ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset()).train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("case, said", [
    ("frozen", "params: 47 on rank 0, 48 on rank 1; param 0: 'shared.weight (64, 32) float32 trainable' on rank 0, "
               "'extra (3,) float32 frozen' on rank 1"),
    ("swapped", "param 1: 'encoder.block.0.layer.0.SelfAttention.q.weight (32, 32) float32 trainable' on rank 0, "
                "'encoder.block.0.layer.0.SelfAttention.v.weight (32, 32) float32 trainable' on rank 1"),
    ("buffer", "buffer 0: 'counts (4,) int64' on rank 0, 'counts (4,) int32' on rank 1"),
    ("flag", "ddp_broadcast_buffers: True on rank 0, False on rank 1")])
def test_ranks_with_other_params_or_buffers_stop_at_once_naming_them(tmp_path, case, said):
    """An outside probe: the engine compared the trainable params' shapes only, so one frozen param more on rank 1
    (or a buffer of another dtype) left both ranks in the coalesced broadcast of rank 0's frozen params and buffers
    until the collective timeout (30 minutes by default), which then named neither; and a rank 1 with q and k
    registered last trained on without a word, rank 0's q set into its v (as DDP does too)."""
    start = time.monotonic()
    ours = run_distributed(_states_apart, str(tmp_path), case, timeout=120, collective_timeout=60)
    assert time.monotonic() - start < 40
    for r in ours:
        assert r and "the 2 ranks hold different models" in r and said in r, ours


def _buffer_equal(rank, world_size, out_dir):
    from _t5 import OFFLOAD, ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    model = tiny_t5()
    model.register_buffer("counts", torch.full((4,), float(rank)))
    model.register_parameter("frozen", torch.nn.Parameter(torch.full((2,), float(rank)), requires_grad=False))
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=f"{out_dir}/same", per_device_train_batch_size=4, max_steps=1, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="no", disable_tqdm=True, sharded_ddp=True, zero_offload=OFFLOAD)
    ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset()).train()
    return model.counts.tolist() + model.frozen.tolist()


def test_ranks_with_the_same_frozen_params_and_buffers_still_take_rank_0s(tmp_path):
    assert run_distributed(_buffer_equal, str(tmp_path), timeout=120) == [[0.0] * 6, [0.0] * 6]


def _weights_refused(rank, world_size, out_dir):
    """Rank 0's save_pretrained refuses the weights at step 4 with a ValueError (as it does an invalid generation
    config); checkpoint-2 was saved before."""
    import os

    from _t5 import OFFLOAD, ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True, sharded_ddp=True,
        zero_offload=OFFLOAD)
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())
    save = trainer._save

    def refuse(*a, **k):
        if rank == 0 and trainer.state.global_step == 4:
            raise ValueError("The generation config instance is invalid")
        return save(*a, **k)

    trainer._save = refuse
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}",
                "marked": sorted(d for d in os.listdir(out_dir) if os.path.isfile(f"{out_dir}/{d}/hzo_complete.json"))}
    return {"error": None}


def test_weights_refused_by_a_value_error_on_rank_0_stop_every_rank_at_once(tmp_path):
    """An outside probe: rank 0's weights save kept a full disk's OSError for the end of the save, but a ValueError
    (save_pretrained refusing an invalid generation config, safetensors a non-contiguous tensor) went out of it on
    rank 0 alone, while rank 1 waited in the engine's save until the collective timeout (30 minutes by default)."""
    start = time.monotonic()
    ours = run_distributed(_weights_refused, str(tmp_path), timeout=120, collective_timeout=60)
    assert time.monotonic() - start < 40
    assert ours[0]["error"].startswith("ValueError: The generation config instance is invalid"), ours
    assert f"saving {tmp_path}/checkpoint-4 failed on rank 0 (host" in ours[1]["error"], ours
    assert "The generation config instance is invalid" in ours[1]["error"], ours
    for r in ours:
        assert r["marked"] == ["checkpoint-2"], ours


def _raises_mid_step(rank, world_size, out_dir, where):
    """Rank 1 raises at its third training forward (``forward``), in the backward of its third step (``backward``:
    while its gradient hooks reduce), or in a callback at step 2's end (``before_save``: where rank 0 goes on to
    save checkpoint-2), or rank 0 in a callback at step 2's end (``callback``)."""
    from transformers import TrainerCallback

    from _t5 import OFFLOAD, ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    model, calls = tiny_t5(), []

    def forward_hook(module, inputs, output):
        calls.append(1)
        if rank == 1 and len(calls) == 3 and module.training:
            if where == "forward":
                raise RuntimeError("boom in forward")
            output.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0 and state.global_step == 2 and where == "callback":
                raise KeyError("boom in callback")
            if rank == 1 and state.global_step == 2 and where.startswith("before_save"):  # rank 0 then waits to save
                raise KeyError("boom before the save")

    model.lm_head.register_forward_hook(forward_hook)
    # without the engine (the mixin's Trainer as a plain DDP one) the control flags are not agreed: the save's own
    # wait (saving.py) meets the failure
    engine = {} if where == "before_save_no_engine" else dict(sharded_ddp=True, zero_offload=OFFLOAD)
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=f"{out_dir}/{where}", per_device_train_batch_size=4, max_steps=4, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="steps" if where.startswith("before_save") else "no", save_steps=2, disable_tqdm=True,
        **engine)
    try:
        ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), callbacks=[Stop()]).train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("where, failing, said", [("forward", 1, "RuntimeError: boom in forward"),
                                                  ("backward", 1, "RuntimeError: boom in backward"),
                                                  ("callback", 0, "KeyError: 'boom in callback'"),
                                                  ("before_save", 1, "KeyError: 'boom before the save'"),
                                                  ("before_save_no_engine", 1, "KeyError: 'boom before the save'")])
def test_a_rank_failing_mid_step_is_named_by_the_others(tmp_path, where, failing, said):
    """An outside probe: rank 1 raising mid-step ended its process, and rank 0 failed in the collective it waited in
    with gloo's words alone ("Connection closed by peer [127.0.0.1]:37056 ... GLHF!"), naming neither the rank nor
    its error; with a save at that step rank 0 looked for rank 1 to reach it until --ddp_timeout (30 minutes)."""
    start = time.monotonic()
    ours = run_distributed(_raises_mid_step, str(tmp_path), where, timeout=120, collective_timeout=60)
    assert time.monotonic() - start < 40
    assert ours[failing].startswith(said), ours
    if where == "before_save":  # (rank 0 now meets the gone rank in the control flags' agreement, before the save's
        # own wait for it: agreed_control.py; that wait, "this rank waited for it to save ...", is met without the engine)
        assert ours[0].startswith(f"RuntimeError: rank 1 (host {socket.gethostname()}) failed: {said}; this rank "
                                  "(rank 0) stopped in the collective"), ours
        assert not (tmp_path / "before_save" / "checkpoint-2").exists()
        return
    if where == "before_save_no_engine":
        assert ours[0] == f"RuntimeError: rank 1 (host {socket.gethostname()}) failed: {said}; this rank waited for " \
            f"it to save {tmp_path}/{where}/checkpoint-2, which it never will; nothing was written", ours
        assert not (tmp_path / where / "checkpoint-2").exists()
        return
    assert ours[1 - failing].startswith(f"RuntimeError: rank {failing} (host ") and f"failed: {said}" in \
        ours[1 - failing] and f"this rank (rank {1 - failing}) stopped in the collective" in ours[1 - failing], ours
