"""State an op sizes in the forward (an empty buffer a kernel resizes and fills: a lazily
initialized running statistic, a per-channel observer's min/max) is replayed with the shape
the op was given, not the one the window left: the replay takes the forward's branch, and
gradients equal plain PyTorch's bit for bit, the replayed probe's replay (``budget="min"``)
included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_replay as lr

D, B = 16, 8


class LazyStat(nn.Module):
    """A running mean of its input, empty until the first forward fills it with ``out=``."""

    def __init__(self, dim: int | None) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.dim = dim
        self.register_buffer("stat", torch.empty(0))

    def forward(self, x):
        with torch.no_grad():
            if self.stat.numel() == 0:  # first call: sized and filled by the kernel
                if self.dim is None:
                    torch.mean(x, dim=0, out=self.stat)
                else:
                    torch.amax(x, dim=self.dim, out=self.stat)
            else:
                self.stat.mul_(0.5).add_(x.mean(0) if self.dim is None else x.amax(self.dim))
        s = self.stat if self.dim is None else self.stat.mean()
        return x + torch.tanh(self.lin(x)) * (1 + s)


class Net(nn.Module):
    def __init__(self, dim: int | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LazyStat(dim) for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(engine_kw: dict | None, dim: int | None, steps: int = 4):
    torch.manual_seed(0)
    net = Net(dim)
    engine = lr.install(net, ["blocks.0", "blocks.1"], **engine_kw) if engine_kw else None
    grads = []
    for s in range(steps):
        x = torch.randn(B, D, generator=torch.Generator().manual_seed(s))
        net(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None
    state = {k: v.clone() for k, v in net.state_dict().items()}
    if engine is not None:
        engine.uninstall()
    return grads, state


@pytest.mark.parametrize("dim", [None, 1], ids=["mean_per_feature", "amax_per_row"])
@pytest.mark.parametrize("kw", [{}, {"budget": "min"}], ids=["auto", "min"])
def test_state_a_kernel_sizes_in_the_forward_replays_at_its_forward_shape(kw, dim):
    want_grads, want_state = _train(None, dim)
    got_grads, got_state = _train({"on_violation": "raise", **kw}, dim)
    for step, (w, g) in enumerate(zip(want_grads, got_grads)):
        bad = [n for n in w if not torch.equal(w[n], g[n])]
        assert not bad, f"step {step}: gradients differ from plain PyTorch: {bad}"
    bad = [k for k in want_state if not torch.equal(want_state[k], got_state[k])]
    assert not bad, bad
