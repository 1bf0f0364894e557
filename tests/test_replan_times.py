"""``replan_on=("times",)``: a plan made from calibration's few timings is judged once by the
replays timed under it, and made again where its time is off by more than ``time_drift``.

The replay times are set by the test (the meter records a figure per segment and phase
instead of the clock's), so the plan each step runs is known: calibration reads one segment's
replay as the cheapest, the steps under the plan read it as the dearest.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay import ReplayCallback
from lightning_replay.errors import ReplayConfigError
from lightning_replay.planner import predicted_peak
from lightning_replay import ReplanSettings
from lightning_replay.replan import choices_time

W = 64


class _Blocks(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(W, 4 * W), nn.Tanh(), nn.Linear(4 * W, W)) for _ in range(n)
        )
        self.segments = [f"blocks.{i}" for i in range(n)]

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _steps(m, start: int, n: int) -> None:
    """Steps that begin and end without gradients (the engine sees no memory freed)."""
    for s in range(start, start + n):
        x = torch.randn(128, W, generator=torch.Generator().manual_seed(s))
        m(x).pow(2).mean().backward()
        m.zero_grad(set_to_none=True)


def _timed_by(e, calibration: dict[str, float], steady: dict[str, float]) -> None:
    """The meter records ``calibration[segment]`` seconds per replay before the first plan
    and ``steady[segment]`` after it, whatever the clock read."""
    add = e.meter.add_time

    def fake(segment, option, seconds):
        add(segment, option, (calibration if e.plan is None else steady)[segment])

    e.meter.add_time = fake


def _one_replay_budget(e) -> int:
    """A budget the plans that replay one of the first two segments meet, and retaining all
    does not (replaying the last segment can peak higher than retaining it: its replay is
    at the backward's start, beside every other segment's activations)."""
    args = (e.real_base_memory,)
    names = [c.name for c in e.costs]
    one = max(
        predicted_peak(
            e.costs,
            {n: "recompute" if n == r else "retain" for n in names},
            *args,
            **e.phase_peak_args,
        )
        for r in names[:2]
    )
    every = predicted_peak(e.costs, dict.fromkeys(names, "retain"), *args, **e.phase_peak_args)
    assert one < every, (one, every)
    return one


#: calibration's replay seconds per segment: blocks.0's reads as the cheapest
CAL = {"blocks.0": 0.001, "blocks.1": 0.005, "blocks.2": 0.006, "blocks.3": 0.007}


def _planned_one_replay(replan_on: tuple, steady_b0: float):
    """Four blocks calibrated with :data:`CAL`'s figures, then planned for a budget that
    replays one block (calibration: blocks.0); the steps under the plan time blocks.0's
    replay at ``steady_b0`` seconds. Returns the model, the engine and its plan version."""
    torch.manual_seed(0)
    m = _Blocks()
    e = lr.install(m, m.segments, budget=10**12, replan_on=replan_on)
    _timed_by(e, CAL, {**CAL, "blocks.0": steady_b0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(m, 0, e.steps_to_first_plan + 2)
        assert e.plan is not None
        e.replan(budget=_one_replay_budget(e))
    return m, e, e.plan_version


def test_a_plan_whose_replays_time_off_calibration_is_made_again(collector_off):
    # blocks.0 is the dearest replay in steady steps
    m, e, v = _planned_one_replay(("times",), 0.020)
    # calibration: blocks.0's replay is the cheapest, so it is the one replayed
    assert e.plan.choices == {
        "blocks.0": "recompute",
        "blocks.1": "retain",
        "blocks.2": "retain",
        "blocks.3": "retain",
    }
    patience = e.replan_policy.settings.time_patience
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(m, 100, patience)
        assert e.plan_version == v  # judged only once the plan ran time_patience steps
        _steps(m, 200, 2)
    # blocks.0's median is now the steady steps' 20 ms: the plan is made again, and the
    # cheapest replay by the medians now (blocks.1, 5 ms) is the one replayed
    assert e.plan_version == v + 1
    assert e.plan.choices["blocks.0"] == "retain" and e.plan.choices["blocks.1"] == "recompute"
    assert e.replan_policy.replans == 1
    # the new plan's replays time as planned: judged once, not made again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(m, 300, 3 * patience)
    assert e.plan_version == v + 1 and e.replan_policy.replans == 1
    e.uninstall()


def test_a_plan_whose_replays_time_as_planned_stays(collector_off):
    # within time_drift (25 %) of the plan's figure: no re-plan
    m, e, v = _planned_one_replay(("times",), 0.0012)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(m, 100, 3 * e.replan_policy.settings.time_patience)
    assert e.plan_version == v and e.plan.choices["blocks.0"] == "recompute"
    e.uninstall()


def test_without_times_a_plan_is_not_made_again_for_them(collector_off):
    """The same drift with ``"times"`` not asked for: the calibration's plan stays."""
    m, e, v = _planned_one_replay(("violations",), 0.020)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(m, 100, 20)
    assert e.plan_version == v and e.plan.choices["blocks.0"] == "recompute"
    e.uninstall()


def test_choices_time_sums_as_the_planner_does():
    from lightning_replay.planner import CostTable, Option, SegmentCost, min_feasible_budget, plan

    costs = CostTable(
        [
            SegmentCost("a", 100, {"retain": Option(100, 0.0), "regions": Option(10, 0.2, True)}),
            SegmentCost("b", 100, {"retain": Option(100, 0.0), "recompute": Option(0, 0.3)}),
        ],
        capture_time=0.05,
    )
    low = min_feasible_budget(costs, 0)
    for budget in (low, low + 50, 10**9):
        p = plan(costs, budget, 0)
        assert choices_time(costs, p.choices) == p.extra_time
    # the capture mode's time is counted once, where a chosen option needs it
    assert choices_time(costs, {"a": "regions", "b": "recompute"}) == pytest.approx(0.55)
    assert choices_time(costs, {"a": "retain", "b": "recompute"}) == pytest.approx(0.3)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "0.2"])
def test_time_drift_outside_a_fraction_is_refused(bad):
    with pytest.raises(ReplayConfigError, match="time_drift"):
        ReplanSettings(replan_on=("times",), time_drift=bad)


def test_the_callback_asks_for_times_by_name():
    assert "times" not in ReplayCallback().replan_on
    cb = ReplayCallback(replan_on=("times", "memory"), time_drift=0.1, time_patience=4)
    assert cb.replan_on == ("times", "memory") and (cb.time_drift, cb.time_patience) == (0.1, 4)
    with pytest.raises(ReplayConfigError, match="time_patience"):
        ReplayCallback(replan_on=("times",), time_patience=0)
