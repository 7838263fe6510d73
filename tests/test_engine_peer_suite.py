"""The engines probed the way peer suites probe ZeRO optimizers (DeepSpeed's tests/unit/runtime/zero,
torch's test_zero_redundancy_optimizer, DeepSpeed's test_cpu_adam), on combinations the other engine
tests leave out: param groups with their own betas/eps/lr/weight decay and an lr changed mid-run,
torch.optim flags a group may carry, ``zero_grad(set_to_none=False)``, Adam with L2 weight decay per
group, a closure, and a model smaller than one shard's int8 block on two ranks. Every state dtype
(fp32, bf16, int8) and the delayed parameter update (DPU) run where they apply.

References: ``torch.optim.AdamW(foreach=False)`` (fp32: to a few ulp, as test_engine.py), DDP + AdamW
on two ranks, and, for bf16/int8 moments, the one-process engine of the same state dtype (bit for bit
where both sum the same gradients in the same order, else within ``assert_compact_close``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)
TIGHT = dict(rtol=1e-5, atol=1e-6)
DTYPES = ["fp32", "bf16", "int8"]
FLAGS = [("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True),
         ("foreach", True), ("fused", True), ("decoupled_weight_decay", False), ("state_dtype", "int8"),
         ("adamw_mode", "false")]


def own_groups(model):
    """Two groups with their own lr, betas, eps and weight decay (DeepSpeed's multi-group test)."""
    g = param_groups(model, WD)
    g[0].update(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)
    g[1].update(weight_decay=0.05)
    return g


def run(model, opt, data, *, lr_at=3, keep_zero=False, explicit_zero=False, drops=None):
    """One step per batch; group 1's lr changes before step ``lr_at`` (a scheduler would). ``keep_zero``:
    zero_grad(set_to_none=False); ``explicit_zero``: the unused branch gets an explicit zero gradient;
    ``drops``: each window starts with a backward (through the branch where ``drops[i]``) that
    zero_grad(set_to_none=False) drops, leaving a zero .grad on the params it reached."""
    for i, (ids, labels, use_branch) in enumerate(data):
        if i == lr_at:
            opt.param_groups[1]["lr"] = 5e-3
        if drops is not None:
            loss_fn(model, labels, ids, drops[i]).backward()
            opt.zero_grad(set_to_none=False)
        loss = loss_fn(model, ids, labels, use_branch)
        if explicit_zero and not use_branch:
            loss = loss + 0 * sum(p.sum() for p in model.branch.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep_zero)
    if hasattr(opt, "flush"):
        opt.flush()


def flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_compact_close(got, want):
    """bf16/int8 moments of the same gradients summed in another order (the sharded path): the last bit
    may move an int8 code by one step, and that code its param by a few % of lr (test_compact_states)."""
    d = (got - want).abs()
    assert d.max() <= LR / 4, d.max()
    assert (d <= 1e-6 + 1e-5 * want.abs()).float().mean() >= 0.99


def offload(model, groups=own_groups, **opts):
    return OffloadAdam(groups(model), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))


# -- param groups ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_own_group_hyperparameters_and_an_lr_change_match_adamw(dpu):
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(own_groups(ref_model), lr=LR, foreach=False)
    data = batches(8)
    # DPU after warm-up: the device params trail the masters one step; compared after flush()
    opt = offload(model, dpu=dpu, dpu_warmup_steps=100 if not dpu else 8)
    run(ref_model, ref, data)
    run(model, opt, data)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero0"])
@pytest.mark.parametrize("key,value", FLAGS, ids=[k for k, _ in FLAGS])
def test_a_group_flag_the_engine_does_not_implement_is_refused_by_name(kind, key, value):
    """They used to be accepted and dropped: amsgrad=True or maximize=True trained as plain AdamW."""
    torch.manual_seed(0)
    model = TinyNet()
    groups = param_groups(model, WD)
    groups[1][key] = value
    cls, extra = (OffloadAdam, {}) if kind == "offload" else (ShardedAdam, dict(stage=0, offload=False))
    before = flat(model)
    if key == "decoupled_weight_decay":  # given the torch way at build, with no adamw_mode: L2 Adam, as CPUAdam reads it
        cls(groups, lr=LR, options=OffloadOptions(num_threads=1), **extra).close()
    else:
        with pytest.raises(ValueError, match=f"param group 1: {key}[= ]"):
            cls(groups, lr=LR, options=OffloadOptions(num_threads=1), **extra)
    assert torch.equal(flat(model), before)
    # set on a built engine (a group edited by hand): the next step refuses before anything moves
    opt = cls(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1), **extra)
    opt.param_groups[1][key] = value
    ids, labels, use_branch = batches(1)[0]
    loss_fn(model, ids, labels, use_branch).backward()
    with pytest.raises(ValueError, match=f"param group 1: {key}[= ]"):
        opt.step()
    assert torch.equal(flat(model), before) and int(opt._param_steps.sum()) == 0
    opt.close()


