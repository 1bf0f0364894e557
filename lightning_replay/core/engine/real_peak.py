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
import weakref
from typing import Any, Mapping

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from lightning_replay._compat import at_backward_end
from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.base.state import storage_key
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.mechanisms.memory import StepPeak, live_model_bytes

_REPLAY = "replay:"  # a step's phase that begins at a segment's replay (then its name)
_FORWARD = "forward:"  # ... at a segment's forward (then its name)
_FORWARD_END = "forward-end:"  # ... as that forward returns (the unsegmented code after it)


def settle_real_peak(eng) -> None:
    """After a measured step (CPU: the first steps of each plan, the calibration's warm-up
    steps, then now and then) or any planned step (CUDA): fold what the step held beyond
    the engine's figures into the base, re-plan if the plan no longer fits the budget, and
    warn if the step's real peak went over it."""
    acct = eng.accountant
    if acct is None or not eng.real_peak:
        return
    segments = dict(acct.phase_peaks)  # the accountant's figures per phase
    static = eng._static_bytes()
    accounted = static + acct.peak
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
    # the largest input measured: figures are dropped as stale only at a larger one (batch
    # sizes that go up and down keep the largest step's figures)
    top = eng._residual_top
    eng._residual_top = max(top, size)
    # the gradients missing as the step began (paired with the figures the plans credit)
    if measured:
        learn_grad_order(eng)
        fresh = eng._truth_fresh
    else:
        fresh = eng._grad_now
    # what the process held beside the model's own tensors as the step began: memory freed
    # since earlier figures were measured leaves them (the plan is made again below); this
    # step's figures are paired with the held bytes the others include
    start = eng._truth_base if measured else eng._cuda_held
    held = start - static + sum((fresh or {}).values())
    pad, freed = rebase_held(eng, held, size, real, size > top)
    real_f = real + pad
    if pad:
        phases = {label: peak + pad for label, peak in phases.items()}
    if size <= eng.probe_size or not eng.probe_size:
        released = eng._truth_released if measured else eng._replay_released
        fwd, replays, floor = phase_residuals(eng, real_f, phases, segments, plan, released, fresh)
    else:
        # inputs larger than the costs were measured at: the formula's figures and the
        # replays' (re-materialized bytes from the costs) are stale, the accountant's whole
        # step is not: one residual against it, at every moment
        # (and against every gradient: which of them the whole step's peak held is not told
        # apart, and a credit scaled with the input would not be one; from here on the plans
        # charge every gradient all step, as with gradients kept)
        # (paired with the plan formula's own figure where it is the larger: the residual is
        # added to the formula's moments, and against the accountant's lower figure it came
        # out that much high, 1.36 x an all-recompute plan's real peak at 4 x the input)
        accounted = max(accounted, eng.base_memory + _formula_peak(eng, plan))
        fwd, replays, floor = real_f - accounted, {}, phases.get("optimizer", 0)
        eng._grad_fresh, eng._phase_credit = {}, {}
        if size > top:  # figures at smaller inputs than any before are stale
            eng._over_fwd, eng._over_replay = None, {}
    # ... and as the formula charged every gradient all step (the plans' figures at inputs
    # larger than measured, where no gradient is credited: grad_credits)
    credits = eng._phase_credit
    raw_fwd = fwd - credits.get("start", 0)
    if size > eng.probe_size and eng.probe_size and size > top:
        eng._raw_fwd, eng._raw_replay = None, {}
    eng._raw_fwd = raw_fwd if eng._raw_fwd is None else max(eng._raw_fwd, raw_fwd)
    for name, over in replays.items():
        raw = over - credits.get(name, 0)
        eng._raw_replay[name] = max(eng._raw_replay.get(name, raw), raw)
    for key, over in eng._phase_forward.items():
        eng._over_seg_fwd[key] = max(eng._over_seg_fwd.get(key, over), over)
        raw = over - credits.get("start", 0)
        eng._raw_seg_fwd[key] = max(eng._raw_seg_fwd.get(key, raw), raw)
    eng._phase_forward = {}
    grew = eng._over_fwd is None or fwd > eng._over_fwd
    eng._over_fwd = fwd if eng._over_fwd is None else max(eng._over_fwd, fwd)
    for name, over in replays.items():
        if over > eng._over_replay.get(name, over - 1):
            eng._over_replay[name] = over
            grew = True
    if grew:
        # (at least 0: the base never shrinks below the accountant's figures)
        eng._residual = max(min([eng._over_fwd, *eng._over_replay.values()]), 0)
        # the input size the residual is in force for (on CUDA, the step just trained): the
        # least any of its figures was measured at, so that none is scaled up less than its
        # own growth (a figure a larger step measured is scaled up more: bounded)
        fresh = size > top or not eng._residual_size
        eng._residual_size = size if fresh else min(eng._residual_size, size)
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
    if freed:
        replan_smaller_base(eng)
    eng._refit_plan()
    # a measured step is judged by the budget it ran under: a replan to a lower budget made
    # between it and this (at the step's end) is for the steps after it (before: a false
    # "over the budget" naming a step that ran within the budget in force then)
    budget = eng._truth_budget if measured else eng.budget
    if budget is not None and real > budget and eng._over_budget_warned != eng.plan_version:
        eng._over_budget_warned = eng.plan_version
        warnings.warn(
            f"step {eng._last_step} held {format_bytes(real)} ({real} bytes) of real memory, "
            f"over the budget ({format_bytes(budget)}): "
            f"{format_bytes(eng._residual)} beyond the engine's figures (backward "
            "temporaries, optimizer state, state that grew since the last measurement). "
            f"The plan in force (v{eng.plan_version}) now predicts "
            f"{format_bytes(eng.plan.peak_memory)} with that.",
            RuntimeWarning,
            stacklevel=3,
        )


