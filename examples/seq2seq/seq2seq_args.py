"""``finetune_trainer.py``'s command line: the legacy argument dataclasses, parsing (legacy spellings mapped), and
the checks that run before any tokenizer, model or plan work."""

import difflib
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import List, Optional

from transformers import HfArgumentParser

from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments, ops, resume
from hf_zero_offload.args_view import early_view, training_precision
from hf_zero_offload.config import resolve
from hf_zero_offload.launch_checks import check_arguments
from hf_zero_offload.trainer.args import checked_config
from hf_zero_offload.other_engines import legacy_sharded_ddp
from hf_zero_offload.usage import not_utf8_text

import seq2seq_utils as su

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the clone's root


@dataclass
class ModelArguments:
    """Which model/config/tokenizer to fine-tune from (legacy names)."""

    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Pretrained model: a local directory (or a Hub id when online). Either this or "
                          "--config_name (random initialisation) is needed."},
    )
    config_name: Optional[str] = field(
        default=None,
        metadata={"help": "Config name or path (a directory or a config .json such as configs/models/t5-small.json). "
                          "Without --model_name_or_path the model is randomly initialised from it."},
    )
    tokenizer_name: Optional[str] = field(
        default=None,
        metadata={"help": "Tokenizer name or path if not the same as model_name_or_path. With neither, a T5-style "
                          "SentencePiece tokenizer is trained on the training text and saved in --output_dir."},
    )
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Where to store downloaded pretrained models."}
    )
    freeze_encoder: bool = field(default=False, metadata={"help": "Whether to freeze the encoder."})
    freeze_embeds: bool = field(default=False, metadata={"help": "Whether to freeze the embeddings."})
    # v4.2 had these four in its Seq2SeqTrainingArguments: set on the model config, where it has the attribute
    dropout: Optional[float] = field(default=None, metadata={"help": "Legacy: the model config's dropout."})
    attention_dropout: Optional[float] = field(default=None, metadata={"help": "Legacy: config.attention_dropout."})
    encoder_layerdrop: Optional[float] = field(default=None, metadata={"help": "Legacy: config.encoder_layerdrop."})
    decoder_layerdrop: Optional[float] = field(default=None, metadata={"help": "Legacy: config.decoder_layerdrop."})
    tokenizer_vocab_size: Optional[int] = field(
        default=None,
        metadata={"help": "(new) Size of a tokenizer trained here, sentinels included; default: the config's "
                          "vocab_size. A randomly initialised model is then built with this vocabulary."},
    )


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on (legacy names, plus --dataset_name and legacy --label_smoothing)."""

    data_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Directory with line-aligned train|val|test.source/.target files (legacy layout)."},
    )
    task: str = field(
        default="summarization",
        metadata={"help": "summarization, translation_en_to_ro, translation_en_to_de, ... (selects the T5 prefix "
                          "and task_specific_params of the config)."},
    )
    max_source_length: int = field(
        default=1024, metadata={"help": "Max tokenized source length; longer sequences are truncated."}
    )
    max_target_length: int = field(
        default=128, metadata={"help": "Max tokenized target length for training; longer ones are truncated."}
    )
    val_max_target_length: int = field(
        default=142, metadata={"help": "Max target length for validation (labels and generation)."}
    )
    test_max_target_length: int = field(
        default=142, metadata={"help": "Max target length for test (labels and generation)."}
    )
    n_train: int = field(default=-1, metadata={"help": "# training examples. -1 means use all."})
    n_val: int = field(default=-1, metadata={"help": "# validation examples. -1 means use all."})
    n_test: int = field(default=-1, metadata={"help": "# test examples. -1 means use all."})
    src_lang: Optional[str] = field(default=None, metadata={"help": "Source language id for translation."})
    tgt_lang: Optional[str] = field(default=None, metadata={"help": "Target language id for translation."})
    eval_beams: Optional[int] = field(
        default=None, metadata={"help": "# num_beams to use for evaluation (default: task_specific_params or 1)."}
    )
    ignore_pad_token_for_loss: bool = field(
        default=True, metadata={"help": "If only pad tokens should be ignored (label padding becomes -100)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "(new) A `datasets` dataset instead of --data_dir (needs the package and "
                                        "network or a cache)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "(new) Its config, e.g. ro-en."})
    label_smoothing: Optional[float] = field(
        default=None,
        metadata={"help": "Legacy flag: label smoothing epsilon, mapped to --label_smoothing_factor."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Legacy flag (gone from TrainingArguments in transformers 5): allow training into a "
                          "non-empty --output_dir."},
    )


def _refuse_deepspeed_without_package(argv: List[str]) -> None:
    """The blog's ``--deepspeed ds_config.json``: stock transformers needs the deepspeed package for it (and then
    uses DeepSpeed, which is fine). Without the package, point at our flag, which reads the same file. Given with
    --zero_offload/--sharded_ddp, the arguments class refuses the pair (the real mistake) instead."""
    names = {arg.partition("=")[0] for arg in argv}
    if names & {"--zero_offload", "--sharded_ddp"}:
        return
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name != "--deepspeed":
            continue
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            path = value or (argv[i + 1] if i + 1 < len(argv) else "ds_config.json")
            raise ValueError(f"--deepspeed needs the deepspeed package, which is not installed; hf_zero_offload's "
                             f"--zero_offload {path} takes the same file (ZeRO-2 + CPU offload without DeepSpeed)")


def _read_args_json(path: str) -> dict:
    """``finetune_trainer.py args.json``: its flags as one JSON object. Each way it can be wrong names the file
    (Python's own errors named neither the file nor, for bytes that are not UTF-8, the line)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the arguments file: {e.strerror or e}") from None
    try:
        args = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ValueError(not_utf8_text(path, data, "an arguments file is JSON saved as UTF-8")) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{path}: expected one JSON object of flags (without their dashes), got a "
                         f"{type(args).__name__}")
    removed = [f"{k} ({su.REMOVED_FLAGS['--' + k]})" for k in args if "--" + k in su.REMOVED_FLAGS]
    if removed:  # (transformers' "Some keys are not used by the HfArgumentParser" gave no advice)
        raise ValueError(f"{path}: keys of transformers 4.x: {', '.join(removed)}")
    return args


