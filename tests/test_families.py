"""Model families other than T5, tiny and random-initialised from their config classes: GPT-2 (lm_head tied to
wte), BART (one `shared` embedding under four names, a `final_logits_bias` buffer) and BERT's MLM head (its decoder
tied to the word embeddings, and its bias tied to `cls.predictions.bias` under a second name). OffloadAdam in a loop
of one's own against torch.optim.AdamW(foreach=False), the Trainer against the plain Trainer, and what its saves
reload as, element by element (the other families an outside probe ran: docs/TRAINER.md; these three cover the
ways a tie is made).
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, BertForMaskedLM, GPT2Config,
                          GPT2LMHeadModel, Trainer, TrainingArguments)

from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from hf_zero_offload.consolidate import consolidate
from hf_zero_offload.engine import OffloadAdam
from hf_zero_offload.engine.checkpoint.contents import LayoutMismatch

V, LR, WD = 100, 1e-2, 0.1
FAMILIES = ["gpt2", "bart", "bert"]
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def tiny(family: str, tied: bool = True):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=32, bos_token_id=0,
                                          eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                          tie_word_embeddings=tied))
    if family == "bart":
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
        with torch.no_grad():
            model.final_logits_bias.normal_()  # (zeros at init: a buffer that must reach the logits as it is)
        return model
    return BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0,
                                      attention_probs_dropout_prob=0))


def example(family: str, k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(3, V, (8,), generator=g)
    if family == "bart":
        return {"input_ids": ids, "labels": torch.randint(3, V, (8,), generator=g)}
    return {"input_ids": ids, "labels": torch.where(torch.arange(8) % 2 == 0, -100, ids) if family == "bert" else ids}


def batch(family: str, k: int) -> dict:
    rows = [example(family, 4 * k + i) for i in range(4)]
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def ties(model) -> list[list[str]]:
    """The names of each tensor that the model holds under several names."""
    by_storage: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(p.data_ptr(), []).append(name)
    return sorted(names for names in by_storage.values() if len(names) > 1)


def assert_params_equal(ref, model, rtol=1e-5, atol=1e-6):
    # Attention's key bias has a zero gradient but for rounding (softmax ignores a shift that is the same for every
    # key), and Adam scales that noise up to whole steps: it drifts by 1e-5 between any two orders of float ops
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        key_bias = name.endswith(("c_attn.bias", "k_proj.bias", "key.bias"))
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=1e-3 if key_bias else atol, msg=name)


def groups(model, named: bool):
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    pick = (lambda ps: ps) if named else (lambda ps: [p for _, p in ps])
    return [{"params": pick(decay), "weight_decay": WD}, {"params": pick(rest), "weight_decay": 0.0}]


@pytest.mark.parametrize("family", FAMILIES)
def test_offload_adam_trains_tied_weights_as_adamw(family):
    ref = tiny(family)
    ref.train()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(groups(ref, named=False), lr=LR, foreach=False)
    opt = OffloadAdam(groups(model, named=True), lr=LR)
    for k in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(**batch(family, k)).loss.backward()
            o.step()
            o.zero_grad()
    assert_params_equal(ref, model)
    assert ties(model) == ties(ref) != []
    for (name, a), b in zip(ref.named_buffers(), model.buffers()):
        assert torch.equal(a, b), name
    opt.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_gradients_of_a_tied_weight_are_summed_as_autograd_sums_them(family):
    """A tied weight takes a gradient from each of its uses: the 16-bit store holds autograd's bf16 sum bit for bit,
    and the step's masters equal AdamW's on fp32 masters of the same gradients."""
    masters = tiny(family)
    ref, model = copy.deepcopy(masters).bfloat16(), copy.deepcopy(masters)
    opt = OffloadAdam(groups(model, named=True), lr=LR, param_dtype=torch.bfloat16)
    model.bfloat16()
    for m in (ref, model):
        m(**batch(family, 0)).loss.backward()
    opt.pipeline.drain()
    grads = {id(p): r.grad for p, r in zip(model.parameters(), ref.parameters())}
    for p, off, n in opt._flat:
        assert torch.equal(opt.pipeline.store[off:off + n], grads[id(p)].reshape(-1))
    ref_opt = torch.optim.AdamW(groups(masters, named=False), lr=LR, foreach=False)
    for m, r in zip(masters.parameters(), ref.parameters()):
        m.grad = r.grad.float()
    ref_opt.step()
    opt.step()
    for (name, m), p in zip(masters.named_parameters(), model.parameters()):
        off, n = next((off, n) for q, off, n in opt._flat if q is p)
        master = opt.master[off:off + n].view(p.shape)
        torch.testing.assert_close(master, m.detach(), rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(p.detach(), master.bfloat16()), name  # (a master 1 ulp off AdamW's can round elsewhere)
    assert ties(model) == ties(ref)
    opt.close()


class Rows(torch.utils.data.Dataset):
    def __init__(self, family):
        self.family = family

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return example(self.family, i)


def train(family, tmp_path, name, ours: bool, tied=True, resume=None, **more):
    model = tiny(family, tied)
    kw = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
              report_to=[], seed=0, disable_tqdm=True, learning_rate=LR, weight_decay=WD, max_grad_norm=1.0,
              warmup_steps=1, save_strategy="steps", save_steps=3, **more)
    args = (ZeroOffloadTrainingArguments(zero_offload=OFFLOAD, **kw) if ours
            else TrainingArguments(optim="adamw_torch", **kw))
    trainer = (ZeroOffloadTrainer if ours else Trainer)(model=model, args=args, train_dataset=Rows(family))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def assert_reloads(model, folder, expected: dict):
    """``from_pretrained(folder)`` has the model's ties, and ``expected``'s values (fp32) under every name."""
    loaded = type(model).from_pretrained(str(folder), dtype=torch.float32)
    assert ties(loaded) == ties(model), folder
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name].float()), (folder, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_equals_the_plain_trainer_with_tied_weights(family, tmp_path):
    ref, _ = train(family, tmp_path, "plain", ours=False)
    model, _ = train(family, tmp_path, "ours", ours=True)
    assert_params_equal(ref, model)
    assert ties(model) == ties(ref) != []


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_trainer_saves_reload_with_the_tie(family, tmp_path):
    """save_model (safetensors: the tied copies dropped) reloads the 16-bit weights; consolidate's output the fp32
    masters under every name of a tied weight, the frozen tensors and buffers upcast."""
    model, trainer = train(family, tmp_path, "ours", ours=True, bf16=True)
    trainer.save_model(str(tmp_path / "saved"))
    assert_reloads(model, tmp_path / "saved", model.state_dict())
    engine = trainer.optimizer.optimizer
    masters = dict(model.state_dict())
    for name, p in model.named_parameters(remove_duplicate=False):
        off, n = next((off, n) for q, off, n in engine._flat if q is p)
        masters[name] = engine.master[off:off + n].view(p.shape)
    assert any(not torch.equal(masters[n], p.float()) for n, p in model.named_parameters())  # (masters not 16-bit)
    consolidate(str(tmp_path / "ours" / "checkpoint-3"), str(tmp_path / "fp32"))
    assert_reloads(model, tmp_path / "fp32", masters)


@pytest.mark.parametrize("listing", ["named-with-duplicates", "two-groups"])
def test_a_tied_weight_listed_twice_is_refused_naming_both_places(listing):
    """``named_parameters(remove_duplicate=False)`` (or a walk over ``model.modules()``) lists GPT-2's tied wte/lm_head
    weight twice: refused naming both (the message named neither; across groups it was torch's own, naming none)."""
    model = tiny("gpt2")
    named = list(model.named_parameters(remove_duplicate=False))
    if listing == "named-with-duplicates":
        params, match = named, (r"'transformer.wte.weight' \(param 0 of group 0\) and 'lm_head.weight' \(param "
                                r"\d+ of group 0\) are the same tensor \(shape \(100, 32\), one weight tied under two")
    else:
        params = [{"params": [p for n, p in named if n != "lm_head.weight"]}, {"params": [model.lm_head.weight]}]
        match = r"param 0 of group 0 and param 0 of group 1 are the same tensor \(shape \(100, 32\)\), listed twice"
    with pytest.raises(ValueError, match=match):
        OffloadAdam(params, lr=LR)
    OffloadAdam(model.named_parameters(), lr=LR).close()  # (each once: taken)


@pytest.mark.parametrize("saved_tied", [True, False], ids=["tied-then-untied", "untied-then-tied"])
def test_a_resume_across_a_tie_made_or_undone_names_it(saved_tied, tmp_path):
    """tie_word_embeddings changed between the save and the resume: refused (the saved state holds one master for two
    params, or two for one), and named as the tie it is; it was named "trainable now, not in the checkpoint:
    lm_head.weight" (or "trainable in the checkpoint, not now"), which lm_head.weight was, as wte's second name."""
    train("gpt2", tmp_path, "run", ours=True, tied=saved_tied)
    side = "in the checkpoint, not now" if saved_tied else "now, not in the checkpoint"
    with pytest.raises(LayoutMismatch, match=rf"\(tied {side}: lm_head\.weight \(to transformer\.wte\.weight\); from"):
        train("gpt2", tmp_path, "resumed", ours=True, tied=not saved_tied, resume=str(tmp_path / "run" / "checkpoint-3"))
