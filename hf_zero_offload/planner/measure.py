"""Ground truth for the planner on the CPU: the peak memory of a real forward + backward, measured by the
kernel's resident-set high-water mark in a child process (``measure_cpu_steps``), to check the meta-device
trace (``trace.py``) against. Linux only."""
from __future__ import annotations

import contextlib
import os

import torch

from ..fp32_logits import widen_logits
from .subset import freeze_except, with_adapter
from .trace import build_model, dummy_batch, load_config, loss_of


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure_in_process(config, jobs, half_dtype, seq_len: int, tgt_len: int, ckpt: bool = False,
                        padded: bool = False, trainable: str | None = None, peft_config: str | None = None
                        ) -> list[int]:
    import gc

    torch.set_num_threads(1)
    peaks = []
    for mode, batch_size, keep_grads in jobs:
        torch.manual_seed(0)
        model = build_model(config, dtype=half_dtype if mode == "half" else torch.float32, device="cpu",
                            gradient_checkpointing=ckpt)
        if peft_config is not None:
            model = with_adapter(model, peft_config)
        if trainable is not None:
            freeze_except(model, trainable, "the measured model")
        if mode == "half":  # the engine's step, as the trace plans it
            widen_logits(model)
        batch = dummy_batch(config, batch_size, seq_len, tgt_len, "cpu", padded=padded)
        amp = (lambda: torch.autocast("cpu", dtype=half_dtype)) if mode == "amp" else contextlib.nullcontext
        if not keep_grads:
            for p in (p for p in model.parameters() if p.requires_grad):
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

        def step():
            with amp():
                loss = loss_of(model, batch)
            loss.backward()
            del loss

        step()  # warm-up: lazily created kernels, caches and the autograd engine's threads
        model.zero_grad(set_to_none=True)
        gc.collect()
        before = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        step()
        peaks.append(_status_bytes("VmHWM") - before)
        del model, batch
        gc.collect()
    return peaks


def measure_cpu_steps(config, jobs, *, half_dtype: torch.dtype = torch.bfloat16, seq_len: int = 128,
                      tgt_len: int = 128, timeout: float = 600, gradient_checkpointing: bool = False,
                      padded: bool = False, trainable: str | None = None, peft_config: str | None = None
                      ) -> list[int]:
    """Peak extra resident memory (bytes) of one real forward + backward on the CPU per job
    ``(mode, batch_size, keep_grads)`` (Linux only), each on a fresh model, one process for all.

    The process runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor above 64 KiB is its own
    mmap that glibc returns to the kernel when freed: the resident-set high-water mark (``VmHWM``,
    reset before the step) minus the RSS before the step is then the step's peak of live tensor
    memory, measured by the kernel rather than by the planner's own accounting. ``trainable``, ``peft_config``: as ``plan``'s."""
    import json
    import subprocess
    import sys
    import tempfile

    cfg = load_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        cfg.to_json_file(path)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
        args = json.dumps([path, [list(j) for j in jobs], str(half_dtype).split(".")[-1], seq_len, tgt_len,
                           gradient_checkpointing, padded, trainable, peft_config])
        res = subprocess.run([sys.executable, "-m", "hf_zero_offload.planner.measure", args], env=env,
                             capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"measurement process failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import json
    import sys

    _path, _jobs, _dt, _seq, _tgt, _ckpt, _padded, _trainable, _peft = json.loads(sys.argv[1])
    print(json.dumps(_measure_in_process(load_config(_path), _jobs, getattr(torch, _dt), _seq, _tgt, _ckpt, _padded,
                                         _trainable, _peft)))
