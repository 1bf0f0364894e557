"""What a step really held: the real-peak measurement and what the engine learns from it.

A measured step (CPU: profiler memory events over the first steps of each plan, the
calibration's warm-up steps, then now and then; CUDA: the allocator's counters per phase) is
compared with the engine's own figures, phase by phase (the forward's end, each replay, the
optimizer step). What it held beyond them is folded into the base the plans are made with
(:attr:`~lightning_replay.core.engine.engine.ReplayEngine.real_base_memory`,
:attr:`~lightning_replay.core.engine.engine.ReplayEngine.phase_peak_args`), and a plan that no
longer fits the budget is made again.

Functions over the engine (``eng``, a
:class:`~lightning_replay.core.engine.engine.ReplayEngine`), whose state they read and write
(its ``_truth*``, ``_over_*``, ``_residual*``, ``_floor*`` fields and its optimizers): the
engine calls them at a window's start and end and from its optimizer hooks. Moved out of
engine.py as they were (``self`` is ``eng``).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.mechanisms.memory import StepPeak, live_model_bytes

_REPLAY = "replay:"  # a step's phase that begins at a segment's replay (then its name)


def settle_real_peak(eng) -> None:
    """After a measured step (CPU: the first steps of each plan, the calibration's warm-up
    steps, then now and then) or any planned step (CUDA): fold what the step held beyond
    the engine's figures into the base, re-plan if the plan no longer fits the budget, and
    warn if the step's real peak went over it."""
    acct = eng.accountant
    if acct is None or not eng.real_peak:
        return
    segments = dict(acct.phase_peaks)  # the accountant's figures per phase
    accounted = eng._static_bytes() + acct.peak
    if eng._truth is not None:
        stop_truth(eng, eng._truth)
    measured = eng._truth_peak is not None
    plan = eng._truth_plan if measured else eng.plan
    if measured:
        real, eng._truth_peak = eng._truth_peak, None
        phases = eng._truth_phases
    elif eng.plan is not None and eng._cuda and eng._cuda_device is not None:
        real = int(torch.cuda.max_memory_allocated(eng._cuda_device)) if eng._last_step else 0
        if not real:
            return
        # each phase's peak was read (and the allocator's reset) as the next began
        phases = dict(eng._cuda_phases)
        phases[eng._cuda_label] = max(phases.get(eng._cuda_label, 0), real)
        real = max(phases.values())
    else:
        return
    eng.last_real_peak = (eng._last_step, real)
    size = eng._truth_step_size if measured else eng._window_size
    if size <= eng.probe_size or not eng.probe_size:
        released = eng._truth_released if measured else eng._replay_released
        fwd, replays, floor = phase_residuals(eng, real, phases, segments, plan, released)
    else:
        # inputs larger than the costs were measured at: the formula's figures and the
        # replays' (re-materialized bytes from the costs) are stale, the accountant's whole
        # step is not: one residual against it, at every moment
        fwd, replays, floor = real - accounted, {}, phases.get("optimizer", 0)
        if size > eng._residual_size:  # figures at smaller inputs are stale
            eng._over_fwd, eng._over_replay = None, {}
    grew = eng._over_fwd is None or fwd > eng._over_fwd
    eng._over_fwd = fwd if eng._over_fwd is None else max(eng._over_fwd, fwd)
    for name, over in replays.items():
        if over > eng._over_replay.get(name, over - 1):
            eng._over_replay[name] = over
            grew = True
    if grew:
        # (at least 0: the base never shrinks below the accountant's figures)
        eng._residual = max(min([eng._over_fwd, *eng._over_replay.values()]), 0)
        # the input size of the step measured (on CUDA, the step just trained)
        eng._residual_size = size
        eng._residual_fixed = (
            eng._truth_opt
            if measured
            else max(optimizer_bytes(eng), eng._cuda_held - eng._static_bytes())
        )
    if floor > eng._floor:
        eng._floor = floor
        eng._floor_size = eng._truth_step_size if measured else eng._window_size
        eng._floor_inputs = eng._truth_inputs if measured else 0
    if eng.plan is None:
        return
    eng._refit_plan()
    if eng.budget is not None and real > eng.budget and eng._over_budget_warned != eng.plan_version:
        eng._over_budget_warned = eng.plan_version
        warnings.warn(
            f"step {eng._last_step} held {format_bytes(real)} ({real} bytes) of real memory, "
            f"over the budget ({format_bytes(eng.budget)}): "
            f"{format_bytes(eng._residual)} beyond the engine's figures (backward "
            "temporaries, optimizer state, state that grew since the last measurement). "
            f"The plan in force (v{eng.plan_version}) now predicts "
            f"{format_bytes(eng.plan.peak_memory)} with that.",
            RuntimeWarning,
            stacklevel=3,
        )


