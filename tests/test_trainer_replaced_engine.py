"""``create_optimizer()`` of a Trainer whose engine is done: replaced by another Trainer's (or a user's) engine on the
same model, or closed. It handed the done engine back, to be refused only at its first use; now it says so at once,
naming why, as ``train()`` does (trainer/mixin.py)."""
from __future__ import annotations

import pytest

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.engine import OffloadAdam

COMMON = dict(per_device_train_batch_size=4, max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
              disable_tqdm=True)


def _trainer(tmp_path, name, model):
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), zero_offload=OFFLOAD, **COMMON)
    return ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())


@pytest.mark.parametrize("by", ["trainer", "engine"])
def test_create_optimizer_of_a_replaced_engine_says_so_naming_the_replacement(tmp_path, by):
    model = tiny_t5()
    t1 = _trainer(tmp_path, "t1", model)
    t1.create_optimizer()
    if by == "trainer":
        t2 = _trainer(tmp_path, "t2", model)
        new = t2.create_optimizer()
        assert t2.create_optimizer() is new  # the live one is handed back, as before
    else:
        new = OffloadAdam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(RuntimeError, match=r"^OffloadAdam was replaced by a new OffloadAdam built on the same "
                                           r"parameters \(e\.g\. another Trainer on this model\).* so "
                                           r"create_optimizer\(\) has nothing to work on"):
        t1.create_optimizer()
    new.close()
    if by == "trainer":
        with pytest.raises(RuntimeError, match=r"^OffloadAdam was closed; .* create_optimizer\(\)"):
            t2.create_optimizer()
