"""Ranks that build different ShardedAdam engines (another ds_config, command line or model on one node) are refused
at construction, on every rank, with one message naming what differs. They used to train on silently where the
collectives happened to line up (fp32 moments on one rank and int8 on the other; each rank's own learning rate,
clipping or accumulation on its own shard), fail deep in gloo ("Received data size doesn't match expected size"),
or hang (a rank with more backward passes per step)."""
from __future__ import annotations

import torch

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadOptions, ShardedAdam

# case: (what rank 1 changes, the message's part naming it)
CASES = {
    "state_dtype": ("fp32 moments on rank 0, int8 on rank 1", "state_dtype: 'fp32' on rank 0, 'int8' on rank 1"),
    "lr": ("its own --learning_rate", "group 0 lr: 0.01 on rank 0, 0.03 on rank 1"),
    "max_grad_norm": ("its own clipping", "max_grad_norm: 1.0 on rank 0, 0.01 on rank 1"),
    "gas": ("more backward passes per step", "gradient_accumulation_steps: 1 on rank 0, 2 on rank 1"),
    "extra_param": ("a model with one param more",
                    "group 1: 5 params on rank 0, 6 on rank 1 (the first that differs: param 0, (48,) against (3,))"),
    "vocab": ("an embedding of another size (its own tokenizer)", "group 0 param 0: (50, 24) on rank 0, (64, 24) on "
              "rank 1"),
    "stage": ("stage 1 against stage 2", "stage: 2 on rank 0, 1 on rank 1"),
}


def _build(rank, case):
    torch.manual_seed(0)
    model = TinyNet(vocab=64 if case == "vocab" and rank == 1 else 50)
    if case == "extra_param" and rank == 1:
        model.extra = torch.nn.Parameter(torch.zeros(3))
    differs = rank == 1
    opts = dict(num_threads=1, state_dtype="int8" if case == "state_dtype" and differs else "fp32",
                max_grad_norm=(0.01 if differs else 1.0) if case == "max_grad_norm" else 0.0,
                gradient_accumulation_steps=2 if case == "gas" and differs else 1)
    return model, ShardedAdam(param_groups(model, 0.01), lr=0.03 if case == "lr" and differs else 0.01,
                              stage=1 if case == "stage" and differs else 2, offload=True,
                              options=OffloadOptions(**opts))


def _each_case(rank, world_size):
    out = {}
    for case in [*CASES, "same"]:
        try:
            model, engine = _build(rank, case)
        except ValueError as e:
            out[case] = str(e)
            continue
        ids, labels, use_branch = batches(1)[0]
        loss_fn(model, ids, labels, use_branch).backward()
        engine.step()  # the control trains
        engine.close()
        out[case] = None
    return out


def test_ranks_that_build_different_engines_are_refused_on_every_rank_by_name():
    results = run_distributed(_each_case, world_size=2)
    assert results[0]["same"] is None and results[1]["same"] is None
    for case, (why, named) in CASES.items():
        assert results[0][case] == results[1][case], case  # the same message on both ranks
        message = results[0][case]
        assert message is not None, f"{case}: {why} was not refused"
        assert message.startswith("the 2 ranks built different ShardedAdam engines: "), message
        assert named in message, (case, message)
        assert "the same ds_config, command line and model on every node" in message


def _load_refused_on_one_rank(rank, world_size):
    model, engine = _build(rank, "same")
    for ids, labels, use_branch in batches(2):
        loss_fn(model, ids, labels, use_branch).backward()
        engine.step()
        engine.zero_grad()
    own = engine.state_dict()
    theirs = [own]
    torch.distributed.broadcast_object_list(theirs, src=0)  # rank 1 is handed rank 0's state: refused there
    before = [p.detach().clone() for p in model.parameters()]
    try:
        engine.load_state_dict(theirs[0])
        error = None
    except ValueError as e:
        error = str(e)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    engine.load_state_dict(own)  # every rank still loads a good state, and trains on (both join the collectives)
    ids, labels, use_branch = batches(1, seed=5)[0]
    loss_fn(model, ids, labels, use_branch).backward()
    engine.step()
    engine.close()
    return error, unchanged, [p.detach() for p in model.parameters()]


