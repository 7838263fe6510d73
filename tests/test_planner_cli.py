"""The planner's command line and API surface (hf-zero-offload estimate, print_plan, budgets): its table, the
head the config's architectures choose, one-line refusals naming the model, the op or the missing adapter, a
CUDA budget under the per-process cap."""
from __future__ import annotations

import json

import pytest
import torch

from _planner import T5_TINY, config_file, t5_params
from hf_zero_offload import cli, planner


# -- CLI and API surface -----------------------------------------------------------------------------
def test_cli_table_in_process(capsys, tmp_path):
    path = config_file("t5-tiny", T5_TINY, tmp_path)
    assert cli.main(["estimate", "--model", str(path), "--gpus", "2", "--bf16", "--seq-len", "32", "--tgt-len",
                     "16", "--batch-size", "4", "--configs", "baseline,zero2_offload"]) == 0
    text = capsys.readouterr().out
    assert "params: 230,400" in text
    assert f"model: {path} (planned as T5ForConditionalGeneration)" in text  # the class a config becomes
    assert "baseline" in text and "zero2_offload" in text and "max batch" in text and "fits" in text
    lines = [ln for ln in text.splitlines() if ln.startswith(("configuration", "baseline", "zero2_offload"))]
    assert len({len(ln) for ln in lines}) == 1  # aligned


def test_cli_refuses_a_model_without_a_language_model_head_in_one_line(capsys, tmp_path):
    """A ViT config gave transformers' own error, which lists ~200 config classes (3.4 KB)."""
    path = tmp_path / "vit.json"
    path.write_text(json.dumps({"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64}))
    assert cli.main(["estimate", "--model", str(path)]) != 0
    err = capsys.readouterr().err
    assert (f"{path}: estimate plans text models with a language-model head; a ViTConfig (model_type 'vit') has no "
            "causal or masked one (vision, audio and classification models are not planned)") in err
    assert len(err) < 600


def _bert(tmp_path, name, **extra) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_type": "bert", "vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64, **extra}))
    return str(path)


def test_the_configs_architectures_choose_the_head(capsys, tmp_path):
    """A BertForSequenceClassification config was planned as BertLMHeadModel (a vocabulary's logits, 144,680 params
    where the classifier has 143,747) without a word, a BertForMaskedLM one as the causal head, and DistilBERT (a
    masked head, no causal one) was refused as a model without a language-model head (an outside probe)."""
    cases = [({"architectures": ["BertForMaskedLM"]}, "BertForMaskedLM"),
             ({"architectures": ["BertLMHeadModel"], "is_decoder": True}, "BertLMHeadModel"),
             ({"architectures": ["BertModel"]}, "BertLMHeadModel"),      # a bare base model: the default head
             ({"architectures": ["MyOwnBert"]}, "BertLMHeadModel"),     # a name transformers does not know, too
             ({"architectures": ["RobertaForMaskedLM"]}, "BertLMHeadModel"),  # another model type's LM head
             ({"architectures": ["BertForPreTraining"]}, "BertLMHeadModel"),  # a pretraining head (MLM + NSP)
             ({}, "BertLMHeadModel")]
    for i, (extra, planned) in enumerate(cases):
        path = _bert(tmp_path, f"b{i}", **extra)
        assert cli.main(["estimate", "--model", path, "--configs", "zero2_offload", "--seq-len", "16"]) == 0
        assert f"model: {path} (planned as {planned})" in capsys.readouterr().out
    distil = tmp_path / "distil.json"
    distil.write_text(json.dumps({"model_type": "distilbert", "vocab_size": 1000, "dim": 32, "n_layers": 1,
                                  "n_heads": 2, "hidden_dim": 64}))
    assert cli.main(["estimate", "--model", str(distil), "--configs", "zero2_offload", "--seq-len", "16"]) == 0
    assert "(planned as DistilBertForMaskedLM)" in capsys.readouterr().out
    bart = tmp_path / "bart.json"  # a causal head named on an encoder-decoder config: its seq2seq one (the traced
    bart.write_text(json.dumps({"model_type": "bart", "vocab_size": 1000, "d_model": 32,  # labels are the decoder's)
                                "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                                "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
                                "architectures": ["BartForCausalLM"]}))
    assert cli.main(["estimate", "--model", str(bart), "--configs", "zero2_offload", "--seq-len", "16"]) == 0
    assert "(planned as BartForConditionalGeneration)" in capsys.readouterr().out
    path = _bert(tmp_path, "two", architectures=["BertForSequenceClassification", "BertForMaskedLM"])
    assert cli.main(["estimate", "--model", path, "--configs", "zero2_offload", "--seq-len", "16"]) == 0
    assert "(planned as BertForMaskedLM)" in capsys.readouterr().out  # the LM head listed, not the first entry
    for odd in (5, {"a": 1}, "BertForSequenceClassification", [None]):  # (a traceback, or read by its letters)
        path = _bert(tmp_path, "odd", architectures=odd)
        assert cli.main(["estimate", "--model", path]) != 0
        err = capsys.readouterr().err
        assert "the config's architectures is" in err and "a list of transformers class names" in err, err
    for head in ("BertForSequenceClassification", "BertForQuestionAnswering", "BertForTokenClassification"):
        path = _bert(tmp_path, head, architectures=[head], num_labels=3)
        assert cli.main(["estimate", "--model", path]) != 0
        assert (f"{path}: the config's architectures names {head}, which is not a language-model head: estimate "
                "plans causal, masked and seq2seq LM heads") in capsys.readouterr().err


