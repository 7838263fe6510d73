"""The engines against gradients a torch.optim user (or test suite) hands any optimizer: gradients that did
not come from backward (on one rank, or all), zero_grad() between backward and step, sparse gradients, a param cast
or a grad of another dtype at backward, torch's GradScaler, micro-batches summed in 16 bits, OffloadAdam under a
process group. Each is refused by name before anything changes, or behaves as torch.optim does."""
from __future__ import annotations

import pytest
import torch

from _models import TinyNet, param_groups
from _engine_inputs import KINDS, _backward, _engine
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_grad_the_engine_would_ignore_is_refused_before_the_step(kind):
    """A param frozen when the engine was built then unfrozen (gradual unfreezing), or (an engine
    that takes gradients from backward) a .grad assigned by hand: torch.optim would step these
    params; the engine used to skip them silently."""
    model, engine = _engine(kind, lambda m, wd: m.parameters())  # the frozen layer's params included
    frozen = model.frozen.weight
    frozen.requires_grad_(True)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"a \(24, 24\) param has a .grad but was frozen"):
        engine.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and engine.global_steps == 0
    frozen.grad = None
    engine.step()  # the gradients of that backward are still there
    assert not torch.equal(model.body[0].weight, before[3]) and torch.equal(frozen, before[1])
    model.body[0].weight.grad = torch.ones_like(model.body[0].weight)
    if kind != "zero0":
        with pytest.raises(ValueError, match=r"a \(48, 24\) param has a .grad that the engine did not take "
                                             r"from backward"):
            engine.step()
    else:  # stage 0 and 1 take the gradients from .grad at step(): used as torch.optim would
        engine.step()
    engine.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_grad_between_backward_and_step_drops_the_gradients(kind):
    """As torch.optim: the step after zero_grad() updates nothing; it used to apply the gradients
    the engine had already taken from backward."""
    model, engine = _engine(kind)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    engine.zero_grad()
    engine.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    _backward(model, 1)  # and the next window works as usual
    engine.step()
    assert not torch.equal(model.body[0].weight, before[3])
    engine.close()


