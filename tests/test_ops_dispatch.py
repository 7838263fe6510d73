"""The Python entry points of the fused CPU kernels (hf_zero_offload.ops): bad arguments raise a
ValueError / TypeError naming the argument, and the instruction set is chosen by
``set_simd_level`` or the ``HF_ZERO_OFFLOAD_SIMD`` environment variable.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from _forked import collect, runner_argv
from _kernels import LEVELS
from _procs import run_together

from hf_zero_offload import ops


# ---------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument
# ---------------------------------------------------------------------------------------------


def _adam_args(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


def _noncontig(dtype=torch.float32, n=8):
    return torch.zeros(n, 2, dtype=dtype)[:, 0]


def _meta(dtype=torch.float32, n=8):
    return torch.empty(n, dtype=dtype, device="meta")


ADAM_BAD = [
    ("param", torch.zeros(8, dtype=torch.bfloat16), TypeError),
    ("param", torch.zeros(8, dtype=torch.float64), TypeError),
    ("param", _noncontig(), ValueError),
    ("param", _meta(), ValueError),
    ("param", [0.0] * 8, TypeError),
    ("grad", torch.zeros(9), ValueError),
    ("grad", torch.zeros(8, dtype=torch.float64), TypeError),
    ("grad", torch.zeros(8, dtype=torch.int32), TypeError),
    ("grad", _noncontig(torch.bfloat16), ValueError),
    ("grad", _meta(torch.bfloat16), ValueError),
    ("exp_avg", torch.zeros(7), ValueError),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), TypeError),
    ("exp_avg", _noncontig(), ValueError),
    ("exp_avg", _meta(), ValueError),
    ("exp_avg_sq", torch.zeros(16), ValueError),
    ("exp_avg_sq", torch.zeros(8, dtype=torch.float16), TypeError),
    ("exp_avg_sq", _noncontig(), ValueError),
    ("exp_avg_sq", _meta(), ValueError),
    ("param_out", torch.zeros(9, dtype=torch.bfloat16), ValueError),
    ("param_out", torch.zeros(8, dtype=torch.float64), TypeError),
    ("param_out", _noncontig(torch.float16), ValueError),
    ("param_out", _meta(torch.bfloat16), ValueError),
]


@pytest.mark.parametrize("name,value,exc", ADAM_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(ADAM_BAD)])
def test_adam_step_bad_tensor(name, value, exc):
    args = _adam_args()
    args[name] = value
    before = args["param"].clone() if name != "param" else None
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.adam_step(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1,
                      lr=1e-3, **args)
    if before is not None:
        assert before.eq(0).all()


def test_cuda_tensor_is_rejected_by_device_type():
    # no GPU here: a meta tensor has a non-CPU device type just like a CUDA one; on a GPU host check both
    devices = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        args = _adam_args()
        args["grad"] = torch.zeros(8, device=dev)
        with pytest.raises(ValueError, match=rf"^grad must be a CPU tensor, got a tensor on {dev}"):
            ops.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, lr=1e-3)


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(step=0), ValueError, "step"),
        (dict(step=-3), ValueError, "step"),
        (dict(step=1.0), TypeError, "step"),
        (dict(step=True), TypeError, "step"),
        (dict(step=1, beta1=1.0), ValueError, "beta1"),
        (dict(step=1, beta2=-0.1), ValueError, "beta2"),
        (dict(step=1, num_threads=0), ValueError, "num_threads"),
        (dict(step=1, num_threads=1.5), ValueError, "num_threads"),
        (dict(step=1, lr=float("nan")), ValueError, "lr"),
        (dict(step=1, lr=-1e-3), ValueError, "lr"),
        (dict(step=1, lr="1e-3"), ValueError, "lr"),
        (dict(step=1, eps=float("inf")), ValueError, "eps"),
        (dict(step=1, weight_decay=-0.1), ValueError, "weight_decay"),
    ],
)
def test_adam_step_bad_scalar(kwargs, exc, name):
    a = _adam_args()
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], **{"lr": 1e-3, **kwargs})
    assert a["param"].eq(0).all()


def test_read_only_inputs_say_why_they_must_be_contiguous_and_conversions_take_any_layout():
    a = _adam_args()
    with pytest.raises(ValueError, match=r"^grad must be contiguous \(read as one flat array"):
        ops.adam_step(a["param"], _noncontig(), a["exp_avg"], a["exp_avg_sq"], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"^param must be contiguous \(a copy would lose the in-place update"):
        ops.adam_step(_noncontig(), a["grad"], a["exp_avg"], a["exp_avg_sq"], step=1, lr=1e-3)
    x = torch.randn(40, 50).t()  # one-off conversions only read their inputs: an odd layout is copied
    codes, scales = ops.quantize_blockwise(x, "exp_avg")
    assert torch.equal(codes, ops.quantize_blockwise(x.contiguous(), "exp_avg")[0])
    assert torch.equal(ops.dequantize_blockwise(codes.view(50, 40).t(), scales),
                       ops.dequantize_blockwise(codes.view(50, 40).t().contiguous(), scales))
    state = ops.state_from_fp32(x, x.abs(), "int8")
    assert torch.equal(state["exp_avg"], codes)
    with pytest.raises(ValueError, match=r"^scales has 5 elements, expected 1 \(one per 256 of its 10 codes\)"):
        ops.dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(5))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"^numel must be an int >= 0"):
            ops.make_state(bad, "int8")


def test_adam_step_accepts_integral_step_types():
    a = _adam_args()
    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=torch.tensor(2).item(), lr=1e-3)
    import numpy as np

    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=np.int64(3), lr=1e-3)


@pytest.mark.parametrize(
    "acc,grad,exc,name",
    [
        (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), TypeError, "acc"),
        (_noncontig(), torch.zeros(8), ValueError, "acc"),
        (_meta(), torch.zeros(8), ValueError, "acc"),
        (torch.zeros(8), torch.zeros(9), ValueError, "grad"),
        (torch.zeros(8), torch.zeros(8, dtype=torch.int64), TypeError, "grad"),
        (torch.zeros(8), _noncontig(torch.float16), ValueError, "grad"),
        (torch.zeros(8), _meta(), ValueError, "grad"),
        (torch.zeros(8), "grad", TypeError, "grad"),
    ],
)
def test_accumulate_grad_bad_input(acc, grad, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.accumulate_grad(acc, grad)


@pytest.mark.parametrize(
    "grad,exc",
    [
        (torch.zeros(8, dtype=torch.float64), TypeError),
        (_noncontig(), ValueError),
        (_meta(), ValueError),
        (None, TypeError),
    ],
)
def test_grad_norm_bad_input(grad, exc):
    with pytest.raises(exc, match=r"^grad\b"):
        ops.grad_norm_sq_and_finite(grad)
    with pytest.raises(ValueError, match=r"^num_threads\b"):
        ops.grad_norm_sq_and_finite(torch.zeros(4), num_threads=-1)


# ---------------------------------------------------------------------------------------------
# instruction-set choice
# ---------------------------------------------------------------------------------------------


def test_levels_reported():
    assert LEVELS[0] == "scalar"
    assert set(LEVELS) <= {"scalar", "avx2", "avx512", "avx512_bf16"}
    assert ops.simd_level() in LEVELS
    with pytest.raises(ValueError, match="unknown SIMD level"):
        ops.set_simd_level("sse9")
    with pytest.raises(ValueError, match=r"unknown SIMD level 'avx2\\x00' \(expected one of scalar"):
        ops.set_simd_level("avx2\0")  # the C++ message ended at the NUL


_MISSING = [lvl for lvl in ("avx2", "avx512", "avx512_bf16") if lvl not in LEVELS]
_LEVEL_CODE = "from hf_zero_offload import ops; print(ops.simd_level())"
_KERNEL_CODE = (
    "import torch\n"
    "from hf_zero_offload import CPUAdam, ops\n"
    "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
    "for call in (ops.simd_level, lambda: CPUAdam([p]).step(), lambda: ops.grad_norm_sq(torch.ones(3))):\n"
    "    try:\n"
    "        call(); print('ran')\n"
    "    except ValueError as e:\n"
    "        print('refused', 'HF_ZERO_OFFLOAD_SIMD' in str(e), 'sse9' in str(e))\n"
    "assert torch.equal(p.data, torch.ones(3))\n"
    "ops.set_simd_level('scalar'); print(ops.simd_level())\n")


@pytest.fixture(scope="module")
def env_children(tmp_path_factory):
    """Every interpreter of the tests below, one per HF_ZERO_OFFLOAD_SIMD value: the code children forked from one
    runner that has imported torch alone (tests/_forked.py: each imports hf_zero_offload anew, in its own
    environment; six fresh interpreters took ~13 s on 2 cores), the command line a fresh process beside it."""
    children = {("level", v): (_LEVEL_CODE, v) for v in ["scalar", "sse9", *_MISSING]}
    children["kernel", "sse9"] = (_KERNEL_CODE, "sse9")
    codes = [code for code, _ in children.values()]
    envs = [dict(os.environ, HF_ZERO_OFFLOAD_SIMD=v) for _, v in children.values()]
    runner, files = runner_argv(codes, envs, str(tmp_path_factory.mktemp("forked")))
    forked, cli = run_together([runner, [sys.executable, "-m", "hf_zero_offload.cli", "configs"]], timeout=120,
                               per_child=[{}, {"env": dict(os.environ, HF_ZERO_OFFLOAD_SIMD="sse9")}])
    return {**dict(zip(children, collect(forked, codes, files))), ("cli", "sse9"): cli}


def test_env_override_selects_level(env_children):
    r = env_children["level", "scalar"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "scalar"


def test_env_override_rejects_unknown_or_unsupported_level(env_children):
    for value in ["sse9"] + _MISSING:
        r = env_children["level", value]
        assert r.returncode != 0
        assert "HF_ZERO_OFFLOAD_SIMD" in r.stderr and value in r.stderr
        if value in _MISSING:
            assert "lacks" in r.stderr


def test_a_bad_env_level_is_raised_by_kernel_calls_not_at_import(env_children):
    """A command that runs no kernel works (hf-zero-offload configs); the first kernel call raises the
    ValueError naming the variable, which the command lines report in one line; a level set in code
    replaces it. Importing used to raise a RuntimeError traceback, so every command failed."""
    r, cli = env_children["kernel", "sse9"], env_children["cli", "sse9"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["refused True True"] * 3 + ["scalar"]
    assert cli.returncode == 0 and "zero2-offload" in cli.stdout, cli.stderr


def test_unsupported_level_message():
    missing = [lvl for lvl in ("avx2", "avx512", "avx512_bf16") if lvl not in LEVELS]
    if not missing:
        pytest.skip("this CPU supports every level; the env-var subprocess test covers unknown names")
    with pytest.raises(ValueError, match="lacks"):
        ops.set_simd_level(missing[0])