def test_a_state_dict_refused_on_one_rank_is_refused_on_every_rank():
    """Each rank loads its own dict: one refused on rank 1 only left rank 0 waiting in the load's collective until
    the process group's timeout, which then failed in gloo without the cause. Now every rank raises at once."""
    (e0, same0, p0), (e1, same1, p1) = run_distributed(_load_refused_on_one_rank, world_size=2, collective_timeout=20)
    assert e1.startswith("this state (rank 0 of 2, fp32) holds elements [0, "), e1
    assert "this engine (rank 1 of 2, fp32) holds [" in e1, e1
    assert e0 == "load_state_dict: refused on rank(s) [1] (their error says why); no rank loaded", e0
    assert same0 and same1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def _schedules_apart(rank, world_size):
    """Rank 1's lr (or weight decay) moves away from rank 0's after the build, as a schedule of its own would."""
    out = {}
    for key in ("lr", "weight_decay", "nan", "fp32 tensor", "after grad_norm", "group appended", "same"):
        torch.manual_seed(0)
        model = TinyNet()
        engine = ShardedAdam(param_groups(model, 0.01), lr=0.01, stage=2, offload=True,
                             options=OffloadOptions(num_threads=1))
        before = [p.detach().clone() for p in model.parameters()]
        for k, (ids, labels, use_branch) in enumerate(batches(2)):
            if k == 1 and rank == 1 and key in ("lr", "weight_decay"):
                engine.param_groups[0][key] *= 0.5
            elif k == 1 and rank == 1 and key == "nan":
                engine.param_groups[0]["lr"] = float("nan")
            elif k == 1 and key == "fp32 tensor":  # the same lr as the kernels take it: on rank 1 a float32 tensor
                engine.param_groups[0]["lr"] = torch.tensor(0.003, dtype=torch.float32) if rank else 0.003
            elif k == 1 and rank == 1 and key == "group appended":  # (add_param_group is refused; a list append not)
                engine.param_groups.append({**engine.param_groups[1], "params": []})
            loss_fn(model, ids, labels, use_branch).backward()
            if k == 1 and key == "after grad_norm":  # the Trainer's order: the norm, callbacks, then step()
                engine.grad_norm()
                if rank == 1:
                    engine.param_groups[0]["lr"] = float("nan")
            try:
                engine.step()
            except ValueError as e:
                out[key] = (str(e), engine.global_steps)
                break
            before = [p.detach().clone() for p in model.parameters()]
            engine.zero_grad()
        else:
            out[key] = None
        out[key + " untouched"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        engine.close()
    return out


def test_hyperparameters_that_drift_apart_after_the_build_are_refused_on_every_rank():
    """Ranks with different schedules (--warmup_steps on one node) trained on silently: each rank stepped its own
    shard with its own lr, a model of neither run. Every rank raises at the step where they differ, before it
    moves anything."""
    results = run_distributed(_schedules_apart, world_size=2)
    for rank, r in enumerate(results):
        assert r["same"] is None
        lr_msg, steps = r["lr"]
        assert steps == 1 and r["lr untouched"], rank
        assert "ShardedAdam: param group 0 lr differs across ranks at step 2: from 0.005 to 0.01 (this rank " \
               f"{0.005 if rank else 0.01:g})" in lr_msg and "--warmup_steps" in lr_msg
        assert "param group 0 weight_decay differs across ranks at step 2: from 0.005 to 0.01" in r["weight_decay"][0]
        assert r["fp32 tensor"] is None  # trained both steps
        # a lr gone bad on one rank: it raised there alone, before the collective its peer then waited in
        for key in ("nan", "after grad_norm", "group appended"):
            msg, steps = r[key]
            assert steps == 1 and r[key + " untouched"], (rank, key)
            mine = "lr must be" if key != "group appended" else "is fixed when it is built"
            assert (mine in msg) if rank else ("another rank's param group hyperparameters are invalid" in msg), msg
