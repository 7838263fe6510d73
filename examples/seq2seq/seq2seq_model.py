"""``finetune_trainer.py``'s tokenizer and model: the tokenizer a run uses (a resumed checkpoint's, one trained on
the training text here, or the one named), checked against the checkpoint it resumes, and the model (pretrained
weights, or random initialisation from a config), each mistake one line naming the flag."""
import json
import logging
import os
from typing import Callable, Optional

from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from hf_zero_offload.run_lock import RunLock, take_job_lock
from hf_zero_offload.trainer.mean_loss import mean_loss_only  # noqa: F401 - (the script's sm.mean_loss_only)
from train_tokenizer import train_t5_tokenizer

logger = logging.getLogger("finetune_trainer")


def _round_up(n: int, multiple: int = 8) -> int:
    return (n + multiple - 1) // multiple * multiple


def _load_tokenizer(flag: str, name: str, **kwargs):
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, ImportError, TypeError) as e:  # an empty folder said "install sentencepiece"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag} {name}: no tokenizer loads from it ({first}); name a tokenizer's folder (its "
                         "tokenizer.json or spiece.model with tokenizer_config.json) or a Hub id") from e


def _check_resumed_tokenizer(tokenizer, resumed_from: str, flag: str, name: str) -> None:
    """A resume with another tokenizer gave the learned embedding rows other ids without a word, and its checkpoints
    saved that tokenizer for every later resume."""
    if not any(os.path.isfile(os.path.join(resumed_from, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    saved = AutoTokenizer.from_pretrained(resumed_from)
    if saved.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{flag} {name}: its vocabulary is not the one saved in {resumed_from} ({len(tokenizer)} "
                         f"against {len(saved)} ids), which the resumed model was trained with: resume without "
                         f"{flag}, or start a new run")


def make_tokenizer(model_args, training_args, config, texts: dict, prefix: str, resumed_from: Optional[str],
                   check: Callable = lambda tokenizer: None):
    """The run's tokenizer. With neither --tokenizer_name nor --model_name_or_path: the one a resumed checkpoint
    saved, else a SentencePiece tokenizer trained on the training text (saved in output_dir). ``check``: refuses a
    tokenizer the run cannot use, before one trained here is written into output_dir."""
    if model_args.tokenizer_name or model_args.model_name_or_path:
        if model_args.tokenizer_vocab_size:
            raise ValueError(f"--tokenizer_vocab_size {model_args.tokenizer_vocab_size}: the size of a tokenizer "
                             "trained here, which --tokenizer_name/--model_name_or_path replace; drop one")
        flag, name = (("--tokenizer_name", model_args.tokenizer_name) if model_args.tokenizer_name else
                      ("--model_name_or_path", model_args.model_name_or_path))
        tokenizer = _load_tokenizer(flag, name, cache_dir=model_args.cache_dir)
        if resumed_from:
            _check_resumed_tokenizer(tokenizer, resumed_from, flag, name)
        check(tokenizer)
        return tokenizer
    if resumed_from and os.path.isfile(os.path.join(resumed_from, "tokenizer.json")):
        # The tokenizer the resumed model was trained with (every checkpoint saves it): one trained again on this
        # run's text (another --n_train, other data) gave other ids to the embedding rows the model had learned.
        tokenizer = AutoTokenizer.from_pretrained(resumed_from)
        logger.info("tokenizer: %d ids, the one saved in %s (a resume does not train a new one)", len(tokenizer),
                    resumed_from)
        if model_args.tokenizer_vocab_size:
            logger.warning("--tokenizer_vocab_size %d is not used at a resume: the checkpoint's tokenizer (%d ids) "
                           "is, which the resumed model was trained with", model_args.tokenizer_vocab_size,
                           len(tokenizer))
        check(tokenizer)
        return tokenizer
    if training_args.output_dir:
        # The tokenizer is written into output_dir before the Trainer exists, and the Trainer takes the run lock:
        # a second run on a live output_dir overwrote the first run's tokenizer files, then was refused. The lock
        # first (the Trainer's is the same, re-entered; a job's rank 0 takes it and tells the other ranks).
        take_job_lock(RunLock(training_args.output_dir), training_args.process_index, training_args.world_size)
    if resumed_from:
        logger.warning("%s holds no tokenizer.json: a tokenizer is trained on this run's training text, and its "
                       "ids match the resumed model's only if that text is the first run's", resumed_from)
    vocab_size = model_args.tokenizer_vocab_size or config.vocab_size
    src, tgt = texts["train"]
    logger.info("training a SentencePiece unigram tokenizer (vocab <= %d) on %d training pairs", vocab_size, len(src))
    # Rank 0 trains and saves; the other ranks then load its files (one tokenizer for all ranks), on every node:
    # main_process_first's default (local=True) let node 1 load before rank 0 had written (an older run's
    # tokenizer, or none). With save_on_each_node (no shared file system) each node's first process trains.
    local = training_args.save_on_each_node
    with training_args.main_process_first(local=local, desc="tokenizer training"):
        if (training_args.local_process_index if local else training_args.process_index) == 0:
            try:
                tokenizer = train_t5_tokenizer([prefix + s for s in src] + list(tgt), vocab_size,
                                               save_dir=training_args.output_dir, check=check)
            except ValueError as e:
                if not str(e).startswith(f"vocab_size {vocab_size} "):
                    raise
                flag = ("--tokenizer_vocab_size" if model_args.tokenizer_vocab_size else
                        f"the config's vocab_size ({model_args.config_name})")
                raise ValueError(f"{flag}: {e}") from None
        else:
            tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
            check(tokenizer)
    logger.info("tokenizer: %d ids (saved in %s)", len(tokenizer), training_args.output_dir)
    return tokenizer


def make_model(model_args, config, tokenizer, resumed_from: Optional[str]):
    """Pretrained weights (--model_name_or_path, with --config_name's config if given), or a randomly initialised
    model of --config_name's architecture, its vocabulary sized to the tokenizer (at a resume: the checkpoint's)."""
    if model_args.model_name_or_path:
        try:
            model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, config=config,
                                                          cache_dir=model_args.cache_dir)
        except RuntimeError as e:  # transformers' table of mismatched sizes, then "ignore_mismatched_sizes"
            if "mismatch" not in str(e) or not model_args.config_name:
                raise
            raise ValueError(f"--model_name_or_path {model_args.model_name_or_path} and --config_name "
                             f"{model_args.config_name}: the weights do not fit that config (other sizes); drop "
                             "--config_name to fine-tune the model's own architecture") from e
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
        return model
    saved = os.path.join(resumed_from, "config.json") if resumed_from else None
    if saved and os.path.isfile(saved):
        # the vocabulary the resumed model was built with (--tokenizer_vocab_size of the first run, not repeated:
        # the checkpoint's weights then did not fit, a size-mismatch traceback from the Trainer's load)
        config.vocab_size = AutoConfig.from_pretrained(resumed_from).vocab_size
    elif len(tokenizer) > config.vocab_size or model_args.tokenizer_vocab_size:
        config.vocab_size = _round_up(len(tokenizer))
    model = AutoModelForSeq2SeqLM.from_config(config)
    logger.info("randomly initialised %s from %s", type(model).__name__, model_args.config_name)
    if resumed_from:
        check_resumed_shapes(model, resumed_from)
    return model


def check_resumed_shapes(model, resumed_from: str) -> None:
    """The checkpoint's weights against the model built here (another --config_name than the first run's failed
    in the Trainer's load with a size-mismatch traceback): one line naming the first that differs. Read from the
    safetensors headers (one file, or the shards an index lists); a checkpoint of .bin files is left to the Trainer."""
    index = os.path.join(resumed_from, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        files = ["model.safetensors"] if os.path.isfile(os.path.join(resumed_from, "model.safetensors")) else []
    from safetensors import safe_open

    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    for file in files:
        with safe_open(os.path.join(resumed_from, file), framework="pt") as f:
            for name in f.keys():
                saved = tuple(f.get_slice(name).get_shape())
                if name in shapes and shapes[name] != saved:
                    raise ValueError(f"--resume_from_checkpoint {resumed_from}: its {name} is {saved}, the model "
                                     f"built from --config_name {shapes[name]}: give the config of the run that saved "
                                     "it")
