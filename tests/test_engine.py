"""The offload engine against torch.optim.AdamW, element by element.

Tests taking the ``mode`` fixture run on the plain CPU path, on the stream simulator with both of its
adversaries (the GPU code path: staging buffers, deferred copies, events), and on a GPU when there is
one (``-m cuda``); see tests/_modes.py.
"""
from __future__ import annotations

import copy
import math
import os

# cuBLAS is deterministic on one stream only with a fixed workspace; set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from _engine_pair import LR, SMALL, WD, assert_models_close, engine, make_pair, train_both  # noqa: E402
from _models import TinyNet, batches, loss_fn, param_groups, write_some_params  # noqa: E402
from hf_zero_offload.engine import LossScaler, OffloadAdam, OffloadOptions, plan_host_memory  # noqa: E402



def test_fp32_matches_adamw_with_frozen_tied_and_unused_params(mode):
    ref_model, ref, model, opt = make_pair(mode)
    assert opt.streams.async_copies == (mode.name != "cpu")
    frozen_before = model.frozen.weight.detach().clone()
    data = mode.data(batches(20))
    train_both(ref_model, ref, model, opt, data)
    mode.sync()
    branch_steps = sum(use_branch for _, _, use_branch in data)
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.frozen.weight, frozen_before)
    assert model.head.weight is model.embed.weight
    # the branch skipped steps exactly like AdamW (its own step count did not advance)
    assert ref.state[ref_model.branch.weight]["step"].item() == branch_steps < 20
    assert opt.numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt.close()


def test_fp32_matches_adamw_with_a_scatter_thread_on_cpu():
    ref_model, ref, model, opt = make_pair(scatter_thread=True)
    train_both(ref_model, ref, model, opt, batches(20))
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
    opt.close()


def test_gradient_accumulation_1_vs_4_same_global_batch(mode):
    torch.manual_seed(0)
    m1 = mode.model(TinyNet())
    m4 = copy.deepcopy(m1)
    o1 = engine(mode, m1)
    o4 = engine(mode, m4, gradient_accumulation_steps=4)
    for ids, labels, _ in mode.data(batches(8, batch=8)):
        loss_fn(m1, ids, labels, True).backward()
        o1.step()
        o1.zero_grad()
        for i in range(4):  # 4 micro-batches of 2, loss scaled by 1/4 as the Trainer does
            sl = slice(2 * i, 2 * i + 2)
            (loss_fn(m4, ids[sl], labels[sl], True) / 4).backward()
        o4.step()
        o4.zero_grad()
    mode.sync()
    assert_models_close(m1, m4, rtol=2e-5, atol=2e-6)


def test_gradient_accumulation_matches_adamw_accumulating_on_device(mode):
    ref_model, ref, model, opt = make_pair(mode, gradient_accumulation_steps=3)
    for ids, labels, use_branch in mode.data(batches(12)):
        for m in (ref_model, model):
            for i in range(3):
                (loss_fn(m, ids[i:i + 1], labels[i:i + 1], use_branch) / 3).backward()
        ref.step()
        ref.zero_grad()
        opt.step()
        opt.zero_grad()
    mode.sync()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)


def test_clipping_matches_clip_grad_norm(mode):
    ref_model, ref, model, opt = make_pair(mode, max_grad_norm=0.05)
    norms = []
    for ids, labels, use_branch in mode.data(batches(10)):
        loss_fn(ref_model, ids, labels, use_branch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05).item())
        ref.step()
        ref.zero_grad()
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last.grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert min(norms) > 0.05  # clipping was active
    mode.sync()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scatter_thread", [False, True], ids=["inline", "scatter-thread"])
