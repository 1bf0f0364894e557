"""Under a byte budget no plan can meet, the refusal comes as soon as a step was measured.

Issue 31, "the budget holds from step one": the untimed warm-up step after the probe runs every
segment at its lowest option and measures the whole step. Where its figures already show that
no combination of options fits the budget, the engine refuses (``InfeasibleBudget`` with the
lowest peak) at the next step, not after the calibration steps have run over the budget one by
one. The refusal must be right: the lowest plan's real peak (``budget="min"``, judged by the
whole-process referee) is over the budget, and the figure it names is within 1.02 x that peak.

Models: every segment keeps an in-place moving average as big as its activations (so the
lowest plan holds what plain training does), written whole or through a slice; a buffer the
segment writes with ``index_copy_`` at a moving pointer; some segments stateless. The budget is
halfway between torch checkpoint's and plain training's whole-process peak (AdamW).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.helpers.budget_runner import run_arm

MIB = 2**20
W, N = 48, 384


class Ema(nn.Module):
    """``x + b(tanh(a(x)))`` plus a moving average of its output, read first, ``rows`` x N rows
    (written through the first N rows where it is larger)."""

    def __init__(self, rows: int = 1) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)
        self.register_buffer("avg", torch.zeros(rows * N, W))

    def forward(self, x):
        y = x + self.b(torch.tanh(self.a(x))) + self.avg[: x.shape[0]] * 1e-3
        with torch.no_grad():
            self.avg[: x.shape[0]].mul_(0.8).add_(y.detach(), alpha=0.2)
        return y


class Queue(nn.Module):
    """Enqueues its output (N rows) into a queue of 2 N rows at a pointer that moves."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)
        self.register_buffer("queue", torch.zeros(2 * N, W))
        self.ptr = 0

    def forward(self, x):
        y = x + self.b(torch.tanh(self.a(x))) + self.queue[: x.shape[0]].mean(0) * 1e-3
        with torch.no_grad():
            rows = (torch.arange(x.shape[0]) + self.ptr) % self.queue.shape[0]
            self.queue.index_copy_(0, rows, y.detach())
        self.ptr = (self.ptr + x.shape[0]) % self.queue.shape[0]
        return y


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


MODELS = {
    "every_segment_an_average": lambda: [Ema() for _ in range(10)],
    "averages_through_a_slice": lambda: [Ema(rows=2) for _ in range(6)],
    "queues_and_stateless": lambda: [Queue(), Plain(), Queue(), Queue(), Plain(), Queue()],
}


def _model(kind: str) -> nn.Module:
    return nn.Sequential(nn.Sequential(*MODELS[kind]()), nn.Linear(W, 1))


def _run(kind, arm, referee, budget=None, steps=3):
    blocks = len(MODELS[kind]())
    return run_arm(
        lambda: _model(kind),
        [f"0.{i}" for i in range(blocks)],
        arm,
        referee,
        lambda s: torch.randn(N, W, generator=torch.Generator().manual_seed(s)),
        budget=budget,
        steps=steps,
        keep_refusal=True,
    )


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_refused_after_one_measured_step(kind, referee):
    plain = max(_run(kind, "plain", referee).peaks[1:])
    ckpt = max(_run(kind, "checkpoint", referee).peaks[1:])
    halfway = (plain + ckpt) // 2
    low = _run(kind, "replay", referee, budget="min")
    low_peak = max(low.peaks[len(low.peaks) - low.planned :])
    assert low_peak > halfway, (kind, "the lowest plan fits: pick a model that it does not")
    run = _run(kind, "replay", referee, budget=halfway)
    report = ", ".join(f"{p / MIB:.3f}" for p in run.peaks)
    assert run.refused is not None, f"{kind}: {halfway} B not refused; steps {report}"
    # the probe and the measured warm-up ran; the third step's forward refused
    assert len(run.peaks) <= 2, (
        f"{kind}: refused after {len(run.peaks)} steps ({report} MiB against "
        f"{halfway / MIB:.3f}): the calibration steps ran over a budget the measured "
        f"warm-up already showed infeasible"
    )
    named = run.refused.min_feasible
    assert halfway < named and abs(named - low_peak) <= 0.02 * low_peak, (
        f"{kind}: the refusal names {named / MIB:.3f} MiB, the lowest plan peaks at "
        f"{low_peak / MIB:.3f}, the budget {halfway / MIB:.3f}"
    )
