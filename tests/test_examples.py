"""Fast CPU tier for examples/seq2seq (finetune_trainer.py, synthetic_data.py, run_demo.py) and configs/.

Everything runs offline (HF_HUB_OFFLINE=1) on a randomly initialised t5-tiny with a tokenizer trained on the fly.
The real en-ro sample is used when present (HZO_WMT_EN_RO or /work/shared/data/wmt_en_ro); never copied here.
"""
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples", "seq2seq")
CONFIGS = os.path.join(ROOT, "configs")
TINY = os.path.join(CONFIGS, "models", "t5-tiny.json")
# The shared sample sits beside the checkout (../shared) in CI and in development.
WMT_EN_RO = os.environ.get("HZO_WMT_EN_RO") or next(
    (d for d in (os.path.join(ROOT, "..", "shared", "data", "wmt_en_ro"), "/work/shared/data/wmt_en_ro")
     if os.path.isdir(d)), os.path.join(ROOT, "..", "shared", "data", "wmt_en_ro"))
if EX not in sys.path:
    sys.path.insert(0, EX)

import synthetic_data  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402

LEGACY_KEYS = {
    "train_runtime", "train_samples_per_second", "train_loss", "train_n_objs",
    "train_peak_device_mem_bytes", "train_peak_host_rss_bytes",
    "val_loss", "val_bleu", "val_gen_len", "val_runtime", "val_samples_per_second", "val_n_objs",
    "test_loss", "test_bleu", "test_gen_len", "test_runtime", "test_samples_per_second", "test_n_objs",
}


def _common_args(data_dir, out_dir, n_train=48, n_eval=12):
    return [
        "--data_dir", str(data_dir), "--task", "translation_en_to_ro", "--output_dir", str(out_dir),
        "--n_train", str(n_train), "--n_val", str(n_eval), "--n_test", str(n_eval),
        "--max_source_length", "48", "--max_target_length", "32",
        "--val_max_target_length", "24", "--test_max_target_length", "24",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
        "--learning_rate", "3e-3", "--max_steps", "4", "--logging_steps", "2",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0",
    ]


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return synthetic_data.write_corpus(str(tmp_path_factory.mktemp("synth")), n_train=200, n_val=40, n_test=40, seed=0)


# ----------------------------------------------------------------------------------------------------------------------
# synthetic data


def _read(d, name):
    with open(os.path.join(d, name), encoding="utf-8") as f:
        return f.read()


def test_synthetic_data_layout_and_determinism(tmp_path):
    a = synthetic_data.write_corpus(str(tmp_path / "a"), n_train=30, n_val=5, n_test=7, seed=3)
    b = synthetic_data.write_corpus(str(tmp_path / "b"), n_train=30, n_val=5, n_test=7, seed=3)
    c = synthetic_data.write_corpus(str(tmp_path / "c"), n_train=30, n_val=5, n_test=7, seed=4)
    for split, n in (("train", 30), ("val", 5), ("test", 7)):
        for ext in ("source", "target"):
            name = f"{split}.{ext}"
            text = _read(a, name)
            assert text == _read(b, name), "same seed must give byte-identical files"
            lines = text.split("\n")
            assert lines[-1] == "" and len(lines) == n + 1 and all(lines[:-1])
    assert _read(a, "train.source") != _read(c, "train.source")
    assert sorted(os.listdir(a)) == sorted(f"{s}.{e}" for s in ("train", "val", "test") for e in ("source", "target"))


def test_synthetic_translation_rules():
    lex = synthetic_data.LEXICON
    assert len(set(lex.values())) == len(lex), "the toy lexicon must be one-to-one"
    out = synthetic_data.translate("the red house sees a small cat .".split())
    assert out == [lex["house"] + "ul", lex["red"], lex["sees"], "un", lex["cat"], lex["small"], "."]
    # the lexicon does not depend on the seed: the same English sentence always has the same translation
    corpus = synthetic_data.make_corpus(50, 0, 0, seed=1)["train"] + synthetic_data.make_corpus(50, 0, 0, seed=2)["train"]
    seen = {}
    for src, tgt in corpus:
        assert seen.setdefault(src, tgt) == tgt


