"""A run switched to --save_only_model part way: a requeued job's --resume_from_checkpoint true takes the newest
checkpoint, which holds the model only, and is refused; the refusal said only to start afresh from its weights, the
earlier checkpoints that hold optimizer state (which a resume goes on from) not named."""
from __future__ import annotations

import pytest

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

COMMON = dict(per_device_train_batch_size=4, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, seed=0,
              disable_tqdm=True, zero_offload=OFFLOAD)


def _train(out, max_steps, resume=None, **kw):
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), max_steps=max_steps, **COMMON, **kw)
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset()).train(resume_from_checkpoint=resume)


def test_a_model_only_checkpoint_names_the_newest_earlier_one_with_optimizer_state(tmp_path):
    run = tmp_path / "run"
    _train(run, 4)  # checkpoint-2 and -4 hold the optimizer state
    _train(run, 8, resume=True, save_only_model=True)  # checkpoint-6 and -8 the model only
    with pytest.raises(FileNotFoundError, match=r"checkpoint-8 holds the model only .* Or go on from the newest "
                                                r"earlier checkpoint beside it that holds optimizer state, "
                                                rf"{run}/checkpoint-4 \(step 4: the steps after it train again\)"):
        _train(run, 10, resume=True)
    with pytest.raises(FileNotFoundError, match=rf"checkpoint-6 holds the model only .*, {run}/checkpoint-4 "):
        _train(run, 10, resume=str(run / "checkpoint-6"))
    _train(run, 6, resume=str(run / "checkpoint-4"))  # (it does)
