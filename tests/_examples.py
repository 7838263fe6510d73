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