def _stray_on_rank_0(rank, world_size):
    torch.manual_seed(0)
    model = TinyNet()
    engine = ShardedAdam(param_groups(model, 0.01), stage=2, offload=True, lr=1e-2,
                         options=OffloadOptions(num_threads=1))
    _backward(model, rank)
    if rank == 0:
        model.norm.weight.grad = torch.ones_like(model.norm.weight)
    try:
        engine.step()
    except ValueError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_a_grad_ignored_on_one_rank_is_an_error_on_every_rank():
    """Checked inside the step's one small collective: every rank raises after it (one rank raising
    before it would leave the others waiting in it)."""
    from _dist import run_distributed

    errors = run_distributed(_stray_on_rank_0, world_size=2)
    assert "a (24,) param has a .grad that the engine did not take from backward" in errors[0]
    assert "another rank holds a .grad the engine would ignore" in errors[1]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sparse_gradients_are_refused_by_name(kind):
    """An nn.Embedding(sparse=True) failed with torch's "reshape is not implemented for sparse tensors" from inside
    backward (offload, ZeRO-2) or at step (ZeRO-0): CPUAdam's refusal, by name."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    cls, extra = KINDS[kind]
    opt = cls(emb.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    with pytest.raises(TypeError, match=r"the engines do not support sparse gradients: the grad of a \(10, 4\) param "
                                        r"is torch.sparse_coo \(nn.Embedding\(sparse=True\)\? use sparse=False\)"):
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_a_param_cast_after_the_engine_was_built_is_named_at_backward(kind):
    """SwitchTransformers' router casts its classifier to router_dtype (fp32) in forward: a bf16 run failed with
    "gradient dtype torch.float32 differs from the engine's torch.bfloat16", naming no param. A user's own
    model.to(dtype) after the build was told of router_dtype alone (an outside probe)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).bfloat16()
    cls, extra = KINDS[kind]
    opt = cls(list(net.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    net[1].float()
    with pytest.raises(TypeError, match=r"the gradient of parameter 1\.(weight|bias) \(shape \((1, 4|1,)\)\) is "
                                        r"torch.float32, and the engine trains in torch.bfloat16: something cast the "
                                        r"param after the engine was built: a model\.to\(torch\.float32\) \(cast the "
                                        r"model first, then build the engine\).*router_dtype='bfloat16'"):
        net[1](net[0](torch.randn(2, 4, dtype=torch.bfloat16)).float()).sum().backward()
    opt.close()


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype is torch's from 2.9")
@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_a_grad_dtype_other_than_the_params_is_named_at_backward(kind):
    """p.grad_dtype = torch.float32 on a bf16 param (torch's way to accumulate in fp32) was told as a cast of the
    param after the build (model.to, router_dtype), which had not happened."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).bfloat16()
    cls, extra = KINDS[kind]
    opt = cls(list(net.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    net.weight.grad_dtype = torch.float32
    with pytest.raises(TypeError, match=r"the gradient of parameter weight \(shape \(1, 4\)\) is torch.float32, and "
                                        r"the engine trains in torch.bfloat16: the param is torch.bfloat16, but its "
                                        r"grad_dtype is torch.float32 .*set p.grad_dtype = torch.bfloat16"):
        net(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero2", "zero0"])
def test_torch_grad_scaler_is_refused_naming_the_engines_own_scaling(kind):
    """GradScaler.step failed with torch's "No inf checks were recorded for this optimizer" (the engine had taken and
    freed every .grad), naming neither the engine nor its own loss scaling."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    cls, extra = KINDS[kind]
    opt = cls(list(lin.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in lin.parameters()]
    scaler.scale(lin(torch.randn(2, 4)).square().mean()).backward()
    why = (r"the engine unscales .grad and checks it for overflow at step\(\)" if kind == "zero0" else
           r"the engine takes each gradient during backward")  # (stage 0 keeps .grad: it was said to free it)
    with pytest.raises(RuntimeError, match=rf"torch.amp.GradScaler with {cls.__name__}: {why}.*"
                                           r"engine.scale_loss\(loss\)"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    # the refusal leaves the engine as it was: GradScaler's found_inf/grad_scale (it deletes them only after a step
    # that returns) made every later plain step() refused as GradScaler's, in a notebook that dropped the scaler
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    lin(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "sharded"])
def test_micro_batches_summed_in_16_bits_without_the_option_are_said_once(kind, caplog):
    """An outside probe (Accelerate loop, bf16 model, 3 micro-batches per step with the default
    gradient_accumulation_steps=1): summed in bf16, 2.8% from an fp32 sum after 8 steps, without a word."""
    def run(gas, micro):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        opts = OffloadOptions(gradient_accumulation_steps=gas, bucket_numel=64)
        opt = (OffloadAdam(model.parameters(), lr=1e-2, options=opts) if kind == "offload" else
               ShardedAdam(model.parameters(), lr=1e-2, options=opts, stage=2, offload=True))
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_zero_offload"):
            for _ in range(3):
                for _ in range(micro):
                    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
                opt.step()
                opt.zero_grad()
        opt.close()
        return [r.getMessage() for r in caplog.records if "summed in bfloat16" in r.getMessage()]

    said = run(1, 3)
    assert len(said) == 1 and "3 or more backward passes" in said[0] and "gradient_accumulation_steps=3" in said[0]
    assert run(3, 3) == [] and run(1, 1) == []


def _offload_adam_messages(rank, world_size):
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("hf_zero_offload")
    log.addHandler(handler)
    try:
        OffloadAdam(torch.nn.Linear(4, 2).parameters(), options=OffloadOptions(num_threads=1)).close()
    finally:
        log.removeHandler(handler)
    return said


def test_offload_adam_under_a_process_group_says_it_averages_nothing(caplog):
    """An OffloadAdam per rank of a data-parallel loop trained each rank's own copy, which drifted apart (0.076 after a
    few steps) without a word (an outside probe); one process says nothing."""
    from _dist import run_distributed

    for said in run_distributed(_offload_adam_messages, world_size=2):
        assert any("OffloadAdam is one process's engine and averages no gradient across the 2 ranks of this process "
                   "group: for data parallelism use ShardedAdam(..., offload=True)" in s for s in said), said
    assert not any("averages no gradient" in s for s in _offload_adam_messages(0, 1))
