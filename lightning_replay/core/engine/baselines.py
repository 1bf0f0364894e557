"""The baseline planners the joint one is compared with.

``retain_all``, ``whole_all``, ``selective_all``, ``fixed_regions`` (every segment replayed
with its cheapest-memory option) and ``eager_whole`` (greedy over retain and whole, best bytes
saved per second added first). Each yields the assignments it would try, in order, independent
of the budget; the plan is the first that fits, and the minimum feasible budget is the lowest
peak on the path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from lightning_replay.core.engine.peak import (
    _Seg,
    _peak,
)

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


def _baseline_min(
    table: Sequence[_Seg], base: int, method: str, extra: int = 0, floor: int = 0
) -> int:
    return min(_peak(table, picks, base, extra, floor) for picks in _BASELINES[method](table))
