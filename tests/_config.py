"""What the ds_config tests share: the error a config raises, a ZeRO-2 block."""
from __future__ import annotations

import pytest

from hf_zero_offload.config import ConfigError, resolve


def errmsg(cfg, args=None) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(cfg, args)
    return str(e.value)


def zero2(**zero) -> dict:
    return {"zero_optimization": {"stage": 2, **zero}}
