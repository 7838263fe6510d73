"""Checks of how the run was launched and of TrainingArguments the engine cannot honour, made before any model work,
and of the model at each ``train()`` start (the Trainer integration calls them).

Nothing here imports transformers: ``args`` is any object with TrainingArguments' attributes.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
from enum import Enum

import torch
import torch.distributed as dist

from .config import ConfigError
from .switches import switch_problems
from .engine.runs import shares_storage, view_tie_message

logger = logging.getLogger("hf_zero_offload")


class LaunchError(ConfigError):
    """The launch and the Trainer disagree (e.g. torchrun started several processes, the Trainer sees one)."""


# MPI launchers name the rank their own way; Accelerate reads these instead of RANK (and needs no MASTER_ADDR
# with the mpi backend), so their launches are left to it.
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def launch_count(env, name: str) -> int | None:
    """torchrun's count ``name`` in ``env`` as Accelerate and torch read it (``int()``, surrounding blanks
    allowed), None when unset; anything else, ``int()``'s other forms included (``+2``, ``2_0``, ``-1``), is refused
    by name. Every check reads the variables through this one parse: one that skipped the blanks took
    ``WORLD_SIZE=" 2"`` for one process while Accelerate started two."""
    value = env.get(name)
    if value is None:
        return None
    if not value.strip().isdecimal():  # isdecimal, not isdigit: "²" is a digit that int() refuses
        raise LaunchError(f"{name}={value!r}: not a count (torchrun sets it to a non-negative integer)")
    return int(value)


def check_launch_env(env=None) -> None:
    """torchrun's variables, checked before TrainingArguments sets up the process group (its first use of them).
    Left to Accelerate and torch, a partial or inconsistent set either hangs (``RANK=2 WORLD_SIZE=2``: rank 2 waits
    at the rendezvous for ranks that never come, 30 minutes by default) or fails with a message about something
    else (``WORLD_SIZE=2`` alone: "multinode ... MASTER_ADDR"; ``LOCAL_RANK`` alone, a leftover of another launch:
    "MASTER_ADDR expected"; ``WORLD_SIZE=two``: an int() traceback). One error naming the variable instead. A group
    the user initialised before is not checked here (their variables may be absent): ``check_world_size`` compares
    its size with the Trainer's."""
    if dist.is_available() and dist.is_initialized():
        return
    env = os.environ if env is None else env

    world, rank = launch_count(env, "WORLD_SIZE"), launch_count(env, "RANK")
    local_rank, local_world = launch_count(env, "LOCAL_RANK"), launch_count(env, "LOCAL_WORLD_SIZE")
    hint = "start every process with torchrun (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT " \
           "in each, as torchrun does), or unset them all for one process"
    if world == 0:
        raise LaunchError(f"WORLD_SIZE=0: a run needs at least one process; {hint}")
    if world is None:
        stray = [f"{n}={env[n]}" for n in ("RANK", "LOCAL_RANK") if n in env]
        if stray:
            raise LaunchError(f"{' and '.join(stray)} set without WORLD_SIZE (a leftover of another launch?); {hint}")
        return
    if rank is not None and rank >= world:
        raise LaunchError(f"RANK={rank} with WORLD_SIZE={world}: ranks are 0..{world - 1}, this process would wait "
                          f"for the others forever; {hint}")
    if local_world is not None and local_world > world:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_world} > WORLD_SIZE={world}; {hint}")
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise LaunchError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world}: local ranks are "
                          f"0..{local_world - 1}; {hint}")
    if world > 1 and not any(n in env for n in _MPI_RANK_VARS):
        missing = [n for n in ("RANK", "MASTER_ADDR") if not env.get(n)]
        if missing:
            raise LaunchError(f"WORLD_SIZE={world} but {' and '.join(missing)} not set: this process cannot know "
                              f"which rank it is or where to meet the others; {hint}")


def _use_cpu_hint() -> str:
    return "--use_cpu (use_cpu=True; the gloo backend follows)" if not torch.cuda.is_available() else \
        "a CUDA device per process, or --use_cpu (use_cpu=True) for CPU training"


