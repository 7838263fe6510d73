"""Leaving the plugin mid-run: a checkpoint of ours as torch.optim.AdamW's state (``torch_state``) and as a checkpoint
the plain Trainer resumes (``hf-zero-offload consolidate --with-optimizer``)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from _models import TinyNet, batches, param_groups, run_steps, save_as_two_ranks
from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments, ops
from hf_zero_offload.cli import main as cli_main
from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.torch_state import for_params, torch_optimizer_state

LR, WD = 1e-2, 0.01


def _engine(model, state_dtype):
    return OffloadAdam(param_groups(model, WD), lr=LR, betas=(0.8, 0.99), eps=1e-7,
                       options=OffloadOptions(bucket_numel=1200, tile_numel=300, num_threads=1,
                                              state_dtype=state_dtype))


def _no_branch(data):  # the branch takes no gradient: its params never step, and torch keeps no state for them
    return [(ids, labels, False) for ids, labels, _ in data]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_state_is_torch_adamws_with_each_params_moments_and_steps(tmp_path, state_dtype):
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, state_dtype)
    run_steps(model, opt, _no_branch(batches(2)) + batches(3, seed=1))  # branch: 2 steps of 5 (i % 3 != 2)
    save_as_two_ranks(opt, tmp_path / "state")  # a slot across the cut, as a 2-rank ZeRO run's files hold it
    sd = torch_optimizer_state(str(tmp_path / "state"))
    m, v = ops.state_to_fp32(opt.state_tensors())
    groups = param_groups(model, WD)
    params = [p for g in groups for p in g["params"]]
    n0 = len(groups[0]["params"])  # numbered as torch numbers them: group after group
    assert [g["params"] for g in sd["param_groups"]] == [list(range(n0)), list(range(n0, len(params)))]
    slots = [s for g in opt._slots for s in g]
    for pid, (p, (q, off, n)) in enumerate(zip(params, slots)):
        assert p is q
        st = sd["state"][pid]
        assert st["step"].dtype == torch.float32 and st["step"].item() == (2 if p is model.branch.weight
                                                                            or p is model.branch.bias else 5)
        assert torch.equal(st["exp_avg"], m[off:off + n].view(p.shape))  # int8: decoded as the kernel decodes
        assert torch.equal(st["exp_avg_sq"], v[off:off + n].view(p.shape))
    for g in sd["param_groups"]:
        assert g["betas"] == (0.8, 0.99) and g["eps"] == 1e-7 and g["lr"] == LR and g["decoupled_weight_decay"]
        assert not g["amsgrad"] and not g["maximize"]
    assert [g["weight_decay"] for g in sd["param_groups"]] == [WD, 0.0]
    opt.close()


def test_torch_adamw_goes_on_from_it_as_the_engine_does(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, "fp32")
    run_steps(model, opt, _no_branch(batches(3)))
    save_as_two_ranks(opt, tmp_path / "two")
    sd = torch_optimizer_state(str(tmp_path / "two"))
    params = [p for g in param_groups(model, WD) for p in g["params"]]
    unstepped = {i for i, p in enumerate(params) if p is model.branch.weight or p is model.branch.bias}
    assert len(unstepped) == 2 and set(sd["state"]) == set(range(len(params))) - unstepped
    twin = copy.deepcopy(model)  # fp32 params: the masters
    torch_opt = torch.optim.AdamW(param_groups(twin, WD), lr=LR, foreach=False)
    torch_opt.load_state_dict(sd)
    fresh_twin = copy.deepcopy(model)
    fresh = torch.optim.AdamW(param_groups(fresh_twin, WD), lr=LR, betas=(0.8, 0.99), eps=1e-7, foreach=False)
    data = batches(4, seed=3)  # the branch's first steps too: torch starts its state then, as the engine counts it
    run_steps(model, opt, data)
    run_steps(twin, torch_opt, data)
    run_steps(fresh_twin, fresh, data)
    for (name, a), b, c in zip(model.named_parameters(), twin.parameters(), fresh_twin.parameters()):
        # (a last-bit difference of torch's own AdamW between CPUs: 1 ulp of a weight in [2, 4) is 2.4e-7 on AVX2)
        torch.testing.assert_close(b, a, rtol=2 ** -23, atol=2e-7, msg=name)
    assert max((a - c).abs().max().item() for a, c in zip(model.parameters(), fresh_twin.parameters())) > 1e-3
    opt.close()


def _with_frozen(model, wd):  # the run's groups with the frozen params listed too, as a hand-built AdamW has them
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": wd}, {"params": [p for p in model.parameters() if p.dim() < 2],
                                                     "weight_decay": 0.0}]


@pytest.mark.parametrize("built_over", ["parameters", "groups-with-frozen", "optimizer", "trainable-only"])
def test_an_adamw_with_the_frozen_params_in_its_groups_loads_it_and_goes_on_as_the_engine(tmp_path, built_over):
    """TinyNet has a frozen layer: the export numbered the trainable params alone, so an AdamW over
    model.parameters() (frozen ones listed) refused it with torch's group-size error. ``params=`` numbers it for
    the AdamW's params; element by element it then goes on as the engine does (AdamW(foreach=False))."""
    torch.manual_seed(0)
    model = TinyNet()
    one_group = built_over == "parameters"
    opt = OffloadAdam(model.parameters() if one_group else param_groups(model, WD), lr=LR, weight_decay=WD,
                      options=OffloadOptions(bucket_numel=1200, tile_numel=300, num_threads=1))
    run_steps(model, opt, _no_branch(batches(3)))
    save_as_two_ranks(opt, tmp_path / "state")
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(twin.parameters() if one_group else _with_frozen(twin, WD)
                                  if built_over != "trainable-only" else param_groups(twin, WD), lr=LR, foreach=False)
    given = {"parameters": twin.parameters(), "groups-with-frozen": _with_frozen(twin, WD),
             "optimizer": torch_opt, "trainable-only": None}[built_over]
    if built_over != "trainable-only":
        with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):  # torch's own words
            copy.deepcopy(torch_opt).load_state_dict(torch_optimizer_state(str(tmp_path / "state")))
    sd = torch_optimizer_state(str(tmp_path / "state"), params=given)
    torch_opt.load_state_dict(sd)
    frozen = {id(p) for p in twin.frozen.parameters()}
    assert all(p not in torch_opt.state for g in torch_opt.param_groups for p in g["params"] if id(p) in frozen)
    data = batches(4, seed=3)
    run_steps(model, opt, data)
    run_steps(twin, torch_opt, data)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, rtol=2 ** -23, atol=2e-7, msg=name)
    opt.close()


