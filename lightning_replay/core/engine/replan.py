"""When to re-plan: :class:`ReplanPolicy`.

A plan is made once from the costs measured during calibration. Three things can make it
stale, and each is a reason to plan again (:data:`~lightning_replay.config.REPLAN_ON`):

* ``"violations"``: a guard rejected a replay or a check found one diverging; the segment is
  probed again and its contract grows, so its costs change. The re-plan waits until no
  segment is being probed.
* ``"memory"``: the step's measured peak is above the budget, or off the plan's prediction by
  more than ``memory_headroom`` of the budget. A derivative-checked step keeps graphs the plan
  replays, so its peak is not the plan's and is not judged. A re-plan that gives the same
  choices for memory alone settles the question until something else changes the plan.
* ``"shapes"``: the input shapes changed and stayed changed for ``shape_patience`` steps.
* ``"times"``: the plan was made from calibration's few timings of each option; once it has
  run ``time_patience`` steps (each replay timed adds to its option's median), the time its
  choices add per step, by the medians now, is off what it was planned with by more than
  ``time_drift``. Judged once per plan: a plan made again from steady figures is judged by
  its own steps.

``"memory"`` and ``"shapes"`` wait ``replan_cooldown_steps`` after the last re-plan. The
policy only decides; its owner measures and re-plans: the engine itself for ``install(...,
replan_on=...)``, :class:`~lightning_replay.callbacks.ReplayCallback` under a strategy (where
every rank must agree first). It never imports Lightning.

Example:
    >>> import torch, lightning_replay as lr
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> engine = lr.install(model, ["0", "2"], budget="min", replan_on=("violations",))
    >>> engine.replan_policy.settings.replan_on
    ('violations',)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import torch

from lightning_replay._compat import tree_leaves
from lightning_replay.core.engine.config import REPLAN_ON, ReplanSettings
from lightning_replay.core.engine.planner import CostTable, InfeasibleBudget, Plan


class ReplanOutcome(NamedTuple):
    """What :meth:`ReplanPolicy.replan` did."""

    plan: Plan | None
    """The plan in force afterwards (``None`` if there is none yet)."""
    changed: bool
    """The re-plan changed the choices."""
    error: InfeasibleBudget | None
    """Why no plan was made (the plan in force was kept), or ``None``."""


def input_shapes(inputs: Any) -> tuple:
    """The shape and dtype of every tensor in ``inputs`` (any nesting of containers): what
    ``"shapes"`` compares from step to step."""
    return tuple(
        (tuple(t.shape), str(t.dtype)) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)
    )


def costs_ready(engine: Any) -> bool:
    """Every segment that can be replayed has a measured replay option to plan with."""
    costs = engine.costs
    if not costs:
        return False
    contracts = engine.contracts
    for c in costs:
        contract = contracts.get(c.name)
        replayable = contract is not None and any(
            o != "retain" for o in contract.available_options()
        )
        if replayable and not any(o != "retain" for o in c.options):
            return False
    return True


def choices_time(costs: Any, choices: dict) -> float | None:
    """The seconds per step ``choices`` add by the cost table ``costs``, as the planner sums
    them (:attr:`Plan.extra_time`: each chosen option's time, the capture mode's once if any
    option needs it); ``None`` where a chosen option is not in the table.

    Example:
        >>> from lightning_replay.planner import Option, SegmentCost
        >>> costs = [SegmentCost("a", 10, {"retain": Option(10, 0.0),
        ...                               "recompute": Option(0, 0.5)})]
        >>> choices_time(costs, {"a": "recompute"}), choices_time(costs, {"a": "whole"})
        (0.5, None)
    """
    total, capture = 0.0, False
    for c in costs:
        o = choices.get(c.name)
        if o is None:
            continue
        opt = c.options.get(o)
        if opt is None:
            return None
        total += opt.time
        capture = capture or opt.capture
    if capture and isinstance(costs, CostTable):
        total += costs.capture_time
    return total


def settled(engine: Any) -> bool:
    """A plan is in force and no segment is being probed."""
    return engine.plan is not None and not any(
        s["status"] in ("probe", "probing") for s in engine.summary().values()
    )


class StateGrowth:
    """State that grows between the engine's real-peak measurements (a queue rebuilt larger
    with ``torch.cat`` every step) grows what reads it too: the activations of the segments
    it goes into, the temporaries that build it. The base charges the state's own bytes once;
    the real peak grew by many times that (14 x for an attention over the queue).

    From two measured steps of one plan (its choices) whose state differed, the peak's growth
    per byte of state (at least 1, the most seen: a bound, not a fit); between measurements
    the plan is charged the last measured peak plus that rate times the state's growth since.

    Example:
        >>> g = StateGrowth()
        >>> g.measured({"a": "recompute"}, state=100, peak=1_000)
        >>> g.measured({"a": "recompute"}, state=150, peak=1_500)  # 10 bytes of peak per byte
        >>> g.bound({"a": "recompute"}, state=200)
        2000
        >>> g.bound({"a": "retain"}, state=200) is None  # never measured under that plan
        True
    """

    def __init__(self) -> None:
        self._last: dict = {}  # plan choices -> (state bytes, real peak) of its last measurement
        self._rate: dict = {}  # plan choices -> peak bytes per state byte

    def measured(self, choices: dict, state: int, peak: int) -> None:
        """A step of the plan ``choices`` was measured: ``state`` bytes at its start (the
        model's: :func:`~lightning_replay.memory.live_model_bytes`), ``peak`` its real peak."""
        key = tuple(sorted(choices.items()))
        last = self._last.get(key)
        if last is not None and state > last[0]:
            rate = (peak - last[1]) / (state - last[0])
            self._rate[key] = max(self._rate.get(key, 1.0), rate)
        self._last[key] = (state, peak)

    def bound(self, choices: dict, state: int) -> int | None:
        """The real peak of a step of ``choices`` that begins with ``state`` bytes, where the
        state grew since that plan's last measurement; else None."""
        key = tuple(sorted(choices.items()))
        last = self._last.get(key)
        if last is None or state <= last[0]:
            return None
        return last[1] + int(self._rate.get(key, 1.0) * (state - last[0]))

    def grew(self, choices: dict, state: int) -> bool:
        """The state grew since the plan's last measurement (measure again soon)."""
        last = self._last.get(tuple(sorted(choices.items())))
        return last is not None and state > last[0]


class ReplanPolicy:
    """Decides, step by step, whether a run should plan again, and why.

    Call :meth:`observe_shapes` as a step begins, :meth:`reasons` once it has trained, and
    :meth:`replan` with the reasons (or after agreeing on them across ranks).

    Args:
        settings: what triggers a re-plan, the cooldown, the memory headroom and the shape
            patience.
    """

    def __init__(self, settings: ReplanSettings = ReplanSettings()) -> None:
        self.settings = settings
        #: Successful re-plans so far.
        self.replans = 0
        self._batch_shapes: Any = None
        self._plan_shapes: Any = None
        self._shape_streak = 0
        #: The engine step of the last successful re-plan (far in the past before one).
        self.last_replan_step = -(10**9)
        self._memory_settled = False
        self._violation_pending = False
        self._events = 0
        self._times_since: tuple[int, int] | None = None  # (plan version, its first step)
        self._times_judged = -1  # the plan version whose times were judged last

    @property
    def enabled(self) -> bool:
        return bool(self.settings.replan_on)

    def observe_shapes(self, shapes: Any) -> bool:
        """Note the input shapes of the step that begins. Returns ``True`` on the step a
        ``"shapes"`` re-plan will follow: its owner should derivative-check that step, which
        measures the activation bytes at the new shapes (the probe's are for the old ones)."""
        s = self.settings
        self._shape_streak = self._shape_streak + 1 if shapes == self._batch_shapes else 1
        self._batch_shapes = shapes
        return (
            "shapes" in s.replan_on
            and self._plan_shapes is not None
            and shapes != self._plan_shapes
            and self._shape_streak == s.shape_patience
        )

    def reasons(
        self, engine: Any, *, violations: bool, peak: int | None, checked: bool
    ) -> list[str]:
        """The reasons to re-plan after the step just trained, in :data:`REPLAN_ON` order.

        Args:
            engine: the :class:`~lightning_replay.engine.ReplayEngine`.
            violations: the step recorded a rejection or a divergence.
            peak: the step's measured peak in bytes (the CUDA allocator's, or the accounted
                peak on CPU); ``None`` or 0 when not measured.
            checked: the step was derivative-checked (its peak is not the plan's).
        """
        s = self.settings
        out: set[str] = set()
        if "violations" in s.replan_on and violations:
            # The segment is probed again (a rejection, or the engine's reaction to a
            # divergence): plan once its new contract is in force.
            self._violation_pending = True
        if engine.plan is None or not costs_ready(engine) or not settled(engine):
            return []
        if self._violation_pending:
            out.add("violations")
        cooled = engine.step - self.last_replan_step >= s.replan_cooldown_steps
        budget = engine.budget
        if (
            "memory" in s.replan_on
            and budget
            and cooled
            and peak
            and not self._memory_settled
            and not checked
        ):
            # the step's peak in the budget's terms: the CUDA allocator's is real; the
            # accountant's (CPU) plus what a measured step held beyond it (0 without
            # real_peak), the residual the plan's own prediction holds in its base; no less than
            # the prediction, which charges what measured phases held beyond it at their own
            # moments (a plan predicted over the budget no longer fits it)
            predicted = engine.plan.peak_memory
            real = (
                peak
                if engine.peak_is_allocator
                else max(peak + engine.unaccounted_bytes, predicted)
            )
            if real > budget or abs(real - predicted) > s.memory_headroom * budget:
                out.add("memory")
        if (
            "shapes" in s.replan_on
            and cooled
            and self._plan_shapes is not None
            and self._batch_shapes != self._plan_shapes
            and self._shape_streak >= s.shape_patience
        ):
            out.add("shapes")
        if "times" in s.replan_on and not checked and self._times_drifted(engine):
            out.add("times")
        if self._plan_shapes is None:
            self._plan_shapes = self._batch_shapes
        return [r for r in REPLAN_ON if r in out]

    def _times_drifted(self, engine: Any) -> bool:
        """The plan in force has run ``time_patience`` steps and its choices' time by the
        medians now is off its planned :attr:`Plan.extra_time` by more than ``time_drift`` of
        the larger (judged once per plan version)."""
        s, version = self.settings, engine.plan_version
        if self._times_since is None or self._times_since[0] != version:
            self._times_since = (version, engine.step)
            return False
        if self._times_judged == version or engine.step - self._times_since[1] < s.time_patience:
            return False
        self._times_judged = version
        plan = engine.plan
        now = choices_time(engine.costs or [], plan.choices)
        if now is None:
            return False
        then = plan.extra_time
        return abs(now - then) > s.time_drift * max(now, then)

    def replan(
        self, engine: Any, reasons: list[str], replan: Callable[[], Plan | None] | None = None
    ) -> ReplanOutcome:
        """Plan again for ``reasons`` with ``replan`` (default ``engine.replan``; a strategy
        passes its own, which agrees on rank 0's plan). An :class:`InfeasibleBudget` is
        recorded (a failed ``plan`` record naming the reasons) and the plan in force kept; the
        cooldown counts from a failed try as from a re-plan."""
        before = dict(engine.plan.choices) if engine.plan is not None else None
        try:
            with engine._because(*reasons):  # (the plan record names them)
                plan = (replan or engine.replan)()
        except InfeasibleBudget as exc:
            engine.records.record_plan(
                step=engine.step,
                plan_version=engine.plan_version,
                detail={"reasons": list(reasons), "error": str(exc)},
                failed=True,
            )
            # a try all the same: the cooldown counts from it, and the same shapes or the same
            # violation do not ask again (a failed try on every step, each recorded and warned)
            self._memory_settled = True
            self._violation_pending = False
            self.last_replan_step = engine.step
            self._plan_shapes = self._batch_shapes
            return ReplanOutcome(engine.plan, False, exc)
        self.replans += 1
        self._violation_pending = False
        self.last_replan_step = engine.step
        self._plan_shapes = self._batch_shapes
        changed = plan is not None and before != plan.choices
        # Costs that give the same plan again will keep giving it: stop asking until
        # something else changes the plan.
        self._memory_settled = plan is not None and not changed and list(reasons) == ["memory"]
        return ReplanOutcome(plan, changed, None)

    def after_step(self, engine: Any) -> ReplanOutcome | None:
        """For an engine that runs the policy itself, as its next window begins: judge the
        step just trained by its window's figures (:meth:`ReplayEngine.window_stats`) and the
        segments' violation and divergence counts, and re-plan for the reasons (``None``:
        none). A failed re-plan warns and keeps the plan in force."""
        events = sum(s["violations"] + s["divergences"] for s in engine.summary().values())
        violations, self._events = events > self._events, events
        stats = engine.window_stats()
        reasons = self.reasons(
            engine, violations=violations, peak=stats["peak_bytes"], checked=bool(stats["checked"])
        )
        if not reasons:
            return None
        out = self.replan(engine, reasons)
        if out.error is not None:
            warnings.warn(
                f"re-plan ({', '.join(reasons)}) after step {engine.step} failed, "
                f"keeping plan v{engine.plan_version}: {out.error}",
                RuntimeWarning,
                stacklevel=4,
            )
        return out
