"""The cost model: what a plan's choices cost in peak memory and extra time.

With ``o_s`` the option chosen for segment ``s`` (in forward order), the predicted peak is
``base + max(sum_s memory(s, o_s), max over replayed s of (sum_{j<=s} memory(j, o_j) + A(s)),
max over s of (sum_{j<=s} memory(j, o_j) + F(s, o_s)))``, ``F(s, o)`` the transient segment
``s``'s forward holds under option ``o`` beyond what it keeps (measured; 0 where not given), and
the extra time ``sum_s time(s, o_s)`` plus the capture mode's per-step time once if any
chosen option needs it (see :mod:`~lightning_replay.core.engine.planner`). Every planning
method, the joint one and the baselines, is judged by these two functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_replay.core.base.plan_types import (
    SegmentCost,
    _check_int_bytes,
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
    # bytes each option's forward holds beyond the prefix through this segment (its moment)
    fwd: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.acts:
            object.__setattr__(self, "acts", tuple(self.act for _ in self.names))
        if not self.fwd:
            object.__setattr__(self, "fwd", tuple(0 for _ in self.names))

    def index(self, option: str) -> int | None:
        return self.names.index(option) if option in self.names else None

    def lowest_memory(self, among: Sequence[int] | None = None) -> int:
        # Ties go to the faster option, then to OPTION_NAMES order, so plans are reproducible.
        pool = range(len(self.names)) if among is None else among
        return min(pool, key=lambda k: (self.mem[k], self.time[k], k))


def _table(
    costs: Sequence[SegmentCost],
    replay_extra: Mapping[str, int] | None = None,
    forward_transient: Mapping[str, Mapping[str, int]] | None = None,
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
        moment = (forward_transient or {}).get(seg.name) or {}
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
                fwd=tuple(int(moment.get(o, 0)) for o in names),
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
        fwd=tuple(seg.fwd[k] for k in keep),
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
        if seg.fwd[k]:  # the segment's own forward: its transient on top of what it keeps
            replay_peak = max(replay_peak, prefix + seg.fwd[k])
    return max(base + max(prefix + forward_extra, replay_peak), floor)


def _check_transient(forward_transient: object) -> None:
    if forward_transient is None:
        return
    if not isinstance(forward_transient, Mapping):
        raise TypeError(
            "forward_transient must map segment names to {option: bytes}, got "
            f"{type(forward_transient).__name__}"
        )
    for name, per_option in forward_transient.items():
        if not isinstance(per_option, Mapping):
            raise TypeError(
                f"forward_transient[{name!r}] must map option names to bytes, got "
                f"{type(per_option).__name__}"
            )
        for o, nbytes in per_option.items():
            _check_int_bytes(f"forward_transient[{name!r}][{o!r}]", nbytes)


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
    forward_transient: Mapping[str, Mapping[str, int]] | None = None,
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
        forward_transient: Segment name to option name to bytes its forward holds under that
            option beyond ``base_memory``, what the segments before it keep and what it keeps
            itself (a replayed option's forward briefly holds the activations it drops: a
            measured step's peak inside that forward); its own moment, ``sum_{j<=s}
            memory(j, o_j) + F(s, o_s)``. Segments and options not named: 0.

    Returns:
        ``max(base + max(sum_s memory(s, o_s) + forward_extra, max over replayed s of
        (sum_{j<=s} memory(j, o_j) + A(s)), max over s of (sum_{j<=s} memory(j, o_j) +
        F(s, o_s))), floor)``.

    Raises:
        ValueError: If a segment has no choice, a choice names an unknown segment, or an
            option the segment does not have.

    Example:
        >>> from lightning_replay.core.base.plan_types import Option, SegmentCost
        >>> costs = [
        ...     SegmentCost("a", 50, {"retain": Option(50, 0.0), "whole": Option(10, 1.0)}),
        ...     SegmentCost("b", 80, {"retain": Option(80, 0.0), "whole": Option(20, 1.0)}),
        ... ]
        >>> predicted_peak(costs, {"a": "whole", "b": "retain"}, base_memory=5)  # 5 + 10 + 80
        95
        >>> predicted_peak(costs, {"a": "retain", "b": "whole"}, base_memory=5)  # 5 + 50 + 20 + 80
        155
        >>> predicted_peak(costs, {"a": "whole", "b": "retain"}, base_memory=5,
        ...                forward_transient={"a": {"whole": 60}})  # a's forward 5 + 10 + 60 < 95
        95
        >>> predicted_peak(costs, {"a": "whole", "b": "retain"}, base_memory=5,
        ...                forward_transient={"a": {"whole": 90}})  # a's forward: 5 + 10 + 90
        105
    """
    extra, floor = _check_phase(forward_extra, floor, replay_extra)
    _check_transient(forward_transient)
    table = _table(costs, replay_extra, forward_transient)
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
