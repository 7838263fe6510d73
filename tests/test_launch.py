"""How a run starts: a real 2-process torchrun on CPU, with and without --use_cpu; the start line; fp16 on CPU."""
from __future__ import annotations

import logging
import os
import sys

import pytest

from _procs import run_together
from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _torchrun(out_dir, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(HERE, "_launch_script.py"), str(out_dir), *extra]


def test_torchrun_on_cpu_without_use_cpu_stops_with_one_line(tmp_path):
    # --standalone: each launch binds its own free rendezvous port, so the two run side by side
    bad, good = run_together([_torchrun(tmp_path / "bad"), _torchrun(tmp_path / "good", "--use_cpu")],
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if bad.returncode == 0:  # accelerate 1.3 (the floor) gives the Trainer both gloo ranks: a right run, no stop
        assert "ranks=2 backend=gloo" in bad.stderr, bad.stderr[-3000:]
    else:
        assert "WORLD_SIZE=2 (torchrun) but the Trainer sees 1 process" in bad.stderr
        assert "Add --use_cpu" in bad.stderr
        assert not os.path.exists(tmp_path / "bad" / "checkpoint-2")
    assert good.returncode == 0, good.stderr[-3000:]
    starts = [ln for ln in good.stderr.splitlines() if " ranks=" in ln and "backend=" in ln]
    assert len(starts) == 2 and all(ln.startswith("INFO") for ln in starts)  # one per rank, at INFO
    assert "ranks=2 backend=gloo device=cpu" in starts[0] and "dtype=float32" in starts[0]
    share = max(1, len(os.sched_getaffinity(0)) // 2)  # each rank's step takes its share of the node's CPUs
    assert all(f" step_threads={share} " in ln for ln in starts)


def _args(tmp_path, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, zero_offload=OFFLOAD, **kw)


def test_start_line_is_info_with_ranks_backend_device_and_dtype(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, bf16=True), train_dataset=ToyDataset())
    trainer.train()
    (start,) = [r for r in caplog.records if "ranks=" in r.getMessage() and "backend=" in r.getMessage()]
    assert start.levelno == logging.INFO
    assert "ranks=1 backend=none device=cpu dtype=bfloat16 engine=OffloadAdam" in start.getMessage()
    # on a CPU run the gradient buckets are host memory too (the line gave the arena alone)
    engine = trainer.zero_engine
    from hf_zero_offload.engine_setup import _bytes
    assert f" host_reserved={_bytes(engine.arena.nbytes + engine.plan.device_bytes)} " in start.getMessage()
    # the schedule that runs: a "scheduler" block replaces the Trainer's (the shipped configs' WarmupLR stays flat
    # after its warm-up, which a user of the blog's command saw nowhere)
    assert " lr_schedule=trainer " in start.getMessage()
    caplog.clear()
    args = _args(tmp_path)
    args.zero_offload = "zero2-offload"
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset()).train()
    assert any(" lr_schedule=WarmupLR " in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("native_bf16", [True, False, None], ids=["bf16-cpu", "other-cpu", "unknown"])
@pytest.mark.parametrize("fp16", [True, False])
def test_fp16_on_cpu_names_what_to_use_on_this_cpu(tmp_path, caplog, fp16, native_bf16, monkeypatch):
    """It advised --bf16 on every CPU; where the CPU has no native bf16, the --bf16 warning then said to drop it."""
    from hf_zero_offload import launch_checks

    monkeypatch.setattr(launch_checks, "cpu_has_native_bf16", lambda: native_bf16)
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, fp16=fp16), train_dataset=ToyDataset())
    hits = [r for r in caplog.records if "--fp16 on a CPU-only run" in r.getMessage()]
    assert len(hits) == int(fp16)
    advice = "use --bf16" if native_bf16 else "drop --fp16 to train in fp32"
    assert all(advice in r.getMessage() and r.levelno == logging.WARNING for r in hits)