def test_flags_that_agree_with_the_engine_are_accepted():
    """A group copied from torch.optim.AdamW's (foreach None, fused None, amsgrad False...) steps."""
    torch.manual_seed(0)
    model = TinyNet()
    groups = param_groups(model, WD)
    torch_keys = torch.optim.AdamW(param_groups(TinyNet(), WD), foreach=False).param_groups[0]
    for g in groups:
        g.update({k: v for k, v in torch_keys.items() if k not in ("params", "lr", "weight_decay")})
    opt = OffloadAdam(groups, lr=LR, options=OffloadOptions(num_threads=1))
    run(model, opt, batches(2))
    opt.close()


def test_adam_with_l2_weight_decay_per_group_matches_torch_adam():
    """adamw_mode per group: False is torch.optim.Adam's L2 decay, True AdamW's decoupled decay."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    groups = param_groups(model, WD)
    groups[0]["adamw_mode"] = False
    ref_groups = param_groups(ref_model, WD)
    refs = [torch.optim.Adam([ref_groups[0]], lr=LR, foreach=False),
            torch.optim.AdamW([ref_groups[1]], lr=LR, foreach=False)]
    opt = OffloadAdam(groups, lr=LR, options=OffloadOptions(**SMALL))
    for ids, labels, use_branch in batches(6):
        loss_fn(ref_model, ids, labels, use_branch).backward()
        for r in refs:
            r.step()
            r.zero_grad()
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


def test_a_closure_is_called_and_its_loss_returned_as_torch_does():
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = offload(model, groups=lambda m: param_groups(m, WD))
    for ids, labels, use_branch in batches(5):
        losses = []
        for m, o in ((ref_model, ref), (model, opt)):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = loss_fn(m, ids, labels, use_branch)
                loss.backward()
                return loss
            losses.append(o.step(closure).item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


# -- zero_grad(set_to_none=False) ------------------------------------------------------------------
def test_zero_grad_keeping_zeros_steps_unused_params_like_adamw():
    """torch: a param that had a .grad keeps a zero one and AdamW steps it (moments decay, weight decay
    applies); the engines skipped it, as if set_to_none=True."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = offload(model, groups=lambda m: param_groups(m, WD))
    data = batches(6)
    run(ref_model, ref, data, keep_zero=True)
    run(model, opt, data, keep_zero=True)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    assert int(opt._param_steps.min()) == 6 == ref.state[ref_model.branch.weight]["step"].item()
    # set_to_none=True forgets the kept zeros: the branch skips again
    opt.zero_grad()
    ids, labels, _ = data[0]
    loss_fn(model, ids, labels, False).backward()
    opt.step()
    opt.zero_grad()
    branch = next(i for i, (q, _, _) in enumerate(opt._flat) if q is model.branch.weight)
    assert int(opt._param_steps[branch]) == 6
    opt.close()


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_zero_grad_keeping_zeros_is_an_explicit_zero_gradient(state_dtype, dpu):
    """Every state dtype, with and without DPU: bit for bit the run whose unused branch got a zero
    gradient from backward."""
    runs = []
    for keep in (True, False):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, state_dtype=state_dtype, dpu=dpu, dpu_warmup_steps=2)
        run(model, opt, batches(6), keep_zero=keep, explicit_zero=not keep)
        runs.append((flat(model), opt.state_tensors()))
        opt.close()
    assert torch.equal(runs[0][0], runs[1][0])
    for k, t in runs[1][1].items():
        assert torch.equal(runs[0][1][k], t), k


