"""Under a budget, derivative checks take the replayed segments in turn: none is left unchecked
while the others take every turn.

Before, a checked step checked the segments whose graphs fit beside the plan in force, from
the cursor on, and moved the cursor past the last one checked: a segment whose check never
fit beside the plan (a larger segment than the others) was passed over at every turn, without
a word, while a step planned around its check would have fit, or while nothing could. Now the
segment whose turn it is goes first (beside the plan, else on a step planned around its check),
and one whose check fits neither is named in a warning and counted in ``checks_skipped``.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.engine import check_steps
from lightning_replay.planner import min_feasible_budget

STEPS_TO_PLAN = 1 + 2 * 3 + 1  # probe, two calibration phases (warm-up + 2 steps), the plan


def _stub_engine(names, fits_beside, step_plans):
    """An engine as :func:`check_steps.select_checked` reads it, every segment replayed."""
    cost = lambda n: types.SimpleNamespace(name=n, options={"recompute": None, "retain": None})
    eng = types.SimpleNamespace(
        plan=types.SimpleNamespace(choices={n: "recompute" for n in names}),
        budget=100,
        costs=[cost(n) for n in names],
        segments=list(names),
        runtimes={n: types.SimpleNamespace(module=nn.Linear(1, 1), contract=None) for n in names},
        step=0,
        _check_cursor=0,
        checks_skipped=0,
        checks_skipped_reason=None,
        _checks_named=(0, set()),
        plan_version=1,
        _check_turn=None,
        _checked_ran=set(),
        _check_missed={},
        _step_choices=None,
        planned_around=[],
    )
    eng._set_options = lambda choices: eng.planned_around.append(dict(choices))
    return eng


@pytest.fixture
def rule(monkeypatch):
    """select_checked over a stub: ``fits`` names the segments whose check fits beside the
    plan (any set of them together, or one at a time), ``planned`` those with a step planned
    around their check."""

    def make(names, fits, planned, together=True):
        eng = _stub_engine(names, fits, planned)
        monkeypatch.setattr(
            check_steps,
            "checked_peak",
            lambda e, by, chosen, grads=None: (
                0 if set(chosen) <= set(fits) and (together or len(chosen) == 1) else 10**9
            ),
        )
        monkeypatch.setattr(
            check_steps,
            "check_step_plan",
            lambda e, by, n, grads: (
                types.SimpleNamespace(choices={m: "recompute" for m in names})
                if n in planned
                else None
            ),
        )
        return eng

    return make


def _turn(eng, left_out=()):
    """One checked window: the segments chosen run under their checks, but ``left_out``."""
    check_steps.missed_turn(eng)  # as the engine's window begins
    chosen = check_steps.select_checked(eng, None)
    eng._checked_ran = set(chosen) - set(left_out)
    return chosen


def test_a_segment_chosen_that_did_not_run_gets_the_next_turn_again(rule):
    """A segment the model left out of the step of its turn (it did not run under its check)
    is chosen again at the next checked step, up to two turns in a row; before, the cursor
    had moved past it, and one left out on every one of its turns was never checked."""
    eng = rule(["a", "b", "c"], fits={"a", "b", "c"}, planned=set(), together=False)
    seen = [_turn(eng, left_out={"b"} if i == 1 else ()) for i in range(4)]
    assert seen == [frozenset(x) for x in ("a", "b", "b", "c")]  # (before: a, b, c, a)
    eng = rule(["a", "b", "c"], fits={"a", "b", "c"}, planned=set(), together=False)
    seen = [_turn(eng, left_out={"b"}) for i in range(6)]
    assert seen == [frozenset(x) for x in ("a", "b", "b", "b", "c", "a")]  # then moves on


def test_a_segment_whose_check_fits_only_on_a_step_planned_around_it_gets_its_turn(rule):
    names = ["a", "b", "c", "d"]
    eng = rule(names, fits={"a", "b", "d"}, planned={"c"})
    seen = [_turn(eng) for _ in range(2 * len(names))]
    assert frozenset({"c"}) in seen  # (before: never; a, b and d took every turn)
    assert set().union(*seen) == set(names)
    assert eng.planned_around and eng.checks_skipped == 0


def test_every_segment_is_checked_within_one_round(rule):
    names = ["a", "b", "c", "d", "e"]
    eng = rule(names, fits={"b", "e"}, planned={"a", "c", "d"})
    for start in range(len(names)):
        eng._check_cursor = start
        seen = [_turn(eng) for _ in range(len(names))]
        assert set().union(*seen) == set(names), (start, seen)


def test_a_segment_whose_check_never_fits_is_named_and_counted(rule):
    names = ["a", "b", "c"]
    eng = rule(names, fits={"a", "c"}, planned=set())
    with pytest.warns(RuntimeWarning, match="segment 'b' skipped") as got:
        seen = [_turn(eng) for _ in range(3 * len(names))]
    assert all(seen) and set().union(*seen) == {"a", "c"}
    assert eng.checks_skipped >= 1 and "'b'" in eng.checks_skipped_reason
    assert sum("segment 'b'" in str(w.message) for w in got) == 1  # named once


def test_nothing_fits_skips_the_step_and_warns_once(rule):
    eng = rule(["a", "b"], fits=set(), planned=set())
    with pytest.warns(RuntimeWarning, match="derivative check skipped at step") as got:
        seen = [_turn(eng) for _ in range(3)]
    assert seen == [frozenset()] * 3 and eng.checks_skipped == 3
    assert len(got) == 1


class _Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.a, self.b = nn.Linear(32, hidden), nn.Linear(hidden, 32)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _Uneven(nn.Module):
    """Five residual blocks, the third four times the others' width and the fourth sixteen:
    the third's check needs more than the first two's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(h) for h in (64, 64, 256, 1024, 64))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _steps(m, e, steps, start, check=False):
    seen = []
    for s in range(steps):
        if check:
            e.request_check()
        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(start + s))
        m(x).pow(2).mean().backward()
        m.zero_grad(set_to_none=True)  # every step begins and ends without gradients
        seen.append(e.window_stats())
    return seen


