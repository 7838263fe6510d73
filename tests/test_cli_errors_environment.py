"""What the environment brings, refused or said in one line: a second engine beside --zero_offload,
accelerate's own engines, mixed precision and parallelism config, a source tree without its kernels, an
environment without transformers (star import), an example newer than the installed package."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _cli_errors import ROOT
from hf_zero_offload.config import ConfigError


def test_zero_offload_arguments_refuse_a_second_engine(tmp_path):
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    with pytest.raises(ConfigError, match="--deepspeed and --zero_offload both given"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), deepspeed=str(ROOT / "configs" / "ds_config.json"),
                                     zero_offload="zero2-offload", use_cpu=True)
    with pytest.raises(ConfigError, match="--fsdp and --sharded_ddp both given"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", sharded_ddp=True, use_cpu=True)


@pytest.mark.parametrize("var,value,named", [("ACCELERATE_USE_DEEPSPEED", "true", "accelerate launch --use_deepspeed"),
                                              ("ACCELERATE_USE_DEEPSPEED", "1", "DEEPSPEED"),
                                              ("ACCELERATE_USE_FSDP", "True", "accelerate launch --use_fsdp")])
@pytest.mark.parametrize("ours", ["zero_offload", "sharded_ddp"])
def test_accelerates_own_engines_are_refused_before_transformers_builds_them(tmp_path, monkeypatch, var, value, named,
                                                                             ours):
    # accelerate's launcher sets these: both engines were built, then the run failed naming a create_optimizer
    # override nobody wrote (or, without the deepspeed package, a garbled "No package metadata")
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    monkeypatch.setenv(var, value)
    kw = {"zero_offload": "zero2-offload"} if ours == "zero_offload" else {"sharded_ddp": True}
    with pytest.raises(ConfigError, match=rf"{var}={value} \(.*{named}.*\) and --{ours} both given: .*two engines"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)
    monkeypatch.setenv(var, "false")
    ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)


@pytest.mark.parametrize("mp,flags,expect", [("bf16", {}, "bf16"), ("fp16", {}, "fp16"), ("BF16", {}, "bf16"),
                                             ("no", {}, None), ("fp16", {"bf16": True}, "bf16")])
def test_accelerates_mixed_precision_is_taken_as_the_flag(tmp_path, monkeypatch, mp, flags, expect):
    # accelerate launch --mixed_precision bf16 was dropped: the run trained in fp32 without a word
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", mp)
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_offload="zero2-offload", **flags)
    assert (args.bf16, args.fp16) == (expect == "bf16", expect == "fp16")
    plain = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True)  # the plain Trainer's business
    assert not plain.bf16 and not plain.fp16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigError, match=r"ACCELERATE_MIXED_PRECISION=fp8 .*with --zero_offload: .*fp32, bf16 or fp16"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_offload="zero2-offload")


def test_a_source_tree_without_its_kernels_says_so(tmp_path):
    """From a clone's root, an unbuilt tree hides an installed hf_zero_offload: the error blamed a circular import
    ("cannot import name '_C' from partially initialized module")."""
    import shutil

    pkg = tmp_path / "hf_zero_offload"
    pkg.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "hf_zero_offload" / "__init__.py", pkg / "__init__.py")
    r = subprocess.run([sys.executable, "-S", "-c", "import hf_zero_offload"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert f"compiled kernels (_C) are not built in {pkg}" in r.stderr and "this source tree hides it" in r.stderr


_STAR = """
import importlib.util, sys
class NoTransformers:  # an environment without transformers
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'transformers':
            raise ModuleNotFoundError("No module named 'transformers'", name='transformers')
sys.meta_path.insert(0, NoTransformers())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == 'transformers' else find_spec(name, *a)
from hf_zero_offload import *
assert 'CPUAdam' in dir() and 'ZeroOffloadTrainer' not in dir()
# a loop of one's own: the engines and adapt_accelerator from the package too (they were an AttributeError)
from hf_zero_offload.engine import OffloadAdam as O, OffloadOptions as OO, ShardedAdam as S, ShardOptions as SO
from hf_zero_offload.accelerator_patch import adapt_accelerator as A
assert (OffloadAdam, OffloadOptions, ShardedAdam, ShardOptions, adapt_accelerator) == (O, OO, S, SO, A)
import hf_zero_offload
try:
    hf_zero_offload.ZeroOffloadTrainer
except ModuleNotFoundError as e:
    print(e)
"""
_OLDER = {"module missing": "sys.modules['hf_zero_offload.run_lock'] = None",
          "name missing": "import hf_zero_offload.usage as u; del u.not_utf8_text"}
_SCRIPT = str(ROOT / "examples" / "seq2seq" / "finetune_trainer.py")


@pytest.fixture(scope="module")
def children():
    """The interpreters of the two tests below, forked side by side from one runner that has imported torch alone
    (tests/_forked.py: each imports hf_zero_offload anew; three fresh interpreters took ~6.7 s): name -> run."""
    from _forked import run_forked

    codes = {"star": _STAR, **{case: "import sys, runpy; %s; sys.argv = ['finetune_trainer.py', '--help']; "
                                     "runpy.run_path(%r, run_name='__main__')" % (older, _SCRIPT)
                               for case, older in _OLDER.items()}}
    envs = [os.environ] + [{**os.environ, "HF_ZERO_OFFLOAD_DEBUG": ""}] * 2  # each test's own, as before
    return dict(zip(codes, run_forked(list(codes.values()), envs)))


def test_star_import_and_trainer_names_without_transformers(children):
    """Without the [trainer] extra, `from hf_zero_offload import *` failed on transformers, and a Trainer name gave
    the bare "No module named 'transformers'". The engines' names are the package's too."""
    r = children["star"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "needs transformers, an optional dependency of hf_zero_offload; install it with the [trainer] extra" in r.stdout


@pytest.mark.parametrize("how", ["argument", "launcher"])
def test_accelerates_parallelism_config_is_refused_beside_ours(tmp_path, monkeypatch, how):
    pytest.importorskip("accelerate.parallelism_config", reason="accelerate >= 1.10 has a ParallelismConfig")
    """An outside probe: parallelism_config was refused by neither check; accelerate refuses it on CPU ranks for both
    Trainers alike, but on GPUs its mesh would shard the model beside our engine. Sizes of 1 change nothing."""
    pytest.importorskip("transformers")
    from accelerate.parallelism_config import ParallelismConfig
    from hf_zero_offload.other_engines import refuse_other_engines

    class Args:
        zero_offload, sharded_ddp, deepspeed, fsdp, parallelism_config = "zero2-offload", False, None, "", None

    args = Args()
    if how == "argument":
        args.parallelism_config = ParallelismConfig(dp_shard_size=2, tp_size=1)
    else:
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallelism_config \(dp_shard_size=2\) and --zero_offload both given"):
        refuse_other_engines(args)
    args.zero_offload = None
    refuse_other_engines(args)  # not ours: accelerate's business
    args.zero_offload = "zero2-offload"
    if how == "argument":
        args.parallelism_config = ParallelismConfig(dp_shard_size=1)
    else:
        monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    refuse_other_engines(args)


def test_an_example_newer_than_the_installed_package_says_so_in_one_line(children):
    """An outside probe: a wheel installed, then `git pull`: the example failed with a ModuleNotFoundError traceback
    for a module the older package lacks (or an ImportError for a name it lacks)."""
    for case in _OLDER:
        r = children[case]
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (case, r.stderr)
        assert "lacks it: older than this script? Reinstall it" in r.stderr and "Traceback" not in r.stderr, case
