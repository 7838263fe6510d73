"""examples/seq2seq with a new user's own data and flags (an outside probe's cases): lines split as ``wc -l`` counts
them, BLEU against the reference texts of the split, the loss of accumulated micro-batches averaged, and every
flag that could not work refused in one line naming it."""
import json
import os

import numpy as np
import pytest
import torch

from _examples import TINY, write_synth
from _examples import common_args as _common_args

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
sacrebleu = pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402
import seq2seq_model as sm  # noqa: E402
import seq2seq_utils as su  # noqa: E402


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return write_synth(tmp_path_factory)


def test_a_lone_carriage_return_does_not_end_a_line(tmp_path):
    """Python's universal newlines ended a line at a "\\r" inside it: the pairs after it were shifted against the
    other side, and training went on (12 pairs from files of 11 lines)."""
    path = tmp_path / "train.source"
    path.write_bytes(b"one two\rthree\r\nfour\n\xef\xbb\xbffive\n")
    assert su.read_lines(str(path)) == ["one two\rthree", "four", "\ufefffive"]
    (tmp_path / "bom.source").write_bytes(b"\xef\xbb\xbfa\r\nb\r\n")
    assert su.read_lines(str(tmp_path / "bom.source")) == ["a", "b"]


def test_a_data_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("x\n")
    with pytest.raises(NotADirectoryError, match=r"--data_dir \S+f: a file; it names the folder"):
        su.read_split(str(tmp_path / "f"), "train")


class _Tokenizer:
    """Decodes token ids as the words of a tiny vocabulary; 0 is padding, unknown characters are lost."""
    pad_token_id = 0
    words = ["<pad>", "a", "b", "c", "d"]

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(self.words[t] for t in row if t) for row in rows]


def test_bleu_is_scored_against_the_reference_texts_and_padding_rows_are_dropped():
    """The labels decoded back lose what the tokenizer cannot spell and what the max target length cut; several
    processes pad the last batch with repeats of the first examples (8 rows for 7)."""
    refs = ["a b c d Ωmega", "b c d a", "c d a b"]
    preds = np.array([[1, 2, 3, 4], [2, 3, 4, 1], [3, 4, 1, 0], [1, 2, 3, 4]])  # the 4th: a repeat of the 1st
    labels = np.array([[1, 2, 3, 4], [2, 3, 4, 1], [3, 4, 1, 2], [1, 2, 3, 4]])
    out = su.build_compute_metrics(_Tokenizer(), refs)(type("P", (), {"predictions": preds, "label_ids": labels}))
    want = sacrebleu.corpus_bleu(["a b c d", "b c d a", "c d a"], [refs]).score
    assert out["bleu"] == round(want, 4) and out["gen_len"] == round(11 / 3, 4)
    with pytest.raises(ValueError, match="2 generations for the 3 examples"):
        su.build_compute_metrics(_Tokenizer(), refs)(type("P", (), {"predictions": preds[:2], "label_ids": None}))


def test_t5_is_told_to_the_trainer_as_a_mean_loss_model():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_ff=8, num_layers=1, num_heads=1, d_kv=8))
    assert sm.mean_loss_only(t5)

    class SumsItself(torch.nn.Module):
        def forward(self, x, labels=None, **kwargs):
            return self.loss_function(x, labels, **kwargs)

    assert not sm.mean_loss_only(SumsItself()) and not sm.mean_loss_only(torch.nn.Linear(2, 2))


def test_accumulated_micro_batches_give_the_loss_of_one_batch(tmp_path, synth_dir):
    """T5's forward takes **kwargs, so the Trainer took its loss for a sum over num_items_in_batch and did not divide
    by the accumulation steps: train_loss 23.5 against ~7.7 with 3 steps (an outside probe), gradients 3x larger."""
    losses = {}
    for steps, batch in ((1, "8"), (2, "4")):
        out = tmp_path / f"ga{steps}"
        argv = _common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--max_steps", "1",
                                               "--per_device_train_batch_size", batch,
                                               "--gradient_accumulation_steps", str(steps)]
        losses[steps] = finetune_trainer.main(argv)["train_loss"]
    assert abs(losses[2] / losses[1] - 1) < 0.05, losses  # (the same 8 examples; was 2x)


