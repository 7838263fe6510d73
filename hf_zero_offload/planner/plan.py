"""The memory plan: model-state bytes per configuration, traced activations, the largest batch that fits
(see the package docstring)."""
from __future__ import annotations

import difflib
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from ..args_view import hidden_size_of
from ..engine.buffers import plan_host_memory
from ..ops import STATE_DTYPES
from ..engine.options import OffloadOptions
from ..engine.sharded.plan import plan_for
from . import subset, trace
from .model_checks import check_positions, model_errors

GiB = 2 ** 30
SAFETY_BYTES = GiB // 2
SAFETY_FRACTION = 0.05
FP32, HALF, ADAM = 4, 2, 8  # bytes per param: fp32 tensor, 16-bit tensor, Adam's two fp32 moments

_HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# -- model states per configuration (bytes per rank; n = trainable params, N = ranks) ------------------
def _engine_defaults() -> dict:
    o = OffloadOptions()
    return {"bucket_numel": o.bucket_numel, "tile_numel": o.tile_numel}


@dataclass(frozen=True)
class EngineSettings:
    """What the engines' buffers depend on; defaults are ``OffloadOptions``' own."""
    bucket_numel: int
    tile_numel: int
    gradient_accumulation_steps: int = 1
    max_param_numel: int = 0
    cuda: bool = True
    half_dtype: torch.dtype = torch.float16
    numels: tuple = ()           # trainable params' sizes in flat-layout order (the sharded engine's buckets)


def _engine_plan(numel: int, s: EngineSettings, dpu: bool, state_dtype: str = "fp32"):
    return plan_host_memory(numel, param_dtype=s.half_dtype, gradient_accumulation_steps=s.gradient_accumulation_steps,
                            delayed_param_update=dpu, bucket_numel=s.bucket_numel, tile_numel=s.tile_numel,
                            max_param_numel=s.max_param_numel, cuda=s.cuda, state_dtype=state_dtype)


def states_baseline(n: int, gpus: int) -> tuple[dict, int]:
    """fp32 training, torch AdamW, DDP when gpus > 1: params 4 + grads 4 + Adam moments 8 B/param, and
    DDP's reducer keeps its own flat copy of the gradients (4 B/param; gradient_as_bucket_view=False,
    the Trainer's default)."""
    dev = {"params_fp32": FP32 * n, "grads_fp32": FP32 * n, "adam_moments": ADAM * n}
    if gpus > 1:
        dev["ddp_buckets"] = FP32 * n
    return dev, 0


def states_amp(n: int, gpus: int, autocast_copies: int) -> tuple[dict, int]:
    """torch AMP (plain --fp16/--bf16): the model stays fp32 (4 + grads 4 + Adam 8 B/param, DDP buckets
    4 B/param when gpus > 1) plus autocast's 16-bit copies of the weights that feed matmuls, which
    live from their first use in forward until backward has used them (measured by the trace)."""
    dev, _ = states_baseline(n, gpus)
    dev["autocast_weight_copies"] = autocast_copies
    return dev, 0


def _sharded_plan(gpus: int, s: EngineSettings, dtype: torch.dtype, *, stage: int, offload: bool, dpu: bool = False,
                  state_dtype: str = "fp32"):
    """What one rank of ``ShardedAdam`` allocates (the engine's own ``plan_for``)."""
    opts = OffloadOptions(gradient_accumulation_steps=s.gradient_accumulation_steps, bucket_numel=s.bucket_numel,
                          tile_numel=s.tile_numel, dpu=dpu, state_dtype=state_dtype)
    return plan_for(list(s.numels), gpus, param_dtype=dtype, options=opts, stage=stage, offload=offload, cuda=s.cuda)


def _device_regions(plan) -> dict:
    return {k: b for k, b in plan.bytes_by_region().items() if plan.regions[k][2] == "device" and b}