def _refuse_legacy_sharded_ddp(argv: List[str]) -> None:
    """transformers 4.x's ``--sharded_ddp zero_dp_2`` (fairscale's values): argparse's own "Truthy value expected"
    did not say that the flag is a switch now, nor where the stage and the offload are set. (argparse takes an
    unambiguous prefix of a flag, ``--sharded_dd``, so prefixes are matched too.)"""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) > len("--sh") and any(flag.startswith(name) for flag in ("--sharded_ddp", "--sharded-ddp")):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if (message := legacy_sharded_ddp(value)) is not None:
                raise ValueError(message)


def _looks_like_a_path(value: str) -> bool:
    """A Hub id is ``name`` or ``namespace/name``; anything with a ``.json`` suffix, a leading ``/``, ``.`` or ``~``,
    or two slashes is a local path (transformers would otherwise report it as a malformed repo id)."""
    return value.endswith(".json") or value.startswith(("/", ".", "~")) or value.count("/") >= 2


def check_local_paths(model_args) -> None:
    """A path given to --config_name/--model_name_or_path/--tokenizer_name that does not exist is one error naming
    the flag and the directory it was looked up from, not transformers' "Repo id must be in the form ..." (the
    usual cause: a relative path such as configs/models/t5-small.json run from outside the clone)."""
    for flag, value in (("--config_name", model_args.config_name),
                        ("--model_name_or_path", model_args.model_name_or_path),
                        ("--tokenizer_name", model_args.tokenizer_name)):
        if not value or os.path.exists(os.path.expanduser(value)) or not _looks_like_a_path(value):
            continue
        in_repo = os.path.join(_REPO, value)
        hint = f"; did you mean {in_repo}?" if not os.path.isabs(value) and os.path.exists(in_repo) else ""
        raise FileNotFoundError(f"{flag} {value}: no such file or directory (a relative path is read from the "
                                f"current directory, {os.getcwd()}){hint}")


