"""Shared by the ``test_trainer_features*`` files: the training arguments they start from, and a float-input
regressor with its data."""
from __future__ import annotations

import torch

from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments

COMMON = dict(per_device_train_batch_size=4, max_steps=6, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0)


def _args(tmp_path, name, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), **{**COMMON, **kw})


class FloatRegressor(torch.nn.Module):
    """A model whose inputs are float features (audio / vision style), with a loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.seen: list[torch.dtype] = []

    def forward(self, features, labels=None):
        self.seen.append(features.dtype)
        out = self.net(features).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels.float()), "logits": out}


class FloatData(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(-1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}