def test_16bit_store_sums_a_second_gradient_as_autograd_does(scatter_thread):
    # gradient_accumulation_steps=1 keeps a 16-bit store; a gradient arriving in pieces before step() (a layer
    # shared by reentrant-checkpointed segments; here two backward passes) is summed in 16-bit, exactly as
    # autograd sums it into the .grad of a 16-bit model without the engine
    torch.manual_seed(0)
    ref_model = TinyNet().bfloat16()
    model = copy.deepcopy(ref_model)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, param_dtype=torch.bfloat16,
                      options=OffloadOptions(scatter_thread=scatter_thread, **SMALL))
    ids, labels, _ = batches(1)[0]
    for m in (ref_model, model, ref_model, model):
        loss_fn(m, ids, labels, True).backward()
    opt.pipeline.drain()
    refs = {id(p): r for p, r in zip(model.parameters(), ref_model.parameters())}
    for p, off, n in opt._flat:
        assert torch.equal(opt.pipeline.store[off:off + n], refs[id(p)].grad.reshape(-1))
    opt.step()
    opt.close()


def test_fp16_overflow_skips_step_and_follows_hysteresis(mode):
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=1000, hysteresis=2,
                min_loss_scale=1)
    opt = engine(mode, model, fp16=fp16)
    model.half()  # frozen params and buffers; the engine already cast the trainable ones
    assert model.body[0].weight.dtype == torch.float16
    data = mode.data(batches(6))
    expected_scales, skipped = [], []
    for k, (ids, labels, use_branch) in enumerate(data):
        loss = opt.scale_loss(loss_fn(model, ids, labels, use_branch))
        if k in (2, 3):
            loss = loss * float("inf")  # injected overflow
        mode.sync()
        masters = opt.master.clone()
        params = [p.detach().clone() for p in model.parameters()]
        loss.backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last.skipped)
        expected_scales.append(opt.loss_scale)
        if k in (2, 3):
            mode.sync()
            assert torch.equal(opt.master, masters)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert skipped == [False, False, True, True, False, False]
    # hysteresis 2: the first overflow only spends the hysteresis, the second halves the scale
    assert expected_scales == [256, 256, 256, 128, 128, 128]
    assert int(opt._param_steps.max()) == 4  # step counts untouched by skipped steps


def test_loss_scaler_window_and_min_scale():
    s = LossScaler.from_fp16(enabled=True, loss_scale=0, initial_scale_power=2, loss_scale_window=3,
                             hysteresis=1, min_loss_scale=2)
    seen = []
    for overflow in [False, False, False, True, True, True, False, False, False]:
        s.update(overflow)
        seen.append(s.scale)
    # DeepSpeed's DynamicLossScaler.update_scale since 0.17.1 (stable_interval = cur_iter - last_overflow_iter - 1,
    # grown when > 0 and a multiple of the window): [4, 4, 8, ...] before, which a port of its test_no_overflow found
    assert seen == [4, 4, 4, 2, 2, 2, 2, 2, 2]
    s = LossScaler.from_fp16(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=2,
                             hysteresis=1, min_loss_scale=1)
    seen = []
    for overflow in [False] * 6 + [True, True, False, False, False, True]:
        s.update(overflow)
        seen.append(s.scale)
    assert seen == [256, 256, 512, 512, 1024, 1024, 512, 256, 256, 256, 512, 256]
    static = LossScaler.from_fp16(enabled=True, loss_scale=128)
    static.update(True)
    assert static.scale == 128


def test_bf16_masters_track_fp32_reference(mode):
    torch.manual_seed(0)
    ref_model = mode.model(TinyNet())
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    model = copy.deepcopy(ref_model)
    init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    opt = engine(mode, model, param_dtype=torch.bfloat16)
    assert model.body[0].weight.dtype == torch.bfloat16
    model.bfloat16()
    train_both(ref_model, ref, model, opt, mode.data(batches(10)))
    mode.sync()
    # masters in fp32 stay within bf16 forward rounding of the fp32 run; device params are the masters rounded
    offsets = {id(p): (off, n) for g in opt._slots for p, off, n in g}
    for (name, pr), p in zip(ref_model.named_parameters(), model.parameters()):
        if not p.requires_grad:
            continue
        off, n = offsets[id(p)]
        master = opt.master[off:off + n].view(p.shape).to(p.device)
        # Adam's normalised update amplifies rounding where a gradient is near zero, so bound the
        # typical deviation against the distance trained, and the worst one by a few LR-sized steps.
        diff = (master - pr.detach()).abs()
        moved = (pr.detach() - init[name]).abs().mean()
        assert diff.mean() <= 0.02 * moved, (name, diff.mean().item(), moved.item())
        assert diff.max() <= 5 * LR, (name, diff.max().item())
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), name


