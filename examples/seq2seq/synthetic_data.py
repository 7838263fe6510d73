#!/usr/bin/env python
"""SYNTHETIC parallel corpus for offline demos and tests (NOT real English-Romanian data).

Writes ``train|val|test.source/.target`` in the legacy ``--data_dir`` layout of ``finetune_trainer.py``
(line-aligned, one sentence per line). The "translation" is a made-up, fully deterministic toy language
that only *looks* Romanian, chosen so that a tiny randomly initialised T5 learns it in a few CPU minutes
and loss and BLEU visibly move:

* every English word maps to one fixed made-up word (the lexicon does not depend on ``--seed``);
* the definite article ``the`` becomes a suffix glued to its noun (``the house`` -> ``casul`` style);
* ``a`` becomes the separate word ``un``;
* adjectives move after their noun (``a red house`` -> ``un <house> <red>``);
* ``and`` becomes ``si`` and the sentence-final ``.`` is kept.

``--seed`` only changes which sentences are sampled; the same seed always writes byte-identical files.
Nothing here is a benchmark of translation quality: use ``--data_dir /path/to/wmt_en_ro`` for real data.

Usage::

    python examples/seq2seq/synthetic_data.py OUT_DIR --n_train 2000 --n_val 200 --n_test 200 --seed 0
"""
from __future__ import annotations

import os
import random
import sys
from typing import Dict, List, Sequence, Tuple

__all__ = ["LEXICON", "translate", "make_pair", "make_corpus", "write_corpus", "main"]

# A small English vocabulary, by part of speech.
NOUNS = (
    "house cat dog child teacher river city garden book window friend doctor road tree market "
    "farmer bird letter table mountain village student mother father king boat school door song "
    "apple car"
).split()
ADJECTIVES = "red small old green happy quiet big new cold dark young bright tall slow".split()
VERBS = "sees likes finds builds paints follows visits opens reads helps carries watches".split()
ADVERBS = "today slowly often again quickly tomorrow".split()
FUNCTION_WORDS = ("the", "a", "and", ".")

# Syllables for the made-up target words (ASCII plus a few Romanian letters, so the text looks the part).
_ONSETS = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ș", "ț", "br", "cr", "st", "tr")
_NUCLEI = ("a", "e", "i", "o", "u", "ă", "â", "ea", "ie", "oa")


def _build_lexicon() -> Dict[str, str]:
    rng = random.Random(20210119)  # fixed: the toy language never changes with --seed
    used = {"un", "si", "ul"}
    lex: Dict[str, str] = {}
    for word in NOUNS + ADJECTIVES + VERBS + ADVERBS:
        while True:
            n_syl = rng.choice((2, 2, 3))
            cand = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(n_syl))
            if word in VERBS:
                cand += "ește"
            if cand not in used:
                break
        used.add(cand)
        lex[word] = cand
    return lex


LEXICON: Dict[str, str] = _build_lexicon()


def _noun_phrase(rng: random.Random) -> List[str]:
    words = [rng.choice(("the", "the", "a"))]
    if rng.random() < 0.5:
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    return words


def _clause(rng: random.Random) -> List[str]:
    words = _noun_phrase(rng) + [rng.choice(VERBS)] + _noun_phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(ADVERBS))
    return words


def _sentence(rng: random.Random) -> List[str]:
    words = _clause(rng)
    if rng.random() < 0.3:
        words += ["and"] + _clause(rng)
    return words + ["."]


def translate(words: Sequence[str]) -> List[str]:
    """Apply the toy grammar to a tokenised English sentence produced by this module."""
    out: List[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("the", "a"):
            adjs: List[str] = []
            j = i + 1
            while words[j] in ADJECTIVES:
                adjs.append(words[j])
                j += 1
            noun = LEXICON[words[j]]
            out.append(noun + "ul" if w == "the" else noun)
            if w == "a":
                out.insert(len(out) - 1, "un")
            out += [LEXICON[a] for a in adjs]
            i = j + 1
        elif w == "and":
            out.append("si")
            i += 1
        elif w == ".":
            out.append(".")
            i += 1
        else:
            out.append(LEXICON[w])
            i += 1
    return out


def _detok(words: Sequence[str]) -> str:
    return " ".join(words).replace(" .", ".")  # lower case throughout: one spelling per word


def make_pair(rng: random.Random) -> Tuple[str, str]:
    words = _sentence(rng)
    return _detok(words), _detok(translate(words))


def make_corpus(n_train: int = 2000, n_val: int = 200, n_test: int = 200, seed: int = 0) -> Dict[str, List[Tuple[str, str]]]:
    """Return ``{"train"|"val"|"test": [(source, target), ...]}``; deterministic in ``seed``."""
    rng = random.Random(seed)
    return {split: [make_pair(rng) for _ in range(n)] for split, n in (("train", n_train), ("val", n_val), ("test", n_test))}


def write_corpus(out_dir: str, n_train: int = 2000, n_val: int = 200, n_test: int = 200, seed: int = 0) -> str:
    """Write the legacy layout under ``out_dir`` and return it."""
    os.makedirs(out_dir, exist_ok=True)
    for split, pairs in make_corpus(n_train, n_val, n_test, seed).items():
        for ext, col in (("source", 0), ("target", 1)):
            path = os.path.join(out_dir, f"{split}.{ext}")
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                for pair in pairs:
                    f.write(pair[col] + "\n")
            os.replace(tmp, path)
    return out_dir


def main(argv=None) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from example_cli import OneLineParser  # (a mistake is one line, the nearest flag named)

    p = OneLineParser(description="Write a SYNTHETIC toy en->ro-looking parallel corpus (legacy data_dir layout).")
    p.add_argument("out_dir")
    p.add_argument("--n_train", type=int, default=2000)
    p.add_argument("--n_val", type=int, default=200)
    p.add_argument("--n_test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = write_corpus(a.out_dir, a.n_train, a.n_val, a.n_test, a.seed)
    print(f"wrote synthetic corpus to {out} (train {a.n_train}, val {a.n_val}, test {a.n_test}, seed {a.seed})")
    return out


if __name__ == "__main__":
    main()
