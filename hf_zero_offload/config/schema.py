"""The ``ds_config.json`` key tables behind :mod:`hf_zero_offload.config`.

Every key hf_zero_offload knows is listed here with one of four kinds:

* ``use``: read and turned into a field of :class:`~hf_zero_offload.config.TrainingConfig`;
* ``ignore``: a harmless DeepSpeed key (one that transformers, accelerate or the HF docs write); its type is
  checked, its value has no effect;
* ``unsupported``: a DeepSpeed feature hf_zero_offload does not implement; accepted and ignored only while it is
  switched off (``false``/``null``/``0``, a section with ``"enabled": false``, or a section whose values are all
  off), otherwise a :class:`ConfigError` saying what to use instead;
* ``section``: a nested object with its own table.

The kinds (:class:`~hf_zero_offload.config.checks.Spec`) and the value checks live in
:mod:`hf_zero_offload.config.checks`; this module holds the tables, :mod:`.walker` walks a config through them.

Stdlib only: no torch, no transformers.
"""
from __future__ import annotations

from typing import Any, Callable

from .checks import (Spec, an_object, betas, boolean, choice, ignore, integer, number, section, stage,
                     stage3_value, static_loss_scale, str_or_null, unsupported, use)

AUTO = "auto"


class ConfigError(ValueError):
    """A ds_config problem; the message names the file (or ``<dict>``) and the key path."""


# ---------------------------------------------------------------- harmless values of unsupported keys


def _eq(value: Any) -> Callable[[Any], bool]:
    """Harmless when equal to ``value`` (with bools and numbers kept apart)."""
    return lambda v: isinstance(v, bool) == isinstance(value, bool) and v == value


def _device_none(v: Any) -> bool:
    return isinstance(v, dict) and v.get("device", "none") in ("none", None)


def _never(v: Any) -> bool:
    """Never harmless (but null, which the walker reads as not set): a block that is on whenever given."""
    return False


def _enabled_off(v: Any) -> bool:
    """A section whose "enabled" is false or left out (DeepSpeed's default: off)."""
    return isinstance(v, dict) and v.get("enabled", False) is False


def _tp_off(v: Any) -> bool:
    """DeepSpeed's tensor_parallel section with a size of 1 (OpenRLHF's default writes autotp_size 1): no TP. Only
    its size keys: any other (a misspelt "autotp_szie": 2) is not known to be off."""
    def one(x):
        return x in (None, 0, 1) and not isinstance(x, bool)
    tp = v.get("tp", {}) if isinstance(v, dict) else None
    return (isinstance(v, dict) and set(v) <= {"autotp_size", "tp_size", "tp"} and one(v.get("autotp_size"))
            and one(v.get("tp_size")) and isinstance(tp, dict) and set(tp) <= {"tp_size"} and one(tp.get("tp_size")))


_FP32_ONLY = choice("fp32", other="gradients are accumulated in fp32 only")


def _GRAD_ACCUM_DTYPE(v: Any) -> str | None:  # null: DeepSpeed's "not set"
    return None if v is None else _FP32_ONLY(v)


# ---------------------------------------------------------------- the tables


def _OBJECT_OR_NULL(v: Any) -> dict | None:  # null: DeepSpeed's "not set" (accepted before these blocks were read)
    return None if v is None else an_object(v)


# ignored blocks that the start log names only when switched on ({"enabled": false} is what DeepSpeed's docs write)
QUIET_WHEN_OFF = ("activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
                  "comms_logger")

# Stage-3 tuning keys (stage3_* and their DeepSpeed aliases) have no meaning at stages 0-2, where DeepSpeed ignores
# them too: a stage-3 config switched to stage 2 runs as it does under DeepSpeed, and the start log names them.
# Stage 3 itself is refused by "stage".
STAGE3_KEY = Spec("ignore", stage3_value, True)

