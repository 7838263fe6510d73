"""``consolidate`` on a PEFT adapter checkpoint: peft saves ``adapter_model.safetensors`` under names without the adapter
name (``q.lora_A.weight`` for the param ``q.lora_A.default.weight``) and without ``modules_to_save``; consolidate
refused every such checkpoint as "of different models" (an outside probe), though a bf16 run's adapter weights are
bf16-rounded there and the masters are the only fp32 copy. The layout is built here without peft (peft's LoRA layer
and ModulesToSaveWrapper naming, its save's key rule); with peft installed, a real LoraConfig run too."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_zero_offload.consolidate import consolidate, full_masters
from hf_zero_offload.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

CFG = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 4096}}


class _Lora(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _ModulesToSave(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.original_module = base.requires_grad_(False)
        self.modules_to_save = torch.nn.ModuleDict({"default": copy.deepcopy(base).requires_grad_(True)})

    def forward(self, x):
        return self.modules_to_save["default"](x)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16).requires_grad_(False)
        self.q = _Lora(torch.nn.Linear(16, 16))
        self.head = _ModulesToSave(torch.nn.Linear(16, 32))

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.q(self.emb(input_ids))))
        return {"loss": torch.nn.functional.cross_entropy(logits.float().view(-1, 32), labels.view(-1))}


class _PeftLike(torch.nn.Module):
    """PeftModel's nesting: ``base_model`` (the tuner) holding ``model``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base_model = torch.nn.Module()
        self.base_model.model = _Net()

    def forward(self, input_ids, labels):
        return self.base_model.model(input_ids, labels)


def _peft_key(name: str) -> str:  # peft's save: modules_to_save. dropped, then the adapter's name
    return name.replace("modules_to_save.", "").replace(".default", "")


class _SavesAdapters(ZeroOffloadTrainer):
    """A Trainer whose model saves as PeftModel.save_pretrained does: the trainable tensors only, peft's names."""

    def _save(self, output_dir=None, state_dict=None):
        os.makedirs(output_dir, exist_ok=True)
        tensors = {_peft_key(n): p.detach().clone() for n, p in self.model.named_parameters()
                   if p.requires_grad and (".lora_" in n or ".modules_to_save." in n)}
        save_file(tensors, os.path.join(output_dir, "adapter_model.safetensors"))
        with open(os.path.join(output_dir, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 2}, f)


def _train(tmp_path, model, trainer_cls=_SavesAdapters, **kw) -> str:
    ds = [{"input_ids": ids, "labels": ids.flip(0)} for ids in torch.randint(0, 32, (16, 6))]
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / "run"), zero_offload=CFG, max_steps=3,
                                        save_steps=3, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                        learning_rate=1e-2, disable_tqdm=True, seed=0, **kw)
    trainer_cls(model=model, args=args, train_dataset=ds).train()
    return str(tmp_path / "run" / "checkpoint-3")


@pytest.mark.parametrize("bf16", [True, False])
def test_an_adapter_checkpoint_consolidates_to_its_fp32_masters(tmp_path, bf16):
    ckpt = _train(tmp_path, _PeftLike(), bf16=bf16)
    masters = full_masters(os.path.join(ckpt, "zero_offload"))
    saved = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    assert set(saved) == {_peft_key(n) for n in masters}  # the names differ from the params' ...
    assert not set(saved) & set(masters)
    consolidate(ckpt, str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert set(out) == set(saved)  # ... and the output keeps peft's
    for name, master in masters.items():
        assert out[_peft_key(name)].dtype == torch.float32 and torch.equal(out[_peft_key(name)], master)
    if bf16:  # the checkpoint's own copy is the rounded one
        assert any(not torch.equal(saved[k].float(), out[k]) for k in saved)
    assert json.load(open(tmp_path / "out" / "adapter_config.json")) == {"peft_type": "LORA", "r": 2}


def test_a_master_the_adapter_file_lacks_is_refused_by_name(tmp_path):
    model = _PeftLike()
    model.base_model.model.q.base_layer.bias.requires_grad_(True)  # trained beside the adapter: peft never saves it
    ckpt = _train(tmp_path, model)
    with pytest.raises(ValueError, match=r"base_model\.model\.q\.base_layer\.bias .*PEFT adapter checkpoint holds "
                                         r"the weights of its 'default' adapter only"):
        consolidate(ckpt, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_with_peft_a_lora_checkpoint_consolidates(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    ckpt = _train(tmp_path, model, trainer_cls=ZeroOffloadTrainer, bf16=True)
    consolidate(ckpt, str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    masters = full_masters(os.path.join(ckpt, "zero_offload"))
    assert len(out) == len(masters) and all(torch.equal(out[_peft_key(n)], m) for n, m in masters.items())
