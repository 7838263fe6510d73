"""The flat layout of the trainable parameters, and runs over it (the unit of one optimizer kernel
call); shared by the offload and the sharded engines."""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("hf_zero_offload")


def flat_layout(param_groups: list[dict], who: str, device=None) -> tuple[list[list[tuple]], int, torch.device]:
    """The trainable params of every group back to back in one flat range: per group a list of
    ``(param, offset, numel)``; the total numel; the device they train on: ``device`` where given (an engine built
    over a model still on the CPU moves each param there once its master is taken), else theirs (one for all).
    Frozen params own no range."""
    slots, seen, offset = [], set(), 0
    for group in param_groups:
        group_slots = []
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError("a parameter appears twice in the optimizer's param groups")
            seen.add(id(p))
            if not p.requires_grad:
                continue  # frozen: never gets a gradient, owns no optimizer state
            if p.device.type == "meta":  # no values to take masters from: a copy failed deep in torch, or steps did
                raise ValueError(f"{who}: a parameter of shape {tuple(p.shape)} is on the meta device (not "
                                 "materialised: init_empty_weights, low_cpu_mem_usage or device_map?); load its "
                                 "weights before building the optimizer")
            if not p.is_floating_point():  # a complex one was cast to real by the masters' copy, silently
                raise TypeError(f"{who}: parameter {param_label(group, p)} is {p.dtype}: the engine trains real "
                                "floating-point params (fp32 masters); freeze it (requires_grad=False), or hold it as "
                                "real numbers (torch.view_as_real) and view it as complex in forward")
            if not p.is_contiguous():  # (the engine makes them contiguous first: make_contiguous)
                raise ValueError(f"parameter {param_label(group, p)} is not contiguous; updates are copied "
                                 "into parameters as flat ranges")
            group_slots.append((p, offset, p.numel()))
            offset += p.numel()
        slots.append(group_slots)
    flat = [s for g in slots for s in g]
    if not flat:
        raise ValueError(f"{who} got no trainable parameters")
    here = flat[0][0].device
    if any(p.device != here for p, _, _ in flat):
        raise ValueError("every trainable parameter must be on the same device")
    if device is None:
        return slots, offset, here
    device = torch.device(device)
    if device.type == "meta" or (device.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"{who}: device={device} cannot hold the parameters to train "
                         f"({'no values' if device.type == 'meta' else 'no CUDA device is available here'})")
    if device.type == "cuda" and device.index is None:  # compared with the params' own device later: cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    return slots, offset, device


def place_params(params, device: torch.device, dtype: torch.dtype) -> None:
    """Each param in ``dtype`` on ``device``. Params moved to another device: every new tensor is made before any
    param is rebound, so a device too small for the model raises with the model whole where it was (masters are
    taken before this); a cast in place goes one param at a time (the host holds one param twice, not the model)."""
    moving = [p for p in params if p.device != device]
    for p, t in zip(moving, [p.data.to(device=device, dtype=dtype) for p in moving]):
        p.data = t
    for p in params:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def host_bytes_leaving(flat, device: torch.device) -> int:
    """Host RAM the engine gets back by moving the trainable params on the CPU to a CUDA ``device``
    (``place_params``), credited to its host-memory check (they are resident when it runs). Only what the move
    frees: storages a param holds whole (not a view of a larger one, counted once), and not pages of a mapped file
    (a checkpoint loaded with mmap: MemAvailable counts those as free already, and crediting them admitted arenas
    that did not fit); none off Linux, where the mappings cannot be read."""
    if device.type != "cuda":
        return 0
    files = _file_mappings()
    if files is None:
        return 0
    starts = [lo for lo, _ in files]
    owned = {}
    for p, _, _ in flat:
        s = p.untyped_storage()
        at = bisect.bisect_right(starts, s.data_ptr()) - 1  # the file mapping starting at or before it, if any
        if p.device.type == "cpu" and s.nbytes() == p.numel() * p.element_size() and \
                not (at >= 0 and s.data_ptr() < files[at][1]):
            owned[s.data_ptr()] = s.nbytes()
    return sum(owned.values())


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges of this process mapped from files (inode != 0), in address order as the kernel lists
    them (they do not overlap); None where /proc/self/maps is missing."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0":
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def param_label(group: dict, p) -> str:
    """How a message names ``p`` of ``group``: by name where the group keeps names (``param_names``), and shape."""
    for name, q in zip(group.get("param_names") or (), group["params"]):
        if q is p:
            return f"{name} (shape {tuple(p.shape)})"
    return f"of shape {tuple(p.shape)}"


def grad_dtype_error(label: str, got: torch.dtype, want: torch.dtype, param: torch.Tensor | None = None) -> TypeError:
    """A gradient in another dtype than the engine's: its param was cast after the engine was built, or (``param``
    still in ``want``) torch's ``grad_dtype`` asked autograd for gradients in another dtype, which was called a cast."""
    if param is not None and param.dtype == want:
        return TypeError(f"the gradient of parameter {label} is {got}, and the engine trains in {want}: the param is "
                         f"{want}, but its grad_dtype is {getattr(param, 'grad_dtype', None)} (torch accumulates its "
                         f"gradients in another dtype); set p.grad_dtype = {want} (the engine sums several backward "
                         "passes in fp32 itself: OffloadOptions(gradient_accumulation_steps=k))")
    return TypeError(f"the gradient of parameter {label} is {got}, and the engine trains in {want}: something cast "
                     f"the param after the engine was built: a model.to({got}) (cast the model first, then build the "
                     "engine), or a module that casts its own weights in forward (e.g. a router kept in float32, as "
                     "SwitchTransformers' router_dtype does: keep every trainable param in "
                     f"{want}, router_dtype={str(want).replace('torch.', '')!r}, or freeze it)")


