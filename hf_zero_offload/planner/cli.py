"""``hf-zero-offload estimate``'s arguments and its entry point (the dispatcher is ``hf_zero_offload.cli``)."""
from __future__ import annotations

import argparse
import json
import sys

from ..ops import STATE_DTYPES
from .plan import plan
from .report import format_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="config JSON file or local model directory")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (GPUs); default 1")
    parser.add_argument("--gpu-mem-gib", type=float, default=24.0, help="memory of one GPU in GiB; default 24")
    half = parser.add_mutually_exclusive_group()
    half.add_argument("--fp16", dest="dtype", action="store_const", const="fp16", help="16-bit = fp16 (default)")
    half.add_argument("--bf16", dest="dtype", action="store_const", const="bf16", help="16-bit = bf16")
    parser.set_defaults(dtype="fp16")
    parser.add_argument("--seq-len", type=int, default=128, help="padded source length; default 128")
    parser.add_argument("--tgt-len", type=int, default=128, help="padded target length (seq2seq); default 128")
    parser.add_argument("--batch-size", type=int, default=None, help="also report the memory at this batch size")
    parser.add_argument("--bucket-numel", type=_bucket, default="auto",
                        help="gradient bucket size in elements, or auto (default): hidden_size**2, what the shipped "
                             "configs' \"auto\" reduce_bucket_size gives (a ds_config without the key: 500000000)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1,
                        help="micro-batches per step (the gradient store is fp32 above 1); default 1")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="trace the step with the model's gradient checkpointing on")
    parser.add_argument("--configs", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                        help="Adam moments of the offload rows (offload_optimizer.state_dtype; default fp32)")
    parser.add_argument("--trainable", default=None, metavar="REGEX",
                        help="only the params whose name matches REGEX (re.search) train; the others are frozen "
                             "(e.g. 'decoder\\.' or 'bias|layer_norm'; with --peft-config it narrows the "
                             "adapter's params); default: all")
    parser.add_argument("--peft-config", default=None, metavar="PATH",
                        help="plan a PEFT adapter (LoRA, ...): its adapter_config.json or the folder holding it; the "
                             "adapter's params train, the model's are frozen (needs peft)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _bucket(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        pass
    try:  # 2e8, as a ds_config's bucket sizes take it
        number = float(value)
    except ValueError:
        number = None
    if number is None or not number.is_integer():
        raise argparse.ArgumentTypeError(f"expected a number of elements or auto, got {value!r}") from None
    return int(number)


def main(args: argparse.Namespace) -> int:
    p = plan(args.model, gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib, dtype=args.dtype, seq_len=args.seq_len,
             tgt_len=args.tgt_len, batch_size=args.batch_size, bucket_numel=args.bucket_numel,
             gradient_accumulation_steps=args.gradient_accumulation_steps,
             configs=args.configs.split(",") if args.configs is not None else None,
             gradient_checkpointing=args.gradient_checkpointing, state_dtype=args.state_dtype,
             trainable=args.trainable, peft_config=args.peft_config,
             # the trace takes seconds to minutes (a large model, a loaded machine): say so on stderr, where
             # --json's output is not
             progress=lambda line: print(f"hf-zero-offload estimate: {line}", file=sys.stderr, flush=True))
    p.inputs["model"] = args.model  # as typed
    if args.json:
        print(json.dumps(p.to_json(), indent=2))
    else:
        print(format_plan(p))
    return 0
