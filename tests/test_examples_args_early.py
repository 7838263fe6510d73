"""examples/seq2seq/finetune_trainer.py refuses what the run cannot use before any model work: values,
config errors, argument errors, files where directories belong, a resume target that is no checkpoint, another
live run's output_dir (nothing written into it)."""
import json
import os
import subprocess
import sys

import pytest

from _examples import TINY, write_synth
from _examples import common_args as _common_args

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return write_synth(tmp_path_factory)


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
