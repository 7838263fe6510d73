"""``hf-zero-offload``: a dispatcher of subcommands, each delegating to its own module.

    hf-zero-offload estimate --model CONFIG_JSON_OR_MODEL_DIR --gpus N [--gpu-mem-gib 24] [--fp16|--bf16] [--json]
    hf-zero-offload consolidate CHECKPOINT_DIR OUTPUT_DIR [--with-optimizer]
    hf-zero-offload configs

``consolidate``'s module is imported only when it runs, so a problem there never breaks ``estimate``.
A bad value, a missing file or an unknown name prints one line and exits 2 (``usage.run_reporting``);
``--debug`` or ``HF_ZERO_OFFLOAD_DEBUG=1`` shows the traceback.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from .usage import run_reporting, take_debug_flag


def _estimate(args: argparse.Namespace) -> int:
    from . import planner

    return planner.main(args)


def _consolidate(args: argparse.Namespace) -> int:
    from . import consolidate

    return consolidate.consolidate_main(args)


def _configs(args: argparse.Namespace) -> int:
    from . import presets

    print(presets.listing())
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors (a value of the wrong type, a missing or unknown flag) as one line, as every other mistake
    here: argparse printed its usage block first (10 lines for estimate) above the line that names the problem.
    Subparsers are made of the same class."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for error(): a subparser is given only its own
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # argparse checks the required arguments before it returns the unknown ones, so `--modle X` was reported
        # as "required: --model" without a word of the typo that caused it: name the typo first
        unknown = unknown_flags(self, getattr(self, "_argv", []))
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {with_hints(self, unknown)}; {message}"
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The ``--flags`` in ``argv`` that ``parser`` would not take: neither one of its options nor a prefix of one
    (argparse's abbreviations); what follows a bare ``--`` is values."""
    known = list(parser._option_string_actions)
    out = []
    for arg in argv:
        if arg == "--":
            break
        name = arg.partition("=")[0]
        if name.startswith("--") and len(name) > 2 and not any(o.startswith(name) for o in known):
            out.append(arg)
    return out


def with_hints(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``--x (did you mean --y?)`` for each unknown flag close to one of ``parser``'s options."""
    return " ".join(f"{x} (did you mean {m[0]}?)" if x.startswith("--") and (
        m := difflib.get_close_matches(x.partition("=")[0], list(parser._option_string_actions), n=1)) else x
        for x in extra)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="hf-zero-offload", description="ZeRO-Offload / ZeRO-1/2 tools",
                                     epilog="A mistake prints one line and exits 2; --debug (anywhere on the line) "
                                            "or HF_ZERO_OFFLOAD_DEBUG=1 shows the traceback.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    est = sub.add_parser("estimate", help="memory plan per configuration and the largest batch that fits",
                         description="Model-state bytes on the device and the host per rank, traced activation "
                                     "bytes, and the largest batch per configuration.")
    from . import planner  # its arguments live next to the code that reads them

    planner.add_arguments(est)
    est.set_defaults(func=_estimate)

    con = sub.add_parser("consolidate",
                         help="a checkpoint's fp32 weights (its per-rank masters) as a model folder "
                              "from_pretrained loads")
    con.add_argument("checkpoint_dir", help="a Trainer checkpoint-N/ folder holding zero_offload/")
    con.add_argument("output_dir", help="where the consolidated weights are written")
    con.add_argument("--with-optimizer", action="store_true",
                     help="also write torch.optim.AdamW's state (optimizer.pt: the fp32 Adam moments) and copy the "
                          "checkpoint's trainer state, scheduler and RNG files, so that the plain Trainer (no "
                          "hf_zero_offload) resumes the output as a checkpoint")
    con.set_defaults(func=_consolidate)

    cfg = sub.add_parser("configs", help="list the ds_configs shipped with the package (--zero_offload NAME)")
    cfg.set_defaults(func=_configs)
    parser.subcommands = sub.choices  # name -> its parser: main reports a stray argument in the subcommand's words
    return parser


def _dash_spellings(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--seq_len`` for ``--seq-len``: the Trainer's flags are spelled with underscores, which a user then types
    here too (argparse said only "unrecognized arguments"). A flag is rewritten only where the dashed spelling is
    one of its subcommand's options and the underscored one is not."""
    command = next((a for a in argv if a in parser.subcommands), None)
    if command is None:
        return argv
    known = set(parser.subcommands[command]._option_string_actions)
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":  # argparse's end of options: what follows is values, as typed
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        out.append(dashed + eq + value if name.startswith("--") and name not in known and dashed in known else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    debug, argv = take_debug_flag(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(_dash_spellings(parser, argv))
    if extra:  # argparse would blame the top-level command and print its usage, not the subcommand's
        sub = parser.subcommands[args.command]
        sub.error(f"unrecognized arguments: {with_hints(sub, extra)}")
    try:
        return int(run_reporting(f"hf-zero-offload {args.command}", lambda: args.func(args), debug=debug) or 0)
    except SystemExit as e:  # the one-line report of a user error
        return int(e.code)


if __name__ == "__main__":
    sys.exit(main())
