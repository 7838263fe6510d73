"""Shared by the ``test_cli_errors*`` files (and test_cli_hostile.py, test_cli_checkpoint_files.py,
test_crash_safety.py): the repository's root and tiny model config, the check that a command failed in one line,
and a checkpoint of a Linear to consolidate."""
from pathlib import Path

import torch

from hf_zero_offload import cli

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "models" / "t5-tiny.json")


def _one_line_error(capsys, argv, *needles):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    # estimate's progress line ("tracing ...") comes before an error found by the trace: status, not the error
    lines = [ln for ln in captured.err.strip().splitlines() if not ln.startswith("hf-zero-offload estimate: tracing ")]
    assert len(lines) == 1 and lines[0].startswith(f"hf-zero-offload {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _checkpoint_of_a_linear(tmp_path):
    from safetensors.torch import save_file

    from hf_zero_offload.saved_names import write_param_names
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    model = torch.nn.Linear(4, 3)
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    model(torch.randn(2, 4)).sum().backward()
    engine.step()
    ckpt = tmp_path / "checkpoint-1"
    engine.save_checkpoint(str(ckpt / "zero_offload"))
    write_param_names(str(ckpt / "zero_offload"), [["weight"], ["bias"]])
    engine.close()
    return ckpt, model, save_file
