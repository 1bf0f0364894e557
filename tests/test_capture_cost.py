"""The capture mode is one cost per step: the options that turn it on say so, and the table
charges it once.

The capture mode logs writes over the whole forward. Before, each segment's ``regions`` time
carried an equal share of it, measured while every segment logged regions, so a plan with only
some of them was charged part of a cost it pays in full, and a guard (a replayed segment's
unchanged buffer, watched for writes) was charged nothing.
"""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.planner import CostTable, plan
from lightning_replay.verify import train_steps


class Bank(nn.Module):
    """A block conditioned on a memory bank that the step overwrites a few rows of."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("memory", torch.randn(rows, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x + self.memory.mean(0)))


class Scaled(nn.Module):
    """A block with a buffer no step writes: replaying it guards the buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * self.scale)


class Plain(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Mixed(nn.Module):
    def __init__(self, dim: int = 16, rows: int = 256) -> None:
        super().__init__()
        self.bank0, self.bank1 = Bank(dim, rows), Bank(dim, rows)
        self.scaled, self.plain = Scaled(dim), Plain(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.plain(self.scaled(self.bank1(self.bank0(x))))
        with torch.no_grad():  # the step overwrites 4 data-chosen rows of each bank
            start = int(h[0, 0].abs().mul(1e4).long()) % self.bank0.memory.shape[0]
            idx = (torch.arange(4) * 37 + start) % self.bank0.memory.shape[0]
            for bank in (self.bank0, self.bank1):
                bank.memory.index_copy_(0, idx, h[:4].detach())
        return self.head(h)


SEGMENTS = ["bank0", "bank1", "scaled", "plain"]


def _x(step: int) -> torch.Tensor:
    return torch.randn(32, 16, generator=torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = Mixed()
    # a byte budget nothing reaches: calibration times every option (under "min" only those
    # the lowest plan can pick)
    engine = lr.install(model, SEGMENTS, budget=2**40, calibration_steps=2)
    train_steps(model, _x, engine.steps_to_first_plan)
    assert engine.plan is not None
    return model, engine


def test_the_table_charges_the_capture_mode_once(measured):
    _, engine = measured
    costs = engine.costs
    assert isinstance(costs, CostTable) and costs.capture_time > 0
    opts = {c.name: c.options for c in costs}
    assert set(opts["bank0"]) == {"retain", "whole", "regions"}
    assert set(opts["scaled"]) == {"retain", "recompute"}
    assert set(opts["plain"]) == {"retain", "recompute"}
    # regions log writes; a replayed block with a buffer guards it; retaining needs nothing
    assert opts["bank0"]["regions"].capture and opts["bank1"]["regions"].capture
    assert opts["scaled"]["recompute"].capture
    assert not opts["bank0"]["whole"].capture and not opts["plain"]["recompute"].capture
    assert not any(o["retain"].capture for o in opts.values())
    # every step of calibration runs the engine's mode here (the guard), and the mode is still
    # priced in place: each segment's forward was timed under one more mode and without
    times = engine.meter.forward_times
    assert sorted(times) == sorted(SEGMENTS)
    assert all(t[True] and t[False] for t in times.values())
    # a plan that takes any of them pays the mode once, one that takes none pays nothing
    all_regions = {"bank0": "regions", "bank1": "regions", "scaled": "retain", "plain": "retain"}
    one_region = {**all_regions, "bank1": "whole"}
    for choices in (all_regions, one_region):
        p = plan(costs, budget=10**12, method="joint", allowed={k: {v} for k, v in choices.items()})
        per_segment = sum(opts[n][o].time for n, o in choices.items())
        assert p.extra_time == pytest.approx(per_segment + costs.capture_time)
    none = {"bank0": "whole", "bank1": "whole", "scaled": "retain", "plain": "recompute"}
    p = plan(costs, budget=10**12, method="joint", allowed={k: {v} for k, v in none.items()})
    assert p.extra_time == pytest.approx(sum(opts[n][o].time for n, o in none.items()))


def test_the_flags_say_when_the_engine_runs_the_capture_mode(measured):
    """For every combination of options, the step runs the capture mode exactly when the
    plan's table says one of its options needs it (so the planner charges what runs)."""
    model, engine = measured
    opts = {c.name: c.options for c in engine.costs}
    combos = list(itertools.product(*(list(opts[n]) for n in SEGMENTS)))
    assert len(combos) == 3 * 3 * 2 * 2
    step = 100
    for combo in combos:
        choices = dict(zip(SEGMENTS, combo))
        engine.set_options(choices)
        train_steps(model, lambda s: _x(step + s), 2)  # the second runs with nothing pending
        step += 2
        expected = any(opts[n][o].capture for n, o in choices.items())
        ran = engine._capture_ops > 0
        assert ran == expected, choices


class Banks(nn.Module):
    """Bank blocks only: no guard, so calibration's replay phase runs no engine mode."""

    def __init__(self, dim: int = 16, rows: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Bank(dim, rows) for _ in range(4))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        with torch.no_grad():
            start = int(x[0, 0].abs().mul(1e4).long()) % 256
            idx = (torch.arange(4) * 37 + start) % 256
            for b in self.blocks:
                b.memory.index_copy_(0, idx, x[:4].detach())
        return self.head(x)


def test_the_capture_mode_is_timed_in_place_and_changes_nothing():
    """Calibration runs every other segment's forward under one more capture mode, one that
    logs nothing, alternating by step, and prices the mode per op from the difference; the
    steps train exactly as plain PyTorch."""
    torch.manual_seed(0)
    model, plain = Banks(), Banks()
    plain.load_state_dict(model.state_dict())
    engine = lr.install(model, "blocks.*", budget="min", calibration_steps=4)
    steps = engine.steps_to_first_plan + 2
    got, _ = train_steps(model, _x, steps)
    want, _ = train_steps(plain, _x, steps)
    assert engine.plan is not None
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want) for k in b)
    meter = engine.meter
    assert sorted(meter.forward_times) == [f"blocks.{i}" for i in range(4)]
    for name, times in meter.forward_times.items():
        # both ways in the 8 timed calibration steps (replay and regions phases, the second
        # under the engine's own mode too), alternating: 4 each; none after the plan
        assert len(times[True]) == len(times[False]) == 4, name
        assert set(meter.forward_ops[name]) == {5}  # mean, add, t, addmm, tanh
    rate = statistics.median(
        (statistics.median(t[True]) - statistics.median(t[False])) / 5
        for t in meter.forward_times.values()
    )
    assert meter.capture_op_seconds == max(rate, 0.0)
    assert engine.costs.capture_time == statistics.median(meter.capture_ops) * max(rate, 0.0)
