"""Fast CPU tier for examples/seq2seq (finetune_trainer.py, run_demo.py) and configs/ (synthetic_data.py:
test_examples_synthetic.py).

Everything runs offline (HF_HUB_OFFLINE=1) on a randomly initialised t5-tiny with a tokenizer trained on the fly.
The real en-ro sample is used when present (HZO_WMT_EN_RO or /work/shared/data/wmt_en_ro); never copied here.
"""
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from _examples import CONFIGS, EX, ROOT, TINY, WMT_EN_RO, run_tokenizer, write_synth
from hf_zero_offload.engine import OffloadOptions
from _examples import common_args as _common_args
from _procs import run_together

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


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return write_synth(tmp_path_factory)


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
def test_finetune_t5_tiny_synthetic(tmp_path, synth_dir, offload, caplog, capsys, monkeypatch):
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
    import hf_zero_offload.engine_setup as engine_setup
    built = []  # the gradient bucket the run's engine takes, which the memory plan printed at start must show
    monkeypatch.setattr(engine_setup, "OffloadOptions",
                        lambda **kw: built.append(kw.get("bucket_numel")) or OffloadOptions(**kw))
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
    printed = capsys.readouterr().out
    assert ("gradient checkpointing; budget" in printed) == bool(offload)
    if offload:  # the plan printed the planner's default (200M elements, cut to the model's size) while the run's
        # engine took the config's "auto" (hidden_size**2, at least the largest param)
        (bucket,) = re.findall(r"gradient buckets of ([\d,]+) elements", printed)
        from transformers import AutoModelForSeq2SeqLM
        sizes = [p.numel() for p in AutoModelForSeq2SeqLM.from_pretrained(str(out)).parameters()]
        assert built and int(bucket.replace(",", "")) == max(min(built[0], sum(sizes)), max(sizes)), (bucket, built)

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


@pytest.fixture(scope="module")
def torchruns(request, tmp_path_factory, synth_dir):
    """The torchrun launches of the two tests below (those collected), side by side (tests/_procs.py): each keeps
    about one core busy (its ranks import, then train on one thread each, or stop), so both take little more than
    the longer (13.8 + 8.8 s one after the other on 2 cores). name -> (CompletedProcess, its output_dir)."""
    tmp, wanted = tmp_path_factory.mktemp("torchruns"), {item.name for item in request.session.items}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, EX])}
    launches = {}
    if "test_sharded_ddp_two_processes" in wanted:
        single = run_tokenizer(synth_dir, tmp / "single")  # the one a 1-process run of these args trains
        argv = _common_args(synth_dir, tmp / "sharded") + [
            "--config_name", TINY, "--tokenizer_name", str(single), "--do_train", "--do_eval",
            "--predict_with_generate", "--per_device_train_batch_size", "4",
            "--sharded_ddp", "--zero_offload", "zero2",  # the README's CPU form:
            "--do_predict", "--n_test", "7", "--per_device_eval_batch_size", "2"]
        # --use_cpu (in _common_args) and no --ddp_backend: the backend follows the device
        launches["sharded"] = (argv, env, tmp / "sharded")
    if "test_torchrun_on_cpu_without_use_cpu_names_the_flag_before_anything_is_written" in wanted:
        argv = [a for a in _common_args(synth_dir, tmp / "out") if a != "--use_cpu"]
        argv += ["--config_name", TINY, "--do_train", "--sharded_ddp", "--zero_offload", "zero2-offload"]
        launches["no-use-cpu"] = (argv, {**env, "CUDA_VISIBLE_DEVICES": ""}, tmp / "out")
    # --standalone: the rendezvous binds a free port itself (the README's form; each launch its own); a port picked
    # here and released before torchrun binds it could be taken in between
    runs = run_together([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(EX, "finetune_trainer.py"), *argv] for argv, _, _ in launches.values()],
                        per_child=[{"env": env} for _, env, _ in launches.values()], timeout=600, cwd=ROOT)
    return {name: (r, out) for (name, (_, _, out)), r in zip(launches.items(), runs)}


