"""Test helpers: train a model with and without recomputation and compare everything."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_replay.state import PLAIN_TYPES


def snapshot_state(model: nn.Module) -> dict[str, object]:
    """Every piece of state a user could observe: params, buffers, tensor attrs, generators,
    plain Python attributes."""
    out: dict[str, object] = {}
    for mname, mod in model.named_modules():
        p = f"{mname}." if mname else ""
        for k, v in mod.__dict__.items():
            if k in ("_parameters", "_buffers"):
                for kk, t in v.items():
                    if t is not None:
                        out[p + kk] = t.detach().clone()
            elif isinstance(v, torch.Tensor):
                out[p + k] = v.detach().clone()
            elif isinstance(v, torch.Generator):
                out[p + k] = v.get_state()
            elif type(v) in PLAIN_TYPES and not k.startswith("_"):
                out[p + k] = v
    return out


def assert_same_state(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: state names differ {set(a) ^ set(b)}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {k} metadata differs"
            assert torch.equal(x, y), f"{what}: {k} differs (max {(x.double() - y.double()).abs().max()})"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def train_steps(model: nn.Module, make_input: Callable[[int], torch.Tensor], steps: int,
                lr: float = 0.05, rng_seed: int | None = 100):
    """SGD steps; returns the per-step gradients (name -> tensor) and losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, losses = [], []
    for step in range(steps):
        if rng_seed is not None:
            torch.manual_seed(rng_seed + step)
        opt.zero_grad(set_to_none=True)
        out = model(make_input(step))
        loss = (out.float() ** 2).mean()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        losses.append(loss.item())
        opt.step()
    return grads, losses


def grads_equal(ga: list[dict], gb: list[dict]) -> list[tuple[int, str]]:
    """(step, name) of every gradient that is not bit-identical."""
    bad = []
    for step, (a, b) in enumerate(zip(ga, gb)):
        for n in a.keys() | b.keys():
            if n not in a or n not in b or not torch.equal(a[n], b[n]):
                bad.append((step, n))
    return bad


def torch_checkpoint(model: nn.Module, names: list[str]) -> nn.Module:
    """Wrap the named submodules with plain torch.utils.checkpoint (the state-unaware anchor)."""
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward

        def wrapped(*args, _fwd=fwd, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(_fwd, *args, use_reentrant=False, **kwargs)
        mod.forward = wrapped
    return model


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
