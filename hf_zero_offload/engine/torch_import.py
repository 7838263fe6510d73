"""``TorchStateImport``: the engines' ``load_torch_state_dict``, for joining the plugin mid-run: a
``torch.optim.AdamW``/``Adam`` state dict (a plain Trainer's ``optimizer.pt``) into this engine, over the same param
groups. Each rank takes its own slice of every param's moments; the masters come from the weights given (the
checkpoint's, in fp32) or from the params. Built as the engine's own state dict (fp32 moments, the engine's meta with
the torch groups' hyper-parameters and step counts) and loaded through ``_load_state_dict``, so everything its load
checks is checked here too, before the first write, and int8/bf16 engines convert as a load of an fp32 state does.
"""
from __future__ import annotations

import logging
import numbers
import reprlib

import torch

from .group_flags import value
from .runs import FlatIndex

logger = logging.getLogger("hf_zero_offload")

#: torch group flags whose update the engine does not compute (it refuses them when built from such groups too)
_UNSUPPORTED = ("amsgrad", "maximize")
#: what the groups of torch's other optimizers hold and Adam's/AdamW's do not (SGD, NAdam, RAdam, Adagrad, RMSprop...)
_OTHER_OPTIMIZERS = ("momentum", "dampening", "nesterov", "momentum_decay", "lr_decay",
                     "initial_accumulator_value", "alpha", "centered", "lambd", "etas", "step_sizes")
_ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}


