"""Compact Adam moments (``OffloadOptions.state_dtype`` fp32 / bf16 / int8) in both engines.

The reference is ``_flat_ref.FlatReference`` (plain torch, the numbers from ``_quant_ref``): params,
masters, codes and scales are compared element by element (``torch.equal``), on the plain CPU path
and on both stream-simulator adversaries. Sharded runs get the same data on both ranks, so the
averaged gradient is the one-process gradient bit for bit and the two engines must agree exactly.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from _dist import run_distributed
from _flat_ref import FlatReference
from _models import TinyNet, batches, delayed_update_reference, loss_fn, param_groups
from hf_zero_offload import ops
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)  # several buckets; tiles end on 256-element blocks
DTYPES = ["fp32", "bf16", "int8"]
SCALED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def engine(mode, model, state_dtype, **opts):
    return OffloadAdam(param_groups(model, WD), lr=LR, streams=None if mode is None else mode.streams(),
                       options=OffloadOptions(**{**SMALL, **opts, "state_dtype": state_dtype}))


def assert_state_equal(opt, want: dict):
    got = opt.state_tensors()
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def train(model, opt, data, gas=1):
    for ids, labels, use_branch in data:
        for i in range(gas):
            (loss_fn(model, ids[i::gas], labels[i::gas], use_branch) / gas).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_engine_equals_the_flat_reference(mode, state_dtype):
    torch.manual_seed(0)
    ref_model = mode.model(TinyNet())
    model = copy.deepcopy(ref_model)
    ref = FlatReference(param_groups(ref_model, WD), lr=LR, state_dtype=state_dtype)
    opt = engine(mode, model, state_dtype)
    data = mode.data(batches(8))
    train(ref_model, ref, data)
    train(model, opt, data)  # some steps skip the branch: runs end and start inside int8 blocks
    mode.sync()
    assert_state_equal(opt, ref.flat_state())
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_gradient_accumulation_and_clipping(state_dtype):
    # GAS: the engine sums the micro-batches in fp32 in the same order as .grad; clipping: the
    # reference applies clip_grad_norm_'s coefficient of the engine's norm as the kernel's grad_scale
    # (its own fp64 norm, summed in another order, may differ in the last bit, and that bit may move
    # a code by one step, the param by a few % of lr: not what this test is about)
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = FlatReference(param_groups(ref_model, WD), lr=LR, state_dtype=state_dtype)
    opt = engine(None, model, state_dtype, gradient_accumulation_steps=2, max_grad_norm=0.05)
    for ids, labels, use_branch in batches(6):
        for m in (ref_model, model):
            for i in range(2):
                (loss_fn(m, ids[i::2], labels[i::2], use_branch) / 2).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        assert opt.last.grad_norm > 0.05  # clipping was active
        assert opt.last.grad_norm == pytest.approx(norm.item(), rel=1e-6)
        ref.step(grad_scale=min(0.05 / (opt.last.grad_norm + 1e-6), 1.0))
        ref.zero_grad()
    got = opt.state_tensors()
    torch.testing.assert_close(got["master"], ref.master, rtol=1e-5, atol=1e-6)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got[k], ref.moments[k]), k
    opt.close()


def test_dpu_follows_the_delayed_schedule_with_int8(mode):
    torch.manual_seed(0)
    device_model = mode.model(TinyNet())
    model = copy.deepcopy(device_model)
    data = mode.data(batches(8))
    ref_dev, ref_master = delayed_update_reference(
        device_model, data, 3, lr=LR, weight_decay=WD,
        make_opt=lambda groups: FlatReference(groups, lr=LR, state_dtype="int8"))
    opt = engine(mode, model, "int8", dpu=True, dpu_warmup_steps=3)
    train(model, opt, data)
    mode.sync()
    for a, b in zip(ref_dev.parameters(), model.parameters()):
        assert torch.equal(a, b)  # one step behind, like the reference's device model
    opt.flush()
    mode.sync()
    for a, b in zip(ref_master.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_fp16_overflow_leaves_int8_moments_untouched():
    torch.manual_seed(0)
    model = TinyNet()
    opt = engine(None, model, "int8", fp16=dict(enabled=True, loss_scale=0, initial_scale_power=8,
                                                   loss_scale_window=1000, hysteresis=1, min_loss_scale=1))
    model.half()
    for k, (ids, labels, use_branch) in enumerate(batches(4)):
        loss = opt.scale_loss(loss_fn(model, ids, labels, use_branch).float())
        before = {n: t.clone() for n, t in opt.state_tensors().items()}
        (loss * float("inf") if k == 2 else loss).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last.skipped == (k == 2)
        same = all(torch.equal(t, before[n]) for n, t in opt.state_tensors().items())
        assert same == (k == 2)
    assert opt.loss_scale == 128
    opt.close()


@pytest.mark.parametrize("saved,loaded", [("int8", "int8"), ("fp32", "int8"), ("int8", "bf16"), ("bf16", "fp32")])
def test_resume_and_cross_dtype_load(saved, loaded, tmp_path, caplog):
    data = batches(8)
    torch.manual_seed(0)
    init = TinyNet()
    full = copy.deepcopy(init)
    o_full = engine(None, full, loaded)
    first = copy.deepcopy(init)
    o_first = engine(None, first, saved)
    train(first, o_first, data[:4])
    o_first.save_checkpoint(str(tmp_path))
    # the reference: the saved state converted once, then ``loaded`` steps
    converted = o_first.state_dict()
    o_full.load_state_dict(converted)
    full.load_state_dict(first.state_dict())
    second = copy.deepcopy(first)
    o_second = engine(None, second, loaded)
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        o_second.load_checkpoint(str(tmp_path))
    conversions = [r for r in caplog.records if "converted to state_dtype" in r.getMessage()]
    assert len(conversions) == (saved != loaded)
    assert_state_equal(o_second, o_full.state_tensors())
    train(full, o_full, data[4:])
    train(second, o_second, data[4:])
    assert_state_equal(o_second, o_full.state_tensors())
    if saved == loaded:  # resume is bit-exact: 4 + save/load + 4 == 8 uninterrupted steps
        torch.manual_seed(0)
        straight = copy.deepcopy(init)
        o_straight = engine(None, straight, saved)
        train(straight, o_straight, data)
        assert_state_equal(o_second, o_straight.state_tensors())
        o_straight.close()
    for o in (o_full, o_first, o_second):
        o.close()


def test_int8_state_of_code_map_1_converts_on_load(caplog):
    """An int8 state saved before the code map had a version (``int8_codes`` absent: map 1) is
    decoded with map 1 and re-encoded, with one log line; then training goes on from it. An unknown
    map is refused with the place named."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = engine(None, model, "int8")
    train(model, opt, batches(3))
    sd = opt.state_dict()
    assert sd["int8_codes"] == ops.INT8_CODES
    old = {k: v for k, v in sd.items() if k != "int8_codes"}
    n = opt.hi - opt.lo
    want = ops.state_from_fp32(*ops.state_to_fp32({k: sd[k] for k in SCALED}, 1), "int8")
    copied = copy.deepcopy(model)
    other = engine(None, copied, "int8")
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        other.load_state_dict(old)
    assert any("saved as int8 (code map 1) converted" in r.getMessage() for r in caplog.records)
    got = other.state_tensors()
    assert torch.equal(got["master"], sd["master"][:n])
    for k in SCALED:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(got["exp_avg"], sd["exp_avg"])  # map 1's values, map 2's codes
    train(copied, other, batches(1))
    before = {k: t.clone() for k, t in other.state_tensors().items()}
    steps = other.global_steps
    for bad in (3, "2", None):  # refused before anything is loaded
        with pytest.raises(ValueError, match=f"state dict: int8 moments with code map {bad!r}"):
            other.load_state_dict({**sd, "int8_codes": bad})
    assert other.global_steps == steps
    assert all(torch.equal(t, before[k]) for k, t in other.state_tensors().items())
    for o in (opt, other):
        o.close()


