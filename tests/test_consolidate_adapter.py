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


class _Magnitude(torch.nn.Module):  # peft's DoraLinearLayer: one param, "weight"
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))


class _Lora(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, name: str, r: int = 2):
        super().__init__()
        self.name = name
        self.base_layer = base.requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({name: torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({name: torch.nn.Linear(r, base.out_features, bias=False)})
        self.lora_magnitude_vector = torch.nn.ModuleDict({name: _Magnitude(base.out_features)})

    def forward(self, x):
        return (self.base_layer(x) + self.lora_B[self.name](self.lora_A[self.name](x))) * \
            self.lora_magnitude_vector[self.name].weight


class _ModulesToSave(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, name: str):
        super().__init__()
        self.name = name
        self.original_module = base.requires_grad_(False)
        self.modules_to_save = torch.nn.ModuleDict({name: copy.deepcopy(base).requires_grad_(True)})

    def forward(self, x):
        return self.modules_to_save[self.name](x)


class _Net(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16).requires_grad_(False)
        self.q = _Lora(torch.nn.Linear(16, 16), name)
        self.head = _ModulesToSave(torch.nn.Linear(16, 32), name)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.q(self.emb(input_ids))))
        return {"loss": torch.nn.functional.cross_entropy(logits.float().view(-1, 32), labels.view(-1))}


class _PeftLike(torch.nn.Module):
    """PeftModel's nesting: ``base_model`` (the tuner) holding ``model``."""

    def __init__(self, name: str = "default"):
        super().__init__()
        torch.manual_seed(0)
        self.adapter = name
        self.base_model = torch.nn.Module()
        self.base_model.model = _Net(name)

    def forward(self, input_ids, labels):
        return self.base_model.model(input_ids, labels)


def _peft_key(name: str, adapter: str = "default") -> str:
    """peft's save: modules_to_save. dropped, then the adapter's name, and DoRA's magnitude without .weight."""
    key = name.replace("modules_to_save.", "").replace(f".{adapter}", "")
    return key[:-len(".weight")] if key.endswith("lora_magnitude_vector.weight") else key


class _SavesAdapters(ZeroOffloadTrainer):
    """A Trainer whose model saves as PeftModel.save_pretrained does: the trainable tensors only, peft's names."""

    def _save(self, output_dir=None, state_dict=None):
        name = self.model.adapter
        folder = output_dir if name == "default" else os.path.join(output_dir, name)  # peft's layout
        os.makedirs(folder, exist_ok=True)
        tensors = {_peft_key(n, name): p.detach().clone() for n, p in self.model.named_parameters()
                   if p.requires_grad and (".lora_" in n or ".modules_to_save." in n)}
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 2}, f)


def _train(tmp_path, model, trainer_cls=_SavesAdapters, **kw) -> str:
    ds = [{"input_ids": ids, "labels": ids.flip(0)} for ids in torch.randint(0, 32, (16, 6))]
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / "run"), zero_offload=CFG, max_steps=3,
                                        save_steps=3, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                        learning_rate=1e-2, disable_tqdm=True, seed=0, **kw)
    trainer_cls(model=model, args=args, train_dataset=ds).train()
    return str(tmp_path / "run" / "checkpoint-3")


