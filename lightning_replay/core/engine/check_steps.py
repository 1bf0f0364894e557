"""Which segments a step derivative-checks, and the plan a checked step runs under.

Without a budget every segment is checked on a checked step. Under a budget, a checked segment
keeps its graph beside its replay, so the segments checked are those whose graphs fit beside
the plan in force (taken in turn from step to step); where none fits, the step is planned
around one check (more segments replayed for that step), or the check is skipped, recorded
and warned once.

Functions over the engine (``eng``, a
:class:`~lightning_replay.core.engine.engine.ReplayEngine`): its plan, costs, budget and
runtimes. Moved out of engine.py as they were (``self`` is ``eng``).
"""

from __future__ import annotations

import warnings
from typing import Mapping

from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.base.state import unique_bytes as _unique_bytes
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.engine.config import PIN_OPTIONS


def select_checked(eng, requested: list[str] | None) -> frozenset:
    """The segments to derivative-check this window (see :meth:`request_check`)."""
    if requested is not None:
        return frozenset(requested)
    if eng.plan is None or not eng.budget:
        return frozenset(eng.segments)
    choices = eng.plan.choices
    # segments the plan covers with an option they still have (a segment first probed
    # after the plan, or re-probed since, is left out until the next plan)
    by_name = {
        c.name: c for c in eng.costs or [] if c.name in choices and choices[c.name] in c.options
    }
    # (a segment whose inputs it writes is never derivative-checked: its replay is not
    # compared, so it takes no turn)
    candidates = [
        n
        for n in eng.segments
        if n in by_name
        and choices[n] != "retain"
        and not (eng.runtimes[n].contract and eng.runtimes[n].contract.written_inputs)
    ]
    if not candidates:
        return frozenset()
    k = eng._check_cursor % len(candidates)
    order = candidates[k:] + candidates[:k]
    grads = {
        n: 2 * _unique_bytes([p for p in eng.runtimes[n].module.parameters() if p.requires_grad])
        for n in candidates
    }
    # The segment whose turn it is is checked first: beside the plan in force with as many
    # of the others as fit, else on a step planned around its check (more segments replayed
    # for one step). Passed over only where neither fits the budget: a segment whose check
    # never fits beside the plan is not left unchecked while the others take every turn
    # (before, the ones that fit were checked and the cursor moved past it).
    passed: list[str] = []
    for i, n in enumerate(order):
        if checked_peak(eng, by_name, [n], grads) <= eng.budget:
            chosen = [n]
            for m in order[i + 1 :]:
                if checked_peak(eng, by_name, chosen + [m], grads) <= eng.budget:
                    chosen.append(m)
            # the next turn is the first segment after this one that was not checked
            rest = [j for j in range(i + 1, len(order)) if order[j] not in chosen]
            eng._check_cursor = k + (rest[0] if rest else len(order))
            _passed_over(eng, passed)
            eng._check_turn = (frozenset(chosen), candidates)
            return frozenset(chosen)
        step_plan = check_step_plan(eng, by_name, n, grads)
        if step_plan is not None:
            eng._step_choices = dict(step_plan.choices)
            eng._set_options(step_plan.choices)
            eng._check_cursor = k + i + 1
            _passed_over(eng, passed)
            eng._check_turn = (frozenset([n]), candidates)
            return frozenset([n])
        passed.append(n)
    eng._check_cursor = k + 1
    eng.checks_skipped += 1
    eng.checks_skipped_reason = (
        f"keeping one replayed segment's graph beside its replay needs more than the "
        f"budget {format_bytes(eng.budget)}, even with every other segment replayed"
    )
    if _first_named(eng, "*"):
        warnings.warn(
            f"derivative check skipped at step {eng.step}: "
            f"{eng.checks_skipped_reason}, by the measured costs. Raise the budget to "
            "check under it, or name segments with request_check(segments=...).",
            RuntimeWarning,
            stacklevel=3,
        )
    return frozenset()