def test_sharded_ddp_two_processes(torchruns, synth_dir):
    """torchrun with 2 gloo ranks: --sharded_ddp + ZeRO-2 (no offload) trains and writes the legacy results; the
    generations and BLEU are those of the split's examples (the Trainer pads the last batch of 7 examples with a
    repeat of the first: test_generations.txt had 8 lines and BLEU scored them, an outside probe)."""
    r, out = torchruns["sharded"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "hf_zero_offload: config=" in log and "stage=2" in log, log[-3000:]
    assert log.count("accepted, no effect here") == 1, log[-3000:]  # once per job, not once per rank
    with open(out / "all_results.json") as f:
        metrics = json.load(f)
    assert metrics["train_loss"] == metrics["train_loss"] and "val_bleu" in metrics  # finite, evaluated
    generated = (out / "test_generations.txt").read_text(encoding="utf-8").splitlines()
    refs = open(os.path.join(synth_dir, "test.target"), encoding="utf-8").read().splitlines()[:7]
    import sacrebleu

    assert len(generated) == 7 and metrics["test_bleu"] == round(sacrebleu.corpus_bleu(generated, [refs]).score, 4)



def test_torchrun_on_cpu_without_use_cpu_names_the_flag_before_anything_is_written(torchruns):
    """Each process saw one process; the second then met the first one's run lock ("another run ... is training in
    this output_dir") and torchrun printed a traceback: the flag that fixes it was never named."""
    r, out = torchruns["no-use-cpu"]
    if r.returncode == 0:  # accelerate 1.3 (the floor) gives the Trainer both gloo ranks: a right run, nothing to stop
        assert "ranks=2 backend=gloo" in r.stderr, r.stderr[-3000:]
        return
    assert "WORLD_SIZE=2 (torchrun) but the Trainer sees 1 process" in r.stderr and "--use_cpu" in r.stderr, \
        r.stderr[-3000:]
    assert "hzo-run.lock" not in r.stderr and "another run" not in r.stderr
    assert not out.exists() or not os.listdir(out)


@pytest.mark.slow  # (18 s: make test-all)
def test_two_nodes_on_one_file_system_train_with_rank_0s_tokenizer(tmp_path, synth_dir):
    """Two torchrun launches (--nnodes=2, one process each) sharing output_dir, which holds an older run's tokenizer:
    main_process_first is node-local by default, so node 1 loaded the old tokenizer before rank 0 had trained the
    new one (313 ids against 317), and the ranks tokenized the data differently without a word."""
    import socket

    from train_tokenizer import train_t5_tokenizer

    out = tmp_path / "out"
    src = open(os.path.join(synth_dir, "train.source")).read().splitlines()[:20]
    stale = len(train_t5_tokenizer(src, 200, save_dir=str(out)))
    with socket.socket() as s:  # (a port taken between here and torchrun's bind fails the launch, loudly)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = _common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--max_steps", "1", "--sharded_ddp",
                                           "--zero_offload", "zero2-offload", "--overwrite_output_dir"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, EX])}
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--master_addr",
            "127.0.0.1", "--master_port", str(port)]
    runs = run_together([node + [f"--node_rank={n}", os.path.join(EX, "finetune_trainer.py"), *argv] for n in (0, 1)],
                        timeout=600, cwd=ROOT, env=env)
    sizes = []
    for r in runs:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        sizes += [int(m) for m in re.findall(r"tokenizer: (\d+) ids", r.stdout + r.stderr)]
    assert len(sizes) == 2 and sizes[0] == sizes[1] != stale, sizes

def test_a_resume_takes_the_tokenizer_of_its_checkpoint(tmp_path, synth_dir):
    """Random initialisation trains a tokenizer on the training text; a resume (here with another --n_train)
    trained another one, whose ids no longer matched the embedding rows the model had learned."""
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    base = _common_args(synth_dir, out, n_train=48) + ["--config_name", TINY, "--do_train", "--zero_offload",
                                                      "zero2-offload"]
    base[base.index("--save_strategy") + 1] = "steps"
    finetune_trainer.main(base + ["--save_steps", "2", "--max_steps", "2"])
    saved = AutoTokenizer.from_pretrained(out / "checkpoint-2").get_vocab()
    argv = _common_args(synth_dir, out, n_train=160) + ["--config_name", TINY, "--do_train", "--zero_offload",
                                                       "zero2-offload", "--resume_from_checkpoint",
                                                       str(out / "checkpoint-2")]
    finetune_trainer.main(argv)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == saved  # the final model's tokenizer is the run's


def test_ctrl_c_is_one_line_naming_the_checkpoint_to_go_on_from(tmp_path, synth_dir):
    """SIGINT mid-run printed a 115-line KeyboardInterrupt traceback through the model's forward."""
    import signal

    out = tmp_path / "out"
    argv = _common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--zero_offload", "zero2-offload",
                                          "--max_steps", "100000", "--save_steps", "2"]
    argv[argv.index("--save_strategy") + 1] = "steps"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, EX])}
    p = subprocess.Popen([sys.executable, os.path.join(EX, "finetune_trainer.py"), *argv], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoint-2" / "hzo_complete.json").exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("finetune_trainer.py: interrupted; the newest complete checkpoint is "), last
    assert "--resume_from_checkpoint true" in last


def test_ctrl_c_while_starting_is_one_line_too(tmp_path):
    """An outside probe: a Ctrl-C while torch and transformers load (seconds) printed a KeyboardInterrupt traceback
    through their imports. The signal comes 0.3 s after start: the script's guard is set within its first lines, and
    torch alone takes longer than that to import."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, EX])}
    # (SIGINT as a terminal gives it, also where this suite runs as a background job, which ignores SIGINT)
    p = subprocess.Popen([sys.executable, os.path.join(EX, "finetune_trainer.py"), "--output_dir", str(tmp_path / "o")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "finetune_trainer.py: interrupted while starting; nothing was written"
    assert not (tmp_path / "o").exists()