def phase_residuals(
    eng,
    real: int,
    phases: Mapping[str, int],
    segments: Mapping[str, int],
    plan: _planner.Plan | None,
    released: Mapping[str, int] | None = None,
) -> tuple[int, dict[str, int], int]:
    """What a measured step held beyond the plan formula's figures, per phase: (the
    forward's end, loss and backward until the first replay; per segment replayed, its
    replay and backward until the next replay; the optimizer step's real peak, 0 where it
    was not told apart).

    Each phase's real peak is paired with the formula's own figure for that phase of the
    step's choices: the base (what is saved outside segments held all step) plus what the
    segments held at that phase's moments (the accountant's per-phase figures, or the plan's
    cost formula where lower: costs can miss what a step holds). One residual paired with
    one moment and added to every other would count twice what the base charges and the
    step freed before its replays, or miss what the head and loss add on top of the
    segments the forward retained; and the gradients made by each replay's moment differ
    from one replay to the next (the formula charges them all step)."""
    base = eng.base_memory
    figures = dict(segments)  # label -> the segments' bytes at that phase's peak
    if plan is not None and not eng._truth_checked:
        costs = [c for c in eng.costs or [] if plan.choices.get(c.name) in c.options]
        if costs and len(costs) == len(plan.choices):
            held, replays = _planner.peak_terms(
                costs, {c.name: plan.choices[c.name] for c in costs}
            )
            counted = figures.get("start", held)
            if counted > held + max(held // 100, 4096) and eng.measure_costs:
                # the segments held more than the plan's options are costed (a call the costs
                # missed, issue 31): a cost error of these options, charged to them, not a
                # base every plan would carry (it inflated the lowest plan over the budget)
                chosen = {
                    c.name: (plan.choices[c.name], c.options[plan.choices[c.name]].memory)
                    for c in costs
                }
                eng.meter.charge_miss(chosen, counted - held)
                eng._plan_extras = None  # the plan in force is predicted again (_refit_plan)
                figures["start"] = counted
            else:
                figures["start"] = min(counted, held)
            for name, term in replays.items():
                label = _REPLAY + name
                if label in figures:
                    figures[label] = min(figures[label], term)
    if not phases:  # not told apart: the whole step at its first phase
        phases = {"start": real}
    start = phases.get("start", 0)
    replays: dict[str, int] = {}
    for label, peak in phases.items():
        if label.startswith(_REPLAY) and label in figures:
            # The formula's figure holds the segment's preserved bytes at its replay; the
            # call gives them back as the replay ends, before the backward's temporaries
            # peak. Paired with the figure as it holds them, the residual would come out
            # that much short, and a plan that retains the segment (nothing preserved,
            # the same temporaries) would be predicted that much low. Paired without them,
            # it is the temporaries; a replayed option is then charged them on top of its
            # preserved bytes (never under).
            held = figures[label] - (released or {}).get(label, 0)
            replays[label[len(_REPLAY) :]] = peak - (base + held)
        elif label != "optimizer":  # nothing to pair it with: counted in the first
            start = max(start, peak)
    return start - (base + figures.get("start", 0)), replays, phases.get("optimizer", 0)


def start_truth(eng) -> None:
    truth = StepPeak(eng.model)
    try:
        truth.start()
    except RuntimeError as exc:  # another profiler got there first: measure nothing
        warnings.warn(
            f"the real peak of step {eng.step} was not measured ({exc}); the "
            "plan's predictions leave out what the accountant does not count",
            RuntimeWarning,
            stacklevel=3,
        )
        eng._truth_off = True
        return
    eng._truth = truth
    eng._replay_released = {}
    # what the process held beyond the model's own tensors (gradients that exist now
    # included) and the batch: optimizer state and whatever anyone keeps between steps
    eng._truth_held = truth.base - live_model_bytes(eng.model) - eng._truth_inputs
    # Stop right after the step's optimizer step (its temporaries and state included),
    # so the profiler does not span the caller's code between steps; else when the next
    # window begins. Not from inside backward: autograd restores the thread's profiler
    # state after its callbacks.
    eng._truth_hook = register_optimizer_step_post_hook(lambda opt, *_: stop_truth(eng, truth, opt))
    # the optimizer step is a phase of its own: its peak holds no activation
    eng._truth_pre_hook = register_optimizer_step_pre_hook(
        lambda *_: truth.mark("optimizer") if eng._truth is truth else None
    )


def stop_truth(eng, truth: StepPeak, optimizer: Any = None) -> None:
    if eng._truth is truth:
        eng._truth = None
        if eng._truth_hook is not None:
            eng._truth_hook.remove()
            eng._truth_hook = None
        if eng._truth_pre_hook is not None:
            eng._truth_pre_hook.remove()
            eng._truth_pre_hook = None
        if optimizer is not None:
            adopt_optimizer(eng, optimizer)
        # the process's live storages when the step began (parameters, optimizer state,
        # the batch, whatever anyone kept) + the step's net peak: nothing to add
        eng._truth_peak = truth.stop()
        eng._truth_phases = dict(truth.phases)
        eng._truth_released = dict(eng._replay_released)
        # held between steps, not growing with the input: the optimizer's state and
        # whatever else the process kept beyond the model's own tensors and the batch
        eng._truth_opt = max(optimizer_bytes(eng), eng._truth_held)


def adopt_optimizer(eng, optimizer: Any) -> bool:
    """Track an optimizer seen stepping this model's parameters (one ``track_optimizer``
    was not told about): its state is part of every step's real memory."""
    if any(o is optimizer for o in eng._optimizers):
        return False
    ours = {id(p) for p in eng.model.parameters()}
    groups = getattr(optimizer, "param_groups", ())
    if not any(id(p) in ours for g in groups for p in g.get("params", ())):
        return False
    eng._optimizers.append(optimizer)
    return True


def optimizer_bytes(eng) -> int:
    return live_model_bytes(nn.Module(), eng._optimizers) if eng._optimizers else 0
