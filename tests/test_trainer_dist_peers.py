"""--sharded_ddp on 2 gloo ranks where one rank fails outside the training loop, makes a call its peer does not, or
is killed: the other rank names it (peer_failure.py) instead of failing in gloo's words."""
from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from torch import equal as torch_equal
from torch.testing import assert_close

from _dist import DistributedError, run_distributed

HOST = socket.gethostname()


def _args(out_dir, case, **kw):
    from _t5 import OFFLOAD
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments

    base = dict(output_dir=f"{out_dir}/{case}", per_device_train_batch_size=4, max_steps=2, use_cpu=True,
                ddp_backend="gloo", report_to=[], save_strategy="no", disable_tqdm=True, sharded_ddp=True,
                zero_offload=OFFLOAD)
    return ZeroOffloadSeq2SeqTrainingArguments(**{**base, **kw})


def _fails_before_train(rank, world_size, out_dir, case):
    """Rank 1's ``model_init`` raises in the Trainer's constructor (rank 0 goes on to train()), or rank 1's ds_config
    file is not there (rank 0 waits in the constructor's run-lock broadcast)."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer

    def model_init():
        if rank == 1:
            raise KeyError("boom in model_init")
        return tiny_t5()

    try:
        if case == "model_init":
            trainer = ZeroOffloadSeq2SeqTrainer(model_init=model_init, args=_args(out_dir, case),
                                                train_dataset=ToyDataset())
        else:
            cfg = {"zero_offload": f"{out_dir}/absent.json"} if rank == 1 else {}
            trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, case, **cfg),
                                                train_dataset=ToyDataset())
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("case, said", [
    ("model_init", "KeyError: 'boom in model_init'"),
    ("config_file", "ConfigError: {}/absent.json: cannot read the ds_config file")])
def test_a_rank_failing_in_the_constructor_is_named_by_the_others(tmp_path, case, said):
    """An outside probe: rank 1 raising in the Trainer's constructor left rank 0 to fail in gloo's words at its next
    collective ("Connection closed by peer [127.0.0.1]:8082 ... GLHF!"), naming neither rank 1 nor its error."""
    said = said.format(tmp_path)
    ours = run_distributed(_fails_before_train, str(tmp_path), case, timeout=120, collective_timeout=60)
    assert ours[1].startswith(said), ours
    assert ours[0].startswith(f"RuntimeError: rank 1 (host {HOST}) failed: {said}"), ours
    assert "this rank (rank 0) stopped in the collective it was waiting in for it" in ours[0], ours


def _one_sided(rank, world_size, out_dir, case):
    """After a train() on both ranks, rank 0 alone evaluates or saves a checkpoint, or (``resume``) a second run is
    resumed on rank 0 only."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer

    saves = dict(save_strategy="steps", save_steps=2) if case == "resume" else {}
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, case, **saves),
                                        train_dataset=ToyDataset(), eval_dataset=ToyDataset(8))
    trainer.train()
    try:
        if case == "resume":
            again = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, "again", max_steps=4),
                                              train_dataset=ToyDataset())
            again.train(resume_from_checkpoint=f"{out_dir}/resume/checkpoint-2" if rank == 0 else None)
        elif rank == 0:
            {"evaluate": trainer.evaluate, "save": lambda: trainer._save_checkpoint(trainer.model, None)}[case]()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("case, doing", [("evaluate", "evaluate()"), ("save", "a checkpoint save")])
def test_a_call_made_on_one_rank_only_names_the_rank_that_did_not(tmp_path, case, doing):
    """An outside probe: rank 0's evaluate() (or checkpoint save) after train(), which rank 1 did not call, failed
    in gloo's words when rank 1's process ended (plain DDP does the same); now it names rank 1 as returned."""
    ours = run_distributed(_one_sided, str(tmp_path), case, timeout=120, collective_timeout=60)
    assert ours[1] is None, ours
    assert ours[0].startswith(f"RuntimeError: rank 1 (host {HOST}) had returned from its train() (at step 2) and "
                              f"was not in the collective this rank (rank 0) waited in, in {doing}: "), ours