def test_unknown_state_dtype_and_device_adam_are_refused():
    with pytest.raises(ValueError, match="state_dtype"):
        engine(None, TinyNet(), "int4")
    with pytest.raises(ValueError, match="state_dtype='int8'.*offload"):
        ShardedAdam(param_groups(TinyNet(), WD), lr=LR, offload=False,
                    options=OffloadOptions(**SMALL, state_dtype="int8"))


def test_host_bytes_per_param():
    from hf_zero_offload.engine import plan_host_memory
    n = 10**8
    per = {dt: plan_host_memory(n, param_dtype=torch.bfloat16, bucket_numel=OffloadOptions().bucket_numel,
                                tile_numel=OffloadOptions().tile_numel, state_dtype=dt).host_bytes / n
           for dt in DTYPES}
    assert per["fp32"] - per["bf16"] == pytest.approx(4, abs=0.01)
    assert per["fp32"] - per["int8"] == pytest.approx(6 - 8 / 256, abs=0.01)


# -- two gloo ranks ------------------------------------------------------------------------------
def _sharded_job(rank, world, root):
    out = {}
    data = batches(8)  # the same batches on both ranks: the averaged gradient is the local one
    for stage in (1, 2):
        torch.manual_seed(0)
        model = TinyNet()
        opt = ShardedAdam(param_groups(model, WD), lr=LR, stage=stage,
                          options=OffloadOptions(**SMALL, state_dtype="int8"))
        assert opt.lo % 256 == 0  # blocks never straddle two shards
        train(model, opt, data[:4])
        opt.save_checkpoint(f"{root}/s{stage}")
        saved = {k: v.clone() for k, v in opt.state_tensors().items()}
        train(model, opt, data[4:])
        out[stage] = (saved, {k: v.clone() for k, v in opt.state_tensors().items()})
        opt.close()
    return out


