"""transformers' test regression model and its Trainer, for the tests/test_peer_deepspeed*.py files (the port of
transformers' tests/deepspeed/test_deepspeed.py), with the peer's ZeRO-2 config and the plain-Trainer reference
runs that the port compares against element by element.

The model is transformers' ``RegressionPreTrainedModel`` (tests/trainer/test_trainer.py): ``y = a * x + b``, two
0-dim params, MSE loss, trained on ``y = 2x + 3 + noise``.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

#: the peer's ds_config_zero2.json (tests/deepspeed/ds_config_zero2.json), every value "auto" where it is there
ZERO2_CFG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
#: the peer's ds_config_zero3.json: its zero_optimization block (the rest is ZeRO-2's)
ZERO3_OPT = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
             "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
             "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
             "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
             "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
             "stage3_gather_16bit_weights_on_model_save": False}


def ds_config(offload: str = "cpu", stage: int = 2, *, optimizer: bool = True, scheduler: bool = True,
              scale_power: int | None = None) -> dict:
    """The peer's config: ZeRO-2 (``offload`` the optimizer's device) or ZeRO-3; without the optimizer / scheduler
    block (the Trainer's then); fp16's ``initial_scale_power`` set."""
    c = copy.deepcopy(ZERO2_CFG)
    if stage == 3:
        c["zero_optimization"] = copy.deepcopy(ZERO3_OPT)
    c["zero_optimization"]["offload_optimizer"]["device"] = offload
    if not optimizer:
        del c["optimizer"]
    if not scheduler:
        del c["scheduler"]
    if scale_power is not None:
        c["fp16"]["initial_scale_power"] = scale_power
    return c


def with_dtype(kwargs: dict, dtype: str) -> dict:
    """``kwargs`` with ``bf16=True`` / ``fp16=True`` for that dtype (nothing for fp32)."""
    return kwargs if dtype == "fp32" else {**kwargs, dtype: True}


class RegressionDataset:
    def __init__(self, a=2, b=3, length=64, seed=42, label_names=None):
        np.random.seed(seed)
        self.label_names = ["labels"] if label_names is None else label_names
        self.length = length
        self.x = np.random.normal(size=(length,)).astype(np.float32)
        self.ys = [(a * self.x + b + np.random.normal(scale=0.1, size=(length,))).astype(np.float32)
                   for _ in self.label_names]

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        result = {name: y[i] for name, y in zip(self.label_names, self.ys)}
        result["input_x"] = self.x[i]
        return result


class RegressionModelConfig(PretrainedConfig):
    model_type = "regression_peer"

    def __init__(self, a=0, b=0, double_output=False, random_torch=True, **kwargs):
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.double_output = double_output
        self.random_torch = random_torch
        self.hidden_size = 1


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.double_output = config.double_output
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y, y) if self.double_output else (y,)
        loss = nn.functional.mse_loss(y, labels)
        return (loss, y, y) if self.double_output else (loss, y)


COMMON = dict(report_to="none", use_cpu=True, disable_tqdm=True)


def get_regression_trainer(a=0, b=0, double_output=False, train_len=64, eval_len=64, zero_offload=None,
                           output_dir="./regression", **kwargs):
    """The peer's get_regression_trainer with our Trainer: ``zero_offload`` is its ``deepspeed`` config."""
    from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

    model = RegressionPreTrainedModel(RegressionModelConfig(a=a, b=b, double_output=double_output))
    args = ZeroOffloadTrainingArguments(output_dir, zero_offload=zero_offload, **{**COMMON, **kwargs})
    return ZeroOffloadTrainer(model, args=args, train_dataset=RegressionDataset(length=train_len),
                              eval_dataset=RegressionDataset(length=eval_len))


def plain_trainer(output_dir, a=0, b=0, train_len=64, **kwargs):
    """The reference: transformers' own Trainer (torch AdamW, fp32) on the same model and data."""
    from transformers import Trainer, TrainingArguments

    model = RegressionPreTrainedModel(RegressionModelConfig(a=a, b=b))
    return Trainer(model, args=TrainingArguments(str(output_dir), **{**COMMON, **kwargs}),
                   train_dataset=RegressionDataset(length=train_len))


def weights(trainer) -> tuple[float, float]:
    m = trainer.model
    return m.a.item(), m.b.item()


def steps(trainer, *keys) -> list[tuple]:
    """Per logging step, the values of ``keys`` (the final summary left out)."""
    return [tuple(h[k] for k in keys) for h in trainer.state.log_history if keys[0] in h]


def assert_tracks(ours, ref, start, tol):
    """``ours`` equals the reference ``ref`` element by element within ``tol``, and the reference moved from
    ``start`` by more than 20 tolerances somewhere, so that an untrained or half-trained run fails."""
    ours, ref, start = (np.asarray(v, dtype=np.float64) for v in (ours, ref, start))
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.abs(ref - start).max() > 20 * tol, ("the reference barely moved", ref, start, tol)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)


def assert_same_state(state, state1):
    """TrainerIntegrationCommon.check_trainer_state_are_the_same: the two TrainerStates equal, timings left out."""
    state, state1 = dataclasses.asdict(state), dataclasses.asdict(state1)
    log, log1 = state.pop("log_history"), state1.pop("log_history")
    assert state == state1
    assert len(log) == len(log1)
    skip = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    for a, b in zip(log, log1):
        assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