def states_stage1(n: int, gpus: int, s: EngineSettings, dtype: torch.dtype) -> tuple[dict, int]:
    """ZeRO-1 (--sharded_ddp): full params and full ``.grad`` in the training dtype until ``step()``
    reduces them; each rank's 1/N of fp32 masters, Adam moments and reduced gradients, the reduction
    rounds, the updated shard and the all-gather buffer: ``ShardedAdam``'s plan, on the device."""
    b = FP32 if dtype == torch.float32 else HALF
    tag = "fp32" if dtype == torch.float32 else "16bit"
    plan = _sharded_plan(gpus, s, dtype, stage=1, offload=False)
    return {f"params_{tag}": b * n, f"grads_{tag}": b * n, **_device_regions(plan)}, plan.host_bytes


def states_zero2(n: int, gpus: int, s: EngineSettings) -> tuple[dict, int]:
    """ZeRO-2 without offload: 16-bit params 2 B/param; gradients leave through two device buckets
    and each rank keeps only its 1/N of reduced gradients, fp32 masters and moments (``ShardedAdam``'s
    plan; the owned gradient slice is booked as live for the whole step)."""
    plan = _sharded_plan(gpus, s, s.half_dtype, stage=2, offload=False)
    return {"params_16bit": HALF * n, **_device_regions(plan)}, plan.host_bytes


def states_zero2_offload(n: int, gpus: int, s: EngineSettings, dpu: bool, state_dtype: str = "fp32"
                         ) -> tuple[dict, int]:
    """ZeRO-2 + CPU offload: the device keeps 16-bit params (2 B/param) and the engine's buffers; the
    host holds the engine's arena (fp32 masters, moments stored as ``state_dtype``, gradient store(s),
    staging; page-aligned regions). One GPU: ``OffloadAdam``'s ``plan_host_memory``; several:
    ``ShardedAdam``'s plan."""
    if gpus == 1:
        plan = _engine_plan(n, s, dpu=dpu, state_dtype=state_dtype)
    else:
        plan = _sharded_plan(gpus, s, s.half_dtype, stage=2, offload=True, dpu=dpu, state_dtype=state_dtype)
    return {"params_16bit": HALF * n, **_device_regions(plan)}, plan.host_bytes


# -- the rows ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSpec:
    name: str
    mode: str          # activation trace: "fp32" | "half" | "amp"
    keep_grads: bool   # all gradients stay on the device until step() (DDP, ZeRO-1)
    description: str
    state_dtype: str = "fp32"  # offload rows: how the host stores the Adam moments


def row_specs(dtype: str = "fp16", state_dtype: str = "fp32") -> list[RowSpec]:
    """``state_dtype``: the moments of the two offload rows; two more rows show bf16 and int8 moments."""
    st = "" if state_dtype == "fp32" else f", {state_dtype} moments"
    return [
        RowSpec("baseline", "fp32", True, "fp32, torch AdamW (DDP when gpus > 1)"),
        RowSpec(dtype, "amp", True, f"torch autocast {dtype}, fp32 params (DDP when gpus > 1)"),
        RowSpec("sharded_stage1_fp32", "fp32", True, "ZeRO-1 (--sharded_ddp), fp32"),
        RowSpec(f"sharded_stage1_{dtype}", "half", True, f"ZeRO-1 (--sharded_ddp --{dtype}), 16-bit params"),
        RowSpec("zero2", "half", False, f"ZeRO-2, {dtype}, no offload"),
        RowSpec("zero2_offload", "half", False, f"ZeRO-2 + CPU offload, {dtype}{st}", state_dtype),
        RowSpec("zero2_offload_dpu", "half", False, f"ZeRO-2 + CPU offload + delayed param update, {dtype}{st}",
                state_dtype),
        *(RowSpec(f"zero2_offload_state_{sd}", "half", False, f"ZeRO-2 + CPU offload, {dtype}, {sd} moments", sd)
          for sd in ("bf16", "int8")),
    ]


