"""Train a T5-style SentencePiece unigram tokenizer on the training text (offline random-init runs).

The result follows T5's layout: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, the SentencePiece pieces, then
``extra_ids`` sentinels ``<extra_id_99> ... <extra_id_0>`` at the top of the vocabulary. It is returned as a
``transformers.T5Tokenizer`` (in transformers 5.x the tokenizers-backed class; it is built with
``T5Tokenizer.from_pretrained(dir_with_spiece.model)``, which converts the SentencePiece model; note that
``T5Tokenizer(vocab_file=...)`` ignores the file in 5.x) and, once saved with ``save_pretrained``, reloads with
``AutoTokenizer.from_pretrained``.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from typing import Callable, Iterable, Optional

__all__ = ["train_t5_tokenizer", "choose_extra_ids"]

# Below this many SentencePiece pieces we drop the 100 sentinels: they would crowd out real pieces.
_MIN_PIECES_FOR_SENTINELS = 256


def choose_extra_ids(vocab_size: int, extra_ids: int = 100) -> int:
    """T5's 100 sentinels when ``vocab_size`` leaves room for them, else none."""
    return extra_ids if vocab_size - extra_ids >= _MIN_PIECES_FOR_SENTINELS else 0


def train_t5_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    save_dir: Optional[str] = None,
    extra_ids: Optional[int] = None,
    seed_sentencepiece_size: int = 1_000_000,
    input_sentence_size: int = 2_000_000,
    num_threads: Optional[int] = None,
    check: Optional[Callable] = None,
):
    """Train on ``texts`` and return a ``T5Tokenizer`` with at most ``vocab_size`` ids in total.

    ``vocab_size`` counts the sentinels: SentencePiece is asked for ``vocab_size - extra_ids`` pieces, as a soft
    limit (a small corpus yields fewer). ``extra_ids=None`` picks 100 or 0 with :func:`choose_extra_ids`.
    When ``save_dir`` is given the tokenizer is saved there (``tokenizer.json``, ``tokenizer_config.json``, and the
    raw SentencePiece ``spiece.model``), once ``check(tokenizer)`` (when given) has not raised.
    """
    import sentencepiece as spm
    from transformers import T5Tokenizer

    if extra_ids is None:
        extra_ids = choose_extra_ids(vocab_size)
    n_pieces = vocab_size - extra_ids
    if n_pieces < 8:
        raise ValueError(f"vocab_size {vocab_size} is too small for a tokenizer (extra_ids={extra_ids})")
    with tempfile.TemporaryDirectory(prefix="hzo_spm_") as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        n_lines, longest = 0, 0
        rng = random.Random(0)
        with open(corpus, "w", encoding="utf-8") as f:
            for line in texts:
                words = line.split()
                if words:
                    # Shuffle the words of each line. Pieces never cross whitespace, so the unigram model's
                    # objective is unchanged, but SentencePiece seeds its candidates from repeated substrings
                    # whose left context varies: a word always at the same place (the task prefix, the fixed word
                    # order of a low-diversity corpus) is otherwise never a candidate and ends up split into
                    # characters ("translate" -> "tra ns la te"). Measured: synthetic corpus 28 -> 16 tokens a line.
                    rng.shuffle(words)
                    f.write(" ".join(words) + "\n")
                    n_lines += 1
                    longest = max(longest, len(line.encode("utf-8")))
        if n_lines == 0:
            raise ValueError("no training text for the tokenizer")
        try:
            spm.SentencePieceTrainer.train(
                input=corpus,
                model_prefix=os.path.join(tmp, "spiece"),
                model_type="unigram",
                vocab_size=n_pieces,
                hard_vocab_limit=False,  # a small corpus gives fewer pieces instead of an error
                pad_id=0,
                eos_id=1,
                unk_id=2,
                bos_id=-1,
                pad_piece="<pad>",
                eos_piece="</s>",
                unk_piece="<unk>",
                character_coverage=1.0,
                # its default (4192 bytes) left longer lines (summarization documents) out of training, silently
                max_sentence_length=max(4192, longest + 1),
                seed_sentencepiece_size=seed_sentencepiece_size,
                input_sentence_size=input_sentence_size,
                shuffle_input_sentence=True,
                num_threads=num_threads or max(1, os.cpu_count() or 1),
                minloglevel=2,
            )
        except RuntimeError as e:  # (SentencePiece's "Vocabulary size is smaller than required_chars. 20 vs 36.")
            need = re.search(r"required_chars\. \d+ vs (\d+)", str(e))
            if not need:
                raise
            raise ValueError(f"vocab_size {vocab_size} is too small for this text, which has {need.group(1)} "
                             f"distinct characters: {int(need.group(1)) + 3 + extra_ids} ids at least (with <pad>, "
                             f"</s>, <unk> and {extra_ids} sentinels)") from None
        os.replace(os.path.join(tmp, "spiece.model"), os.path.join(tmp, "model_dir_spiece.model"))
        model_dir = os.path.join(tmp, "tok")
        os.makedirs(model_dir)
        os.replace(os.path.join(tmp, "model_dir_spiece.model"), os.path.join(model_dir, "spiece.model"))
        tokenizer = T5Tokenizer.from_pretrained(model_dir, extra_ids=extra_ids)
        # Detach from the temporary directory before it disappears.
        if getattr(tokenizer, "vocab_file", None):
            tokenizer.vocab_file = None
        if check is not None:
            check(tokenizer)
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
            tokenizer.save_pretrained(save_dir)
            shutil.copy(os.path.join(model_dir, "spiece.model"), os.path.join(save_dir, "spiece.model"))
    return tokenizer
