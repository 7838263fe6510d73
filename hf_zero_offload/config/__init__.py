"""``ds_config.json`` -> validated, frozen dataclasses, with ``"auto"`` resolved from TrainingArguments values.

The file uses DeepSpeed's key names, so a DeepSpeed ZeRO-1/2 config (the 2021 blog's ``ds_config_1gpu.json``, or
today's form with ``"offload_optimizer": {"device": "cpu"}`` and ``"auto"``) loads unchanged. Nothing here imports
transformers: the Trainer integration copies the few values it needs into an :class:`ArgsView`.

``load_config(path_or_dict)`` reads and validates; ``resolve(raw_or_path, args)`` returns a :class:`TrainingConfig`.
Every problem is a :class:`ConfigError` naming the file (or ``<dict>``) and the key path.

"auto" sources (``resolve(..., args)``; with ``args=None`` each "auto" below is an error, listed together, except
the two marked *):

=============================================  ================================================================
key                                            value
=============================================  ================================================================
train_micro_batch_size_per_gpu                 per_device_train_batch_size
gradient_accumulation_steps                    gradient_accumulation_steps
train_batch_size                               world_size * micro batch * gradient_accumulation_steps
gradient_clipping                              max_grad_norm
optimizer.params.lr / betas / eps              learning_rate / [adam_beta1, adam_beta2] / adam_epsilon
optimizer.params.weight_decay                  weight_decay
scheduler.params.warmup_min_lr *               0
scheduler.params.warmup_max_lr                 learning_rate
scheduler.params.warmup_num_steps              max(1, warmup_steps)  (0 and 1 both mean 1; DeepSpeed makes them 2)
scheduler.params.total_num_steps               max_steps (error when unknown; WarmupDecayLR/WarmupCosineLR)
fp16.enabled / bf16.enabled                    fp16 / bf16
zero_optimization.reduce_bucket_size           hidden_size * hidden_size (error when hidden_size is unknown)
zero_optimization.allgather_bucket_size *      the resolved reduce_bucket_size
=============================================  ================================================================

Explicit values are compared with args (every key above except warmup_min_lr and the bucket sizes), and so is
scheduler.type with --lr_scheduler_type (the block replaces the Trainer's schedule: WarmupLR goes with linear, the
default, or constant_with_warmup; WarmupDecayLR with linear; WarmupCosineLR with linear, cosine, cosine_with_min_lr
or cosine_warmup_with_min_lr); all disagreements are reported in one one-line ConfigError, ``key=value vs --arg
value`` each, separated by "; ". bf16.check_grad_overflow (true/false, DeepSpeed's): with bf16 training, a step
whose gradients are not finite is skipped (the engines' ``OffloadOptions.skip_nonfinite``).

Schedulers (:mod:`hf_zero_offload.schedulers`). WarmupLR / WarmupDecayLR take warmup_min_lr, warmup_max_lr,
warmup_num_steps, warmup_type and (WarmupDecayLR, required) total_num_steps. WarmupCosineLR takes total_num_steps
(required), warmup_num_steps, warmup_type, warmup_min_ratio and cos_min_ratio: its LR is each param group's lr (the
optimizer's: optimizer.params.lr or --learning_rate) times a ratio, warmup_min_ratio -> 1 over the warm-up, then a
cosine down to cos_min_ratio. The two ratios are numbers in [0, 1] (above 1 the "min" would be a maximum: refused)
and take no "auto" (transformers fills neither). DeepSpeed builds a scheduler with the block's params as keyword
arguments, so a key of another type (warmup_max_lr with WarmupCosineLR, a ratio or total_num_steps with WarmupLR)
is an error naming the key and the type; last_batch_iteration is accepted at -1 only (DeepSpeed starts the
schedule at another; a resume restores the schedule's position here). A
warmup_min_lr above warmup_max_lr (given, or --learning_rate for "auto") is an error naming both (the warm-up would
go down); a total_num_steps below warmup_num_steps is a warning, as in DeepSpeed (the run never leaves its warm-up).

Missing keys. With ``args``, a missing key of the table above (except the bucket sizes) takes the same value as
"auto", so TrainingArguments stay in charge unless the file says otherwise (e.g. gradient_clipping follows
--max_grad_norm). Without args, DeepSpeed's defaults apply: micro batch 1, gradient accumulation 1 and
train_batch_size derived from the others assuming world_size 1; gradient_clipping 0 (off); fp16/bf16 off; Adam
lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0; WarmupLR 0 -> 1e-3 over 1000 steps, warmup_type "log";
WarmupCosineLR warmup_min_ratio 0, cos_min_ratio 1e-4, 1000 warm-up steps, warmup_type "log".
Always: stage 0, no offload, pin_memory true, overlap_comm false, contiguous_gradients true, reduce_scatter true,
allgather_partitions true, round_robin_gradients false, both bucket sizes 5e8, steps_per_print 10. A missing
"optimizer" block gives ``optimizer=None`` (the Trainer's AdamW from TrainingArguments); a missing "scheduler" gives
``scheduler=None`` (the Trainer's own scheduler). ``"type": "Adam"`` is AdamW unless ``adam_w_mode`` is false;
``"type": "AdamW"`` is AdamW whatever ``adam_w_mode`` says (DeepSpeed's rule; a false one is logged).

Accepted without effect (type-checked; the start log names those a config sets): overlap_comm,
contiguous_gradients, allgather_partitions, round_robin_gradients, steps_per_print, wall_clock_breakdown, and: zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer,
memory_breakdown, dump_state, dataloader_drop_last, checkpoint{...} (transformers writes use_node_local_storage),
bf16.immediate_grad_update, optimizer.params.torch_adam and set_grad_none (any bool), optimizer.legacy_fusion,
log_level, managed_gradient_accumulation true and gradient_allreduce_op "mean" (DeepSpeed's defaults),
data_types.grad_accum_dtype "fp32" (refused at
ZeRO stage 1 with a 16-bit model and accumulation: it sums in .grad, in 16 bits),
zero_optimization.{load_from_fp32_weights, elastic_checkpoint,
ignore_unused_parameters, use_multi_rank_bucket_allreduce, memory_efficient_linear,
[stage3_]gather_16bit_weights_on_model_save, stage3_gather_fp16_weights_on_model_save} (accelerate writes the
last for every stage), every other stage-3 tuning key (stage3_* and DeepSpeed's aliases such as prefetch_bucket_size:
and sub_group_size, zero_hpz_partition_size: a number, a boolean, null or "auto"; DeepSpeed ignores them below
stage 3 too; also module_granularity_threshold, use_all_reduce_for_fetch_params, allgather_sequential,
enable_sanity_checks, save_muon_momentum_buffer_in_memory and leaf_module{...}), comms_config{...} and
monitor_config{...} (keys DeepSpeed does not read, which LLaMA-Factory's
configs carry), DeepSpeed's observability blocks tensorboard/wandb/csv_monitor/comet (use --report_to),
flops_profiler and comms_logger (use torch.profiler), and activation_checkpointing (it configures
deepspeed.checkpointing, which transformers' models never call, under DeepSpeed too: use --gradient_checkpointing)
(these named in the start log only when switched on), keys starting with "_" ("_comment"; skipped),
offload_optimizer.{nvme_path, buffer_count, pipeline, pipeline_read, pipeline_write,
fast_init, cpuadam_cores_perc (SuperOffload's only)}. Legacy spellings: "bfloat16" for "bf16",
zero_optimization.cpu_offload (== offload_optimizer.device
"cpu") and cpu_offload_use_pin_memory (== offload_optimizer.pin_memory).

Unsupported DeepSpeed features are a ConfigError "not supported by hf_zero_offload: <why / what to use>" while they
are switched on, and ignored while switched off (false/null/0, ``{"enabled": false}``, offload_param
``{"device": "none"}``, ratio 1, gradient_predivide_factor 1...): ZeRO stage 3, offload_param, NVMe offload, optimizer types other than Adam/AdamW,
schedulers other than WarmupLR/WarmupDecayLR/WarmupCosineLR (OneCycle, LRRangeTest, torch's by name),
fp16.{consecutive_hysteresis, auto_cast, fp16_master_weights_and_grads}, bf16.{bf16_master_weights_and_grads,
bf16_optimizer_states}, optimizer.params.fp32_optimizer_states false (use offload_optimizer.state_dtype),
optimizer.params.max_grad_norm (DeepSpeed refuses it too: gradient_clipping), managed_gradient_accumulation false,
gradient_allreduce_op "sum", data_types.{param_dtype, buffer_dtype}, zero_optimization.zenflow (on whenever given),
offload_optimizer.super_offload, expert_parallel, datastates_ckpt, weight_quantization, amp, torch_autocast,
elasticity, pipeline, tensor_parallel
(autotp_size/tp_size above 1),
sparse_gradients, sparse_attention, communication_data_type, prescale_gradients, data_types (fp32 accumulation
only), ZeRO++ / MiCS keys (but hpZ, above) and the other DeepSpeed-only libraries; see :mod:`hf_zero_offload.config.schema`.
Unknown keys are errors, with "did you mean" for near misses (case too) or the section a key one level off
belongs to. A section set to null ("offload_optimizer": null,
"scheduler": null) is a section not given, as DeepSpeed reads its optional blocks; a null leaf value is an error.
A dict built in Python may hold numpy scalars (numbers) but no arrays, tensors or non-string keys. The extension
``zero_optimization.delayed_param_update {enabled, warmup_steps}`` (the paper's DPU) needs CPU offload, and so
does ``zero_optimization.offload_optimizer.state_dtype`` ("fp32" default, "bf16", "int8": how the Adam moments
are stored on the host; int8 is blockwise, 256 elements per scale, csrc/quant.h). The extension
``zero_optimization.offload_optimizer.cpu_threads`` (an integer in [1, 2**31) or "auto", the default) sets the threads of
each rank's CPU step (``engine_setup.step_threads`` says what "auto" picks). Either key under ``offload_param``
is an error naming where it belongs (not ignored with the switched-off section).

Layout: :mod:`.training` holds the frozen dataclasses (and :class:`ArgsView`), :mod:`.loader` reads and validates a
file (:func:`check`, :func:`load_config`), :mod:`.resolver` turns a validated dict into a :class:`TrainingConfig`,
:mod:`.schema` holds the key tables, :mod:`.walker` walks a config through them, :mod:`.checks` the value checks
those tables use, :mod:`.rules` the rules across keys (and :func:`validate`, which applies both).

fp16 loss scaling: the engine unscales by 1/scale in fp32, so every scale and its reciprocal must be normal fp32
numbers: ``loss_scale`` is 0 (dynamic) or a static scale in [1, 2**126] (below 1 a static scale only pushes fp16
gradients into underflow: refused; 1 is no scaling), ``initial_scale_power`` in [0, 126], ``min_loss_scale`` in
[2**-126, 2**126] and, for a dynamic scale, at most 2**initial_scale_power (above it the first overflow raised the
scale to the "minimum"). An integer beyond a float's range (JSON allows any length) is refused naming the key.
"""
from __future__ import annotations

from .loader import Checked, check, load_config
from .resolver import resolve
from .rules import validate
from .schema import AUTO, ConfigError
from .training import (DEFAULT_BUCKET_SIZE, ArgsView, DPUConfig, FP16Config, OptimizerConfig, SchedulerConfig,
                       TrainingConfig, ZeroConfig)

__all__ = ["FP16Config", "OptimizerConfig", "SchedulerConfig", "DPUConfig", "ZeroConfig", "TrainingConfig",
           "ArgsView", "ConfigError", "load_config", "resolve"]
