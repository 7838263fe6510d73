"""examples/seq2seq/finetune_trainer.py's arguments: legacy flags, and every mistake a first-hour user makes
refused in one line before any model work (the runs themselves: test_examples.py)."""
import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

from _examples import CONFIGS, EX, ROOT, TINY, write_synth
from _examples import common_args as _common_args
from _procs import run_together

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return write_synth(tmp_path_factory)


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


@pytest.mark.parametrize("extra,match", [
    # each failed after training: at generation (ZeroDivisionError, a negative dimension) or the test split
    (["--eval_beams", "0"], r"--eval_beams 0: generation needs at least 1 beam"),
    (["--generation_num_beams", "-1"], r"--generation_num_beams -1: generation needs at least 1 beam"),
    (["--n_test", "0", "--do_predict"], r"--n_test 0: the number of test examples to use, > 0 \(-1: all\)"),
    (["--n_val", "-2"], r"--n_val -2"),
    (["--eval_beams", "4", "--generation_num_beams", "2"], r"--eval_beams 4 and --generation_num_beams 2: .*give one"),
    (["--label_smoothing", "0.1", "--label_smoothing_factor", "0.3"], r"--label_smoothing 0.1 and "
                                                                       r"--label_smoothing_factor 0.3: .*give one"),
    # v4.2's model-config flags: T5's config has no dropout (v4.2 asserted the same)
    (["--dropout", "0.2"], r"--dropout: T5Config has no dropout \(T5's is dropout_rate"),
    (["--attention_dropout", "1.5"], r"--attention_dropout 1.5: a probability in \[0, 1\)"),
    # a ZeroDivisionError inside train() (with or without --zero_offload); lengths of 0 tokenized to nothing
    (["--gradient_accumulation_steps", "0"], r"--gradient_accumulation_steps 0: the micro-batches of one optimizer"),
    (["--gradient_accumulation_steps", "-1", "--zero_offload", "zero2-offload"], r"--gradient_accumulation_steps -1"),
    (["--max_source_length", "0"], r"--max_source_length 0: a length in tokens, >= 1"),
    (["--generation_max_length", "0"], r"--generation_max_length 0: a length in tokens, >= 1"),
    (["--val_max_target_length", "-5", "--max_target_length", "0"], r"--max_target_length 0: a length in tokens, "
                                                                      r">= 1; --val_max_target_length -5"),
    (["--learning_rate", "-1", "--zero_offload", "zero2-offload"], r"--learning_rate -1.0: must be a finite number"),
    # trained on without a word (an outside probe, session 33)
    (["--label_smoothing", "1.5"], r"--label_smoothing 1.5: the share of the target's probability .* in \[0, 1\)"),
    (["--label_smoothing_factor", "-0.1"], r"--label_smoothing_factor -0.1: the share"),
    (["--sortish_sampler", "--train_sampling_strategy", "group_by_length"],
     r"--sortish_sampler and --train_sampling_strategy group_by_length: both choose the training order"),
    (["--adafactor=maybe"], r"--adafactor maybe: true or false"),
    (["--adafactor", "--optim", "adamw_torch"], r"--adafactor and --optim: .*give one"),
    (["--fp16_opt_level", "O1"], r"--fp16_opt_level \(apex's optimization level: .*removed apex; drop it\)"),
    (["--evaluate_during_training"], r"--evaluate_during_training \(use --eval_strategy steps and --eval_steps\)"),
])
def test_values_the_run_cannot_use_are_refused_before_any_model_work(tmp_path, synth_dir, monkeypatch, extra, match):
    _no_model_work(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", *extra])
    assert not out.exists() or not os.listdir(out)


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


@pytest.mark.parametrize("split", ["--do_eval", "--do_predict"])
def test_an_evaluation_of_a_random_model_is_refused_before_a_trained_runs_tokenizer_is_replaced(
        tmp_path, synth_dir, monkeypatch, split):
    """--do_eval with --config_name alone scored a randomly initialised model, and wrote the tokenizer it trained over
    the trained run's in --output_dir (an outside probe: the folder's model then sat beside a 358-id tokenizer)."""
    _no_model_work(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "spiece.model").write_bytes(b"the trained run's")
    with pytest.raises(ValueError, match=r"--do_eval/--do_predict without --do_train and without --model_name_or_path "
                                         r"would score a randomly initialised model"):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, split])
    assert (out / "spiece.model").read_bytes() == b"the trained run's" and os.listdir(out) == ["spiece.model"]