@pytest.mark.parametrize("opts", [{}, {"dpu": True, "dpu_warmup_steps": 2}, {"gradient_accumulation_steps": 2},
                                  {"scatter_thread": True, "dpu": True, "dpu_warmup_steps": 1},
                                  {"dpu": True, "dpu_warmup_steps": 2, "write_at": 5}],
                         ids=["sync", "dpu", "gas2", "thread-dpu", "dpu-write"])
def test_resume_is_bit_exact(mode, opts, tmp_path):
    """dpu-write: params written while the delayed step 5 is in flight, then the save: the saved masters lacked the
    write, which the resumed run then lost (1.04 off), while the run that went on kept it."""
    data = mode.data(batches(10))
    opts = dict(opts)
    write_at = opts.pop("write_at", None)
    gas = opts.get("gradient_accumulation_steps", 1)

    def train(model, opt, part, first_step=1):
        for k, (ids, labels, use_branch) in enumerate(part, start=first_step):
            for i in range(gas):
                (loss_fn(model, ids[i::gas], labels[i::gas], use_branch) / gas).backward()
            opt.step()
            opt.zero_grad()
            if k == write_at:
                mode.host_write()
                write_some_params(model)

    torch.manual_seed(0)
    full = mode.model(TinyNet())
    init = copy.deepcopy(full)
    o_full = engine(mode, full, **opts)
    train(full, o_full, data)

    first = copy.deepcopy(init)
    o_first = engine(mode, first, **opts)
    train(first, o_first, data[:5])
    o_first.save_checkpoint(str(tmp_path))
    assert os.listdir(tmp_path) == ["rank0_of_1.hzo"]  # no temporary file left behind
    mode.sync()
    model_state = copy.deepcopy(first.state_dict())
    o_first.close()

    second = copy.deepcopy(init)
    second.load_state_dict(model_state)
    o_second = engine(mode, second, **opts)
    o_second.load_checkpoint(str(tmp_path))
    train(second, o_second, data[5:], first_step=6)
    mode.sync()
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)
    o_full.flush()  # DPU: wait for the last step and publish it
    o_second.flush()
    mode.sync()
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(o_full.master, o_second.master)
    assert torch.equal(o_full.exp_avg_sq, o_second.exp_avg_sq)


def test_state_from_another_model_is_refused():
    _, _, model, opt = make_pair()
    other = OffloadAdam(torch.nn.Linear(3, 3).parameters(), options=OffloadOptions(**SMALL))
    with pytest.raises(ValueError, match="does not match this model"):
        other.load_state_dict(opt.state_dict())


def test_host_bytes_per_param_for_16bit_models():
    n = 3_000_000_000
    for gas, dpu in [(1, False), (4, False), (1, True)]:
        plan = plan_host_memory(n, param_dtype=torch.float16, gradient_accumulation_steps=gas,
                                delayed_param_update=dpu, bucket_numel=200_000_000, tile_numel=1 << 22)
        assert plan.host_bytes / n <= 18.3, (gas, dpu, plan.host_bytes / n)
        assert plan.device_bytes == 2 * 200_000_000 * 2


def test_engine_allocates_its_plan():
    _, _, model, opt = make_pair()
    assert opt.arena.nbytes == opt.plan.host_bytes
    assert math.isclose(opt.plan.regions["master"][0], opt.numel)


def test_state_dict_round_trip():
    _, _, model, opt = make_pair()
    for ids, labels, use_branch in batches(3):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
    state = opt.state_dict()
    torch.manual_seed(1)
    other_model = TinyNet()
    other = OffloadAdam(param_groups(other_model, WD), lr=LR, options=OffloadOptions(**SMALL))
    other.load_state_dict(state)
    assert torch.equal(other.master, opt.master) and torch.equal(other.exp_avg, opt.exp_avg)
    assert other.state_meta() == opt.state_meta()
