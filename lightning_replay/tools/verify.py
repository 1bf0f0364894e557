"""Check a model replays exactly: train it with and without recomputation and compare.

These helpers back the demo, the tests and the benchmarks, and are public so users can run the
same comparison on their own model before trusting a plan.

Example:
    >>> import copy, lightning_replay as lr
    >>> from lightning_replay.demos.hazards import HAZARDS
    >>> h = HAZARDS["queue"]()
    >>> ref, model = copy.deepcopy(h.model), copy.deepcopy(h.model)
    >>> engine = lr.install(model, h.segments)
    >>> g_ref, _ = train_steps(ref, h.make_input, 3)
    >>> g_rep, _ = train_steps(model, h.make_input, 3)
    >>> grad_diffs(g_ref, g_rep), diff_state(snapshot_state(ref), snapshot_state(model))
    ([], [])
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_replay.core.mechanisms.slots import MISSING, MODULE_INTERNALS, copy_plain, same_value


def snapshot_state(model: nn.Module) -> dict[str, object]:
    """Everything a user could observe: parameters, buffers, tensor attributes, generator
    states and public plain Python attributes, by qualified name."""
    out: dict[str, object] = {}
    for mname, mod in model.named_modules():
        p = f"{mname}." if mname else ""
        for k, v in mod.__dict__.items():
            if k in ("_parameters", "_buffers"):
                for kk, t in v.items():
                    if t is not None:
                        out[p + kk] = t.detach().clone()
            elif k in MODULE_INTERNALS:
                continue
            elif isinstance(v, torch.Tensor):
                out[p + k] = v.detach().clone()
            elif isinstance(v, torch.Generator):
                out[p + k] = v.get_state()
            elif type(v) in (tuple, list) and any(isinstance(x, torch.Tensor) for x in v):
                out[p + k] = type(v)(
                    x.detach().clone() if isinstance(x, torch.Tensor) else x for x in v
                )
            elif not k.startswith("_") and copy_plain(v) is not MISSING:
                out[p + k] = copy_plain(v)
    return out


def _same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x, y)
        )
    if type(x) in (tuple, list):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    return same_value(x, y)


def diff_state(a: dict, b: dict) -> list[str]:
    """Names whose values are not identical (bit for bit for tensors)."""
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not _same(a[k], b[k])
    )


def train_steps(
    model: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    steps: int,
    lr: float = 0.05,
    rng_seed: int | None = 100,
):
    """Plain SGD on ``mean(model(x) ** 2)``; the global RNG is reseeded per step.

    Returns:
        (per-step gradients as {name: tensor}, per-step losses).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, losses = [], []
    for step in range(steps):
        if rng_seed is not None:
            torch.manual_seed(rng_seed + step)
        opt.zero_grad(set_to_none=True)
        loss = (model(make_input(step)).float() ** 2).mean()
        loss.backward()
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        losses.append(loss.item())
        opt.step()
    return grads, losses


def grad_diffs(ga: list[dict], gb: list[dict]) -> list[tuple[int, str]]:
    """(step, name) of every gradient that is not bit-identical."""
    bad = []
    for step, (a, b) in enumerate(zip(ga, gb)):
        for n in sorted(a.keys() | b.keys()):
            if n not in a or n not in b or not torch.equal(a[n], b[n]):
                bad.append((step, n))
    return bad


def max_relative_error(ga: list[dict], gb: list[dict]) -> float:
    """Largest ||a - b|| / ||a|| over all steps and parameters."""
    worst = 0.0
    for a, b in zip(ga, gb):
        for n in a.keys() & b.keys():
            den = float(a[n].double().norm())
            if den > 0:
                worst = max(worst, float((a[n].double() - b[n].double()).norm()) / den)
    return worst


def torch_checkpoint(model: nn.Module, names: list[str]) -> nn.Module:
    """Wrap the named submodules in plain ``torch.utils.checkpoint`` (the state-unaware anchor)."""
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward

        def wrapped(*args, _fwd=fwd, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(_fwd, *args, use_reentrant=False, **kwargs)

        mod.forward = wrapped
    return model