def repo_config_hint(name: str) -> str:
    """For a Hub id that could not be loaded (offline): the clone's config of the same architecture, if any."""
    local = os.path.join(_REPO, "configs", "models", f"{name.rsplit('/', 1)[-1]}.json")
    if os.path.exists(name) or not os.path.isfile(local):
        return ""
    return f" (offline, --config_name {local} builds a randomly initialised {name} without the Hub)"


def parse_args(argv: Optional[List[str]] = None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, ZeroOffloadSeq2SeqTrainingArguments))

    def one_line(message: str):
        # argparse printed its 140-line usage before a bad or missing value's message; one line, as for the rest
        raise ValueError(f"{message} (all flags: --help)")

    parser.error = one_line
    argv = list(sys.argv[1:] if argv is None else argv)
    _refuse_deepspeed_without_package(argv)
    _refuse_legacy_sharded_ddp(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):  # the legacy spellings are mapped here too
        return parser.parse_dict(su.rewrite_legacy_keys(_read_args_json(argv[0])))
    *parsed, unknown = parser.parse_args_into_dataclasses(args=su.rewrite_legacy_argv(argv),
                                                          return_remaining_strings=True)
    if unknown:
        flags = [f for a in parser._actions for f in a.option_strings]
        hints = [f"{u} ({su.REMOVED_FLAGS[u.split('=')[0]]})" if u.split("=")[0] in su.REMOVED_FLAGS
                 else f"{u} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(u.split("=")[0], flags, n=1))
                 else u for u in unknown if u.startswith("-") and not _is_number(u)]
        raise ValueError(f"unknown arguments: {', '.join(hints or unknown)} (all flags: --help)")
    return tuple(parsed)


def _is_number(s: str) -> bool:  # the value of a misspelled flag, "-1", is no flag of its own
    try:
        float(s)
        return True
    except ValueError:
        return False


def check_zero_config(training_args, config) -> None:
    """Resolve --zero_offload against the arguments now, with the model config's hidden size, so that a bad key or
    a value contradicting the command line stops the run before the tokenizer, the model and the memory plan.
    The Trainer resolves it again once it knows the number of training steps; only that number is provisional
    here (and only when the config leaves total_num_steps to "auto": any value resolves the same way)."""
    if training_args.zero_offload is None:
        if training_args.sharded_ddp:  # ZeRO-2 without offload: the arguments the engine cannot honour, now too
            check_arguments(training_args)
        return
    checked = checked_config(training_args)  # a path, a shipped config's name, or JSON text (named so)
    # the Trainer's precision (--bf16_full_eval is bf16 too): "enabled": true was refused here and the Trainer took it
    cfg = resolve(checked, early_view(training_args, checked.cfg, *training_precision(training_args),
                                      types.SimpleNamespace(config=config) if config is not None else None))
    check_arguments(training_args, cfg.scheduler.type if cfg.scheduler is not None else None)


LEGACY_CONFIG_FLAGS = ("dropout", "attention_dropout", "encoder_layerdrop", "decoder_layerdrop")


