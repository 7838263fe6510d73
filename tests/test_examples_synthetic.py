"""examples/seq2seq/synthetic_data.py: the toy en->ro corpus that the demo, the examples' tests and CI train on (its
files and their determinism, the translation rules, the command line)."""
import os
import subprocess
import sys

from _examples import EX
import synthetic_data  # noqa: E402  (on sys.path through _examples)


def _read(d, name):
    with open(os.path.join(d, name), encoding="utf-8") as f:
        return f.read()


def test_synthetic_data_layout_and_determinism(tmp_path):
    a = synthetic_data.write_corpus(str(tmp_path / "a"), n_train=30, n_val=5, n_test=7, seed=3)
    b = synthetic_data.write_corpus(str(tmp_path / "b"), n_train=30, n_val=5, n_test=7, seed=3)
    c = synthetic_data.write_corpus(str(tmp_path / "c"), n_train=30, n_val=5, n_test=7, seed=4)
    for split, n in (("train", 30), ("val", 5), ("test", 7)):
        for ext in ("source", "target"):
            name = f"{split}.{ext}"
            text = _read(a, name)
            assert text == _read(b, name), "same seed must give byte-identical files"
            lines = text.split("\n")
            assert lines[-1] == "" and len(lines) == n + 1 and all(lines[:-1])
    assert _read(a, "train.source") != _read(c, "train.source")
    assert sorted(os.listdir(a)) == sorted(f"{s}.{e}" for s in ("train", "val", "test") for e in ("source", "target"))


def test_synthetic_translation_rules():
    lex = synthetic_data.LEXICON
    assert len(set(lex.values())) == len(lex), "the toy lexicon must be one-to-one"
    out = synthetic_data.translate("the red house sees a small cat .".split())
    assert out == [lex["house"] + "ul", lex["red"], lex["sees"], "un", lex["cat"], lex["small"], "."]
    # the lexicon does not depend on the seed: the same English sentence always has the same translation
    corpus = synthetic_data.make_corpus(50, 0, 0, seed=1)["train"] + synthetic_data.make_corpus(50, 0, 0, seed=2)["train"]
    seen = {}
    for src, tgt in corpus:
        assert seen.setdefault(src, tgt) == tgt


def test_synthetic_cli(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, os.path.join(EX, "synthetic_data.py"), str(out), "--n_train", "5",
                        "--n_val", "2", "--n_test", "2", "--seed", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "synthetic" in r.stdout
    assert _read(str(out), "train.source") == "".join(s + "\n" for s, _ in synthetic_data.make_corpus(5, 2, 2, 0)["train"])
