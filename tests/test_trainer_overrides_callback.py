"""The plain Trainer's ZeroOffloadCallback (DPU + load_best_model_at_end, DPU resume, weights loaded after
the engine was built, --max_grad_norm) as the plain Trainer with torch AdamW, and what it refuses by name (a
one-process engine on several ranks, fp16, accumulation its engine would sum in 16 bits)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from _t5 import ToyDataset, best_eval_step, logged, tiny_t5
from _overrides import _args, _assert_same
from hf_zero_offload import ZeroOffloadCallback
from hf_zero_offload.engine import OffloadAdam, OffloadOptions


# ---------------------------------------------------------------- ZeroOffloadCallback (a plain Trainer)

def _callback_trainer(tmp_path, name, dpu, seed=0, clip=0.0, **kw):
    model = tiny_t5(seed)
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(dpu=dpu, dpu_warmup_steps=1,
                                                                             max_grad_norm=clip))
    args = _args(tmp_path, name, Seq2SeqTrainingArguments, max_grad_norm=clip, **kw)
    return model, Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), eval_dataset=ToyDataset(8, seed=1),
                                 optimizers=(engine, None), callbacks=[ZeroOffloadCallback()])


def test_callback_dpu_load_best_model_keeps_the_best_weights(tmp_path):
    """on_train_end's flush published the last delayed step over the best checkpoint's weights (0.025 off)."""
    model, trainer = _callback_trainer(
        tmp_path, "best", dpu=True, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_eval_step(trainer.state)}")
    best = load_file(trainer.state.best_model_checkpoint + "/model.safetensors")
    sd = model.state_dict()
    assert max((sd[k] - v).abs().max().item() for k, v in best.items()) == 0.0
    assert not trainer.optimizer.optimizer.needs_publish
    assert trainer.evaluate()["eval_loss"] == trainer.state.best_metric


@pytest.mark.parametrize("dpu", [False, True])
def test_callback_resume_is_bit_exact(tmp_path, dpu):
    """With DPU the resumed run was 0.0145 off: Accelerate's device placement loads the engine's own state_dict()
    back, and that load published the fresh engine's masters over the checkpoint's weights just loaded."""
    full, trainer = _callback_trainer(tmp_path, "full", dpu, save_strategy="steps", save_steps=2, warmup_steps=1)
    trainer.train()
    resumed, trainer = _callback_trainer(tmp_path, "res", dpu, seed=5, save_strategy="steps", save_steps=2,
                                         warmup_steps=1)
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_callback_weights_loaded_after_building_the_engine_are_trained(tmp_path):
    """The same load: a model given other weights between building the engine and train() trained from the
    engine's stale masters (the weights the model had when the engine was built)."""
    ref_model = tiny_t5(3)
    ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "r", Seq2SeqTrainingArguments, optim="adamw_torch",
                                                     max_grad_norm=0.0, max_steps=2), train_dataset=ToyDataset())
    ref.train()
    weights = tiny_t5(3).state_dict()  # before the Trainer seeds the global RNG (its sampler draws from it)
    model, trainer = _callback_trainer(tmp_path, "o", dpu=False, max_steps=2)
    model.load_state_dict(weights)
    trainer.train()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert (a - b).abs().max().item() <= 5e-7


def test_callback_max_grad_norm(tmp_path):
    """TrainingArguments' default max_grad_norm=1.0 with OffloadOptions' 0: nothing was clipped, grad_norm logged
    0.0, without a word. A mismatch is refused; equal values clip as the plain Trainer and log its grad_norm."""
    _, trainer = _callback_trainer(tmp_path, "x", dpu=False)
    trainer.args.max_grad_norm = 1.0
    with pytest.raises(ValueError, match=r"TrainingArguments\.max_grad_norm=1 but the engine's OffloadOptions\."
                                         r"max_grad_norm=0: .*set both to the same value"):
        trainer.train()
    ref_model = tiny_t5()
    ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "r", Seq2SeqTrainingArguments, optim="adamw_torch",
                                                     max_grad_norm=1.0, lr_scheduler_type="constant"),
                         train_dataset=ToyDataset())
    ref.train()
    model, ours = _callback_trainer(tmp_path, "o", dpu=False, clip=1.0, lr_scheduler_type="constant")
    ours.train()
    assert max(logged(ref, "grad_norm")) > 1.0  # the clipping acts
    _assert_same(ref_model, ref, model, ours)


def test_the_callback_refuses_a_one_process_engine_on_several_ranks():
    """A plain Trainer on 2 ranks with ZeroOffloadCallback and OffloadAdam: the engine's hooks took each gradient
    before DDP averaged it, so each rank stepped on its own (replicas 0.0497 apart after a few steps, no word)."""
    from types import SimpleNamespace

    engine = OffloadAdam(tiny_t5().parameters(), lr=1e-2, options=OffloadOptions(pin_memory=False))
    args = SimpleNamespace(world_size=2, max_grad_norm=0.0, resume_from_checkpoint=None, output_dir="unused")
    with pytest.raises(ValueError, match="one-process engine and this job has 2 ranks"):
        ZeroOffloadCallback().on_train_begin(args, SimpleNamespace(global_step=0), None, optimizer=engine)
    engine.close()


def test_the_callback_refuses_fp16():
    """The callback's docstring said fp16 is not supported (the loss scaling is the mixin's), but nothing refused it:
    Accelerate's GradScaler would scale the loss and find no gradient to unscale (the engine took them)."""
    from types import SimpleNamespace

    engine = OffloadAdam(tiny_t5().parameters(), lr=1e-2, options=OffloadOptions(pin_memory=False))
    args = SimpleNamespace(world_size=1, fp16=True, max_grad_norm=0.0, resume_from_checkpoint=None, output_dir="x")
    with pytest.raises(ValueError, match="--fp16 needs the engine's loss scaling"):
        ZeroOffloadCallback().on_train_begin(args, SimpleNamespace(global_step=0), None, optimizer=engine)
    engine.close()


@pytest.mark.parametrize("built, dtype, refused", [(1, torch.bfloat16, True), (4, torch.bfloat16, False),
                                                   (1, torch.float32, False)])
def test_the_callback_refuses_accumulation_its_engine_would_sum_in_16_bit(built, dtype, refused):
    """A plain Trainer with --gradient_accumulation_steps 4 and a bf16 engine built with the default options (one
    micro-batch per step) summed the micro-batches in its bf16 store."""
    from types import SimpleNamespace

    engine = OffloadAdam(tiny_t5().to(dtype).parameters(), lr=1e-2,
                         options=OffloadOptions(pin_memory=False, gradient_accumulation_steps=built))
    args = SimpleNamespace(world_size=1, fp16=False, max_grad_norm=0.0, resume_from_checkpoint=None, output_dir="x",
                           gradient_accumulation_steps=4)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    begin = lambda: ZeroOffloadCallback().on_train_begin(args, state, None, optimizer=engine)  # noqa: E731
    if refused:
        with pytest.raises(ValueError, match=r"ZeroOffloadCallback: gradient_accumulation_steps 4 with an engine "
                                             r"built for 1 .*bfloat16.*OffloadOptions\(gradient_accumulation_steps=4\)"):
            begin()
    else:
        begin()
    engine.close()