def check_values(model_args, data_args, training_args, config) -> None:
    """Values the parser takes but the run cannot use, refused by name before any model work (they failed after
    training, at generation or at the test split); then the legacy flags mapped: --label_smoothing, --eval_beams,
    and the four that set the model config."""
    if training_args.zero_offload is not None or training_args.sharded_ddp:
        ops.simd_level()  # a bad HF_ZERO_OFFLOAD_SIMD, named now rather than at the engine's first kernel call
    problems = []
    for flag, beams in (("--eval_beams", data_args.eval_beams), ("--generation_num_beams",
                                                                 training_args.generation_num_beams)):
        if beams is not None and beams < 1:
            problems.append(f"{flag} {beams}: generation needs at least 1 beam")
    for split in ("train", "val", "test"):
        n = getattr(data_args, f"n_{split}")
        if n == 0 or n < -1:
            problems.append(f"--n_{split} {n}: the number of {split} examples to use, > 0 (-1: all)")
    lengths = {n: getattr(data_args, n) for n in ("max_source_length", "max_target_length", "val_max_target_length",
                                                   "test_max_target_length")}
    if training_args.generation_max_length != data_args.val_max_target_length:  # (unset, main took that one)
        lengths["generation_max_length"] = training_args.generation_max_length
    for name, n in lengths.items():
        if n is not None and n < 1:  # a length of 0 tokenized every example to nothing, found deep in the model
            problems.append(f"--{name} {n}: a length in tokens, >= 1")
    problems += _run_problems(data_args, training_args, config)
    if (training_args.do_eval or training_args.do_predict) and not training_args.do_train \
            and model_args.model_name_or_path is None:  # (it wrote a new tokenizer over a trained run's, too)
        problems.append("--do_eval/--do_predict without --do_train and without --model_name_or_path would score a "
                        "randomly initialised model (built from --config_name): give the trained model's folder (a "
                        "run's --output_dir) as --model_name_or_path")
    vocab = model_args.tokenizer_vocab_size
    if vocab is not None and vocab < 8:  # (train_tokenizer's floor without sentinels; it said "vocab_size 5")
        problems.append(f"--tokenizer_vocab_size {vocab}: a tokenizer needs 8 pieces at least")
    if training_args.gradient_accumulation_steps < 1:  # (the plain Trainer divides by it: ZeroDivisionError)
        problems.append(f"--gradient_accumulation_steps {training_args.gradient_accumulation_steps}: the micro-batches "
                        "of one optimizer step, >= 1")
    beams = training_args.generation_num_beams
    if data_args.eval_beams is not None and beams is not None and beams != data_args.eval_beams:
        problems.append(f"--eval_beams {data_args.eval_beams} and --generation_num_beams {beams}: the first is the "
                        "legacy spelling of the second; give one")
    given = training_args.label_smoothing_factor
    for flag, eps in (("--label_smoothing", data_args.label_smoothing), ("--label_smoothing_factor", given)):
        if eps is not None and not 0.0 <= eps < 1.0:  # (1.5 or -0.1 trained on, transformers takes any float)
            problems.append(f"{flag} {eps}: the share of the target's probability spread over the vocabulary, in "
                            "[0, 1)")
    if data_args.label_smoothing is not None and given not in (0.0, data_args.label_smoothing):
        problems.append(f"--label_smoothing {data_args.label_smoothing} and --label_smoothing_factor {given}: the "
                        "first is the legacy spelling of the second; give one")
    for name in LEGACY_CONFIG_FLAGS:
        value = getattr(model_args, name)
        if value is None:
            continue
        if not 0.0 <= value < 1.0:
            problems.append(f"--{name} {value}: a probability in [0, 1)")
        elif not hasattr(config, name):  # as v4.2 refused it (an assert), by name
            hint = " (T5's is dropout_rate: set it in the config file)" if hasattr(config, "dropout_rate") else ""
            problems.append(f"--{name}: {type(config).__name__} has no {name}{hint}")
    if problems:
        raise ValueError("; ".join(problems))
    if data_args.label_smoothing is not None:
        training_args.label_smoothing_factor = data_args.label_smoothing
    if training_args.generation_num_beams is None and data_args.eval_beams is not None:
        training_args.generation_num_beams = data_args.eval_beams
    for name in LEGACY_CONFIG_FLAGS:
        if getattr(model_args, name) is not None:
            setattr(config, name, getattr(model_args, name))


