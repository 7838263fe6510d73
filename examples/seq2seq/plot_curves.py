#!/usr/bin/env python
"""Training loss and validation loss/BLEU of a finetune_trainer.py run, as one PNG beside all_results.json.

    python examples/seq2seq/plot_curves.py OUTPUT_DIR          # writes OUTPUT_DIR/curves.png

Reads OUTPUT_DIR/trainer_state.json (the Trainer's log history: ``loss`` per logging step, ``eval_*`` per
evaluation during training) and OUTPUT_DIR/all_results.json (the final ``val_*``, drawn at the last step).
The image is written under a temporary name and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import sys


def read_curves(output_dir: str) -> dict:
    """{"loss": [(step, value)], "val_loss": [...], "val_bleu": [...]} from the run's files."""
    if not os.path.isfile(os.path.join(output_dir, "trainer_state.json")):
        what = "holds no trainer_state.json" if os.path.isdir(output_dir) else "is not a directory"
        raise FileNotFoundError(f"{output_dir} {what}: give the --output_dir of a finished finetune_trainer.py "
                                "--do_train run")
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        state = json.load(f)
    curves = {"loss": [], "val_loss": [], "val_bleu": []}
    for entry in state.get("log_history", []):
        step = entry.get("step")
        for key, name in (("loss", "loss"), ("eval_loss", "val_loss"), ("eval_bleu", "val_bleu")):
            if key in entry and step is not None:
                curves[name].append((step, entry[key]))
    final = os.path.join(output_dir, "all_results.json")
    if os.path.isfile(final):
        with open(final) as f:
            results = json.load(f)
        last = state.get("global_step") or max((s for s, _ in curves["loss"]), default=0)
        for name in ("val_loss", "val_bleu"):
            if name in results and not any(s == last for s, _ in curves[name]):
                curves[name].append((last, results[name]))
    return curves


def plot(output_dir: str, name: str = "curves.png") -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    curves = read_curves(output_dir)
    if not curves["loss"]:
        raise ValueError(f"{output_dir}/trainer_state.json has no training loss entries to plot (the Trainer logs "
                         "the loss every --logging_steps steps: 500 by default; pass a smaller one)")
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        if curves[key]:
            ax_loss.plot(*zip(*curves[key]), style, label=key.replace("loss", "loss (train)") if key == "loss"
                         else "loss (validation)")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="loss")
    ax_loss.legend()
    if curves["val_bleu"]:
        ax_bleu.plot(*zip(*curves["val_bleu"]), "o-", color="tab:green")
    ax_bleu.set(xlabel="optimizer step", ylabel="BLEU", title="validation BLEU (synthetic data: the pipeline learns)")
    fig.tight_layout()
    path = os.path.join(output_dir, name)
    tmp = f"{path}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import example_cli

    example_cli.require(os.path.basename(__file__), ("hf_zero_offload", "matplotlib"))
    from hf_zero_offload.usage import run_reporting, take_debug_flag

    debug, argv = take_debug_flag(sys.argv[1:] if argv is None else argv)
    parser = example_cli.OneLineParser(description=(__doc__ or "").split("\n\n")[0],  # (None under python -OO)
                                     epilog="errors print one line and exit 2; --debug shows the traceback")
    parser.add_argument("output_dir", help="the --output_dir of a finetune_trainer.py run (holds trainer_state.json); "
                                           "curves.png is written there")
    args = parser.parse_args(argv)
    print(run_reporting(os.path.basename(__file__), lambda: plot(args.output_dir), debug=debug))


if __name__ == "__main__":
    main()