def test_a_bad_simd_level_is_named_before_any_model_work(tmp_path, synth_dir, monkeypatch):
    """HF_ZERO_OFFLOAD_SIMD=avx512 on a CPU without it was refused at the engine's first kernel call, after the
    tokenizer, the model and the memory plan (16-39 s for t5-3b)."""
    from hf_zero_offload.ops import simd

    _no_model_work(monkeypatch)
    monkeypatch.setattr(simd, "_env_error", ValueError("HF_ZERO_OFFLOAD_SIMD='avx512': not on this CPU"))
    with pytest.raises(ValueError, match="HF_ZERO_OFFLOAD_SIMD='avx512'"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "out") + ["--config_name", TINY, "--do_train",
                                                                           "--zero_offload", "zero2-offload"])


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


def test_data_files_that_are_not_utf8_are_named_and_a_bom_is_dropped(tmp_path):
    import seq2seq_data as sd

    (tmp_path / "train.source").write_bytes(b"\xef\xbb\xbfone\ntwo\n")
    (tmp_path / "train.target").write_bytes(b"unu\ndoi cu \xe2\x80\n")  # cut inside a character
    with pytest.raises(ValueError, match=r"train.target: not a UTF-8 text file \(line 2: byte 11 is 0xe2\)"):
        sd.read_split(str(tmp_path), "train")
    (tmp_path / "train.target").write_bytes(b"a\rb\r\xe9\r")  # lines end at \r too, as the reader ends them
    with pytest.raises(ValueError, match=r"train.target: not a UTF-8 text file \(line 3: byte 4 is 0xe9\)"):
        sd.read_split(str(tmp_path), "train")
    (tmp_path / "train.target").write_bytes("unu\ndoi \u0219i\n".encode())
    assert sd.read_split(str(tmp_path), "train") == (["one", "two"], ["unu", "doi \u0219i"])


def test_blank_and_empty_data_files_are_refused_by_name(tmp_path):
    """A blank line trained a pair with an empty side, without a word (v4.2's dataset asserted "empty tgt line for
    index N"); empty files failed later, in the sampler, naming neither."""
    import seq2seq_data as sd

    (tmp_path / "train.source").write_text("one\ntwo\nthree\n\n", encoding="utf-8")
    (tmp_path / "train.target").write_text("unu\n  \ntrei\npatru\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.source: 1 blank or missing text\(s\) among the 4 used \(line 4\)"):
        sd.read_split(str(tmp_path), "train")
    with pytest.raises(ValueError, match=r"train.target: 1 blank or missing text\(s\) among the 2 used \(line 2\)"):
        sd.read_split(str(tmp_path), "train", n_obs=2)
    assert sd.read_split(str(tmp_path), "train", n_obs=1) == (["one"], ["unu"])  # the lines used are checked
    for name in ("train.source", "train.target"):
        (tmp_path / name).write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.source and .*train.target hold no lines"):
        sd.read_split(str(tmp_path), "train")


