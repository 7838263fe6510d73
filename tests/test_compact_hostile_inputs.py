"""Hostile inputs to the compact host optimizer states (``offload_optimizer.state_dtype`` / ``cpu_threads``):
config values a user might plausibly write, checkpoints that pass their checksums but were not written by
us, a world-size and dtype change together, ``consolidate`` of an int8 checkpoint and the estimate CLI.

Each refusal must name the key path (config) or the file and key (checkpoint), and leave the optimizer as
it was: compared element by element, and a step must still run after it.
"""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload import config, ops
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam
from hf_zero_offload.engine.checkpoint import folder

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)
SCALED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
OFF = "zero_optimization.offload_optimizer"
VALUES = "'fp32', 'bf16', 'int8'"


def resolve(offload: dict, stage=2, **zero):
    return config.resolve({"zero_optimization": {"stage": stage, "offload_optimizer": offload, **zero}})


def refused(raw: dict) -> str:
    with pytest.raises(config.ConfigError) as e:
        config.resolve(raw)
    return str(e.value)


def engine(model, state_dtype):
    return OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype))


def train(model, opt, data):
    for ids, labels, use_branch in data:
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["INT8", " int8", "fp16", "float32", "8bit", 8, None, True, ["int8"], "auto", ""])
def test_state_dtype_near_misses_are_refused_naming_key_and_values(value):
    msg = refused({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "state_dtype": value}}})
    assert f"<dict>: {OFF}.state_dtype: " in msg and VALUES in msg, msg  # "auto" named no values before


@pytest.mark.parametrize("value", [0, -1, 2.5, "2", True, "auto ", "AUTO", None, [2], 2**31, 1e300])
def test_cpu_threads_bad_values_are_refused_naming_key_and_values(value):
    # 2**31 and 1e300 were accepted and failed at the first step (the kernels take < 2**31 threads)
    msg = refused({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "cpu_threads": value}}})
    assert f"<dict>: {OFF}.cpu_threads: expected an integer >= 1 (and below 2**31) or \"auto\"" in msg, msg


@pytest.mark.parametrize("value,want", [(1, 1), (2.0, 2), (10**9, 10**9), (2**31 - 1, 2**31 - 1), ("auto", None)])
def test_cpu_threads_accepted_values(value, want):
    assert resolve({"device": "cpu", "cpu_threads": value}).zero.cpu_threads == want


@pytest.mark.parametrize("param", [{"state_dtype": "int8"}, {"device": "none", "state_dtype": "bf16"},
                                   {"device": None, "cpu_threads": 4}])