def missed_turn(eng) -> None:
    """A segment chosen at its turn that did not run under its check in that window (the
    model left it out of that step) gets the next turn again, up to :data:`_MISSED_TURNS`
    turns in a row; before, the cursor had moved past it, and a segment left out of every
    other step, on its turns, was never checked. Called as every window begins, before the
    last window's record of what ran is reset (plain windows come between checked ones)."""
    turn, eng._check_turn = eng._check_turn, None
    if turn is None:
        return
    chosen, candidates = turn
    for n in chosen & eng._checked_ran:
        eng._check_missed.pop(n, None)
    for n in candidates:
        if n in chosen and n not in eng._checked_ran:
            tries = eng._check_missed.get(n, 0) + 1
            eng._check_missed[n] = tries
            if tries <= _MISSED_TURNS:
                eng._check_cursor = candidates.index(n)
                return
            eng._check_missed.pop(n, None)  # its turn comes round again in the next round


#: turns in a row a chosen segment that did not run gets again
_MISSED_TURNS = 2


def _first_named(eng, key: str) -> bool:
    """Whether a skipped-check warning names ``key`` for the first time under the plan in
    force (a new plan version names again what it passes over)."""
    version, named = eng._checks_named
    if version != eng.plan_version:
        named = set()
        eng._checks_named = (eng.plan_version, named)
    if key in named:
        return False
    named.add(key)
    return True


def _passed_over(eng, passed: list[str]) -> None:
    """Segments whose turn a checked step passed over (their check fits the budget neither
    beside the plan nor on a step planned around it) while others were checked: counted as
    skipped checks, and named once each."""
    for n in passed:
        eng.checks_skipped += 1
        eng.checks_skipped_reason = (
            f"keeping segment {n!r}'s graph beside its replay needs more than the budget "
            f"{format_bytes(eng.budget)}, even with every other segment replayed"
        )
        if _first_named(eng, n):
            warnings.warn(
                f"derivative check of segment {n!r} skipped at step {eng.step}: "
                f"{eng.checks_skipped_reason}, by the measured costs (other segments are "
                "checked). Raise the budget to check it under it, or name it with "
                f"request_check(segments=[{n!r}]).",
                RuntimeWarning,
                stacklevel=4,
            )


def check_step_plan(
    eng, by_name: Mapping[str, _planner.SegmentCost], checked: str, grads: Mapping[str, int]
) -> _planner.Plan | None:
    """A plan for one checked step: ``checked`` keeps its graph beside its planned option
    (charged as :meth:`_checked_peak` charges it) and the others take whatever fits the
    budget (their pins kept); None when nothing does."""
    costs = []
    for c in eng.costs or []:
        if c.name not in by_name:
            if c.name in eng.plan.choices and c.name in eng.runtimes:
                return None  # a planned segment without its measured option: no basis
            continue
        if c.name == checked:
            o = eng.plan.choices[c.name]
            opt = c.options[o]
            keep = c.options["retain"].memory + opt.memory + grads[c.name]
            c = _planner.SegmentCost(
                c.name, c.activation_bytes, {o: _planner.Option(memory=keep, time=opt.time)}
            )
        costs.append(c)
    allowed = {
        name: PIN_OPTIONS[eng.runtimes[name].preservation]
        for name in by_name
        if name != checked and eng.runtimes[name].preservation in PIN_OPTIONS
    }
    try:
        return _planner.plan(
            costs,
            budget=eng.budget,
            base_memory=eng.real_base_memory,
            method=eng.planner,
            allowed=allowed,
            **eng.phase_peak_args,
        )
    except (_planner.InfeasibleBudget, ValueError, KeyError):
        return None


def checked_peak(
    eng,
    by_name: Mapping[str, _planner.SegmentCost],
    checked: list[str],
    grads: Mapping[str, int] | None = None,
) -> int:
    """Predicted peak of the plan with ``checked`` segments also keeping their graphs
    (their activations, inputs and preserved state, and ``grads``: two sets of their
    parameter gradients for the comparison, computed here when not given)."""
    costs = []
    for c in by_name.values():
        o = eng.plan.choices[c.name]
        if c.name in checked:
            opt = c.options[o]
            g = (
                grads[c.name]
                if grads is not None
                else 2
                * _unique_bytes(
                    [p for p in eng.runtimes[c.name].module.parameters() if p.requires_grad]
                )
            )
            keep = c.options["retain"].memory + opt.memory + g
            c = _planner.SegmentCost(
                c.name, c.activation_bytes, {o: _planner.Option(memory=keep, time=opt.time)}
            )
        costs.append(c)
    return _planner.predicted_peak(
        costs,
        {n: eng.plan.choices[n] for n in by_name},
        eng.real_base_memory,
        **eng.phase_peak_args,
    )