@pytest.mark.parametrize("rows, match", [
    ({"translation": [{"en": "a", "ro": "b"}, {"en": "c", "ro": " "}]},
     r"wmt16 split 'train' column translation\['ro'\]: 1 blank or missing text\(s\) among the 2 used \(index 1\)"),
    ({"translation": [{"en": "a", "ro": "b"}, {"ro": "d"}]}, r"column translation\['en'\]: .*\(index 1\)"),
    ({"document": ["x", None, ""], "summary": ["y", "z", "w"]}, r"column 'document': 2 blank or missing .*index 1, 2"),
])
def test_blank_texts_of_a_hub_dataset_are_refused_by_name(monkeypatch, rows, match):
    """--dataset_name took the same blank texts (and a pair missing a language: a KeyError) as --data_dir did."""
    import sys
    import types

    import seq2seq_data as sd

    class Split:
        column_names = list(rows)

        def select(self, idx):
            return self

        def __getitem__(self, col):
            return rows[col]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: Split()))
    with pytest.raises(ValueError, match=match):
        sd.load_hf_dataset_split("wmt16", "ro-en", "train", "en_XX", "ro_RO", None)
    rows = {k: v[:1] for k, v in rows.items()}  # the first pair alone is whole
    got = sd.load_hf_dataset_split("wmt16", "ro-en", "train", "en_XX", "ro_RO", None)
    assert got == ((["a"], ["b"]) if "translation" in rows else (["x"], ["y"]))


def test_freeze_embeds_and_encoder():
    from transformers import AutoConfig, AutoModelForSeq2SeqLM
    import seq2seq_utils as su

    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(TINY))
    su.freeze_embeds(model)
    assert not model.shared.weight.requires_grad
    assert not model.encoder.embed_tokens.weight.requires_grad and not model.decoder.embed_tokens.weight.requires_grad
    assert model.encoder.block[0].layer[0].SelfAttention.q.weight.requires_grad
    su.freeze_encoder(model)
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert model.decoder.block[0].layer[0].SelfAttention.q.weight.requires_grad


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="config_name"):
        finetune_trainer.main(["--data_dir", "x", "--output_dir", str(tmp_path / "o"), "--use_cpu"])
    with pytest.raises(ValueError, match="data_dir"):
        finetune_trainer.main(["--config_name", TINY, "--output_dir", str(tmp_path / "o"), "--use_cpu"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="overwrite_output_dir"):
        finetune_trainer.main(["--config_name", TINY, "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "full"),
                               "--do_train", "--use_cpu"])


def _no_model_work(monkeypatch):
    """Make the tokenizer, the model and the memory plan fail loudly if anything reaches them."""
    def boom(*a, **k):
        raise AssertionError("model work started before the config was checked")

    import seq2seq_model

    monkeypatch.setattr(seq2seq_model, "train_t5_tokenizer", boom)
    monkeypatch.setattr(seq2seq_model.AutoModelForSeq2SeqLM, "from_config", boom)
    monkeypatch.setattr(seq2seq_model.AutoModelForSeq2SeqLM, "from_pretrained", boom)


@pytest.mark.parametrize("config,extra,match", [
    ({"zero_optimization": {"stage": 2, "ofload_optimizer": {"device": "cpu"}}}, [], "did you mean 'offload_optimizer'"),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, ["--bf16"], "fp16.enabled=True vs --fp16 False"),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}, [], "per_device_train_batch_size 8"),
    ("no-such-config", [], "no shipped ds_config named"),
])
def test_config_errors_come_before_any_model_work(tmp_path, synth_dir, monkeypatch, config, extra, match):
    from hf_zero_offload.config import ConfigError

    _no_model_work(monkeypatch)
    path = config
    if isinstance(config, dict):
        path = str(tmp_path / "ds.json")
        with open(path, "w") as f:
            json.dump(config, f)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train",
                                                              "--zero_offload", path, *extra])
    assert not out.exists() or not os.listdir(out)  # no tokenizer written


@pytest.mark.parametrize("enabled", [True, False])
def test_the_early_config_check_reads_full_eval_as_the_trainer_does(tmp_path, enabled):
    """--bf16_full_eval trains the bf16 model (transformers' DeepSpeed rule, the Trainer's): the script's early check
    read --bf16 alone, so it refused "bf16": {"enabled": true}, which the Trainer runs, and let "enabled": false
    through to fail in the Trainer after the tokenizer and the model."""
    import seq2seq_args

    from hf_zero_offload.config import ConfigError

    cfg = json.dumps({"bf16": {"enabled": enabled}, "zero_optimization": {"stage": 2}})
    _, _, targs = seq2seq_args.parse_args(["--output_dir", str(tmp_path / "o"), "--data_dir", "x", "--use_cpu",
                                           "--zero_offload", cfg, "--bf16_full_eval"])
    if enabled:
        seq2seq_args.check_zero_config(targs, None)
    else:
        with pytest.raises(ConfigError, match="bf16.enabled=False vs --bf16 True"):
            seq2seq_args.check_zero_config(targs, None)


