"""--sharded_ddp through the Trainer on 2 gloo processes: saves (node-local output dirs, a save failing or asked
on one rank only) stop or agree on every rank."""
from __future__ import annotations

import pytest

from _dist import run_distributed


def _node_local(rank, world_size, out_dir, phase):
    """Each rank its own output_dir, as two nodes with node-local disks: ``save`` saves at step 2; ``resume`` resumes
    `true` from folders prepared to hold different checkpoints (rank 0's at step 4, rank 1's at step 2)."""
    import os

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    out = f"{out_dir}/{phase}/node{rank}" if phase in ("save", "resume", "each", "in_the_way") else f"{out_dir}/{phase}"
    if (phase, rank) == ("in_the_way", 1):  # a file named like a checkpoint in this node's output_dir only
        os.makedirs(out, exist_ok=True)
        open(f"{out}/checkpoint-2", "w").close()
    if phase == "each":  # a launcher whose LOCAL_WORLD_SIZE hides the nodes (set by hand in a SLURM script)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        save_only_model=phase == "only_model", save_on_each_node=phase == "each",
        output_dir=out, per_device_train_batch_size=4, max_steps=6 if phase == "resume" else 4, use_cpu=True,
        ddp_backend="gloo", report_to=[], save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True,
        sharded_ddp=True, zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=ToyDataset())
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # one rank's disk fills up during its part of the save: its RNG state, rank 0's weights (before the engine's
    # collectives), rank 1's optimizer shard (between them), rank 0's completion marker (after the last)
    if (phase, rank) == ("full", 1):
        trainer._save_rng_state = no_space
    elif (phase, rank) == ("full-weights", 0):
        trainer._save = no_space
    elif (phase, rank) == ("full-shard", 1):
        import hf_zero_offload.engine.checkpoint as ckpt
        ckpt.write_state = no_space
    elif (phase, rank) == ("full-folder", 0):  # rank 0 clears the folder before the engine's first collective
        import hf_zero_offload.engine.checkpoint.folder as sd
        sd._clear_previous = no_space
    elif (phase, rank) == ("full-marker", 0):
        import hf_zero_offload.resume as res
        res.write_marker = no_space
    try:
        trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}", "marked": os.path.exists(f"{out}/checkpoint-2/hzo_complete.json")}
    return {"error": None}


def test_node_local_output_dirs_are_refused_at_the_first_save_and_at_a_resume(tmp_path):
    """An outside probe (2 nodes, each its own output_dir): each save marked complete a checkpoint holding rank 0's
    shard alone; resumed, the ranks took different checkpoints (steps 4 and 2) and trained on in lockstep."""
    for r in run_distributed(_node_local, str(tmp_path), "save", timeout=300):
        assert r["error"] and "lacks rank1_of_2.hzo" in r["error"] and "shared file system" in r["error"], r
        assert not r["marked"] and "save_on_each_node" not in r["error"]
    # the node count hidden from the launch check (SLURM without torchrun): the save names the flag
    for r in run_distributed(_node_local, str(tmp_path), "each", timeout=300):
        assert r["error"] and "--save_on_each_node makes each node save a copy of its own" in r["error"], r
        assert not r["marked"]
    run_distributed(_node_local, str(tmp_path), "shared", timeout=300)  # checkpoints 2 and 4, then spread:
    import shutil
    for rank, keep in ((0, 4), (1, 2)):
        shutil.copytree(tmp_path / "shared" / f"checkpoint-{keep}", tmp_path / "resume" / f"node{rank}" /
                        f"checkpoint-{keep}")
    for r in run_distributed(_node_local, str(tmp_path), "resume", timeout=300):
        assert r["error"] and "the ranks chose different checkpoints" in r["error"], r
        assert "checkpoint-4 (step 4)" in r["error"] and "checkpoint-2 (step 2)" in r["error"]


def test_a_save_only_model_over_a_leftover_state_folder_is_not_taken_for_node_local_dirs(tmp_path):
    """A review: with --save_only_model the check read a zero_offload/ left by an earlier save of checkpoint-2 (of
    another world size), which this save removes, and stopped a valid run."""
    import os
    os.makedirs(tmp_path / "only_model" / "checkpoint-2" / "zero_offload")
    (tmp_path / "only_model" / "checkpoint-2" / "zero_offload" / "rank0_of_1.hzo").write_bytes(b"old")
    for r in run_distributed(_node_local, str(tmp_path), "only_model", timeout=300):
        assert r["error"] is None, r


@pytest.mark.parametrize("phase, failing", [("full", 1), ("full-weights", 0), ("full-shard", 1), ("full-folder", 0),
                                            ("full-marker", 0)])
