"""Blockwise 8-bit moments' codes: the block size, the code tables, quantization to the nearest code (ties up),
stochastic rounding against the reference, quantization on given scales, states of code map 1, conversions between
state dtypes."""
from __future__ import annotations

import pytest
import torch
import _quant_ref as ref
from _ops_quant import _wide

from hf_zero_offload import ops


def test_block_constant():
    assert ops.QUANT_BLOCK == ref.BLOCK == 256


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_code_table(moment):
    if moment == "exp_avg":
        codes = torch.arange(-120, 121, dtype=torch.int32).to(torch.int8)
    else:
        codes = torch.arange(0, 249, dtype=torch.int32).to(torch.uint8)
    got = ops.dequantize_blockwise(codes, torch.ones(-(-codes.numel() // 256)))
    assert torch.equal(got, ref.code_values(codes))
    # sorted, distinct; the top is 1 - c (exact) for exp_avg, 1.0 for exp_avg_sq (c is under its ulp)
    assert got.max() == (1.0 - ref.shift(moment) if moment == "exp_avg" else 1.0)
    smallest = got[codes.numel() // 2 + 1] if moment == "exp_avg" else got[1]
    assert torch.all(got[1:] > got[:-1]) and smallest == ref.shift(moment) / 8


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 70_000])
def test_quantize_is_nearest_code(moment, n):
    x = _wide(n, seed=n)
    if moment == "exp_avg_sq":
        x = x.abs()
    x[: min(n, 256)] *= 0  # an all-zero block
    if n > 600:
        x[300] = 1e30  # an outlier flattens only its own block
    codes, scales = ops.quantize_blockwise(x, moment)
    want_codes, want_scales = ref.quantize(x, moment)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    back = ops.dequantize_blockwise(codes, scales)
    assert torch.equal(back, ref.dequantize(codes, scales))
    assert torch.equal(back[: min(n, 256)], torch.zeros(min(n, 256)))


def test_quantize_ties_go_up():
    # s = fp32(n + c) halfway between two code floats takes the larger: 0.53125 is halfway between
    # 0.5 (mag 112) and 0.5625 (113), 0.59375 between 113 and 0.625 (114); c = 2^-15 for exp_avg.
    c = ref.shift("exp_avg")
    x = torch.tensor([1.0, 0.53125 - c, 0.59375 - c, 0.53125 - c - 2**-20, -(0.53125 - c)])
    codes, _ = ops.quantize_blockwise(x, "exp_avg")
    assert codes.tolist() == [120, 113, 114, 112, -113]


@pytest.mark.parametrize("src", ops.STATE_DTYPES)
@pytest.mark.parametrize("dst", ops.STATE_DTYPES)
def test_state_conversions(src, dst):
    n = 1000
    m, v = _wide(n, 1) * 1e-3, _wide(n, 2).abs() * 1e-6
    st = ops.state_from_fp32(m, v, src)
    assert ops.state_dtype_of(st) == src
    m1, v1 = ops.state_to_fp32(st)
    conv = ops.state_from_fp32(m1, v1, dst)
    assert ops.state_dtype_of(conv) == dst
    m2, v2 = ops.state_to_fp32(conv)
    if src == dst:  # a round trip through fp32 keeps every code and value
        for k in st:
            if k == "exp_avg_scale":  # exp_avg's top code decodes to 1 - 2^-15 of the block's absmax
                torch.testing.assert_close(conv[k], st[k] * (1 - ref.shift("exp_avg")), rtol=2**-23, atol=0)
            else:
                assert torch.equal(st[k], conv[k]), k
    if "int8" not in (src, dst) and "bf16" not in (src, dst):
        assert torch.equal(m2, m) and torch.equal(v2, v)
    rtol = {"fp32": 0, "bf16": 2**-8, "int8": 2**-4}
    tol = max(rtol[src], rtol[dst]) * 2.01
    big = m.abs() > m.abs().max() * 1e-4  # the 8-bit code flushes values far below the block's max
    torch.testing.assert_close(m2[big], m[big], rtol=tol, atol=0)
    big = v > v.max() * 1e-8
    torch.testing.assert_close(v2[big], v[big], rtol=tol, atol=0)


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("step,round_index", [(1, 0), (7, 12345), (2**31 + 5, 2**32 - 100)])
def test_quantize_stochastic_matches_reference(step, round_index, moment):
    """A moment as a step stores it (ops.quantize_blockwise(step=...), the scalar helpers the
    kernels equal) against the reference's table search: magnitudes over the whole code range,
    exact code values, both sides of mag 8 (the end of the evenly spaced first binade), zeros, 1.0
    and an outlier; exp_avg with both signs."""
    sq = moment == "exp_avg_sq"
    x = _wide(3 * 256 + 41, seed=step).abs()
    x[:256] = x[:256].clamp(max=0.5)
    x[0], x[600] = 1.0, 1e30  # block 0's max (its values are their own codes' scale); an outlier
    c = 2.0 ** (1 - ref.BIAS[moment])
    x[1:40] = torch.tensor([c * (1 + k / 64) for k in range(-20, 19)])  # around c: s = 2c is mag 8
    x[40:60] = ref.magnitudes(moment)[torch.arange(0, 240 if sq else 120, 12 if sq else 6)].float()
    x[300:310] = 0.0
    if not sq:
        x[1::3] = -x[1::3]
    codes, scales = ops.quantize_blockwise(x, moment, step=step, round_index=round_index)
    want_codes, want_scales = ref.quantize(x, moment, step, round_index)
    assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)
    nearest, _ = ops.quantize_blockwise(x, moment)
    assert (codes.int() - nearest.int()).abs().max() <= 1 and not torch.equal(codes, nearest)
    assert torch.equal(codes[40:60], nearest[40:60])  # exact code values never move


def test_stochastic_codes_round_up_in_proportion():
    """Over many steps (each its own random bits) a value 30% of the way from its code to the next
    one rounds up 30% of the time; 70% for one in the evenly spaced range below the normal codes."""
    x = torch.zeros(256)
    x[0] = 1.0
    x[1] = 0.5 + 0.3 * 0.0625  # codes 0.5 (mag 240) and 0.5625 (241)
    x[2] = (2 + 0.7) * 2.0**-34  # mags 2 and 3 (step 2^-34)
    ups = torch.zeros(3)
    for step in range(1, 4001):
        codes, _ = ops.quantize_blockwise(x, "exp_avg_sq", step=step)
        ups += (codes[:3].long() == torch.tensor([248, 241, 3])).float()
    assert ups[0] == 4000
    assert abs(ups[1] / 4000 - 0.3) < 0.03 and abs(ups[2] / 4000 - 0.7) < 0.03, ups


def test_states_of_code_map_1_decode_with_it():
    """int8 states saved before ops.INT8_CODES = 2 (no version: map 1, exponent biases 15 and 31, a
    subnormal range below mag 8) still decode, so they convert on load; an unknown map is refused."""
    st = {"exp_avg": torch.tensor([0, 1, 7, 8, 9, 120, -120, -9], dtype=torch.int8),
          "exp_avg_sq": torch.tensor([0, 1, 8, 17, 248, 0, 0, 0], dtype=torch.uint8),
          "exp_avg_scale": torch.tensor([2.0]), "exp_avg_sq_scale": torch.tensor([4.0])}
    m, v = ops.state_to_fp32(st, 1)
    assert m.tolist() == [0, 2 * 2**-17, 2 * 7 * 2**-17, 2 * 2**-14, 2 * 1.125 * 2**-14, 2, -2, -2 * 1.125 * 2**-14]
    assert v.tolist() == [0, 4 * 2**-33, 4 * 2**-30, 4 * 1.125 * 2**-29, 4, 0, 0, 0]
    m2, _ = ops.state_to_fp32(st)  # the current map reads the same codes otherwise
    assert not torch.equal(m, m2)
    with pytest.raises(ValueError, match="int8 moments with code map 3"):
        ops.state_to_fp32(st, 3)


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_quantize_on_given_scales(moment):
    """The engine encodes a block shared with params it did not step on a scale it keeps (the old one times a
    power of two): the codes are the reference's on that scale, a code's value times 2^k codes exactly, and a
    scale under the block's largest |x| (values would clamp) or a non-finite one is refused. On 4x the scale a
    code's value moves by the shift c alone (decode subtracts it once per scale, csrc/quant.h): at most 2c times
    the new scale, the floor of the code range, not a code step (1/16 of the value) above it."""
    x = _wide(300, seed=3).abs()
    if moment == "exp_avg":
        x[::2] = -x[::2]
    big = torch.tensor([x[:256].abs().max() * 1.5, x[256:].abs().max() * 3])
    codes, scales = ops.quantize_blockwise(x, moment, scales=big)
    assert torch.equal(scales, big) and torch.equal(codes, torch.cat(
        [ref.quantize(x[:256], moment, scale=float(big[0]))[0], ref.quantize(x[256:], moment, scale=float(big[1]))[0]]))
    values = ops.dequantize_blockwise(*ops.quantize_blockwise(x, moment))
    _, s0 = ops.quantize_blockwise(values, moment)
    twice, _ = ops.quantize_blockwise(values, moment, scales=s0 * 4)
    c, per = 2.0 ** (1 - ref.BIAS[moment]), s0.repeat_interleave(256)[:300]
    moved = (ops.dequantize_blockwise(twice, s0 * 4) - values).abs()
    assert (moved <= 2 * c * 4 * per).all()
    above = values.abs() > 0.1 * per
    assert (moved[above] / values[above].abs() < 2e-3).all()
    for bad in (torch.tensor([x[:256].abs().max() * 0.5, 1e30]), torch.tensor([float("inf"), 1e30])):
        with pytest.raises(ValueError, match="scales: each must be finite and >= its block's largest"):
            ops.quantize_blockwise(x, moment, scales=bad)