def row_states(spec: RowSpec, n: int, gpus: int, s: EngineSettings, prof) -> tuple[dict, int]:
    if spec.name == "baseline":
        return states_baseline(n, gpus)
    if spec.mode == "amp":
        return states_amp(n, gpus, prof.param_cast_bytes)
    if spec.name == "sharded_stage1_fp32":
        return states_stage1(n, gpus, s, torch.float32)
    if spec.name.startswith("sharded_stage1_"):
        return states_stage1(n, gpus, s, s.half_dtype)
    if spec.name == "zero2":
        return states_zero2(n, gpus, s)
    return states_zero2_offload(n, gpus, s, dpu=spec.name.endswith("_dpu"), state_dtype=spec.state_dtype)


@dataclass
class Row:
    name: str
    description: str
    device_bytes_model_states: int
    host_bytes: int
    # the line of the event that sets the peak at large batch sizes (see trace), minus the
    # state bytes the trace holds (kept grads, autocast copies); the const may be negative when the
    # gradients are not all alive yet at that moment. max_batch_size uses the exact peak.
    activation_bytes_per_sample: int
    activation_bytes_const: int
    max_batch_size: int
    device_bytes_total: int        # exact peak at max_batch_size (at 1 when nothing fits)
    device_bytes_budget: int
    device_states: dict = field(default_factory=dict)
    batch_size: int | None = None
    device_bytes_at_batch_size: int | None = None
    fits: bool | None = None


@dataclass
class Plan:
    model: str
    params: int
    max_param_numel: int
    gpus: int
    gpu_mem_gib: float
    dtype: str
    seq_len: int
    tgt_len: int
    rows: list
    seconds: float = 0.0
    exact_lines: bool = True
    gradient_checkpointing: bool = False
    cuda: bool = True                  # planned as the engines allocate with CUDA present
    run_dtype: str | None = None       # what the run that asked for the plan trains in, when one did
    inputs: dict = field(default_factory=dict)  # the arguments of plan(), echoed by --json
    model_class: str = ""              # the transformers class planned (planner/heads.py)
    frozen: int = 0                    # frozen params (--trainable, --peft-config), on the device in the row's dtype

    @property
    def bucket_elements(self) -> int:
        """The gradient buckets' size as plan_host_memory sizes them (a param is never split across buckets), where
        ``inputs["bucket_numel"]`` is the size asked for."""
        asked = self.inputs.get("bucket_numel") or OffloadOptions().bucket_numel
        return max(min(asked, self.params), self.max_param_numel, 1)

    def to_json(self) -> dict:
        return {"inputs": self.inputs, "params": self.params, "frozen_params": self.frozen,
                "gradient_bucket_numel": self.bucket_elements, "configs": [asdict(r) for r in self.rows]}


def device_budget(gpu_mem_gib: float) -> int:
    """Bytes torch may allocate: the card minus SAFETY_FRACTION of it minus SAFETY_BYTES."""
    return int(gpu_mem_gib * GiB * (1 - SAFETY_FRACTION)) - SAFETY_BYTES


MAX_BATCH_SEARCHED = 1 << 20  # the largest batch the search tries; a max_batch_size of it means "this or more"