def test_a_resume_given_on_one_rank_only_is_refused_on_every_rank(tmp_path):
    """An outside probe: resume_from_checkpoint on rank 0 only paired its resume's gather with rank 1's next one,
    and each failed unpacking the other's ("ValueError: not enough values to unpack (expected 5, got 2)")."""
    ours = run_distributed(_one_sided, str(tmp_path), "resume", timeout=120, collective_timeout=60)
    for r in ours:
        assert r == ("ValueError: resume_from_checkpoint was given on rank(s) 0 and not on rank(s) 1: every rank "
                     "must resume from the same checkpoint, or none (the same train() call on every rank)"), ours


def _killed(rank, world_size, out_dir, where):
    """Rank 1 killed (SIGKILL) at step 2's end (``train``), or (``evaluate``) in the first batch of the evaluate()
    both ranks call after train() (the usual script); rank 0 writes what it raised to a file (its peer's death fails
    the test's run)."""
    from transformers import TrainerCallback

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer
    from hf_zero_offload.trainer import peer_failure

    peer_failure._WAIT_S = 1.0  # rank 0's look for the key a killed rank never writes, waited out in full: 1 s (3 s)

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 2 and where == "train":
                os.kill(os.getpid(), signal.SIGKILL)

    class KilledOnRank1(ToyDataset):
        def __getitem__(self, i):
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__getitem__(i)

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, where, max_steps=4),
                                        train_dataset=ToyDataset(), eval_dataset=KilledOnRank1(8), callbacks=[Kill()])
    try:
        trainer.train()
        trainer.evaluate()
    except Exception as e:  # noqa: BLE001 - the message is the result
        with open(f"{out_dir}/rank{rank}.txt", "w") as f:
            f.write(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("where, doing", [("train", "train()"), ("evaluate", "evaluate()")])
def test_a_peer_killed_is_named_as_stopped_without_an_error(tmp_path, where, doing):
    """An outside probe: rank 1 killed by SIGKILL (the out-of-memory killer's signal) left rank 0 with gloo's words
    only ("Connection closed by peer ... GLHF!"). Killed in the evaluate() after train(), its "returned from its
    train()" key still in the store, rank 0 said it had returned and was not in the collective ("every rank must
    make the same calls"), blaming the script."""
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 ---\nprocess exited with code -9"):
        run_distributed(_killed, str(tmp_path), where, timeout=120, collective_timeout=60)
    assert time.monotonic() - start < 60
    said = (tmp_path / "rank0.txt").read_text()
    assert said.startswith("RuntimeError: rank 1 stopped without an error of its own while this rank (rank 0) "
                           f"waited for it in a collective, in {doing}: killed (SIGKILL, the out-of-memory "
                           "killer)"), said


def _batches_apart(rank, world_size, out_dir, schedule):
    """Rank 1's sampler yields 24 samples, rank 0's 16 (2 and 3 batches of 4 per rank), for one epoch."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer

    class PerRankSampler(ZeroOffloadSeq2SeqTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return list(range(16 if rank == 0 else 24))

    args = _args(out_dir, schedule, max_steps=-1, num_train_epochs=1, lr_scheduler_type=schedule)
    try:
        PerRankSampler(model=tiny_t5(), args=args, train_dataset=ToyDataset()).train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_samplers_yielding_other_batch_counts_stop_at_train_start(tmp_path, schedule):
    """An outside probe: each rank took its own step count from its own sampler; under a decaying schedule the run
    stopped at step 2 blaming the schedule ("param group 0 lr differs across ranks"), under a constant one rank 1
    trained on 2 of its 3 batches (plain DDP: gloo's "Connection reset by peer")."""
    ours = run_distributed(_batches_apart, str(tmp_path), schedule, timeout=120, collective_timeout=60)
    for r in ours:
        assert r == ("ConfigError: the 2 ranks were started for different runs: the training dataloader's batches "
                     "per epoch: 2 on rank 0, 3 on rank 1. Every rank's sampler must yield the same number of batches: "
                     "each rank derives its step count and epoch ends from it, and ranks that differ there train on a "
                     "mix or wait in a collective their peers never reach"), ours


def _uneven_shards(rank, world_size, out_dir, mode):
    """Each rank reads its own IterableDataset shard (8 and 12 samples; dispatch_batches off): its epochs end at its
    own steps. 6 steps, a log at each, a checkpoint at step 3."""
    import torch

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer
    from transformers import Seq2SeqTrainer

    data = ToyDataset()

    class Shard(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (data[i] for i in range(8 if rank == 0 else 12))

    kw = dict(max_steps=6, logging_steps=1, save_strategy="steps", save_steps=3, learning_rate=1e-3, seed=0,
              accelerator_config={"dispatch_batches": False})
    if mode == "ddp":
        args = _args(out_dir, mode, sharded_ddp=False, zero_offload=None, optim="adamw_torch", **kw)
        trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=Shard())
    else:
        trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, mode, **kw), train_dataset=Shard())
    trainer.train()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()],
            "saved": sorted(os.listdir(f"{out_dir}/{mode}"))}