@pytest.mark.parametrize("explicit, local, omp, cpus, torch_threads, want", [
    (3, "2", "1", 16, 1, 3),         # offload_optimizer.cpu_threads wins
    (None, None, None, 16, 5, 5),    # alone on the node: torch's thread count
    (None, "1", "1", 16, 1, 1),
    (None, "2", "1", 16, 1, 8),      # torchrun, 2 ranks: OMP_NUM_THREADS=1 would leave 14 of 16 CPUs idle
    (None, " 2\n", "1", 16, 1, 8),  # as int() and Accelerate read it (was: as if alone)
    (None, "4", None, 16, 16, 4),    # several ranks started another way: no 4 x 16 threads on 16 CPUs
    (None, "2", "6", 16, 6, 6),      # the user's own OMP_NUM_THREADS is kept
    (None, "32", "1", 16, 1, 1),
    (None, "two", None, 16, 5, 5),   # not a count: as if alone
])
def test_step_threads_share_the_node_between_local_ranks(monkeypatch, explicit, local, omp, cpus, torch_threads,
                                                          want, slurm=None):
    from hf_zero_offload import engine_setup
    for name in ("SLURM_LOCALID", "SLURM_CPUS_PER_TASK", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_NODEID", "SLURM_CPUS_ON_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (slurm or {}).items():
        monkeypatch.setenv(name, value)
    for name, value in (("LOCAL_WORLD_SIZE", local), ("OMP_NUM_THREADS", omp)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(engine_setup.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(engine_setup.torch, "get_num_threads", lambda: torch_threads)
    assert engine_setup.step_threads(explicit) == want


@pytest.mark.parametrize("slurm, omp, want", [
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, None, 8),                            # 4 tasks on 32 CPUs: not 4 x 32
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),8", "SLURM_NODEID": "3"}, None, 4),  # this node (the 4th) runs 8
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),8", "SLURM_NODEID": "1"}, None, 16),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),8", "SLURM_NODEID": "9"}, None, 32),  # no entry for it: as if alone
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "6"}, None, 6),  # the allocation per task
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "64"}, None, 32),  # no more than it may use
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_CPUS_ON_NODE": "128"}, None, 32),  # bound to its own 32 CPUs
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, "3", 3),                            # the user's OMP_NUM_THREADS is kept,
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, "1", 1),                            # 1 too (no torchrun set it here)
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NODEID": "-1"}, None, 32),   # unreadable: as if alone (not node 0)
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3000000000)", "SLURM_NODEID": "7"}, None, 16),  # (was a MemoryError)
    ({"SLURM_STEP_TASKS_PER_NODE": "bad"}, None, 32),                        # unreadable: as if alone
    ({"SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": "4"}, None, 32),  # one task: alone on the node
    ({"SLURM_TASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "8"}, None, 32),   # a batch script's one process
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "0"}, None, 8),
])
def test_step_threads_of_ranks_srun_started(monkeypatch, slurm, omp, want):
    """Ranks started by SLURM's srun (no torchrun: no LOCAL_WORLD_SIZE, no OMP_NUM_THREADS) each ran torch's default
    thread count, every core of the node: 4 tasks on 32 CPUs ran 4 x 32 step threads. A batch script's one process
    keeps every core it has (the job-wide variables are not a step's tasks: a review)."""
    test_step_threads_share_the_node_between_local_ranks(
        monkeypatch, None, None, omp, 32, int(omp) if omp else 32, want, slurm={"SLURM_LOCALID": "0", **slurm})


def test_cpu_threads_key_reaches_the_engine_and_the_start_line(tmp_path, caplog):
    from hf_zero_offload import config
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "cpu_threads": 3}}
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, zero_offload={"zero_optimization": zero})
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())
    trainer.train()
    assert trainer.zero_engine.options.num_threads == 3
    assert trainer.zero_engine.pipeline.num_threads == 3
    (start,) = [r.getMessage() for r in caplog.records if "ranks=" in r.getMessage() and "backend=" in r.getMessage()]
    assert " step_threads=3 " in start
    for bad in (0, 2.5, "many"):
        zero["offload_optimizer"]["cpu_threads"] = bad
        with pytest.raises(config.ConfigError, match="offload_optimizer.cpu_threads.*an integer >= 1"):
            config.resolve({"zero_optimization": zero})
    zero["offload_optimizer"]["cpu_threads"] = "auto"
    assert config.resolve({"zero_optimization": zero}).zero.cpu_threads is None


@pytest.mark.parametrize("native, warned", [(False, True), (True, False), (None, False)])
def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path, caplog, monkeypatch, native, warned):
    """On an AVX2 CPU torch emulates bf16 matmuls (a t5-small step > 20x slower than fp32): one WARNING saying to
    drop --bf16; none where the CPU has AVX512-BF16/AMX or where its flags are unknown."""
    from hf_zero_offload import launch_checks
    monkeypatch.setattr(launch_checks, "cpu_has_native_bf16", lambda: native)
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, bf16=True), train_dataset=ToyDataset())
    hits = [r for r in caplog.records if "without AVX512-BF16 or AMX" in r.getMessage()]
    assert len(hits) == int(warned) and all(r.levelno == logging.WARNING for r in hits)


def test_the_cpu_flags_are_read_from_the_flags_lines(monkeypatch, tmp_path):
    from hf_zero_offload import launch_checks
    real_open = open
    for text, want in [("flags\t\t: fpu avx2 fma\n", False), ("flags\t\t: fpu avx512f avx512_bf16\n", True),
                       ("flags\t\t: fpu amx_bf16 amx_tile\n", True), ("Features\t: fp asimd bf16\n", None)]:
        path = tmp_path / "cpuinfo"
        path.write_text("processor\t: 0\n" + text)
        monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(path if p == "/proc/cpuinfo" else p, *a, **k))
        assert launch_checks.cpu_has_native_bf16() is want, text
        monkeypatch.undo()
