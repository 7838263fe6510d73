"""examples/seq2seq/finetune_trainer.py's legacy flags (transformers 4's and the original script's), mapped to
today's or refused naming the new spelling; JSON arguments files alike."""
import json
import os
import warnings

import pytest

from _examples import CONFIGS, TINY

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402


def test_legacy_flags_are_mapped():
    model_args, data_args, args = finetune_trainer.parse_args([
        "--config_name", TINY, "--data_dir", "x", "--output_dir", "o", "--label_smoothing", "0.1",
        "--adam_eps", "1e-6", "--evaluation_strategy", "no", "--sortish_sampler", "--freeze_embeds",
        "--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"), "--use_cpu",
    ])
    assert data_args.label_smoothing == 0.1 and args.adam_epsilon == 1e-6 and args.eval_strategy == "no"
    assert args.sortish_sampler and model_args.freeze_embeds and args.zero_offload.endswith("ds_config_1gpu.json")


@pytest.mark.parametrize("form", ["space", "equals"])
@pytest.mark.parametrize("name", ["--lr_scheduler", "--lr_scheduler_type"])
def test_legacy_scheduler_value_names_are_mapped(form, name):
    """v4.2's --lr_scheduler took constant_w_warmup and cosine_w_restarts, which transformers renamed."""
    for old, new in (("constant_w_warmup", "constant_with_warmup"), ("cosine_w_restarts", "cosine_with_restarts")):
        flag = [name, old] if form == "space" else [f"{name}={old}"]
        _, _, args = finetune_trainer.parse_args(["--config_name", TINY, "--data_dir", "x", "--output_dir", "o",
                                                  "--use_cpu", *flag])
        assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == new


@pytest.mark.parametrize("flags, adafactor", [(["--adafactor"], True), (["--adafactor", "true"], True),
                                              (["--adafactor=1"], True), (["--adafactor", "false"], False),
                                              (["--adafactor=false"], False), (["--adafactor=no"], False)])
def test_the_legacy_adafactor_flag_reads_its_value(flags, adafactor, tmp_path):
    """--adafactor=false switched Adafactor on (any mention of the flag did), --adafactor false was "unknown
    arguments: false", and an arguments file's "adafactor": false was not used (an outside probe)."""
    base = ["--config_name", TINY, "--data_dir", "x", "--output_dir", "o", "--use_cpu"]
    _, _, args = finetune_trainer.parse_args(base + flags + ["--do_train"])
    assert (str(getattr(args.optim, "value", args.optim)) == "adafactor") == adafactor and args.do_train
    path = tmp_path / "args.json"
    for value in (adafactor, str(adafactor).lower()) + ((None,) if not adafactor else ()):  # null: v4's default
        path.write_text(json.dumps({"config_name": TINY, "data_dir": "x", "output_dir": "o", "use_cpu": True,
                                    "adafactor": value}))
        _, _, args = finetune_trainer.parse_args([str(path)])
        assert (str(getattr(args.optim, "value", args.optim)) == "adafactor") == adafactor
    path.write_text(json.dumps({"config_name": TINY, "fp16_opt_level": "O1"}))  # advice, as on the command line
    with pytest.raises(ValueError, match=r"args.json: keys of transformers 4.x: fp16_opt_level \(apex's"):
        finetune_trainer.parse_args([str(path)])


def test_removed_per_gpu_batch_flags_are_mapped_and_a_legacy_spelling_beside_its_new_one_refused(tmp_path):
    base = ["--config_name", TINY, "--data_dir", "x", "--output_dir", "o", "--use_cpu"]
    _, _, args = finetune_trainer.parse_args(base + ["--per_gpu_train_batch_size", "3", "--per_gpu_eval_batch_size=5"])
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size) == (3, 5)
    # both spellings: the later one won without a word (a review); refused as for --eval_beams
    with pytest.raises(ValueError, match=r"--per_gpu_train_batch_size and --per_device_train_batch_size: the first "
                                         r"is the legacy spelling of the second; give one"):
        finetune_trainer.parse_args(base + ["--per_gpu_train_batch_size", "3", "--per_device_train_batch_size=4"])
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"config_name": TINY, "data_dir": "x", "output_dir": "o", "use_cpu": True,
                                "adam_eps": 1e-7, "adam_epsilon": 1e-6}))
    with pytest.raises(ValueError, match=r"adam_eps and adam_epsilon: .*give one"):
        finetune_trainer.parse_args([str(path)])