def test_cli_names_an_op_the_meta_device_cannot_run_not_the_config(capsys, tmp_path):
    """A mixture of experts routes tokens with torch.nonzero, which has no meta form: the error asked "are the lengths
    too long, or is a key of the config missing or wrong?" at --seq-len 16."""
    path = tmp_path / "switch.json"
    path.write_text(json.dumps({"model_type": "switch_transformers", "d_model": 32, "d_ff": 64, "num_layers": 2,
                                "num_heads": 2, "d_kv": 16, "num_experts": 2, "vocab_size": 256,
                                "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1,
                                "decoder_start_token_id": 0}))
    assert cli.main(["estimate", "--model", str(path), "--seq-len", "16", "--tgt-len", "16"]) != 0
    err = capsys.readouterr().err
    assert "which the meta device cannot run without weights: estimate cannot plan it" in err
    assert "is a key of the config missing" not in err


def test_consolidate_subcommand_dispatches_lazily():
    args = cli.build_parser().parse_args(["consolidate", "ckpt", "out"])
    assert args.func is cli._consolidate and (args.checkpoint_dir, args.output_dir) == ("ckpt", "out")


def test_budget_and_max_batch():
    assert planner.device_budget(24) == int(24 * 2**30 * 0.95) - 2**29

    class Lines:
        def peak(self, b, keep):
            return max(100 + 10 * b, 300)  # convex: flat (gradients) then linear (activations)

    assert planner._max_batch(0, Lines(), True, 299) == 0
    assert planner._max_batch(0, Lines(), True, 300) == 20
    assert planner._max_batch(50, Lines(), True, 1000) == 85


def test_print_plan_and_api(capsys):
    p = planner.print_plan(T5_TINY, gpus=1, gpu_mem_gib=1.0, seq_len=16, tgt_len=16, configs=["zero2_offload"])
    assert isinstance(p, planner.Plan) and p.params == t5_params(T5_TINY)
    assert "zero2_offload" in capsys.readouterr().out
    assert planner.format_plan(p) == planner.format_plan(p)
    with pytest.raises(FileNotFoundError):
        planner.plan("/nonexistent/config.json")


def test_cuda_budget_follows_the_per_process_cap(monkeypatch):
    """The finetune script plans against what the process may allocate: a 24 GiB cap on a 140 GiB card planned the
    whole card on the H200 (the planner said 'fits' for batches the cap refused)."""
    from types import SimpleNamespace

    from hf_zero_offload.planner import cuda_memory_gib

    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: seen.append(i) or SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 24 / 140, raising=False)
    assert cuda_memory_gib() == pytest.approx(24.0) and seen == [1]
    assert cuda_memory_gib(torch.device("cuda:3")) == pytest.approx(24.0) and seen[-1] == 3
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")  # an older torch: the card
    assert cuda_memory_gib("cuda:0") == pytest.approx(140.0)


def test_a_batch_at_the_search_limit_is_shown_as_a_bound_and_a_missing_adapter_is_named_first(capsys, tmp_path):
    """A card of 1e30 GiB read "max batch 1048575", the search's limit, as if it were the largest batch; a wrong
    --peft-config path was reported as peft missing where peft was not installed (an outside probe)."""
    path = _bert(tmp_path, "b", architectures=["BertForMaskedLM"])
    assert cli.main(["estimate", "--model", path, "--configs", "zero2_offload", "--seq-len", "16",
                     "--gpu-mem-gib", "1e30"]) == 0
    out = capsys.readouterr().out
    assert ">=1048576" in out and ">=1048576: the search stops there" in out
    missing = tmp_path / "nowhere"
    assert cli.main(["estimate", "--model", path, "--peft-config", str(missing)]) != 0
    assert f"--peft-config {missing}: no adapter_config.json there" in capsys.readouterr().err
    assert cli.main(["estimate", "--model", path, "--configs", "zero2-offload"]) == 2  # a shipped config's name
    assert "unknown row(s) 'zero2-offload' (did you mean zero2_offload?)" in capsys.readouterr().err


def test_a_moe_whose_expert_matmul_is_bf16_only_is_told_to_plan_with_bf16(capsys, tmp_path):
    """Mixtral at the default --fp16: torch's grouped matmul wants bf16, and the hint asked whether the lengths were
    too long or a config key wrong (an outside probe)."""
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 256,
                                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 2,
                                "num_experts_per_tok": 1, "max_position_embeddings": 64}))
    small = ["--configs", "zero2_offload", "--seq-len", "16", "--tgt-len", "16"]
    if cli.main(["estimate", "--model", str(path), *small]) == 0:
        pytest.skip("this torch runs the experts' grouped matmul in fp16")
    assert "grouped expert matmul runs in bf16 only: plan it with --bf16" in capsys.readouterr().err
    assert cli.main(["estimate", "--model", str(path), *small, "--bf16"]) == 0
