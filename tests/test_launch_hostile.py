"""How a run starts when the launch is wrong or unusual: partial or inconsistent torchrun variables, a process group
the user initialised without them, --sharded_ddp with stage 1 and 2 configs, fp16 on a CPU, and GPU-only ds_config
keys on a CPU run. A bad launch is one error naming the variable before any model work (never a hang); an accepted
one trains as documented."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from _dist import DistributedError, run_distributed
from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.launch_checks import LaunchError, check_launch_env, check_world_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, match", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK and MASTER_ADDR not set"),        # was accelerate's "multinode"
    ({"WORLD_SIZE": "2", "RANK": "1"}, "WORLD_SIZE=2 but MASTER_ADDR not set"),
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 with WORLD_SIZE=2: ranks are 0..1"),       # was a 30-minute rendezvous hang
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 set without WORLD_SIZE"),                   # was "MASTER_ADDR expected"
    ({"RANK": "0"}, "RANK=0 set without WORLD_SIZE"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': not a count"),                       # was an int() traceback
    ({"WORLD_SIZE": "\u00b2"}, "WORLD_SIZE='\u00b2': not a count"),                   # a digit int() refuses: was a traceback
    ({"WORLD_SIZE": "2_0"}, "WORLD_SIZE='2_0': not a count"),                       # int() reads 20
    ({**TORCHRUN, "RANK": "-1"}, "RANK='-1': not a count"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 > WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
])
def test_partial_or_inconsistent_launch_variables_are_refused_by_name(env, match):
    with pytest.raises(LaunchError, match=match):
        check_launch_env(env)


@pytest.mark.parametrize("env", [
    {}, TORCHRUN, {**TORCHRUN, "RANK": "1", "LOCAL_RANK": "1"}, {"WORLD_SIZE": "1"},
    {**TORCHRUN, "LOCAL_WORLD_SIZE": "1"},            # two nodes of one rank each
    {"WORLD_SIZE": "2", "PMI_RANK": "1"},             # an MPI launch: Accelerate reads its own variables
])
def test_consistent_launch_variables_pass(env):
    check_launch_env(env)


@pytest.mark.parametrize("value", ["2", " 2", "2\n", "\uff12"])  # as int() reads them, and as Accelerate does
def test_every_form_of_a_launched_world_size_is_compared_with_the_trainers(monkeypatch, value):
    """check_world_size read WORLD_SIZE with isdigit() and no strip: " 2" counted as one process, so two ranks
    that Accelerate saw as one each trained alone. It now reads it through check_launch_env's parse."""
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(LaunchError, match="WORLD_SIZE=2 \\(torchrun\\) but the Trainer sees 1 process"):
        check_world_size(SimpleNamespace(world_size=1))
    check_world_size(SimpleNamespace(world_size=2))  # no group initialised here: nothing else to compare


def test_a_world_size_that_is_not_a_count_is_refused_by_the_world_size_check_too(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2_0")
    with pytest.raises(LaunchError, match="WORLD_SIZE='2_0': not a count"):
        check_world_size(SimpleNamespace(world_size=1))


def test_the_arguments_check_the_variables_before_setting_up_the_process_group(monkeypatch, tmp_path):
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(LaunchError, match="LOCAL_RANK=0 set without WORLD_SIZE"):
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], sharded_ddp=True)


def test_rank_beyond_world_size_stops_the_example_at_once_instead_of_hanging(tmp_path):
    """Before: rank 2 of 2 waited at the rendezvous for peers that never come (torch's default: 30 minutes)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update({**TORCHRUN, "RANK": "2", "MASTER_PORT": "1"})  # port 1: nothing may get as far as connecting
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "seq2seq", "finetune_trainer.py"), "--model_name_or_path",
         os.path.join(ROOT, "configs", "models", "t5-demo.json"), "--data_dir", str(tmp_path / "none"),
         "--output_dir", str(tmp_path / "out"), "--zero_offload", "zero2-offload", "--use_cpu", "--do_train"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "RANK=2 with WORLD_SIZE=2" in lines[0]
    assert not os.path.exists(tmp_path / "out")


def _user_group_without_variables(rank, world_size, out_dir):
    # The group exists (run_distributed made it); the variables Accelerate reads do not.
    for name in DIST_VARS:
        os.environ.pop(name, None)
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=f"{out_dir}/rank{rank}", use_cpu=True, per_device_train_batch_size=4, max_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, sharded_ddp=True, zero_offload=OFFLOAD)
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())


def test_a_group_initialised_without_torchrun_variables_is_refused_by_its_size(tmp_path):
    """Before: Accelerate saw one process, so each rank built a one-process engine and trained alone (with one
    output_dir, the second rank met the first's run lock: "another run is training in this output_dir")."""
    with pytest.raises(DistributedError) as err:
        run_distributed(_user_group_without_variables, str(tmp_path), timeout=60, collective_timeout=20)
    msg = str(err.value)
    assert msg.count("torch.distributed is initialised with 2 ranks (backend gloo) but the Trainer sees 1") == 2
    assert not any(os.path.exists(tmp_path / f"rank{r}" / "checkpoint-1") for r in (0, 1))


def _stage_1_and_2(rank, world_size, out_dir):
    import hf_zero_offload.trainer as zt
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    zt.logger.addHandler(handler)
    zt.logger.setLevel(logging.INFO)
    result = {}
    for stage in (1, 2):
        model = tiny_t5()
        cfg = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
        args = ZeroOffloadSeq2SeqTrainingArguments(
            output_dir=f"{out_dir}/s{stage}", use_cpu=True, per_device_train_batch_size=4, max_steps=2, seed=0,
            report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3, sharded_ddp=True,
            zero_offload=cfg)
        trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())
        trainer.train()
        result[stage] = {"engine": (type(trainer.zero_engine).__name__, trainer.zero_engine.stage),
                         "params": [p.detach().clone() for p in model.parameters()]}
    result["starts"] = [ln for ln in lines if " ranks=" in ln and " backend=" in ln]
    return result


