"""A loop of one's own: the names ``hf_zero_offload`` gives on first access, and ``options=`` as a dict."""
from __future__ import annotations

import pytest

import hf_zero_offload
from _models import TinyNet
from hf_zero_offload.engine import OffloadAdam, ShardedAdam


def test_dir_lists_the_names_imported_on_first_access():
    """dir() (a shell's completion) listed neither the engines nor the Trainer's classes."""
    names = dir(hf_zero_offload)
    for name in ("OffloadAdam", "ShardedAdam", "OffloadOptions", "ShardOptions", "adapt_accelerator", "CPUAdam",
                 "ZeroOffloadTrainer", "__version__"):
        assert name in names, name


@pytest.mark.parametrize("cls", [OffloadAdam, ShardedAdam])
def test_a_sharding_field_among_the_options_is_named_as_shardedadams_keyword(cls):
    """options={"stage": 1} said only "unknown field(s) stage", not where stage goes."""
    with pytest.raises(TypeError, match=r"options has unknown field\(s\) dpuu, stage; .* \(stage: ShardOptions' "
                                        r"field\(s\), ShardedAdam's own keyword\(s\): ShardedAdam\(params, stage=\.\.\."):
        cls(TinyNet().parameters(), options={"stage": 1, "dpuu": True})