def _task_problem(task: str, config) -> Optional[str]:
    """A misspelt --task trained without T5's prefix, silently: any summarization or translation_<src>_to_<tgt>
    name is taken, and any key of the config's task_specific_params."""
    known = getattr(config, "task_specific_params", None) if config is not None else None
    known = known if isinstance(known, dict) else {}
    if task in known or re.fullmatch(r"summarization(_\S+)?|translation(_\S+_to_\S+)?", task):
        return None
    close = difflib.get_close_matches(task, [*su.T5_TASK_PREFIXES, *known], n=1)
    return (f"--task {task}: summarization, translation_<src>_to_<tgt> (e.g. translation_en_to_ro) or a key of the "
            "config's task_specific_params" + (f"; did you mean {close[0]}?" if close else ""))


def _metric_problem(metric: Optional[str], generate: bool) -> Optional[str]:
    """--metric_for_best_model names what this script's evaluations report (a KeyError 'eval_bleu' after training
    when no evaluation computed BLEU)."""
    reported = ("loss", "runtime", "samples_per_second", "steps_per_second") + (("bleu", "gen_len") if generate else ())
    if metric is None or metric.removeprefix("eval_") in reported:
        return None
    return (f"--metric_for_best_model {metric}: this script's evaluations report loss"
            + (", bleu and gen_len" if generate else " (bleu and gen_len need --predict_with_generate)")
            + " (and the Trainer's runtime, samples_per_second, steps_per_second)")


def _generation_problems(data_args, args) -> List[str]:
    """With --predict_with_generate: the evaluation flags that break scoring the split's generations at once (each
    failed at the first evaluation, after any training, or scored other examples), and generation lengths of 1 (the
    decoder's start token takes it)."""
    if not args.predict_with_generate:
        return []
    problems = []
    for flag, off in (("--dataloader_in_order false", getattr(args, "dataloader_in_order", True) is False),
                      ("--eval_do_concat_batches false", getattr(args, "eval_do_concat_batches", True) is False),
                      ("--batch_eval_metrics", getattr(args, "batch_eval_metrics", False))):
        if off:
            problems.append(f"{flag} with --predict_with_generate: the script scores the split's generations at once, "
                            "against its texts by position; drop it")
    # (main set an unset --generation_max_length to --val_max_target_length: named as that one then)
    val = "generation_max_length" if args.generation_max_length != data_args.val_max_target_length else \
        "val_max_target_length"
    for name, value, used in ((val, args.generation_max_length, args.do_eval or args.eval_strategy != "no"),
                              ("test_max_target_length", data_args.test_max_target_length, args.do_predict)):
        if used and value == 1:
            problems.append(f"--{name} 1: generation needs 2 tokens at least (the decoder's start token takes one)")
    return problems


def _run_problems(data_args, training_args, config) -> List[str]:
    """What the run was asked to do that it cannot: the task, the best-model metric, generation, a resume without
    training (it evaluated a fresh model)."""
    problems = [p for p in (_task_problem(data_args.task, config),
                            _metric_problem(training_args.metric_for_best_model, training_args.predict_with_generate))
                if p]
    problems += _generation_problems(data_args, training_args)
    if training_args.sortish_sampler and training_args.train_sampling_strategy != "random":  # (sortish won, silently)
        problems.append(f"--sortish_sampler and --train_sampling_strategy {training_args.train_sampling_strategy}: "
                        "both choose the training order (the first: length-grouped mega-batches, the legacy "
                        "sampler); give one")
    if training_args.resume_from_checkpoint and not training_args.do_train:
        problems.append(f"--resume_from_checkpoint {training_args.resume_from_checkpoint} without --do_train: it "
                        "resumes training; to evaluate a checkpoint, give it as --model_name_or_path")
    return problems


def check_resume_target(training_args) -> Optional[str]:
    """--resume_from_checkpoint names a complete checkpoint (or true/last with one in output_dir): checked before the
    tokenizer, the model and the memory plan, as the Trainer's train() will check it again. Returns the checkpoint
    the run resumes from (None: no resume)."""
    if training_args.do_train and training_args.resume_from_checkpoint:
        return resume.target(training_args.resume_from_checkpoint, training_args.output_dir)[0]
    return None