# The branch per step: in the batch (BRANCH), in the dropped backward that starts the window (DROPS). Steps 1
# and 5: only the dropped gradient reaches it (torch steps its zero .grad; the engines skipped it). Steps 2 and
# 4: neither, after a step that updated it (torch: None since zero_grad(); the engines stepped it with zeros).
BRANCH = [True, False, False, True, False, False]
DROPS = [False, True, False, True, False, True]
BRANCH_STEPS = 4


def dropping_data(seed=0):
    return [(ids, labels, use) for (ids, labels, _), use in zip(batches(6, seed=seed), BRANCH)]


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_gradients_dropped_by_zero_grad_keeping_zeros_leave_the_zeros_adamw_steps(state_dtype):
    """zero_grad(set_to_none=False) part way through a window leaves a zero .grad exactly on the params that
    hold a .grad then, and AdamW steps those even when the rest of the window gives them none. The engines
    went by the last step's gradients instead, even after a zero_grad() had set them to None. fp32 against
    AdamW; bf16/int8 bit for bit against the run that gives those params explicit zero gradients."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model, zeros_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    opt = offload(model, groups=lambda m: param_groups(m, WD), state_dtype=state_dtype)
    run(model, opt, dropping_data(), drops=DROPS)
    branch = next(i for i, (q, _, _) in enumerate(opt._flat) if q is model.branch.weight)
    assert int(opt._param_steps[branch]) == BRANCH_STEPS
    if state_dtype == "fp32":
        ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
        run(ref_model, ref, dropping_data(), drops=DROPS)
        assert ref.state[ref_model.branch.weight]["step"].item() == BRANCH_STEPS
        torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    else:
        zeros = offload(zeros_model, groups=lambda m: param_groups(m, WD), state_dtype=state_dtype)
        for i, ((ids, labels, use), drop) in enumerate(zip(dropping_data(), DROPS)):
            if i == 3:
                zeros.param_groups[1]["lr"] = 5e-3  # as run() does
            loss = loss_fn(zeros_model, ids, labels, use)
            if drop and not use:
                loss = loss + 0 * sum(p.sum() for p in zeros_model.branch.parameters())
            loss.backward()
            zeros.step()
            zeros.zero_grad()
        assert torch.equal(flat(model), flat(zeros_model))
        zeros.close()
    opt.close()


# -- two ranks -------------------------------------------------------------------------------------
SHARDED = {"s1-off": dict(stage=1, offload=True), "s2-off": dict(stage=2, offload=True),
           "s2-off-dpu": dict(stage=2, offload=True, dpu=True), "s1": dict(stage=1, offload=False),
           "s2": dict(stage=2, offload=False)}


def _sharded(model, groups, cfg, state_dtype="fp32"):
    cfg = dict(cfg)
    dpu = cfg.pop("dpu", False)
    opts = OffloadOptions(**SMALL, state_dtype=state_dtype, dpu=dpu, dpu_warmup_steps=2)
    return ShardedAdam(groups(model), lr=LR, options=opts, allgather_bucket_numel=1000, **cfg)


ENGINES = {"offload": lambda m, wd: OffloadAdam(param_groups(m, wd), lr=LR, options=OffloadOptions(**SMALL)),
           "sharded1": lambda m, wd: _sharded(m, lambda q: param_groups(q, wd), dict(stage=1, offload=True)),
           "sharded2": lambda m, wd: _sharded(m, lambda q: param_groups(q, wd), dict(stage=2, offload=False))}


@pytest.mark.parametrize("then", ["close", "replace", "torch"])
@pytest.mark.parametrize("kind", list(ENGINES))
def test_an_optimizer_built_next_steps_the_zero_grads_torch_keeps(kind, then):
    """zero_grad(set_to_none=False), then a new optimizer over the same params (after close(), or replacing the
    engine alive): torch's steps the params holding a zero .grad (the branch, unused from step 2 on). The engines
    free each .grad they take, so the next engine found none and skipped them: 0.198 off AdamW with weight decay
    0.5, silently. Element by element against AdamW(foreach=False) rebuilt at the same point."""
    wd = 0.5
    data = [(ids, labels, i == 0) for i, (ids, labels, _) in enumerate(batches(5))]
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    for m, make in ((ref_model, lambda: torch.optim.AdamW(param_groups(ref_model, wd), lr=LR, foreach=False)),
                    (model, lambda: ENGINES[kind](model, wd))):
        opt = make()
        run(m, opt, data[:2], keep_zero=True, lr_at=-1)
        if m is model and then == "close":
            opt.close()
        opt = make() if m is ref_model or then != "torch" else (opt.close(), torch.optim.AdamW(
            param_groups(model, wd), lr=LR, foreach=False))[1]
        run(m, opt, data[2:], keep_zero=True, lr_at=-1)
        if m is model and then != "torch":
            assert all(p.grad is None for p in model.parameters())  # taken: the zeros live in the engine's flags
            opt.close()
    assert model.branch.weight.grad is not None and not model.branch.weight.grad.any()  # handed back at close
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, **TIGHT, msg=name)


def test_closing_after_zero_grad_to_none_hands_back_no_grads():
    """torch's default zero_grad(): a close allocates no .grad (nothing torch would hold is a zero)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = ENGINES["offload"](model, WD)
    run(model, opt, batches(2), lr_at=-1)
    opt.close()
    assert all(p.grad is None for p in model.parameters())


