"""examples/seq2seq with a new user's own data and flags (an outside probe's cases): lines split as ``wc -l`` counts
them, BLEU against the reference texts of the split, the loss of accumulated micro-batches averaged, and every
flag that could not work refused in one line naming it."""
import json
import os
import re

import numpy as np
import pytest
import torch
from transformers import TrainingArguments

from _examples import TINY, write_synth
from _examples import common_args as _common_args

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
sacrebleu = pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402
import seq2seq_model as sm  # noqa: E402
import seq2seq_data as sd  # noqa: E402


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    return write_synth(tmp_path_factory)


@pytest.mark.parametrize("content,line", [(b"one two\rthree\r\nfour\n", 1), (b"a\nb\n\rc\n", 3),
                                          (b"a b\rc d\re f\r", 1)])
def test_a_lone_carriage_return_is_named(tmp_path, content, line):
    """Python's universal newlines ended a line at a "\\r" inside it: the pairs after it were shifted against the
    other side, and training went on (12 pairs from files of 11 lines); read at "\\n" alone, a file of classic-Mac
    "\\r" endings was one example."""
    path = tmp_path / "train.source"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"train.source: line {line} holds a carriage return \(\\r\) that ends no "
                                         r"line: .*tr '\\r' '\\n'"):
        sd.read_lines(str(path))
    (tmp_path / "bom.source").write_bytes("\ufeffa\r\nb\r\n\u2028c\n".encode())
    assert sd.read_lines(str(tmp_path / "bom.source")) == ["a", "b", "\u2028c"]


def test_a_data_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("x\n")
    with pytest.raises(NotADirectoryError, match=r"--data_dir \S+f: a file; it names the folder"):
        sd.read_split(str(tmp_path / "f"), "train")


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
    out = sd.build_compute_metrics(_Tokenizer(), refs)(type("P", (), {"predictions": preds, "label_ids": labels}))
    want = sacrebleu.corpus_bleu(["a b c d", "b c d a", "c d a"], [refs]).score
    assert out["bleu"] == round(want, 4) and out["gen_len"] == round(11 / 3, 4)
    # --dataloader_drop_last leaves evaluation's last partial batch out too: scored against the examples generated
    out = sd.build_compute_metrics(_Tokenizer(), refs)(type("P", (), {"predictions": preds[:2], "label_ids": None}))
    assert out["bleu"] == round(sacrebleu.corpus_bleu(["a b c d", "b c d a"], [refs[:2]]).score, 4)