def test_iterable_shards_ending_their_epochs_at_other_steps_train_as_ddp(tmp_path):
    """An outside probe: with each rank's own iterable shard, rank 0's epoch end (no collective in the plain
    Trainer) met the control flags' agreement against rank 1's gradient reduction, and both waited until the
    collective timeout; plain DDP trained on. Now such an epoch end is each rank's own, and the run equals DDP's."""
    ref = run_distributed(_uneven_shards, str(tmp_path), "ddp", timeout=120, collective_timeout=30)
    ours = run_distributed(_uneven_shards, str(tmp_path), "offload", timeout=120, collective_timeout=30)
    for a, b in zip(ours[0]["params"], ours[1]["params"]):
        assert torch_equal(a, b)  # the ranks stay identical
    for a, b in zip(ref[0]["params"], ours[0]["params"]):
        assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ours[0]["saved"] == ["checkpoint-3", "checkpoint-6"], ours[0]["saved"]


def _epoch_end_save_on_rank_1(rank, world_size, out_dir):
    """An IterableDataset read through accelerate's dispatcher (its default: rank 0 reads, every rank gets a part of
    each batch, so every rank ends its epochs at one step); a callback sets should_save at the first epoch end on
    rank 1 only."""
    import torch
    from transformers import TrainerCallback

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer

    data = ToyDataset()

    class Whole(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (data[i] for i in range(8))

    class SaveOnRank1(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            if rank == 1 and state.epoch is not None and state.global_step == 1:
                control.should_save = True

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, "dispatched", max_steps=3),
                                        train_dataset=Whole(), callbacks=[SaveOnRank1()])
    trainer.train()
    return {"step": trainer.state.global_step, "saved": sorted(os.listdir(f"{out_dir}/dispatched"))}


def test_an_epoch_end_flag_of_one_rank_is_agreed_when_the_dispatcher_ends_every_rank_together(tmp_path):
    """The epoch end of a loader without a length is each rank's own only where each rank reads its own shard:
    through accelerate's dispatcher every rank ends its epochs at one step, and a flag set there on one rank is
    agreed as at any other point (taken as each rank's own, rank 1's save waited for rank 0 until the timeout)."""
    got = run_distributed(_epoch_end_save_on_rank_1, str(tmp_path), timeout=120, collective_timeout=30)
    for r in (0, 1):
        assert got[r]["step"] == 3 and "checkpoint-1" in got[r]["saved"], got


