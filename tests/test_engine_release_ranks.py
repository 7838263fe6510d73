"""Engine replacement on 2 gloo ranks (engine/lifetime.py): a replacement runs no collective of its own.

Both ranks replacing (a new Trainer on every rank) trains as DDP + a fresh torch AdamW from the model's weights; one
rank replacing alone is a user error that fails (a gloo timeout, here 4 s), the peer naming the rank that replaced
its engine (engine/sharded/peers.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from _models import TinyNet, batches, param_groups, run_steps
from hf_zero_offload.engine import OffloadOptions, ShardedAdam


def _engine(model, stage):
    return ShardedAdam(param_groups(model, 0.01), lr=1e-2, stage=stage,
                       options=OffloadOptions(num_threads=1, bucket_numel=1200))


def _both_replace_job(rank, world):
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = TinyNet()
        ref = DDP(TinyNet())
        ref.module.load_state_dict(model.state_dict())
        data = batches(4, seed=10 + rank)
        run_steps(model, _engine(model, stage), data[:2])
        ref_opt = torch.optim.AdamW(param_groups(ref.module, 0.01), lr=1e-2, foreach=False)
        run_steps(ref.module, _Ddp(ref, ref_opt), data[:2])
        engine = _engine(model, stage)  # every rank replaces: a fresh Adam from the weights as they are
        run_steps(model, engine, data[2:])
        ref_opt = torch.optim.AdamW(param_groups(ref.module, 0.01), lr=1e-2, foreach=False)
        run_steps(ref.module, _Ddp(ref, ref_opt), data[2:])
        engine.close()
        out[stage] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters()))
    return out


class _Ddp:
    """run_steps' optimizer over the DDP-wrapped module: the DDP forward reduces (run_steps calls the module's)."""

    def __init__(self, ddp, opt):
        self.ddp, self.opt = ddp, opt

    def step(self):
        for p in self.ddp.module.parameters():  # DDP's average, done by hand (run_steps calls the bare module)
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)


def test_both_ranks_replacing_train_as_ddp_with_a_fresh_adamw():
    for out in run_distributed(_both_replace_job, timeout=60, collective_timeout=10):
        assert all(d < 1e-5 for d in out.values()), out


def _one_replaces_job(rank, world):
    torch.manual_seed(0)
    model = TinyNet()
    engine = _engine(model, 2)
    data = batches(4, seed=10 + rank)
    run_steps(model, engine, data[:2])
    try:
        if rank == 0:
            engine = _engine(model, 2)
        run_steps(model, engine, data[2:])
    except RuntimeError as e:
        return str(e)
    return None


def test_one_rank_replacing_alone_fails_within_the_collective_timeout_naming_it():
    said = run_distributed(_one_replaces_job, timeout=40, collective_timeout=4)
    assert all(s is not None and ("Timed out" in s or "Connection" in s) for s in said), said
    # rank 1, in its backward's reduction, names what rank 0 did (it used to say gloo's words alone)
    assert said[1].startswith("rank 0 (host ") and "began to build a new engine on the parameters of its ShardedAdam " \
        "after its step 2" in said[1], said[1]