def test_evaluation_runs_in_dataset_order_whatever_the_train_sampling(tmp_path):
    """--train_sampling_strategy group_by_length made transformers evaluate grouped by length too: generations
    scored by position against other examples' references (BLEU 5.56 for a perfect model, a review)."""
    from torch.utils.data import SequentialSampler

    _, _, args = finetune_trainer.parse_args(["--config_name", TINY, "--data_dir", "x", "--output_dir",
                                              str(tmp_path), "--use_cpu", "--train_sampling_strategy",
                                              "group_by_length", "--report_to", "none"])
    trainer = finetune_trainer.LegacySeq2SeqTrainer.__new__(finetune_trainer.LegacySeq2SeqTrainer)
    trainer.args = args
    assert isinstance(trainer._get_eval_sampler(list(range(5))), SequentialSampler)


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
    (["--task", "tranlsation_en_to_ro"], r"--task tranlsation_en_to_ro: summarization, translation_<src>_to_<tgt> "
                                         r".*did you mean translation_en_to_ro\?"),
    (["--metric_for_best_model", "bleu"], r"--metric_for_best_model bleu: this script's evaluations report loss "
                                          r"\(bleu and gen_len need --predict_with_generate\)"),
    (["--metric_for_best_model", "rouge2", "--predict_with_generate"], r"report loss, bleu and gen_len"),
    (["--do_eval", "--predict_with_generate", "--val_max_target_length", "1"],
     r"--val_max_target_length 1: generation needs 2 tokens at least"),
    (["--do_eval", "--predict_with_generate", "--generation_max_length", "1"], r"--generation_max_length 1"),
    (["--do_predict", "--predict_with_generate", "--test_max_target_length", "1"], r"--test_max_target_length 1"),
    (["--tokenizer_vocab_size", "5"], r"--tokenizer_vocab_size 5: a tokenizer needs 8 pieces at least"),
    pytest.param(["--do_eval", "--predict_with_generate", "--dataloader_in_order", "false"],
                 r"--dataloader_in_order false with --predict_with_generate: the script scores .* by position",
                 marks=pytest.mark.skipif(not hasattr(TrainingArguments, "dataloader_in_order"),
                                          reason="this transformers has no --dataloader_in_order")),
    (["--do_eval", "--predict_with_generate", "--eval_do_concat_batches", "false"], r"--eval_do_concat_batches false"),
    (["--do_eval", "--predict_with_generate", "--batch_eval_metrics"], r"--batch_eval_metrics with"),
])
def test_flags_that_fail_after_training_are_refused_first(tmp_path, synth_dir, extra, match):
    """Each trained, then failed (a KeyError 'eval_bleu'; generation asked for 1 token) or ran without T5's prefix."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train", *extra])
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize("task", ["summarization", "summarization_cnn", "translation_en_XX_to_ro_RO",
                                  "translation_zh-CN_to_en", "my_task"])
def test_legitimate_tasks_and_metrics_are_taken(tmp_path, synth_dir, task):
    """A --task of the config's task_specific_params or with region codes, and the Trainer's own eval metrics, were
    refused by the first form of the checks (a review)."""
    import seq2seq_args

    config = type("C", (), {"task_specific_params": {"my_task": {}}})()
    _, data_args, args = finetune_trainer.parse_args(_common_args(synth_dir, tmp_path) + [
        "--config_name", TINY, "--task", task, "--metric_for_best_model", "eval_runtime"])
    assert seq2seq_args._run_problems(data_args, args, config) == []


def test_a_resume_flag_without_training_is_refused(tmp_path, synth_dir):
    """--resume_from_checkpoint with --do_eval alone evaluated a freshly initialised model (BLEU 0.0 where the
    checkpoint scored 1.63), an outside probe."""
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint \S+ckpt without --do_train: it resumes training; "
                                         r"to evaluate a checkpoint, give it as --model_name_or_path"):
        finetune_trainer.main([a for a in _common_args(synth_dir, tmp_path / "o")] + [
            "--config_name", TINY, "--do_eval", "--resume_from_checkpoint", str(tmp_path / "ckpt")])


def test_invisible_only_texts_are_blank(tmp_path):
    """A line of a zero-width space or a BOM passed the blank-line check and tokenized to </s> alone."""
    with pytest.raises(ValueError, match=r"2 blank or missing text\(s\) among the 3 used \(line 2, 3\)"):
        sd.check_texts("val.target", ["a", "\u200b", " \ufeff "], "line", 1)


def test_bleu_compares_nfkc_forms(tmp_path):
    """The tokenizer normalizes to NFKC; references in NFD capped a perfect model's BLEU at 49 (an outside probe)."""
    import unicodedata

    class Echo(_Tokenizer):
        words = ["<pad>", unicodedata.normalize("NFC", "țară"), "ﬁn", "ok"]

    refs = [unicodedata.normalize("NFD", "țară fin ok ok")]
    preds = np.array([[1, 2, 3, 3]])
    assert sd.build_compute_metrics(Echo(), refs)(type("P", (), {"predictions": preds}))["bleu"] == 100.0


