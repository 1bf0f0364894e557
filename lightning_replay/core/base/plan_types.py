"""The planner's data: options and their measured costs, the cost table, a plan.

What :mod:`~lightning_replay.core.engine.planner` plans over and returns, as plain values: an
:class:`Option` (bytes held and seconds added), a :class:`SegmentCost` (a segment's options and
the activation bytes it re-materializes), a :class:`CostTable` (the segments in forward order
and the per-step capture time), a :class:`Plan`, and :class:`InfeasibleBudget` when none fits.
The cost meter (:mod:`~lightning_replay.core.mechanisms.costs`) builds these from
measurements, below the planner, so they live here.

Example:
    >>> Option(memory=30, time=2.0).memory
    30
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.base.contract import OPTIONS
from lightning_replay.errors import ReplayError

#: Preservation options a segment may have (the contract's :data:`OPTIONS`). Iteration order
#: everywhere in the planner is this order, so results never depend on the order a caller
#: happened to build its dicts in.
OPTION_NAMES: tuple[str, ...] = OPTIONS

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
        replay: Bytes this option's replay adds on top of ``memory``, where they differ from
            the segment's ``activation_bytes`` (``None``): a selective replay re-materializes
            only what it recomputes, the outputs it kept being in ``memory`` already, and
            consumes the kept outputs autograd does not save as it uses them.

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
        >>> from lightning_replay.core.engine.planner import plan
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
