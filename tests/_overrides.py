"""Shared by the ``test_trainer_overrides*`` files: the training arguments they start from, and the element by
element comparison of a run against the plain Trainer's."""
from __future__ import annotations

import pytest

from _t5 import logged
from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments

COMMON = dict(per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0)


def _args(tmp_path, name, cls=ZeroOffloadSeq2SeqTrainingArguments, **kw):
    return cls(output_dir=str(tmp_path / name), **{**COMMON, **kw})


def _assert_same(ref_model, ref, model, ours, atol=5e-7):
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert (a - b).abs().max().item() <= atol, n
    for key in ("loss", "grad_norm", "learning_rate"):
        assert logged(ours, key) == pytest.approx(logged(ref, key), rel=2.5e-7, abs=1e-12), key