def test_tokenizer_training_keeps_long_lines_and_names_a_too_small_vocabulary(tmp_path):
    """SentencePiece left lines over 4192 bytes out of training, silently (a summarization document's sources
    became characters and <unk>); a vocabulary under the text's distinct characters was its raw RuntimeError."""
    from train_tokenizer import train_t5_tokenizer

    long_line = " ".join(f"word{i % 50}x" for i in range(1000))  # ~8 KB, the only text with 'word'
    tok = train_t5_tokenizer([long_line, "short line here"], 300)
    assert tok.unk_token_id not in tok(long_line[:200])["input_ids"]
    with pytest.raises(ValueError, match=r"vocab_size 20 is too small for this text, which has \d+ distinct "
                                         r"characters: \d+ ids at least"):
        train_t5_tokenizer(["abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ 0123456789"], 20)


@pytest.mark.parametrize("flag", ["--max_target_length", "--val_max_target_length"])
def test_a_target_length_of_the_special_tokens_alone_is_refused(tmp_path, synth_dir, flag):
    """--max_target_length 1 trained on labels of </s> alone, silently (an outside probe)."""
    with pytest.raises(ValueError, match=rf"{flag} 1: the special tokens take 1, which leaves no token of the target"):
        finetune_trainer.main(_common_args(synth_dir, tmp_path / "o") + ["--config_name", TINY, "--do_train",
                                                                         "--do_eval", flag, "1"])


def test_a_source_length_the_prefix_fills_is_refused_before_anything_is_written(tmp_path, synth_dir):
    """Checked once the tokenizer was trained and saved into output_dir: the run with a fixed length was then refused
    for the output_dir that the refused run had filled (a review)."""
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"--max_source_length 3: the task prefix 'translate English to Romanian: ' "
                                         r"and the special tokens take \d+, which leaves no token of the source"):
        finetune_trainer.main(_common_args(synth_dir, out) + ["--config_name", TINY, "--do_train",
                                                              "--max_source_length", "3"])
    assert [f for f in os.listdir(out) if f != "hzo-run.lock"] == []  # (the lock goes at exit)


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


def test_a_missing_data_dir_is_named_before_the_model_config(tmp_path, monkeypatch):
    """The blog's command offline stopped at the Hub lookup of t5-large's config; the missing --data_dir, the first
    thing a new user has to fix, came only after (an outside probe)."""
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model config was looked up first"))
    monkeypatch.chdir(tmp_path)  # and where a relative one was looked for (it said only "not found")
    with pytest.raises(NotADirectoryError, match=r"--data_dir wmt_en_ro: not found \(a relative path is read from the "
                                                 rf"current directory, {re.escape(str(tmp_path))}\); it names the folder"):
        finetune_trainer.main(["--model_name_or_path", "t5-large", "--data_dir", "wmt_en_ro", "--output_dir",
                               str(tmp_path / "o"), "--do_train", "--use_cpu", "--report_to", "none"])


def test_texts_the_tokenizer_reduces_to_nothing_are_named(tmp_path):
    """Control characters (DOS's end-of-file byte), U+FFFD: a line of those passed the blank-text check and trained an
    example of </s> alone (an outside probe)."""
    from train_tokenizer import train_t5_tokenizer

    tok = train_t5_tokenizer(["the cat sat on the mat", "a dog ran to the park"] * 20, 200)
    assert not sd._visible("\x1a \x00")
    sd.check_tokenized_texts(tok, {"train": (["the cat", "..."], ["a dog", "- the -"])}, "d")  # nothing to say
    with pytest.raises(ValueError, match=r"d val.target: 1 text\(s\) that the tokenizer reduces to its special tokens "
                                         r"alone \(line 2: control characters or symbols it cannot spell\)"):
        sd.check_tokenized_texts(tok, {"val": (["the cat", "a dog"], ["the mat", "\ufffd\u2581"])}, "d")


def test_a_config_with_odd_task_specific_params_does_not_break_the_task_check(tmp_path, synth_dir):
    import seq2seq_args

    _, data_args, args = finetune_trainer.parse_args(_common_args(synth_dir, tmp_path) + ["--config_name", TINY])
    for odd in (5, "translation", None, []):
        config = type("C", (), {"task_specific_params": odd})()
        assert seq2seq_args._run_problems(data_args, args, config) == []