def check_world_size(args) -> None:
    """torchrun on CPUs without ``--use_cpu``: every process trains alone on all the data and all of them write
    ``rank0_of_1`` into the same output_dir. Stop with the one flag that fixes it. The same for a process group the
    user initialised before the Trainer without torchrun's variables: Accelerate, which reads only those, sees one
    process, and each rank would train alone (and meet the others' run lock in a shared output_dir)."""
    launched = launch_count(os.environ, "WORLD_SIZE") or 1
    if launched > 1 and args.world_size == 1:
        raise LaunchError(
            f"WORLD_SIZE={launched} (torchrun) but the Trainer sees 1 process: each rank would train alone on all "
            f"the data and write into the same output_dir. Add {_use_cpu_hint()}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != args.world_size:
        raise LaunchError(
            f"torch.distributed is initialised with {dist.get_world_size()} ranks (backend {dist.get_backend()}) "
            f"but the Trainer sees {args.world_size}: each rank would train alone on all the data. Set RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each process before creating the "
            f"TrainingArguments (Accelerate reads those, not the group), or start with torchrun; on CPUs also "
            f"{_use_cpu_hint()}")


def warn_fp16_on_cpu(args, fp16: bool) -> None:
    if fp16 and (getattr(args, "use_cpu", False) or not torch.cuda.is_available()):
        # the advice of warn_bf16_on_cpu too: --bf16 only where the CPU runs bf16 matmuls natively (it told users of
        # other CPUs to take --bf16, and the next run's warning to drop it)
        instead = ("use --bf16 for 16-bit training on this CPU (it has AVX512-BF16 or AMX)" if cpu_has_native_bf16()
                   else "drop --fp16 to train in fp32 (on a CPU, --bf16 helps only with AVX512-BF16 or AMX)")
        logger.warning("hf_zero_offload: --fp16 on a CPU-only run: CPUs emulate fp16 arithmetic (~20x slower than "
                       "bf16 or fp32); %s", instead)


def warn_full_eval_trains(args) -> None:
    """--bf16_full_eval (--fp16_full_eval) alone: the plain Trainer trains in fp32 and evaluates in 16 bits; here, as
    under transformers' DeepSpeed integration, the one device model is 16-bit, so training is too (0.06 off the plain
    run's weights after 4 steps of a tiny T5, with no word but the start line's dtype)."""
    for half in ("bf16", "fp16"):
        if getattr(args, f"{half}_full_eval", False) and not getattr(args, half, False):
            logger.warning("hf_zero_offload: --%s_full_eval without --%s: the model trains in %s too (the engine keeps "
                           "one model on the device, in one dtype, as transformers' DeepSpeed integration does); drop "
                           "--%s_full_eval to train and evaluate in fp32, or pass --%s to say so", half, half, half,
                           half, half)


def cpu_has_native_bf16() -> bool | None:
    """AVX512-BF16 or AMX, from Linux's x86 CPU flags: torch's bf16 matmuls run in hardware there and beat fp32; on
    other x86 CPUs torch emulates them. None where the flags are unknown (another OS or architecture)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    flags = re.findall(r"^flags\s*:(.*)$", text, flags=re.M)
    if not flags:
        return None
    return any(" avx512_bf16" in line or " amx_bf16" in line for line in flags)


def warn_upcast(model, dtype: torch.dtype) -> None:
    """A 16-bit model cast up to the training dtype: twice the weights' memory, for a run that may have loaded
    bf16 to save it (the plain Trainer keeps the model as given)."""
    given = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype.itemsize < dtype.itemsize}
    for d in sorted(given, key=str):
        flag = "--bf16 (bf16=True)" if d == torch.bfloat16 else "--fp16 (fp16=True)"
        logger.warning("hf_zero_offload: the model's %s parameters were cast to %s, the training dtype of this run "
                       "(every parameter and buffer: twice the weights' memory, and save_model writes %s); to keep "
                       "the model in %s, pass %s", str(d).replace("torch.", ""), str(dtype).replace("torch.", ""),
                       str(dtype).replace("torch.", ""), str(d).replace("torch.", ""), flag)
    # and down: float64 params (the masters are fp32), where the plain Trainer keeps float64; fp32 params cast to
    # the 16-bit training dtype are every --bf16/--fp16 run's normal path, not news
    wider = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype.itemsize > 4]
    if wider:
        logger.warning("hf_zero_offload: %d float64 parameter(s) (%s%s) were cast to %s, the training dtype of this "
                       "run: the engine's masters are fp32 and every parameter trains in one dtype (the plain "
                       "Trainer keeps them as they are)", len(wider), ", ".join(wider[:3]),
                       ", ..." if len(wider) > 3 else "", str(dtype).replace("torch.", ""))


def warn_keep_fp32(model, dtype: torch.dtype) -> None:
    """Modules a transformers model keeps in fp32 when loaded in 16-bit (``_keep_in_fp32_modules``: T5's ``wo`` for
    fp16; ``_keep_in_fp32_modules_strict``: e.g. DeepSeek-V3's router, which it requires) train in the one training
    dtype here, as under DeepSpeed: said at INFO, a warning for the strict ones (an outside probe: nothing was said)."""
    if dtype == torch.float32:
        return
    for attr, level in (("_keep_in_fp32_modules", logging.INFO), ("_keep_in_fp32_modules_strict", logging.WARNING)):
        names = [n for n in (getattr(model, attr, None) or []) if any(n in m for m, _ in model.named_modules())]
        if names:
            logger.log(level, "hf_zero_offload: %s keeps %s in fp32 (%s); the engine trains every parameter in %s, "
                       "as DeepSpeed does, so those run in %s too", type(model).__name__, ", ".join(sorted(names)),
                       attr, str(dtype).replace("torch.", ""), str(dtype).replace("torch.", ""))


def warn_bf16_on_cpu(args, bf16: bool) -> None:
    if bf16 and (getattr(args, "use_cpu", False) or not torch.cuda.is_available()) and cpu_has_native_bf16() is False:
        logger.warning("hf_zero_offload: --bf16 (bf16=True) on a CPU without AVX512-BF16 or AMX: torch emulates "
                       "bf16 matmuls there (one t5-small step measured > 20x slower than in fp32 on an AVX2 Zen 3); "
                       "drop --bf16 (bf16=True) to train in fp32 on this CPU")


def refuse_user_optimizer(optimizer, scheduler, cls_argument: bool = True) -> None:
    """transformers refuses ``optimizers=`` under DeepSpeed and FSDP; with ``zero_offload`` the engine is the
    optimizer, so a user's would be kept and never fed gradients. ``cls_argument``: the Trainer takes
    ``optimizer_cls_and_kwargs`` (transformers' Seq2SeqTrainer does not)."""
    given = [n for n, v in (("optimizer", optimizer), ("lr scheduler", scheduler)) if v is not None]
    if given:
        raise ConfigError(
            f"Passing {' and '.join(given)} to the Trainer is not allowed with zero_offload / sharded_ddp: "
            "hf_zero_offload builds its own Adam/AdamW engine. Set lr, betas, eps and weight_decay with "
            f"TrainingArguments, {'optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}), ' if cls_argument else ''}"
            "or the ds_config's \"optimizer\" "
            "block (per-group values: override create_optimizer, returning a torch.optim.AdamW/Adam, whose groups the "
            "engine takes over), the schedule with --lr_scheduler_type or the ds_config's \"scheduler\" block; to "
            "drive an engine you built yourself, use a plain Trainer with ZeroOffloadCallback.")


def refuse_given_optimizer(init, args, kwargs) -> None:
    """``optimizers=`` / ``optimizer_cls_and_kwargs=`` as the Trainer's ``init`` would take them from ``args`` and
    ``kwargs``: refused or checked before any model work."""
    try:
        given = inspect.signature(init).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return  # the Trainer's own __init__ names the bad argument
    optimizer, scheduler = given.get("optimizers") or (None, None)
    refuse_user_optimizer(optimizer, scheduler, "optimizer_cls_and_kwargs" in inspect.signature(init).parameters)
    check_optimizer_cls(given.get("optimizer_cls_and_kwargs"))


def check_optimizer_cls(cls_and_kwargs) -> None:
    """``optimizer_cls_and_kwargs``: the Trainer builds that optimizer over its own groups, and the engine takes
    them over (lr, betas, eps, weight decay, Adam or AdamW), as from a create_optimizer override: so only torch's
    AdamW and Adam, whose math the engine runs (a subclass may change step()). Refused before any model work."""
    if cls_and_kwargs is None:
        return
    if not (isinstance(cls_and_kwargs, (tuple, list)) and len(cls_and_kwargs) == 2
            and isinstance(cls_and_kwargs[1], dict)):  # (transformers unpacks it as such)
        raise ConfigError(f"optimizer_cls_and_kwargs is {repr(cls_and_kwargs)[:80]}: it takes a pair (optimizer class, "
                          "dict of keyword arguments), e.g. (torch.optim.AdamW, {\"lr\": 1e-4})")
    cls = cls_and_kwargs[0]
    if cls not in (torch.optim.AdamW, torch.optim.Adam):
        shown = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls_and_kwargs)[:80]
        raise ConfigError(f"optimizer_cls_and_kwargs names {shown}: with zero_offload / sharded_ddp the optimizer is "
                          "hf_zero_offload's Adam/AdamW engine, which takes over the param groups and values of a "
                          "torch.optim.AdamW or torch.optim.Adam only; pass one of those, or train without "
                          "zero_offload")


# ``--optim`` values that name plain AdamW (implementations differ, not the math): the engine is that optimizer,
# with TrainingArguments' lr, betas, eps and weight decay (or the ds_config's "optimizer" block, as with DeepSpeed).
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_hf")
# AdamW on an XLA or Ascend NPU device: the engines train on CUDA or CPU devices (on a CPU these names trained as
# AdamW without a word, where the plain Trainer stops for want of torch_xla / torch_npu)
OTHER_DEVICE_OPTIMS = ("adamw_torch_xla", "adamw_torch_npu_fused")


def check_arguments(args, scheduler_block: str | None = None) -> None:
    """TrainingArguments that would otherwise be ignored silently (another optimizer trained as Adam, schedule
    options next to the ds_config's "scheduler" block, which replaces the Trainer's schedule) or fail later (a best
    checkpoint without optimizer state, max_grad_norm=None): one error naming each. ``scheduler_block``: the
    config's scheduler type, when it has one."""
    problems = []
    if getattr(args, "max_grad_norm", 0) is None:
        # transformers' loop compares it with 0 after the first backward: a TypeError, with or without zero_offload
        problems.append("--max_grad_norm None: the Trainer's loop needs a number (transformers compares it with 0 "
                        "at every step); use 0 to turn clipping off")
    if scheduler_block and getattr(args, "lr_scheduler_kwargs", None):
        problems.append(f"--lr_scheduler_kwargs {args.lr_scheduler_kwargs}: the ds_config's \"scheduler\" block "
                        f"({scheduler_block}) replaces the Trainer's schedule, so these would have no effect; set the "
                        "block's params instead, or drop the block to keep --lr_scheduler_type")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in OTHER_DEVICE_OPTIMS:
        problems.append(f"--optim {optim}: AdamW for an {'XLA' if 'xla' in optim else 'Ascend NPU'} device, where the "
                        "zero_offload engines do not run (CUDA or CPU devices); drop --optim (the engine is AdamW)")
    elif optim not in ADAMW_OPTIMS:
        # the names this transformers knows (adamw_hf and adamw_apex_fused are gone from 5.x)
        known = {str(getattr(o, "value", o)) for o in type(args.optim)} if isinstance(args.optim, Enum) else None
        accepted = [o for o in ADAMW_OPTIMS if known is None or o in known]
        # 8-bit and paged AdamW: their memory saving is what the offload and its int8 states give
        compact = ("; for 8-bit optimizer states, the engine's own: \"offload_optimizer\": {\"device\": \"cpu\", "
                   "\"state_dtype\": \"int8\"} (the shipped zero2-offload-int8)"
                   if any(w in optim for w in ("8bit", "4bit", "bnb", "paged")) else "")
        problems.append(f"--optim {optim}: the zero_offload engine is Adam/AdamW only (accepted: "
                        f"{', '.join(accepted)}); drop --optim or use a plain Trainer for {optim}{compact}")
    if getattr(args, "save_only_model", False) and getattr(args, "load_best_model_at_end", False):
        problems.append("--save_only_model with --load_best_model_at_end: the best checkpoint would hold no "
                        "optimizer state (fp32 master weights) to load with the model, as with DeepSpeed; drop one "
                        "of the two")
    nodes = _node_count()
    if getattr(args, "save_on_each_node", False) and nodes > 1:
        # each node's copy of a checkpoint held only its own ranks' shards (and node 1's no meta.json or weights),
        # was marked complete all the same, and every resume from it failed
        problems.append(f"--save_on_each_node on {nodes} nodes: a checkpoint is one directory holding every rank's "
                        "optimizer shard (rank<r>_of_<W>.hzo), so each node's copy would hold only its own ranks' "
                        "files and no resume could read it; put output_dir on a file system all nodes share and drop "
                        "--save_on_each_node")
    if problems:
        raise ConfigError("Not supported with zero_offload / sharded_ddp: " + "; ".join(problems))
    if bad := switch_problems():  # (the environment, not an argument: said apart)
        raise ConfigError("; ".join(bad))


def check_even_batches(args, train_dataset) -> None:
    """``--accelerator_config '{"even_batches": false}'`` on several ranks, where the training samples do not fill
    whole batches on every rank: the ranks then run different numbers of backward passes per epoch and wait in each
    other's reductions until the process group's timeout (an outside probe: 62 samples on 3 ranks, killed after
    150 s; DDP under the plain Trainer hangs alike). A dataset of unknown length could do the same."""
    config = getattr(args, "accelerator_config", None)
    if args.world_size <= 1 or getattr(config, "even_batches", True) or train_dataset is None:
        return
    whole = args.per_device_train_batch_size * args.world_size
    try:
        n = len(train_dataset)
    except TypeError:  # an iterable dataset (one may define __len__ and raise)
        n = None
    if n is None or n % whole:
        have = ("a dataset of unknown length" if n is None
                else f"{n} training samples ({n % whole} over a multiple of {whole})")
        raise ConfigError(f"accelerator_config even_batches=False on {args.world_size} ranks with {have}: the ranks "
                          "would run different numbers of backward passes and wait in each other's gradient "
                          "reductions until the process group's timeout; keep even_batches (the default: the last "
                          f"batch is filled up from the start) or give a multiple of {whole} samples "
                          "(per_device_train_batch_size x ranks)")


def _node_count() -> int:
    """Nodes of a torchrun launch: WORLD_SIZE over LOCAL_WORLD_SIZE (1 when either is unset)."""
    try:
        world, local = launch_count(os.environ, "WORLD_SIZE"), launch_count(os.environ, "LOCAL_WORLD_SIZE")
    except LaunchError:  # not a count: check_launch_env names it
        return 1
    return -(-world // local) if world and local else 1


def first_names(names: list) -> str:
    """The first five of ``names`` for an error message, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_dpu_writers(model, dpu: bool) -> None:
    """With the delayed parameter update a param written while a delayed step is in flight keeps the written values and
    that step's update of it is dropped (engine/delayed.py). ``nn.Embedding(max_norm=...)`` renormalises the rows it
    looks up in place at every forward (a write, even when no row changes): its weight never trained past the DPU
    warm-up, with an INFO line per step (an outside probe: 0.008 moved against 0.85 without DPU)."""
    if not dpu:
        return
    found = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Embedding) and m.max_norm is not None and m.weight.requires_grad]
    if found:
        raise ConfigError(f"delayed_param_update with nn.Embedding(max_norm=...) ({first_names(found)}): the "
                          "embedding renormalises its weight in place at every forward, a write that keeps its values "
                          "over each delayed step's update, so it would never train; turn delayed_param_update off, "
                          "set max_norm=None, or freeze the embedding")


def refuse_view_ties(model) -> None:
    """A trainable param that is a strided view of another param or buffer of the model (a tie through ``.t()``):
    the engine makes its params contiguous (copies), which would untie them without a word."""
    known = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for name, p in model.named_parameters():
        if p.requires_grad and p.device.type != "meta" and not p.is_contiguous():
            other = next((n for n, q in known if shares_storage(p, q)), None)
            if other is not None:
                raise ConfigError(view_tie_message(name, other))


def check_trainable(engine_params, named_params, during_training: bool = False) -> None:
    """At ``train()``: parameters made trainable after the engine was built (``requires_grad_(True)`` between two
    ``train()`` calls) have no slot in it: their gradients would be computed and dropped at every step, and left out
    of the logged grad_norm. Parameters frozen since then are fine (no gradient: skipped, as AdamW skips them).
    ``during_training``: at an optimizer step (``trainer/trainable_watch.py``), for one unfrozen by a callback."""
    known = {id(p) for group in engine_params for p in group}
    new = [n for n, p in named_params if p.requires_grad and id(p) not in known]
    if new:
        fix = ("Set requires_grad before creating the Trainer, or create a new Trainer after changing it" if not
               during_training else "To unfreeze during training, make them trainable before the Trainer is created "
               "(in a param group whose learning rate a callback raises from 0)")
        raise ConfigError(
            f"{len(new)} parameter(s) became trainable after the zero_offload engine was built ({first_names(new)}): "
            f"the engine holds no optimizer state for them and would never update them. {fix}")