def test_params_that_are_not_the_runs_are_refused_by_name(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, "fp32")
    run_steps(model, opt, batches(2))
    sd = torch_optimizer_state(str(_saved(opt, tmp_path)))
    with pytest.raises(ValueError, match=r"2 param group\(s\) .*the params given 1: build the AdamW over the run"):
        for_params(sd, model.parameters())
    model.frozen.requires_grad_(True)  # not frozen as in the run
    with pytest.raises(ValueError, match=r"param group 0: 5 trainable param\(s\) given .*freeze the params"):
        for_params(sd, _with_frozen(model, WD))
    model.frozen.requires_grad_(False)
    groups = _with_frozen(model, WD)
    groups[0]["params"] = groups[0]["params"][::-1]
    with pytest.raises(ValueError, match=r"a trainable param of shape .*give the run's params, in its order"):
        for_params(sd, groups)
    with pytest.raises(TypeError, match="params: the params the AdamW was built over"):
        for_params(sd, [1, 2])
    opt.close()


def _saved(opt, path):
    opt.save_checkpoint(str(path / "s"))
    return path / "s"


def test_an_early_state_without_steps_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, "fp32")
    run_steps(model, opt, batches(1))
    meta = {k: v for k, v in opt.state_meta().items() if k != "param_steps"}
    from hf_zero_offload.engine import checkpoint
    os.makedirs(tmp_path / "old")
    checkpoint.write_state(checkpoint.rank_file(str(tmp_path / "old"), 0, 1), meta, opt.state_tensors())
    with pytest.raises(ValueError, match=r"early version of hf_zero_offload .*resume it with hf_zero_offload"):
        torch_optimizer_state(str(tmp_path / "old"))
    opt.close()


COMMON = dict(per_device_train_batch_size=4, max_steps=6, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              disable_tqdm=True, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2, save_strategy="steps",
              save_steps=3)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    root = tmp_path_factory.mktemp("ours")
    model = tiny_t5(0)
    zero = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(root / "run"), zero_offload=zero, **COMMON)
    ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset()).train()
    return model, root / "run" / "checkpoint-3"