def _planned_at_the_lowest():
    """:class:`_Uneven` installed, calibrated and planned at its lowest feasible budget (after
    six measured steps of a first such plan): (model, engine, replayed segments, costs)."""
    torch.manual_seed(0)
    m = _Uneven()
    e = lr.install(m, [f"blocks.{i}" for i in range(5)], budget=10**12)
    _steps(m, e, STEPS_TO_PLAN, 0)
    e.replan(budget=min_feasible_budget(e.costs, e.real_base_memory, **e.phase_peak_args))
    _steps(m, e, 6, 50)
    e.replan(budget=min_feasible_budget(e.costs, e.real_base_memory, **e.phase_peak_args))
    replayed = [n for n, o in e.plan.choices.items() if o != "retain"]
    return m, e, replayed, {c.name: c for c in e.costs}


def test_a_larger_segment_is_checked_or_named_under_a_budget_the_others_fit(collector_off):
    """The plan replays segments of unequal size; the budget fits a check of any of the
    smaller ones beside it, not the larger one's. Every replayed segment is checked within
    two rounds, or named in a warning (before: the larger one was never checked, silently)."""
    m, e, replayed, by_name = _planned_at_the_lowest()
    peaks = {n: e._checked_peak(by_name, [n]) for n in replayed}
    large = max(peaks, key=peaks.get)
    small = max(p for n, p in peaks.items() if n != large)
    assert len(replayed) >= 3 and peaks[large] > small, peaks
    e.budget = (small + peaks[large]) // 2  # the plan keeps its choices
    version = e.plan_version
    with pytest.warns(RuntimeWarning) as got:
        seen = _steps(m, e, 2 * len(replayed), 100, check=True)
    assert e.plan_version == version
    checked = set().union(*(s["checked"] for s in seen))
    named = {n for n in replayed if any(f"segment {n!r} skipped" in str(w.message) for w in got)}
    assert checked | named == set(replayed), (checked, named, peaks, e.budget)
    assert set(replayed) - {large} <= checked
    if large in named:
        assert e.checks_skipped >= 1
    for stats in seen:
        assert stats["checked"] and stats["peak_bytes"] <= e.budget, (stats, e.budget)


def test_plain_steps_between_checked_ones_do_not_hold_the_rotation_back(collector_off):
    """Checked steps with plain ones between (``check_every_n_steps``): every replayed segment
    is checked within one round of checked steps. (A first version of the missed-turn rule
    read the plain step's empty record as the chosen segments not having run, and gave the
    same segments every turn.)"""
    m, e, replayed, by_name = _planned_at_the_lowest()
    e.budget = max(e._checked_peak(by_name, [n]) for n in replayed)  # any one fits
    assert e._checked_peak(by_name, replayed) > e.budget  # not all at once
    version, seen = e.plan_version, []
    for s in range(len(replayed)):
        seen += _steps(m, e, 1, 100 + 2 * s, check=True)
        _steps(m, e, 1, 101 + 2 * s)  # a plain step between
    assert e.plan_version == version
    assert set().union(*(s["checked"] for s in seen)) == set(replayed), seen