def _loader_on_rank_0(rank, world_size, out_dir):
    """Rank 0 alone builds the training dataloader (to print its length) before both ranks train()."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, "loader"), train_dataset=ToyDataset())
    try:
        if rank == 0:
            len(trainer.get_train_dataloader())
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return trainer.state.global_step


def test_a_training_dataloader_built_on_one_rank_outside_train_gathers_nothing(tmp_path):
    """The batch count's comparison ran in every get_train_dataloader(): rank 0's own call, outside train(), met
    rank 1's first gather of train() and both failed (a plain Trainer's call gathers nothing)."""
    assert run_distributed(_loader_on_rank_0, str(tmp_path), timeout=120, collective_timeout=30) == [2, 2]


@pytest.mark.parametrize("kind", ["DistBackendError", "DistNetworkError", "RuntimeError"])
@pytest.mark.parametrize("peer", ["failed", "returned", "silent"])
def test_the_error_naming_a_peer_keeps_the_collective_errors_type(monkeypatch, kind, peer):
    """The named error replaced torch's DistBackendError (a collective timeout) with a plain RuntimeError: a script's
    ``except torch.distributed.DistBackendError`` (a retry or a requeue on a lost peer) no longer caught it, now that
    evaluate(), predict() and saves are named too. Same type, its message the named one, chained to torch's."""
    import torch.distributed as dist

    from hf_zero_offload.dist_store import GroupStore
    from hf_zero_offload.trainer import peer_failure

    monkeypatch.setattr(peer_failure, "_WAIT_S", 0.2)
    store = GroupStore(dist.HashStore())
    if peer == "failed":
        store.set(peer_failure._KEY.format(1, 1), "h\nKeyError: 'boom'")
    elif peer == "returned":
        store.set(peer_failure._LEFT_KEY.format(1), "1\n2\nh")
    error = getattr(dist, kind, RuntimeError)("[gloo] Connection closed by peer [127.0.0.1]:1")
    named = peer_failure.peer_failed(error, store, 1, 0, 2, "evaluate()")
    assert type(named) is type(error), repr(named)
    assert str(named).startswith({"failed": "rank 1 (host h) failed: KeyError: 'boom'",
                                  "returned": "rank 1 (host h) had returned from its train() (at step 2)",
                                  "silent": "rank 1 stopped without an error of its own"}[peer]), named


def _stuck(rank, world_size, out_dir):
    """Rank 1 alive but stuck past the collective timeout (a dataloader or a callback that hangs) at step 1's end."""
    from transformers import TrainerCallback

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer
    from hf_zero_offload.trainer import peer_failure

    # rank 0's look for a failure key rank 1 (silent by design) never writes: 1 s instead of 3 s
    peer_failure._WAIT_S = 1.0
    verdict = os.path.join(out_dir, "rank0-said")

    class Stuck(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 1:  # stuck until rank 0 has said what it says (a fixed 12 s before)
                give_up = time.monotonic() + 30
                while not os.path.exists(verdict) and time.monotonic() < give_up:
                    time.sleep(0.1)

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(out_dir, "stuck"), train_dataset=ToyDataset(),
                                        callbacks=[Stuck()])
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        said = f"{type(e).__name__}: {e}"
    else:
        said = None
    if rank == 0:
        open(verdict, "w").close()
    return said


def test_a_peer_alive_past_the_collective_timeout_is_not_said_to_be_killed(tmp_path):
    """Rank 0's collective timed out while rank 1, alive, had not come to it: rank 0 said rank 1 "stopped without an
    error of its own ... killed (SIGKILL, the out-of-memory killer)", sending its user to look for a dead process."""
    ours = run_distributed(_stuck, str(tmp_path), timeout=120, collective_timeout=5)
    assert ours[0].startswith("RuntimeError: rank 1 did not come within the collective timeout to the collective "
                              "this rank (rank 0) waited in, in train(), and said no error of its own: alive "
                              "elsewhere"), ours
    assert "killed" not in ours[0], ours
