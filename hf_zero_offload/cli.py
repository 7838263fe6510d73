"""``hf-zero-offload``: a dispatcher of subcommands, each delegating to its own module.

    hf-zero-offload estimate --model CONFIG_JSON_OR_MODEL_DIR --gpus N [--gpu-mem-gib 24] [--fp16|--bf16] [--json]
    hf-zero-offload consolidate CHECKPOINT_DIR OUTPUT_DIR

``consolidate``'s module is imported only when it runs, so a problem there never breaks ``estimate``.
"""
from __future__ import annotations

import argparse
import sys


def _estimate(args: argparse.Namespace) -> int:
    from . import planner

    return planner.main(args)


def _consolidate(args: argparse.Namespace) -> int:
    from . import consolidate

    return consolidate.consolidate_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero-offload", description="ZeRO-Offload / ZeRO-1/2 tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    est = sub.add_parser("estimate", help="memory plan per configuration and the largest batch that fits",
                         description="Model-state bytes on the device and the host per rank, traced activation "
                                     "bytes, and the largest batch per configuration.")
    from . import planner  # its arguments live next to the code that reads them

    planner.add_arguments(est)
    est.set_defaults(func=_estimate)

    con = sub.add_parser("consolidate", help="merge per-rank ZeRO checkpoint shards into one fp32 state dict")
    con.add_argument("checkpoint_dir", help="a Trainer checkpoint-N/ folder holding zero_offload/")
    con.add_argument("output_dir", help="where the consolidated weights are written")
    con.set_defaults(func=_consolidate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
