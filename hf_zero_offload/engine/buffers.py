"""Host memory for the offloaded optimizer: the allocation plan and the arena that realises it.

``plan_host_memory`` is the one source of truth for what the engine allocates; the memory planner
(``hf_zero_offload.planner``) calls the same function.
"""
from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass, field

import torch

from .. import ops
from .memory_limits import check_host_ram
from .moments import moment_regions

_ALIGN = 4096
PINNED_REGIONS = ("grad_staging", "param_staging")  # what crosses PCIe  # every region starts on a page: no two regions share a cache line or a page


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class HostPlan:
    """Bytes the engine allocates, by region. ``regions`` maps name -> (numel, dtype)."""
    numel: int
    regions: dict = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return sum(_round(n * _bytes(dt)) for n, dt, where in self.regions.values() if where == "host")

    @property
    def device_bytes(self) -> int:
        return sum(n * _bytes(dt) for n, dt, where in self.regions.values() if where == "device")

    def bytes_by_region(self) -> dict:
        return {k: n * _bytes(dt) for k, (n, dt, _) in self.regions.items()}


def _round(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def store_dtype(param_dtypes: set, gradient_accumulation_steps: int) -> torch.dtype:
    """dtype of the host gradient store: the grads' own 16-bit dtype when each step sees one
    micro-batch (2 B/param), fp32 when micro-batches accumulate (summing in 16-bit would lose bits)."""
    if gradient_accumulation_steps == 1 and len(param_dtypes) == 1:
        return next(iter(param_dtypes))
    return torch.float32


def summed_in_16_bits(engine: str, store: torch.Tensor, counts: list[int]) -> str | None:
    """The warning for a window in which every param that got a gradient got several (micro-batches accumulated
    with gradient_accumulation_steps=1) into a 16-bit store: they were summed in 16 bits, as torch sums a 16-bit
    model's ``.grad``, where the option sums in fp32 (the Trainer refuses the mismatch; a loop of one's own may
    not know). A param alone getting several (a layer shared by reentrant-checkpointed segments) is no sign."""
    got = [c for c in counts if c > 0]
    if store.dtype == torch.float32 or not got or min(got) < 2:
        return None
    return (f"hf_zero_offload: {engine}: {min(got)} or more backward passes went into one step with "
            f"gradient_accumulation_steps=1: their gradients were summed in {str(store.dtype)[6:]} (as torch sums a "
            f"16-bit model's .grad); OffloadOptions(gradient_accumulation_steps={min(got)}) sums them in fp32")


def write_grad(dst: torch.Tensor, src: torch.Tensor, *, first: bool, num_threads: int | None = None) -> None:
    """The one writer into a host gradient store (both engines): an fp32 store sums the micro-batches
    of a step (the first overwrites), a 16-bit store holds one micro-batch's gradient per step.

    A parameter's gradient can still arrive in pieces within one backward: a layer shared by several
    reentrant-checkpointed segments gets one accumulation per segment (the hook fires each time). A 16-bit
    store sums those pieces in its own dtype, as autograd sums them into a 16-bit ``.grad`` (and as the
    sharded engine's device store does)."""
    if dst.dtype == torch.float32:
        ops.accumulate_grad(dst, src, overwrite=first, num_threads=num_threads)
    elif first:
        dst.copy_(src)
    else:
        dst.add_(src)


def plan_host_memory(numel: int, *, param_dtype: torch.dtype, grad_dtype: torch.dtype | None = None,
                     gradient_accumulation_steps: int = 1, delayed_param_update: bool = False,
                     bucket_numel: int, tile_numel: int, max_param_numel: int = 0, cuda: bool = True,
                     state_dtype: str = "fp32") -> HostPlan:
    """Regions for ``numel`` trainable params held in ``param_dtype`` on the device.

    host: fp32 master + exp_avg + exp_avg_sq (12 B/param; ``state_dtype`` "bf16": 8, "int8": 6 + 8 B
    per 256-element block of scales, ``moments.moment_regions``); the gradient store (2 or 4 B/param, two
    of them with DPU, whose step reads one while backward fills the other); pinned staging for
    gradient buckets going down; staging for updated params going up (two tiles, or a full copy
    with DPU since its step finishes while the device still runs on the previous params).
    device: two gradient buckets. Without CUDA the buckets already live in host memory, so there is
    no separate staging for them.
    """
    grad_dtype = grad_dtype or param_dtype
    sdt = store_dtype({grad_dtype}, gradient_accumulation_steps)
    bucket = max(min(bucket_numel, numel), max_param_numel, 1)
    tile = max(min(tile_numel, numel), 1)
    regions = {
        "master": (numel, torch.float32, "host"),
        **{k: (n, dt, "host") for k, (n, dt) in moment_regions(numel, state_dtype).items()},
        "grad_store": (numel * (2 if delayed_param_update else 1), sdt, "host"),
        **({"grad_staging": (2 * bucket, grad_dtype, "host")} if cuda else {}),
        "param_staging": ((numel if delayed_param_update else 2 * tile), param_dtype, "host"),
        "grad_buckets": (2 * bucket, grad_dtype, "device"),
    }
    return HostPlan(numel=numel, regions=regions)


class HostArena:
    """One host allocation carved into the plan's regions; pinned when CUDA is present.

    Pinning registers an ordinary allocation with cudaHostRegister instead of using torch's pinned
    caching allocator, which rounds every block up to a power of two (up to ~2x the RAM).
    """

    def __init__(self, plan: HostPlan, *, pin: bool, check_ram: bool = True, also: int = 0, freed: int = 0):
        """``also``: bytes the engine allocates beside the arena in host RAM, checked with it (on a CPU run the
        plan's "device" regions, the gradient buckets: left out, they failed after the check with torch's bare
        "can't allocate memory")."""
        self.plan = plan
        layout, total = {}, 0
        # Regions the device copies from or to go last, so that one contiguous range is pinned; the
        # masters, moments and gradient store are only touched by the CPU and stay pageable (pinning
        # them would only cost registration time and locked-memory budget).
        host = [(k, v) for k, v in plan.regions.items() if v[2] == "host"]
        host.sort(key=lambda kv: kv[0] in PINNED_REGIONS)
        pin_from = None
        for name, (n, dt, _) in host:
            if name in PINNED_REGIONS and pin_from is None:
                pin_from = total
            layout[name] = (total, n, dt)
            total += _round(n * _bytes(dt))
        self.nbytes = total
        if check_ram:
            check_host_ram(total + also, freed)
        self._buf = torch.empty(total, dtype=torch.uint8)
        self._pinned_range = self._buf[pin_from:] if pin_from is not None else self._buf[:0]
        self.pinned = _register(self._pinned_range) if pin else False
        self.regions = {name: self._buf[off:off + n * _bytes(dt)].view(dt) for name, (off, n, dt) in layout.items()}

    def close(self) -> None:
        if self.pinned:
            # An async copy may still read or write the staging: let it land before unpinning.
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._pinned_range.data_ptr())
            self.pinned = False
        self.regions = {}
        self._buf = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_warned_pin = False


def _register(buf: torch.Tensor) -> bool:
    global _warned_pin
    if not torch.cuda.is_available() or buf.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        ok = int(getattr(err, "value", err)) == 0
    except Exception as exc:  # pragma: no cover - depends on the driver
        ok, err = False, exc
    if not ok:
        _clear_last_cuda_error()
    if not ok and not _warned_pin:
        _warned_pin = True
        warnings.warn(f"hf_zero_offload: pinning {buf.numel() / 2**30:.2f} GiB of host memory failed ({err}); "
                      "continuing with pageable memory (slower host<->device copies)", RuntimeWarning)
    return ok


def _clear_last_cuda_error() -> None:
    """A failed cudaHostRegister stays this thread's CUDA "last error" until someone reads it, and
    torch's next kernel-launch check (cudaGetLastError) would raise it as its own failure, far from
    here. Read it from the libcudart torch loaded (found in /proc/self/maps); without one (a static
    runtime, not Linux) there is nothing we can reach, and the warning above still explains."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and line.split()[-1].startswith("/")}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()  # dlopen of a loaded path returns that same library
    except OSError:
        pass
