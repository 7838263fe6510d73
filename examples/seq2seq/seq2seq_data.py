"""The example's data: the legacy ``--data_dir`` layout (line-aligned ``{split}.source`` / ``{split}.target``) or a
``datasets`` split, the checks on its texts and on the room the lengths leave, the dataset the Trainer reads, and BLEU
scored against the split's own target texts."""
from __future__ import annotations

import os
import unicodedata
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from torch.utils.data import Dataset

from hf_zero_offload.usage import not_utf8_text, relative_path_hint



def read_lines(path: str) -> List[str]:
    """The lines of a UTF-8 text file (a byte-order mark, which Windows editors write, dropped), ended by "\n" alone
    (a "\r\n" ending loses its "\r"), as ``wc -l`` counts them: Python's universal newlines also ended a line at a
    lone "\r" inside it, which shifted every later pair of a split against the other side without a word; such a
    "\r" is refused naming the file and line (a file of "\r" endings would be one line). Not UTF-8
    (a file saved as Latin-1, or cut inside a character): refused naming the file, the line and the byte, where
    Python's own error named neither file nor line."""
    try:
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            lines = [line.rstrip("\n").removesuffix("\r") for line in f]
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            data = f.read()
        raise ValueError(not_utf8_text(path, data, "--data_dir files are line-aligned text saved as UTF-8")) from None
    stray = next((i for i, line in enumerate(lines, 1) if "\r" in line), None)
    if stray is not None:  # (a file of classic-Mac "\r" endings read as one line: one huge example)
        raise ValueError(f"{path}: line {stray} holds a carriage return (\\r) that ends no line: lines end at \\n "
                         "(or \\r\\n) here, as wc -l counts them; convert the file (tr '\\r' '\\n' < old > new for "
                         "\\r line endings) or remove the stray \\r")
    return lines


def check_data_dir(data_dir: str) -> None:
    if not os.path.isdir(data_dir):
        # the blog's `--data_dir wmt_en_ro` is relative to where it runs (examples/seq2seq/ in the blog): say where
        raise NotADirectoryError(f"--data_dir {data_dir}: {'a file' if os.path.exists(data_dir) else 'not found'}"
                                 f"{relative_path_hint(data_dir)}; it names the folder holding "
                                 "train|val|test.source/.target")


