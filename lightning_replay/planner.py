"""The plan: one preservation option per segment, chosen under a memory budget.

Each segment has measured options (see the design notes, "Cost model"): ``retain`` keeps its
activations; ``recompute``, ``whole`` and ``regions`` drop them and replay the segment in
backward, holding only checkpoint inputs plus whatever snapshots the option needs. For the
options ``o_s`` chosen per segment ``s`` (in forward order) the predicted peak is::

    peak = base + max( sum_s memory(s, o_s),
                       max over replayed s of ( sum_{j<=s} memory(j, o_j) + activation_bytes(s) ) )

because backward runs from the last segment to the first and, when ``s`` replays, the
segments after it are already freed. :func:`plan` minimizes the extra time
``sum_s time(s, o_s)`` subject to ``peak <= budget``.

Some costs are paid once per step, not per segment: the capture mode that logs writes (for
``regions`` and for the guards of replayed segments' unchanged buffers) runs over the whole
forward as soon as one segment needs it. Options that need it say so (``Option.capture``), a
:class:`CostTable` carries the mode's per-step time, and a plan's extra time adds it once when
any chosen option needs it.

``method="joint"`` is exact. The other methods are the baselines it is compared with.

Example:
    >>> costs = [
    ...     SegmentCost("b0", activation_bytes=100, options={
    ...         "retain": Option(memory=100, time=0.0),
    ...         "whole": Option(memory=30, time=2.0),
    ...         "regions": Option(memory=15, time=3.0)}),
    ...     SegmentCost("b1", activation_bytes=100, options={
    ...         "retain": Option(memory=100, time=0.0),
    ...         "recompute": Option(memory=10, time=1.0)}),
    ... ]
    >>> p = plan(costs, budget=170, base_memory=50)
    >>> p.choices
    {'b0': 'regions', 'b1': 'retain'}
    >>> p.peak_memory, p.extra_time
    (165, 3.0)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_replay.budget import format_bytes
from lightning_replay.errors import ReplayError

__all__ = [
    "OPTION_NAMES",
    "METHODS",
    "PLANNER_SCHEMA_VERSION",
    "Option",
    "SegmentCost",
    "CostTable",
    "Plan",
    "InfeasibleBudget",
    "predicted_peak",
    "peak_terms",
    "plan",
    "min_feasible_budget",
    "costs_to_dict",
    "costs_from_dict",
]

#: Preservation options a segment may have. Iteration order everywhere in the planner is this
#: order, so results never depend on the order a caller happened to build its dicts in.
OPTION_NAMES: tuple[str, ...] = (
    "retain",
    "recompute",
    "whole",
    "regions",
    "selective",
    "selective_whole",
    "selective_regions",
)

#: Planning methods :func:`plan` accepts. ``joint`` is exact; the others are baselines.
METHODS: tuple[str, ...] = (
    "joint",
    "eager_whole",
    "fixed_regions",
    "retain_all",
    "whole_all",
    "selective_all",
)

#: Version of the JSON layout written by :func:`costs_to_dict` and :meth:`Plan.to_dict`.
PLANNER_SCHEMA_VERSION = 1

# Byte counts live in int64 arrays inside the joint solver; keep well clear of overflow.
_MAX_BYTES = 2**62

# Width of the cheap first pass that finds a good feasible plan; its time bounds the exact pass.
_BEAM_WIDTH = 64


def _check_int_bytes(what: str, value: object) -> int:
    # bool is an int subclass; a True memory is a bug, not 1 byte.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{what} must be an int number of bytes, got {value!r} ({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(f"{what} must be >= 0 bytes, got {value!r}")
    return int(value)


def _check_seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{what} must be a number of seconds, got {value!r} ({type(value).__name__})"
        )
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


@dataclass(frozen=True)
class Option:
    """The measured cost of one preservation option for one segment.

    Args:
        memory: Bytes held from the segment's forward until its backward: the activations for
            ``retain``; checkpoint inputs plus snapshots for the replayed options.
        time: Extra seconds per step: 0 for ``retain``; recompute plus capture and restore for
            the replayed options. Not the capture mode's own time, which :class:`CostTable`
            carries once for the step.
        capture: Taking this option turns on the capture mode for the whole forward (its time,
            :attr:`CostTable.capture_time`, is paid once however many segments need it).
        replay: Bytes this option's replay re-materializes, where they differ from the
            segment's ``activation_bytes`` (``None``): a selective replay re-materializes only
            what it recomputes, the outputs it kept being in ``memory`` already.

    Raises:
        TypeError: If ``memory`` is not an int, ``time`` is not a real number or ``capture``
            is not a bool.
        ValueError: If either number is negative, or ``time`` is NaN or infinite.

    Example:
        >>> Option(memory=2**20, time=0.004)
        Option(memory=1048576, time=0.004)
        >>> Option(memory=512, time=0.002, capture=True)
        Option(memory=512, time=0.002, capture=True)
        >>> Option(memory=700, time=0.001, replay=300)
        Option(memory=700, time=0.001, replay=300)
    """

    memory: int
    time: float
    capture: bool = False
    replay: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", _check_int_bytes("Option.memory", self.memory))
        object.__setattr__(self, "time", _check_seconds("Option.time", self.time))
        if not isinstance(self.capture, bool):
            raise TypeError(f"Option.capture must be a bool, got {self.capture!r}")
        if self.replay is not None:
            object.__setattr__(self, "replay", _check_int_bytes("Option.replay", self.replay))

    def __repr__(self) -> str:
        shared = ", capture=True" if self.capture else ""
        replay = f", replay={self.replay}" if self.replay is not None else ""
        return f"Option(memory={self.memory}, time={self.time}{shared}{replay})"


@dataclass(frozen=True)
class SegmentCost:
    """The options one segment can be planned with, and what its replay re-materializes.

    Args:
        name: The segment's name, unique within a cost table.
        activation_bytes: Bytes of activations a replay of this segment re-materializes
            (``A(s)`` in the cost model).
        options: A non-empty mapping from option names in :data:`OPTION_NAMES` to
            :class:`Option`. Stored as a plain ``dict`` in :data:`OPTION_NAMES` order.

    Raises:
        TypeError: On a wrongly typed field.
        ValueError: On an empty name, negative ``activation_bytes``, no options, or an
            unknown option name; the message names the segment.

    Example:
        >>> seg = SegmentCost("block3", activation_bytes=4096, options={
        ...     "whole": Option(memory=512, time=0.01), "retain": Option(memory=4096, time=0.0)})
        >>> list(seg.options)
        ['retain', 'whole']
    """

    name: str
    activation_bytes: int
    options: Mapping[str, Option]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SegmentCost.name must be a non-empty str, got {self.name!r}")
        object.__setattr__(
            self,
            "activation_bytes",
            _check_int_bytes(f"segment {self.name!r}: activation_bytes", self.activation_bytes),
        )
        if not isinstance(self.options, Mapping):
            raise TypeError(
                f"segment {self.name!r}: options must be a mapping of option name to Option, "
                f"got {type(self.options).__name__}"
            )
        if not self.options:
            raise ValueError(
                f"segment {self.name!r} has no options; give at least one of {list(OPTION_NAMES)}"
            )
        for key, option in self.options.items():
            if key not in OPTION_NAMES:
                raise ValueError(
                    f"segment {self.name!r}: unknown option {key!r}; options are {list(OPTION_NAMES)}"
                )
            if not isinstance(option, Option):
                raise TypeError(
                    f"segment {self.name!r}: option {key!r} must be an Option, got {option!r}"
                )
        ordered = {key: self.options[key] for key in OPTION_NAMES if key in self.options}
        object.__setattr__(self, "options", ordered)

    def __hash__(self) -> int:
        # The generated hash would fail on the dict; hash its items instead.
        return hash((self.name, self.activation_bytes, tuple(self.options.items())))


class CostTable(list):
    """A cost table (:class:`SegmentCost` s in forward order) with the costs a step pays once.

    A plain list of :class:`SegmentCost` is a table whose ``capture_time`` is 0.

    Args:
        segments: The segments in forward execution order.
        capture_time: Seconds per step the capture mode costs over the whole forward; a plan
            pays it once when any chosen option has ``capture=True``.

    Raises:
        ValueError, TypeError: On a negative, NaN or non-numeric ``capture_time``.

    Example:
        >>> t = CostTable([SegmentCost("b0", 8, {"retain": Option(8, 0.0)})], capture_time=0.5)
        >>> len(t), t.capture_time
        (1, 0.5)
    """

    def __init__(self, segments: Iterable[SegmentCost] = (), capture_time: float = 0.0) -> None:
        super().__init__(segments)
        self.capture_time = _check_seconds("CostTable.capture_time", capture_time)

    def __repr__(self) -> str:
        return f"CostTable({list.__repr__(self)}, capture_time={self.capture_time})"


def _capture_time(costs: Sequence[SegmentCost]) -> float:
    return costs.capture_time if isinstance(costs, CostTable) else 0.0


@dataclass(frozen=True)
class Plan:
    """One option per segment, with what the cost model predicts for it.

    Attributes:
        choices: Segment name to option name, in forward order.
        peak_memory: Predicted peak in bytes, base memory included.
        extra_time: Sum of the chosen options' times, in seconds per step.
        method: The method that made the plan (one of :data:`METHODS`).
        budget: The budget in bytes the plan was made for.
        base_memory: The memory outside segments, in bytes, the plan was made with.

    Example:
        >>> p = Plan({"b0": "whole"}, peak_memory=300, extra_time=0.5, method="joint",
        ...          budget=400, base_memory=100)
        >>> Plan.from_dict(p.to_dict()) == p
        True
    """

    choices: dict[str, str]
    peak_memory: int
    extra_time: float
    method: str
    budget: int
    base_memory: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", dict(self.choices))

    def __hash__(self) -> int:
        # The generated hash would fail on the dict; hash its items instead.
        return hash(
            (
                tuple(self.choices.items()),
                self.peak_memory,
                self.extra_time,
                self.method,
                self.budget,
                self.base_memory,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict that :meth:`from_dict` turns back into an equal plan.

        Example:
            >>> Plan({"b0": "retain"}, 10, 0.0, "retain_all", 10, 0).to_dict()["choices"]
            {'b0': 'retain'}
        """
        return {
            "schema": PLANNER_SCHEMA_VERSION,
            "method": self.method,
            "budget": self.budget,
            "base_memory": self.base_memory,
            "peak_memory": self.peak_memory,
            "extra_time": self.extra_time,
            "choices": dict(self.choices),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan written by :meth:`to_dict`.

        Raises:
            ValueError: If the schema is not :data:`PLANNER_SCHEMA_VERSION` or a field is
                missing or malformed.

        Example:
            >>> Plan.from_dict({"schema": 1, "method": "joint", "budget": 10, "base_memory": 0,
            ...                 "peak_memory": 10, "extra_time": 0.0, "choices": {"b0": "retain"}})
            Plan(choices={'b0': 'retain'}, peak_memory=10, extra_time=0.0, method='joint', budget=10, base_memory=0)
        """
        _check_schema("plan", data)
        try:
            choices = data["choices"]
            if not isinstance(choices, Mapping) or not all(
                isinstance(k, str) and v in OPTION_NAMES for k, v in choices.items()
            ):
                raise ValueError(
                    f"choices must map segment names to {list(OPTION_NAMES)}, got {choices!r}"
                )
            method = data["method"]
            if method not in METHODS:
                raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
            return cls(
                choices=dict(choices),
                peak_memory=_check_int_bytes("peak_memory", data["peak_memory"]),
                extra_time=_check_seconds("extra_time", data["extra_time"]),
                method=method,
                budget=_check_int_bytes("budget", data["budget"]),
                base_memory=_check_int_bytes("base_memory", data["base_memory"]),
            )
        except KeyError as err:
            raise ValueError(f"plan dict is missing the field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"malformed plan dict: {err}") from None


class InfeasibleBudget(ReplayError, ValueError):
    """No plan from the chosen method fits the budget.

    Attributes:
        budget: The budget asked for, in bytes.
        min_feasible: The smallest budget, in bytes and base memory included, that ``method``
            can meet. For ``joint`` this is the lowest peak of any combination of options, so
            no method can do better.
        method: The method that was asked.
        joint_min_feasible: The same minimum for ``joint``, when it was computed (``None``
            otherwise), so the message can say whether switching method would help.
        pins: The segments whose options a preservation pin restricted (segment name to the
            options it allowed), or ``None`` when nothing was pinned.
        unpinned_min_feasible: With pins, the minimum ``method`` reaches without them, so the
            message can say whether the pins are what makes the budget infeasible.
        floor: ``min_feasible`` is only a lower bound known before any step (the parameters,
            buffers and gradients), not the minimum of a measured plan.

    Example:
        >>> costs = [SegmentCost("b0", 100, {"retain": Option(100, 0.0)})]
        >>> try:
        ...     plan(costs, budget=64, base_memory=0)
        ... except InfeasibleBudget as err:
        ...     print(err.min_feasible)
        100
    """

    def __init__(
        self,
        budget: int,
        min_feasible: int,
        method: str,
        joint_min_feasible: int | None = None,
        pins: Mapping[str, Sequence[str]] | None = None,
        unpinned_min_feasible: int | None = None,
        floor: bool = False,
    ) -> None:
        self.floor = floor
        self.budget = budget
        self.min_feasible = min_feasible
        self.method = method
        self.joint_min_feasible = joint_min_feasible
        self.pins = {k: tuple(v) for k, v in pins.items()} if pins else None
        self.unpinned_min_feasible = unpinned_min_feasible
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-rich __init__ would otherwise break pickling (multiprocessing, DDP).
        return (
            type(self),
            (
                self.budget,
                self.min_feasible,
                self.method,
                self.joint_min_feasible,
                self.pins,
                self.unpinned_min_feasible,
                self.floor,
            ),
        )

    def _message(self) -> str:
        def show(n: int) -> str:
            return f"{format_bytes(n)} ({n} bytes)"

        if self.floor:  # known before any step: no plan, any method, can go below it
            return (
                f"budget {show(self.budget)} cannot be met: the model's parameters, buffers and "
                f"their gradients alone take {show(self.min_feasible)}, before any activation "
                f"is kept. Raise the budget above {self.min_feasible} bytes, or shard the "
                "model over several devices (strategy='replay_fsdp')."
            )

        text = (
            f"budget {show(self.budget)} cannot be met with method={self.method!r}: the lowest "
            f"peak it reaches is {show(self.min_feasible)}, base memory included. "
        )
        if self.pins:
            pinned = ", ".join(f"{name!r}: {'/'.join(opts)}" for name, opts in self.pins.items())
            text = text[:-2] + f", with the preservation pins {{{pinned}}}. "
            free = self.unpinned_min_feasible
            if free is not None and free <= self.budget:
                return text + (
                    f"Without the pins the budget fits (the lowest peak is {show(free)}): pin "
                    f"fewer segments (preservation='auto' for them), or raise the budget to at "
                    f"least {self.min_feasible} bytes."
                )
            if free is not None:
                text += f"Without the pins the lowest peak is {show(free)}. "
        joint = self.joint_min_feasible
        if self.method == "joint":
            return text + (
                "No combination of the measured options fits, so no other method can either. "
                f"Raise the budget to at least {self.min_feasible} bytes, or reduce the memory "
                "outside segments (base_memory)."
            )
        if joint is not None and joint <= self.budget:
            return text + (
                f"Use method='joint', which fits this budget (it reaches {show(joint)}), or raise "
                f"the budget to at least {self.min_feasible} bytes."
            )
        return text + (
            f"Raise the budget to at least {self.min_feasible} bytes, or use another method"
            + (f" (method='joint' fits budgets down to {show(joint)})" if joint is not None else "")
            + f"; methods: {list(METHODS)}."
        )


# ----------------------------------------------------------------------------------------------
# Internal table: the planner works on option indices, not names.


@dataclass(frozen=True)
class _Seg:
    name: str
    act: int
    names: tuple[str, ...]
    mem: tuple[int, ...]
    time: tuple[float, ...]
    replay: tuple[bool, ...]
    capture: tuple[bool, ...]
    acts: tuple[int, ...] = ()  # bytes each option's replay re-materializes

    def __post_init__(self) -> None:
        if not self.acts:
            object.__setattr__(self, "acts", tuple(self.act for _ in self.names))

    def index(self, option: str) -> int | None:
        return self.names.index(option) if option in self.names else None

    def lowest_memory(self, among: Sequence[int] | None = None) -> int:
        # Ties go to the faster option, then to OPTION_NAMES order, so plans are reproducible.
        pool = range(len(self.names)) if among is None else among
        return min(pool, key=lambda k: (self.mem[k], self.time[k], k))


def _table(
    costs: Sequence[SegmentCost], replay_extra: Mapping[str, int] | None = None
) -> list[_Seg]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(
            f"costs must be a sequence of SegmentCost in forward order, got {type(costs).__name__}"
        )
    seen: set[str] = set()
    table = []
    for position, seg in enumerate(costs):
        if not isinstance(seg, SegmentCost):
            raise TypeError(f"costs[{position}] must be a SegmentCost, got {seg!r}")
        if seg.name in seen:
            raise ValueError(
                f"duplicate segment name {seg.name!r} at costs[{position}]; segment names must be unique"
            )
        seen.add(seg.name)
        names = tuple(seg.options)
        more = 0 if not replay_extra else int(replay_extra.get(seg.name, 0))
        table.append(
            _Seg(
                name=seg.name,
                act=seg.activation_bytes,
                names=names,
                mem=tuple(seg.options[o].memory for o in names),
                time=tuple(seg.options[o].time for o in names),
                # with measured extras, a retained segment's backward is a moment of its own:
                # what it holds (in the prefix) + what its backward adds
                replay=tuple(o != "retain" or replay_extra is not None for o in names),
                capture=tuple(seg.options[o].capture for o in names),
                acts=tuple(
                    more
                    if o == "retain" and replay_extra is not None
                    else more
                    + (
                        seg.activation_bytes
                        if seg.options[o].replay is None
                        else seg.options[o].replay
                    )
                    for o in names
                ),
            )
        )
    return table


def _without_capture(seg: _Seg) -> _Seg | None:
    """``seg`` cut down to its options that leave the capture mode off (None: it has none)."""
    keep = [k for k, c in enumerate(seg.capture) if not c]
    if not keep:
        return None
    return _Seg(
        seg.name,
        seg.act,
        *(tuple(field[k] for k in keep) for field in (seg.names, seg.mem, seg.time, seg.replay)),
        capture=tuple(False for _ in keep),
        acts=tuple(seg.acts[k] for k in keep),
    )


def _peak(
    table: Sequence[_Seg], picks: Sequence[int], base: int, forward_extra: int = 0, floor: int = 0
) -> int:
    prefix = 0
    replay_peak = 0
    for seg, k in zip(table, picks):
        prefix += seg.mem[k]
        if seg.replay[k]:
            replay_peak = max(replay_peak, prefix + seg.acts[k])
    return max(base + max(prefix + forward_extra, replay_peak), floor)


def peak_terms(
    costs: Sequence[SegmentCost], choices: Mapping[str, str]
) -> tuple[int, dict[str, int]]:
    """The moments of :func:`predicted_peak`'s formula for ``choices``, base left out: the
    bytes the segments hold when the forward ends (``sum_s memory(s, o_s)``), and per
    replayed segment its replay (``sum_{j<=s} memory(j, o_j) + A(s)``). A measured step's real
    peak per phase is paired with these.

    Example:
        >>> costs = [
        ...     SegmentCost("a", 50, {"retain": Option(50, 0.0), "whole": Option(10, 1.0)}),
        ...     SegmentCost("b", 80, {"retain": Option(80, 0.0), "whole": Option(20, 1.0)}),
        ... ]
        >>> peak_terms(costs, {"a": "whole", "b": "retain"})  # 10 + 80; a's replay 10 + 50
        (90, {'a': 60})
    """
    table = _table(costs)
    prefix = 0
    replays: dict[str, int] = {}
    for seg, k in zip(table, _picks_from_choices(table, choices)):
        prefix += seg.mem[k]
        if seg.replay[k]:
            replays[seg.name] = prefix + seg.acts[k]
    return prefix, replays


def _with_forward_extra(table: Sequence[_Seg], forward_extra: int) -> list[_Seg]:
    """``table`` with a last, retained pseudo-segment holding ``forward_extra`` bytes: what a
    step holds beyond the segments when their forward ends (the loss, the head's temporaries),
    charged at that moment only, never under an earlier replay."""
    if not forward_extra:
        return list(table)
    tail = _Seg(
        name="",
        act=0,
        names=("retain",),
        mem=(forward_extra,),
        time=(0.0,),
        replay=(False,),
        capture=(False,),
    )
    return [*table, tail]


def _check_phase(forward_extra: object, floor: object, replay_extra: object) -> tuple[int, int]:
    if replay_extra is not None:
        if not isinstance(replay_extra, Mapping):
            raise TypeError(
                f"replay_extra must map segment names to bytes, got {type(replay_extra).__name__}"
            )
        for name, nbytes in replay_extra.items():
            _check_int_bytes(f"replay_extra[{name!r}]", nbytes)
    return (
        _check_int_bytes("forward_extra", forward_extra),
        _check_int_bytes("floor", floor),
    )


def _extra_time(table: Sequence[_Seg], picks: Sequence[int], capture_time: float = 0.0) -> float:
    # Summed in forward order, the same order the joint solver accumulates in, so the reported
    # time is bit-identical to the one the solver minimized; the capture mode's time once, last.
    total = 0.0
    for seg, k in zip(table, picks):
        total += seg.time[k]
    if capture_time and any(seg.capture[k] for seg, k in zip(table, picks)):
        total += capture_time
    return total


def predicted_peak(
    costs: Sequence[SegmentCost],
    choices: Mapping[str, str],
    base_memory: int = 0,
    *,
    forward_extra: int = 0,
    floor: int = 0,
    replay_extra: Mapping[str, int] | None = None,
) -> int:
    """Predict the peak memory, in bytes, of running ``costs`` with ``choices``.

    Args:
        costs: The segments in forward execution order.
        choices: Segment name to option name, one entry for every segment.
        base_memory: Bytes held outside the segments (parameters, gradients, optimizer state,
            unsegmented activations).
        forward_extra: Bytes held beyond ``base_memory`` only while the segments' forward
            ends and before the first replay (the loss and head temporaries a measured step
            held there beyond what it held at its replays).
        floor: A peak no choice goes under (a measured step's optimizer phase).
        replay_extra: Segment name to bytes held at its replay beyond ``base_memory`` and its
            activations (what a measured step held there: backward's temporaries, the
            gradients made by then), added to that segment's replay term.

    Returns:
        ``max(base + max(sum_s memory(s, o_s) + forward_extra, max over replayed s of
        (sum_{j<=s} memory(j, o_j) + A(s))), floor)``.

    Raises:
        ValueError: If a segment has no choice, a choice names an unknown segment, or an
            option the segment does not have.

    Example:
        >>> costs = [
        ...     SegmentCost("a", 50, {"retain": Option(50, 0.0), "whole": Option(10, 1.0)}),
        ...     SegmentCost("b", 80, {"retain": Option(80, 0.0), "whole": Option(20, 1.0)}),
        ... ]
        >>> predicted_peak(costs, {"a": "whole", "b": "retain"}, base_memory=5)  # 5 + 10 + 80
        95
        >>> predicted_peak(costs, {"a": "retain", "b": "whole"}, base_memory=5)  # 5 + 50 + 20 + 80
        155
    """
    extra, floor = _check_phase(forward_extra, floor, replay_extra)
    table = _table(costs, replay_extra)
    base = _check_int_bytes("base_memory", base_memory)
    return _peak(table, _picks_from_choices(table, choices), base, extra, floor)


def _picks_from_choices(table: Sequence[_Seg], choices: Mapping[str, str]) -> list[int]:
    if not isinstance(choices, Mapping):
        raise TypeError(
            f"choices must map segment names to option names, got {type(choices).__name__}"
        )
    known = {seg.name for seg in table}
    unknown = [name for name in choices if name not in known]
    if unknown:
        raise ValueError(f"choices name segments that are not in the cost table: {unknown}")
    picks = []
    for seg in table:
        if seg.name not in choices:
            raise ValueError(f"choices has no option for segment {seg.name!r}")
        k = seg.index(choices[seg.name])
        if k is None:
            raise ValueError(
                f"segment {seg.name!r} has no option {choices[seg.name]!r}; it has {list(seg.names)}"
            )
        picks.append(k)
    return picks


# ----------------------------------------------------------------------------------------------
# Joint: exact.
#
# Write P_s for the memory held by segments 0..s (the prefix). Every constraint is on a prefix:
# P_s + A(s) <= C for a replayed s and P_last <= C, with C = budget - base. Prefixes only grow,
# so a partial plan's future depends on nothing but its prefix: the smaller the better. A DP
# over segments in forward order that keeps the Pareto front of (prefix, time) is therefore
# exact. Two exact prunings keep the front small:
#   * F[s], the largest prefix after s segments from which *some* completion is feasible
#     (computed backward), removes dead states;
#   * a lower bound on the time still to come (the LP relaxation of the remaining
#     multiple-choice knapsack) removes states that cannot beat a plan already known, found by
#     a cheap beam-limited first pass.


def _feasibility_thresholds(table: Sequence[_Seg], cap: int) -> list[int]:
    n = len(table)
    thresholds = [0] * (n + 1)
    thresholds[n] = cap
    for s in range(n - 1, -1, -1):
        seg = table[s]
        after = thresholds[s + 1]
        thresholds[s] = max(
            (min(after, cap - seg.acts[k]) if seg.replay[k] else after) - seg.mem[k]
            for k in range(len(seg.mem))
        )
    return thresholds


def _joint_min_cap(table: Sequence[_Seg]) -> int:
    """Smallest ``budget - base`` the joint planner can meet: the lowest peak of any plan."""
    # Feasibility is monotone in the capacity and F[0] >= 0 decides it exactly, so a binary
    # search over integers finds the exact minimum in ~log2(bytes) cheap passes.
    lo = 0
    hi = sum(max(seg.mem) for seg in table) + max((max(seg.acts) for seg in table), default=0)
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasibility_thresholds(table, mid)[0] >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class _SuffixBound:
    """LP lower bound on the time of segments s..n-1 as a function of their memory allowance."""

    base_mem: int  # memory with every segment at its lowest-memory hull point
    base_time: float
    cum_mem: np.ndarray  # int64, cumulative extra memory of hull edges, best slope first
    cum_time: np.ndarray  # float64, cumulative time change (<= 0) of those edges
    slope: np.ndarray  # float64, time per byte of the next edge; 0 past the last edge

    def __call__(self, allowance: np.ndarray) -> np.ndarray:
        spare = allowance - self.base_mem
        k = np.searchsorted(self.cum_mem, spare, side="right") - 1
        k = np.maximum(k, 0)
        bound = self.base_time + self.cum_time[k] + self.slope[k] * (spare - self.cum_mem[k])
        return np.where(spare < 0, np.inf, bound)


def _lower_hull(seg: _Seg) -> tuple[tuple[int, float], list[tuple[int, float]]]:
    points = sorted(zip(seg.mem, seg.time))
    hull: list[tuple[int, float]] = []
    for m, t in points:
        if hull and hull[-1][0] == m:
            continue  # same memory, slower (sorted): never on the lower hull
        while len(hull) >= 2:
            (m1, t1), (m2, t2) = hull[-2], hull[-1]
            if (m2 - m1) * (t - t1) - (t2 - t1) * (m - m1) <= 0:
                hull.pop()
            else:
                break
        hull.append((m, t))
    # Past the fastest point more memory buys nothing.
    fastest = min(range(len(hull)), key=lambda i: (hull[i][1], i))
    hull = hull[: fastest + 1]
    edges = [
        (hull[i + 1][0] - hull[i][0], hull[i + 1][1] - hull[i][1]) for i in range(len(hull) - 1)
    ]
    return hull[0], edges


def _suffix_bounds(table: Sequence[_Seg]) -> list[_SuffixBound]:
    n = len(table)
    owner: list[int] = []
    d_mem: list[int] = []
    d_time: list[float] = []
    starts = []
    for s, seg in enumerate(table):
        start, edges = _lower_hull(seg)
        starts.append(start)
        for dm, dt in edges:
            owner.append(s)
            d_mem.append(dm)
            d_time.append(dt)
    owner_a = np.asarray(owner, dtype=np.int64)
    d_mem_a = np.asarray(d_mem, dtype=np.int64)
    d_time_a = np.asarray(d_time, dtype=np.float64)
    # Per segment, hull slopes increase along the hull, so taking all edges best-slope-first
    # takes each segment's edges in hull order: the greedy is the LP optimum.
    order = np.argsort(d_time_a / np.maximum(d_mem_a, 1), kind="stable")
    owner_a, d_mem_a, d_time_a = owner_a[order], d_mem_a[order], d_time_a[order]
    bounds = []
    base_mem = 0
    base_time = 0.0
    suffix_start = [(0, 0.0)] * (n + 1)
    for s in range(n - 1, -1, -1):
        base_mem += starts[s][0]
        base_time += starts[s][1]
        suffix_start[s] = (base_mem, base_time)
    for s in range(n + 1):
        keep = owner_a >= s
        dm, dt = d_mem_a[keep], d_time_a[keep]
        bounds.append(
            _SuffixBound(
                base_mem=suffix_start[s][0],
                base_time=suffix_start[s][1],
                cum_mem=np.concatenate(([0], np.cumsum(dm))).astype(np.int64),
                cum_time=np.concatenate(([0.0], np.cumsum(dt))),
                slope=np.concatenate((dt / np.maximum(dm, 1), [0.0])),
            )
        )
    return bounds


def _pareto_indices(prefix: np.ndarray, time: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """Indices of the states no other state dominates, sorted by prefix.

    State a dominates b when a's prefix is no larger and a is strictly faster, or equally fast
    with a replay peak no larger (so among equal-time plans the lower peak survives).
    """
    # lexsort is stable: among identical states the earliest (deterministic) one is kept.
    order = np.lexsort((peak, time, prefix))
    t_sorted = time[order]
    running = np.minimum.accumulate(t_sorted)
    before = np.empty_like(t_sorted)
    before[0] = np.inf
    before[1:] = running[:-1]
    keep = t_sorted < before
    ties = t_sorted == before
    if ties.any():
        # Exact time ties are rare with measured times; resolve them by replay peak in Python.
        p_sorted = peak[order]
        best_time = np.inf
        best_peak = 0
        for i in np.flatnonzero(t_sorted <= before).tolist():
            if t_sorted[i] < best_time:
                best_time, best_peak = t_sorted[i], p_sorted[i]
            elif p_sorted[i] < best_peak:
                keep[i] = True
                best_peak = p_sorted[i]
    return order[keep]


def _pareto_pass(
    table: Sequence[_Seg],
    cap: int,
    thresholds: Sequence[int],
    bounds: Sequence[_SuffixBound],
    time_limit: float,
    beam: int | None,
) -> tuple[list[int], float, bool] | None:
    """Forward DP; returns (picks, time, truncated) of the best final state, or None if none."""
    prefix = np.zeros(1, dtype=np.int64)
    time = np.zeros(1, dtype=np.float64)
    peak = np.zeros(1, dtype=np.int64)  # max over replayed segments so far of P_s + A(s)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = False
    for s, seg in enumerate(table):
        limit = thresholds[s + 1]
        parts = []
        for k in range(len(seg.mem)):
            grown = prefix + seg.mem[k]
            ok = grown <= limit
            if seg.replay[k]:
                ok &= grown + seg.acts[k] <= cap
            parent = np.flatnonzero(ok)
            if parent.size == 0:
                continue
            grown = grown[parent]
            new_peak = (
                np.maximum(peak[parent], grown + seg.acts[k]) if seg.replay[k] else peak[parent]
            )
            option = np.full(parent.size, k, dtype=np.int8)
            parts.append((grown, time[parent] + seg.time[k], new_peak, parent, option))
        if not parts:
            return None
        c_prefix, c_time, c_peak, c_parent, c_opt = (np.concatenate(x) for x in zip(*parts))
        score = c_time + bounds[s + 1](cap - c_prefix)
        if math.isfinite(time_limit):
            alive = np.flatnonzero(score <= time_limit)
            if alive.size == 0:
                return None
            c_prefix, c_time, c_peak, c_parent, c_opt, score = (
                x[alive] for x in (c_prefix, c_time, c_peak, c_parent, c_opt, score)
            )
        kept = _pareto_indices(c_prefix, c_time, c_peak)
        if beam is not None and kept.size > beam:
            truncated = True
            best = np.argpartition(score[kept], beam - 1)[:beam]
            kept = kept[np.sort(best)]  # back to prefix order
        prefix, time, peak = c_prefix[kept], c_time[kept], c_peak[kept]
        back.append((c_parent[kept], c_opt[kept]))
    # Every surviving state satisfies all constraints (the last threshold is cap itself).
    final = np.lexsort((np.maximum(prefix, peak), time))[0]
    best_time = float(time[final])
    picks = [0] * len(table)
    state = int(final)
    for s in range(len(table) - 1, -1, -1):
        parent, opt = back[s]
        picks[s] = int(opt[state])
        state = int(parent[state])
    return picks, best_time, truncated


def _joint(table: Sequence[_Seg], cap: int) -> list[int] | None:
    if cap < 0:
        return None
    thresholds = _feasibility_thresholds(table, cap)
    if thresholds[0] < 0:
        return None
    if not table:
        return []
    bounds = _suffix_bounds(table)
    first = _pareto_pass(table, cap, thresholds, bounds, math.inf, _BEAM_WIDTH)
    if first is None:  # cannot happen: every state kept has a feasible completion
        raise RuntimeError("joint planner lost every feasible state; please report this cost table")
    picks, upper, truncated = first
    if not truncated:
        return picks  # the beam never cut anything, so the first pass was already exact
    # Float sums differ from the exact values by a few ulps; the slack keeps the optimum (and
    # its equal-time ties) from being pruned by rounding.
    scale = upper + sum(max(seg.time) for seg in table)
    exact = _pareto_pass(table, cap, thresholds, bounds, upper + 1e-9 * scale + 1e-12, None)
    return picks if exact is None else exact[0]


def _joint_with_capture(table: Sequence[_Seg], cap: int, capture_time: float) -> list[int] | None:
    """The exact optimum when options that turn the capture mode on share its time.

    Any plan either leaves the mode off, and is no faster than the best plan among options
    that leave it off, or turns it on and costs its per-segment sum plus ``capture_time``, no
    less than the best per-segment sum over every option plus ``capture_time``. So the faster
    of those two plans (the lower peak on a tie) is optimal.
    """
    best = _joint(table, cap)
    if best is None or not capture_time or not any(seg.capture[k] for seg, k in zip(table, best)):
        return best
    reduced = [_without_capture(seg) for seg in table]
    if any(seg is None for seg in reduced):
        return best
    off = _joint(reduced, cap)
    if off is None:
        return best
    off = [table[s].names.index(reduced[s].names[k]) for s, k in enumerate(off)]
    key = lambda picks: (_extra_time(table, picks, capture_time), _peak(table, picks, 0))  # noqa: E731
    return min((best, off), key=key)


# ----------------------------------------------------------------------------------------------
# Baselines. Each yields the assignments it would try, in order, independent of the budget;
# the plan is the first that fits and the minimum feasible budget is the lowest peak on the path.


def _retain_all(table: Sequence[_Seg]) -> Iterator[list[int]]:
    yield [seg.index("retain") if "retain" in seg.names else seg.lowest_memory() for seg in table]


def _whole_all(table: Sequence[_Seg]) -> Iterator[list[int]]:
    picks = []
    for seg in table:
        k = seg.index("whole")
        if k is None:
            k = seg.index("recompute")
        picks.append(seg.lowest_memory() if k is None else k)
    yield picks


def _selective_all(table: Sequence[_Seg]) -> Iterator[list[int]]:
    # every segment replayed selectively, with its lowest-memory selective option (a segment
    # without one: its lowest-memory option)
    picks = []
    for seg in table:
        selective = [k for k, o in enumerate(seg.names) if o.startswith("selective")]
        picks.append(seg.lowest_memory(selective or None))
    yield picks


def _fixed_regions(table: Sequence[_Seg]) -> Iterator[list[int]]:
    picks = []
    for seg in table:
        replayed = [k for k, o in enumerate(seg.names) if o != "retain"]
        picks.append(seg.lowest_memory(replayed) if replayed else 0)
    yield picks


def _eager_whole(table: Sequence[_Seg]) -> Iterator[list[int]]:
    eligible = [
        [k for k, o in enumerate(seg.names) if o in ("whole", "recompute")] for seg in table
    ]
    picks = []
    for seg, options in zip(table, eligible):
        if "retain" in seg.names:
            picks.append(seg.index("retain"))
        elif options:
            # No retain: start at the fastest option the greedy may use, the closest to retain.
            picks.append(min(options, key=lambda k: (seg.time[k], seg.mem[k], k)))
        else:
            picks.append(seg.lowest_memory())  # only "regions": outside this method, fixed
    yield list(picks)
    while True:
        best_key: tuple[float, int, int, int] | None = None
        best_move = (0, 0)
        for s, (seg, options) in enumerate(zip(table, eligible)):
            current = picks[s]
            for k in options:
                saved = seg.mem[current] - seg.mem[k]
                if saved <= 0:
                    continue
                added = seg.time[k] - seg.time[current]
                ratio = math.inf if added <= 0 else saved / added
                key = (ratio, saved, -s, -k)
                if best_key is None or key > best_key:
                    best_key, best_move = key, (s, k)
        if best_key is None:
            return
        picks[best_move[0]] = best_move[1]
        yield list(picks)


_BASELINES = {
    "eager_whole": _eager_whole,
    "fixed_regions": _fixed_regions,
    "retain_all": _retain_all,
    "whole_all": _whole_all,
    "selective_all": _selective_all,
}


def _check_method(method: object) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    return str(method)


def _check_budget(budget: object) -> int:
    if isinstance(budget, (str, float)):
        raise TypeError(
            f"budget must be an int number of bytes, got {budget!r}; convert it first, e.g. "
            "budget=parse_budget('40GiB') from lightning_replay.budget"
        )
    return _check_int_bytes("budget", budget)


def _check_size(table: Sequence[_Seg], budget: int, base: int, more: int = 0) -> None:
    total = (
        budget
        + base
        + more
        + sum(max(seg.mem) for seg in table)
        + max((max((seg.act,) + seg.acts) for seg in table), default=0)
    )
    if total >= _MAX_BYTES:
        raise ValueError(
            f"budget, base_memory and segment costs add up to {total} bytes, beyond the "
            f"{_MAX_BYTES} bytes the planner supports; check the units of the cost table"
        )


def _restrict(
    costs: Sequence[SegmentCost], allowed: Mapping[str, Iterable[str]] | None
) -> tuple[list[SegmentCost], dict[str, tuple[str, ...]]]:
    """The cost table with each pinned segment cut down to its allowed options, and the pins
    that removed at least one measured option."""
    if allowed is None:
        return list(costs), {}
    if not isinstance(allowed, Mapping):
        raise TypeError(
            f"allowed must map segment names to sets of options, got {type(allowed).__name__}"
        )
    known = {seg.name for seg in costs if isinstance(seg, SegmentCost)}
    wanted: dict[str, tuple[str, ...]] = {}
    for name, options in allowed.items():
        if name not in known:
            raise ValueError(
                f"allowed names segment {name!r}, which is not in the cost table {sorted(known)}"
            )
        if isinstance(options, str) or not isinstance(options, Iterable):
            raise TypeError(f"allowed[{name!r}] must be a set of option names, got {options!r}")
        options = set(options)
        unknown = sorted(options - set(OPTION_NAMES))
        if unknown or not options:
            raise ValueError(
                f"allowed[{name!r}] must be a non-empty set of options from {list(OPTION_NAMES)}, got "
                f"{sorted(options)}"
            )
        wanted[name] = tuple(o for o in OPTION_NAMES if o in options)
    restricted = []
    pins = {}
    for seg in costs:
        keep = wanted.get(seg.name) if isinstance(seg, SegmentCost) else None
        if keep is None:
            restricted.append(seg)
            continue
        options = {o: opt for o, opt in seg.options.items() if o in keep}
        if not options:
            raise ValueError(
                f"segment {seg.name!r} is pinned to {list(keep)}, but its measured options are "
                f"{list(seg.options)}: none of them honours the pin. Pin it to one of those."
            )
        if len(options) < len(seg.options):
            pins[seg.name] = tuple(options)
        restricted.append(SegmentCost(seg.name, seg.activation_bytes, options))
    return restricted, pins


def plan(
    costs: Sequence[SegmentCost],
    budget: int,
    base_memory: int = 0,
    method: str = "joint",
    allowed: Mapping[str, Iterable[str]] | None = None,
    *,
    forward_extra: int = 0,
    floor: int = 0,
    replay_extra: Mapping[str, int] | None = None,
) -> Plan:
    """Choose one option per segment so the predicted peak fits ``budget``, as fast as possible.

    Args:
        costs: The segments in forward execution order (names unique).
        budget: Peak memory allowed, in bytes, base memory included. Use
            :func:`lightning_replay.budget.parse_budget` to convert ``"40GiB"`` or a fraction.
        base_memory: Bytes held outside the segments.
        method: One of :data:`METHODS`:

            * ``joint``: the exact minimum of ``extra_time`` over every option of every
              segment (the capture mode's time of a :class:`CostTable` counted once). Among
              equal-time plans it takes the lowest peak.
            * ``eager_whole``: greedy over ``retain``/``whole``/``recompute`` (ignores
              ``regions``): from all-retain, repeatedly switch the segment with the most
              bytes saved per second added, until the budget holds.
            * ``fixed_regions``: every segment replayed with its lowest-memory replay option.
            * ``retain_all``: every segment retained (lowest-memory option if it cannot be).
            * ``whole_all``: every segment ``whole``, else ``recompute``, else its
              lowest-memory option.
            * ``selective_all``: every segment its lowest-memory selective option
              (``selective``, ``selective_whole``, ``selective_regions``), else its
              lowest-memory option.
        allowed: Segment name to the options it may take (a preservation pin); every method
            chooses only among those. Segments not named may take any measured option.
        forward_extra, floor, replay_extra: As in :func:`predicted_peak`: bytes held beyond
            the base at the forward's end only, a peak no plan goes under, and bytes held at
            each segment's replay beyond its activations.

    Returns:
        The :class:`Plan`.

    Raises:
        InfeasibleBudget: If the method cannot meet the budget; ``min_feasible`` says the
            smallest budget it can, and ``pins`` names the pinned segments, if any.
        TypeError, ValueError: On malformed costs, budget, base memory, method or
            ``allowed`` (including a pin that none of a segment's measured options honours).

    Example:
        >>> costs = [SegmentCost(f"b{i}", 100, {"retain": Option(100, 0.0),
        ...                                     "whole": Option(40, 1.0),
        ...                                     "regions": Option(20, 1.5)}) for i in range(3)]
        >>> plan(costs, budget=220).choices
        {'b0': 'regions', 'b1': 'retain', 'b2': 'retain'}
        >>> plan(costs, budget=220, method="eager_whole").choices
        {'b0': 'whole', 'b1': 'whole', 'b2': 'retain'}
        >>> try:
        ...     plan(costs, budget=100)
        ... except InfeasibleBudget as err:
        ...     print(err.min_feasible)
        140
        >>> plan(costs, budget=220, allowed={"b0": {"retain"}}).choices  # b0 pinned to retain
        {'b0': 'retain', 'b1': 'regions', 'b2': 'retain'}
    """
    extra, floor = _check_phase(forward_extra, floor, replay_extra)
    full = _table(costs, replay_extra)
    budget = _check_budget(budget)
    base = _check_int_bytes("base_memory", base_memory)
    method = _check_method(method)
    _check_size(full, budget, base, extra + floor)
    restricted, pins = _restrict(costs, allowed)
    table = _table(restricted, replay_extra) if pins else full
    capture_time = _capture_time(costs)
    if method == "joint":
        picks = None
        if floor <= budget:
            picks = _joint_with_capture(
                _with_forward_extra(table, extra), budget - base, capture_time
            )
        if picks is None:
            raise InfeasibleBudget(
                budget,
                _joint_min(table, base, extra, floor),
                method,
                pins=pins,
                unpinned_min_feasible=_joint_min(full, base, extra, floor) if pins else None,
            )
        picks = picks[: len(table)]
    else:
        picks = None
        lowest = None
        for candidate in _BASELINES[method](table):
            peak = _peak(table, candidate, base, extra, floor)
            if peak <= budget:
                picks = candidate
                break
            lowest = peak if lowest is None else min(lowest, peak)
        if picks is None:
            assert lowest is not None  # every baseline yields at least one assignment
            raise InfeasibleBudget(
                budget,
                lowest,
                method,
                _joint_min(table, base, extra, floor),
                pins=pins,
                unpinned_min_feasible=_baseline_min(full, base, method, extra, floor)
                if pins
                else None,
            )
    return Plan(
        choices={seg.name: seg.names[k] for seg, k in zip(table, picks)},
        peak_memory=_peak(table, picks, base, extra, floor),
        extra_time=_extra_time(table, picks, capture_time),
        method=method,
        budget=budget,
        base_memory=base,
    )


def _baseline_min(
    table: Sequence[_Seg], base: int, method: str, extra: int = 0, floor: int = 0
) -> int:
    return min(_peak(table, picks, base, extra, floor) for picks in _BASELINES[method](table))


def _joint_min(table: Sequence[_Seg], base: int, extra: int = 0, floor: int = 0) -> int:
    """The lowest predicted peak of any plan over ``table``."""
    return max(base + _joint_min_cap(_with_forward_extra(table, extra)), floor)


def min_feasible_budget(
    costs: Sequence[SegmentCost],
    base_memory: int = 0,
    method: str = "joint",
    allowed: Mapping[str, Iterable[str]] | None = None,
    *,
    forward_extra: int = 0,
    floor: int = 0,
    replay_extra: Mapping[str, int] | None = None,
) -> int:
    """The smallest budget, in bytes and base memory included, that ``method`` can meet.

    This is :attr:`InfeasibleBudget.min_feasible` without having to fail first; for
    ``joint`` it is the lowest predicted peak over every combination of options. ``allowed``
    restricts segments' options as in :func:`plan`.

    Example:
        >>> costs = [SegmentCost(f"b{i}", 100, {"retain": Option(100, 0.0), "whole": Option(40, 1.0)})
        ...          for i in range(2)]
        >>> min_feasible_budget(costs, base_memory=10)  # b0 whole, b1 retain: 10 + 40 + 100
        150
        >>> min_feasible_budget(costs, base_memory=10, method="retain_all")
        210
        >>> min_feasible_budget(costs, base_memory=10, allowed={"b0": {"retain"}})  # b1's replay
        210
        >>> # would hold b0's 100 + its own 40 + 100 re-materialized; retaining b1 holds only 200
    """
    extra, floor = _check_phase(forward_extra, floor, replay_extra)
    table = _table(costs, replay_extra)
    base = _check_int_bytes("base_memory", base_memory)
    method = _check_method(method)
    _check_size(table, 0, base, extra + floor)
    restricted, pins = _restrict(costs, allowed)
    if pins:
        table = _table(restricted, replay_extra)
    if method == "joint":
        return _joint_min(table, base, extra, floor)
    return _baseline_min(table, base, method, extra, floor)


# ----------------------------------------------------------------------------------------------
# Serialization.


def _check_schema(what: str, data: object) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} dict must be a mapping, got {type(data).__name__}")
    schema = data.get("schema")
    if schema != PLANNER_SCHEMA_VERSION:
        raise ValueError(
            f"{what} dict has schema {schema!r}, but this version of lightning_replay reads "
            f"schema {PLANNER_SCHEMA_VERSION}; re-measure the costs or load them with a "
            "matching version"
        )


def costs_to_dict(costs: Sequence[SegmentCost]) -> dict[str, Any]:
    """Serialize a cost table to a JSON-safe dict (``{"schema": 1, "segments": [...]}``, with
    ``capture_time`` for a :class:`CostTable`, and ``capture`` on the options that need it).

    Example:
        >>> import json
        >>> costs = [SegmentCost("b0", 8, {"retain": Option(8, 0.0), "recompute": Option(2, 0.1)})]
        >>> costs_from_dict(json.loads(json.dumps(costs_to_dict(costs)))) == costs
        True
    """
    _table(costs)  # the same validation as planning: a table that saves can be planned

    def option(opt: Option) -> dict[str, Any]:
        out: dict[str, Any] = {"memory": opt.memory, "time": opt.time}
        if opt.capture:
            out["capture"] = True
        if opt.replay is not None:
            out["replay"] = opt.replay
        return out

    return {
        "schema": PLANNER_SCHEMA_VERSION,
        "capture_time": _capture_time(costs),
        "segments": [
            {
                "name": seg.name,
                "activation_bytes": seg.activation_bytes,
                "options": {o: option(opt) for o, opt in seg.options.items()},
            }
            for seg in costs
        ],
    }


def costs_from_dict(data: Mapping[str, Any]) -> CostTable:
    """Rebuild a cost table written by :func:`costs_to_dict` (``capture_time`` 0 and no
    ``capture`` where a dict has none).

    Raises:
        ValueError: If the schema is not :data:`PLANNER_SCHEMA_VERSION`, or a segment or option is
            missing a field or holds a bad value; the message says which.

    Example:
        >>> costs_from_dict({"schema": 1, "segments": [{"name": "b0", "activation_bytes": 8,
        ...     "options": {"retain": {"memory": 8, "time": 0.0}}}]})[0].options
        {'retain': Option(memory=8, time=0.0)}
    """
    _check_schema("cost table", data)
    segments = data.get("segments")
    if not isinstance(segments, list):
        raise ValueError(f"cost table dict needs a list under 'segments', got {segments!r}")
    costs = []
    for position, raw in enumerate(segments):
        where = f"segments[{position}]"
        try:
            if not isinstance(raw, Mapping):
                raise ValueError(f"expected a mapping, got {raw!r}")
            where = f"segment {raw.get('name', position)!r}"
            raw_options = raw["options"]
            if not isinstance(raw_options, Mapping):
                raise ValueError(f"options must be a mapping, got {raw_options!r}")
            options = {}
            for key, value in raw_options.items():
                if not isinstance(value, Mapping):
                    raise ValueError(
                        f"option {key!r} must be a mapping with memory and time, got {value!r}"
                    )
                try:
                    options[key] = Option(
                        memory=value["memory"],
                        time=value["time"],
                        capture=value.get("capture", False),
                        replay=value.get("replay"),
                    )
                except KeyError as err:
                    raise ValueError(f"option {key!r} is missing {err.args[0]!r}") from None
                except (TypeError, ValueError) as err:
                    raise ValueError(f"option {key!r}: {err}") from None
            costs.append(SegmentCost(raw["name"], raw["activation_bytes"], options))
        except KeyError as err:
            raise ValueError(f"cost table {where} is missing the field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"cost table {where}: {err}") from None
    try:
        _table(costs)
        return CostTable(costs, capture_time=data.get("capture_time", 0.0))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cost table: {err}") from None