def _max_batch(static: int, prof, keep: bool, budget: int) -> int:
    def fits(b):
        return static + prof.peak(b, keep) <= budget

    if not fits(1):
        return 0
    if fits(MAX_BATCH_SEARCHED):
        return MAX_BATCH_SEARCHED  # at least this: the report prints ">=" (a 1e30 GiB card read 1048575)
    hi = 2
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo) holds, fits(hi) does not (or the search cap was hit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _model_name(src) -> str:
    if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__"):
        return str(src)
    if isinstance(src, dict):
        return src.get("_name_or_path") or f"{src.get('model_type', '?')} config (dict)"
    return getattr(src, "name_or_path", "") or getattr(src, "model_type", type(src).__name__)


def _check_inputs(*, gpus, gpu_mem_gib, dtype, seq_len, tgt_len, batch_size, bucket_numel, tile_numel,
                  gradient_accumulation_steps, configs, state_dtype) -> None:
    """Every number and name before any model work; each message names the CLI flag (API keyword)."""
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_HALF_DTYPES)}, got {dtype!r}")
    # finite in bytes too: 1e308 GiB is a finite float whose byte count is not (int(inf) would be a traceback)
    if not (isinstance(gpu_mem_gib, (int, float)) and math.isfinite(gpu_mem_gib * GiB) and gpu_mem_gib > 0):
        raise ValueError(f"--gpu-mem-gib (gpu_mem_gib) must be a finite number > 0, got {gpu_mem_gib!r}")
    if device_budget(gpu_mem_gib) <= 0:
        raise ValueError(f"--gpu-mem-gib {gpu_mem_gib:g}: nothing left after the safety margin of "
                         f"{SAFETY_FRACTION:.0%} + {SAFETY_BYTES / GiB:g} GiB (give the card's memory in GiB)")
    for flag, value, least, optional in (("--gpus", gpus, 1, False), ("--seq-len", seq_len, 1, False),
                                         ("--tgt-len", tgt_len, 1, False), ("--batch-size", batch_size, 1, True),
                                         ("--bucket-numel", bucket_numel, 1, True), ("tile_numel", tile_numel, 1, True),
                                         ("--gradient-accumulation-steps", gradient_accumulation_steps, 1, False)):
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{flag} ({flag.lstrip('-').replace('-', '_')}) must be an integer >= {least}, "
                             f"got {value!r}")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"--state-dtype (state_dtype) must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
    if configs is not None:
        known = [s.name for s in row_specs(dtype)]
        unknown = [c for c in configs if c not in known]
        if unknown or not configs:
            # a shipped ds_config's name (zero2-offload) given for a row (zero2_offload): say which row it is
            close = [m[0] for c in unknown if (m := difflib.get_close_matches(c.replace("-", "_"), known, n=1))]
            raise ValueError(f"--configs: unknown row(s) {', '.join(map(repr, unknown)) or '(none given)'}"
                             f"{' (did you mean ' + ', '.join(close) + '?)' if close else ''}; "
                             f"rows for {dtype}: {', '.join(known)}")