#: the least drop in held memory that makes the figures forget it (and 1 % of the step's own
#: bytes; smaller drops add up)
_FREED_MIN = 4096


def rebase_held(eng, held: int, size: int, real: int, larger: bool) -> tuple[int, int]:
    """Memory the process held beside the model's own tensors as measured steps began
    (optimizer state, the batch, a cache, a model nobody uninstalled yet, objects in a
    reference cycle the collector had not reached), freed since. Every figure a measured step
    gives (what it held beyond the accountant's figures, its optimizer phase) includes what
    was held as it began; they never went down, so such memory stayed in every plan's base
    for good (measured: a 1 MiB tensor in a cycle, collected after calibration, kept the
    prediction at 2.5 x the real peak for the rest of the run; ``gpu_check --smoke`` lost
    16 KiB, 2 % of its step, and predicted 1.28 x).

    ``held``: the process's bytes as the step began (CPU: every live storage; CUDA: the
    allocator's) less the model's parameters, buffers and the gradients that existed. Every
    figure in force includes at least :attr:`_held_ref` of it: a step that began with less
    has its own figures raised to it (returned: the pad), so what it held on top is kept.
    Where two measured steps in a row, at the largest input measured, began holding less
    than that by at least :data:`_FREED_MIN` (and 1 % of the step's bytes beyond ``held``),
    every figure loses the difference: it was measured holding at least that much more. One
    low step is not enough (a dip that comes back); after one, the next step is measured.
    Steps on smaller inputs (a last batch) leave the count alone; a larger input than any
    starts it again (the figures kept from smaller ones include no more than the reference).

    Memory freed and later made again is charged again only in the phases measured after it
    came back (as any memory that appears after calibration).

    Returns (the pad for this step's figures, the bytes forgotten)."""
    ref = eng._held_ref
    opt = eng._truth_opt_start
    if ref is None:
        eng._held_ref = eng._held_prev = held
        eng._held_opt = opt
        return 0, 0
    eng._held_opt = max(eng._held_opt, opt)
    if held > ref:
        # Held at this step's start, so at every moment of the steps to come: the figures
        # this step does not measure again (a phase only earlier steps had: a replay measured
        # before the optimizer made its state) are raised to it, as a drop lowers them
        # (measured: gradient accumulation calibrated its replays before AdamW's first step;
        # the first plan's replays held 531 KB of optimizer state beyond their figures, and
        # the first planned step went 3.3 % over the budget)
        _shift_figures(eng, held - ref)
        eng._held_ref = ref = held
    if larger:  # a larger input than any (a larger batch held): the count starts again
        eng._held_ref, eng._held_prev = min(ref, held), None
        return max(ref - held, 0), 0
    if size < eng._residual_top:
        return max(ref - held, 0), 0
    prev, eng._held_prev = eng._held_prev, held
    if held >= ref:
        return 0, 0
    # (1 % of what the step held beyond what it began with beside the model: the process's
    # other memory, counted in the real peak, would raise it past any drop; measured: with
    # 4 MB of other live tensors, a 32 KiB drop in a 0.7 MB step was never forgotten)
    least = max(_FREED_MIN, (real - held) // 100)
    drop = ref - max(held, prev if prev is not None else ref)
    if drop < least:
        if ref - held >= least:  # a first step that began with less: the next one is measured
            eng._measure_plan(gap=False)
        return ref - held, 0
    eng._held_ref = ref = ref - drop
    _shift_figures(eng, -drop)
    return max(ref - held, 0), drop


def _shift_figures(eng, delta: int) -> None:
    """Every measured figure (each phase's excess, the optimizer phase, the residual) moves by
    ``delta`` bytes: memory the process holds as steps begin came (> 0) or went (< 0)."""
    if eng._over_fwd is not None:
        eng._over_fwd += delta
    if eng._raw_fwd is not None:
        eng._raw_fwd += delta
    for figures in (eng._over_replay, eng._raw_replay, eng._over_seg_fwd, eng._raw_seg_fwd):
        for key in figures:
            figures[key] += delta
    if eng._floor:
        eng._floor = max(eng._floor + delta, 0)
    if eng._over_fwd is not None:
        eng._residual = max(min([eng._over_fwd, *eng._over_replay.values()]), 0)
    eng._residual_fixed = max(eng._residual_fixed + delta, optimizer_bytes(eng), 0)


def replan_smaller_base(eng) -> None:
    """The plan in force was made with a base that held memory freed since: made again (a
    budget the larger base could not meet may be met now; a plan that fit may be faster)."""
    with eng._because("smaller_base"):
        try:
            eng.replan()
        except _planner.InfeasibleBudget as exc:
            eng._lowest_plan_instead(exc)


def _formula_peak(eng, plan: _planner.Plan | None) -> int:
    """The segments' bytes at the plan formula's highest moment (its forward's end or a
    replay), base left out; 0 where the plan or its costs are not in hand."""
    if plan is None or eng._truth_checked:
        return 0
    costs = [c for c in eng.costs or [] if plan.choices.get(c.name) in c.options]
    if not costs or len(costs) != len(plan.choices):
        return 0
    held, replays = _planner.peak_terms(costs, {c.name: plan.choices[c.name] for c in costs})
    return max([held, *replays.values()])


def phase_residuals(
    eng,
    real: int,
    phases: Mapping[str, int],
    segments: Mapping[str, int],
    plan: _planner.Plan | None,
    released: Mapping[str, int] | None = None,
    fresh: Mapping | None = None,
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
    from one replay to the next (the formula charges them all step).

    ``fresh``: the gradients that were None as the step began (storage key -> bytes). Each
    phase is paired with the base less those of them its moment is credited (all at the
    forward's end; at a replay, those :func:`grad_credit` knows to be made later), as the
    plans are predicted (:func:`grad_credits`): what the phase held beyond is its
    temporaries, not minus the gradients that did not exist yet."""
    base = eng.base_memory
    fresh = fresh or {}
    eng._phase_credit = {"start": sum(fresh.values())}  # (what each phase was credited)
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
    at_start = base - sum(fresh.values())
    eng._phase_forward = {}
    before = 0  # what the segments whose forwards ran before held, by the formula's figures
    for label, peak in phases.items():
        name = label[len(_FORWARD) :]
        if label.startswith(_FORWARD) and name in eng._truth_forward:
            # A segment's forward: paired with what the segments before it keep and what it
            # keeps itself; the rest is its transient under its option (a replayed option's
            # forward holds, for a while, the activations it then drops)
            option = eng._truth_forward[name]
            own = forward_held(eng, name, option)
            key = (name, option)
            over = peak - (at_start + before + own)
            eng._phase_forward[key] = max(eng._phase_forward.get(key, over), over)
            before += own
            continue
        if label.startswith(_REPLAY) and label in figures:
            # The formula's figure holds the segment's preserved bytes at its replay; the
            # call gives them back as the replay ends, before the backward's temporaries
            # peak. Paired with the figure as it holds them, the residual would come out
            # that much short, and a plan that retains the segment (nothing preserved,
            # the same temporaries) would be predicted that much low. Paired without them,
            # it is the temporaries; a replayed option is then charged them on top of its
            # preserved bytes (never under).
            held = figures[label] - (released or {}).get(label, 0)
            name = label[len(_REPLAY) :]
            credit = eng._phase_credit[name] = grad_credit(eng, fresh, name) if fresh else 0
            replays[name] = peak - (base - credit + held)
        elif label != "optimizer":  # nothing to pair it with: counted in the first
            start = max(start, peak)
    return start - (at_start + figures.get("start", 0)), replays, phases.get("optimizer", 0)


def forward_held(eng, name: str, option: str) -> int:
    """What one call of segment ``name`` keeps from its forward under ``option`` by the
    engine's figures (the least of the calibration's and the cost table's: paired with the
    lesser, a forward's transient comes out no smaller than it was)."""
    from lightning_replay.core.engine.calibration import calibration_held

    rt = eng.runtimes[name]
    calls = max(getattr(rt, "window_calls", 1), 1)
    held = calibration_held(eng, rt, option)[0]
    for c in eng.costs or []:
        if c.name == name and option in c.options:
            held = min(held, c.options[option].memory)
    return held // calls


def forward_begins(eng, name: str) -> StepPeak | None:
    """Segment ``name``'s forward begins a phase of a measured step (its first call in the
    step; not a probe's or a derivative-checked step's, which hold more than the option):
    returns the meter, to mark where it ends (:func:`forward_ends`)."""
    truth = eng._truth
    if truth is None or eng._check_grad or name in eng._truth_forward:
        return None
    rt = eng.runtimes.get(name)
    if rt is None or rt.contract is None or rt.status in ("probe", "probing"):
        return None
    option = "retain" if rt.status == "retain" else rt.contract.option
    eng._truth_forward[name] = option
    truth.mark(_FORWARD + name)
    return truth


def forward_ends(eng, truth: StepPeak, name: str) -> None:
    if eng._truth is truth:
        truth.mark(_FORWARD_END + name)


#: optimizer hooks to remove outside an optimizer step: a hook removed from inside the step's
#: loop over the hooks makes the next one raise "OrderedDict mutated during iteration"
_STALE_HOOKS: list = []


def drop_stale_hooks() -> None:
    """Remove the measurement hooks whose step ended (see :data:`_STALE_HOOKS`)."""
    while _STALE_HOOKS:
        _STALE_HOOKS.pop().remove()


def start_truth(eng) -> None:
    drop_stale_hooks()
    truth = StepPeak(eng.model, optimizers=eng._optimizers)
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
    eng._truth_forward = {}
    eng._truth_fresh = fresh_grads(eng.model)  # the gradients this step has yet to make
    eng._truth_opt_start = optimizer_bytes(eng)  # (+ an optimizer first seen in its step: pre)
    eng._grad_seen, eng._grad_end_hooked = [], False
    # what the process held beyond the model's own tensors (gradients that exist now
    # included) and the batch: optimizer state and whatever anyone keeps between steps
    eng._truth_held = truth.base - live_model_bytes(eng.model) - eng._truth_inputs
    eng._truth_base = truth.base
    # Stop right after the step's optimizer step (its temporaries and state included),
    # so the profiler does not span the caller's code between steps; else when the next
    # window begins. Not from inside backward: autograd restores the thread's profiler
    # state after its callbacks.
    # The hooks are every optimizer's (global): they hold the engine and the meter weakly, so
    # an engine dropped while it measures is collected, and its meter with it (which stops
    # the profiler: StepPeak.start); a hook that finds them gone is removed at the next start.
    eng_ref, truth_ref = weakref.ref(eng), weakref.ref(truth)
    handles: list = []

    def post(opt: Any, *_: Any) -> None:
        e, t = eng_ref(), truth_ref()
        if e is None or t is None:
            _STALE_HOOKS.extend(handles)
            handles.clear()
            return
        stop_truth(e, t, opt)

    def pre(opt: Any, *_: Any) -> None:
        e, t = eng_ref(), truth_ref()
        if e is not None and t is not None and e._truth is t:
            t.mark("optimizer")  # the optimizer step is a phase of its own: no activation
            if not any(o is opt for o in e._optimizers) and _steps_model(e, opt):
                # not tracked yet: the state it held as the step began (before this step)
                e._truth_opt_start += live_model_bytes(nn.Module(), [opt])

    eng._truth_hook = register_optimizer_step_post_hook(post)
    eng._truth_pre_hook = register_optimizer_step_pre_hook(pre)
    handles += [eng._truth_hook, eng._truth_pre_hook]


def stop_truth(eng, truth: StepPeak, optimizer: Any = None) -> None:
    if eng._truth is truth:
        eng._truth = None
        # (this may run inside the optimizer step's loop over its hooks: removed later)
        if eng._truth_hook is not None:
            _STALE_HOOKS.append(eng._truth_hook)
            eng._truth_hook = None
        if eng._truth_pre_hook is not None:
            _STALE_HOOKS.append(eng._truth_pre_hook)
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
    if any(o is optimizer for o in eng._optimizers) or not _steps_model(eng, optimizer):
        return False
    eng._optimizers.append(optimizer)
    return True


def _steps_model(eng, optimizer: Any) -> bool:
    """Whether ``optimizer`` steps any of the model's parameters."""
    ours = {id(p) for p in eng.model.parameters()}
    groups = getattr(optimizer, "param_groups", ())
    return any(id(p) in ours for g in groups for p in g.get("params", ()))


def watch_optimizers(eng) -> Any:
    """Until the first plan: a hook on every optimizer's step that tracks those stepping the
    model (:func:`fold_optimizer_growth` needs them; a measured step's hook adopts only the
    optimizers that stepped inside it, and the warm-up steps of a gradient accumulation may
    hold no optimizer step). Returns the handle; the hook holds the engine weakly."""
    eng_ref = weakref.ref(eng)
    handles: list = []

    def post(opt: Any, *_: Any) -> None:
        e = eng_ref()
        if e is None or e.model is None:
            _STALE_HOOKS.extend(handles)
            handles.clear()
            return
        adopt_optimizer(e, opt)

    handles.append(register_optimizer_step_post_hook(post))
    return handles[0]


def unwatch_optimizers(eng) -> None:
    """Remove :func:`watch_optimizers`' hook (later, outside any optimizer step)."""
    if eng._opt_watch is not None:
        _STALE_HOOKS.append(eng._opt_watch)
        eng._opt_watch = None


def fold_optimizer_growth(eng) -> None:
    """Before the first plan: optimizer state made after every measured step began (AdamW's
    moments, made at its first step, where the measured warm-up steps ran before it: a
    gradient accumulation's first micro-batches) is held at every moment of the steps to
    come; every figure is raised by it, as by memory a measured step began with
    (:func:`rebase_held`)."""
    unwatch_optimizers(eng)
    if eng._held_ref is None or eng._over_fwd is None:
        return
    grow = optimizer_bytes(eng) - eng._held_opt
    if grow > 0:
        _shift_figures(eng, grow)
        eng._held_ref += grow
        eng._held_opt += grow


def optimizer_bytes(eng) -> int:
    return live_model_bytes(nn.Module(), eng._optimizers) if eng._optimizers else 0


# ----------------------------------------------------------------------------------------------
# Gradients that do not exist yet (issue 30). The base charges every parameter's gradient at
# every moment of the step; with ``zero_grad(set_to_none=True)`` none exists at the forward's
# end, and at a segment's replay only those backward has reached. A gradient is credited
# (left out of a moment's figure) only where the engine has seen it missing:
# - at the forward's end, every gradient that was None as every window so far began (one
#   that existed as any window began, with gradients kept or in an accumulation window, is
#   never credited again: the plan holds for every step);
# - at segment ``s``'s moment (its replay, or a retained segment's backward, and what backward
#   runs until it reaches the segment before ``s``), a gradient a measured step found still
#   None at the replay of a segment before ``s`` and never found made at the replay of a
#   segment at or before that one (its grad is made later in backward: it belongs to earlier
#   segments, or to code before them, as an untied embedding). A head's gradients come first
#   in backward: found made at every replay, they are charged at every segment's moment; a
#   parameter shared between segments is charged from the first backward that reaches it.
# The measured phases are paired with the same figures, so what they held beyond them is the
# step's temporaries alone, and the residual is no longer clamped at 0 for the gradients.


def fresh_grads(model: nn.Module) -> dict:
    """Storage key -> gradient bytes of the trainable parameters whose gradients are all None
    now (each parameter's own bytes, at most its storage's: what the base charges for it).
    Sharded (FSDP2) parameters are left out: their gradients are accounted by their strategy."""
    seen: dict = {}
    for p in model.parameters():
        if not p.requires_grad or hasattr(p, "_local_tensor"):
            continue
        key = storage_key(p)
        if key is None:
            continue
        none, nbytes = seen.get(key, (True, 0))
        seen[key] = (
            none and p.grad is None,
            min(nbytes + p.numel() * p.element_size(), p.untyped_storage().nbytes()),
        )
    return {k: b for k, (none, b) in seen.items() if none}


def observe_fresh_grads(eng) -> dict:
    """As a window begins: the gradients None now (returned), and those None as every window
    so far began (the credit only shrinks)."""
    if eng._grad_fresh is not None and not eng._grad_fresh:
        return {}  # a gradient existed as every one began: nothing is credited again
    now = fresh_grads(eng.model)
    if eng._grad_fresh is None:
        eng._grad_fresh = dict(now)
    else:
        eng._grad_fresh = {k: b for k, b in eng._grad_fresh.items() if k in now}
    return now


def observe_grads(eng, segment: str | None) -> None:
    """On a measured step: which of the step's missing gradients are still None at the
    replay of ``segment`` (None: as the backward ends)."""
    if eng._truth is None or not eng._truth_fresh:
        return
    keys = set(eng._truth_fresh)
    still = set(fresh_grads(eng.model)) & keys
    eng._grad_seen.append((segment, still))
    if segment is not None and not eng._grad_end_hooked:
        eng._grad_end_hooked = True
        at_backward_end(lambda: observe_grads(eng, None))


def learn_grad_order(eng) -> None:
    """Fold the measured step's observations into where each gradient is made: for a gradient
    the step made, the least segment position whose replay found it None, and the greatest
    whose replay found it made."""
    seen, eng._grad_seen = eng._grad_seen, []
    eng._grad_end_hooked = False
    if not seen:
        return
    ends = [still for seg, still in seen if seg is None]
    made = set(eng._truth_fresh) - (ends[-1] if ends else seen[-1][1])
    order = {name: i for i, name in enumerate(eng.segments)}
    for seg, still in seen:
        if seg is None or seg not in order:
            continue
        pos = order[seg]
        for key in made:
            if key in still:
                eng._grad_none_at[key] = min(eng._grad_none_at.get(key, pos), pos)
            else:
                eng._grad_made_at[key] = max(eng._grad_made_at.get(key, pos), pos)


def grad_credit(eng, fresh: Mapping, segment: str) -> int:
    """Bytes of ``fresh``'s gradients known not to exist yet at ``segment``'s moment (see
    above): found None at the replay of a segment before it, never found made at or before."""
    order = {name: i for i, name in enumerate(eng.segments)}
    pos = order.get(segment)
    if pos is None:
        return 0
    credit = 0
    for key, nbytes in fresh.items():
        none_at = eng._grad_none_at.get(key)
        if none_at is not None and none_at < pos and none_at > eng._grad_made_at.get(key, -1):
            credit += nbytes
    return credit


def grad_credits(eng) -> tuple[int, dict[str, int]]:
    """The plans' credit: (bytes left out of the base: every gradient missing as every window
    began, once a measured step's phases were paired with it; per segment, the bytes of them
    its moment holds, given back to it). (0, {}) with gradients kept."""
    fresh = eng._grad_fresh
    if not fresh or eng._over_fwd is None or eng.size_scale(eng._residual_size) > 1.0:
        # (at inputs larger than measured, the residual is scaled with them: the measured
        # figures as if every gradient were charged all step are, and nothing is credited)
        return 0, {}
    total = sum(fresh.values())
    return total, {n: total - grad_credit(eng, fresh, n) for n in eng.segments}
