"""Activation memory, measured: one training step traced on a model that has no data.

The model is built from its config on the ``meta`` device (shapes, dtypes and ``nbytes``, no storage),
and one forward + backward runs under ``LiveBytes``, a ``TorchDispatchMode`` that sees every aten op
below autograd. Each op's new output storages are counted at creation (views of an input are not new)
and a weakref finalizer on the storage subtracts them when the storage dies, so ``live`` is what a
caching allocator would hold as "allocated" at each moment (allocator rounding and op-internal
workspaces are not seen: the planner's safety margin covers them).

Gradients: a post-accumulate-grad hook frees each parameter's gradient as soon as it is final (what
the bucketed engines do) and adds its size to ``kept``; ``live + kept`` is then the timeline of a
step that keeps every gradient until ``step()`` (DDP, ZeRO-1). One trace gives both.

Linearity in the batch size: with batch sizes B1 and B2 (both >= 2: B=1 takes other code paths in
broadcasting ops) the two traces emit the same sequence of events, so each event t has an exact
line ``live_t(B) = a_t + b_t * B`` and the peak at any B is ``max_t(a_t + b_t * B)`` -- convex, and
exact rather than a secant through two peaks (at small B the peak sits late in backward where
gradients dominate; at large B at the start of backward). When the sequences differ (a model with
data-dependent control flow) the two peaks give one line.

16-bit training, three ways. Checked against real CPU steps (``measure.py``, ``benchmarks/t5/planner_validate.py``,
t5-small, seq 128, batch 2 and 8): tracing in the row's own dtype was within 0.6 % in every mode;
"trace fp32 and halve" was off by -28 % to +7 % (it misses what stays fp32 or 1 byte: upcast
softmax and norms, dropout masks, the fp32 loss), so every row is traced in its own dtype:
- ``"fp32"``: the model in fp32.
- ``"half"``: the model itself in fp16/bf16 (the ZeRO engines: 16-bit params, fp32 masters in the
  optimizer), traced in that dtype on meta.
- ``"amp"``: torch autocast with fp32 params (plain ``--fp16``/``--bf16``, DDP). Meta tensors carry
  no autocast key, so this trace uses ``FakeTensorMode`` tensors that claim to be on the CPU and runs
  CPU autocast (no GPU needed). Its cast policy matches CUDA's for the ops a T5 step uses
  (linear/matmul to 16-bit; cross-entropy in fp32; T5 upcasts its softmax and norm itself); CUDA also upcasts
  softmax/layer_norm/pow/sum of 16-bit inputs, which models that feed those ops 16-bit tensors
  would see as extra fp32 copies. Autocast's fp16 copies of the weights are counted separately
  (``param_cast_bytes``): the planner books them as model states.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..extras import require
from ..fp32_logits import widen_logits
from .heads import model_class

TRACE_BATCHES = (2, 4)


_NO_DATA_SCALAR = {True: 0.0, False: 0}


def _tensors(x, out: list) -> list:
    """The tensors in an op's arguments or results (nested tuples/lists/dicts); faster than pytree."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _no_data(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


class LiveBytes(TorchDispatchMode):
    """Live bytes of storages created by the ops run under it, with an event timeline."""

    def __init__(self, ignore=()):
        super().__init__()
        self.live = 0
        self.kept = 0            # gradients dropped by the hook but booked as if kept
        self.peak = 0
        self.peak_keep = 0
        self.param_cast_bytes = 0
        self.timeline: list[int] = []       # live after each op
        self.timeline_keep: list[int] = []  # live + kept after each op
        self._seen = WeakIdKeyDictionary()
        self._params = {t.untyped_storage()._cdata for t in ignore}

    def _free(self, nbytes: int, _ref) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _no_data(args[0]):
            # .item() on a tensor without data (e.g. transformers' "is the attention mask all ones?"):
            # answer False/0, which keeps the general (materialised-mask) path: the conservative one.
            return _NO_DATA_SCALAR[args[0].dtype.is_floating_point]
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs), [])}
        out = func(*args, **kwargs)
        new = 0
        for t in _tensors(out, []):
            st = t.untyped_storage()
            if st._cdata in inputs or st in self._seen:
                continue  # a view of, or the same storage as, something already counted or not ours
            nb = st.nbytes()
            self._seen[st] = weakref.ref(st, lambda r, nb=nb: self._free(nb, r))
            new += nb
        if new:
            if func is torch.ops.aten._to_copy.default and inputs & self._params:
                self.param_cast_bytes += new   # autocast's 16-bit copy of a weight
            self.live += new
            self.peak = max(self.peak, self.live)
            self.peak_keep = max(self.peak_keep, self.live + self.kept)
        self.timeline.append(self.live)
        self.timeline_keep.append(self.live + self.kept)
        return out