def _two_rank_job(rank, world, ckpt):
    out = {}
    same = batches(6)                   # the same data on both ranks: the one-process gradient
    own = batches(6, seed=10 + rank)    # each rank its own: against DDP
    torch.manual_seed(0)
    ddp_model = TinyNet()
    # drop: each window starts with a backward through the branch that zero_grad(set_to_none=False) drops
    for keep, drop in ((False, False), (True, False), (False, True)):
        data, drops = (dropping_data(seed=10 + rank), DROPS) if drop else (own, None)
        m = copy.deepcopy(ddp_model)
        ref = torch.optim.AdamW(own_groups(m), lr=LR, foreach=False)
        run(DDP(m, find_unused_parameters=True), ref, data, keep_zero=keep, drops=drops)
        for name, cfg in SHARDED.items():
            if cfg.get("dpu"):
                continue  # one step behind AdamW by design (test_sharding_dpu.py has its reference)
            torch.manual_seed(0)
            model = TinyNet()
            opt = _sharded(model, own_groups, cfg)
            run(model, opt, data, keep_zero=keep, drops=drops)
            torch.testing.assert_close(flat(model), flat(m), **TIGHT, msg=f"{name} keep_zero={keep} drop={drop}")
            opt.close()
    for st in ("bf16", "int8"):
        for name in ("s1-off", "s2-off", "s2-off-dpu"):
            torch.manual_seed(0)
            model = TinyNet()
            opt = _sharded(model, own_groups, SHARDED[name], st)
            run(model, opt, same)
            out[(st, name)] = flat(model)
            opt.close()
    # a model smaller than one int8 block (and than the ranks, in elements): rank 1's shard is all
    # padding; stage 2 delivered its piece past the end of its store, inside backward
    for st in DTYPES:
        for name in ("s1-off", "s2-off", "s2-off-dpu"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(5))
            opt = _sharded(p, lambda q: [q], SHARDED[name], st)
            for _ in range(4):
                (p * p * torch.arange(5.0)).sum().backward()
                opt.step()
                opt.zero_grad()
            opt.flush()
            out[("tiny", st, name)] = p.detach().clone()
            if name == "s2-off":
                opt.save_checkpoint(f"{ckpt}/{st}")
            opt.close()
    dist.barrier()
    return out


