"""benchmarks/t5/gpu_tier.py on the CPU: what the planner validation's GPU tier computes beside its CUDA steps (the
trace with CUDA's kernel choices, the measured per-sample slope); the steps themselves are for a GPU session."""
from pathlib import Path

import torch

from benchmarks.t5 import gpu_tier, planner_validate
from hf_zero_offload.planner import trace

TINY = Path(__file__).resolve().parents[1] / "configs" / "models" / "t5-tiny.json"


def test_cuda_like_traces_keep_less_and_restore_torch():
    """On t5-tiny (dropout 0.1, a learned position bias): 1-byte dropout masks and the memory-efficient kernel each
    plan fewer bytes per sample than the meta device's CPU paths, and torch's functions are torch's again after."""
    f = torch.nn.functional
    before = (f.dropout, f.scaled_dot_product_attention)
    got = gpu_tier.traced_per_sample(trace.load_config(TINY), 32, 32)
    assert list(got) == list(gpu_tier.TRACES)
    planned, masks, efficient = got.values()
    assert planned > masks > efficient > 0, got
    assert (f.dropout, f.scaled_dot_product_attention) == before


def test_measured_per_sample_is_the_slope_of_each_setting():
    row = lambda bs, gib, attention="default": {"model": "m", "row": "zero2_offload", "attention": attention,
                                                "batch": bs, "measured_GiB": gib}
    rows = [row(4, 10.0), row(8, 14.0), row(4, 11.0, "math"), row(8, 17.0, "math"), row(4, 9.0, "efficient"),
            {"model": "m", "row": "zero2_offload", "attention": "efficient", "batch": 8, "error": "OOM"}]
    assert gpu_tier.per_sample(rows) == [
        {"model": "m", "row": "zero2_offload", "attention": "default", "measured_GiB_per_sample": 1.0},
        {"model": "m", "row": "zero2_offload", "attention": "math", "measured_GiB_per_sample": 1.5}]
    a = planner_validate.build_parser().parse_args(["--gpu", "--gpu-attention", "default,math", "--gpu-batch", "4,8"])
    assert a.gpu_attention == ["default", "math"] and a.gpu_batch == [4, 8]