@dataclass
class Trace:
    batch_size: int
    peak: int
    peak_keep: int
    param_cast_bytes: int
    grad_bytes: int
    timeline: list = field(repr=False, default_factory=list)
    timeline_keep: list = field(repr=False, default_factory=list)


# -- the model ---------------------------------------------------------------------------------------
def load_config(model_config_or_path):
    """A transformers config from a PretrainedConfig, a dict (with ``model_type``), a config JSON file
    or a model directory. Never touches the network: a path must exist."""
    require("hf_zero_offload.planner", "transformers")  # the [trainer] extra, named if missing
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config_or_path, PretrainedConfig):
        return model_config_or_path
    if isinstance(model_config_or_path, dict):
        d = dict(model_config_or_path)
        return AutoConfig.for_model(d.pop("model_type", "t5"), **d)
    path = os.fspath(model_config_or_path)
    if not os.path.exists(path):
        # the repository's architecture configs, from here or from the clone this package runs from (a relative
        # path typed outside the clone: the example script's --config_name says the same)
        clone = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        guesses = [os.path.join("configs", "models", f"{path}.json")]
        if not os.path.isabs(path):
            guesses += [os.path.join(clone, path), os.path.join(clone, "configs", "models", f"{path}.json")]
        hint = next((f"; did you mean {g}?" for g in guesses if os.path.isfile(g)), "")
        where = "" if os.path.isabs(path) else f", read from the current directory, {os.getcwd()}"
        raise FileNotFoundError(f"{path}: no such config file or model directory{where} (the planner works "
                                f"offline: pass a local config.json or a directory holding one{hint})")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        # transformers would say "Should have a `model_type` key in its config.json", of a file that is not there
        raise FileNotFoundError(f"{path}: a folder with no config.json in it (pass a model folder holding "
                                "config.json, or a config JSON file)")
    if not os.path.isdir(path) and not os.path.isfile(path):  # /dev/null, a pipe: transformers took it for a Hub id
        raise ValueError(f"{path}: not a regular file (pass a config JSON file or a model folder)")
    try:
        return _numbers_checked(AutoConfig.from_pretrained(path, local_files_only=True))
    except Exception as e:  # noqa: BLE001 -- a value of the wrong type is huggingface_hub's own exception class
        if isinstance(e, ImportError):
            raise
        message = " ".join(str(e).split())
        if isinstance(e, OSError) and path in message:
            raise  # transformers' own message already names the file
        # every other failure to read the file is the file's fault: say which file (the message may not)
        raise ValueError(f"{path}: not a model config transformers can read ({type(e).__name__}: {message})") from e


def _numbers_checked(config):
    """A number given as text ("d_model": "big") refused by name, as transformers >= 5.x's strict config dataclasses
    do ("Field 'd_model' expected int"); older ones loaded it and torch failed far inside the model's build with
    "type must be tuple of ints, but got str", naming no key. Only keys whose class default is a number are read."""
    try:
        defaults = type(config)()
    except Exception:  # noqa: BLE001 -- a class that needs arguments: transformers' own checks only
        return config
    for key, value in config.to_dict().items():
        ref = getattr(defaults, key, None)
        if isinstance(value, str) and isinstance(ref, (int, float)) and not isinstance(ref, bool):
            raise TypeError(f"Field {key!r} expected {type(ref).__name__}, got str (value: {value!r})")
    return config


