"""Every rank of a sharded run must run the same ``train()``: the Trainer arguments that decide its steps, its
collectives (logging's gather of the loss, evaluation, saves, the tokens seen) and its data, and the lengths of its
datasets.

The engine compares what each rank built (``engine/sharded/agree.py``) and its hyperparameters at every step; a rank
given another ``--max_steps`` with a flat schedule, ``--save_only_model``, ``--seed`` or dataset (an outside probe,
2 gloo ranks) still trained on a mix (another data order on one rank, 0.041 off; its checkpoints marked complete),
failed in gloo's words ("Connection closed by peer") or waited in a collective its peer never reached until the
30-minute timeout. One all-gather at each ``train()`` start compares them, and every rank raises the same error.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sized

from accelerate.data_loader import DataLoaderDispatcher

from ..config import ConfigError
from ..engine.sharded.agree import check_ranks_agree
from .shared_dir import distributed

# what makes one rank's run another's: step counts, the data each rank draws, and every event with a collective
SAME_ON_EVERY_RANK = (
    "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed",
    "dataloader_drop_last", "group_by_length", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "weight_decay", "max_grad_norm", "logging_strategy", "logging_steps", "logging_first_step", "eval_strategy",
    "eval_steps", "eval_on_start", "per_device_eval_batch_size", "eval_accumulation_steps", "prediction_loss_only",
    "save_strategy", "save_steps", "save_only_model", "load_best_model_at_end", "metric_for_best_model",
    "include_num_input_tokens_seen", "average_tokens_across_devices", "gradient_checkpointing", "torch_compile",
    "fp16", "bf16",
    # an outside probe: --eval_delay on one rank left both in evaluation's gather until the 30-minute timeout; a
    # --label_smoothing_factor or accelerator_config split_batches on one rank trained on a mix of the two runs
    "eval_delay", "label_smoothing_factor", "neftune_noise_alpha", "ignore_data_skip", "accelerator_config",
    "lr_scheduler_kwargs", "label_names", "past_index", "torch_compile_backend", "torch_compile_mode",
    "eval_use_gather_object", "include_for_metrics", "include_inputs_for_metrics", "batch_eval_metrics",
    "eval_do_concat_batches", "predict_with_generate", "generation_max_length", "generation_num_beams")


def _plain(value):
    return getattr(value, "value", value)  # an enum (IntervalStrategy, SchedulerType) by its name


def _length(dataset) -> int | None:
    """len() where it has one: a ChainDataset of iterable datasets is Sized but its len() raises (transformers'
    has_length catches that too)."""
    try:
        return len(dataset) if isinstance(dataset, Sized) else None
    except (TypeError, NotImplementedError):
        return None


def check_same_run(args, train_dataset, eval_dataset=None) -> None:
    """Raises ConfigError on every rank when the ranks' runs differ (one all-gather; nothing with one process)."""
    if not distributed(args.world_size):
        return
    setup = {}
    for k in SAME_ON_EVERY_RANK:
        value = getattr(args, k, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):  # accelerator_config: each field by its
            setup.update({f"{k}.{f}": v for f, v in dataclasses.asdict(value).items()})  # name, the one that differs
        else:
            setup[k] = _plain(value)
    setup["the training set's length"] = _length(train_dataset)
    # (evaluation gathers across ranks: a set of another length on one rank averaged two sets, or waited)
    evals = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
    setup["the evaluation set's length"] = {name: _length(d) for name, d in evals.items()}
    try:
        check_ranks_agree(setup, None, args.world_size, "were started for different runs",
                          "Every rank must run the same train() (the same command line and data on every node): ranks "
                          "that differ there train on a mix, or wait in a collective their peers never reach (a plain "
                          "DDP run does the same)")
    except ValueError as e:
        raise ConfigError(str(e)) from None


class SameBatches:
    """Mixed into ``ZeroOffloadMixin``: the training dataloader's batches per epoch compared across the ranks (one
    all-gather per dataloader the training loop builds, once per ``train()``). Its length comes from each rank's own
    sampler: one that yields another count on one rank (a ``_get_train_sampler`` override, a per-rank sampler) gave
    each rank its own ``max_steps``; an outside probe (2 gloo ranks, 2 and 3 batches) stopped at a lr that "differs
    across ranks" under a decaying schedule, blaming the schedule, and under a constant one trained rank 1 on 2 of
    its 3 batches (plain DDP: gloo's "Connection reset by peer").

    A loader without a length (an IterableDataset each rank reads its own shard of, ``dispatch_batches`` off) ends
    its epochs where its rank's shard ends: at such an epoch end the log/evaluate/save point is each rank's own
    (``_zo_own_end``), where the control flags' agreement and the saves' point count are not taken, as the plain
    Trainer takes no collective there. They were: an outside probe's shards of 8 and 12 samples sent rank 0's
    epoch-end agreement against rank 1's gradient reduction, and both waited until the collective timeout (plain
    DDP trained on)."""
    _zo_no_length = False  # this train()'s dataloader has no length
    _zo_in_loop = False  # within transformers' training loop, whose dataloader every rank builds
    _zo_own_end = False  # within a point at such a loader's epoch end
    _zo_last_point: tuple | None = None  # (the train()'s state, its global_step) at the last point

    def get_train_dataloader(self, *args, **kwargs):
        loader = super().get_train_dataloader(*args, **kwargs)
        try:
            n = _length(loader)
        except Exception:  # noqa: BLE001 - a len() that fails in another way than _length's: taken as none
            n = None
        # accelerate's dispatcher (its default for an IterableDataset) hands every rank a part of rank 0's batches,
        # so every rank ends its epochs at one step: there the flags are still agreed
        self._zo_no_length = n is None and not isinstance(loader, DataLoaderDispatcher)
        # (the loop's own call only: a get_train_dataloader() of the user's on one rank met its peers' next gather)
        if self._zo_in_loop and getattr(self, "_zo_raw", None) is not None and distributed(self.args.world_size):
            try:
                check_ranks_agree({"the training dataloader's batches per epoch": n}, None, self.args.world_size,
                                  "were started for different runs",
                                  "Every rank's sampler must yield the same number of batches: each rank derives "
                                  "its step count and epoch ends from it, and ranks that differ there train on a mix "
                                  "or wait in a collective their peers never reach")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return loader

    def _inner_training_loop(self, *args, **kwargs):
        self._zo_in_loop = True
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            self._zo_in_loop = False

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        last, now = self._zo_last_point, (self.state, self.state.global_step)
        self._zo_last_point = now
        # no step since the last point of this train(): its epoch end, at a step of this rank's own
        self._zo_own_end = self._zo_no_length and last is not None and last[0] is now[0] and last[1] == now[1]
        try:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        finally:
            self._zo_own_end = False
