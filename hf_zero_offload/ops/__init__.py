"""Typed wrapper over the compiled kernels (``hf_zero_offload._C``).

Every argument is checked here before a raw address crosses into C++: dtype, device, contiguity,
sizes. A bad tensor raises ``TypeError``/``ValueError`` naming the argument; nothing is ever copied
silently (a hidden copy would make an in-place update disappear).

- ``kernels``: the fused Adam step, the gradient norm and the gradient accumulation;
- ``moments``: how the moments are stored (fp32, bf16, blockwise int8) and converted;
- ``simd``: which instruction set runs them.
"""
from __future__ import annotations

from ._args import check_num_threads
from .kernels import (accumulate_grad, adam_step, check_hyperparameters, check_separate, grad_norm_sq,
                      grad_norm_sq_and_finite, stream_reference)
from .hparams import next_step
from .moments import (INT8_CODES, QUANT_BLOCK, STATE_DTYPES, check_int8_codes, check_scales, check_state_dtype,
                      dequantize_blockwise, make_state, quantize_blockwise, state_dtype_of, state_from_fp32,
                      state_slice, state_to_fp32)
from .simd import available_simd_levels, set_simd_level, simd_level

__all__ = [
    "QUANT_BLOCK",
    "INT8_CODES",
    "STATE_DTYPES",
    "check_int8_codes",
    "check_scales",
    "check_state_dtype",
    "adam_step",
    "make_state",
    "state_slice",
    "state_to_fp32",
    "state_from_fp32",
    "quantize_blockwise",
    "dequantize_blockwise",
    "state_dtype_of",
    "check_hyperparameters",
    "next_step",
    "check_separate",
    "check_num_threads",
    "grad_norm_sq",
    "grad_norm_sq_and_finite",
    "accumulate_grad",
    "stream_reference",
    "simd_level",
    "available_simd_levels",
    "set_simd_level",
]