@pytest.mark.parametrize("extra,match", [
    (["--zero_offload", "zero2-offload", "--optim", "adafactor"], "--optim adafactor"),
    (["--sharded_ddp", "--optim", "adafactor"], "--optim adafactor"),
    (["--zero_offload", "zero2-offload", "--max_grad_norm", "-1"], r"--max_grad_norm -1\.0: must be a finite number"),
    (["--zero_offload", "zero2-offload", "--max_grad_norm", "nan"], "--max_grad_norm nan"),
    (["--zero_offload", "zero2-offload", "--save_only_model", "--load_best_model_at_end", "--eval_strategy", "steps",
      "--save_strategy", "steps"], "--save_only_model with --load_best_model_at_end"),
])
def test_argument_errors_come_before_any_model_work(tmp_path, synth_dir, monkeypatch, extra, match):
    """The Trainer's own argument checks, made by the script before the tokenizer, the model and the memory plan
    (they used to come ~20 s and a tokenizer written into output_dir later, from the Trainer); the clipping norm
    is named as the flag (it was "OffloadOptions.max_grad_norm")."""
    from hf_zero_offload.config import ConfigError

    _no_model_work(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", *extra])
    assert not out.exists() or not os.listdir(out)  # no tokenizer written


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_refused_by_the_lock_writes_nothing_into_the_live_runs_output_dir(tmp_path, synth_dir, monkeypatch):
    """The tokenizer went into output_dir before the Trainer took the run lock: a second run on a live output_dir
    (--overwrite_output_dir, another --tokenizer_vocab_size) overwrote the first run's tokenizer files, then was
    refused. The lock is now taken before anything is written."""
    import socket

    import psutil

    from hf_zero_offload.run_lock import LOCK_NAME, RunLockError

    _no_model_work(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"the first run": 1}')
    (out / "spiece.model").write_bytes(b"first")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": "then",
                                                 "process_start": psutil.Process(live.pid).create_time()}))
        before = _tree(out)
        for extra in ([], ["--zero_offload", "zero2-offload"]):
            with pytest.raises(RunLockError, match=rf"another run \(pid {live.pid}"):
                finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train",
                                                                      "--overwrite_output_dir",
                                                                      "--tokenizer_vocab_size", "128", *extra])
            assert _tree(out) == before
    finally:
        live.kill()
        live.wait()


def test_files_where_directories_belong_are_named_before_any_model_work(tmp_path, synth_dir, monkeypatch):
    """--output_dir naming a file was "[Errno 17] File exists"; a checkpoint-N that is a file was "Not a directory:
    .../checkpoint-2/hzo_complete.json", at that save, after the steps since the last one were lost."""
    from hf_zero_offload import resume
    from hf_zero_offload.run_lock import RunLock, RunLockError

    _no_model_work(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("hi")
    with pytest.raises(ValueError, match=rf"^--output_dir {afile} is a file, not a directory$"):
        finetune_trainer.main(_common_args(synth_dir, afile) + ["--config_name", TINY, "--do_train"])
    with pytest.raises(RunLockError, match=rf"^output_dir {afile} is a file, not a directory$"):  # a Trainer's lock
        RunLock(str(afile)).acquire()
    out = tmp_path / "out"
    (out / "checkpoint-10").mkdir(parents=True)
    (out / "checkpoint-2").write_text("x")
    with pytest.raises(ValueError, match=rf"^{out / 'checkpoint-2'} is a file, not a directory: the Trainer saves"):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train",
                                                              "--overwrite_output_dir", "--zero_offload",
                                                              "zero2-offload"])
    with pytest.raises(NotADirectoryError, match=rf"^{out / 'checkpoint-2'} is a file"):  # the save itself
        resume.clear_marker(str(out / "checkpoint-2"))
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-2"]


