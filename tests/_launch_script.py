"""Run by tests/test_launch.py under torchrun: a 2-step ZeRO-Offload Trainer run on a tiny T5.

usage: _launch_script.py OUTPUT_DIR [--use_cpu]
"""
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _t5 import ToyDataset, tiny_t5  # noqa: E402
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
args = ZeroOffloadSeq2SeqTrainingArguments(
    output_dir=sys.argv[1], use_cpu="--use_cpu" in sys.argv, per_device_train_batch_size=4, max_steps=2,
    report_to=[], save_strategy="no", disable_tqdm=True, sharded_ddp=True,
    zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset()).train()