def test_legacy_model_config_flags_set_the_config(tmp_path):
    """--dropout & co. were unknown arguments; v4.2 set them on the model config where it has the attribute."""
    from transformers import BartConfig

    config = BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=64)
    model_args, data_args, args = finetune_trainer.parse_args([
        "--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "o"), "--use_cpu", "--dropout", "0.2",
        "--attention_dropout", "0.1", "--encoder_layerdrop", "0.05", "--decoder_layerdrop", "0.0"])
    finetune_trainer.check_values(model_args, data_args, args, config)
    assert (config.dropout, config.attention_dropout, config.encoder_layerdrop, config.decoder_layerdrop) == (
        0.2, 0.1, 0.05, 0.0)


def test_a_json_arguments_file_maps_the_legacy_keys(tmp_path):
    """The script's one-.json-argument form skipped the mapping: "Some keys are not used by the HfArgumentParser"."""
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"config_name": TINY, "data_dir": "x", "output_dir": str(tmp_path / "o"),
                                "use_cpu": True, "lr_scheduler": "cosine_w_restarts", "evaluation_strategy": "no",
                                "adam_eps": 1e-7, "label_smoothing": 0.1}))
    _, data_args, args = finetune_trainer.parse_args([str(path)])
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "cosine_with_restarts"
    assert args.adam_epsilon == 1e-7 and data_args.label_smoothing == 0.1


@pytest.mark.parametrize("content,match", [
    (b'{"output_dir": "o",}', r"args.json:1:20: invalid JSON: Expecting property name"),
    (b'{"model_name_or_path": "caf\xe9"}', r"args.json: not a UTF-8 text file \(line 1: byte 27 is 0xe9\)"),
    (b'\xef\xbb\xbf{\r\n"model_name_or_path": "caf\xe9"}',
     r"args.json: not a UTF-8 text file \(line 2: byte 32 is 0xe9\)"),
    (b"[1, 2]", r"args.json: expected one JSON object of flags"),
])
def test_a_bad_json_arguments_file_is_named(tmp_path, content, match):
    path = tmp_path / "args.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        finetune_trainer.parse_args([str(path)])
    with pytest.raises(ValueError, match="nope.json: cannot read the arguments file"):
        finetune_trainer.parse_args([str(tmp_path / "nope.json")])


@pytest.mark.parametrize("form", [["--sharded_ddp", "zero_dp_2"], ["--sharded_ddp=zero_dp_3 offload"],
                                  ["--sharded_dd", "simple"]])
def test_transformers_4_sharded_ddp_values_say_the_flag_is_a_switch(tmp_path, form):
    with pytest.raises(ValueError, match="transformers 4.x's fairscale values .* here --sharded_ddp is a switch"):
        finetune_trainer.parse_args(["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path), *form])


def test_gradient_checkpointing_flag_is_mapped_without_a_deprecation_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, targs = finetune_trainer.parse_args(["--output_dir", str(tmp_path), "--gradient_checkpointing",
                                                   "--use_cpu"])
    # (before transformers 5.23 there is no --activation_checkpointing: the flag is taken as it is)
    assert getattr(targs, "activation_checkpointing", True) and targs.gradient_checkpointing


def test_quiet_flag_renames_only_to_names_this_transformers_has():
    """--gradient_checkpointing was rewritten to --activation_checkpointing, which transformers before 5.23 does not
    know: "unknown arguments: --activation_checkpointing (did you mean --gradient_checkpointing?)" (outside probe V)."""
    import dataclasses

    import seq2seq_utils as su
    from transformers import TrainingArguments
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert all(new[2:] in fields for new in su.QUIET_FLAG_RENAMES.values())
    assert all(old[2:] in fields for old in su.QUIET_FLAG_RENAMES)  # the old name still parses where it is kept


def test_both_checkpointing_spellings_are_left_to_transformers_rule():
    """--activation_checkpointing false --gradient_checkpointing: the rename made two --activation_checkpointing and the
    old spelling won; transformers alone lets the new name win (outside probe R2)."""
    import seq2seq_utils as su
    if "--gradient_checkpointing" not in su.QUIET_FLAG_RENAMES:
        pytest.skip("this transformers has no --activation_checkpointing")
    argv = ["--activation_checkpointing", "false", "--gradient_checkpointing"]
    assert su.rewrite_legacy_argv(argv) == argv
    assert su.rewrite_legacy_argv(["--gradient_checkpointing"]) == ["--activation_checkpointing"]
    both = {"activation_checkpointing": False, "gradient_checkpointing": True}
    assert su.rewrite_legacy_keys(both) == both
    assert su.rewrite_legacy_keys({"gradient_checkpointing": True}) == {"activation_checkpointing": True}