def assert_int8_close(got: dict, want: dict):
    """The sharded gradient path sums a few elements in another order than the one-process path
    (the last bit; fp32 states too). A last bit may move a code by one step, and that code its param
    by a few % of lr. So: codes within one step and all but 1% equal; masters all within lr / 4 and
    all but 1% to fp32 rounding (a systematic error, such as another element's random bits, moves
    most codes and masters)."""
    d = (got["master"] - want["master"]).abs()
    assert d.max() <= LR / 4, d.max()
    assert (d <= 1e-6 + 1e-5 * want["master"].abs()).float().mean() >= 0.99
    for k in ("exp_avg", "exp_avg_sq"):
        diff = (got[k].int() - want[k].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.01, k
    for k in ("exp_avg_scale", "exp_avg_sq_scale"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-9)


def test_sharded_int8_matches_one_process_and_reloads_on_one(tmp_path):
    r0, r1 = run_distributed(_sharded_job, str(tmp_path))
    torch.manual_seed(0)
    init = TinyNet()
    single = copy.deepcopy(init)
    o_single = engine(None, single, "int8")
    train(single, o_single, batches(8))
    want = o_single.state_tensors()
    for stage in (1, 2):
        joined = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(r0[stage], r1[stage])]
        assert_int8_close(joined[1], want)  # the two shards side by side are the one-process state
        # 2 -> 1: the 2-rank checkpoint of step 4 loads bit for bit into one process and continues
        model = copy.deepcopy(init)
        opt = engine(None, model, "int8")
        opt.load_checkpoint(str(tmp_path / f"s{stage}"))
        assert_state_equal(opt, joined[0])
        opt._publish_masters()  # the params of step 4 (fp32: the masters)
        train(model, opt, batches(8)[4:])
        assert_int8_close(opt.state_tensors(), joined[1])
        opt.close()
    o_single.close()


def test_config_key_reaches_the_engine_options():
    from hf_zero_offload import config
    from hf_zero_offload.engine_setup import engine_options
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "state_dtype": "int8"}}
    cfg = config.resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert engine_options(cfg)[0].state_dtype == "int8"
    zero["offload_optimizer"]["state_dtype"] = "int4"
    with pytest.raises(config.ConfigError, match="offload_optimizer.state_dtype.*'fp32', 'bf16', 'int8'"):
        config.resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    zero["offload_optimizer"] = {"state_dtype": "bf16"}
    with pytest.raises(config.ConfigError, match="offload_optimizer.state_dtype.*\"device\": \"cpu\""):
        config.resolve({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})