def _plain_resume(output_dir, checkpoint):
    model = tiny_t5(1)  # another init: everything comes from the checkpoint
    args = Seq2SeqTrainingArguments(output_dir=str(output_dir), optim="adamw_torch", **COMMON)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return model, trainer


def test_the_plain_trainer_resumes_a_checkpoint_converted_with_its_optimizer(ours, tmp_path, capsys):
    model, ckpt = ours
    out = tmp_path / "torch"
    assert cli_main(["consolidate", "--with-optimizer", str(ckpt), str(out)]) == 0
    assert "resume it with the plain Trainer" in capsys.readouterr().out
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth", "model.safetensors",
            "config.json"} <= set(os.listdir(out))
    assert "hzo_complete.json" not in os.listdir(out) and "zero_offload" not in os.listdir(out)
    resumed, trainer = _plain_resume(tmp_path / "plain", out)
    assert trainer.state.global_step == 6
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    # without the moments (and so, in transformers, without the schedule) it is another run
    os.remove(out / "optimizer.pt")
    restarted, _ = _plain_resume(tmp_path / "plain2", out)
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), restarted.parameters())) > 1e-3


def test_the_plain_trainer_resumes_the_position_of_a_scheduler_block(tmp_path, capsys):
    """Every shipped config has a WarmupLR block, whose scheduler.pt (its position) the plain Trainer's LambdaLR
    failed to load (KeyError: 'lr_lambdas', a raw traceback). It loads now, and with the Trainer's schedule of the
    block's shape (WarmupLR linear = constant_with_warmup) the resumed run is the uninterrupted one."""
    model = tiny_t5(0)
    zero = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_min_lr": 0,
                                                         "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), zero_offload=zero, **COMMON)
    ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset()).train()
    out = tmp_path / "torch"
    assert cli_main(["consolidate", "--with-optimizer", str(tmp_path / "run" / "checkpoint-3"), str(out)]) == 0
    assert "goes on from that step with its own --lr_scheduler_type" in capsys.readouterr().out
    resumed = tiny_t5(1)
    trainer = Seq2SeqTrainer(model=resumed, train_dataset=ToyDataset(), args=Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "plain"), optim="adamw_torch", lr_scheduler_type="constant_with_warmup", **COMMON))
    trainer.train(resume_from_checkpoint=str(out))
    assert trainer.state.global_step == 6
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_with_optimizer_refuses_an_output_that_is_not_empty_and_a_changed_trainer_file(ours, tmp_path):
    _, ckpt = ours
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["consolidate", "--with-optimizer", str(ckpt), str(out)]) == 2
    assert os.listdir(out) == ["notes.txt"]
    copy_dir = tmp_path / "ckpt"
    os.makedirs(copy_dir)
    for root, _, files in os.walk(ckpt):
        for f in files:
            src = os.path.join(root, f)
            dst = copy_dir / os.path.relpath(src, ckpt)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(open(src, "rb").read())
    state = json.loads((copy_dir / "trainer_state.json").read_text())
    state["global_step"] = 5
    (copy_dir / "trainer_state.json").write_text(json.dumps(state))
    assert cli_main(["consolidate", str(copy_dir), str(tmp_path / "weights")]) == 0  # weights alone do not read it
    assert cli_main(["consolidate", "--with-optimizer", str(copy_dir), str(tmp_path / "all")]) == 2
    assert not os.path.exists(tmp_path / "all")


