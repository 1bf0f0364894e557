"""Measured phase figures as one row of integers, so that ranks that run one plan can agree
on the largest of each (a strategy reduces the rows with ``max``) and plan with figures that
bound every rank's step, not only the planning rank's.

The figures are :attr:`~lightning_replay.core.engine.engine.ReplayEngine.phase_peak_args`:
``forward_extra``, ``floor``, ``replay_extra`` (per segment) and ``forward_transient`` (per
segment and option). The row's layout depends only on the segment names and
:data:`~lightning_replay.core.base.contract.OPTIONS`, which every rank shares; a figure a rank
has not measured is :data:`MISSING` there.

Example:
    >>> args = {"forward_extra": 5, "floor": 0, "replay_extra": {"a": 3, "b": 1}}
    >>> other = {"forward_extra": 2, "floor": 9, "forward_transient": {"b": {"retain": 4}}}
    >>> rows = [phase_row(a, ["a", "b"]) for a in (args, other)]
    >>> agreed = phase_args(list(map(max, *rows)), ["a", "b"])
    >>> agreed["forward_extra"], agreed["floor"], agreed["replay_extra"]
    (5, 9, {'a': 3, 'b': 1})
    >>> agreed["forward_transient"]
    {'b': {'retain': 4}}
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lightning_replay.core.base.contract import OPTIONS

#: A figure this rank has not measured (below every figure in bytes: ``max`` ignores it).
MISSING = -1


def phase_row(args: Mapping[str, Any], segments: Sequence[str]) -> list[int]:
    """``args`` (phase figures, as ``phase_peak_args``) as a row of integers:
    ``[forward_extra, floor, has replay_extra, replay_extra per segment, forward_transient
    per segment and option]``."""
    replay = args.get("replay_extra")
    transient = args.get("forward_transient") or {}
    row = [int(args.get("forward_extra", 0)), int(args.get("floor", 0)), int(replay is not None)]
    row += [int(replay.get(s, MISSING)) if replay is not None else MISSING for s in segments]
    for s in segments:
        mine = transient.get(s) or {}
        row += [int(mine.get(o, MISSING)) for o in OPTIONS]
    return row


def phase_args(row: Sequence[int], segments: Sequence[str]) -> dict[str, Any]:
    """The phase figures a row (:func:`phase_row`, or the ``max`` of several) stands for."""
    n = len(segments)
    if len(row) != 3 + n + n * len(OPTIONS):
        raise ValueError(
            f"a phase row for {n} segments has {3 + n + n * len(OPTIONS)} figures, got "
            f"{len(row)}: every rank must name the same segments"
        )
    args: dict[str, Any] = {"forward_extra": int(row[0]), "floor": int(row[1])}
    if row[2] > 0:
        args["replay_extra"] = {s: max(int(row[3 + i]), 0) for i, s in enumerate(segments)}
    transient: dict[str, dict[str, int]] = {}
    at = 3 + n
    for s in segments:
        figures = {o: int(v) for o, v in zip(OPTIONS, row[at : at + len(OPTIONS)]) if v > MISSING}
        at += len(OPTIONS)
        if figures:
            transient[s] = figures
    if transient:
        args["forward_transient"] = transient
    return args


def largest(own: Mapping[str, Any], agreed: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each figure the larger of ``own`` and ``agreed`` (the ranks' largest as last agreed:
    a figure this rank measured since is not in it yet)."""
    if not agreed:
        return dict(own)
    segments = sorted(
        {*(own.get("replay_extra") or {}), *(agreed.get("replay_extra") or {})}
        | {*(own.get("forward_transient") or {}), *(agreed.get("forward_transient") or {})}
    )
    rows = [phase_row(a, segments) for a in (own, agreed)]
    return phase_args([max(a, b) for a, b in zip(*rows)], segments)
