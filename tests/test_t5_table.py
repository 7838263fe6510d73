"""benchmarks/t5/table.py --smoke end to end (CPU, offline): one-process rows of finetune_trainer.py on t5-tiny (the DPU
row by default, all three in the slow tier), then the JSON / markdown / PNG outputs. Also the batch-size search on a fake probe (no training runs)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")
pytest.importorskip("matplotlib")

SMOKE_ROWS = ["baseline", "zero2_offload", "zero2_offload_dpu"]
ROW_KEYS = {"name", "configuration", "nproc", "batch_size", "status", "train_runtime", "val_runtime",
            "peak_device_mem_gib", "peak_host_rss_mib", "train_loss", "cmd", "foreign_cores"}


def _t5_table():
    from benchmarks.t5 import table  # the repository root is on pytest's pythonpath (pyproject.toml)

    return table


# One row is the whole pipeline (its runner, the JSON, markdown and chart); the DPU row's config is the one table.py
# writes itself. The three rows take 31 s more (10 s each, a process and a tokenizer each): make test-all.
@pytest.mark.parametrize("rows", [pytest.param(SMOKE_ROWS[2:], id="dpu-row"),
                                  pytest.param(SMOKE_ROWS, id="all-rows", marks=pytest.mark.slow)])
def test_smoke_outputs(tmp_path, rows, monkeypatch, capsys):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(ROOT)  # where the program ran
    argv = ["--smoke", "--cpu", "--out_dir", str(tmp_path)]
    if rows != SMOKE_ROWS:
        argv += ["--rows", ",".join(rows)]
    # main() here, not `python -m benchmarks.t5.table` (a child importing torch and transformers again, 3-5 s): the
    # rows run as children either way (test_benchmarks_args runs the module as a program, its --help and errors)
    code = _t5_table().main(argv)
    out = capsys.readouterr()
    assert code == 0, out.out[-4000:] + out.err[-4000:]

    payload = json.loads((tmp_path / "t5_table_smoke.json").read_text())
    assert payload["smoke"] is True and payload["mode"] == "cpu"
    assert {"hardware", "hardware_line", "command", "loadavg_before", "loadavg_after", "settings", "rows",
            "notes", "blog_reference"} <= set(payload)
    assert "--smoke" in payload["command"]
    assert len(payload["loadavg_before"]) == 3
    assert [r["name"] for r in payload["rows"]] == rows
    by = {r["name"]: r for r in payload["rows"]}
    for r in by.values():
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["status"] == "ok", r.get("log_tail")
        assert r["nproc"] == 1 and r["batch_size"] == payload["settings"]["batch_size"]
        assert r["train_runtime"] > 0 and r["val_runtime"] > 0
        assert r["peak_host_rss_mib"] > 0 and r["peak_device_mem_gib"] is None  # CPU: no device memory
        assert r["train_loss"] == pytest.approx(r["train_loss"])  # finite
        assert "finetune_trainer.py" in r["cmd"] and "--use_cpu" in r["cmd"]
    if "baseline" in by:
        assert "--zero_offload" not in by["baseline"]["cmd"]
    if "zero2_offload" in by:
        assert "ds_config_1gpu.json" in by["zero2_offload"]["cmd"]
    assert "ds_config_1gpu_dpu.json" in by["zero2_offload_dpu"]["cmd"]  # the temporary copy with delayed_param_update

    md = (tmp_path / "t5_table_smoke.md").read_text()
    assert "| configuration | procs |" in md
    for r in by.values():
        assert f"| {r['configuration']} |" in md
    assert "30.95" in md  # the blog's baseline row, for comparison

    png = (tmp_path / "t5_table_smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_rows_cpu(tmp_path):
    t5 = _t5_table()
    a = t5.parse_args([])
    t5._defaults(a, cuda=False)
    rows = t5.build_rows(a, str(tmp_path), cuda=False)
    assert [r.name for r in rows] == ["baseline", "half", "sharded_ddp", "sharded_ddp_half", "zero2", "zero2_offload",
                                      "zero2_offload_dpu"]
    by = {r.name: r for r in rows}
    assert by["baseline"].nproc == 2 and by["zero2_offload_dpu"].nproc == 2
    assert "--bf16" in by["half"].flags and "--fp16" not in by["zero2"].flags
    assert by["zero2_offload"].flags[1].endswith("ds_config.json")
    dpu_cfg = json.loads(open(by["zero2_offload_dpu"].flags[1]).read())
    assert dpu_cfg["zero_optimization"]["delayed_param_update"] == {"enabled": True, "warmup_steps": 10}
    assert dpu_cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    stage = json.loads(open(by["sharded_ddp"].flags[2]).read())
    assert by["sharded_ddp"].flags[0] == "--sharded_ddp" and stage == {"zero_optimization": {"stage": 1}}
    # GPU: fp16 and the same row names
    g = t5.build_rows(a, str(tmp_path), cuda=True)
    assert "--fp16" in {f for r in g for f in r.flags} and "--bf16" not in {f for r in g for f in r.flags}


def test_command_cpu_and_caps(tmp_path):
    t5 = _t5_table()
    a = t5.parse_args(["--nproc", "2"])
    t5._defaults(a, cuda=False)
    runner = t5.Runner(a, str(tmp_path), str(tmp_path / "data"), cuda=False, log_dir=str(tmp_path))
    assert runner.launcher is None  # no cap on CPU unless --host_mem_gib
    row = t5.RowSpec("baseline", "b", [], 2)
    cmd = runner.command(row, 16, str(tmp_path / "o"), probe=False)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nnodes"] and "--nproc_per_node" in cmd
    assert cmd[cmd.index("--ddp_backend") + 1] == "gloo" and "--use_cpu" in cmd
    assert "--predict_with_generate" in cmd and cmd[cmd.index("--eval_beams") + 1] == "4"
    assert cmd[cmd.index("--per_device_train_batch_size") + 1] == "16"
    probe = runner.command(t5.RowSpec("x", "x", [], 1), 8, str(tmp_path / "p"), probe=True)
    assert "--do_eval" not in probe and probe[probe.index("--max_steps") + 1] == "3"
    assert "--ddp_backend" not in probe  # one process: no process group

    # GPU mode: the generated launcher applies the per-process memory fraction before running the script
    g = t5.parse_args([])
    t5._defaults(g, cuda=True)
    gr = t5.Runner(g, str(tmp_path), str(tmp_path / "data"), cuda=True, log_dir=str(tmp_path))
    text = open(gr.launcher).read()
    assert "set_per_process_memory_fraction" in text and "runpy.run_path" in text
    env = gr.env(t5.RowSpec("zero2", "z", [], 2))
    assert env["HZO_GPU_MEM_GIB"] == "24.0" and env["HZO_SCRIPT"].endswith("finetune_trainer.py")
    gcmd = gr.command(t5.RowSpec("zero2", "z", [], 2), 8, "o", probe=True)
    assert gr.launcher in gcmd and t5.SCRIPT not in gcmd and "--use_cpu" not in gcmd


def test_launcher_applies_host_cap_and_runs_script(tmp_path):
    """The generated launcher (CPU path: RLIMIT_AS) sets the cap, then runs HZO_SCRIPT as __main__ with its argv."""
    t5 = _t5_table()
    a = t5.parse_args(["--host_mem_gib", "64"])
    t5._defaults(a, cuda=False)
    runner = t5.Runner(a, str(tmp_path), str(tmp_path), cuda=False, log_dir=str(tmp_path))
    target = tmp_path / "target.py"
    target.write_text("import resource, sys\nif __name__ == '__main__':\n"
                      "    print(resource.getrlimit(resource.RLIMIT_AS)[0], sys.argv[0].endswith('target.py'), "
                      "sys.argv[1:])\n")
    env = runner.env(t5.RowSpec("x", "x", [], 1))
    env["HZO_SCRIPT"] = str(target)
    out = subprocess.run([sys.executable, runner.launcher, "--a", "1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(64 * 2**30), "True", "['--a',", "'1']"]


@pytest.mark.parametrize("limit,start,multiple", [(37, 16, 1), (37, 200, 1), (50, 16, 10), (1, 16, 1), (0, 4, 1),
                                                  (5000, 16, 1)])
def test_find_max_bs(limit, start, multiple):
    t5 = _t5_table()
    calls = []

    def probe(bs):
        calls.append(bs)
        return "ok" if bs <= limit else "oom"

    bs, seen, err = t5.find_max_bs(probe, start, multiple, max_bs=1024, log=lambda m: None)
    expected = min(1024, limit // multiple * multiple)
    assert err is None and bs == expected
    assert len(calls) == len(set(calls)) <= 20


def test_find_max_bs_rel_tol():
    t5 = _t5_table()
    bs, seen, err = t5.find_max_bs(lambda b: "ok" if b <= 100 else "oom", 16, 1, log=lambda m: None, rel_tol=0.05)
    failing = min(b for b, st in seen.items() if st == "oom")
    assert err is None and 95 <= bs <= 100 and failing - bs <= 0.05 * bs and len(seen) <= 10


def test_find_max_bs_error_stops():
    t5 = _t5_table()
    bs, seen, err = t5.find_max_bs(lambda b: "ok" if b <= 20 else "error", 16, 1, log=lambda m: None)
    assert bs == 16 and "not out-of-memory" in err


def test_t5_3b_recipe_needs_gpu(tmp_path):
    t5 = _t5_table()
    if t5._gpu_count():
        pytest.skip("a GPU is present: the recipe would run")
    assert t5.main(["--t5_3b_recipe", "--out_dir", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir())


def test_t5_3b_recipe_rows():
    """--rows with the recipe: --rows parses to a list (the first H100 run's `a.rows.split` was an AttributeError
    before anything ran), picks among the recipe's two rows, and refuses a row of the table's others by name."""
    t5 = _t5_table()
    pick = lambda *argv: [r.name for r in t5.recipe_rows(t5.parse_args(["--t5_3b_recipe", *argv]), cuda=True)]
    assert pick() == ["half", "zero2_offload"]
    assert pick("--rows", "zero2_offload") == ["zero2_offload"]
    assert t5.recipe_rows(t5.parse_args(["--t5_3b_recipe"]), cuda=True)[1].flags[-1] == "--fp16"
    with pytest.raises(SystemExit, match="--rows zero2: not a row of --t5_3b_recipe; its rows are half,zero2_offload"):
        pick("--rows", "zero2,half")
