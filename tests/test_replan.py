"""The re-plan policy in the core: ``install(replan_on=...)`` re-plans without Lightning, for the
same reasons ReplayCallback does under the strategy (violations, divergences, a memory misfit,
changed input shapes), and not at all by default."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.config import ReplanSettings
from lightning_replay.planner import min_feasible_budget
from lightning_replay.replan import ReplanPolicy


class TableReader(nn.Module):
    """Reads a table it does not own; the test changes the table inside a window."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 512)
        self.out = nn.Linear(512, 16)
        object.__setattr__(self, "_table", table)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(x))) @ self._table.clone()


def _table_model():
    torch.manual_seed(0)
    table = torch.eye(16)
    blocks = [nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 16)) for _ in range(2)]
    return nn.Sequential(TableReader(table), *blocks, nn.Linear(16, 1)), table


def _plans(engine):
    return [r for r in engine.records.read() if r.check == "plan" and r.outcome == "match"]


def _reasons(record) -> list[str]:
    return json.loads(record.detail)["reasons"]


def _contracts(engine, segment="0"):
    return [r for r in engine.records.read() if r.check == "contract" and r.segment == segment]


def _run_with_table_writes(
    replan_on, write, steps=14, from_step=6, check=False, until=None, planner="joint"
):
    """Train ``steps`` steps; from ``from_step`` on, ``write(table)`` runs inside each window
    (after the forward, before the backward), on the installed model and on an identical
    plain one. Returns the engine, the installed model and the plain one."""
    m, table = _table_model()
    ref, ref_table = _table_model()
    engine = lr.install(
        m,
        ["0", "1", "2"],
        budget="min",
        calibration_steps=1,
        on_violation="record",
        planner=planner,
        replan_on=replan_on,
        replan_cooldown_steps=1,
        # segment 0 replays in every plan (the writes are seen at its replay): under "min" the
        # planner may retain it where that costs nothing at the step's real peak (issue 31)
        preservation={"0": "whole"},
    )
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        if check and step >= from_step:
            engine.request_check()
        for model, tab in ((m, table), (ref, ref_table)):
            model.zero_grad()
            out = model(x)
            if from_step <= step < (until or steps):
                write(tab)
            with warnings.catch_warnings():  # the rejection warns; the records tell
                warnings.simplefilter("ignore", RuntimeWarning)
                out.sum().backward()
    return engine, m, ref


def test_a_violation_replans_once_the_new_contract_is_in_force():
    engine, m, ref = _run_with_table_writes(("violations",), lambda t: t.add_(0.5))
    rejected = engine.records.read(outcome="rejection")
    assert [r.check for r in rejected] == ["version"]
    contracts = _contracts(engine)
    assert [r.contract_version for r in contracts] == [1, 2]
    plans = _plans(engine)
    assert [r.contract_version for r in plans] == [1, 2]  # plan versions
    assert plans[1].step > contracts[1].step  # planned after the new contract, not before
    # each plan record says why it was made: the calibration's end, then the policy's reason
    assert [_reasons(r) for r in plans] == [["calibrated"], ["violations"]]
    assert engine.replan_policy.replans == 1 and engine.plan_version == 2
    # the re-plan changed options, not numbers: after the rejected step the replayed
    # segment's gradients are a plain model's
    assert torch.equal(m[0].fc.weight.grad, ref[0].fc.weight.grad)


def test_without_replan_on_the_engine_keeps_its_first_plan():
    engine, _, _ = _run_with_table_writes((), lambda t: t.add_(0.5))
    assert engine.replan_policy is None
    assert [r.contract_version for r in _contracts(engine)] == [1, 2]  # re-probed all the same
    assert [r.contract_version for r in _plans(engine)] == [1] and engine.plan_version == 1


def test_a_divergence_replans_like_a_rejection():
    """A ``.data`` write bumps no version: only a check sees it, and its divergence is what
    re-plans."""
    engine, _, _ = _run_with_table_writes(
        ("violations",), lambda t: t.data.add_(0.5), check=True, until=7, planner="fixed_regions"
    )
    assert engine.records.read(check="version") == []
    assert engine.records.read(outcome="divergence")
    # one re-plan, judged right after the step that re-probed the segment (not before)
    assert engine.replan_policy.replans == 1
    assert engine.replan_policy.last_replan_step == _contracts(engine)[1].step


