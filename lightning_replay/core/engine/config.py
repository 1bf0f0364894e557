"""One validated configuration for a replay run: :class:`ReplayConfig`.

``install()``, :class:`~lightning_replay.strategies.ReplayStrategy` and
:class:`~lightning_replay.strategies.ReplayFSDPStrategy` each build one from their arguments;
every check of a replay argument lives here, so the three accept exactly the same values and
word their errors the same way (the error names the call, the argument and the value, and says
what to use). The engine keeps the configuration it was installed with as ``engine.config``.

What needs the model is checked at install: segment names (and the pins naming them) resolve
against its submodules, and a budget written as a fraction resolves against its device.

Example:
    >>> cfg = ReplayConfig(segments="blocks.*", budget="2GiB", preservation={"blocks.0": "retain"})
    >>> cfg.budget, cfg.pins(["blocks.0", "blocks.1"])
    (Budget('2.00 GiB'), {'blocks.0': 'retain'})
    >>> ReplayConfig(planner="greedy", caller="install")
    Traceback (most recent call last):
    ...
    lightning_replay.errors.ReplayConfigError: install(planner='greedy') is not known; use one of ['joint', 'eager_whole', 'fixed_regions', 'retain_all', 'whole_all', 'selective_all']
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.base.budget import Budget
from lightning_replay.errors import ReplayConfigError
from lightning_replay.core.base.records import RecordStore
from lightning_replay.core.mechanisms.selective import POLICIES

#: What ``preservation=`` accepts, for all segments or per segment.
PRESERVATIONS = ("auto", "whole", "regions", "retain", "selective")
#: The options a per-segment preservation pin leaves the planner (``auto``: all of them).
PIN_OPTIONS = {
    "retain": frozenset({"retain"}),
    "whole": frozenset({"whole", "recompute"}),
    "regions": frozenset({"regions", "recompute"}),
    "selective": frozenset({"selective", "selective_whole", "selective_regions"}),
}
#: What ``on_violation=`` accepts.
ON_VIOLATION = ("raise", "record")
#: What ``window=`` accepts.
WINDOWS = ("root", "manual")
#: What can trigger a re-plan (:class:`ReplanSettings`).
REPLAN_ON = ("memory", "violations", "shapes", "times")
#: What :class:`~lightning_replay.callbacks.ReplayCallback` re-plans on by default (``"times"``
#: is asked for by name).
DEFAULT_REPLAN_ON = ("memory", "violations", "shapes")


def check_count(
    caller: str, name: str, value: Any, *, minimum: int = 1, none: str | None = None
) -> int | None:
    """``value`` as an int ``>= minimum`` (not a bool), or ``None`` where ``none`` says what
    ``None`` means; else a :class:`ReplayConfigError` naming ``caller(name=value)``.

    The one check of a count or size argument in the package.

    Example:
        >>> check_count("install", "calibration_steps", 2)
        2
        >>> check_count("ReplayCallback", "check_every_n_steps", 0, none="no checks")
        Traceback (most recent call last):
        ...
        lightning_replay.errors.ReplayConfigError: ReplayCallback(check_every_n_steps=0) must be a positive int or None (no checks)
    """
    if value is None and none is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if none is not None and minimum == 1 else f"an int >= {minimum}"
        raise ReplayConfigError(
            f"{caller}({name}={value!r}) must be {what}"
            + (f" or None ({none})" if none is not None else "")
        )
    return value


def check_choices(
    caller: str,
    name: str,
    value: Any,
    allowed: tuple[str, ...],
    *,
    allow_empty: bool,
    empty_hint: str = "",
) -> tuple[str, ...]:
    """``value`` (one string or a sequence of them) as a tuple of distinct entries of
    ``allowed``; else a :class:`ReplayConfigError` naming ``caller(name=...)``."""
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise ReplayConfigError(
            f"{caller}({name}={value!r}) must be a sequence of {list(allowed)}"
        ) from None
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise ReplayConfigError(
            f"{caller}({name}=...) has unknown entries {unknown}; allowed: {list(allowed)}"
        )
    if not items and not allow_empty:
        raise ReplayConfigError(
            f"{caller}({name}=()) is empty; pass at least one of {list(allowed)}{empty_hint}"
        )
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class ReplanSettings:
    """When a run re-plans by itself (the policy is :class:`~lightning_replay.replan.ReplanPolicy`).

    Attributes:
        replan_on: what re-plans: ``"memory"`` (the measured peak above the budget, or off the
            plan's prediction by more than ``memory_headroom`` of the budget), ``"violations"``
            (a rejection or a check's divergence: once the segment's new contract is in force),
            ``"shapes"`` (input shapes changed and stayed changed), ``"times"`` (the time the
            plan adds per step, by the replays timed since it was made, moved from what it was
            planned with by more than ``time_drift``: calibration times each option on a few
            steps only). Empty: never.
        replan_cooldown_steps: steps between two re-plans for ``"memory"`` or ``"shapes"``.
        memory_headroom: the fraction of the budget the peak may miss the prediction by.
        shape_patience: steps new input shapes must persist before ``"shapes"`` re-plans.
        time_drift: for ``"times"``, the fraction of the larger of the two figures by which
            the plan's added time may move before it re-plans.
        time_patience: for ``"times"``, the steps a plan runs before its times are judged,
            once per plan (each replay timed adds to its option's median; the medians keep
            the last 16 figures).
        caller: the call the arguments were given to, for error messages only.

    Example:
        >>> ReplanSettings(replan_on=("violations", "memory")).replan_on
        ('violations', 'memory')
    """

    replan_on: tuple[str, ...] = ()
    replan_cooldown_steps: int = 10
    memory_headroom: float = 0.25
    shape_patience: int = 2
    time_drift: float = 0.25
    time_patience: int = 8
    caller: str = field(default="ReplanSettings", compare=False, repr=False)

    def __post_init__(self) -> None:
        call = self.caller
        object.__setattr__(
            self,
            "replan_on",
            check_choices(call, "replan_on", self.replan_on, REPLAN_ON, allow_empty=True),
        )
        headroom = self.memory_headroom
        if (
            isinstance(headroom, bool)
            or not isinstance(headroom, (int, float))
            or not 0 < headroom < 1
        ):
            raise ReplayConfigError(
                f"{call}(memory_headroom={headroom!r}) must be a fraction strictly between 0 and 1"
            )
        object.__setattr__(self, "memory_headroom", float(headroom))
        drift = self.time_drift
        if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not 0 < drift < 1:
            raise ReplayConfigError(
                f"{call}(time_drift={drift!r}) must be a fraction strictly between 0 and 1"
            )
        object.__setattr__(self, "time_drift", float(drift))
        check_count(call, "replan_cooldown_steps", self.replan_cooldown_steps)
        check_count(call, "shape_patience", self.shape_patience)
        check_count(call, "time_patience", self.time_patience)


@dataclass(frozen=True)
class ReplayConfig:
    """Every replay argument of a run, validated once at construction.

    Attributes:
        segments: what to replay (names, globs, classes, a predicate or a list of these; see
            :func:`~lightning_replay.segments.resolve_segments`). ``None`` only under a
            strategy, which finds the segments itself.
        preservation: ``"auto"``, ``"whole"``, ``"regions"``, ``"retain"``, or a dict from
            segment name to one of these (a pin: that segment is planned only with the options
            :data:`PIN_OPTIONS` gives it).
        on_violation: ``"raise"`` or ``"record"``.
        records: ``None`` (in memory), a SQLite path, or a :class:`RecordStore`.
        window: ``"root"`` (each forward of the model opens a window) or ``"manual"``.
        budget: a :class:`~lightning_replay.budget.Budget` (anything :meth:`Budget.parse`
            takes is converted): bytes, a fraction of the device, ``"min"``, or none.
        planner: a method of :data:`lightning_replay.planner.METHODS`.
        track_memory: count saved-tensor and snapshot bytes every step.
        base_memory: bytes outside the engine's view, added to the base.
        reserve_memory: bytes every plan keeps free on top of its measured figures, for
            transients a measured step may not show (a collective that frees its buffers at a
            moment that varies from step to step: ``replay_fsdp`` sets it). Unlike
            ``base_memory`` it is never compared with a measured step: what a step held beyond
            the accountant does not absorb it.
        calibration_steps: steps per option measured before the first plan.
        real_peak: plan for the process's measured real peak (see ``install``).
        measure_costs: time each option every step: ``None`` while a budget is set (not after
            a resume that loaded a plan); ``True`` always (the strategies: after a resume the
            loaded plan's options keep being timed, so a later re-plan has costs).
        replan: when the engine re-plans by itself (a :class:`ReplanSettings`; off by
            default: ``ReplayCallback`` re-plans for the strategies).
        selective: a policy of :data:`lightning_replay.selective.POLICIES` (``"matmul"``,
            ``"every_other_matmul"``, ``"flops"``): the planner may also replay segments
            selectively (keeping the outputs of the ops the policy names). ``None``: it may
            not, unless a segment's preservation is ``"selective"`` (then under ``"matmul"``).
        caller: the call the arguments were given to, for error messages only (``"install"``,
            ``"ReplayStrategy"``); not part of the value.
    """

    segments: Any = None
    preservation: str | Mapping[str, str] = "auto"
    on_violation: str = "raise"
    records: RecordStore | str | os.PathLike | None = None
    window: str = "root"
    budget: Budget = Budget()
    planner: str = "joint"
    track_memory: bool = False
    base_memory: int = 0
    reserve_memory: int = 0
    calibration_steps: int = 2
    real_peak: bool = True
    measure_costs: bool | None = None
    replan: ReplanSettings = ReplanSettings()
    selective: str | None = None
    caller: str = field(default="ReplayConfig", compare=False, repr=False)

    def __post_init__(self) -> None:
        call = self.caller

        def bad(name: str, value: Any, why: str) -> ReplayConfigError:
            return ReplayConfigError(f"{call}({name}={value!r}) {why}")

        pres = self.preservation
        if isinstance(pres, str):
            if pres not in PRESERVATIONS:
                raise bad(
                    "preservation",
                    pres,
                    f"is not known; use one of {list(PRESERVATIONS)} or a dict per segment",
                )
        elif isinstance(pres, Mapping):
            for k, v in pres.items():
                if not isinstance(k, str) or v not in PRESERVATIONS:
                    raise ReplayConfigError(
                        f"{call}(preservation={{{k!r}: {v!r}}}) is not known; a pin maps a "
                        f"segment name to one of {list(PRESERVATIONS)}"
                    )
            # a copy: the caller's dict changing later does not change this value
            object.__setattr__(self, "preservation", dict(pres))
        else:
            raise ReplayConfigError(
                f"{call}(preservation=...) must be a string or a dict, got "
                f"{type(pres).__name__} {pres!r}"
            )
        if self.on_violation not in ON_VIOLATION:
            raise bad(
                "on_violation", self.on_violation, f"is not known; use one of {list(ON_VIOLATION)}"
            )
        if not (
            self.records is None
            or isinstance(self.records, (str, bytes, RecordStore))
            or hasattr(self.records, "__fspath__")
        ):
            raise ReplayConfigError(
                f"{call}(records=...) must be None, a path or a "
                f"RecordStore, got {type(self.records).__name__}"
            )
        if self.window not in WINDOWS:
            raise bad("window", self.window, f"is not known; use one of {list(WINDOWS)}")
        try:
            object.__setattr__(self, "budget", Budget.parse(self.budget))
        except (TypeError, ValueError) as exc:
            raise ReplayConfigError(f"{call}(budget={self.budget!r}): {exc}") from None
        if self.planner not in _planner.METHODS:
            raise bad("planner", self.planner, f"is not known; use one of {list(_planner.METHODS)}")
        for name in ("track_memory", "real_peak"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "must be a bool")
        if self.measure_costs not in (None, True, False):
            raise bad("measure_costs", self.measure_costs, "must be None or a bool")
        check_count(call, "base_memory", self.base_memory, minimum=0)
        check_count(call, "reserve_memory", self.reserve_memory, minimum=0)
        check_count(call, "calibration_steps", self.calibration_steps)
        if self.selective is not None and self.selective not in POLICIES:
            raise bad("selective", self.selective, f"is not known; use one of {list(POLICIES)}")
        if not isinstance(self.replan, ReplanSettings):
            raise ReplayConfigError(
                f"{call}(replan=...) must be a ReplanSettings, got {type(self.replan).__name__}"
            )

    def replace(self, **changes: Any) -> "ReplayConfig":
        """A copy with ``changes``, validated like a new one."""
        return dataclasses.replace(self, **changes)

    def pins(self, segments: Iterable[str]) -> dict[str, str]:
        """The preservation of each installed segment that is not ``"auto"``.

        Raises:
            ReplayConfigError: ``preservation`` names a segment that is not among ``segments``.
        """
        names = list(segments)
        if isinstance(self.preservation, str):
            return {n: self.preservation for n in names} if self.preservation != "auto" else {}
        unknown = [k for k in self.preservation if k not in names]
        if unknown:
            raise ReplayConfigError(
                f"{self.caller}(preservation=...) names segment {unknown[0]!r}, which is not "
                f"among the installed segments {names}"
            )
        return {k: v for k, v in self.preservation.items() if v != "auto"}

    @property
    def selective_policy(self) -> str | None:
        """The policy selective replays run under: ``selective``, else ``"matmul"`` when some
        segment's preservation is ``"selective"``, else ``None`` (no selective options)."""
        if self.selective is not None:
            return self.selective
        pres = self.preservation
        values = [pres] if isinstance(pres, str) else list(pres.values())
        return "matmul" if "selective" in values else None

    def preservation_of(self, segment: str) -> str:
        """The preservation asked for ``segment`` (``"auto"`` unless pinned)."""
        if isinstance(self.preservation, str):
            return self.preservation
        return self.preservation.get(segment, "auto")

    def make_records(self, rank: int = 0) -> RecordStore:
        """The record store ``records`` names (a new in-memory one for ``None``)."""
        if isinstance(self.records, RecordStore):
            return self.records
        return RecordStore(self.records, rank=rank)