@pytest.mark.parametrize("bf16,adapter", [(True, "default"), (False, "default"), (True, "x")])
def test_an_adapter_checkpoint_consolidates_to_its_fp32_masters(tmp_path, bf16, adapter):
    # with LoRA, DoRA's magnitude (saved without .weight) and modules_to_save; an adapter not named "default" is
    # saved in a subfolder of its name (it was "no *.safetensors model weights")
    ckpt = _train(tmp_path, _PeftLike(adapter), bf16=bf16)
    masters = full_masters(os.path.join(ckpt, "zero_offload"))
    folder = ckpt if adapter == "default" else os.path.join(ckpt, adapter)
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert set(saved) == {_peft_key(n, adapter) for n in masters}  # the names differ from the params' ...
    assert not set(saved) & set(masters) and any(k.endswith("lora_magnitude_vector") for k in saved)
    consolidate(ckpt, str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert set(out) == set(saved)  # ... and the output keeps peft's
    for name, master in masters.items():
        key = _peft_key(name, adapter)
        assert out[key].dtype == torch.float32 and torch.equal(out[key], master)
    if bf16:  # the checkpoint's own copy is the rounded one
        assert any(not torch.equal(saved[k].float(), out[k]) for k in saved)
    assert json.load(open(tmp_path / "out" / "adapter_config.json")) == {"peft_type": "LORA", "r": 2}


def test_a_master_the_adapter_file_lacks_is_refused_by_name(tmp_path):
    model = _PeftLike()
    model.base_model.model.q.base_layer.bias.requires_grad_(True)  # trained beside the adapter: peft never saves it
    ckpt = _train(tmp_path, model)
    with pytest.raises(ValueError, match=r"base_model\.model\.q\.base_layer\.bias .*PEFT adapter checkpoint holds "
                                         r"its adapter's weights only \(a base param trained beside the adapter"):
        consolidate(ckpt, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


class _Prompted(torch.nn.Module):
    """Prompt tuning's layout: the prompt embedding is the one trained param, saved as prompt_embeddings."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.prompt_encoder = torch.nn.ModuleDict({"default": torch.nn.Module()})
        self.prompt_encoder["default"].embedding = torch.nn.Embedding(2, 16)
        self.base_model = torch.nn.Module()
        self.base_model.model = torch.nn.Linear(16, 32).requires_grad_(False)

    def forward(self, input_ids, labels):
        h = self.prompt_encoder["default"].embedding.weight.sum(0)
        logits = self.base_model.model(h).expand(labels.numel(), 32)
        return {"loss": torch.nn.functional.cross_entropy(logits.float(), labels.view(-1))}


class _SavesPrompts(ZeroOffloadTrainer):
    def _save(self, output_dir=None, state_dict=None):
        os.makedirs(output_dir, exist_ok=True)
        save_file({"prompt_embeddings": self.model.prompt_encoder["default"].embedding.weight.detach().clone()},
                  os.path.join(output_dir, "adapter_model.safetensors"))
        with open(os.path.join(output_dir, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 2}, f)


def test_a_prompt_tuning_checkpoint_consolidates(tmp_path):
    ckpt = _train(tmp_path, _Prompted(), trainer_cls=_SavesPrompts, bf16=True)
    consolidate(ckpt, str(tmp_path / "out"))
    (master,) = full_masters(os.path.join(ckpt, "zero_offload")).values()
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert list(out) == ["prompt_embeddings"] and torch.equal(out["prompt_embeddings"], master)


@pytest.mark.parametrize("kind", ["lora", "dora", "adapter_x", "prompt", "adapter_model", "adapter_transformer"])
def test_with_peft_a_checkpoint_consolidates(tmp_path, kind):
    """adapter_model/adapter_transformer: an adapter named like a module of the path ("base_model.model.",
    "transformer.") was refused ("a base param trained beside the adapter is not saved"): every segment of that name
    was dropped from the keys, where peft drops the one before the last."""
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    if kind == "prompt":
        cfg = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    else:
        cfg = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=kind == "dora")
    name = kind[len("adapter_"):] if kind.startswith("adapter_") else "default"
    model = peft.get_peft_model(base, cfg, adapter_name=name)
    ckpt = _train(tmp_path, model, trainer_cls=ZeroOffloadTrainer, bf16=True)
    consolidate(ckpt, str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    masters = full_masters(os.path.join(ckpt, "zero_offload"))
    if kind == "prompt":
        assert torch.equal(out["prompt_embeddings"], next(iter(masters.values())))
        return
    saved = os.path.join(ckpt, *([] if name == "default" else [name]), "adapter_model.safetensors")
    assert set(out) == set(load_file(saved))  # peft's own keys (another adapter's file: in its own folder)
    if name in ("default", "x"):
        assert len(out) == len(masters) and all(torch.equal(out[_peft_key(n, name)], m) for n, m in masters.items())
    loaded = peft.PeftModel.from_pretrained(GPT2LMHeadModel(base.config), str(tmp_path / "out"), adapter_name=name)
    got = {n: p for n, p in loaded.named_parameters() if n in masters}
    assert len(got) == len(masters) and all(torch.equal(p.float(), masters[n]) for n, p in got.items())


def test_an_adapter_the_run_did_not_train_is_said_to_be_left_out(tmp_path, capsys):
    """A second adapter (peft's add_adapter, frozen) saved in its subfolder was left out of the output without a word
    (an outside probe with peft): said now."""
    from hf_zero_offload import cli
    ckpt = _train(tmp_path, _PeftLike())
    os.makedirs(os.path.join(ckpt, "second"))
    save_file({"q.lora_A.weight": torch.zeros(2, 16)}, os.path.join(ckpt, "second", "adapter_model.safetensors"))
    with open(os.path.join(ckpt, "second", "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2}, f)
    assert cli.main(["consolidate", ckpt, str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"left out: the checkpoint's other adapter(s) second ({os.path.join(ckpt, 'second')}), which this run " \
           "did not train" in out
    assert "left out" not in (cli.main(["consolidate", _train(tmp_path / "b", _PeftLike()), str(tmp_path / "o2")]),
                              capsys.readouterr().out)[1]