def _tiny_one_process(state_dtype, dpu, load=None):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = OffloadAdam([p], lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype, dpu=dpu,
                                                        dpu_warmup_steps=2))
    if load:
        opt.load_checkpoint(load)
        return opt
    for _ in range(4):
        (p * p * torch.arange(5.0)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    return opt, p


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    return run_distributed(_two_rank_job, str(ckpt), timeout=150, collective_timeout=30), ckpt


def test_sharded_own_groups_lr_change_and_kept_zero_grads_match_ddp(two_ranks):
    """Stage 1/2, with and without offload, with set_to_none True and False (asserted on the ranks)."""
    (r0, r1), _ = two_ranks
    for key in r0:
        if key[0] != "tiny":
            assert torch.equal(r0[key], r1[key]), key  # both ranks hold the same params


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_sharded_compact_states_with_own_groups_match_one_process(two_ranks, state_dtype):
    (r0, _), _ = two_ranks
    for name in ("s1-off", "s2-off", "s2-off-dpu"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, state_dtype=state_dtype, dpu=name.endswith("dpu"), dpu_warmup_steps=2)
        run(model, opt, batches(6))
        assert_compact_close(r0[(state_dtype, name)], flat(model))
        opt.close()


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_a_model_smaller_than_a_shard_block_trains_and_reloads_on_one_process(two_ranks, state_dtype):
    (r0, r1), ckpt = two_ranks
    for name in ("s1-off", "s2-off", "s2-off-dpu"):
        opt, p = _tiny_one_process(state_dtype, name.endswith("dpu"))
        for r in (r0, r1):
            assert torch.equal(r[("tiny", state_dtype, name)], p.detach()), name
        if name == "s2-off":
            loaded = _tiny_one_process(state_dtype, False, load=f"{ckpt}/{state_dtype}")
            for k, t in opt.state_tensors().items():
                assert torch.equal(loaded.state_tensors()[k], t), k
            loaded.close()
        opt.close()


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_int8_results_do_not_depend_on_the_tile_size(dpu):
    """A tile under one quantization block (256) split a block's update into parts, each re-encoding it: params
    moved by 3e-3 at lr 1e-2 against the default tile. Tiles are now whole blocks."""
    runs = []
    for tile in (4, 100, 300, 1 << 22):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, groups=lambda m: param_groups(m, WD), state_dtype="int8", tile_numel=tile, dpu=dpu,
                      dpu_warmup_steps=2)
        assert opt.options.tile_numel % 256 == 0
        run(model, opt, batches(6))
        runs.append(flat(model))
        opt.close()
    for r in runs[1:]:
        assert torch.equal(r, runs[0])



class _SharedInTwoSegments(torch.nn.Module):
    """A layer used by two segments checkpointed with use_reentrant=True: each segment's backward accumulates
    its piece of that layer's gradient on its own, so the gradient reaches the engine twice in one backward."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.mid, self.out = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                                     torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        self.aux = torch.nn.Linear(16, 16)  # used on some ranks only: holds back its bucket there

    def forward(self, x, aux=False):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), self.inp(x), use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.shared(self.mid(t))), h, use_reentrant=True)
        return self.out(self.aux(h) if aux else h)


def _shared_layer_steps(model, opt, aux):
    """``aux``: per rank, whether it runs the aux layer (one process: the mean of the ranks' losses)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g).requires_grad_(True), torch.randn(4, 4, generator=g)
        sum(((model(x, a) - y) ** 2).mean() for a in aux).div(len(aux)).backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


def _shared_layer_job(rank, world, aux):
    out = {}
    # buckets of 100 and 300 elements: the shared layer's bucket goes before its second piece, on the rank that
    # runs aux only where aux shares that bucket (on the other it waits for the end of backward)
    for offload, bucket in ((True, 100), (False, 100), (True, 300), (False, 300)):
        torch.manual_seed(0)
        model = _SharedInTwoSegments()
        opt = ShardedAdam(model.parameters(), lr=LR, stage=2, offload=offload, allgather_bucket_numel=1000,
                          options=OffloadOptions(bucket_numel=bucket, tile_numel=300, num_threads=1))
        out[(offload, bucket)] = _shared_layer_steps(model, opt, [aux[rank]])
        opt.close()
    return out


@pytest.mark.parametrize("aux", [(False, False), (True, False)], ids=["same-graph", "aux-on-rank-0"])
def test_zero2_sums_a_gradient_that_arrives_in_two_pieces_after_its_bucket_went(aux):
    """ZeRO-2 left the second piece in .grad once the param's bucket had been reduced, and the step refused it as
    "a .grad that did not come from backward()". Equal to AdamW on one process (the mean of the ranks' losses);
    with a layer one rank skips, the ranks see the late piece at different points and still reduce alike."""
    torch.manual_seed(0)
    ref_model = _SharedInTwoSegments()
    want = _shared_layer_steps(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.0,
                                                                    foreach=False), list(aux))
    for r in run_distributed(_shared_layer_job, aux, timeout=120, collective_timeout=30):
        for key, got in r.items():
            torch.testing.assert_close(got, want, **TIGHT, msg=f"offload, bucket={key}")
