"""Port of transformers' tests/deepspeed/test_deepspeed.py (TestDeepSpeedWithLauncher): its run_translation.py /
run_clm.py launches are tests/_peer_launch.py under torchrun (2 gloo ranks, --sharded_ddp), compared with a one-process
reference run. Every torchrun launch is in the slow tier (``make test-all``)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _procs import run_together
from _peer_ds import DTYPES, HERE, OFFLOADS, slow


# --------------------------------------------------------------------------- launcher tests (torchrun, gloo)
def _launch(nproc, out, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(HERE / "_peer_launch.py"), "--output_dir", str(out), *args]


def _run(*argvs):
    """The launches side by side (--standalone: each binds its own rendezvous port)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for r in run_together(list(argvs), timeout=420, env=env):
        assert r.returncode == 0, r.stdout[-3000:] + "\n" + r.stderr[-6000:]


def _results(out, kind):
    return json.loads((Path(out) / f"{kind}_results.json").read_text())


def check_launch(out, ref, dtype, do_train=True, do_eval=True):
    """The peer's do_checks (the results files are written), and the run against the plain Trainer's: the trained
    weights element by element and the metrics, within the dtype's tolerance (bf16 / fp16 hold weights rounded to
    their 8 / 11 bits, and train on losses computed at that precision)."""
    if do_eval:
        ours, theirs = _results(out, "eval"), _results(ref, "eval")
        assert ours["eval_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs={"fp32": 1e-6}.get(dtype, 0.2))
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel={"fp32": 1e-4}.get(dtype, 5e-2))
    if do_train:
        assert "train_samples_per_second" in _results(out, "train")
        assert _results(out, "train")["train_loss"] == pytest.approx(_results(ref, "train")["train_loss"],
                                                                     rel={"fp32": 1e-5}.get(dtype, 2e-2))
        ours, theirs = load_file(Path(out) / "model.safetensors"), load_file(Path(ref) / "model.safetensors")
        assert ours.keys() == theirs.keys()
        for k in theirs:
            want, got = theirs[k], ours[k].float()
            if dtype == "fp32":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
            else:  # a few units in the dtype's last place, and twice the run's summed LR (2.25e-3): Adam moves a
                # weight by about the LR a step, so a step that went the other way stays inside
                eps = torch.finfo(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])).eps
                torch.testing.assert_close(got, want, rtol=4 * eps, atol=5e-3, msg=lambda m: f"{k}: {m}")


def _launch_and_reference(tmp_path, nproc, dtype, *args):
    out, ref = tmp_path / "out", tmp_path / "ref"
    _run(_launch(nproc, out, "--dtype", dtype, *args), _launch(nproc, ref, "--reference", *args))
    return out, ref


@slow
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_basic_distributed(dtype, offload, tmp_path):
    """Peer test_basic_distributed / test_fp32_distributed: 2 ranks, run_translation with predict_with_generate,
    group_by_length, label smoothing, warm-up 8; ours: --sharded_ddp on 2 gloo ranks."""
    out, ref = _launch_and_reference(tmp_path, 2, dtype, "--offload", offload, "--do_train", "--do_eval")
    check_launch(out, ref, dtype)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp32_non_distributed(dtype, tmp_path):
    out, ref = _launch_and_reference(tmp_path, 1, dtype, "--do_train", "--do_eval")
    check_launch(out, ref, dtype)


@slow
def test_do_eval_no_train(tmp_path):
    """Peer: zero3 only ('zero2 makes no sense with inference'); ours: an eval-only run with zero_offload gives the
    plain Trainer's metrics."""
    out, ref = _launch_and_reference(tmp_path, 1, "fp32", "--do_eval")
    check_launch(out, ref, "fp32", do_train=False)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_train_not_from_ds_checkpoint(dtype, tmp_path):
    """Peer: a second run starting from the first's saved model (not its ZeRO checkpoint): both as the plain
    Trainer's first and second runs."""
    out1, ref1 = _launch_and_reference(tmp_path / "1", 2, dtype, "--do_train")
    check_launch(out1, ref1, dtype, do_eval=False)
    out2, ref2 = tmp_path / "out2", tmp_path / "ref2"
    _run(_launch(2, out2, "--dtype", dtype, "--do_train", "--model_name_or_path", str(out1)),
         _launch(2, ref2, "--reference", "--do_train", "--model_name_or_path", str(ref1)))
    check_launch(out2, ref2, dtype, do_eval=False)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_clm(dtype, tmp_path):
    """Peer test_clm: a tiny GPT-2 with resize_token_embeddings, 2 ranks."""
    out, ref = _launch_and_reference(tmp_path, 2, dtype, "--do_train", "--do_eval", "--task", "clm")
    check_launch(out, ref, dtype)