def test_a_memory_misfit_replans_and_the_new_plan_holds_the_budget():
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32)) for _ in range(4)]
    )
    engine = lr.install(
        model,
        ["0", "1", "2", "3"],
        budget="1GiB",
        calibration_steps=1,
        replan_on=("memory",),
        replan_cooldown_steps=1,
    )
    peaks = {}
    lowered = None
    for step in range(14):
        model(torch.randn(64, 32, generator=torch.Generator().manual_seed(step))).sum().backward()
        stats = engine.window_stats()
        peaks[stats["step"]] = stats["peak_bytes"]
        if step == 7:
            assert engine.plan_version == 1 and set(engine.plan.choices.values()) == {"retain"}
            lowered = min_feasible_budget(
                engine.costs, engine.real_base_memory, **engine.phase_peak_args
            )
            # the all-retained plan no longer fits: its prediction, in the same (whole-process)
            # terms as the lowered budget (the accountant's peak leaves out what the process
            # holds beyond it, which in a full suite's order is more than the difference)
            assert engine.plan.peak_memory > lowered
            engine.reconfigure(budget=lowered)
            at = stats["step"]
    assert engine.replan_policy.replans == 1 and engine.plan_version == 2
    assert _reasons(_plans(engine)[-1]) == ["memory"]
    assert engine.plan.budget == lowered
    assert any(o != "retain" for o in engine.plan.choices.values())
    after = [peaks[s] for s in peaks if s > at + 1]
    assert after and max(after) <= lowered, (after, lowered)


@pytest.mark.parametrize(
    "sizes, replans",
    [
        ([8] * 7 + [4] * 4, 1),  # the shapes change for good: one re-plan
        ([8] * 7 + [4] + [8] * 3, 0),  # one short batch: no re-plan
    ],
)
def test_changed_input_shapes_replan_once_they_persist(sizes, replans):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    engine = lr.install(
        model,
        ["0", "2"],
        budget="min",
        calibration_steps=1,
        replan_on=("shapes",),
        replan_cooldown_steps=1,
    )
    for i, n in enumerate(sizes):
        model(torch.randn(n, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
    assert engine.replan_policy.replans == replans
    if replans:  # (a re-plan to the same choices writes no record)
        assert {"shapes"} >= {x for r in _plans(engine)[1:] for x in _reasons(r)}


def test_a_plan_made_by_hand_says_it_was_requested():
    """``engine.replan(...)`` by the caller: its record says ``requested``; a plan the engine
    makes itself names its own reason (the first: ``calibrated``)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 16)) for _ in range(3)]
    )
    engine = lr.install(model, ["0", "1", "2"], budget="1GiB", calibration_steps=1)
    for i in range(4):
        model(torch.randn(32, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
    engine.replan(budget=None)  # the lowest-memory plan: other choices than all-retain
    plans = _plans(engine)
    assert [_reasons(r) for r in plans] == [["calibrated"], ["requested"]], plans
    assert engine._why == ()  # (nothing left in force after the calls)


def test_the_policy_waits_while_a_segment_is_probed_and_honours_the_cooldown():
    """The pure policy: reasons from a stand-in engine, no training."""

    class Engine:
        step, budget, unaccounted_bytes, peak_is_allocator = 10, 1000, 0, False
        plan = type("P", (), {"peak_memory": 500, "choices": {"a": "whole"}})()
        costs = [type("C", (), {"name": "a", "options": {"whole": 1}})()]
        contracts = {}
        status = "active"

        def summary(self):
            return {"a": {"status": self.status}}

    e = Engine()
    policy = ReplanPolicy(
        ReplanSettings(replan_on=("memory", "violations"), replan_cooldown_steps=5)
    )
    assert policy.reasons(e, violations=False, peak=600, checked=False) == []
    e.status = "probing"  # a violation is pending, the segment is being probed: wait
    assert policy.reasons(e, violations=True, peak=2000, checked=False) == []
    e.status = "active"
    assert policy.reasons(e, violations=False, peak=2000, checked=False) == ["memory", "violations"]
    assert policy.reasons(e, violations=False, peak=2000, checked=True) == ["violations"]
    policy.last_replan_step = 8  # re-planned two steps ago: memory waits for the cooldown
    assert policy.reasons(e, violations=False, peak=2000, checked=False) == ["violations"]


def test_replan_settings_are_validated_where_install_takes_them():
    with pytest.raises(lr.ReplayConfigError, match=r"unknown entries \['weather'\]"):
        lr.install(nn.Sequential(nn.Linear(2, 2)), ["0"], replan_on=("weather",))
    with pytest.raises(lr.ReplayConfigError, match=r"install\(replan_cooldown_steps=0\)"):
        lr.install(nn.Sequential(nn.Linear(2, 2)), ["0"], replan_cooldown_steps=0)
