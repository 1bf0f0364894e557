"""Which option each segment is timed with in a calibration step, under the budget.

A calibration step's peak is predicted as the planner predicts a plan's (from the probe's
figures); where an option would take the step over the budget, the segment is timed with a
cheaper one in that phase instead, so that calibration itself keeps to the budget.

Functions over the engine (``eng``, a
:class:`~lightning_replay.core.engine.engine.ReplayEngine`): its runtimes, cost meter, budget
and configuration. Moved out of engine.py as they were (``self`` is ``eng``).
"""

from __future__ import annotations

from typing import Mapping

from lightning_replay.core.base.contract import SELECTIVE, base_option
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.mechanisms.costs import peak_order
from lightning_replay.core.runtime import SegmentRuntime


def calibration_peak(eng, choices: Mapping[str, str], base: int) -> int:
    """A calibration step's peak by the probe's figures, as the planner predicts a plan's:
    ``base`` (:meth:`_calibration_base`), each segment's inputs and preserved state under its
    calibration option
    (its activations where it keeps them), and each replay's activations on top."""
    costs, picks = [], {}
    for name in peak_order(eng):  # (a segment called k times: at its last call)
        rt = eng.runtimes[name]
        c = rt.contract
        if c is None:
            continue
        o = choices.get(name, c.option)
        held, replay = calibration_held(eng, rt, o)
        costs.append(
            _planner.SegmentCost(
                name,
                int(c.activation_bytes * eng.size_scale(eng.probe_size)),
                {o: _planner.Option(held, 0.0, replay=replay)},
            )
        )
        picks[name] = o
    return _planner.predicted_peak(costs, picks, base, **eng.phase_peak_args)


def calibration_held(eng, rt: SegmentRuntime, o: str) -> tuple[int, int | None]:
    """What segment ``rt`` holds from its forward to its backward under option ``o`` in a
    calibration step, and what its replay re-materializes (``None``: its activations). A
    selective option holds its kept outputs too (measured on a warm-up step before its
    phase; until then, as many bytes as its activations), and its replay adds its
    activations less the kept outputs (those autograd saves are held already, the others are
    consumed as the replay uses them)."""
    c = rt.contract
    k = max(getattr(rt, "window_calls", 1), 1)  # called k times per window: k calls' worth
    # the probe's figures, at the inputs planned for (a larger batch since: scaled up)
    grow = eng.size_scale(eng.probe_size)
    if o == "retain":
        kept_act = eng.meter.window_activation_bytes(rt.name, c.activation_bytes, k)
        return int((kept_act + k * rt.input_saved_bytes) * grow), None
    # read-only copies and the region log: once per window (the probe's region estimate)
    est = sum(
        min(s.region_bytes, s.nbytes)
        for s in c.changing
        if s.regions_ok and not s.unannotated_write
    )
    per_call, once = eng.meter.held_bytes(rt.name, c, o, k, regions=est)
    held = k * (int(rt.input_bytes * grow) + per_call) + once
    if o not in SELECTIVE:
        return held, None
    one = int(eng.meter.selective_bytes.get(rt.name, c.activation_bytes) * grow)
    return held + k * one, max(int(c.activation_bytes * grow) - one, 0)


def fit_calibration(eng, choices: dict[str, str], allowed: Mapping[str, list]) -> None:
    """Under a byte budget, calibrate only options that fit: where a whole snapshot would
    take the step over the budget, the segment is timed with regions (or recompute) in this
    phase instead, largest snapshot first. An option that does not fit with every other
    segment at its calibration option fits in no plan either, so nothing the planner could
    choose is left untimed; it stays out of the cost table (never measured). Under
    ``budget="min"`` only each segment's lowest option is timed: the plan picks no other."""
    if eng.budget is None:
        if eng.config.budget.min and eng.config.planner != "selective_all":
            # (selective_all plans each segment's lowest *selective* option: timed too)
            # the lowest-memory plan: no segment's held bytes beyond its lowest option's
            # are ever chosen, so no step times them (the probe's figures rank them)
            fit_to(eng, choices, allowed, lambda: True)
        return
    base = eng._calibration_base()  # a walk of the process: once per phase step
    fit_to(eng, choices, allowed, lambda: calibration_peak(eng, choices, base) > eng.budget)


def fit_to(eng, choices: dict[str, str], allowed: Mapping[str, list], over) -> None:
    """While ``over()``, time the segment whose option saves the most preserved bytes
    with a cheaper one (recompute or regions) instead."""
    while over():
        swaps = []
        for name, o in choices.items():
            rt = eng.runtimes[name]
            now = calibration_held(eng, rt, o)[0]  # (a selective option: kept outputs)
            cheaper = [
                alt
                for alt in dict.fromkeys(("recompute", "regions", base_option(o)))
                if alt in allowed[name] and calibration_held(eng, rt, alt)[0] < now
            ]
            if cheaper:
                saved = now - calibration_held(eng, rt, cheaper[0])[0]
                swaps.append((saved, name, cheaper[0]))
        if not swaps:
            return  # the lowest options already: the first plan judges the budget
        _, name, alt = max(swaps)
        choices[name] = alt


def lowest_peak(eng, allowed: Mapping[str, list]) -> int | None:
    """The lowest peak any plan can reach, by the figures calibration steps are predicted with
    (each segment's held bytes under each option it may take, and its replay) on the real
    base and the measured phases, as :func:`~lightning_replay.planner.min_feasible_budget`
    finds it over every combination: the first plan's refusal figure, before its timings.
    ``None`` where an option's bytes are still a stand-in (a selective option's kept outputs
    before its phase measured them): the lowest could be lower than the figure says."""
    costs = []
    for name in peak_order(eng):
        rt = eng.runtimes[name]
        c = rt.contract
        if c is None or name not in allowed:
            continue
        opts = {}
        for o in allowed[name]:
            if o in SELECTIVE and name not in eng.meter.selective_bytes:
                return None
            held, replay = calibration_held(eng, rt, o)
            opts[o] = _planner.Option(held, 0.0, replay=replay)
        if not opts:
            return None
        # (the probe's figure, at the inputs planned for)
        act = int(c.activation_bytes * eng.size_scale(eng.probe_size))
        costs.append(_planner.SegmentCost(name, act, opts))
    if not costs:
        return None
    return _planner.min_feasible_budget(costs, eng.real_base_memory, "joint", **eng.phase_peak_args)


def refuse_before_calibrating(eng, allowed: Mapping[str, list]) -> None:
    """Under a byte budget, once a step was measured (the untimed warm-up that runs every
    segment at its lowest option): where no combination of options fits the budget by the
    measured figures, the first plan would be refused after the calibration steps, each of
    them over the budget. Refuse now instead (:class:`InfeasibleBudget` with the lowest
    peak), before the next step runs over it."""
    if eng.budget is None or eng.last_real_peak is None:
        return
    lowest = lowest_peak(eng, allowed)
    if lowest is None or lowest <= eng.budget:
        return
    eng._calibration = []  # a later step (a budget raised meanwhile) calibrates afresh
    raise _planner.InfeasibleBudget(eng.budget, lowest, eng.planner, lowest)
