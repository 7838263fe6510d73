"""save_total_limit under our rule in real Trainer runs (tiny T5, CPU): transformers' own end-of-training cleanup
(save_total_limit=1 with a best checkpoint), checkpoints a user's on_save edited, a plain Trainer's --save_only_model
checkpoints beside ours, a folder removed while rotation looks; and what a failed save says (the file, the cause kept,
pickling, another rank's failure)."""
from __future__ import annotations

import errno
import logging
import os
import pickle
import re

import pytest

from hf_zero_offload import resume
from hf_zero_offload.trainer import save_errors
from test_trainer_resume import _trainer


def test_the_file_named_is_one_of_the_checkpoint_saved_and_not_a_temporary(tmp_path):
    target = str(tmp_path / "checkpoint-6")
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "checkpoint-2"))
    assert save_errors.file_written(other, target) is None
    tmp = OSError(errno.ENOSPC, "No space left on device", f"{target}/zero_offload/rank1_of_2.hzo.hzo-tmp.vm.21138")
    assert save_errors.file_written(tmp, target) == f"{target}/zero_offload/rank1_of_2.hzo"


def test_a_failure_describing_the_failure_keeps_the_cause(tmp_path, monkeypatch):
    """newest_whole raising (a folder not readable): the PermissionError was raised in place of the full disk."""
    import transformers.modeling_utils as mu

    real = mu.safe_save_file
    full = OSError(errno.ENOSPC, "No space left on device")

    def save_file(tensors, filename, metadata=None):
        if "checkpoint-4" in filename:
            raise full
        return real(tensors, filename, metadata=metadata)

    def newest(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out" / "checkpoint-2"))
    monkeypatch.setattr(mu, "safe_save_file", save_file)
    monkeypatch.setattr(resume, "newest_whole", newest)
    _, trainer = _trainer(tmp_path / "out", max_steps=4, save_steps=2)
    with pytest.raises(save_errors.CheckpointSaveError) as e:
        trainer.train()
    assert e.value.__cause__ is full and e.value.errno == errno.ENOSPC
    assert re.search(r"no space left on device .*the newest complete checkpoint could not be looked for "
                     r"\(PermissionError: .*Permission denied", str(e.value)), str(e.value)


@pytest.mark.parametrize("cause", [OSError(errno.ENOSPC, "No space left on device"),
                                   FileNotFoundError(errno.ENOENT, "gone"), RuntimeError("unexpected pos")])
def test_save_errors_survive_pickling(tmp_path, cause):
    e = save_errors.wrap(cause, str(tmp_path / "checkpoint-2"), str(tmp_path))
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e) and again.errno == e.errno
    assert isinstance(again, save_errors.CheckpointSaveError) and isinstance(again, OSError)
    if isinstance(cause, OSError):
        assert isinstance(again, type(cause))


def test_another_ranks_failure_is_said_once():
    target = "/r/checkpoint-4"
    said = save_errors.failed_on(target, f"rank 1 (host vm): saving {target} failed: no space left on device "
                                         f"writing {target}/rng_state_1.pth (OSError: ...); it is not complete and a "
                                         "resume skips it; the newest complete checkpoint is /r/checkpoint-2")
    assert said.count(f"saving {target} failed") == 1 and said.count("it is not complete") == 1, said
    assert said.startswith(f"saving {target} failed on rank 1 (host vm): no space left on device writing"), said
    assert save_errors.failed_on(target, "rank 1 (host vm): boom") == (
        f"saving {target} failed on rank 1 (host vm): boom; it is not complete and a resume skips it")
