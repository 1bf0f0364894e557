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

``method="joint"`` is exact (:mod:`~lightning_replay.core.engine.joint`). The other methods
are the baselines it is compared with (:mod:`~lightning_replay.core.engine.baselines`); both
judge plans by the cost model of :mod:`~lightning_replay.core.engine.peak`, over the values
of :mod:`~lightning_replay.core.base.plan_types` (all importable from here as before).

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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


from lightning_replay.core.base.plan_types import (  # (moved there; importable here as before)
    CostTable as CostTable,
    InfeasibleBudget as InfeasibleBudget,
    METHODS as METHODS,
    OPTION_NAMES as OPTION_NAMES,
    Option as Option,
    PLANNER_SCHEMA_VERSION as PLANNER_SCHEMA_VERSION,
    Plan as Plan,
    SegmentCost as SegmentCost,
    _MAX_BYTES as _MAX_BYTES,
    _capture_time as _capture_time,
    _check_int_bytes as _check_int_bytes,
    _check_schema as _check_schema,
    _check_seconds as _check_seconds,
)

from lightning_replay.core.engine.peak import (  # (moved there; importable here as before)
    _Seg as _Seg,
    _check_phase as _check_phase,
    _check_transient as _check_transient,
    _extra_time as _extra_time,
    _peak as _peak,
    _picks_from_choices as _picks_from_choices,
    _table as _table,
    _without_capture as _without_capture,
    predicted_peak as predicted_peak,
)

from lightning_replay.core.engine.joint import (  # (moved there; importable here as before)
    _SuffixBound as _SuffixBound,
    _feasibility_thresholds as _feasibility_thresholds,
    _joint as _joint,
    _joint_min_cap as _joint_min_cap,
    _joint_with_capture as _joint_with_capture,
    _lower_hull as _lower_hull,
    _pareto_indices as _pareto_indices,
    _pareto_pass as _pareto_pass,
    _suffix_bounds as _suffix_bounds,
)

from lightning_replay.core.engine.baselines import (  # (moved there; importable here as before)
    _BASELINES as _BASELINES,
    _baseline_min as _baseline_min,
    _eager_whole as _eager_whole,
    _fixed_regions as _fixed_regions,
    _retain_all as _retain_all,
    _selective_all as _selective_all,
    _whole_all as _whole_all,
)

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
        + max((max((seg.act,) + seg.acts + seg.fwd) for seg in table), default=0)
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
    forward_transient: Mapping[str, Mapping[str, int]] | None = None,
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
        forward_extra, floor, replay_extra, forward_transient: As in :func:`predicted_peak`:
            bytes held beyond the base at the forward's end only, a peak no plan goes under,
            bytes held at each segment's replay beyond its activations, and bytes each
            segment's forward holds under each option beyond what it keeps.

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
    _check_transient(forward_transient)
    full = _table(costs, replay_extra, forward_transient)
    budget = _check_budget(budget)
    base = _check_int_bytes("base_memory", base_memory)
    method = _check_method(method)
    _check_size(full, budget, base, extra + floor)
    restricted, pins = _restrict(costs, allowed)
    table = _table(restricted, replay_extra, forward_transient) if pins else full
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
    forward_transient: Mapping[str, Mapping[str, int]] | None = None,
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
    _check_transient(forward_transient)
    table = _table(costs, replay_extra, forward_transient)
    base = _check_int_bytes("base_memory", base_memory)
    method = _check_method(method)
    _check_size(table, 0, base, extra + floor)
    restricted, pins = _restrict(costs, allowed)
    if pins:
        table = _table(restricted, replay_extra, forward_transient)
    if method == "joint":
        return _joint_min(table, base, extra, floor)
    return _baseline_min(table, base, method, extra, floor)


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