def _import_job(rank, world, stage, offload, state_dtype):
    """Each rank takes its shard of a torch AdamW state (3 steps of one process) and goes on as torch does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hf_zero_offload.engine import ShardedAdam
    torch.manual_seed(0)
    model = TinyNet()
    ref = torch.optim.AdamW(param_groups(model, WD), lr=LR, betas=(0.8, 0.99), foreach=False)
    run_steps(model, ref, _no_branch(batches(3)))  # the same on every rank: a one-process run's state
    ours = copy.deepcopy(model)
    engine = ShardedAdam(param_groups(ours, WD), lr=1.0, options=OffloadOptions(
        bucket_numel=1200, tile_numel=300, num_threads=1, state_dtype=state_dtype), stage=stage, offload=offload)
    engine.load_torch_state_dict(ref.state_dict())
    ddp = DDP(model, find_unused_parameters=True)
    data = batches(4, seed=3 + rank)  # each rank its own batches: the average is what DDP steps on
    for ids, labels, use_branch in data:
        from _models import loss_fn
        loss_fn(ddp, ids, labels, use_branch).backward()
        ref.step()
        ref.zero_grad()
    run_steps(ours, engine, data)
    engine.close()
    dist.barrier()
    # the distance beyond 1 ulp of each weight (torch's AdamW rounds its last bit differently on AVX2 and AVX512)
    return [((a - b).abs() - 2 ** -23 * a.abs()).max().item() for a, b in zip(model.parameters(), ours.parameters())]


@pytest.mark.parametrize("stage, offload, state_dtype", [(2, True, "fp32"), (1, False, "fp32"), (2, True, "int8")])
def test_sharded_engines_take_their_shard_of_a_torch_state(stage, offload, state_dtype):
    from _dist import run_distributed
    diffs = run_distributed(_import_job, stage, offload, state_dtype, world_size=2)
    worst = max(max(d) for d in diffs)
    assert worst < (8e-3 if state_dtype == "int8" else 2e-7), worst  # int8: its own rounding (3.6e-3 here)
    assert diffs[0] == diffs[1]


@pytest.mark.parametrize("other", [torch.optim.SGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                                   torch.optim.RMSprop])
def test_another_optimizers_state_is_refused_by_name(other):
    """An SGD checkpoint was taken over as Adam's with fresh moments (and a message about torch < 2.6); NAdam's and
    RAdam's loaded as Adam's (mu_product dropped, the rectification lost)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = other(param_groups(model, WD), lr=1e-2, **({"momentum": 0.9} if other is torch.optim.SGD else {}))
    run_steps(model, opt, batches(2))
    engine = _engine(copy.deepcopy(model), "fp32")
    before = engine.state_tensors()["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"not the state of torch.optim.Adam/AdamW"):
        engine.load_torch_state_dict(opt.state_dict())
    assert torch.equal(engine.state_tensors()["exp_avg"], before)
    engine.close()


def test_an_engine_group_given_the_torch_way_is_l2_adam():
    """{"decoupled_weight_decay": False} in a group was refused as contradicting adamw_mode=True, set by no one."""
    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    groups = [{**g, "decoupled_weight_decay": False} for g in param_groups(model, 0.1)]
    engine = OffloadAdam(groups, lr=LR, options=OffloadOptions(num_threads=1))
    torch_opt = torch.optim.Adam(param_groups(ref, 0.1), lr=LR, foreach=False)
    run_steps(model, engine, batches(3))
    run_steps(ref, torch_opt, batches(3))
    assert all(g["adamw_mode"] is False for g in engine.param_groups)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)
    engine.close()


@pytest.mark.parametrize("edit, said", [
    (lambda g: g.update(amsgrad=True), r"param_groups\[0\] has amsgrad=True, which the engine does not compute"),
    (lambda g: (g.pop("amsgrad"), g.update(bias_correction=False)),
     r"param_groups\[0\] has bias_correction=False; the engine always corrects the bias"),
    (lambda g: (g.pop("amsgrad"), g.update(bias_correction=True)), None),  # apex/DeepSpeed FusedAdam: Adam's
    (lambda g: (g.pop("amsgrad"), g.update(correct_bias=True)), None),     # transformers' old AdamW (adamw_hf)
], ids=["amsgrad", "no-bias-correction", "fused-adam", "adamw-hf"])
def test_adams_of_other_libraries_load_and_their_flags_are_named(edit, said):
    """An amsgrad state was called 'not Adam' (its max_exp_avg_sq); apex's FusedAdam and transformers' old AdamW
    (no amsgrad key) were refused as another optimizer's; bias_correction=False loaded as bias-corrected Adam."""
    torch.manual_seed(0)
    model = TinyNet()
    ref = torch.optim.AdamW(param_groups(model, WD), lr=LR, foreach=False)
    run_steps(model, ref, batches(1))
    sd = ref.state_dict()
    for g in sd["param_groups"]:
        edit(g)
    engine = _engine(copy.deepcopy(model), "fp32")
    if said is None:
        engine.load_torch_state_dict(sd)
    else:
        with pytest.raises(ValueError, match=said):
            engine.load_torch_state_dict(sd)
    engine.close()
