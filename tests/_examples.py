"""What the examples/seq2seq tests share: offline environment, paths, the example modules on sys.path,
the command line of a small run and the synthetic corpus."""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def common_args(data_dir, out_dir, n_train=48, n_eval=12):
    return [
        "--data_dir", str(data_dir), "--task", "translation_en_to_ro", "--output_dir", str(out_dir),
        "--n_train", str(n_train), "--n_val", str(n_eval), "--n_test", str(n_eval),
        "--max_source_length", "48", "--max_target_length", "32",
        "--val_max_target_length", "24", "--test_max_target_length", "24",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
        "--learning_rate", "3e-3", "--max_steps", "4", "--logging_steps", "2",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0",
    ]


def write_synth(tmp_path_factory):
    return synthetic_data.write_corpus(str(tmp_path_factory.mktemp("synth")), n_train=200, n_val=40, n_test=40, seed=0)


def run_tokenizer(data_dir, save_dir, n_train=48, config=TINY, task="translation_en_to_ro"):
    """The tokenizer a ``finetune_trainer.py`` run of ``common_args(data_dir, ...)`` + ``--config_name config``
    trains (the same function on the same text: the task's prefix + the first n_train sources, then their targets;
    the config's vocab_size), saved in save_dir without a training run around it: for a test that passes it as
    --tokenizer_name (a whole run only to get one cost a test 5-8 s)."""
    import seq2seq_data
    import seq2seq_utils
    from train_tokenizer import train_t5_tokenizer
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(config)
    src, tgt = seq2seq_data.read_split(str(data_dir), "train", n_train)
    prefix = seq2seq_utils.task_prefix(task, cfg)
    train_t5_tokenizer([prefix + s for s in src] + list(tgt), cfg.vocab_size, save_dir=str(save_dir))
    return save_dir


# libgomp reads GOMP_SPINCOUNT once, when torch loads it: a probe without the user's spin settings prints whether
# finetune_trainer.py sets the spin before `import torch` (in its source) and the value it set.
SPIN_PROBE = (("-c", "import sys; sys.path.insert(0, sys.argv[1]); import finetune_trainer, os; "
               "src = open(finetune_trainer.__file__).read(); "
               "print(src.index('\\nshorten_openmp_spin(os.environ)') < src.index('\\n    import torch'), "
               "os.environ.get('GOMP_SPINCOUNT'))", EX), ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"))
FINETUNE_HELP = (("examples/seq2seq/finetune_trainer.py", "--help"), ("PYTHONPATH",))  # as tests/_help.py runs it


def finetune_children():
    """{"help": finetune_trainer.py --help as a user runs it, "spin": SPIN_PROBE's run}: two children that mostly
    import torch (~5 s each on 2 cores), run side by side once a session for the test that asks first
    (test_cli_hostile, test_examples_args), read back by the other."""
    from _help import runs_once

    return dict(zip(("help", "spin"), runs_once([FINETUNE_HELP, SPIN_PROBE])))
