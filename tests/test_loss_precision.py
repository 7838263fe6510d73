"""A 16-bit model's language-model loss is computed in fp32 (trainer/loss_precision.py): the engine casts the whole
model and runs it without autocast, and a model computing its cross-entropy on its own logits (T5) returned a
16-bit loss (an outside probe: eval_loss 6.0 at nine evaluations in a row, so load_best_model_at_end kept an early
checkpoint)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments, ZeroOffloadTrainer
from hf_zero_offload.trainer import ZeroOffloadTrainingArguments

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=8, max_steps=2, use_cpu=True, report_to=[],
              logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0)


def _t5_trainer(tmp_path, **kw):
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / "t5"), zero_offload=OFFLOAD,
                                               **{**COMMON, **kw})
    return ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset(),
                                     eval_dataset=ToyDataset(8, seed=1))


def _batch(ds) -> dict:
    return {k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ds[0]}


def _fp32_loss_of_16bit_logits(model, batch) -> torch.Tensor:
    """What the plain Trainer's autocast computes: the model's 16-bit logits, their cross-entropy in fp32."""
    head = model.get_output_embeddings()
    saved = dict(head._forward_hooks)
    head._forward_hooks.clear()
    try:
        logits = model(**batch).logits
    finally:
        head._forward_hooks.update(saved)
    assert logits.dtype == torch.bfloat16
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["labels"].view(-1))


@pytest.mark.parametrize("fp16", [False, True])
def test_t5_loss_is_fp32_in_a_16bit_run(tmp_path, fp16):
    trainer = _t5_trainer(tmp_path, **({"fp16": True} if fp16 else {"bf16": True}))
    trainer.train()
    model, dtype = trainer.model, torch.float16 if fp16 else torch.bfloat16
    assert next(model.parameters()).dtype == dtype  # the model is 16-bit, as DeepSpeed casts it
    batch = _batch(ToyDataset(8, seed=1))
    with torch.no_grad():
        out = model(**batch)
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    if not fp16:
        with torch.no_grad():
            assert torch.equal(out.loss, _fp32_loss_of_16bit_logits(model, batch))
    # the logged losses are fp32 values, not bf16 ones
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert any(torch.tensor(x).to(dtype).float().item() != x for x in losses)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(out.loss.item(), rel=1e-6)
    assert torch.tensor(metrics["eval_loss"]).to(dtype).float().item() != metrics["eval_loss"]


def test_predictions_keep_the_logits_16bit(tmp_path):
    # compute_metrics gathers what prediction_step returns: the training dtype, as with autocast or DeepSpeed
    trainer = _t5_trainer(tmp_path, bf16=True)
    trainer.train()
    batch = trainer._prepare_inputs(_batch(ToyDataset(4, seed=2)))
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert loss.dtype == torch.float32
    first = logits[0] if isinstance(logits, tuple) else logits
    assert first.dtype == torch.bfloat16 and first.shape[-1] == trainer.model.config.vocab_size
    assert all(t.dtype == torch.bfloat16 for t in (logits if isinstance(logits, tuple) else [logits])
               if isinstance(t, torch.Tensor))
    pred = trainer.predict(ToyDataset(4, seed=2))
    assert pred.metrics["test_loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_fp32_run_adds_no_hook(tmp_path):
    trainer = _t5_trainer(tmp_path)
    trainer.train()
    assert not trainer.model.get_output_embeddings()._forward_hooks


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def test_a_model_that_widens_its_logits_itself_trains_as_before(tmp_path):
    # GPT-2's loss_function widens the logits already: the same loss, bit for bit, and the tie kept; one hook
    # however many Trainers hold the model
    ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12), generator=torch.Generator()
                                                                         .manual_seed(0))]
    model = _gpt2()
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / "g"), zero_offload=OFFLOAD, bf16=True,
                                        **{**COMMON, "per_device_train_batch_size": 8})
    for _ in range(2):
        ZeroOffloadTrainer(model=model, args=args, train_dataset=ds).train()
    head = model.get_output_embeddings()
    assert len(head._forward_hooks) == 1
    assert head.weight is model.transformer.wte.weight
    batch = {k: torch.stack([d[k] for d in ds]) for k in ds[0]}
    with torch.no_grad():
        widened = model(**batch).loss
        saved = dict(head._forward_hooks)
        head._forward_hooks.clear()
        plain = model(**batch).loss
        head._forward_hooks.update(saved)
    assert torch.equal(widened, plain)


class _TiedByFunctional(torch.nn.Module):
    """An LM whose output projection is its embedding table, used through F.linear: the output embeddings are an
    nn.Embedding, whose forward (the input lookup) must stay in the model's dtype."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.mix = torch.nn.Linear(16, 16)

    def get_output_embeddings(self):
        return self.emb

    def forward(self, input_ids, labels=None):
        logits = F.linear(torch.tanh(self.mix(self.emb(input_ids))), self.emb.weight)
        loss = F.cross_entropy(logits.view(-1, 64), labels.view(-1))
        return {"loss": loss, "logits": logits}


def test_an_embedding_used_as_the_output_projection_is_left_alone(tmp_path):
    ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 6))]
    model = _TiedByFunctional()
    cfg = {**OFFLOAD, "zero_optimization": {**OFFLOAD["zero_optimization"], "reduce_bucket_size": 4096}}
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / "e"), zero_offload=cfg, bf16=True, **COMMON)
    ZeroOffloadTrainer(model=model, args=args, train_dataset=ds).train()
    assert not model.emb._forward_hooks and model.emb.weight.dtype == torch.bfloat16


def test_the_plain_trainer_is_untouched(tmp_path):
    model = tiny_t5()
    args = TrainingArguments(output_dir=str(tmp_path / "p"), bf16=True, **COMMON)
    Trainer(model=model, args=args, train_dataset=ToyDataset()).train()
    assert not model.get_output_embeddings()._forward_hooks


def test_the_16bit_loss_is_kept_on_request(tmp_path):
    # --zero_offload_fp32_logits false: DeepSpeed's 16-bit loss, without the fp32 logits' memory
    trainer = _t5_trainer(tmp_path, bf16=True, zero_offload_fp32_logits=False)
    trainer.train()
    assert not trainer.model.get_output_embeddings()._forward_hooks
    with torch.no_grad():
        assert trainer.model(**_batch(ToyDataset(8, seed=1))).loss.dtype == torch.bfloat16


def test_the_switch_holds_for_a_model_an_earlier_trainer_widened(tmp_path):
    # an outside probe: the first Trainer's hook stayed, so the second one's 16-bit loss was fp32 all the same, and
    # its evaluation returned fp32 logits
    first = _t5_trainer(tmp_path, bf16=True)
    first.train()
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / "again"), zero_offload=OFFLOAD, bf16=True,
                                               zero_offload_fp32_logits=False, **COMMON)
    second = ZeroOffloadSeq2SeqTrainer(model=first.model, args=args, train_dataset=ToyDataset())
    second.train()
    assert not first.model.get_output_embeddings()._forward_hooks
    with torch.no_grad():
        assert first.model(**_batch(ToyDataset(8, seed=1))).loss.dtype == torch.bfloat16