@pytest.mark.parametrize("key", ["master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"])
@pytest.mark.parametrize("target", ["int8", "fp32"])
def test_a_state_tensor_longer_than_its_header_says_is_refused(tmp_path, key, target):
    """One element too many in a checksum-valid file loaded without a word (one too few was refused): every
    tensor's length is now checked to equal what the header's numel implies."""
    from hf_zero_offload.engine.checkpoint import folder
    torch.manual_seed(0)
    model = TinyNet()
    opt = engine(None, model, "int8")
    train(model, opt, batches(2))
    tensors = {k: v.clone() for k, v in opt.state_tensors().items()}
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    folder.save(str(tmp_path), 0, 1, opt.state_meta(), tensors, barrier=None, partition=None)
    other = engine(None, copy.deepcopy(model), target)
    with pytest.raises(ValueError, match=rf"rank0_of_1\.hzo: {key} is \w+, \d+ bytes, expected"):
        other.load_checkpoint(str(tmp_path))
    for o in (opt, other):
        o.close()


@pytest.mark.parametrize("bad", [-1.0, float("nan")], ids=["negative", "nan"])
def test_int8_state_with_negative_scales_is_refused_on_load(tmp_path, bad):
    """A checkpoint (valid checksum) whose int8 scales are negative or NaN was not written by us (the block max
    skips a NaN; a NaN scale loaded turned its block's 256 params NaN at the next step): the load names the
    directory and stops; a state dict likewise."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = engine(None, model, "int8")
    train(model, opt, batches(2))
    opt.moments.state["exp_avg_sq_scale"][0] = bad
    opt.save_checkpoint(str(tmp_path))
    bad = opt.state_dict()
    other = engine(None, copy.deepcopy(model), "int8")
    with pytest.raises(ValueError, match=f"{tmp_path}/rank0_of_1.hzo: exp_avg_sq_scale has negative or NaN entries"):
        other.load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="state dict: exp_avg_sq_scale has negative or NaN entries"):
        other.load_state_dict(bad)
    for o in (opt, other):
        o.close()


def test_int8_moments_of_a_param_without_gradient_keep_their_values():
    """torch's AdamW leaves a param without a gradient and its moments alone. In the flat int8 layout such a
    param shares a 256-element block with stepped ones: re-encoded on each step's absmax its moments
    random-walked (exp_avg 1.2x off after 200 steps with codes to nearest, 5.8x with stochastic ones;
    exp_avg_sq 0.18-0.36x). On the old scale times a power of two they keep their codes' values but for the
    shift c (csrc/quant.h) times the scale change: exact for exp_avg_sq (c = 2^-31), and for exp_avg where
    the element is well above that floor."""
    gen = torch.Generator().manual_seed(0)

    class Three(torch.nn.Module):  # 100 + 64 + 92 elements: one block
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(k, generator=gen)) for k in (100, 64, 92))

        def forward(self, x, use_b):
            out = (self.a * x[:100]).sum() + (self.c * x[:92]).sum()
            return (out + (self.b * x[:64]).sum() if use_b else out) ** 2

    model = Three()
    opt = OffloadAdam(model.parameters(), lr=1e-3, options=OffloadOptions(pin_memory=False, num_threads=1,
                                                                          state_dtype="int8"))

    def b_moments():
        st = {k: t.clone() for k, t in opt.state_tensors().items() if k != "master"}
        m, v = ops.state_to_fp32(st)
        return m[100:164], v[100:164]

    for s in range(5):
        opt.zero_grad()
        model(torch.randn(100, generator=gen) * (1 + s), True).backward()
        opt.step()
    m0, v0 = b_moments()
    for s in range(200):  # b gets no gradient; a's and c's vary 31x, so the block's scale moves both ways
        opt.zero_grad()
        model(torch.randn(100, generator=gen) * (1 + 5 * (s % 7)), False).backward()
        opt.step()
    m1, v1 = b_moments()
    assert ((v1 - v0).abs() / v0).max() < 1e-3
    assert (m1 - m0).norm() / m0.norm() < 0.05
    rel = (m1 - m0).abs() / m0.abs()
    assert rel.median() < 0.01 and (rel[m0.abs() > 0.2 * m0.abs().max()] < 0.01).all()