def build_model(config, *, dtype: torch.dtype = torch.float32, device="meta", gradient_checkpointing: bool = False):
    cls = model_class(config)  # (transformers' own error for a config without the head listed ~200 classes)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    if gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
        # What the Trainer's --gradient_checkpointing turns on (non-reentrant: both its default and
        # the one whose saved tensors the trace sees; the method was renamed in Transformers 5).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def to_fake(model, fake_mode, dtype: torch.dtype | None = None):
    """Replace every param/buffer by a FakeTensor on the CPU (floating ones in ``dtype`` when given),
    keeping tied params tied."""
    memo = {}
    with fake_mode:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in store.items():
                    if t is None:
                        continue
                    if id(t) not in memo:
                        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
                        new = torch.empty(t.shape, dtype=dt, device="cpu")
                        if isinstance(t, torch.nn.Parameter):
                            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                        memo[id(t)] = new
                    store[name] = memo[id(t)]
    return model


def dummy_batch(config, batch_size: int, seq_len: int, tgt_len: int, device="meta", padded: bool = False) -> dict:
    """``padded``: one padding position, as most training batches have (an SDPA model then builds its attention
    mask, which it skips for a batch without padding; on meta it cannot tell, and always builds it)."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if padded:
        batch["attention_mask"][0, -1] = 0
    if getattr(config, "is_encoder_decoder", False):
        batch["labels"] = torch.zeros(batch_size, tgt_len, dtype=torch.long, device=device)
    else:
        batch["labels"] = ids.clone()
    return batch


def loss_of(model, batch):
    return model(**batch).loss  # the outputs (logits) die here, as in Trainer.compute_loss


@contextlib.contextmanager
def _fused_attention_on_meta():
    """``scaled_dot_product_attention`` on meta tensors takes its math path (no fused kernel is registered for the
    meta device), which creates the seq x seq attention scores that a real step never holds: on the CPU the fused
    flash kernel runs, on a GPU flash or memory-efficient attention, each keeping only the output and a logsumexp.
    Traced through the CPU flash kernel's meta function instead (a Llama-shaped model at seq 2048 traced 8.5x its
    real CPU step). With dropout the math path stays (the CPU kernel runs none), and with a mask that needs a gradient
    (T5's learned position bias): the fused kernels take none, so a real step runs the math path too."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or dropout_p or (attn_mask is not None and attn_mask.requires_grad):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # (grouped-query attention too: the kernel reads the shared key/value heads as they are)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = attn_mask.to(query.dtype)  # the kernel keeps a copy in the query's dtype for backward
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def trace_step(model, batch: dict, *, autocast_dtype: torch.dtype | None = None, fake_mode=None) -> Trace:
    """One forward + backward of ``model`` on ``batch`` under ``LiveBytes`` (works on meta, fake and
    real tensors). Gradients are freed by a hook as soon as they are final and booked in ``kept``."""
    params = list(model.parameters())
    tracker = LiveBytes(ignore=params)
    grad_bytes = 0

    def hook(p):
        nonlocal grad_bytes
        nb = p.grad.untyped_storage().nbytes()
        grad_bytes += nb
        tracker.kept += nb
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
    device_type = "cpu"
    amp = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    try:
        with fake_mode or contextlib.nullcontext(), tracker, _fused_attention_on_meta():
            with amp:
                loss = loss_of(model, batch)
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    bs = next(iter(batch.values())).shape[0]
    return Trace(bs, tracker.peak, tracker.peak_keep, tracker.param_cast_bytes, grad_bytes,
                 tracker.timeline, tracker.timeline_keep)


# -- lines in the batch size -------------------------------------------------------------------------
@dataclass
class ActivationProfile:
    """Per-event lines ``a + b * B`` (bytes) for the two gradient policies of one traced mode."""
    mode: str                    # "fp32" | "half" | "amp"
    a: np.ndarray                # drop-gradients timeline intercepts
    b: np.ndarray
    a_keep: np.ndarray           # keep-gradients timeline
    b_keep: np.ndarray
    grad_bytes: int              # all gradients of one step in the traced dtype
    param_cast_bytes: int        # autocast's weight copies (amp only)
    aligned: bool                # event-by-event lines (False: one line through the two peaks)
    traces: list = field(repr=False, default_factory=list)

    def lines(self, keep: bool):
        return (self.a_keep, self.b_keep) if keep else (self.a, self.b)

    def peak(self, batch_size: int, keep: bool) -> int:
        a, b = self.lines(keep)
        return int(np.max(a + b * batch_size))

    def asymptote(self, keep: bool) -> tuple[int, int]:
        """(intercept, slope) of the event that sets the peak at large batch sizes: the steepest line
        (the highest among equally steep ones). Its slope is the activation cost of one sample."""
        a, b = self.lines(keep)
        i = int(np.lexsort((a, b))[-1])
        return int(round(a[i])), int(round(b[i]))


def _fit(t1: Trace, t2: Trace, keep: bool):
    y1 = t1.timeline_keep if keep else t1.timeline
    y2 = t2.timeline_keep if keep else t2.timeline
    db = t2.batch_size - t1.batch_size
    if len(y1) == len(y2):
        y1, y2 = np.asarray(y1, dtype=np.float64), np.asarray(y2, dtype=np.float64)
        b = (y2 - y1) / db
        return y1 - b * t1.batch_size, b, True
    p1, p2 = (t1.peak_keep, t2.peak_keep) if keep else (t1.peak, t2.peak)
    b = (p2 - p1) / db
    return np.array([p1 - b * t1.batch_size]), np.array([b]), False


MODES = ("fp32", "half", "amp")


def _batch(config, bs, seq_len, tgt_len, fake_mode):
    if fake_mode is None:
        return dummy_batch(config, bs, seq_len, tgt_len, "meta")
    with fake_mode:
        return dummy_batch(config, bs, seq_len, tgt_len, "cpu")


def profile_modes(config, modes=MODES, *, half_dtype: torch.dtype = torch.float16, seq_len: int = 128,
                  tgt_len: int = 128, batches=TRACE_BATCHES, model=None) -> dict:
    """Trace one training step at two batch sizes in each of ``modes`` ("fp32" | "half" | "amp") on
    one meta model (built once; converted in place fp32 -> 16-bit -> fake fp32 for autocast)."""
    model = model if model is not None else build_model(config)
    out = {}
    widened = None
    for mode in [m for m in MODES if m in modes]:
        fake_mode, autocast_dtype = None, None
        if mode == "half":  # the engine's step: the model cast, its logits widened to fp32 (trainer/loss_precision.py)
            model.to(half_dtype)
            widened = widen_logits(model)
        elif mode == "amp":
            if widened is not None:  # the plain Trainer's: autocast alone
                widened.remove()
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode, autocast_dtype = FakeTensorMode(), half_dtype
            to_fake(model, fake_mode, torch.float32)
        traces = [trace_step(model, _batch(config, bs, seq_len, tgt_len, fake_mode), autocast_dtype=autocast_dtype,
                             fake_mode=fake_mode) for bs in batches]
        t1, t2 = traces[0], traces[-1]
        a, b, aligned = _fit(t1, t2, keep=False)
        ak, bk, aligned_k = _fit(t1, t2, keep=True)
        for t in traces:  # the lines are all we keep
            t.timeline, t.timeline_keep = [], []
        out[mode] = ActivationProfile(mode, a, b, ak, bk, t2.grad_bytes, t2.param_cast_bytes, aligned and aligned_k,
                                      traces)
    if widened is not None:  # (a caller's model is left as it came)
        widened.remove()
    return out


def profile_activations(config, mode: str, **kwargs) -> ActivationProfile:
    return profile_modes(config, (mode,), **kwargs)[mode]


def count_params(model) -> tuple[int, int]:
    """(trainable params, largest trainable param) counting tied params once."""
    ps = [p for p in model.parameters() if p.requires_grad]  # parameters() yields each tensor once
    return sum(p.numel() for p in ps), max((p.numel() for p in ps), default=0)

