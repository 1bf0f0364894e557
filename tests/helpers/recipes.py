"""The referee of the adversary recipe files (issue 33): train one model in plain PyTorch and
under :func:`lightning_replay.install` from identical deep copies (same seeds, same data,
same optimizer, several steps) and compare every step's gradients bit for bit.

A ``step(model, generator, step_index)`` runs one training step (forward, backward) and may
return extra tensors to compare (``{"name": tensor}``), such as a buffer after backward.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
    ...     def forward(self, x):
    ...         return self.blocks[1](self.blocks[0](x).tanh())
    >>> def step(model, g, s):
    ...     model(torch.randn(B, D, generator=g)).pow(2).mean().backward()
    >>> check(Net, step, [{"preservation": "whole"}])
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

import lightning_replay as lr

D = 8
B = 4
STEPS = 4
PRES = [{"preservation": "auto"}, {"preservation": "whole"}, {"preservation": "regions"}]
WITH_BUDGET = PRES + [{"budget": "min"}]

Step = Callable[[nn.Module, torch.Generator, int], Any]


class Blk(nn.Module):
    """A stateful block: a reduction over the batch and a BatchNorm (the recipe files' base
    block)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x - x.mean(0))).tanh()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, cloned (parameters without one are left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def optimizer(model: nn.Module, opt: str = "sgd") -> torch.optim.Optimizer:
    """``"sgd"`` (momentum 0.9) or ``"adamw"``."""
    params = list(model.parameters())
    if opt == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def run(model: nn.Module, step: Step, opt: str = "sgd", steps: int = STEPS) -> list[dict]:
    """Train ``steps`` steps from fixed seeds; each step's gradients (and extras)."""
    torch.manual_seed(11)
    g = torch.Generator().manual_seed(7)
    o = optimizer(model, opt)
    out = []
    for s in range(steps):
        o.zero_grad(set_to_none=True)
        extra = step(model, g, s) or {}
        got = grads(model)
        got.update({f"extra.{k}": v.detach().clone() for k, v in extra.items()})
        out.append(got)
        o.step()
    return out


def diff(a: list[dict], b: list[dict]) -> list[tuple[int, str]]:
    """(step, name) of every tensor that is not bit-equal between two runs."""
    assert len(a) == len(b)
    out = []
    for s, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys(), (s, sorted(ga), sorted(gb))
        out += [(s, k) for k in ga if not torch.equal(ga[k], gb[k])]
    return out


def worst(a: list[dict], b: list[dict], bad: list[tuple[int, str]]) -> float:
    """The largest absolute difference among ``bad``."""
    return max((float((a[i][k] - b[i][k]).abs().max()) for i, k in bad), default=0.0)


def replay_count(eng: Any) -> int:
    """Replays the engine ran, all segments together."""
    return sum(v.get("replays", 0) for v in eng.summary().values() if isinstance(v, dict))


def check(
    make: Callable[[], nn.Module],
    step: Step,
    kws: list[dict] = PRES,
    opt: str = "sgd",
    spec: Any = "blocks.*",
    replays: bool = True,
    steps: int = STEPS,
) -> None:
    """Plain PyTorch against ``install(model, spec, **kw)`` for each ``kw``: bit-equal
    gradients on every step, replays (unless ``replays`` is False) and nothing
    preserved once the last backward ran."""
    torch.manual_seed(0)
    ref = make()
    expected = run(copy.deepcopy(ref), step, opt, steps)
    for kw in kws:
        model = copy.deepcopy(ref)
        eng = lr.install(model, spec, **kw)
        try:
            got = run(model, step, opt, steps)
            bad = diff(expected, got)
            assert bad == [], (
                kw,
                len(bad),
                sum(map(len, expected)),
                f"max|diff|={worst(expected, got, bad):.3g}",
                bad[:6],
            )
            if replays:
                assert replay_count(eng), (kw, eng.summary())
            assert eng.preserved_bytes == 0, kw
        finally:
            eng.uninstall()
