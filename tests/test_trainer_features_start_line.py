"""The start line --zero_offload logs: what runs (the config path quoted, sharded_ddp alone, a config that
offloads nothing, stage 1 run as stage 2 on one process) and the modules a model keeps in fp32 in a 16-bit run."""
from __future__ import annotations

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from _features import _args
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer


def _start_line(tmp_path, caplog, **kw) -> str:
    """The one start line of a 1-step run with these arguments."""
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "s", max_steps=1, **kw),
                                        train_dataset=ToyDataset())
    with caplog.at_level("INFO", logger="hf_zero_offload"):
        trainer.train()
    (start,) = [r.getMessage() for r in caplog.records if "hf_zero_offload: config=" in r.getMessage()]
    return start


def test_a_config_path_with_a_space_is_quoted_in_the_start_line(tmp_path, caplog):
    """An outside probe: `config=my cönfig.json ranks=1 ...` read as two values in a key=value line."""
    import json
    cfg = tmp_path / "my cönfig.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert f"config='{cfg}' ranks=1 " in _start_line(tmp_path, caplog, zero_offload=str(cfg))


def test_start_line_names_sharded_ddp_alone(tmp_path, caplog):
    """--sharded_ddp without a ds_config logged config=<dict>: the start line now says what was asked for."""
    assert "config=--sharded_ddp (stage 2) " in _start_line(tmp_path, caplog, sharded_ddp=True)


def test_a_ds_config_without_zero_optimization_says_it_offloads_nothing(tmp_path, caplog):
    """--zero_offload with a ds_config that has no "zero_optimization" section ran ZeRO stage 0 without offload (as
    DeepSpeed reads it) with only the start line's stage=0 offload=False to say so (outside probe, session 23)."""
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "s", zero_offload={"gradient_clipping": 1.0}, max_steps=1))
    with caplog.at_level("INFO", logger="hf_zero_offload"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "zero_optimization" in r.getMessage()]
    assert len(said) == 1 and "nothing is offloaded or sharded" in said[0], said
    for name, cfg, extra, warns in (("e", {"zero_optimization": {}}, {}, True),  # empty: the same stage 0
                                    ("t", OFFLOAD, {}, False),
                                    ("u", {"gradient_clipping": 1.0}, {"sharded_ddp": True}, False)):  # stage 2
        caplog.clear()
        trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                            args=_args(tmp_path, name, zero_offload=cfg, max_steps=1, **extra))
        with caplog.at_level("INFO", logger="hf_zero_offload"):
            trainer.train()
        assert warns == any("nothing is offloaded or sharded" in r.getMessage() for r in caplog.records), name


def test_modules_a_model_keeps_in_fp32_are_named_when_trained_in_16_bit(tmp_path, caplog):
    """A model's _keep_in_fp32_modules (T5's wo) and _keep_in_fp32_modules_strict (a router it requires in fp32) train
    in the one training dtype, as under DeepSpeed; the strict ones were cast without a word."""
    import logging

    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model = tiny_t5()
    model._keep_in_fp32_modules_strict = ["lm_head"]
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "k", zero_offload=OFFLOAD, max_steps=1,
                                                                bf16=True), train_dataset=ToyDataset())
    trainer.train()
    said = {r.levelno: r.getMessage() for r in caplog.records if "keeps" in r.getMessage()}
    assert said[logging.INFO].startswith("hf_zero_offload: T5ForConditionalGeneration keeps wo in fp32 "
                                         "(_keep_in_fp32_modules); the engine trains every parameter in bfloat16")
    assert "keeps lm_head in fp32 (_keep_in_fp32_modules_strict)" in said[logging.WARNING]


def test_start_line_says_a_stage_1_offload_file_runs_as_stage_2_on_one_process(tmp_path, caplog):
    """'"stage": 1' with offload on one process read stage=2 (the engine's) with no word of the file's 1."""
    zero = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    assert " engine=OffloadAdam stage=2(config:1) " in _start_line(tmp_path, caplog, zero_offload=zero)
