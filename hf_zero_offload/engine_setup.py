"""A resolved TrainingConfig as an engine: its typed options, the training dtype, the engine for the world
size, and the one line the Trainer logs at its start. No transformers here (the Trainer passes its values)."""
from __future__ import annotations

import logging
import os
import re
import shlex

import torch
import torch.distributed as dist

from . import ops
from .config import ConfigError, TrainingConfig
from .engine import OffloadOptions, ShardOptions, factory
from .adam.flags import IMPLEMENTATION_FLAGS, MATH_FLAGS, adamw_mode
from .engine import param_names
from .launch_checks import LaunchError, first_names, launch_count

logger = logging.getLogger("hf_zero_offload")


def step_threads(explicit: int | None) -> int:
    """Threads of this rank's CPU optimizer step (and its gradient norms and accumulation): ``explicit``
    (offload_optimizer.cpu_threads) when given. Otherwise, with several ranks on this node
    (LOCAL_WORLD_SIZE > 1), this rank's share of the CPUs it may run on: torchrun sets OMP_NUM_THREADS=1
    for every rank of such a launch, and torch's thread count, which the kernels follow by default, would
    leave the step on one core per rank while the rest of the host idles (the step is the part of a
    ZeRO-Offload run that needs the host's cores and memory bandwidth); ranks started another way would
    each take all the cores. An OMP_NUM_THREADS other than torchrun's 1 is the user's choice and is kept,
    as it is alone on the node: torch's own thread count. Ranks that SLURM's ``srun`` started without torchrun
    take SLURM_CPUS_PER_TASK, else their share as torchrun's (``_slurm_tasks``). The result does not depend on
    it: the kernels give the same bits at any thread count."""
    if explicit is not None:
        return explicit
    try:  # read as the launch checks and Accelerate read it: " 2" is two ranks
        local_ranks = launch_count(os.environ, "LOCAL_WORLD_SIZE")
    except LaunchError:  # not a count: check_launch_env names it before a Trainer run gets here
        local_ranks = 1
    user_omp = os.environ.get("OMP_NUM_THREADS", "1").strip() not in ("", "1")
    # srun's tasks, no torchrun: an OMP_NUM_THREADS there, 1 included, is the user's (only torchrun sets 1 itself)
    if local_ranks is None and "OMP_NUM_THREADS" not in os.environ:
        local_ranks = _slurm_tasks(os.environ)
        if local_ranks:
            return _slurm_threads(os.environ, local_ranks)
    local_ranks = local_ranks or 1
    if local_ranks == 1 or user_omp:
        return max(1, torch.get_num_threads())
    return max(1, _usable_cpus() // local_ranks)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (taskset, a cpuset, srun's binding)
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _count(value) -> int | None:
    return int(value) if value is not None and value.strip().isdecimal() and int(value) > 0 else None


def _slurm_tasks(env) -> int | None:
    """This node's task count in an ``srun`` step of several tasks per node started without torchrun (SLURM sets
    no LOCAL_WORLD_SIZE and no OMP_NUM_THREADS: each task took every core, torch's default, 8 x 32 step threads for
    8 tasks on 32 cores), from SLURM_STEP_TASKS_PER_NODE ("2(x3),1": per node, SLURM_NODEID's entry); None outside
    such a step (a batch script's one process, the job-wide SLURM_TASKS_PER_NODE notwithstanding), for one task,
    or where unreadable."""
    if "SLURM_LOCALID" not in env:
        return None
    node = env.get("SLURM_NODEID", "0").strip()
    if not node.isdecimal():  # (-1: unreadable, not node 0)
        return None
    node = int(node)
    for part in (env.get("SLURM_STEP_TASKS_PER_NODE") or "").split(","):  # walked, not expanded: "2(x3000000000)"
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        if node < int(match[2] or 1):
            tasks = int(match[1])
            return tasks if tasks > 1 else None
        node -= int(match[2] or 1)
    return None


def _slurm_threads(env, tasks: int) -> int:
    """A task's step threads among ``tasks`` on the node: SLURM_CPUS_PER_TASK (no more than the CPUs it may use: from
    SLURM 22.05 srun no longer takes sbatch's value, which stays in the environment); else, when srun bound the task
    to fewer CPUs than the node has, those CPUs; else the node's share."""
    cpus = _usable_cpus()
    per_task = _count(env.get("SLURM_CPUS_PER_TASK"))
    if per_task:
        return max(1, min(per_task, cpus))
    on_node = _count(env.get("SLURM_CPUS_ON_NODE"))
    if on_node and cpus < on_node:
        return cpus
    return max(1, cpus // tasks)


def engine_options(cfg: TrainingConfig) -> tuple[OffloadOptions, ShardOptions]:
    """The resolved config as the engine's typed options."""
    z = cfg.zero
    options = OffloadOptions(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_grad_norm=cfg.gradient_clipping,
        fp16=cfg.fp16 if cfg.fp16.enabled else None, bucket_numel=z.reduce_bucket_size, pin_memory=z.pin_memory,
        dpu=z.delayed_param_update.enabled, dpu_warmup_steps=z.delayed_param_update.warmup_steps,
        state_dtype=z.state_dtype, num_threads=step_threads(z.cpu_threads), skip_nonfinite=cfg.check_grad_overflow)
    shard = ShardOptions(stage=z.stage, offload=z.offload, allgather_bucket_numel=z.allgather_bucket_size,
                         reduce_scatter=z.reduce_scatter)
    return options, shard


def training_dtype(cfg: TrainingConfig) -> torch.dtype:
    return torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16 else torch.float32


def build_engine(param_groups: list[dict], cfg: TrainingConfig, args, groups_decide: bool = False, device=None):
    """The engine for this config and world size (the optimizer the Trainer will drive). ``args``: the
    TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, world_size, sharded_ddp are read).
    ``groups_decide``: the groups carry their own lr, betas, eps and weight decay (``groups_from_optimizer``),
    which the config's "optimizer" block does not replace. ``device``: where the params train, when the model is
    still on the CPU (the engine moves each in the training dtype once its master is taken)."""
    opt = cfg.optimizer
    hyper = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, adamw_mode=opt.adam_w_mode) if opt else dict(
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, adamw_mode=True)
    if opt is not None and not groups_decide:  # the config's weight decay replaces the Trainer's for the decayed group
        param_groups = [{**g, "weight_decay": opt.weight_decay if g["weight_decay"] else 0.0} for g in param_groups]
    options, shard = engine_options(cfg)
    gas, dtype = options.gradient_accumulation_steps, training_dtype(cfg)
    if factory.choose(args.world_size, shard, sharded_ddp=args.sharded_ddp)[1] == 1 and dtype != torch.float32 \
            and gas > 1 and cfg.grad_accum_fp32:  # (DeepSpeed's BF16_Optimizer sums there in fp32; this engine cannot)
        raise ConfigError(f"{cfg.source}: data_types.grad_accum_dtype \"fp32\" with ZeRO stage 1, a "
                          f"{str(dtype).replace('torch.', '')} model and gradient_accumulation_steps {gas}: stage 1 "
                          "reduces the params' .grad once a step, where autograd sums the micro-batches in the params' "
                          "dtype; use \"stage\": 2 (it sums them in fp32), or drop the key")
    engine = factory.build_engine(param_groups, world_size=args.world_size, shard=shard, options=options,
                                  param_dtype=dtype, sharded_ddp=args.sharded_ddp, device=device,
                                  **hyper)
    if getattr(engine, "stage", None) == 1 and engine.param_dtype != torch.float32 and gas > 1 and engine.rank == 0:
        # stage 1 reduces the full .grad once a step, so torch's autograd sums the micro-batches there, in the param
        # dtype (as a plain DDP run of a 16-bit model does); stage 2 and the one-process engine sum them in fp32
        logger.warning("hf_zero_offload: ZeRO stage 1 sums the %d micro-batches of a step in the params' .grad, in %s "
                       "(as DDP does with a %s model); stage 2 sums them in fp32: use \"stage\": 2 for the fp32 sum",
                       gas, str(engine.param_dtype).replace("torch.", ""),
                       str(engine.param_dtype).replace("torch.", ""))
    return engine


def groups_from_optimizer(opt, where: str, model) -> list[dict]:
    """The param groups of the torch.optim.AdamW / Adam that ``where`` (a user's ``create_optimizer``) built, as
    the engine's groups: each group's params (frozen ones left out: AdamW never steps them), lr, betas, eps,
    weight decay and Adam/AdamW mode, and its other keys (a name, a layer index). Anything whose result the
    engine cannot reproduce is refused by name: another optimizer class (a subclass may change step()),
    amsgrad/maximize/differentiable, a state already stepped, a trainable param left out of every group (the
    plain Trainer's clipping and logged grad norm count it; the engine's norm would not)."""
    cls = type(opt)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls not in (torch.optim.AdamW, torch.optim.Adam):
        raise ConfigError(f"{where} returned a {name}: with zero_offload the optimizer is hf_zero_offload's Adam/AdamW "
                          "engine, which takes over the param groups (lr, betas, eps, weight_decay per group) of a "
                          "torch.optim.AdamW or torch.optim.Adam only; return one of those there, or train without "
                          "zero_offload")
    if opt.state:
        raise ConfigError(f"{where} returned a {name} that has already stepped: the engine starts from zero moments; "
                          "return a new optimizer there")
    groups = []
    for i, g in enumerate(opt.param_groups):
        bad = [f"{k}={g[k]!r} ({why})" for k, why in MATH_FLAGS.items() if g.get(k)]
        if bad:
            raise ConfigError(f"{where} returned a {name} with {', '.join(bad)} in param group {i}: the zero_offload "
                              "engine cannot run that; remove the option there, or train without zero_offload")
        # a group with no trainable param stays, empty: the LR log (group 0) and a per-group LambdaLR count groups
        params = [p for p in g["params"] if p.requires_grad]
        # implementation flags (foreach, fused, capturable) choose how torch runs the math: the engine runs its own;
        # param_names (an optimizer built from named_parameters()) would name the frozen params left out too: the
        # model's names of the params kept are set below
        rest = {k: v for k, v in g.items() if k not in (*IMPLEMENTATION_FLAGS, *MATH_FLAGS, "params",
                                                        "decoupled_weight_decay", param_names.KEY)}
        adamw = bool(adamw_mode(g, default=cls is torch.optim.AdamW))  # (torch's Adam: decoupled_weight_decay's)
        groups.append({**rest, "params": params, "lr": float(g["lr"]), "betas": tuple(float(b) for b in g["betas"]),
                       "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]), "adamw_mode": adamw})
    named_params = list(model.named_parameters(remove_duplicate=False))  # every alias of a tied param
    taken, models = {id(p) for g in groups for p in g["params"]}, {id(q) for _, q in named_params}
    outside = [tuple(p.shape) for g in groups for p in g["params"] if id(p) not in models]
    if outside:
        raise ConfigError(f"{where} put {len(outside)} parameter(s) that are not the model's in its param groups "
                          f"(shapes {', '.join(map(str, outside[:5]))}): the plain Trainer counts and clips only the "
                          "model's, and the engine saves its state by the model's parameter names; make them part of "
                          "the model (an nn.Parameter attribute of a module) or train without zero_offload")
    names = param_names.smallest_names(named_params)
    for g in groups:  # the engine keeps the names, and a load compares them (engine/param_names.py)
        g[param_names.KEY] = [names[id(p)] for p in g["params"]]
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in taken]
    if left:
        raise ConfigError(f"{where} left {len(left)} trainable parameter(s) out of its param groups "
                          f"({first_names(left)}): the plain Trainer clips them and counts them in grad_norm, the "
                          "zero_offload engine would not; freeze them (requires_grad_(False)) or put them in a group")
    return groups


def check_user_groups(cfg: TrainingConfig, raw: dict, groups: list[dict], where: str) -> None:
    """The groups of ``where`` (``groups_from_optimizer``) against the ds_config (``raw``: as the user wrote it,
    resolved into ``cfg``): its "optimizer" block may not set the values the groups carry, and a scheduler that sets
    one LR for every group is said to replace theirs."""
    block = (raw.get("optimizer") or {}).get("params") or {}
    explicit = sorted(k for k, v in block.items() if v != "auto")
    if explicit:  # two sources for the same values: which one runs would be a guess
        raise ConfigError(f"{cfg.source}: the \"optimizer\" block sets {', '.join(explicit)} and {where} builds "
                          "its own param groups with their own values: set them in one place (\"auto\" in the "
                          "block, or leave the groups to the mixin)")
    lrs = sorted({float(g["lr"]) for g in groups})
    if cfg.scheduler is not None and cfg.scheduler.type in ("WarmupLR", "WarmupDecayLR") and \
            lrs != [cfg.scheduler.warmup_max_lr]:
        # (one LR that differs from the block's too: optimizer_cls_and_kwargs' lr trained at --learning_rate, silent)
        logger.warning("hf_zero_offload: %s gives its param groups the learning rate(s) %s, and %s's scheduler %s "
                       "sets one LR for every group, warmup_max_lr %g (as in DeepSpeed): the groups' LRs are "
                       "replaced; WarmupCosineLR or --lr_scheduler_type scale each group's own", where,
                       ", ".join(f"{x:g}" for x in lrs), cfg.source, cfg.scheduler.type, cfg.scheduler.warmup_max_lr)


def _bytes(n: int) -> str:
    """A size for the start line: a small model's few MiB must not read as 0.00GiB (as if nothing were reserved)."""
    return f"{n / 2**30:.2f}GiB" if n >= 2**30 else f"{n / 2**20:.1f}MiB"


def _host_bytes(eng) -> int:
    """The engine's host memory: its arena, and on a CPU-only run the plan's "device" regions too, which live in
    host RAM there (the line left out 63 MiB of gradient buckets of t5-small's 887, and read 0 for --sharded_ddp
    without offload)."""
    arena, plan = getattr(eng, "arena", None), getattr(eng, "plan", None)
    on_cpu = getattr(getattr(eng, "device", None), "type", "cpu") == "cpu"
    return getattr(arena, "nbytes", 0) + (getattr(plan, "device_bytes", 0) if on_cpu else 0)


def start_line(cfg: TrainingConfig, eng, world_size: int, device) -> str:
    """What the run is: config, ranks, backend, engine, moments, SIMD level, reserved host memory, streams."""
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    arena = getattr(eng, "arena", None)
    source = str(cfg.source)  # a file's path quoted where it holds a space: the line is key=value pairs
    source = shlex.quote(source) if os.path.exists(source) and any(c.isspace() for c in source) else source
    return (f"hf_zero_offload: config={source} ranks={world_size} backend={backend} device={device} "
            f"dtype={str(training_dtype(cfg)).replace('torch.', '')} engine={type(eng).__name__} "
            f"stage={_stage(cfg, eng)} offload={getattr(eng, 'offload', True)} "
            f"dpu={cfg.zero.delayed_param_update.enabled} "
            f"lr_schedule={cfg.scheduler.type if cfg.scheduler is not None else 'trainer'} "
            f"moments={getattr(getattr(eng, 'moments', None), 'state_dtype', '-')} simd={ops.simd_level()} "
            f"threads={torch.get_num_threads()} step_threads={getattr(getattr(eng, 'options', None), 'num_threads', '-')} "
            f"host_reserved={_bytes(_host_bytes(eng))} "
            f"pinned={getattr(arena, 'pinned', False)} params={eng.numel} streams={eng.streams.kind}")


def _stage(cfg: TrainingConfig, eng) -> str:
    """The stage the engine runs, and the config's where they differ (one process offloads as stage 2: the
    gradients leave during backward; --sharded_ddp without a stage runs 2): a "stage": 1 file read "stage=2"."""
    ran = getattr(eng, "stage", "-")
    return f"{ran}(config:{cfg.zero.stage})" if cfg.zero.stage not in (0, ran) else str(ran)


def accumulation_problem(engine, gas: int) -> str | None:
    """Why ``engine`` cannot sum ``gas`` micro-batches per step, or None. Its host gradient store was sized when it
    was built: a 16-bit one holds one micro-batch per step, and summing several there rounds each partial sum to 16
    bits (a bf16 ulp off an engine built for them after 3 steps, silently); ZeRO-1 reduces ``.grad`` once a step."""
    store, built = getattr(engine, "store", None), engine.options.gradient_accumulation_steps
    if gas <= 1 or getattr(engine, "stage", 2) != 2 or store is None or store.dtype == torch.float32:
        return None
    return (f"gradient_accumulation_steps {gas} with an engine built for {built} micro-batch(es) per step: its host "
            f"gradient store holds {str(store.dtype).replace('torch.', '')} gradients and would round each sum of "
            f"{gas} micro-batches to 16 bits (an engine built for {gas} sums them in fp32)")