class TorchStateImport:
    @torch.no_grad()
    def load_torch_state_dict(self, state_dict: dict, weights: list[torch.Tensor] | None = None) -> None:
        """Load torch.optim.AdamW's (or Adam's) ``state_dict()`` of an optimizer over the same param groups (the same
        params, in the same order; torch numbers them group after group). ``weights``: the fp32 values of the
        params in that order (the masters; None: the params as they are). Every rank calls it with the whole dict."""
        self.check_open("load_torch_state_dict()")
        where = "torch optimizer state dict"
        groups, ids = self._torch_groups(state_dict, where)
        flat = [p for p, _, _ in self._flat]
        if weights is not None and (len(weights) != len(flat) or any(
                not torch.is_tensor(w) or w.numel() != p.numel() for w, p in zip(weights, flat))):
            raise ValueError(f"load_torch_state_dict: weights must be {len(flat)} tensors of the params' sizes")
        steps, moments = [], []
        for pid, p in zip(ids, flat):
            st = state_dict["state"].get(pid, {})
            steps.append(self._torch_step(st, pid, p, where))
            moments.append(self._torch_moments(st, pid, p, where) if steps[-1] else None)
        meta = self.state_meta()
        meta["param_groups"] = [self._our_group(g, mine, i) for i, (g, mine) in enumerate(zip(groups, meta["param_groups"]))]
        meta.update(param_steps=steps, global_steps=max(steps, default=0), needs_publish=False, state_dtype="fp32")
        meta.pop("int8_codes", None)
        n = self.hi - self.lo
        tensors = {"master": self.master[:n].clone(), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        index = {id(p): i for i, p in enumerate(flat)}
        for p, off, a, b in FlatIndex(self._flat).pieces(self.lo, self.hi):  # this rank's slice of each param
            i, dst = index[id(p)], slice(a - self.lo, b - self.lo)
            if weights is not None:
                tensors["master"][dst] = weights[i].detach().reshape(-1)[a - off:b - off].float()
            if moments[i] is not None:
                tensors["exp_avg"][dst] = moments[i][0][a - off:b - off]
                tensors["exp_avg_sq"][dst] = moments[i][1][a - off:b - off]
        self._load_state_dict({**meta, **tensors})
        logger.info("hf_zero_offload: loaded a torch optimizer's state (%d of %d params with moments, step %d)",
                    sum(1 for s in steps if s), len(steps), meta["global_steps"])

    def _torch_groups(self, state_dict, where: str) -> tuple[list[dict], list]:
        """The torch groups, checked, and the torch id of each param of the engine's flat layout (``_flat`` order).
        The torch optimizer may list the params frozen when the engine was built, as the engine's own groups do (both
        built over ``model.parameters()``: a frozen param has its id there, and no state the engine could step), or
        the trainable ones alone (the Trainer's groups); such an optimizer was refused as "built otherwise"."""
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
                and isinstance(state_dict.get("param_groups"), list)) or "format" in state_dict:
            got = ("this engine's own state_dict(): load it with load_state_dict" if isinstance(state_dict, dict)
                   and "format" in state_dict else reprlib.repr(state_dict))
            raise TypeError(f"load_torch_state_dict: expected a torch optimizer's state_dict() ({{'state': ..., "
                            f"'param_groups': [...]}}), got {got}")
        groups = state_dict["param_groups"]
        sizes = [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups]
        mine, listed = [len(g) for g in self._slots], [len(g["params"]) for g in self.param_groups]
        if sizes not in (mine, listed):
            counts = f"{mine}" if mine == listed else f"{listed}, of which {mine} trainable when it was built"
            raise ValueError(f"{where}: param groups of {sizes} params; this engine's are {counts} (the same params in "
                             "the same groups, in order: the optimizer the state was saved from was built otherwise)")
        not_adam(state_dict, where)
        if sizes == mine:
            return groups, [i for g in groups for i in g["params"]]
        trainable = {id(p) for p, _, _ in self._flat}
        return groups, [i for g, mine_g in zip(groups, self.param_groups)
                        for i, p in zip(g["params"], mine_g["params"]) if id(p) in trainable]

    @staticmethod
    def _torch_step(st, pid, p, where: str) -> int:
        if not isinstance(st, dict):
            raise ValueError(f"{where}: state of param {pid} is {type(st).__name__}, expected a dict")
        if not st:
            return 0  # torch keeps no state for a param that never stepped
        step = st.get("step")
        value = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 1
                or value != int(value) or value >= 2**53):
            raise ValueError(f"{where}: state of param {pid} (shape {tuple(p.shape)}): step must be a whole number "
                             f">= 1, got {step!r}")
        return int(value)

    @staticmethod
    def _torch_moments(st: dict, pid, p, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for k in ("exp_avg", "exp_avg_sq"):
            v = st.get(k)
            if not (torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape):
                got = f"{str(v.dtype)[6:]} of shape {tuple(v.shape)}" if torch.is_tensor(v) else repr(v)[:40]
                raise ValueError(f"{where}: state of param {pid}: {k} must be a float tensor of the param's shape "
                                 f"{tuple(p.shape)}, got {got}")
            out.append(v.detach().reshape(-1))  # (converted to fp32 on the host by the slice assignment: this rank's)
        return out[0], out[1]

    @staticmethod
    def _our_group(g: dict, mine: dict, i: int) -> dict:
        """A torch group's hyper-parameters as the engine's meta holds them (its own param names kept)."""
        out = dict(mine)
        for k in ("lr", "eps", "weight_decay", "initial_lr"):
            if k in g:
                out[k] = value(g[k])
        if "betas" in g:
            out["betas"] = [value(b) for b in g["betas"]]
        if "decoupled_weight_decay" in g:
            out["adamw_mode"] = bool(g["decoupled_weight_decay"])
        elif g.get("weight_decay"):  # torch before 2.7 wrote no such key: Adam's and AdamW's dicts look alike
            logger.info("hf_zero_offload: param_groups[%d] of the torch state does not say whether its weight decay "
                        "was decoupled (saved by torch < 2.7): the engine's own mode is kept (adamw_mode=%s)", i,
                        out.get("adamw_mode"))
        return out


def not_adam(state_dict: dict, where: str) -> None:
    """A ValueError when ``state_dict`` (torch's outline checked) is another torch optimizer's than Adam/AdamW: its
    moments would be taken for Adam's (an SGD checkpoint resumed with fresh moments and a wrong message, NAdam's
    mu_product dropped)."""
    for i, g in enumerate(state_dict["param_groups"]):
        if not isinstance(g, dict):
            continue
        for flag in _UNSUPPORTED:  # Adam's, named as such (its state holds max_exp_avg_sq)
            if g.get(flag):
                raise ValueError(f"{where}: param_groups[{i}] has {flag}=True, which the engine does not compute")
        for flag in ("bias_correction", "correct_bias"):  # apex FusedAdam's, transformers' old AdamW's
            if g.get(flag, True) is False:
                raise ValueError(f"{where}: param_groups[{i}] has {flag}=False; the engine always corrects the bias")
        other = [k for k in _OTHER_OPTIMIZERS if k in g] + [f"no {k}" for k in ("betas", "eps") if k not in g]
        # RAdam's groups look like Adam's but lack amsgrad, which torch's Adam/AdamW always write (transformers' old
        # AdamW and apex's FusedAdam write correct_bias / bias_correction instead); NAdam's and Adamax's state hold
        # mu_product / exp_inf
        other += [] if {"amsgrad", "correct_bias", "bias_correction"} & set(g) else ["no amsgrad"]
        other += sorted({k for st in state_dict["state"].values() if isinstance(st, dict) for k in st} - _ADAM_STATE)
        if other:
            raise ValueError(f"{where}: not the state of torch.optim.Adam/AdamW (param_groups[{i}] or the state has "
                             f"{', '.join(map(str, other[:4]))}): its moments are another optimizer's, and an Adam step "
                             "from them would be neither that optimizer's nor Adam's; resume that run with its own "
                             "optimizer, or start a new run from its weights")
