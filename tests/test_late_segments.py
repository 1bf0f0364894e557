"""A segment first called after the plan was made (progressive growing, a branch a schedule
switches on) joins the plan before its activations are dropped under a plan that never counted
them: every step, judged on its own by the whole-process referee, holds the budget (issue 31),
and training equals plain PyTorch bit for bit.

Models: the late segment is the last block or a middle one, stateless or with a moving average
written in its forward (a whole copy preserved), big (8 x the others' hidden width).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.helpers.budget_runner import run_arm

MIB = 2**20
TOLERANCE = 1.02
W, N = 64, 512
JOINS = 7  # the forward a late block is first called at: after the first plan (step 6)


class Blk(nn.Module):
    def __init__(self, hidden: int = 2 * W) -> None:
        super().__init__()
        self.a = nn.Linear(W, hidden)
        self.b = nn.Linear(hidden, W)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class EmaBlk(Blk):
    """A moving average of its output, written in its forward after being read."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.register_buffer("ema", torch.zeros(N, W))

    def forward(self, x):
        y = super().forward(x) + self.ema * 1e-3
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.detach(), alpha=0.1)
        return y


class Growing(nn.Module):
    """Blocks; the one at ``late`` is skipped until the ``JOINS``-th forward."""

    def __init__(self, blocks, late: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(W, 1)
        self.late = late
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for i, b in enumerate(self.blocks):
            if i != self.late or self.calls >= JOINS:
                x = b(x)
        return self.head(x)


MODELS = {
    "big_middle_block": lambda: Growing([Blk(), Blk(), Blk(hidden=8 * W), Blk(), Blk()], 2),
    "big_stateful_last_block": lambda: Growing([Blk(), Blk(), Blk(), EmaBlk(8 * W)], 3),
}


def _run(name: str, arm: str, referee, budget=None, steps: int = 4):
    make = MODELS[name]
    names = [f"blocks.{i}" for i in range(len(make().blocks))]
    return run_arm(
        make,
        names,
        arm,
        referee,
        lambda s: torch.randn(N, W, generator=torch.Generator().manual_seed(s)),
        budget=budget,
        steps=steps,
        keep_refusal=True,
        keep_state=True,
    )


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("budget", ["halfway", "min"])
def test_a_segment_joining_after_the_plan_is_planned_for(name, budget, referee):
    plain = max(_run(name, "plain", referee, steps=JOINS + 2).peaks[JOINS - 1 :])
    ckpt = max(_run(name, "checkpoint", referee, steps=JOINS + 2).peaks[JOINS - 1 :])
    assert ckpt < 0.98 * plain
    halfway = (plain + ckpt) // 2
    run = _run(name, "replay", referee, budget=halfway if budget == "halfway" else "min")
    assert run.refused is None, run.refused
    peaks = run.peaks
    assert len(peaks) > JOINS + 1, peaks  # the late block ran under plans
    want = _run(name, "plain", None, steps=len(peaks)).state
    bad = [k for k, v in want.items() if not torch.equal(run.state[k], v)]
    assert not bad, f"differ from plain PyTorch: {bad[:5]}"
    report = ", ".join(f"{p / MIB:.3f}" for p in peaks)
    # under "min": the steps after the block joined hold the lowest plan's peak, below plain's
    bound = halfway if budget == "halfway" else max(peaks[JOINS:])
    if budget == "min":
        assert bound < 0.98 * plain, f"lowest plan {bound / MIB:.3f} MiB; steps {report}"
    over = [(s + 1, round(p / bound, 3)) for s, p in enumerate(peaks) if p > TOLERANCE * bound]
    assert not over, f"(step, peak / bound): {over}; bound {bound / MIB:.3f} MiB; steps {report}"


#: what a real peak may exceed its prediction by: a few 0-dim tensors made between the engine's
#: measurement and the step (in the full suite's order: 5,469,856 B real against 5,469,852
#: predicted, one float32 scalar; alone the two are equal)
SCALARS = 4096


@pytest.mark.parametrize("name", list(MODELS))
def test_the_prediction_bounds_each_step_once_the_joined_segment_was_measured(name, referee):
    """Under the halfway budget, once the late segment's first planned step was measured, each
    step's real peak (the whole-process referee) is within the plan's prediction (but for a few
    scalars: :data:`SCALARS`), and that within the budget, exactly. The late block sits at its place in the forward (the middle),
    where the peak formula sums its bytes: the blocks after it hold them when they replay.
    Appended after the blocks known before it, the prediction of the plan for the budget
    read 5,806,448 B against the budget 5,793,808 (big_middle_block: no plan fit, and the
    lowest-memory one ran, 5,534,192 B).

    Not bounds (measured, main as of this test): the step the block is first called (7) runs
    under a plan made before it existed (5,524,512 B real against 3,322,464 predicted), and its
    first planned step (8), the lowest-memory plan, is predicted before its backward's
    temporaries were ever measured (5,539,248 real against 3,267,808: the 8 x wider block's
    backward holds about 2 MiB that no other block's figures stand for)."""
    plain = max(_run(name, "plain", referee, steps=JOINS + 2).peaks[JOINS - 1 :])
    ckpt = max(_run(name, "checkpoint", referee, steps=JOINS + 2).peaks[JOINS - 1 :])
    halfway = (plain + ckpt) // 2
    run = _run(name, "replay", referee, budget=halfway, steps=6)
    assert run.refused is None, run.refused
    judged = list(zip(run.peaks, run.predicted))[JOINS + 1 :]
    assert len(judged) >= 2, run.peaks
    # (real against predicted: within SCALARS bytes; the prediction against the budget: exactly)
    over = [
        (JOINS + 2 + i, real, pred)
        for i, (real, pred) in enumerate(judged)
        if not (real <= pred + SCALARS and pred <= halfway)
    ]
    assert not over, f"(step, real, predicted) over; budget {halfway}: {over}"
