"""Run under torchrun by tests/test_peer_deepspeed_launcher.py: stands in for transformers' examples
run_translation.py / run_clm.py in the peer's TestDeepSpeedWithLauncher, on a tiny random T5 / GPT-2 and synthetic
data, with the peer's ZeRO-2 config (--sharded_ddp on more than one rank). Writes train/eval results and the model
to --output_dir.

--reference runs the same with transformers' own Trainer (DDP, torch AdamW, fp32) instead: the run the test
compares against. The config's WarmupLR warms up linearly ("warmup_type": "linear"), as the reference's
constant_with_warmup does (DeepSpeed's default log warm-up has no Trainer counterpart).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _peer import ds_config, with_dtype  # noqa: E402
from _t5 import ToyDataset, WithDecoderInputs, tiny_t5  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--output_dir", required=True)
p.add_argument("--dtype", default="fp32")
p.add_argument("--offload", default="cpu")
p.add_argument("--do_train", action="store_true")
p.add_argument("--do_eval", action="store_true")
p.add_argument("--model_name_or_path", default=None)
p.add_argument("--task", default="translation", choices=["translation", "clm"])
p.add_argument("--reference", action="store_true")
a = p.parse_args()

from transformers import (GPT2Config, GPT2LMHeadModel, Seq2SeqTrainer, Seq2SeqTrainingArguments,  # noqa: E402
                          T5ForConditionalGeneration, Trainer, TrainingArguments)

from hf_zero_offload import (ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments,  # noqa: E402
                             ZeroOffloadTrainer, ZeroOffloadTrainingArguments)

common = dict(output_dir=a.output_dir, warmup_steps=8, save_strategy="no", eval_steps=10, report_to="none",
              use_cpu=True, disable_tqdm=True, num_train_epochs=1, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, learning_rate=3e-3, do_train=a.do_train, do_eval=a.do_eval, seed=42,
              logging_steps=1)
if a.reference:
    assert a.dtype == "fp32", "the reference is the plain Trainer in fp32"
    common.update(optim="adamw_torch", lr_scheduler_type="constant_with_warmup")
else:
    ds = ds_config(a.offload)
    ds["scheduler"]["params"]["warmup_type"] = "linear"
    common = with_dtype(dict(common, zero_offload=ds, sharded_ddp=int(os.environ.get("WORLD_SIZE", "1")) > 1),
                        a.dtype)


class CLMData(torch.utils.data.Dataset):
    def __init__(self, n, seed, vocab=70, length=16):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def first(preds):
    return preds[0] if isinstance(preds, tuple) else preds


if a.task == "translation":
    model = T5ForConditionalGeneration.from_pretrained(a.model_name_or_path) if a.model_name_or_path else tiny_t5()

    def compute_metrics(ev):
        preds, labels = first(ev.predictions), ev.label_ids
        n = min(preds.shape[1], labels.shape[1])
        m = labels[:, :n] != -100
        return {"accuracy": float(((preds[:, :n] == labels[:, :n]) & m).sum() / max(m.sum(), 1))}

    # the peer's run_translation flags: --predict_with_generate --group_by_length --label_smoothing 0.1
    kw = dict(predict_with_generate=True, generation_max_length=10, train_sampling_strategy="group_by_length",
              label_smoothing_factor=0.1, **common)
    trainer_cls, args = ((Seq2SeqTrainer, Seq2SeqTrainingArguments(**kw)) if a.reference else
                         (ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments(**kw)))
    trainer = trainer_cls(model=model, args=args, train_dataset=WithDecoderInputs(16),
                          eval_dataset=WithDecoderInputs(16, seed=1), compute_metrics=compute_metrics)
else:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.resize_token_embeddings(70)  # the peer's test_clm: a vocabulary grown after the model was made

    def compute_metrics(ev):
        preds, labels = first(ev.predictions), ev.label_ids
        return {"accuracy": float((preds.argmax(-1)[:, :-1] == labels[:, 1:]).mean())}

    trainer_cls, args = ((Trainer, TrainingArguments(**common)) if a.reference else
                         (ZeroOffloadTrainer, ZeroOffloadTrainingArguments(**common)))
    trainer = trainer_cls(model=model, args=args, train_dataset=CLMData(16, 0), eval_dataset=CLMData(16, 1),
                          compute_metrics=compute_metrics)

if a.do_train:
    r = trainer.train()
    trainer.save_model()
    trainer.save_metrics("train", r.metrics)
    trainer.save_state()
if a.do_eval:
    trainer.save_metrics("eval", trainer.evaluate())
if torch.distributed.is_initialized():  # a group left to the interpreter's exit can abort a rank (SIGABRT)
    torch.distributed.destroy_process_group()