@pytest.mark.parametrize("finished", [False, True], ids=["running", "finished"])
def test_a_resume_target_that_is_no_checkpoint_is_refused_before_any_model_work(tmp_path, synth_dir, monkeypatch,
                                                                                finished):
    """A finished run's folder holds trainer_state.json and the model beside its checkpoints: it was taken for a
    checkpoint without a marker, then refused in train(), after tokenizer and plan work, as 'the model only'."""
    from hf_zero_offload.config import ConfigError

    _no_model_work(monkeypatch)
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)  # a run folder given where a checkpoint is expected
    if finished:
        (run / "trainer_state.json").write_text('{"global_step": 4, "log_history": []}')
        (run / "config.json").write_text("{}")
        (run / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="is a run folder, not a checkpoint"):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--zero_offload",
                                                              "zero2-offload", "--resume_from_checkpoint", str(run)])
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize("word", ["false", "False", "no", "none"])
def test_resume_false_means_no_resume_and_keeps_the_output_dir_check(tmp_path, synth_dir, monkeypatch, word):
    """--resume_from_checkpoint false was taken for a path ("false does not exist", after model work), and being a
    non-empty string it let the script's "output_dir not empty" check pass: now it is no resume."""
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments

    monkeypatch.chdir(tmp_path)
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir="o", use_cpu=True, report_to=[], resume_from_checkpoint=word)
    assert args.resume_from_checkpoint is None
    (tmp_path / word).mkdir()  # a folder of that name is a path, as before
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir="o", use_cpu=True, report_to=[], resume_from_checkpoint=word)
    assert args.resume_from_checkpoint == word
    (tmp_path / word).rmdir()
    _no_model_work(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="already exists and is not empty. Use --overwrite_output_dir to overcome "
                                         r"\(it holds no complete checkpoint to go on from"):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--zero_offload",
                                                              "zero2-offload", "--resume_from_checkpoint", word])
    assert (out / "keep.txt").read_text() == "x"
    # a Ctrl-C before the first save left the tokenizer there: the interrupt line names the flag a rerun needs
    assert finetune_trainer._where_to_go_on().endswith("run the command again with --overwrite_output_dir to start "
                                                       "afresh")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="--deepspeed is then DeepSpeed's")
def test_deepspeed_flag_without_the_package_points_at_zero_offload(tmp_path):
    with pytest.raises(ValueError, match="--zero_offload ds_config.json takes the same file"):
        finetune_trainer.main(["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "o"),
                               "--deepspeed", "ds_config.json"])


def test_deepspeed_together_with_zero_offload_names_the_pair(tmp_path):
    from hf_zero_offload.config import ConfigError

    base = ["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "o"), "--use_cpu"]
    with pytest.raises(ConfigError, match="--deepspeed and --zero_offload both given"):
        finetune_trainer.main(base + ["--deepspeed", "ds_config.json", "--zero_offload", "zero2-offload"])
    with pytest.raises(ConfigError, match="--fsdp and --sharded_ddp both given"):
        finetune_trainer.main(base + ["--sharded_ddp", "--fsdp", "full_shard"])


def test_a_relative_model_config_path_run_from_elsewhere(tmp_path, synth_dir, monkeypatch):
    _no_model_work(monkeypatch)
    monkeypatch.chdir(tmp_path)  # outside the clone: configs/models/... is not there
    with pytest.raises(FileNotFoundError, match=r"--config_name configs/models/t5-tiny.json: no such file.*"
                                                r"current directory.*did you mean .*configs/models/t5-tiny.json"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "o") + ["--config_name", "configs/models/t5-tiny.json",
                                                                         "--do_train"])
    with pytest.raises(FileNotFoundError, match="--tokenizer_name ./no/tok: no such file"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "o") + ["--config_name", TINY, "--tokenizer_name",
                                                                         "./no/tok", "--do_train"])


