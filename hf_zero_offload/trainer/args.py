"""The TrainingArguments of the integration: transformers' own, plus ``zero_offload`` and ``sharded_ddp``, checked
before transformers' ``__post_init__`` sets up the process group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from .. import resume
from ..config.checks import plain_numbers
from ..config import ConfigError
from ..config.loader import INLINE, check, is_inline, parse_inline
from ..launch_checks import check_launch_env
from ..launch_watch import watch_world_size
from ..other_engines import refuse_other_engines, take_launcher_precision


@dataclass
class _ZeroOffloadFields:
    # Typed str for HfArgumentParser; code may pass a dict (the dataclass does not enforce the annotation).
    zero_offload: Optional[str] = field(
        default=None,
        metadata={"help": "A DeepSpeed-style ds_config.json path, a shipped config's name (hf-zero-offload "
                          "configs) or the JSON itself ('{...}', as --deepspeed takes it; a dict is accepted in code): "
                          "enables hf_zero_offload's ZeRO-Offload / ZeRO-2 engine."},
    )
    sharded_ddp: bool = field(
        default=False,
        metadata={"help": "Partition optimizer states and gradients across data-parallel ranks (ZeRO stage 1/2)."},
    )
    zero_offload_fp32_logits: bool = field(
        default=True,
        metadata={"help": "With --bf16/--fp16 and zero_offload/sharded_ddp (the model cast to 16-bit, no autocast): "
                          "widen the logits to fp32, so that the loss is computed in fp32 as under the plain "
                          "Trainer's autocast. False keeps DeepSpeed's 16-bit loss and the memory of the fp32 "
                          "logits (t5-small, batch 8 x 128 tokens: 188 MiB)."},
    )


def checked_config(args):
    """``args.zero_offload`` read and validated, named as the user gave it: a ``--zero_offload '{...}'`` text is a
    dict from the arguments on, and its later mistakes (a value contradicting the command line) and the start line
    said "<dict>", a name the user never wrote."""
    checked = check(args.zero_offload)
    if args.zero_offload is getattr(args, "_zo_inline", None):  # (not a dict set in its place since)
        checked = checked._replace(source=INLINE)
    return checked


def _before_post_init(args) -> None:
    refuse_other_engines(args)  # (which also reads sharded_ddp's legacy spellings as a bool)
    inline = is_inline(args.zero_offload)
    if inline:  # --zero_offload '{...}': a dict, as transformers reads a --deepspeed JSON string
        check(args.zero_offload)  # its mistakes named as the text's now (and later too: checked_config)
        args.zero_offload = parse_inline(args.zero_offload)
    if isinstance(args.zero_offload, dict):  # numpy numbers, which the config takes, failed args.to_json_string()
        try:
            args.zero_offload = plain_numbers(args.zero_offload)
        except RecursionError:  # (500 levels in a free-form key: check() takes them, this walk did not)
            raise ConfigError("zero_offload: nested too deeply for a ds_config") from None
        if inline:  # (an attribute, not a field: never serialised with the arguments)
            args._zo_inline = args.zero_offload
    take_launcher_precision(args)
    # Before TrainingArguments' __post_init__, which sets up the process group from torchrun's variables (and may
    # hang on an inconsistent set); only when our engine is asked for, as plain runs are transformers' business.
    if args.zero_offload is not None or args.sharded_ddp:
        check_launch_env()
        watch_world_size()  # (another process's WORLD_SIZE: the rendezvous below would hang on it, launch_watch.py)
    # --resume_from_checkpoint false: no resume, as "true" means the newest checkpoint (it was taken for a path, and
    # a script's "output_dir not empty" check, which tests the value's truth, let the run write over the folder)
    args.resume_from_checkpoint = resume.no_resume_word(args.resume_from_checkpoint)


# _ZeroOffloadFields first among the bases: a dataclass orders the fields of its bases from the last one in the MRO,
# so transformers' come first and TrainingArguments("out") stays output_dir (it was taken as zero_offload, a
# ds_config file "out" that could not be read)
@dataclass
class ZeroOffloadTrainingArguments(_ZeroOffloadFields, TrainingArguments):
    def __post_init__(self):
        _before_post_init(self)
        super().__post_init__()


@dataclass
class ZeroOffloadSeq2SeqTrainingArguments(_ZeroOffloadFields, Seq2SeqTrainingArguments):
    def __post_init__(self):
        _before_post_init(self)
        super().__post_init__()