def read_split(data_dir: str, split: str, n_obs: int = -1) -> Tuple[List[str], List[str]]:
    check_data_dir(data_dir)
    src_path = os.path.join(data_dir, f"{split}.source")
    tgt_path = os.path.join(data_dir, f"{split}.target")
    for path in (src_path, tgt_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: --data_dir must hold train|val|test.source/.target")
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(f"{split}: {len(src)} source lines but {len(tgt)} target lines in {data_dir}")
    if n_obs is not None and n_obs >= 0:
        src, tgt = src[:n_obs], tgt[:n_obs]
    if not src:
        raise ValueError(f"{src_path} and {tgt_path} hold no lines: the {split} split needs at least one pair")
    check_texts(src_path, src, "line", 1)
    check_texts(tgt_path, tgt, "line", 1)
    return src, tgt


def _visible(text: str) -> bool:
    """Any character but white space, format and control ones (a zero-width space, a BOM, DOS's end-of-file byte: a
    line of those passed for text, tokenized to </s> alone; what a tokenizer cannot spell: check_tokenized_texts)."""
    return any(not c.isspace() and unicodedata.category(c) not in ("Cf", "Cc") for c in text)


def check_texts(where: str, texts: list, unit: str, first: int) -> None:
    """Every text of a split's side is a string with something in it: as v4.2's dataset refused them ("empty tgt
    line for index N"); a blank line trained a pair with nothing on one side, without a word."""
    blank = [i + first for i, t in enumerate(texts) if not isinstance(t, str) or not _visible(t)]
    if blank:
        raise ValueError(f"{where}: {len(blank)} blank or missing text(s) among the {len(texts)} used ({unit} "
                         f"{', '.join(map(str, blank[:5]))}{', ...' if len(blank) > 5 else ''}): each is one example, "
                         "aligned with the same one of the other side; remove the pair from both")


def load_hf_dataset_split(dataset_name: str, config_name: Optional[str], split: str, src_lang: Optional[str],
                          tgt_lang: Optional[str], cache_dir: Optional[str], n_obs: int = -1) -> Tuple[List[str], List[str]]:
    """Read one split of a ``datasets`` dataset (translation column, or source/target-like text columns)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "--dataset_name needs the `datasets` package (pip install datasets) and network access to the Hub; "
            "offline, use --data_dir with the legacy train|val|test.source/.target layout instead"
        ) from e
    hf_split = {"val": "validation"}.get(split, split)
    try:
        ds = datasets.load_dataset(dataset_name, config_name, split=hf_split, cache_dir=cache_dir)
    except Exception as e:  # offline, unknown name, missing split
        raise RuntimeError(
            f"could not load {dataset_name!r} ({config_name!r}) split {hf_split!r}: {e}. Offline "
            "(HF_HUB_OFFLINE=1 or no network) only cached datasets load; use --data_dir for local files"
        ) from e
    if n_obs is not None and n_obs >= 0:
        ds = ds.select(range(min(n_obs, len(ds))))
    cols = ds.column_names
    if "translation" in cols:
        if not (src_lang and tgt_lang):
            raise ValueError("a translation dataset needs --src_lang and --tgt_lang (e.g. en and ro)")
        s, t = src_lang.split("_")[0], tgt_lang.split("_")[0]
        pairs = ds["translation"]
        texts = [(f"translation[{lang!r}]", [p.get(lang) for p in pairs]) for lang in (s, t)]
    else:
        found = [(a, b) for a, b in (("source", "target"), ("document", "summary"), ("article", "highlights"),
                                     ("text", "summary")) if a in cols and b in cols]
        if not found:
            raise ValueError(f"do not know which columns of {dataset_name} are source and target: {cols}")
        texts = [(repr(c), list(ds[c])) for c in found[0]]
    for column, values in texts:
        check_texts(f"{dataset_name} split {hf_split!r} column {column}", values, "index", 0)
    return texts[0][1], texts[1][1]


def check_room(tokenizer, prefix: str, lengths: Dict[str, int]) -> None:
    """The task prefix and the tokenizer's special tokens take the first tokens of every source, the special tokens
    those of every target: a max length no longer than they are truncated every text to the same tokens, and the run
    trained on identical inputs, or on targets of </s> alone, without a word (an outside probe: T5's translation
    prefix is 14 tokens here). ``lengths``: the flags this run uses, by name ("max_source_length": ...)."""
    for name, length in lengths.items():
        source = name == "max_source_length"
        taken = len(tokenizer(prefix)["input_ids"] if source else tokenizer(text_target="")["input_ids"])
        if length <= taken:
            what = (f"the task prefix {prefix!r} and the special tokens take {taken}" if source and prefix else
                    f"the special tokens take {taken}")
            side = "source" if source else "target"
            raise ValueError(f"--{name} {length}: {what}, which leaves no token of the {side} text; give a longer "
                             "length")


def check_tokenized_texts(tokenizer, texts: Dict[str, Tuple[List[str], List[str]]], where: str) -> None:
    """A text without a letter or digit that the tokenizer reduces to its special tokens alone (control characters,
    DOS's end-of-file byte, a U+FFFD left by a lossy decoding): an example of nothing on that side, which passed the
    blank-text check and trained without a word (an outside probe). Only such texts are tokenized here (cheap on a
    large split). ``where``: the --data_dir, or the dataset's name."""
    special = set(tokenizer.all_special_ids)
    for split, pair in texts.items():
        for side, items in zip(("source", "target"), pair):
            odd = [i for i, t in enumerate(items) if not any(c.isalnum() for c in t)]
            if not odd:
                continue
            batch = [items[i] for i in odd]
            rows = tokenizer(batch)["input_ids"] if side == "source" else tokenizer(text_target=batch)["input_ids"]
            empty = [odd[k] + 1 for k, row in enumerate(rows) if all(t in special for t in row)]
            if empty:
                raise ValueError(f"{where} {split}.{side}: {len(empty)} text(s) that the tokenizer reduces to its "
                                 f"special tokens alone (line {', '.join(map(str, empty[:5]))}"
                                 f"{', ...' if len(empty) > 5 else ''}: control characters or symbols it cannot "
                                 "spell): each is one example of nothing; remove the pair from both sides")


class Seq2SeqTextDataset(Dataset):
    """Pairs of strings, tokenized one item at a time (cheap with a fast tokenizer, no start-up cost on big splits).

    ``src_lens`` (characters, as the legacy sortish sampler used) feed the length-grouped sampler.
    """

    def __init__(self, tokenizer, sources: List[str], targets: List[str], max_source_length: int,
                 max_target_length: int, prefix: str = ""):
        self.tokenizer = tokenizer
        self.sources = [prefix + s for s in sources]
        self.targets = targets
        self.max_source_length = max_source_length
        self.max_target_length = max_target_length
        self.src_lens = [len(s) for s in self.sources]

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        enc = self.tokenizer(self.sources[i], max_length=self.max_source_length, truncation=True)
        lab = self.tokenizer(text_target=self.targets[i], max_length=self.max_target_length, truncation=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": lab["input_ids"]}


# ----------------------------------------------------------------------------------------------------------------------
# Metrics


def _nfkc(text: str) -> str:
    """Both sides of BLEU in Unicode's NFKC form, which SentencePiece's tokenizers (T5's, and the one trained here)
    normalize their text to: references in decomposed form (NFD) capped a perfect model's BLEU at 49, ligatures and
    ellipses lost their n-grams likewise."""
    return unicodedata.normalize("NFKC", text).strip()


def build_compute_metrics(tokenizer, references: List[str]) -> Callable:
    """sacrebleu corpus BLEU and the mean generated length (non-pad tokens), as the legacy script reported, for the
    generations of the split whose target texts are ``references``. BLEU is scored against those texts, not against
    the labels decoded back (cut to the split's max target length, characters the tokenizer lacks dropped: 4.15
    against 2.44 over the same generations in an outside probe), in the split's order (the script's evaluation
    sampler), both in NFKC form. On several processes the Trainer pads the last batch with repeats of the first
    examples (8 rows for 7): the rows past the split's length are dropped."""
    import sacrebleu

    pad = tokenizer.pad_token_id

    def compute_metrics(eval_pred) -> Dict[str, float]:
        preds = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        preds = np.where(preds != -100, preds, pad)[:len(references)]
        # (fewer rows: --dataloader_drop_last left the last partial batch out, also of evaluation, in order)
        pred_str = [_nfkc(s) for s in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        bleu = sacrebleu.corpus_bleu(pred_str, [[_nfkc(r) for r in references[:len(preds)]]]).score
        gen_len = float(np.mean([(row != pad).sum() for row in preds])) if len(preds) else 0.0
        return {"bleu": round(bleu, 4), "gen_len": round(gen_len, 4)}

    return compute_metrics