def test_our_keys_under_offload_param_are_refused_not_ignored(param):
    # offload_param switched off used to be dropped whole: int8 asked for, fp32 moments run
    key = next(k for k in param if k != "device")
    msg = refused({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": param}})
    assert f"<dict>: zero_optimization.offload_param.{key}: belongs under {OFF}" in msg, msg


@pytest.mark.parametrize("where", ["zero", "top"])
def test_state_dtype_at_the_wrong_level_is_an_unknown_key(where):
    raw = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    (raw["zero_optimization"] if where == "zero" else raw)["state_dtype"] = "int8"
    path = "zero_optimization.state_dtype" if where == "zero" else "state_dtype"
    assert f"<dict>: {path}: unknown key" in refused(raw)


@pytest.mark.parametrize("zero,path", [
    ({"stage": 2, "offload_optimizer": {"device": "none", "state_dtype": "int8"}}, f"{OFF}.state_dtype"),
    ({"stage": 2, "cpu_offload": False, "offload_optimizer": {"state_dtype": "bf16"}}, f"{OFF}.state_dtype"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu", "state_dtype": "int8"}}, "zero_optimization.stage"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "state_dtype": "int8"}}, "zero_optimization.stage"),
])
def test_state_dtype_without_a_cpu_step_is_refused(zero, path):
    assert f"<dict>: {path}: " in refused({"zero_optimization": zero})


def test_documented_accepted_forms():
    assert resolve({"device": "none", "state_dtype": "fp32"}).zero.state_dtype == "fp32"  # the default, spelled out
    legacy = config.resolve({"zero_optimization": {"stage": 1, "cpu_offload": True,
                                                   "offload_optimizer": {"state_dtype": "int8"}}}).zero
    assert (legacy.state_dtype, legacy.offload, legacy.stage) == ("int8", True, 1)


def test_offload_options_refuse_thread_counts_the_kernels_do_not_take():
    with pytest.raises(ValueError, match=r"OffloadOptions.num_threads must be an int in \[1, 2\*\*31\)"):
        OffloadOptions(num_threads=2**31)


# -- checkpoints that pass their checksums but are not ours ----------------------------------------
def _foreign(case: str, meta: dict, tensors: dict) -> tuple[dict, dict, str]:
    """(meta, tensors, the key the error must name) of a checksum-valid file we did not write."""
    t = {k: v.clone() for k, v in tensors.items()}
    if case == "negative_scale":
        t["exp_avg_sq_scale"][-1] = -1.0  # the last block: the one a streamed load writes last
        return meta, t, "exp_avg_sq_scale"
    if case == "wrong_dtype":
        t["exp_avg"] = t["exp_avg"].float()
        return meta, t, "exp_avg"
    if case == "short_scales":
        t["exp_avg_sq_scale"] = t["exp_avg_sq_scale"][:-1]
        return meta, t, "exp_avg_sq_scale"
    # int8 tensors under a header that says fp32
    return {k: v for k, v in meta.items() if k != "int8_codes"} | {"state_dtype": "fp32"}, t, "exp_avg"


@pytest.mark.parametrize("own", ["int8", "fp32"])
@pytest.mark.parametrize("case", ["negative_scale", "wrong_dtype", "short_scales", "mislabeled"])
def test_a_foreign_checkpoint_is_refused_by_file_and_key_before_any_write(tmp_path, case, own):
    """Before: every case was refused only after the master (and, into int8, all moments) had been
    overwritten, leaving an optimizer that refuses to step; negative scales into fp32/bf16 loaded silently
    (decoded to a negative exp_avg_sq)."""
    torch.manual_seed(0)
    model = TinyNet()
    saver = engine(model, "int8")
    train(model, saver, batches(2))
    meta, tensors, key = _foreign(case, saver.state_meta(), saver.state_tensors())
    folder.save(str(tmp_path), 0, 1, meta, tensors, barrier=None, partition=None)
    target_model = copy.deepcopy(model)
    target = engine(target_model, own)
    train(target_model, target, batches(3, seed=1))
    before = {k: v.clone() for k, v in target.state_tensors().items()}
    params = [p.detach().clone() for p in target_model.parameters()]
    steps = (target.global_steps, target._param_steps.clone())
    path = os.path.join(str(tmp_path), "rank0_of_1.hzo")
    with pytest.raises(ValueError, match=re.escape(f"{path}: {key} ")):
        target.load_checkpoint(str(tmp_path))
    for k, v in target.state_tensors().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p, q) for p, q in zip(target_model.parameters(), params))
    assert target.global_steps == steps[0] and torch.equal(target._param_steps, steps[1])
    train(target_model, target, batches(1, seed=2))  # still a working optimizer (no half-loaded state)
    for o in (saver, target):
        o.close()


@pytest.mark.parametrize("own", ["int8", "fp32"])
@pytest.mark.parametrize("key,code", [("exp_avg", -128), ("exp_avg", 121), ("exp_avg_sq", 249)])
def test_a_checkpoint_with_codes_the_kernel_never_writes_is_refused(tmp_path, own, key, code):
    """A checksum-valid int8 file whose codes lie outside what the kernel writes (|exp_avg| <= 120,
    exp_avg_sq <= 248: a larger code decodes above its block's absmax, up to 2x) loaded silently. The codes
    stream into the state, so the refusal comes after the load began: step and save then refuse too."""
    torch.manual_seed(0)
    model = TinyNet()
    saver = engine(model, "int8")
    train(model, saver, batches(2))
    tensors = {k: v.clone() for k, v in saver.state_tensors().items()}
    codes = tensors[key]
    codes[codes.numel() // 2] = code
    folder.save(str(tmp_path), 0, 1, saver.state_meta(), tensors, barrier=None, partition=None)
    target = engine(copy.deepcopy(model), own)
    path = re.escape(os.path.join(str(tmp_path), "rank0_of_1.hzo"))  # the file, not only the directory
    with pytest.raises(ValueError, match=rf"{path}: {key} codes has code {code}, outside"):
        target.load_checkpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="failed part way"):
        target.step()
    for o in (saver, target):
        o.close()


# -- int8 on 2 ranks -> 1 rank in fp32 and back, and consolidate ------------------------------------
def _int8_job(rank, world, ckpt):
    torch.manual_seed(0)
    model = TinyNet()
    opt = ShardedAdam(param_groups(model, WD), lr=LR, stage=2, options=OffloadOptions(**SMALL, state_dtype="int8"))
    train(model, opt, batches(4))
    opt.save_checkpoint(os.path.join(ckpt, "zero_offload"))
    out = {k: v.clone() for k, v in opt.state_tensors().items()}
    if rank == 0:  # the checkpoint's model file: values do not matter (consolidate replaces them); as
        # save_pretrained writes it, without the tied duplicate (head.weight is embed.weight)
        save_file({k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "head.weight"},
                  os.path.join(ckpt, "model.safetensors"))
    opt.close()
    return out


def test_int8_two_ranks_load_into_one_fp32_and_back_and_consolidate(tmp_path):
    ckpt = str(tmp_path / "checkpoint-4")
    r0, r1 = run_distributed(_int8_job, ckpt)
    saved = {k: torch.cat([r0[k], r1[k]]) for k in r0}  # int8 shards start on blocks: the one-process state
    m, v = ops.state_to_fp32({k: saved[k] for k in SCALED})
    torch.manual_seed(0)
    model = TinyNet()
    fp32 = engine(model, "fp32")
    fp32.load_checkpoint(os.path.join(ckpt, "zero_offload"))
    got = fp32.state_tensors()
    assert torch.equal(got["master"], saved["master"])
    assert torch.equal(got["exp_avg"], m) and torch.equal(got["exp_avg_sq"], v)
    # and back: fp32 -> int8 is the one-off encoding of the decoded moments
    fp32.save_checkpoint(str(tmp_path / "fp32"))
    int8 = engine(copy.deepcopy(model), "int8")
    int8.load_checkpoint(str(tmp_path / "fp32"))
    want = ops.state_from_fp32(m, v, "int8")
    for k, t in int8.state_tensors().items():
        assert torch.equal(t, saved["master"] if k == "master" else want[k]), k
    # consolidate: the fp32 masters of the int8 checkpoint, element by element, under every alias
    from hf_zero_offload.consolidate import consolidate
    from hf_zero_offload.saved_names import write_param_names
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    slots = [(names[id(p)], off, n) for g in fp32._slots for p, off, n in g]
    write_param_names(os.path.join(ckpt, "zero_offload"), [s[0] for s in slots])
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump({"torch_dtype": "bfloat16"}, f)
    consolidate(ckpt, str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(out) == set(model.state_dict()) - {"head.weight"}
    for aliases, off, n in slots:
        name = next(a for a in aliases if a in out)
        assert out[name].dtype == torch.float32 and torch.equal(out[name].reshape(-1), saved["master"][off:off + n])
    for o in (fp32, int8):
        o.close()


# -- ops.adam_step on a part of an int8 state --------------------------------------------------------
BAD_PARTS = {  # (codes [a, b), scales [sa, sb)): the right number of scales, of other blocks
    "inside a block": ((100, 612), (0, 2), "starts at element 100 of its state array but {}_scale at block 0"),
    "another block": ((256, 768), (0, 2), "starts at element 256 of its state array but {}_scale at block 0"),
    "later scales": ((0, 512), (1, 3), "starts at element 0 of its state array but {}_scale at block 1"),
}


def test_adam_step_refuses_int8_codes_with_the_scales_of_other_blocks():
    """codes[100:612] with the scales of blocks 0-1 stepped each element with another block's absmax (exp_avg off
    by up to 2.4x its largest value), where ``state_slice`` refused the same range. Refused now, nothing written;
    what the check cannot locate is not refused: block-aligned parts, and a state carved out of one buffer at
    offsets unrelated to its blocks (the engine's arena), step exactly as the whole state does."""
    torch.manual_seed(0)
    st, p = ops.make_state(1024, "int8"), torch.randn(1024)
    g = torch.randn(1024) * torch.logspace(-3, 1, 1024)  # blocks of different absmax: a wrong scale matters
    for s in (1, 2):
        ops.adam_step(p, g, step=s, lr=1e-2, **st)
    before, p0 = {k: v.clone() for k, v in st.items()}, p.clone()
    for case, ((a, b), (sa, sb), says) in BAD_PARTS.items():
        for moment in ("exp_avg", "exp_avg_sq"):  # each pair on its own, the other one aligned
            part = {**ops.state_slice(st, 0, b - a), moment: st[moment][a:b],
                    f"{moment}_scale": st[f"{moment}_scale"][sa:sb]}
            with pytest.raises(ValueError, match=re.escape(f"{moment} {says.format(moment)}") + ".*state_slice"):
                ops.adam_step(p[a:b], g[a:b], step=3, lr=1e-2, **part)
    for k, v in st.items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(p, p0)
    whole, whole_p = {k: v.clone() for k, v in st.items()}, p.clone()
    ops.adam_step(whole_p, g, step=3, lr=1e-2, **whole)
    buf = torch.zeros(8192, dtype=torch.uint8)  # codes at bytes 100 and 1124, scales at 4000 and 4016
    carved = {"exp_avg": buf[100:1124].view(torch.int8), "exp_avg_sq": buf[1124:2148],
              "exp_avg_scale": buf[4000:4016].view(torch.float32), "exp_avg_sq_scale": buf[4016:4032].view(torch.float32)}
    for k, v in carved.items():
        v.copy_(st[k])
    carved_p = p.clone()
    ops.adam_step(carved_p, g, step=3, lr=1e-2, **carved)
    for a, b in ((0, 256), (256, 1024)):
        ops.adam_step(p[a:b], g[a:b], step=3, lr=1e-2, round_index=a, **ops.state_slice(st, a, b))
    for got, got_p in ((st, p), (carved, carved_p)):
        assert torch.equal(got_p, whole_p)
        for k, v in whole.items():
            assert torch.equal(got[k], v), k


# -- the estimate CLI ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["INT8", "int4", "", "float32"])
def test_estimate_state_dtype_bad_values_name_the_choices(value, capsys):
    from hf_zero_offload import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", "--model", "configs/models/t5-tiny.json", "--state-dtype", value])
    assert e.value.code == 2
    assert f"--state-dtype: invalid choice: '{value}' (choose from {VALUES})" in capsys.readouterr().err
