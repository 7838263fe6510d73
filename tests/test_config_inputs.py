"""What --zero_offload (or ``zero_offload=`` in code, or an arguments file) may hold besides a well-formed file: each
mistake one ConfigError naming the input, before any model work."""
from __future__ import annotations

import pathlib

import pytest

from hf_zero_offload.config import ConfigError, resolve


@pytest.mark.parametrize("path", ["/tmp/ds\0config.json", "ds\0config.json", "zero2\0",
                                  pathlib.Path("/tmp/ds\0config.json")])
def test_a_path_holding_a_nul_character_is_named(path):
    """A NUL (from code or a JSON arguments file; no command line carries one) failed in open() with a bare
    "ValueError: embedded null byte" naming no file, or printed the name with the NUL raw in it."""
    with pytest.raises(ConfigError) as e:
        resolve(path)
    assert "\0" not in str(e.value) and "\\x00" in str(e.value) and "NUL" in str(e.value)


@pytest.mark.parametrize("raw, path, hint", [
    # a slip of case: difflib's ratio is too low for short keys, and nothing was suggested
    ({"FP16": {"enabled": False}}, "FP16", "(did you mean 'fp16'? keys are case-sensitive)"),
    ({"optimizer": {"type": "AdamW", "params": {"LR": 1e-4}}}, "optimizer.params.LR", "(did you mean 'lr'?"),
    # a key one level off: the message listed the keys of the wrong section, without the one meant
    ({"optimizer": {"type": "AdamW", "lr": 1e-4}}, "optimizer.lr", "(it is a key of 'optimizer.params')"),
    ({"stage": 2}, "stage", "(it is a key of 'zero_optimization')"),
    ({"zero_optimization": {"stage": 2, "device": "cpu"}}, "zero_optimization.device",
     "(it is a key of 'zero_optimization.offload_optimizer')"),
    ({"scheduler": {"type": "WarmupLR", "warmup_num_steps": 5}}, "scheduler.warmup_num_steps",
     "(it is a key of 'scheduler.params')"),
    ({"zero_optimization": {"stage": 2, "fp16": {"enabled": False}}}, "zero_optimization.fp16",
     "(it is a key of the top level)"),
    ({"type": "AdamW"}, "type", "(it is a key of 'optimizer' or 'scheduler')"),
])
def test_an_unknown_key_says_where_it_belongs(raw, path, hint):
    with pytest.raises(ConfigError) as e:
        resolve(raw)
    msg = str(e.value)
    assert msg.startswith(f"<dict>: {path}: unknown key") and hint in msg, msg


def test_a_key_of_many_sections_gets_no_guess():
    with pytest.raises(ConfigError) as e:
        resolve({"enabled": True})  # fp16, bf16, bfloat16, delayed_param_update...
    assert "(" not in str(e.value).split(";")[0]


def test_eps_0_is_taken_alike_from_the_file_and_from_adam_epsilon():
    """``"eps": 0`` in the file was refused ("a number > 0") while ``--adam_epsilon 0`` (torch's AdamW and DeepSpeed
    take 0 too) resolved ``"eps": "auto"`` to 0: one value, two verdicts by where it came from."""
    from hf_zero_offload.config import ArgsView

    block = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 0}}}
    assert resolve(block).optimizer.eps == 0
    auto = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": "auto"}}}
    assert resolve(auto, ArgsView(adam_epsilon=0.0, learning_rate=1e-3)).optimizer.eps == 0
    for bad in (-1e-8, float("nan"), "0"):
        with pytest.raises(ConfigError, match="optimizer.params.eps"):
            resolve({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": bad}}})


def test_a_pipe_is_read_once_per_process(tmp_path):
    """``--zero_offload <(jq ... ds_config.json)``: the example's early check read the pipe, then the Trainer found
    it empty ("the file is empty"); a named FIFO's second open waited for a writer that had gone."""
    import os
    import threading

    from hf_zero_offload.config import check

    r, w = os.pipe()
    os.write(w, b'{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}')
    os.close(w)
    try:
        path = f"/dev/fd/{r}"
        first, second = check(path), check(path)
        assert first.cfg == second.cfg and first.cfg["gradient_clipping"] == 0.5
    finally:
        os.close(r)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write_once():  # another process's `cat ds_config.json > fifo`: it opens, writes, closes, and is gone
        with open(fifo, "wb") as f:
            f.write(b'{"zero_optimization": {"stage": 1}}')
    writer = threading.Thread(target=write_once, daemon=True)
    writer.start()
    assert check(str(fifo)).cfg["zero_optimization"]["stage"] == 1
    writer.join(timeout=10)
    assert check(str(fifo)).cfg["zero_optimization"]["stage"] == 1  # (no writer now: an open() would wait forever)


@pytest.mark.parametrize("make", ["sparse", "device"])
def test_a_huge_file_is_refused_without_reading_it_whole(tmp_path, make):
    from hf_zero_offload.config import loader

    path = "/dev/zero" if make == "device" else str(tmp_path / "big.json")
    if make == "sparse":
        with open(path, "wb") as f:
            f.truncate(loader.MAX_BYTES * 4)
    with pytest.raises(ConfigError, match=r"over 16 MiB, not a ds_config"):
        resolve(path)