FP16 = {
    "enabled": use(boolean, auto=True),
    "loss_scale": use(static_loss_scale),
    # the kernel unscales by 1/scale in fp32: above 2**126 that is no normal fp32 number (and below 2**-126 it is inf)
    "initial_scale_power": use(integer(0, "an integer in [0, 126] (2**126: 1/scale stays a normal fp32 number)",
                                       hi=126)),
    "loss_scale_window": use(integer(1, "an integer >= 1")),
    "hysteresis": use(integer(1, "an integer >= 1")),
    "min_loss_scale": use(number(2.0 ** -126, 2.0 ** 126, hi_open=False, what="a number in [2**-126, 2**126] (the "
                                 "scale and 1/scale must be normal fp32 numbers)")),
    "consecutive_hysteresis": unsupported("the loss scaler keeps plain hysteresis; set it to false"),
    "auto_cast": unsupported("the engine casts the model to fp16 and runs no autocast (inputs are not cast); set it "
                             "to false"),
    "fp16_master_weights_and_grads": unsupported("master weights are always fp32 on the host"),
}
BF16 = {
    "enabled": use(boolean, auto=True),
    "immediate_grad_update": ignore(boolean),
    # as DeepSpeed: a step whose bf16 gradients are not finite is skipped (the LR schedule held, as for fp16)
    "check_grad_overflow": use(boolean),
    # DeepSpeed's low-precision masters (0.18): here the masters and the moments' default are fp32 on the host
    "bf16_master_weights_and_grads": unsupported("master weights and gradients are always fp32 on the host"),
    "bf16_optimizer_states": unsupported('for bf16 Adam moments on the host use "offload_optimizer": {"device": '
                                         '"cpu", "state_dtype": "bf16"}'),
}
_ONLY_ADAM = "only Adam/AdamW have a CPU kernel here; remove the 'optimizer' block to use TrainingArguments' AdamW"
OPTIMIZER = {
    # DeepSpeed's own (OneBitAdam, Lamb, Lion, ...) and any torch.optim name it would import: all refused alike
    "type": use(choice("Adam", "AdamW", casefold=True, other=_ONLY_ADAM)),
    "legacy_fusion": ignore(boolean),  # DeepSpeed's older fused fp16 optimizer: the same Adam
    "params": section({
        "lr": use(number(0, what="a number >= 0"), auto=True),
        "betas": use(betas, auto=True),
        # >= 0, as torch.optim.AdamW, DeepSpeed and --adam_epsilon take it (0 was refused here alone, not from "auto")
        "eps": use(number(0, what="a number >= 0"), auto=True),
        "weight_decay": use(number(0, what="a number >= 0"), auto=True),
        "adam_w_mode": use(boolean),
        "torch_adam": ignore(boolean),  # only picks DeepSpeed's implementation; the math is the same
        "bias_correction": unsupported("Adam always applies bias correction here", harmless=_eq(True)),
        "amsgrad": unsupported("AMSGrad has no kernel here; set it to false"),
        # DeepSpeedCPUAdam's: false keeps the moments in the parameters' 16-bit dtype
        "fp32_optimizer_states": unsupported('for 16-bit Adam moments on the host use "offload_optimizer": '
                                             '{"device": "cpu", "state_dtype": "bf16"}', harmless=_eq(True)),
        "set_grad_none": ignore(boolean),  # FusedAdam's: how zero_grad clears, not what the step computes
        # DeepSpeed raises for it, whatever its value: clipping is the config's top-level key
        "max_grad_norm": unsupported("no optimizer parameter (DeepSpeed refuses it too); use the top-level "
                                     "gradient_clipping, or --max_grad_norm", harmless=_never),
    }),
}
# The params each scheduler type takes (DeepSpeed builds its class with **params: another key is a TypeError there).
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": _WARMUP + ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
# DeepSpeed's ratios are fractions of the optimizer's lr, the schedule's peak: above 1 the "min" ratio would be a
# maximum (DeepSpeed runs it, warming down or "decaying" upwards); refused here as the slip it almost surely is.
_RATIO = use(number(0, 1, what="a number in [0, 1] (a fraction of the optimizer's lr)", hi_open=False))
SCHEDULER = {
    # OneCycle, LRRangeTest and torch's schedulers by name (DeepSpeed imports them) are refused
    "type": use(choice(*SCHEDULER_PARAMS, other="remove the 'scheduler' block and use TrainingArguments "
                                                 "--lr_scheduler_type (e.g. cosine_with_min_lr)")),
    "params": section({
        "warmup_min_lr": use(number(0, what="a number >= 0"), auto=True),
        "warmup_max_lr": use(number(0, what="a number >= 0"), auto=True),
        "warmup_num_steps": use(integer(0, "an integer >= 0"), auto=True),  # 0: as 1 (max(1, n), schedulers.py)
        "warmup_type": use(choice("log", "linear")),
        "total_num_steps": use(integer(1, "an integer >= 1"), auto=True),
        "warmup_min_ratio": _RATIO,  # no "auto": transformers fills neither ratio, DeepSpeed would get the string
        "cos_min_ratio": _RATIO,
        # DeepSpeed starts the schedule at that iteration: the Trainer's resume restores the schedule's position
        "last_batch_iteration": unsupported("the schedule starts at step 0, and a resume restores its position "
                                            "(--resume_from_checkpoint); leave it -1", harmless=_eq(-1)),
    }),
}
OFFLOAD_OPTIMIZER = {
    "device": use(choice("cpu", "none", unsupported={
        "nvme": "NVMe offload (ZeRO-Infinity) is not implemented; use \"device\": \"cpu\""})),
    "pin_memory": use(boolean),
    # our extension: storage of the Adam moments on the host (fp32 default: exact AdamW)
    "state_dtype": use(choice("fp32", "bf16", "int8")),
    # our extension: threads of the CPU optimizer step per rank ("auto": engine_setup.step_threads)
    # bounded by what the kernels take (ops.check_num_threads): a larger value passed here and failed at the first
    # step, after the model had loaded, in an error that did not name this key
    "cpu_threads": use(integer(1, "an integer >= 1 (and below 2**31) or \"auto\"", hi=2**31 - 1), auto=True),
    "nvme_path": ignore(str_or_null),
    "buffer_count": ignore(integer(0, "an integer >= 0")),
    "pipeline": ignore(boolean),
    "pipeline_read": ignore(boolean),
    "pipeline_write": ignore(boolean),
    "fast_init": ignore(boolean),
    "super_offload": unsupported("SuperOffload (for Superchips) is not implemented; \"device\": \"cpu\" is the CPU "
                                 "offload"),
    # the CPU share of SuperOffload's Adam worker, read by nothing else (under DeepSpeed too): see cpu_threads
    "cpuadam_cores_perc": ignore(number(0, 1, what="a number in (0, 1]", lo_open=True, hi_open=False)),
    "ratio": unsupported("partial offload (ratio < 1) is not implemented; the whole optimizer state is "
                         "offloaded", harmless=_eq(1)),
}
ZERO = {
    "stage": use(stage),
    "offload_optimizer": section(OFFLOAD_OPTIMIZER),
    "cpu_offload": use(boolean),  # legacy spelling of offload_optimizer.device == "cpu"
    "cpu_offload_use_pin_memory": use(boolean),  # legacy spelling of offload_optimizer.pin_memory
    "overlap_comm": use(boolean),
    "contiguous_gradients": use(boolean),
    "reduce_scatter": use(boolean),
    "reduce_bucket_size": use(integer(1, "a positive integer"), auto=True),
    "allgather_partitions": use(boolean),
    "allgather_bucket_size": use(integer(1, "a positive integer"), auto=True),
    "round_robin_gradients": use(boolean),
    "delayed_param_update": section({
        "enabled": use(boolean),
        "warmup_steps": use(integer(0, "an integer >= 0")),
    }),
    # harmless: ours already behaves this way, or the key has no meaning below stage 3
    "load_from_fp32_weights": ignore(boolean),
    "elastic_checkpoint": ignore(boolean),
    "ignore_unused_parameters": ignore(boolean),
    "use_multi_rank_bucket_allreduce": ignore(boolean),
    "sub_group_size": STAGE3_KEY,  # groups ZeRO-3's (and its offload's) flat state; OpenRLHF writes "auto"
    "memory_efficient_linear": ignore(boolean),
    "gather_16bit_weights_on_model_save": ignore(boolean),
    "stage3_gather_16bit_weights_on_model_save": ignore(boolean),  # accelerate writes it for every stage
    "stage3_gather_fp16_weights_on_model_save": ignore(boolean),
    "legacy_stage1": unsupported("the legacy stage-1 implementation is not available; set it to false"),
    "offload_param": unsupported("parameter offload needs ZeRO stage 3; only offload_optimizer is implemented",
                                 harmless=_device_none),
    "cpu_offload_param": unsupported("parameter offload needs ZeRO stage 3; only offload_optimizer is "  # (legacy)
                                     "implemented", harmless=lambda v: v is None or v is False),
    # ZeRO++ hpZ partitions ZeRO-3's params: DeepSpeed reads it in its stage-3 branch only, and stage 3 is refused
    "zero_hpz_partition_size": STAGE3_KEY,
    "zero_quantized_weights": unsupported("ZeRO++ quantized weights are not implemented"),
    "zero_quantized_nontrainable_weights": unsupported("ZeRO++ quantized weights are not implemented"),
    "zero_quantized_gradients": unsupported("ZeRO++ quantized gradients are not implemented"),
    "mics_shard_size": unsupported("MiCS sharding is not implemented", harmless=lambda v: v in (None, -1, 0)),
    "mics_hierarchical_params_gather": unsupported("MiCS sharding is not implemented"),
    "zeropp_loco_param": unsupported("ZeRO++ LoCo gradient compression is not implemented",
                                     harmless=lambda v: v is None),
    **{k: STAGE3_KEY for k in ("log_trace_cache_warnings", "prefetch_bucket_size", "param_persistence_threshold",
                               "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                               "pipeline_loading_checkpoint", "override_module_apply",
                               # (DeepSpeed's names of stage3_module_granularity_threshold, ...; the last two are
                               # arguments of its stage-3 optimizer only)
                               "module_granularity_threshold", "use_all_reduce_for_fetch_params",
                               "allgather_sequential", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory")},
    "leaf_module": ignore(_OBJECT_OR_NULL),  # ZeRO-3's leaf modules (its parameter fetching)
    # ZenFlow is on whenever the block is given (DeepSpeed checks "is not None")
    "zenflow": unsupported("ZenFlow (importance-aware offloaded updates) is not implemented; remove the block",
                           harmless=_never),
}

TOP = {
    "train_batch_size": use(integer(1, "a positive integer"), auto=True),
    "train_micro_batch_size_per_gpu": use(integer(1, "a positive integer"), auto=True),
    "gradient_accumulation_steps": use(integer(1, "a positive integer"), auto=True),
    "gradient_clipping": use(number(0, what="a number >= 0 (0 = off)"), auto=True),
    "fp16": section(FP16),
    "bf16": section(BF16),
    "bfloat16": section(BF16),  # legacy spelling of "bf16"
    "optimizer": section(OPTIMIZER),
    "scheduler": section(SCHEDULER),
    "zero_optimization": section(ZERO),
    "steps_per_print": use(integer(1, "a positive integer")),
    "wall_clock_breakdown": use(boolean),
    # accepted and ignored
    "zero_allow_untested_optimizer": ignore(boolean),
    "zero_force_ds_cpu_optimizer": ignore(boolean),
    "memory_breakdown": ignore(boolean),
    "dump_state": ignore(boolean),
    "dataloader_drop_last": ignore(boolean),
    "checkpoint": ignore(an_object),  # transformers writes checkpoint.use_node_local_storage
    "timers": ignore(an_object),  # DeepSpeed's throughput timers: measurement only
    # keys DeepSpeed itself does not read (its own are comms_logger and the monitors) that popular configs carry:
    # LLaMA-Factory's shipped ds_z*_config.json write both, and ran under DeepSpeed
    "comms_config": ignore(an_object),
    "monitor_config": ignore(an_object),
    # unsupported features (fine while switched off)
    "amp": unsupported("NVIDIA Apex AMP is not used; use the fp16/bf16 sections or --fp16/--bf16"),
    "torch_autocast": unsupported("use the fp16/bf16 sections or --fp16/--bf16"),
    # DeepSpeed's observability blocks, and activation_checkpointing (it configures deepspeed.checkpointing, which
    # transformers' models never call): nothing a model computes changes under DeepSpeed either, so a config that
    # ran there runs; switched on, the start log names them (QUIET_WHEN_OFF), and the module docstring says what to use
    "activation_checkpointing": ignore(_OBJECT_OR_NULL),
    "flops_profiler": ignore(_OBJECT_OR_NULL),
    "tensorboard": ignore(_OBJECT_OR_NULL),
    "wandb": ignore(_OBJECT_OR_NULL),
    "csv_monitor": ignore(_OBJECT_OR_NULL),
    "comet": ignore(_OBJECT_OR_NULL),
    "elasticity": unsupported("elastic batch sizes are not implemented; set the batch sizes explicitly"),
    "pipeline": unsupported("pipeline parallelism is not implemented"),
    "sparse_gradients": unsupported("sparse gradients are not implemented; embeddings get dense gradients"),
    "sparse_attention": unsupported("use the model's own attention implementation"),
    "communication_data_type": unsupported("gradients are reduced in their own dtype"),
    "seq_parallel_communication_data_type": unsupported("sequence parallelism is not implemented"),
    "prescale_gradients": unsupported("gradients are averaged after the reduction"),
    "gradient_predivide_factor": unsupported("gradients are averaged after the reduction", harmless=_eq(1)),
    "disable_allgather": unsupported("ZeRO-1/2 always all-gathers the updated parameters"),
    # kept (not dropped as harmless): ZeRO-1 of a 16-bit model sums in .grad, so "fp32" is refused there (engine_setup)
    "data_types": section({"grad_accum_dtype": use(_GRAD_ACCUM_DTYPE),
                           "param_dtype": unsupported("the model is cast to the training dtype: --bf16/--fp16 (or "
                                                      "the fp16/bf16 sections), fp32 otherwise"),
                           "buffer_dtype": unsupported("buffers keep the dtype the model has them in")}),
    "progressive_layer_drop": unsupported("progressive layer drop is not implemented"),
    "curriculum_learning": unsupported("curriculum learning is not implemented"),
    "data_efficiency": unsupported("DeepSpeed's data efficiency library is not implemented"),
    "compression_training": unsupported("compression training is not implemented"),
    "quantize_training": unsupported("quantized training is not implemented"),
    "eigenvalue": unsupported("eigenvalue computation is not implemented"),
    "autotuning": unsupported("DeepSpeed autotuning is not implemented"),
    "aio": unsupported("async I/O serves NVMe offload, which is not implemented"),
    "nebula": unsupported("Nebula checkpointing is not implemented; the Trainer saves checkpoints"),
    "hybrid_engine": unsupported("the RLHF hybrid engine is not implemented"),
    "compile": unsupported("use TrainingArguments --torch_compile"),
    "comms_logger": ignore(_OBJECT_OR_NULL),
    "graph_harvesting": unsupported("CUDA graph harvesting is not implemented"),
    "sequence_parallel_size": unsupported("sequence parallelism is not implemented", harmless=_eq(1)),
    "tensor_parallel": unsupported("tensor parallelism (AutoTP) is not implemented", harmless=_tp_off),
    "use_data_before_expert_parallelism": unsupported("expert parallelism is not implemented"),
    "expert_parallel": unsupported("expert parallelism (AutoEP) is not implemented", harmless=_enabled_off),
    # false (not DeepSpeed's default, true): every step() call would be an update, whatever the accumulation
    "managed_gradient_accumulation": unsupported("the Trainer steps the optimizer once per --gradient_accumulation_"
                                                 "steps micro-batches (DeepSpeed's default, true)", harmless=_eq(True)),
    "gradient_allreduce_op": unsupported('gradients are averaged across ranks ("mean", DeepSpeed\'s default)',
                                         harmless=lambda v: v == "mean"),
    "log_level": ignore(str_or_null),  # DeepSpeed's own logger's level
    "datastates_ckpt": unsupported("DataStates checkpointing is not implemented; the Trainer saves checkpoints",
                                   harmless=_eq(False)),  # (on whenever given, unless false)
    "weight_quantization": unsupported("weight quantization is not implemented"),
}


# Keys of kind "use" that are read into TrainingConfig but change nothing in hf_zero_offload: the start
# log lists them when a config sets them, with the reason.
NO_EFFECT = {
    "zero_optimization.overlap_comm": "communication always overlaps backward where the device allows it",
    "zero_optimization.contiguous_gradients": "gradients always go to one flat store",
    "zero_optimization.allgather_partitions": "updated shards are always all-gathered",
    "zero_optimization.round_robin_gradients": "shards are equal flat slices",
    "steps_per_print": "use TrainingArguments --logging_steps",
    "wall_clock_breakdown": "use benchmarks/ or torch.profiler",
}