@pytest.mark.parametrize("extra,match", [
    (["--task", "tranlsation_en_to_ro"], r"--task tranlsation_en_to_ro: summarization or translation_<src>_to_<tgt> "
                                         r".*did you mean translation_en_to_ro\?"),
    (["--metric_for_best_model", "bleu"], r"--metric_for_best_model bleu: this script's evaluations report loss "
                                          r"\(bleu and gen_len need --predict_with_generate\)"),
    (["--metric_for_best_model", "rouge2", "--predict_with_generate"], r"report loss, bleu and gen_len"),
    (["--do_eval", "--predict_with_generate", "--val_max_target_length", "1"],
     r"--val_max_target_length 1: generation needs 2 tokens at least"),
    (["--do_eval", "--predict_with_generate", "--generation_max_length", "1"], r"--generation_max_length 1"),
    (["--do_predict", "--predict_with_generate", "--test_max_target_length", "1"], r"--test_max_target_length 1"),
    (["--tokenizer_vocab_size", "5"], r"--tokenizer_vocab_size 5: a tokenizer needs 8 pieces at least"),
])
def test_flags_that_fail_after_training_are_refused_first(tmp_path, synth_dir, extra, match):
    """Each trained, then failed (a KeyError 'eval_bleu'; generation asked for 1 token) or ran without T5's prefix."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", *extra])
    assert not out.exists() or not os.listdir(out)


def test_a_source_length_the_prefix_fills_is_refused(tmp_path, synth_dir):
    with pytest.raises(ValueError, match=r"--max_source_length 3: the task prefix 'translate English to Romanian: ' "
                                         r"and the special tokens take \d+, which leaves no token of the source"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "o") + ["--config_name", TINY, "--do_train",
                                                                         "--max_source_length", "3"])


def _saved_run(synth_dir, out, *extra):
    argv = _common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", "--max_steps", "2", *extra]
    argv[argv.index("--save_strategy") + 1] = "steps"
    finetune_trainer.main(argv + ["--save_steps", "2"])
    return argv


def test_resumes_with_another_tokenizer_or_model_are_one_line_and_the_vocabulary_comes_from_the_checkpoint(
        tmp_path, synth_dir):
    """A resume with another --tokenizer_name trained the learned rows under other ids, silently; one whose first run
    had --tokenizer_vocab_size failed with a size-mismatch traceback unless the flag was repeated; pretrained weights
    beside another --config_name failed with transformers' table of sizes."""
    other = tmp_path / "other"
    _saved_run(synth_dir, other, "--tokenizer_vocab_size", "400")
    out = tmp_path / "out"
    argv = _saved_run(synth_dir, out, "--tokenizer_vocab_size", "300")
    resume = [a for a in argv if a not in ("--tokenizer_vocab_size", "300")] + ["--max_steps", "3",
                                                                                 "--resume_from_checkpoint", "true"]
    with pytest.raises(ValueError, match=r"--tokenizer_name \S+other: its vocabulary is not the one saved in "
                                         r"\S+checkpoint-2 \(\d+ against \d+ ids\)"):
        finetune_trainer.main(resume + ["--tokenizer_name", str(other)])
    finetune_trainer.main(resume)  # the checkpoint's vocabulary, --tokenizer_vocab_size not repeated
    with open(out / "config.json") as f:
        assert json.load(f)["vocab_size"] < 400
    small = os.path.join(os.path.dirname(TINY), "t5-demo.json")
    with pytest.raises(ValueError, match=r"--model_name_or_path \S+other and --config_name \S+t5-demo.json: the "
                                         r"weights do not fit that config"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "ft") + [
            "--model_name_or_path", str(other), "--config_name", small, "--do_train"])
    with pytest.raises(ValueError, match=r"--tokenizer_vocab_size 300: the size of a tokenizer trained here"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "ft2") + [
            "--model_name_or_path", str(other), "--do_train", "--tokenizer_vocab_size", "300"])
    with pytest.raises(ValueError, match=r"--tokenizer_name \S+empty: no tokenizer loads from it"):
        os.makedirs(tmp_path / "empty")
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "ft3") + [
            "--config_name", TINY, "--tokenizer_name", str(tmp_path / "empty"), "--do_train"])
