"""Memory the process held when the engine measured its steps, freed since (CI stop 42).

Every figure a measured step gives (what it held beyond the accountant's figures, its
optimizer phase) includes what the process held as the step began: optimizer state, and
anything else alive, as a previous model in a reference cycle the collector had not reached.
The figures only ever went up, so memory freed after calibration stayed in every plan's base
for good: the benchmark's ``budget_vs_allocator`` predicted 1.28 x the real peak once the
collector ran in the middle of it; a 1 MiB tensor in a cycle, collected after calibration,
kept the prediction at 2.5 x for the rest of the run, and a byte budget that the freed
memory made feasible stayed refused.

Referees: the real peak of every measured step (the process's live bytes as it began plus
its net peak: ``last_real_peak``) against the plan in force's prediction, within
:data:`SLACK` (the same step measures 4 bytes apart from one run to the next: a scalar alive
or not as it begins; the failures guarded against are 1 MiB)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr

MiB = 1 << 20
SLACK = 1024


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _Junk:
    """A tensor in a reference cycle: freed only when the collector runs."""

    def __init__(self, nbytes: int) -> None:
        self.me = self
        self.t = torch.zeros(nbytes // 4)


def _train(
    steps: int,
    budget,
    junk_until: int | None = None,
    junk_again: int | None = None,
    junk: int = MiB,
):
    """Train ``Net`` with ``budget`` and ``real_peak``; a cycle of ``junk`` bytes alive from
    the start until step ``junk_until`` (collected before it), made again before
    ``junk_again``.
    Returns per step (the plan in force's predicted peak, the step's real peak where it was
    measured else None, that plan)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gc.collect()
    gc.disable()
    held = []
    try:
        if junk_until is not None:
            _Junk(junk)
        engine = lr.install(model, "blocks.*", budget=budget, real_peak=True)
        engine.track_optimizer(opt)
        plans, labels, reals = [], [], {}
        for s in range(steps + 1):  # (one more: the last step's measurement settles)
            if s == junk_until:
                gc.collect()
            if s == junk_again:
                held.append(_Junk(junk))
            opt.zero_grad(set_to_none=True)
            x = torch.randn(128, 64, generator=torch.Generator().manual_seed(s))
            loss = model(x).pow(2).mean()
            plans.append(engine.plan)  # the plan this step runs
            labels.append(engine.step)  # the engine's number for it
            loss.backward()
            opt.step()
            del loss, x  # (nothing of this step held into the next)
            if engine.last_real_peak is not None:
                reals.setdefault(*engine.last_real_peak)
        engine.uninstall()
        return [
            (plan.peak_memory if plan else None, reals.get(label), plan)
            for plan, label in zip(plans[:steps], labels)
        ]
    finally:
        held.clear()
        gc.enable()
        gc.collect()


def _measured_after_plan(run):
    return [(p, r) for p, r, _ in run if p is not None and r is not None]


@pytest.mark.parametrize("other", [0, 4_000_000], ids=["alone", "4MB-other"])
@pytest.mark.parametrize("junk", [MiB, 32 * 1024], ids=["1MiB", "32KiB"])
def test_memory_freed_after_calibration_leaves_the_plans_base(junk, other):
    """A cycle alive through calibration, collected at step 14: from the second step measured
    after that, the plan predicts what a run that never had it predicts, and it still bounds
    every measured step's real peak. 32 KiB: the size of what ``gpu_check.py --smoke`` lost
    in CI (16 KiB, 2 % of its step; predicted 1.28 x the real peak), under the 64 KiB the
    first version needed. ``other``: tensors alive in the process that are not the run's (a
    full test run's leftovers, counted in every real peak): at stop 43 the least drop was
    1 % of that whole real peak, so in CI's full run the 32 KiB were never forgotten."""
    keep = torch.zeros(other // 4) if other else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        control = _train(30, "min")
        run = _train(30, "min", junk_until=14, junk=junk)
    del keep
    base = control[-1][0]
    before = [p for p, _, _ in run[8:14] if p is not None]
    assert before and min(before) > base + junk // 2  # the cycle was in the base
    assert run[-1][0] <= base + 4096, (run[-1][0], base)
    for predicted, real in _measured_after_plan(run):
        assert real <= predicted + SLACK, (real, predicted)
    # the drop is forgotten at the second step measured after the collection: the next step
    # runs a plan made without it (and every later one)
    measured = [s for s, (_, r, _) in enumerate(run) if s >= 14 and r is not None]
    assert len(measured) >= 2, measured
    first = min(measured[1] + 1, len(run) - 1)
    assert all(p <= base + 4096 for p, _, _ in run[first:]), [p for p, _, _ in run[12:]]


def test_a_budget_the_freed_memory_leaves_room_in_is_planned_again():
    """A byte budget halfway between the lowest plan's peak and retaining every segment, with
    the cycle alive: while it lives the plan retains some; once it is freed (1 MiB more room)
    the plan is made again and retains more, predicted and measured within the budget."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowest = _train(12, "min", junk_until=99)[-1][0]  # the cycle alive throughout
        top = _train(12, 1 << 40, junk_until=99)[-1][0]  # ... every segment retained
        budget = (lowest + top) // 2
        run = _train(40, budget, junk_until=14)

    def retained(plan) -> int:
        return sum(c == "retain" for c in plan.choices.values())

    assert retained(run[-1][2]) > retained(run[13][2]), (run[13][2].choices, run[-1][2].choices)
    assert run[-1][0] <= budget
    for predicted, real in _measured_after_plan(run):
        assert real <= budget + SLACK and real <= predicted + SLACK, (real, predicted, budget)


def test_one_step_with_less_held_forgets_nothing():
    """Collected before a measured step and made again right after it: the next step (measured
    too: one low step asks for it) began holding it again, so nothing is forgotten and the
    prediction bounds every measured real peak (forgetting on one low step under-predicts
    by 1 MiB from there on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedule = _train(40, "min", junk_until=99)  # which steps are measured
        low = next(s for s, (_, r, _) in enumerate(schedule) if s >= 14 and r is not None)
        run = _train(40, "min", junk_until=low, junk_again=low + 1)
    assert run[low][1] is not None and run[low + 1][1] is not None  # both measured
    assert run[low + 1][1] > run[low][1] + MiB // 2  # the cycle was back
    for predicted, real in _measured_after_plan(run):
        assert real <= predicted + SLACK, (real, predicted)
