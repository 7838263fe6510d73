"""The fused kernel's compact-moment arguments refused by name before any write: int8 argument errors, scales
given for float states, state slices of another alignment or dtype, negative scales (in the kernel and in a
CPUAdam state dict)."""
from __future__ import annotations

import pytest
import torch
from _ops_quant import _args

from hf_zero_offload import ops


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(exp_avg_scale=None), ValueError, "exp_avg_scale is required"),
    (dict(exp_avg_sq_scale=torch.zeros(3)), ValueError, "exp_avg_sq_scale has 3 elements, expected 2"),
    (dict(exp_avg_scale=torch.zeros(2, dtype=torch.float64)), TypeError, "exp_avg_scale must have dtype float32"),
    (dict(exp_avg_sq=torch.zeros(512, dtype=torch.int8)), TypeError, "exp_avg_sq must have dtype"),
    (dict(exp_avg_sq=torch.zeros(512)), TypeError, "exp_avg is int8 .int8 state., so exp_avg_sq must be uint8"),
])
def test_int8_argument_errors(change, exc, pattern):
    args = _args()
    args.update(change)
    before = args["param"].clone()
    with pytest.raises(exc, match=pattern):
        ops.adam_step(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1,
                      lr=1e-3, **args)
    assert torch.equal(args.get("param", before), before)


def test_scales_rejected_for_float_states():
    args = _args(kind="bf16")
    with pytest.raises(ValueError, match="exp_avg_scale is only for int8 moments"):
        ops.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, lr=1e-3,
                      exp_avg_scale=torch.zeros(2))


def test_state_slice_alignment_and_dtype_errors():
    st = ops.make_state(1000, "int8")
    assert ops.state_slice(st, 256, 1000)["exp_avg_scale"].numel() == 3
    with pytest.raises(ValueError, match="multiples of QUANT_BLOCK=256"):
        ops.state_slice(st, 100, 512)
    with pytest.raises(ValueError, match="multiples of QUANT_BLOCK=256"):
        ops.state_slice(st, 0, 300)
    assert ops.state_slice(ops.make_state(1000, "bf16"), 100, 300)["exp_avg"].numel() == 200
    with pytest.raises(ValueError, match="state_dtype must be one of fp32, bf16, int8; got 'fp8'"):
        ops.make_state(10, "fp8")
    with pytest.raises(ValueError, match="moment must be"):
        ops.quantize_blockwise(torch.zeros(4), "m")


@pytest.mark.parametrize("bad", [-1.0, float("nan")], ids=["negative", "nan"])
def test_negative_scales_are_refused_before_any_write(bad):
    """A scale is its block's absmax; the vector kernels rely on it being >= 0, and the kernel never writes a NaN
    one (the block max skips a NaN; inf it may), so either is refused by ops, and nothing is written."""
    args = _args()
    args["exp_avg_sq_scale"][1] = bad
    p, g = args.pop("param"), args.pop("grad")
    p0 = p.clone()
    with pytest.raises(ValueError, match="exp_avg_sq_scale has negative or NaN entries"):
        ops.adam_step(p, g + 1, args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1, lr=1e-3, **args)
    assert torch.equal(p, p0)
    st = ops.make_state(512, "int8")
    st["exp_avg_scale"][0] = float("inf")  # allowed: a block that met an inf
    ops.adam_step(torch.zeros(512), torch.ones(512), **st, step=1, lr=1e-3)


@pytest.mark.parametrize("bad", [-0.5, float("nan")], ids=["negative", "nan"])
def test_cpu_adam_refuses_a_state_dict_with_negative_scales(bad):
    from hf_zero_offload.adam.cpu_adam import CPUAdam

    p = torch.nn.Parameter(torch.randn(600))
    opt = CPUAdam([p], lr=1e-3, state_dtype="int8")
    p.grad = torch.randn(600)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"].clone()
    sd["state"][0]["exp_avg_scale"][2] = bad
    fresh = CPUAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-3, state_dtype="int8")
    with pytest.raises(ValueError, match="exp_avg_scale has negative or NaN entries"):
        fresh.load_state_dict(sd)
    assert len(fresh.state) == 0  # nothing loaded
