"""The joint planner: the fastest plan over every option of every segment, under a budget.

A dynamic program over the segments in forward order that keeps the Pareto front of (memory
held by the prefix, time): every budget constraint is on a prefix, so it is exact. Two exact
prunings keep the front small: the largest prefix from which some completion is feasible, and a
lower bound on the time still to come (:class:`_SuffixBound`) against a plan found by a cheap
beam-limited first pass. ``tests/test_planner.py`` checks it against exhaustive search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_replay.core.engine.peak import (
    _Seg,
    _extra_time,
    _peak,
    _without_capture,
)

# Width of the cheap first pass that finds a good feasible plan; its time bounds the exact pass.
_BEAM_WIDTH = 64


# ----------------------------------------------------------------------------------------------
# Joint: exact.
#
# Write P_s for the memory held by segments 0..s (the prefix). Every constraint is on a prefix:
# P_s + A(s) <= C for a replayed s, P_s + F(s) <= C for every s (its forward's transient) and
# P_last <= C, with C = budget - base. Prefixes only grow,
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
            min(after, cap - seg.acts[k] if seg.replay[k] else after, cap - seg.fwd[k]) - seg.mem[k]
            for k in range(len(seg.mem))
        )
    return thresholds


def _joint_min_cap(table: Sequence[_Seg]) -> int:
    """Smallest ``budget - base`` the joint planner can meet: the lowest peak of any plan."""
    # Feasibility is monotone in the capacity and F[0] >= 0 decides it exactly, so a binary
    # search over integers finds the exact minimum in ~log2(bytes) cheap passes.
    lo = 0
    hi = sum(max(seg.mem) for seg in table) + max(
        (max(max(seg.acts), max(seg.fwd)) for seg in table), default=0
    )
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
            if seg.fwd[k]:
                ok &= grown + seg.fwd[k] <= cap
            parent = np.flatnonzero(ok)
            if parent.size == 0:
                continue
            grown = grown[parent]
            new_peak = (
                np.maximum(peak[parent], grown + seg.acts[k]) if seg.replay[k] else peak[parent]
            )
            if seg.fwd[k]:
                new_peak = np.maximum(new_peak, grown + seg.fwd[k])
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