def make_contiguous(param_groups: list[dict]) -> list[str]:
    """Makes every trainable param contiguous (channels_last, transposed: updates go into params as flat ranges, as
    DeepSpeed's flat buffers do; the values and the Parameter objects stay), with a warning naming them (returned);
    at build, and again when one was rebound non-contiguous after (``model.to(memory_format=...)``, between two
    steps: ``adopt_changed_params``; in a delayed step, a write: ``DelayedUpdate._publish``). One whose storage
    another param of the groups views (a tie through ``.t()``) is refused: a copy would untie them (the Trainer
    checks the model's buffers and other params too: ``launch_checks.refuse_view_ties``)."""
    changed = []
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad and p.layout != torch.strided:  # (torch's NotImplementedError for its storage)
                raise TypeError(f"parameter {param_label(group, p)} is {p.layout}: the engines train dense params, "
                                "copying updates into them as flat ranges (CPUAdam refuses it too); make it dense "
                                "(.to_dense()), or keep it out of the optimizer")
            if p.requires_grad and p.device.type != "meta" and not p.is_contiguous():
                other = next(((g, q) for g in param_groups for q in g["params"] if shares_storage(p, q)), None)
                if other is not None:
                    raise ValueError(view_tie_message(param_label(group, p), param_label(*other)))
                changed.append(param_label(group, p))
                p.data = p.data.contiguous()
    if changed:
        logger.warning("hf_zero_offload: %d trainable param(s) were not contiguous (channels_last or a transposed "
                       "view: %s%s) and are now: the engine copies updates into params as flat ranges",
                       len(changed), ", ".join(changed[:3]), ", ..." if len(changed) > 3 else "")
    return changed


def view_tie_message(param: str, other: str) -> str:
    """Why a non-contiguous param that views ``other``'s storage is refused (the engine's check and the Trainer's)."""
    return (f"parameter {param} is not contiguous and shares its storage with {other} (a transposed or strided view of "
            "it?): the engine copies updates into params as flat ranges, and a contiguous copy would untie the two; "
            "tie them through the module (weight = other.weight) or make it a parameter of its own (.contiguous())")


def shares_storage(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``q``, another tensor than ``p``, views ``p``'s storage. Asked of the tensors the caller knows (the
    groups' params; the model's params and buffers): a user's own reference (a state_dict kept aside) is no tie, and
    torch's storage use count could not tell the two apart."""
    if q is p or q.layout != torch.strided or p.layout != torch.strided:  # (a sparse param has no storage to ask
        return False                                                       # for; make_contiguous names a trainable one)
    ptr = p.untyped_storage().data_ptr()
    return ptr != 0 and q.untyped_storage().data_ptr() == ptr


def training_dtype(param_dtype: torch.dtype | None, fp16_on: bool, params: list) -> torch.dtype:
    """The dtype the device params train in: as asked, else fp16 with loss scaling, else the params' own (one
    dtype: the engine casts every trainable param to the training dtype, and taking the first param's cast the
    others without a word, e.g. a model's fp32 LayerNorms beside bf16 Linears)."""
    first = params[0]
    dtype = param_dtype or (torch.float16 if fp16_on else first.dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the parameters train in float32, bfloat16 or float16; got {dtype} (the first trainable "
                         f"param, shape {tuple(first.shape)}, or param_dtype): cast the model or pass param_dtype")
    if fp16_on and dtype != torch.float16:
        raise ValueError(f"fp16 loss scaling needs param_dtype float16, got {dtype}")
    if param_dtype is None and not fp16_on:
        other = next((p for p in params if p.dtype != dtype), None)
        if other is not None:
            raise ValueError(f"the trainable params have several dtypes ({dtype}: the first, shape "
                             f"{tuple(first.shape)}; {other.dtype}: shape {tuple(other.shape)}, ...) and every one "
                             "trains in one dtype: pass param_dtype= (they are cast to it) or cast the model first")
    return dtype


@dataclass
class Run:
    """Consecutive params of one group that all received a gradient and share a step count:
    one optimizer call covers the run."""
    group: int
    start: int
    end: int
    step: int
    slots: list


def make_runs(groups: list[list[int]], slots: list[tuple], received: list[bool], param_steps: list[int]) -> list[Run]:
    """``groups``: per param group, the flat slot indices in order."""
    runs: list[Run] = []
    for gi, idxs in enumerate(groups):
        cur = None
        for i in idxs:
            _, off, n = slots[i]
            if not received[i]:
                cur = None
                continue
            step = param_steps[i] + 1
            if cur is not None and cur.step == step and cur.end == off:
                cur.end = off + n
                cur.slots.append(i)
            else:
                cur = Run(gi, off, off + n, step, [i])
                runs.append(cur)
    return runs


class FlatIndex:
    """Which parameters a flat range touches (bisect over the sorted offsets)."""

    def __init__(self, slots: list[tuple]):
        self.slots = slots
        self.offsets = [off for _, off, _ in slots]

    def pieces(self, a: int, b: int):
        """(param, its offset, lo, hi): the part [lo, hi) of [a, b) that lies in each parameter."""
        i = max(bisect.bisect_right(self.offsets, a) - 1, 0)
        for p, off, n in self.slots[i:]:
            if off >= b:
                break
            lo, hi = max(a, off), min(b, off + n)
            if hi > lo:
                yield p, off, lo, hi
