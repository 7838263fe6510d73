"""Shared by the ``test_trainer_resume*`` files (and test_storage_failures.py, test_rotation_rules.py): the tiny
T5 run they resume, and the ``full`` run whose checkpoints the tests copy (never change), trained once per session."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume


OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
COMMON = dict(per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              disable_tqdm=True, learning_rate=1e-3, weight_decay=0.01, warmup_steps=3, save_strategy="steps",
              save_steps=2)


def _trainer(out, seed=0, eval_dataset=None, **kw):
    model = tiny_t5(seed)
    targs = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, "zero_offload": OFFLOAD, **kw})
    return model, ZeroOffloadSeq2SeqTrainer(model=model, args=targs, train_dataset=ToyDataset(),
                                            eval_dataset=eval_dataset)


# The run behind ``full``, by session temp folder: pytest makes a fixture imported into several files once per
# file, and the test_trainer_resume* files that use it were one (one run). Safe to share: its users (those files
# and test_storage_failures.py) only read it or copy it.
_FULL: dict = {}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A 4-step run with checkpoints at 2 and 4, kept pristine: tests work on copies."""
    key = tmp_path_factory.getbasetemp()
    if key not in _FULL:
        out = tmp_path_factory.mktemp("full")
        model, trainer = _trainer(out)
        trainer.train()
        _FULL[key] = out, [p.detach().clone() for p in model.parameters()]
    return _FULL[key]


def _copy(full, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(full[0], dst)
    return dst


def _same(model, params):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), params))


def _without_manifest(checkpoint) -> None:
    """The marker as written before it recorded the checkpoint's files: the checks of each file's own loader."""
    marker = json.loads((checkpoint / resume.MARKER).read_text())
    del marker["files"]
    (checkpoint / resume.MARKER).write_text(json.dumps(marker))