def plan(model_config_or_path, *, gpus: int = 1, gpu_mem_gib: float = 24.0, dtype: str = "fp16",
         seq_len: int = 128, tgt_len: int = 128, batch_size: int | None = None, bucket_numel: int | None = None,
         tile_numel: int | None = None, gradient_accumulation_steps: int = 1, cuda: bool = True,
         configs: list[str] | None = None, gradient_checkpointing: bool = False, run_dtype: str | None = None,
         state_dtype: str = "fp32", trainable: str | None = None, peft_config: str | None = None,
         progress=None) -> Plan:
    """Plan every configuration for the model (a config JSON path, a model directory, a dict, a
    ``PretrainedConfig`` or a model with ``.config``) on ``gpus`` GPUs of ``gpu_mem_gib`` each.
    ``bucket_numel``: the gradient bucket size, ``"auto"`` (hidden_size**2, what a ds_config's "auto"
    reduce_bucket_size resolves to) or None (the engine's own default, 200M elements).
    ``cuda=False`` plans the engine as it allocates on a CPU-only machine (no separate bucket staging).
    ``run_dtype`` (``"fp32"``/``"fp16"``/``"bf16"``): what the calling run trains in, shown in the header.
    ``state_dtype``: the Adam moments of the offload rows (offload_optimizer.state_dtype). ``trainable``: a regular
    expression; only the params with a name it matches (``re.search``, any alias of a tied one) train, the rest are
    frozen (no gradient, no optimizer state: on the device in the training dtype). ``peft_config``: a PEFT adapter's
    ``adapter_config.json`` (or its folder): the model with that adapter, its params the trainable ones (needs
    peft). ``progress``: called
    with one line before the trace, the long part, once every input has been checked."""
    inputs = {k: v for k, v in locals().items() if k not in ("model_config_or_path", "progress")}
    t0 = time.perf_counter()
    auto_bucket = bucket_numel == "auto"  # as a ds_config's "auto" reduce_bucket_size resolves (every shipped one)
    bucket_numel = None if auto_bucket else bucket_numel
    _check_inputs(gpus=gpus, gpu_mem_gib=gpu_mem_gib, dtype=dtype, seq_len=seq_len, tgt_len=tgt_len,
                  batch_size=batch_size, bucket_numel=bucket_numel, tile_numel=tile_numel,
                  gradient_accumulation_steps=gradient_accumulation_steps, configs=configs,
                  state_dtype=state_dtype)
    if peft_config is not None:
        subset.adapter_folder(peft_config)  # a wrong path named before the model is built
    src = getattr(model_config_or_path, "config", model_config_or_path)
    config = trace.load_config(src)
    try:
        trace.model_class(config)  # (build_model asks again: a head it cannot plan is named with the file here)
    except ValueError as e:
        raise ValueError(f"{_model_name(src)}: {e}") from None
    with model_errors(_model_name(src), "build the model this config describes", "is a key missing or wrong?"):
        model = trace.build_model(config, gradient_checkpointing=gradient_checkpointing)
    check_positions(config, model, seq_len, tgt_len, _model_name(src))
    if peft_config is not None:
        model = subset.with_adapter(model, peft_config)
    if trainable is not None:
        subset.freeze_except(model, trainable, _model_name(src))
    n, max_numel = trace.count_params(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # (tied ones once)
    defaults = _engine_defaults()
    if auto_bucket:
        hidden = hidden_size_of(model)
        if not hidden:  # as the Trainer refuses "auto" there
            raise ValueError(f"--bucket-numel auto: {_model_name(src)} has no hidden size (hidden_size, d_model, "
                             "n_embd) to square, as a ds_config's \"auto\" reduce_bucket_size would; give a number")
        bucket_numel = hidden * hidden
        inputs["bucket_numel"] = bucket_numel
    settings = EngineSettings(bucket_numel or defaults["bucket_numel"], tile_numel or defaults["tile_numel"],
                              gradient_accumulation_steps, max_numel, cuda, _HALF_DTYPES[dtype],
                              tuple(p.numel() for p in model.parameters() if p.requires_grad))
    specs = [s for s in row_specs(dtype, state_dtype) if configs is None or s.name in configs]
    if progress is not None:
        progress(f"tracing {_model_name(src)} ({n / 1e6:.1f}M params) on the meta device, no weights: seconds to "
                 "minutes")
    with model_errors(_model_name(src), f"trace a training step at --seq-len {seq_len} --tgt-len {tgt_len}",
                       "are the lengths too long, or is a key of the config missing or wrong?"):
        profiles = trace.profile_modes(config, {s.mode for s in specs}, half_dtype=settings.half_dtype,
                                       seq_len=seq_len, tgt_len=tgt_len, model=model)
    budget = device_budget(gpu_mem_gib)
    rows = []
    for spec in specs:
        prof = profiles[spec.mode]
        dev, host = row_states(spec, n, gpus, settings, prof)
        if frozen:  # in the row's parameter dtype: the model's (fp32, amp) or the engine's cast of all of it
            dev[f"frozen_params_{'16bit' if spec.mode == 'half' else 'fp32'}"] = \
                (HALF if spec.mode == "half" else FP32) * frozen
        states = sum(dev.values())
        # state bytes the trace itself holds at its peak: kept gradients, autocast's weight copies
        in_trace = (prof.grad_bytes if spec.keep_grads else 0) + (prof.param_cast_bytes if spec.mode == "amp" else 0)
        static = states - in_trace
        mb = _max_batch(static, prof, spec.keep_grads, budget)
        at = max(mb, 1)
        a, b = prof.asymptote(spec.keep_grads)
        row = Row(spec.name, spec.description, states, host, b, a - in_trace, mb,
                  static + prof.peak(at, spec.keep_grads), budget, dev)
        if batch_size:
            row.batch_size = batch_size
            row.device_bytes_at_batch_size = static + prof.peak(batch_size, spec.keep_grads)
            row.fits = row.device_bytes_at_batch_size <= budget
        rows.append(row)
    inputs["model"] = _model_name(src)
    return Plan(_model_name(src), n, max_numel, gpus, gpu_mem_gib, dtype, seq_len, tgt_len, rows,
                time.perf_counter() - t0, all(p.aligned for p in profiles.values()), gradient_checkpointing,
                cuda, run_dtype, inputs, type(model).__name__, frozen)