def test_a_save_failing_on_one_rank_stops_every_rank(tmp_path, phase, failing):
    """Reviews: a rank whose part of the save failed raised, while the others waited in the next collective (the
    barrier after the save, the engine's own within it) until the timeout (30 minutes by default), and the cause was
    replaced by gloo's timeout on both; rank 0 failing to clear the folder left rank 1 in the engine's first barrier
    (an outside probe)."""
    import time
    start = time.monotonic()
    ours = run_distributed(_node_local, str(tmp_path), phase, timeout=120)
    assert time.monotonic() - start < 60
    assert "No space left on device" in ours[failing]["error"] and not ours[failing]["marked"], ours
    other = ours[1 - failing]["error"]
    if phase in ("full-shard", "full-folder"):  # told by the engine's own agreement, within its save: which rank
        what = "write their optimizer state" if phase == "full-shard" else "make the folder ready"
        assert other and f"rank(s) {failing} could not {what}" in other, ours
    else:
        assert other and f"rank {failing}" in other and "No space left on device" in other, ours


def test_a_problem_one_node_sees_in_its_output_dir_stops_every_rank(tmp_path):
    """A review: the check for a file in the way of a checkpoint folder ran on each rank and raised on the one that
    saw it, before the run lock's broadcast, where the other rank then waited until the collective timeout."""
    ours = run_distributed(_node_local, str(tmp_path), "in_the_way", timeout=120)
    assert "is a file, not a directory" in ours[1]["error"], ours
    assert "rank 1 (host" in ours[0]["error"] and "is a file, not a directory" in ours[0]["error"], ours


def _one_sided_save(rank, world_size, out_dir, how):
    """A save asked on rank 0 alone: by a callback (``callback``), by other --save_steps (``save_steps``), by a
    callback in a run without the engine, whose control flags are not agreed (``no_engine``), or by
    --save_strategy best on a metric that differs between the ranks (``best``: transformers sets should_save from
    it after the last agreement of the flags)."""
    from transformers import TrainerCallback

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    class SaveHere(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = control.should_save or (rank == 0 and state.global_step == 1)

    class LocalMetric(TrainerCallback):  # a rank's own figure: a new best at step 2 on rank 0 only
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_local"] = float([0, 5][rank] if state.global_step == 1 else [1, 4][rank])

    save_steps = 3 if how == "save_steps" and rank == 1 else 2 if how == "save_steps" else 100
    kw = dict(output_dir=f"{out_dir}/{how}", per_device_train_batch_size=4, max_steps=4, use_cpu=True,
              ddp_backend="gloo", report_to=[], save_strategy="steps", save_steps=save_steps, seed=0,
              disable_tqdm=True)
    if how == "no_engine":  # the mixin's Trainer as a plain DDP one: its save still agrees on its outcome (gathers)
        kw.update(optim="adamw_torch")
    else:
        kw.update(sharded_ddp=True, zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu"}}})
    if how == "best":
        kw.update(save_strategy="best", eval_strategy="steps", eval_steps=1, metric_for_best_model="local",
                  greater_is_better=True)
    callbacks = {"save_steps": [], "best": [LocalMetric()]}.get(how, [SaveHere()])
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=ZeroOffloadSeq2SeqTrainingArguments(**kw),
                                        train_dataset=ToyDataset(), eval_dataset=ToyDataset(8), callbacks=callbacks)
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - the peer's connection closed under it, in gloo's words
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


@pytest.mark.parametrize("how", ["callback", "save_steps", "no_engine", "best"])
def test_a_save_asked_on_one_rank_only_stops_at_once_naming_it(tmp_path, how):
    """An outside probe: a callback setting control.should_save on rank 0 alone (or ranks given other --save_steps)
    left rank 0 in the save's first collective and rank 1 in the next step's until the 30-minute timeout, where a
    plain DDP run fails at once. Where the control flags are not agreed (no engine) or should_save is set after
    their agreement (--save_strategy best), the save's own agreement (saving.py) says so; without it both ranks
    waited in gloo until the collective timeout."""
    import time
    start = time.monotonic()
    # best: rank 0 hears that rank 1 went on only once rank 1's next collective has timed out (its progress key says
    # so then), so that case waits the collective timeout out in full: 6 s there (15 s took 15.8 s of the suite)
    ours = run_distributed(_one_sided_save, str(tmp_path), how, timeout=120,
                           collective_timeout=6 if how == "best" else 15)
    assert time.monotonic() - start < 60
    if how == "save_steps":  # told at train()'s start since (same_run.py), on both ranks
        for r in ours:
            assert "were started for different runs: save_steps: 2 on rank 0, 3 on rank 1" in r["error"], ours
        return
    if how == "callback":  # every rank takes the flag since (agreed_control.py; tests/test_trainer_dist_control.py)
        assert ours == [{"error": None}] * 2, ours
        assert (tmp_path / "callback" / "checkpoint-1" / "zero_offload").is_dir()
        return
    step = 2 if how == "best" else 1
    assert f"RuntimeError: rank(s) 1 went on without saving {tmp_path}/{how}/checkpoint-{step}, which this rank " \
           "saves: every rank must save a checkpoint together" in ours[0]["error"], ours
    assert ours[1]["error"], ours  # its peer gone: gloo's error, not a hang
    assert not (tmp_path / how / f"checkpoint-{step}").exists()