def test_synthetic_cli(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, os.path.join(EX, "synthetic_data.py"), str(out), "--n_train", "5",
                        "--n_val", "2", "--n_test", "2", "--seed", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "synthetic" in r.stdout
    assert _read(str(out), "train.source") == "".join(s + "\n" for s, _ in synthetic_data.make_corpus(5, 2, 2, 0)["train"])


# ----------------------------------------------------------------------------------------------------------------------
# configs


@pytest.mark.parametrize("name", ["ds_config_1gpu.json", "ds_config.json", "ds_config_zero2.json"])
def test_ds_configs_are_standard(name):
    with open(os.path.join(CONFIGS, name)) as f:
        cfg = json.load(f)
    zo = cfg["zero_optimization"]
    assert zo["stage"] == 2
    assert zo["contiguous_gradients"] and zo["overlap_comm"] and zo["reduce_scatter"] and zo["allgather_partitions"]
    if name == "ds_config_zero2.json":
        assert "offload_optimizer" not in zo
    else:
        assert zo["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    fp16 = cfg["fp16"]
    assert (fp16["enabled"], fp16["loss_scale"], fp16["loss_scale_window"], fp16["initial_scale_power"],
            fp16["hysteresis"], fp16["min_loss_scale"]) == ("auto", 0, 1000, 16, 2, 1)
    assert cfg["optimizer"]["type"] == "AdamW" and set(cfg["optimizer"]["params"]) == {"lr", "betas", "eps", "weight_decay"}
    assert cfg["scheduler"]["type"] == "WarmupLR"
    for key in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"):
        assert cfg[key] == "auto"
    # the loader, when present, must accept them
    try:
        from hf_zero_offload import config as hzo_config
    except ImportError:
        return
    load = getattr(hzo_config, "load", None) or getattr(hzo_config, "load_config", None)
    if load is not None:
        load(os.path.join(CONFIGS, name))


@pytest.mark.parametrize("name,n_params", [("t5-small", 60_506_624), ("t5-large", 737_668_096),
                                          ("t5-3b", 2_851_598_336), ("t5-tiny", None), ("t5-demo", None)])
def test_model_configs(name, n_params):
    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    cfg = AutoConfig.from_pretrained(os.path.join(CONFIGS, "models", f"{name}.json"))
    assert cfg.model_type == "t5" and (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (0, 1, 0)
    if n_params is not None:  # the public checkpoints' parameter counts
        with torch.device("meta"):
            model = AutoModelForSeq2SeqLM.from_config(cfg)
        assert sum(p.numel() for p in model.parameters()) == n_params


# ----------------------------------------------------------------------------------------------------------------------
# finetune_trainer.py


def test_legacy_flags_are_mapped():
    model_args, data_args, args = finetune_trainer.parse_args([
        "--config_name", TINY, "--data_dir", "x", "--output_dir", "o", "--label_smoothing", "0.1",
        "--adam_eps", "1e-6", "--evaluation_strategy", "no", "--sortish_sampler", "--freeze_embeds",
        "--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"), "--use_cpu",
    ])
    assert data_args.label_smoothing == 0.1 and args.adam_epsilon == 1e-6 and args.eval_strategy == "no"
    assert args.sortish_sampler and model_args.freeze_embeds and args.zero_offload.endswith("ds_config_1gpu.json")


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
        finetune_trainer.main(["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "full"),
                               "--do_train", "--use_cpu"])


def _no_model_work(monkeypatch):
    """Make the tokenizer, the model and the memory plan fail loudly if anything reaches them."""
    def boom(*a, **k):
        raise AssertionError("model work started before the config was checked")

    monkeypatch.setattr(finetune_trainer, "train_t5_tokenizer", boom)
    monkeypatch.setattr(finetune_trainer.AutoModelForSeq2SeqLM, "from_config", boom)
    monkeypatch.setattr(finetune_trainer.AutoModelForSeq2SeqLM, "from_pretrained", boom)


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
        finetune_trainer.main(["--model_name_or_path", "t5-3b", "--data_dir", "x", "--output_dir",
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


def test_gradient_checkpointing_flag_is_mapped_without_a_deprecation_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, _, targs = finetune_trainer.parse_args(["--output_dir", str(tmp_path), "--gradient_checkpointing",
                                                   "--use_cpu"])
    assert targs.activation_checkpointing and targs.gradient_checkpointing


def test_script_errors_are_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "ofload_optimizer": {"device": "cpu"}}}')
    argv = [sys.executable, os.path.join(EX, "finetune_trainer.py"), "--config_name", TINY, "--data_dir", "x",
            "--output_dir", str(tmp_path / "o"), "--use_cpu", "--do_train", "--zero_offload", str(bad)]
    env = {**os.environ, "HF_ZERO_OFFLOAD_DEBUG": "0"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("finetune_trainer.py: error: ") and "ofload_optimizer" in errors[0]
    r = subprocess.run(argv + ["--debug"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
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


def _check_output_dir(out, metrics):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    with open(os.path.join(out, "all_results.json")) as f:
        on_disk = json.load(f)
    missing = LEGACY_KEYS - set(on_disk)
    assert not missing, f"all_results.json lacks {sorted(missing)}"
    assert on_disk["train_peak_host_rss_bytes"] > 0
    assert on_disk["train_peak_device_mem_bytes"] is None  # CPU run
    for split in ("train", "val", "test"):
        with open(os.path.join(out, f"{split}_results.json")) as f:
            part = json.load(f)
        assert part and all(on_disk[k] == v for k, v in part.items())
    assert metrics["val_bleu"] == on_disk["val_bleu"]
    assert os.path.isfile(os.path.join(out, "test_generations.txt"))

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) <= model.config.vocab_size
    ids = tok("translate English to Romanian: the red house sees a cat.")["input_ids"]
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    out_ids = model.generate(input_ids=__import__("torch").tensor([ids]), max_length=8)
    assert out_ids.shape[0] == 1


@pytest.mark.parametrize("offload", [False, True, "zero2-offload-int8"], ids=["plain", "zero_offload", "int8"])
def test_finetune_t5_tiny_synthetic(tmp_path, synth_dir, offload, caplog, capsys):
    caplog.set_level(logging.INFO, logger="hf_zero_offload")  # the start line is INFO
    out = tmp_path / "out"
    argv = _common_args(synth_dir, out) + [
        "--config_name", TINY, "--do_train", "--do_eval", "--do_predict", "--predict_with_generate",
    ]
    if offload:  # with gradient checkpointing, which the memory plan printed at start must trace
        config = offload if isinstance(offload, str) else os.path.join(CONFIGS, "ds_config_1gpu.json")
        argv += ["--zero_offload", config, "--gradient_checkpointing"]
    else:  # legacy extras on the plain run
        argv += ["--sortish_sampler", "--label_smoothing", "0.1", "--freeze_embeds"]
    smoothing = [] if offload else ["--label_smoothing", "0.1"]  # the eval loss depends on it
    metrics = finetune_trainer.main(argv)
    _check_output_dir(str(out), metrics)
    assert metrics["train_n_objs"] == 48 and metrics["val_n_objs"] == 12
    # --zero_offload must reach the engine (its start line), and only then
    assert ("hf_zero_offload: config=" in caplog.text) == bool(offload)
    if offload:  # the start line says how the host stores the moments (a shipped name: the int8 preset)
        assert f"moments={'int8' if isinstance(offload, str) else 'fp32'} " in caplog.text
        # our own shipped config's DeepSpeed-only keys are no reason for a WARNING
        levels = {r.levelname for r in caplog.records if "accepted, no effect here" in r.getMessage()}
        assert levels == {"INFO"}, levels
    assert ("gradient checkpointing; budget" in capsys.readouterr().out) == bool(offload)

    # the saved directory is a complete model + tokenizer: evaluate from it (no tokenizer training this time)
    out2 = tmp_path / "reload"
    m2 = finetune_trainer.main(_common_args(synth_dir, out2) + smoothing + [
        "--model_name_or_path", str(out), "--do_eval", "--predict_with_generate"])
    assert set(m2) >= {"val_loss", "val_bleu", "val_gen_len"}
    assert abs(m2["val_loss"] - metrics["val_loss"]) < 1e-4, "reloaded model must evaluate identically"
    assert not os.path.exists(out2 / "tokenizer.json"), "a tokenizer was trained although the model dir has one"


def test_finetune_on_the_simulated_gpu_path_equals_cpu(tmp_path, synth_dir, monkeypatch, caplog):
    """The whole legacy command (train with DPU, evaluate, predict with generate, save) with the engine's
    GPU code path on the stream simulator: the same metrics as the plain CPU path, to the last digit."""
    caplog.set_level(logging.INFO, logger="hf_zero_offload")  # the start line is INFO
    cfg = tmp_path / "dpu.json"
    with open(os.path.join(CONFIGS, "ds_config_1gpu.json")) as f:
        ds = json.load(f)
    ds["zero_optimization"]["delayed_param_update"] = {"enabled": True, "warmup_steps": 1}
    cfg.write_text(json.dumps(ds))
    metrics = {}
    for name in ("cpu", "sim"):
        if name == "sim":
            monkeypatch.setenv("HF_ZERO_OFFLOAD_SIMULATE_STREAMS", "1")
        argv = _common_args(synth_dir, tmp_path / name) + [
            "--config_name", TINY, "--do_train", "--do_eval", "--do_predict", "--predict_with_generate", "--bf16",
            "--zero_offload", str(cfg)]
        caplog.clear()
        metrics[name] = finetune_trainer.main(argv)
        assert f"streams={name}" in caplog.text
    keys = [k for k in metrics["cpu"] if k.endswith(("_loss", "_bleu", "_gen_len"))]
    assert len(keys) >= 5
    assert {k: metrics["sim"][k] for k in keys} == {k: metrics["cpu"][k] for k in keys}


def test_tokenizer_vocab_size_shrinks_random_model(tmp_path, synth_dir):
    out = tmp_path / "out"
    finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--tokenizer_vocab_size", "400",
                                                          "--do_train", "--max_steps", "1"])
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = AutoConfig.from_pretrained(str(out))
    assert len(tok) <= 400 and cfg.vocab_size == (len(tok) + 7) // 8 * 8


@pytest.mark.skipif(not os.path.isfile(os.path.join(WMT_EN_RO, "train.source")), reason="no wmt_en_ro sample here")
def test_finetune_real_wmt_en_ro(tmp_path):
    out = tmp_path / "out"
    argv = _common_args(WMT_EN_RO, out, n_train=-1, n_eval=8) + [
        "--config_name", TINY, "--do_train", "--do_eval", "--do_predict", "--predict_with_generate",
        "--max_steps", "2", "--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"),
    ]
    metrics = finetune_trainer.main(argv)
    _check_output_dir(str(out), metrics)
    with open(os.path.join(WMT_EN_RO, "train.source"), encoding="utf-8") as f:
        assert metrics["train_n_objs"] == sum(1 for _ in f)


# ----------------------------------------------------------------------------------------------------------------------
# run_demo.py (make demo)


def test_run_demo_smoke(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(EX, "run_demo.py"), "--smoke", "--cpu", "--output_root",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "demo_smoke" / "all_results.json") as f:
        metrics = json.load(f)
    assert {"train_loss", "val_loss", "val_bleu", "val_gen_len"} <= set(metrics)
    assert "--zero_offload" in r.stdout and "ds_config_1gpu.json" in r.stdout
    assert (tmp_path / "demo_smoke_data" / "train.source").is_file()
    # not a terminal here: step lines with the time left instead of a bar; the curve is named in the last line
    assert "step 2/6 (33%)" in r.stdout + r.stderr and "left: loss" in r.stdout + r.stderr
    png = tmp_path / "demo_smoke" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r.stdout.strip().splitlines()[-1] == f"[demo] loss and BLEU curves: {png}"
    curves = __import__("plot_curves").read_curves(str(tmp_path / "demo_smoke"))
    assert [s for s, _ in curves["val_bleu"]] == [3, 6] and len(curves["loss"]) == 3


@pytest.mark.slow
def test_run_demo_full(tmp_path):
    """The whole `make demo` (minutes): BLEU on the synthetic task must move well above 0."""
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(EX, "run_demo.py"), "--cpu", "--output_root", str(tmp_path)],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "demo" / "all_results.json") as f:
        metrics = json.load(f)
    assert metrics["val_bleu"] > 10.0, metrics
    print(f"demo wall time {time.time() - t0:.0f} s, val_bleu {metrics['val_bleu']}")


def test_sharded_ddp_two_processes(tmp_path, synth_dir):
    """torchrun with 2 gloo ranks: --sharded_ddp + ZeRO-2 (no offload) trains and writes the legacy results."""
    single = tmp_path / "single"
    finetune_trainer.main(_common_args(synth_dir, single) + ["--config_name", TINY, "--do_train"])
    out = tmp_path / "sharded"
    argv = _common_args(synth_dir, out) + [
        "--config_name", TINY, "--tokenizer_name", str(single), "--do_train", "--do_eval", "--predict_with_generate",
        "--per_device_train_batch_size", "4", "--sharded_ddp", "--zero_offload", "zero2"]  # the README's CPU form:
    # --use_cpu (in _common_args) and no --ddp_backend: the backend follows the device
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, EX])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(_free_port()), os.path.join(EX, "finetune_trainer.py"), *argv],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hf_zero_offload: config=" in r.stdout + r.stderr and "stage=2" in r.stdout + r.stderr
    assert (r.stdout + r.stderr).count("accepted, no effect here") == 1  # once per job, not once per rank
    with open(out / "all_results.json") as f:
        metrics = json.load(f)
    assert metrics["train_loss"] == metrics["train_loss"] and "val_bleu" in metrics  # finite, evaluated


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