def test_sharded_ddp_takes_the_stage_from_the_config_and_both_stages_train_alike(tmp_path):
    ranks = run_distributed(_stage_1_and_2, str(tmp_path), timeout=120)
    for r in ranks:
        assert r[1]["engine"] == ("ShardedAdam", 1) and r[2]["engine"] == ("ShardedAdam", 2)
        assert [" stage=1 " in s for s in r["starts"]] == [True, False]
        for a, b in zip(r[1]["params"], r[2]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # partitioning changes where, not what
    for a, b in zip(ranks[0][2]["params"], ranks[1][2]["params"]):
        assert torch.equal(a, b)  # ranks stay identical


def _train_one(tmp_path, name, cfg, **kw):
    model = tiny_t5()
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, per_device_train_batch_size=4, max_steps=2, seed=0,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, zero_offload=cfg, **kw)
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())
    trainer.train()
    return model, trainer


def test_fp16_on_a_cpu_trains_with_loss_scaling(tmp_path):
    model, trainer = _train_one(tmp_path, "fp16", OFFLOAD, fp16=True)
    assert next(model.parameters()).dtype == torch.float16
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.zero_engine.loss_scale > 1  # the engine owns the scaling (no GradScaler on a CPU)


def test_gpu_only_keys_on_a_cpu_run_are_named_and_change_no_number(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    gpu_keys = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": False,
                                      "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                            "nvme_path": "/nonexistent"}}}
    plain, _ = _train_one(tmp_path, "plain", OFFLOAD, bf16=True)
    keyed, _ = _train_one(tmp_path, "keyed", gpu_keys, bf16=True)
    for a, b in zip(plain.parameters(), keyed.parameters()):
        assert torch.equal(a, b)
    messages = [r.getMessage() for r in caplog.records]
    assert any("accepted, no effect here" in m and "overlap_comm" in m and "contiguous_gradients" in m
               and "nvme_path" in m for m in messages)
    assert sum(" pinned=False " in m for m in messages if " ranks=" in m) == 2  # nothing to pin for on a CPU
    gpu_keys["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    with pytest.raises(ValueError, match="NVMe offload .*not implemented"):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=ZeroOffloadSeq2SeqTrainingArguments(
            output_dir=str(tmp_path / "nvme"), use_cpu=True, report_to=[], zero_offload=gpu_keys))


@pytest.mark.parametrize("world, local, refused", [("4", "2", True), ("2", "1", True), ("2", "2", False),
                                                   (None, None, False)])
def test_save_on_each_node_is_refused_on_several_nodes(monkeypatch, world, local, refused):
    """Each node's copy of a checkpoint held only its own ranks' optimizer shards (node 1's no meta.json and no
    weights), was marked complete all the same, and every resume from it failed ("Can't find a valid
    checkpoint"); consolidate blamed an interrupted save. On one node the flag changes nothing and is accepted."""
    from hf_zero_offload.config import ConfigError
    from hf_zero_offload.launch_checks import check_arguments

    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    args = SimpleNamespace(max_grad_norm=1.0, optim="adamw_torch", save_on_each_node=True)
    if refused:
        nodes = int(world) // int(local)
        with pytest.raises(ConfigError, match=rf"--save_on_each_node on {nodes} nodes: a checkpoint is one directory "
                                              r"holding every rank's optimizer shard.*a file system all nodes share"):
            check_arguments(args)
    else:
        check_arguments(args)


def _uneven_batches(rank, world_size, out_dir):
    out = {}
    for n in (30, 32):  # 30 samples do not fill batches of 4 on 2 ranks; 32 do
        args = ZeroOffloadSeq2SeqTrainingArguments(
            output_dir=f"{out_dir}/n{n}", use_cpu=True, per_device_train_batch_size=4, max_steps=1, report_to=[],
            save_strategy="no", disable_tqdm=True, zero_offload=OFFLOAD, accelerator_config={"even_batches": False})
        try:
            ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset(n))
            out[n] = "built"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[n] = f"{type(e).__name__}: {e}"
    return out


def test_uneven_batches_on_several_ranks_are_refused_before_they_hang(tmp_path):
    # an outside probe: 62 samples on 3 ranks with even_batches false ran 6/5/5 batches and hung after the last
    # common step (the plain Trainer's DDP too)
    for r in run_distributed(_uneven_batches, str(tmp_path), timeout=120):
        assert r[32] == "built"
        assert r[30].startswith("ConfigError: accelerator_config even_batches=False on 2 ranks with 30 training samples "
                                "(6 over a multiple of 8)") and "keep even_batches" in r[30], r[30]
