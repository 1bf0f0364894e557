"""Session 29's adversary findings, each a test that fails on the code before its fix."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import lightning_replay as lr

D, B = 8, 6

# ----------------------------------------------------------- a NaN the kernel writes is no fill
# State no probe sees: a dict in a custom op's closure, as a C++ kernel's configuration
_CFG = {"scale": 1.0}


@torch.library.custom_op("lr_test_s29::nan_padded_scale", mutates_args=())
def _nan_padded_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity, with a per-row gradient scale saved padded to 8 rows, the padding NaN:
    every byte written, deterministically."""
    rows = x.shape[0]
    stat = torch.full((((rows + 7) // 8) * 8,), float("nan"), dtype=x.dtype)
    stat[:rows] = _CFG["scale"] * (1.0 + x.detach().abs().mean(-1))
    return x.clone(), stat


def _setup(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]
    ctx.save_for_backward(output[1])


def _backward(ctx, g, _g_stat):
    (stat,) = ctx.saved_tensors
    return g * stat[: ctx.rows].unsqueeze(-1)


_nan_padded_scale.register_autograd(_backward, setup_context=_setup)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.b(_nan_padded_scale(torch.tanh(self.a(x)))[0])


class _ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Scaled(), _Scaled())
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_a_state_difference_beside_a_nan_the_kernel_writes_is_recorded():
    """The replayed probe's replay saves a statistic that differs from the forward's in the
    rows the kernel computes (its configuration moved between forward and backward), and
    holds a NaN the kernel writes in its padding. The run over torch-filled memory compared
    values: NaN != NaN made the padding look unwritten, and the difference was called kernel
    noise: parameters off by 8.6e-3 and no record (the same model padded with 0.0 recorded
    it). Compared bit for bit, a divergence is recorded."""
    torch.manual_seed(0)
    _CFG["scale"] = 1.0
    model = _ScaledNet()
    engine = lr.install(model, ["blocks.0", "blocks.1"], budget="min", on_violation="record")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(step))
            out = model(x)
            if step == 0:  # (the replayed probe's replay runs in this step's backward)
                _CFG["scale"] *= 1.5
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    outcomes = [(r.check, r.outcome) for r in engine.records]
    engine.uninstall()
    assert ("probe", "divergence") in outcomes, outcomes