def test_a_hub_id_offline_points_at_the_clone_config(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(finetune_trainer.AutoConfig, "from_pretrained", offline)
    with pytest.raises(OSError, match=r"couldn't connect.*--config_name .*configs/models/t5-3b.json builds a "
                                      r"randomly initialised t5-3b"):
        finetune_trainer.main(["--model_name_or_path", "t5-3b", "--data_dir", str(tmp_path), "--output_dir",
                               str(tmp_path / "o"), "--use_cpu"])


def test_plot_curves_cli(tmp_path, capsys):
    import plot_curves

    with pytest.raises(SystemExit) as e:
        plot_curves.main(["--help"])
    assert e.value.code == 0 and "output_dir" in capsys.readouterr().out
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 3, "train_loss": 7.0}]}))
    for folder, needle in ((tmp_path / "missing", "is not a directory"), (tmp_path, "holds no trainer_state.json"),
                           (tmp_path / "run", "--logging_steps")):
        with pytest.raises(SystemExit) as e:
            plot_curves.main([str(folder)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("plot_curves.py: error: ") and needle in err, err


@pytest.mark.parametrize("script, blocked, args", [
    ("run_demo.py", "torch", ["--smoke", "--cpu"]),
    ("run_demo.py", "matplotlib", ["--smoke", "--cpu"]),  # the plot came last, after the whole training
    ("plot_curves.py", "matplotlib", []),
    ("plot_curves.py", "hf_zero_offload", []),
])
def test_an_example_run_by_a_python_without_its_dependencies_says_so_in_one_line(tmp_path, script, blocked, args):
    """The system's python3 instead of the .venv's (the README's `source .venv/bin/activate` forgotten): run_demo.py
    wrote its data, then died in a traceback; plot_curves.py died in one at its first import."""
    path = os.path.join(EX, script)
    argv = [path, *args, *(["--output_root", str(tmp_path)] if script == "run_demo.py" else [str(tmp_path)])]
    code = (f"import runpy, sys; sys.modules[{blocked!r}] = None; sys.argv = {argv!r}; "
            f"runpy.run_path({path!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{script}: error: this Python ({sys.executable}) has no module named ") and \
        repr(blocked) in err and ".venv/bin/python" in err, err
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.parametrize("argv, says", [
    (["synthetic_data.py", "--n-train=5"], "unrecognized arguments: --n-train=5 (did you mean --n_train?); the "
                                           "following arguments are required: out_dir"),
    (["synthetic_data.py", "OUT", "--n_trian", "5"], "unrecognized arguments: --n_trian (did you mean --n_train?)"),
    (["synthetic_data.py", "OUT", "--n_train", "x"], "argument --n_train: invalid int value: 'x'"),
    (["run_demo.py", "--cpuu"], "unrecognized arguments: --cpuu (did you mean --cpu?)"),
    (["plot_curves.py"], "the following arguments are required: output_dir"),
])
def test_the_small_example_scripts_say_a_command_line_mistake_in_one_line(tmp_path, argv, says):
    """argparse printed its usage block above the error, and a misspelled flag beside a missing positional was
    reported as the missing positional alone (`synthetic_data.py --n-train=5`: "required: out_dir")."""
    r = subprocess.run([sys.executable, os.path.join(EX, argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == f"{argv[0]}: error: {says} (usage: {argv[0]} --help)", err
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_during_the_demo_waits_for_finetune_trainer_and_says_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `make demo` reaches run_demo.py and its finetune_trainer.py child alike: the child said its line,
    then run_demo.py died in a KeyboardInterrupt traceback (and could exit before the child had finished)."""
    import run_demo

    waits = []

    class Child:  # the child as a Ctrl-C finds it: the parent's wait interrupted, the child ends on its own (130)
        def __init__(self, cmd, **kwargs):
            assert cmd[1].endswith("finetune_trainer.py")

        def wait(self):
            waits.append(1)
            if len(waits) == 1:
                raise KeyboardInterrupt
            return 130

        def kill(self):
            raise AssertionError("the child was killed instead of awaited")

    monkeypatch.setattr(run_demo.subprocess, "Popen", Child)
    with pytest.raises(SystemExit) as e:
        run_demo.main(["--smoke", "--cpu", "--output_root", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 130 and len(waits) == 2, (e.value.code, waits)
    assert err.strip().splitlines() == [f"[demo] interrupted: make demo starts again from the first step (its data "
                                        f"in {tmp_path / 'demo_smoke_data'} is kept)"], err


def test_gradient_checkpointing_flag_is_mapped_without_a_deprecation_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, targs = finetune_trainer.parse_args(["--output_dir", str(tmp_path), "--gradient_checkpointing",
                                                   "--use_cpu"])
    # (before transformers 5.23 there is no --activation_checkpointing: the flag is taken as it is)
    assert getattr(targs, "activation_checkpointing", True) and targs.gradient_checkpointing


def test_script_errors_are_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "ofload_optimizer": {"device": "cpu"}}}')
    argv = [sys.executable, os.path.join(EX, "finetune_trainer.py"), "--config_name", TINY, "--data_dir", str(tmp_path),
            "--output_dir", str(tmp_path / "o"), "--use_cpu", "--do_train", "--zero_offload", str(bad)]
    env = {**os.environ, "HF_ZERO_OFFLOAD_DEBUG": "0"}
    r, debug = run_together([argv, argv + ["--debug", "--output_dir", str(tmp_path / "o2")]], timeout=300, cwd=ROOT, env=env)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("finetune_trainer.py: error: ") and "ofload_optimizer" in errors[0]
    r = debug
    assert r.returncode == 1 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_dataset_name_without_datasets_is_a_clear_error(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="--data_dir"):
        finetune_trainer.main(["--config_name", TINY, "--dataset_name", "wmt16", "--dataset_config_name", "ro-en",
                               "--src_lang", "en", "--tgt_lang", "ro", "--output_dir", str(tmp_path / "o"),
                               "--do_train", "--use_cpu", "--report_to", "none"])


@pytest.mark.parametrize("env,want", [({}, "10000"), ({"GOMP_SPINCOUNT": "500"}, "500"),
                                      ({"OMP_WAIT_POLICY": "active"}, None)])
def test_the_script_shortens_the_openmp_spin_unless_the_user_chose(env, want):
    """torch's OpenMP workers spin for milliseconds after each parallel op on the cores the CPU step needs
    next; the script sets a shorter spin (README, Limitations; docs/LIMITATIONS.md) and keeps a GOMP_SPINCOUNT or
    OMP_WAIT_POLICY the user gave."""
    environ = dict(env)
    finetune_trainer.shorten_openmp_spin(environ)
    assert environ.get("GOMP_SPINCOUNT") == want


def test_the_spin_is_set_before_torch_loads_openmp():
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the script must set it before `import torch`."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import finetune_trainer, os; "
            "src = open(finetune_trainer.__file__).read(); "
            "print(src.index('\\nshorten_openmp_spin(os.environ)') < src.index('\\n    import torch'), "
            "os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code, EX], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True 10000"


@pytest.mark.parametrize("argv, match", [
    (["--per_device_train_batch_size", "abc"], r"--per_device_train_batch_size.*invalid int value: 'abc'"),
    (["--zero_offload"], r"--zero_offload.*expected one argument"),
    (["--zero_ofload", "zero2-offload"], r"unknown arguments: --zero_ofload \(did you mean --zero_offload\?\)"),
], ids=["bad-value", "missing-value", "misspelled-flag"])
def test_a_flag_mistake_is_one_error_without_the_usage_text(argv, match, capsys):
    """argparse printed its 140-line usage before a bad or missing value's message."""
    with pytest.raises(ValueError, match=match):
        finetune_trainer.parse_args(["--output_dir", "o", *argv])
    assert "usage:" not in capsys.readouterr().err


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
