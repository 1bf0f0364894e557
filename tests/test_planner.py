"""The planner holds the budget, and ``joint`` is as fast as any plan that fits.

The reference for "optimal" is exhaustive search over every combination of options, with the
peak computed straight from the cost model in the design notes, independently of the code
under test.
"""

from __future__ import annotations

import doctest
import itertools
import json
import math
import pickle
import random
from collections.abc import Callable
from types import ModuleType
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_replay.budget as budget_module
import lightning_replay.planner as planner
from lightning_replay.core.engine import joint
from lightning_replay.planner import (
    METHODS,
    CostTable,
    OPTION_NAMES,
    InfeasibleBudget,
    Option,
    Plan,
    SegmentCost,
    costs_from_dict,
    costs_to_dict,
    min_feasible_budget,
    plan,
    predicted_peak,
)

MiB = 2**20
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Reference: the cost model written out plainly, and exhaustive search.


def reference_peak(costs: list[SegmentCost], combo: tuple[str, ...], base: int) -> int:
    total = sum(c.options[o].memory for c, o in zip(costs, combo))

    def rematerialized(c: SegmentCost, o: str) -> int:  # an option's own figure, if it has one
        replay = c.options[o].replay
        return c.activation_bytes if replay is None else replay

    replay_terms = [
        sum(costs[j].options[combo[j]].memory for j in range(s + 1))
        + rematerialized(costs[s], combo[s])
        for s in range(len(costs))
        if combo[s] != "retain"
    ]
    return base + max([total, *replay_terms])


def reference_time(costs: list[SegmentCost], combo: tuple[str, ...]) -> float:
    total = 0.0
    for c, o in zip(costs, combo):  # forward order, as the planner sums
        total += c.options[o].time
    # the capture mode runs once for the whole forward if any chosen option needs it
    if isinstance(costs, CostTable) and any(c.options[o].capture for c, o in zip(costs, combo)):
        total += costs.capture_time
    return total


def all_plans(costs: list[SegmentCost], base: int) -> list[tuple[int, float, tuple[str, ...]]]:
    return [
        (reference_peak(costs, combo, base), reference_time(costs, combo), combo)
        for combo in itertools.product(*[list(c.options) for c in costs])
    ]


def combo_of(costs: list[SegmentCost], p: Plan) -> tuple[str, ...]:
    return tuple(p.choices[c.name] for c in costs)


# ---------------------------------------------------------------------------------------------
# Strategies.

# Quarter-second steps add up exactly in binary floating point, so equal-time plans really tie
# and the lower-peak tie-break can be checked exactly; arbitrary floats exercise rounding.
exact_times = st.integers(0, 12).map(lambda q: q / 4)
any_times = st.floats(0, 10, allow_nan=False, allow_infinity=False)
MAX_COMBINATIONS = 4096  # keeps exhaustive search to a few ms per example


@st.composite
def cost_tables(
    draw: st.DrawFn, times: st.SearchStrategy[float] = exact_times, max_segments: int = 10
) -> list[SegmentCost]:
    n = draw(st.integers(0, max_segments))
    subsets = [
        draw(st.lists(st.sampled_from(OPTION_NAMES), min_size=1, max_size=4, unique=True))
        for _ in range(n)
    ]
    # Bound the exhaustive search by trimming the widest segments, keeping the draw random.
    while math.prod(len(s) for s in subsets) > MAX_COMBINATIONS:
        widest = max(range(n), key=lambda i: (len(subsets[i]), i))
        subsets[widest].pop()
    # Small byte counts make equal prefixes and equal peaks common: the hard cases for ties.
    memory = st.integers(0, 60)
    # Half the tables share a capture mode: any replayed option may need it (always regions;
    # whole or recompute where a segment guards unchanged buffers), paid once per step.
    shared = draw(st.booleans())

    def option(o: str) -> Option:
        if o == "retain":
            return Option(draw(memory), 0.0)
        capture = shared and (o in ("regions", "selective_regions") or draw(st.booleans()))
        # a selective replay re-materializes only what it recomputes: its own figure, often
        replay = draw(st.none() | st.integers(0, 80)) if o.startswith("selective") else None
        return Option(draw(memory), draw(times), capture=capture, replay=replay)

    segments = [
        SegmentCost(
            f"s{i}",
            activation_bytes=draw(st.integers(0, 80)),
            options={o: option(o) for o in subset},
        )
        for i, subset in enumerate(subsets)
    ]
    return CostTable(segments, capture_time=draw(times)) if shared else segments


def budgets_around(draw: st.DrawFn, peaks: list[int], base: int) -> list[int]:
    low, high = min(peaks), max(peaks)
    picks = {low - 1, low, high, max(low - 7, 0), draw(st.integers(max(low - 30, 0), high + 10))}
    picks |= {draw(st.integers(low, high)) for _ in range(3)}
    return sorted(b for b in picks if b >= 0)


HYPOTHESIS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# joint is exactly optimal.


def check_joint_against_exhaustive(
    costs: list[SegmentCost], base: int, budgets: list[int], exact: bool
) -> None:
    plans = all_plans(costs, base)
    lowest_peak = min(peak for peak, _, _ in plans)
    assert min_feasible_budget(costs, base) == lowest_peak
    for budget in budgets:
        fitting = [(t, peak) for peak, t, _ in plans if peak <= budget]
        if not fitting:
            with pytest.raises(InfeasibleBudget) as info:
                plan(costs, budget=budget, base_memory=base)
            assert info.value.min_feasible == lowest_peak
            assert info.value.budget == budget and info.value.method == "joint"
            continue
        p = plan(costs, budget=budget, base_memory=base)
        combo = combo_of(costs, p)
        assert p.peak_memory == reference_peak(costs, combo, base) <= budget
        assert p.extra_time == reference_time(costs, combo)
        best_time = min(t for t, _ in fitting)
        if exact:
            assert p.extra_time == best_time
            # Among plans exactly as fast, the planner takes the lowest peak.
            assert p.peak_memory == min(peak for t, peak in fitting if t == best_time)
        else:
            assert math.isclose(p.extra_time, best_time, rel_tol=1e-9, abs_tol=1e-12)


@HYPOTHESIS
@given(data=st.data())
def test_joint_is_optimal_with_exact_times(data: st.DataObject) -> None:
    costs = data.draw(cost_tables(exact_times))
    base = data.draw(st.integers(0, 100))
    budgets = budgets_around(data.draw, [p for p, _, _ in all_plans(costs, base)], base)
    check_joint_against_exhaustive(costs, base, budgets, exact=True)


@HYPOTHESIS
@given(data=st.data())
def test_joint_is_optimal_with_float_times(data: st.DataObject) -> None:
    costs = data.draw(cost_tables(any_times))
    base = data.draw(st.integers(0, 100))
    budgets = budgets_around(data.draw, [p for p, _, _ in all_plans(costs, base)], base)
    check_joint_against_exhaustive(costs, base, budgets, exact=False)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_joint_stays_optimal_when_the_first_pass_is_narrow(data: st.DataObject) -> None:
    # Small tables never fill the first pass's beam, so the bound-pruned exact pass would go
    # untested on them; a beam of 1 or 2 forces every plan through it.
    costs = data.draw(cost_tables(data.draw(st.sampled_from([exact_times, any_times]))))
    base = data.draw(st.integers(0, 100))
    budgets = budgets_around(data.draw, [p for p, _, _ in all_plans(costs, base)], base)
    for width in (1, 2):
        with mock.patch.object(joint, "_BEAM_WIDTH", width):
            check_joint_against_exhaustive(costs, base, budgets, exact=False)


def pareto_reference(costs: list[SegmentCost], budget: int, base: int) -> float | None:
    """Unpruned (prefix, time) Pareto DP: exact and simple, feasible for ~40 segments."""
    cap = budget - base
    front = {0: 0.0}
    for seg in costs:
        nxt: dict[int, float] = {}
        for prefix, t in front.items():
            for name, opt in seg.options.items():
                grown = prefix + opt.memory
                if grown > cap or (name != "retain" and grown + seg.activation_bytes > cap):
                    continue
                if grown not in nxt or t + opt.time < nxt[grown]:
                    nxt[grown] = t + opt.time
        best = math.inf
        front = {}
        for prefix in sorted(nxt):
            if nxt[prefix] < best:
                front[prefix] = best = nxt[prefix]
    return min(front.values()) if front else None


def realistic_costs(n: int, rng: random.Random) -> list[SegmentCost]:
    costs = []
    for i in range(n):
        act = rng.randint(8 * MiB, 128 * MiB)
        inputs = rng.randint(act // 20, act // 5)
        fwd = rng.uniform(1e-3, 2e-2)
        costs.append(
            SegmentCost(
                f"block{i}",
                act,
                {
                    "retain": Option(act + inputs, 0.0),
                    "recompute": Option(
                        inputs + rng.randint(0, act // 4), fwd * rng.uniform(1.0, 1.3)
                    ),
                    "whole": Option(
                        inputs + rng.randint(act // 10, act // 2), fwd * rng.uniform(1.0, 1.2)
                    ),
                    "regions": Option(
                        inputs + rng.randint(0, act // 8), fwd * rng.uniform(1.1, 1.6)
                    ),
                },
            )
        )
    return costs


@pytest.mark.parametrize("seed", range(8))
def test_joint_matches_unpruned_dp_on_larger_tables(seed: int) -> None:
    # 40 segments are too many for exhaustive search but enough to make the first pass prune.
    rng = random.Random(seed)
    costs = realistic_costs(40, rng)
    base = rng.randint(0, 1024) * MiB
    low = min_feasible_budget(costs, base)
    high = base + sum(c.options["retain"].memory for c in costs)
    for fraction in (0.0, 0.1, 0.3, 0.5, 0.8):
        budget = low + int(fraction * (high - low))
        p = plan(costs, budget=budget, base_memory=base)
        expected = pareto_reference(costs, budget, base)
        assert expected is not None
        assert p.peak_memory <= budget
        assert math.isclose(p.extra_time, expected, rel_tol=1e-9)
    with pytest.raises(InfeasibleBudget):
        plan(costs, budget=low - 1, base_memory=base)


def feasible_pareto_reference(costs: list[SegmentCost], budget: int) -> float | None:
    """:func:`pareto_reference` (base 0) that also drops prefixes the remaining segments cannot
    fit after, even each at its smallest option: exact, and fast enough for 256 segments at
    the tightest budget."""
    rest = [0] * (len(costs) + 1)
    for i in range(len(costs) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(o.memory for o in costs[i].options.values())
    front = {0: 0.0}
    for i, seg in enumerate(costs):
        nxt: dict[int, float] = {}
        for prefix, t in front.items():
            for name, opt in seg.options.items():
                grown = prefix + opt.memory
                if grown + rest[i + 1] > budget or (
                    name != "retain" and grown + seg.activation_bytes > budget
                ):
                    continue
                if grown not in nxt or t + opt.time < nxt[grown]:
                    nxt[grown] = t + opt.time
        best = math.inf
        front = {}
        for prefix in sorted(nxt):
            if nxt[prefix] < best:
                front[prefix] = best = nxt[prefix]
    return min(front.values()) if front else None


def linear_peak(costs: list[SegmentCost], combo: list[str]) -> int:
    """:func:`reference_peak` (base 0) in one pass over the segments."""
    prefix, peak = 0, 0
    for c, o in zip(costs, combo):
        prefix += c.options[o].memory
        if o != "retain":
            peak = max(peak, prefix + c.activation_bytes)
    return max(peak, prefix)


def test_joint_plans_256_segments_within_budget_and_optimally() -> None:
    # How fast it plans is a benchmark claim (benchmarks/planner_bench.py, planner.ms_256),
    # not a test: a wall-clock bound loose enough for a loaded runner guards nothing.
    rng = random.Random(0)
    costs = realistic_costs(256, rng)
    low = min_feasible_budget(costs)
    high = sum(c.options["retain"].memory for c in costs)

    # The tightest budget, where every segment's choice matters: optimal against exact search.
    tight = plan(costs, budget=low)
    assert reference_peak(costs, combo_of(costs, tight), 0) == tight.peak_memory <= low
    assert math.isclose(tight.extra_time, feasible_pareto_reference(costs, low), rel_tol=1e-9)

    # A middle budget (exact search takes minutes here): the plan is what it says it is, no
    # baseline beats it, and no single segment can switch option to save time within budget.
    budget = low + (high - low) // 3
    p = plan(costs, budget=budget)
    combo = list(combo_of(costs, p))
    assert reference_peak(costs, tuple(combo), 0) == linear_peak(costs, combo) == p.peak_memory
    assert p.peak_memory <= budget
    assert math.isclose(reference_time(costs, tuple(combo)), p.extra_time, rel_tol=1e-12)
    for method in METHODS[1:]:
        try:
            other = plan(costs, budget=budget, method=method)
        except InfeasibleBudget:
            continue
        assert p.extra_time <= other.extra_time * (1 + 1e-9), method
    for i, c in enumerate(costs):
        for o in c.options:
            if c.options[o].time < c.options[combo[i]].time:
                moved = combo[:i] + [o] + combo[i + 1 :]
                assert linear_peak(costs, moved) > budget, (c.name, combo[i], o)


def test_joint_takes_the_lowest_peak_when_time_does_not_matter() -> None:
    # Every option is free: the tie-break should give the lowest peak of any plan.
    rng = random.Random(3)
    costs = [
        SegmentCost(
            f"b{i}",
            rng.randint(1, 100),
            {o: Option(rng.randint(0, 100), 0.0) for o in OPTION_NAMES},
        )
        for i in range(30)
    ]
    p = plan(costs, budget=10**9, base_memory=7)
    assert p.extra_time == 0.0
    assert p.peak_memory == min_feasible_budget(costs, 7)


def test_joint_beats_or_matches_every_baseline() -> None:
    rng = random.Random(11)
    for _ in range(20):
        costs = realistic_costs(12, rng)
        low = min_feasible_budget(costs)
        budget = low + int(rng.random() * (sum(c.options["retain"].memory for c in costs) - low))
        best = plan(costs, budget=budget).extra_time
        for method in METHODS[1:]:
            try:
                other = plan(costs, budget=budget, method=method)
            except InfeasibleBudget:
                continue
            assert best <= other.extra_time + 1e-12


# ---------------------------------------------------------------------------------------------
# Baselines hold the budget, and report the right minimum when they cannot.


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_baselines_hold_the_budget_or_report_their_minimum(data: st.DataObject) -> None:
    costs = data.draw(cost_tables(any_times))
    base = data.draw(st.integers(0, 100))
    method = data.draw(st.sampled_from(METHODS))
    budget = data.draw(st.integers(0, 600))
    joint_min = min_feasible_budget(costs, base)
    try:
        p = plan(costs, budget=budget, base_memory=base, method=method)
    except InfeasibleBudget as err:
        assert err.method == method and err.budget == budget
        assert err.min_feasible > budget
        assert err.min_feasible >= joint_min
        assert err.min_feasible == min_feasible_budget(costs, base, method)
        # The minimum is exact: the method meets it, and nothing below it.
        at_min = plan(costs, budget=err.min_feasible, base_memory=base, method=method)
        assert at_min.peak_memory <= err.min_feasible
        with pytest.raises(InfeasibleBudget):
            plan(costs, budget=err.min_feasible - 1, base_memory=base, method=method)
        return
    assert p.method == method and p.budget == budget and p.base_memory == base
    combo = combo_of(costs, p)
    assert p.peak_memory == reference_peak(costs, combo, base) <= budget
    assert p.extra_time == reference_time(costs, combo)
    assert list(p.choices) == [c.name for c in costs]


@given(costs=cost_tables(any_times))
@settings(max_examples=100, deadline=None)
def test_fixed_baselines_choose_what_they_promise(costs: list[SegmentCost]) -> None:
    def lowest(c: SegmentCost, names: list[str]) -> str:
        return min(
            names, key=lambda o: (c.options[o].memory, c.options[o].time, OPTION_NAMES.index(o))
        )

    big = 10**6
    retain = plan(costs, budget=big, method="retain_all").choices
    whole = plan(costs, budget=big, method="whole_all").choices
    regions = plan(costs, budget=big, method="fixed_regions").choices
    for c in costs:
        names = list(c.options)
        assert retain[c.name] == ("retain" if "retain" in names else lowest(c, names))
        expected_whole = (
            "whole"
            if "whole" in names
            else "recompute"
            if "recompute" in names
            else lowest(c, names)
        )
        assert whole[c.name] == expected_whole
        replayed = [o for o in names if o != "retain"]
        assert regions[c.name] == (lowest(c, replayed) if replayed else "retain")


@given(costs=cost_tables(any_times), budget=st.integers(0, 600))
@settings(max_examples=100, deadline=None)
def test_eager_whole_never_uses_regions_where_it_has_a_choice(
    costs: list[SegmentCost], budget: int
) -> None:
    try:
        p = plan(costs, budget=budget, method="eager_whole")
    except InfeasibleBudget:
        return
    for c in costs:
        if any(o in c.options for o in ("retain", "whole", "recompute")):
            assert p.choices[c.name] in ("retain", "whole", "recompute")
        else:  # only options outside the method (regions, selective ones): the lowest memory
            assert p.choices[c.name] == min(
                c.options,
                key=lambda o: (c.options[o].memory, c.options[o].time, OPTION_NAMES.index(o)),
            )


def test_eager_whole_takes_free_savings_first_then_best_ratio() -> None:
    costs = [
        SegmentCost("a", 10, {"retain": Option(100, 0.0), "whole": Option(50, 1.0)}),  # 50 B/s
        SegmentCost("b", 10, {"retain": Option(100, 0.0), "recompute": Option(80, 0.0)}),  # free
        SegmentCost("c", 10, {"retain": Option(100, 0.0), "whole": Option(20, 1.0)}),  # 80 B/s
    ]
    assert plan(costs, budget=300, method="eager_whole").choices == {
        "a": "retain",
        "b": "retain",
        "c": "retain",
    }
    # Peaks along the path: 300 (all retain), 280 (b, replay 100+80+10), 210 (c, replay
    # 100+80+20+10), 160 (a, replay 50+80+20+10).
    assert plan(costs, budget=280, method="eager_whole").choices == {
        "a": "retain",
        "b": "recompute",
        "c": "retain",
    }
    assert plan(costs, budget=210, method="eager_whole").choices == {
        "a": "retain",
        "b": "recompute",
        "c": "whole",
    }
    assert plan(costs, budget=209, method="eager_whole").choices == {
        "a": "whole",
        "b": "recompute",
        "c": "whole",
    }
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=159, method="eager_whole")
    assert info.value.min_feasible == 160


def test_joint_uses_regions_where_eager_whole_cannot_fit() -> None:
    costs = [
        SegmentCost(
            f"b{i}",
            100,
            {"retain": Option(100, 0.0), "whole": Option(40, 1.0), "regions": Option(20, 1.5)},
        )
        for i in range(3)
    ]
    p = plan(costs, budget=160)
    assert p.choices == {"b0": "regions", "b1": "whole", "b2": "retain"}
    assert (p.peak_memory, p.extra_time) == (160, 2.5)
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=160, method="eager_whole")
    assert info.value.min_feasible == 180
    assert "method='joint'" in str(info.value)  # the message points at the method that fits


# ---------------------------------------------------------------------------------------------
# The peak model, by hand.


def two_blocks() -> list[SegmentCost]:
    return [
        SegmentCost(
            "a",
            50,
            {"retain": Option(50, 0.0), "whole": Option(10, 1.0), "regions": Option(5, 2.0)},
        ),
        SegmentCost("b", 80, {"retain": Option(80, 0.0), "recompute": Option(20, 0.5)}),
    ]


@pytest.mark.parametrize(
    ("choices", "expected"),
    [
        ({"a": "retain", "b": "retain"}, 5 + 50 + 80),  # nothing replays: all activations held
        ({"a": "whole", "b": "retain"}, 5 + max(10 + 80, 10 + 50)),  # a replays with b freed
        (
            {"a": "retain", "b": "recompute"},
            5 + max(50 + 20, 50 + 20 + 80),
        ),  # b replays on top of a
        ({"a": "regions", "b": "recompute"}, 5 + max(5 + 20, 5 + 50, 5 + 20 + 80)),
    ],
)
def test_predicted_peak_by_hand(choices: dict[str, str], expected: int) -> None:
    assert predicted_peak(two_blocks(), choices, 5) == expected


def test_predicted_peak_of_nothing_is_the_base() -> None:
    assert predicted_peak([], {}, 123) == 123
    assert plan([], budget=123, base_memory=123).choices == {}
    with pytest.raises(InfeasibleBudget) as info:
        plan([], budget=122, base_memory=123)
    assert info.value.min_feasible == 123


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ({"a": "retain"}, "no option for segment 'b'"),
        ({"a": "retain", "b": "retain", "zz": "retain"}, "'zz'"),
        ({"a": "retain", "b": "whole"}, "segment 'b' has no option 'whole'"),
    ],
)
def test_predicted_peak_rejects_bad_choices(choices: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        predicted_peak(two_blocks(), choices, 0)


def test_plan_is_deterministic_and_in_forward_order() -> None:
    rng = random.Random(5)
    costs = realistic_costs(30, rng)
    shuffled = [
        SegmentCost(c.name, c.activation_bytes, dict(reversed(list(c.options.items()))))
        for c in costs
    ]
    budget = min_feasible_budget(costs) + 500 * MiB
    p, q = plan(costs, budget=budget), plan(shuffled, budget=budget)
    assert p == q and hash(p) == hash(q)
    assert shuffled == costs and len(set(shuffled) | set(costs)) == len(costs)
    assert list(p.choices) == [c.name for c in costs]


# ---------------------------------------------------------------------------------------------
# Errors a user sees.


def test_infeasible_budget_message_says_what_to_do() -> None:
    costs = [SegmentCost("b0", GiB, {"retain": Option(GiB, 0.0), "whole": Option(GiB // 2, 1.0)})]
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=512 * MiB, base_memory=256 * MiB)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.min_feasible == 256 * MiB + GiB
    text = str(err)
    for expected in (
        str(512 * MiB),
        "512.00 MiB",
        str(err.min_feasible),
        "1.25 GiB",
        "'joint'",
        "Raise the budget",
    ):
        assert expected in text
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.budget, clone.min_feasible, clone.method, str(clone)) == (
        err.budget,
        err.min_feasible,
        err.method,
        text,
    )


def test_infeasible_baseline_message_suggests_another_method() -> None:
    costs = two_blocks()  # retain_all reaches 130 bytes, joint 85
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=100, method="retain_all")
    text = str(info.value)
    assert "method='retain_all'" in text and "130 bytes" in text
    assert "Use method='joint', which fits this budget" in text
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=80, method="retain_all")
    text = str(info.value)
    assert (
        "another method" in text and "method='joint' fits budgets down to 85 B (85 bytes)" in text
    )


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: Option(-1, 0.0), ValueError, "memory.*-1"),
        (lambda: Option(1, -0.5), ValueError, "time.*-0.5"),
        (lambda: Option(1, math.nan), ValueError, "time.*nan"),
        (lambda: Option(1, math.inf), ValueError, "time.*inf"),
        (lambda: Option(1.5, 0.0), TypeError, "memory.*1.5"),
        (lambda: Option(True, 0.0), TypeError, "memory.*True"),
        (lambda: Option(1, "fast"), TypeError, "time.*fast"),
        (lambda: SegmentCost("b", 1, {}), ValueError, "segment 'b' has no options"),
        (
            lambda: SegmentCost("b", 1, {"snapshot": Option(1, 0.0)}),
            ValueError,
            "segment 'b'.*unknown option 'snapshot'",
        ),
        (
            lambda: SegmentCost("b", -3, {"retain": Option(1, 0.0)}),
            ValueError,
            "segment 'b'.*activation_bytes.*-3",
        ),
        (lambda: SegmentCost("", 1, {"retain": Option(1, 0.0)}), ValueError, "name"),
        (
            lambda: SegmentCost("b", 1, {"retain": (1, 0.0)}),
            TypeError,
            "segment 'b'.*'retain'.*Option",
        ),
    ],
)
def test_cost_validation(build: Callable[[], object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build()


def test_duplicate_segment_names_are_rejected() -> None:
    seg = SegmentCost("b", 1, {"retain": Option(1, 0.0)})
    for call in (
        lambda: plan([seg, seg], budget=100),
        lambda: predicted_peak([seg, seg], {"b": "retain"}, 0),
        lambda: costs_to_dict([seg, seg]),
        lambda: min_feasible_budget([seg, seg]),
    ):
        with pytest.raises(ValueError, match="duplicate segment name 'b'"):
            call()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"method": "optimal"}, ValueError, "method.*joint.*'optimal'"),
        ({"budget": -1}, ValueError, "budget.*-1"),
        ({"budget": "40GiB"}, TypeError, "parse_budget"),
        ({"budget": 0.5}, TypeError, "parse_budget"),
        ({"base_memory": -5}, ValueError, "base_memory.*-5"),
        ({"budget": 2**70}, ValueError, "units"),
    ],
)
def test_plan_argument_validation(kwargs: dict, error: type[Exception], message: str) -> None:
    args = {"costs": two_blocks(), "budget": 1000, **kwargs}
    with pytest.raises(error, match=message):
        plan(**args)


# ---------------------------------------------------------------------------------------------
# Serialization: a saved cost table reproduces the plan.


@given(costs=cost_tables(any_times), budget=st.integers(0, 600), method=st.sampled_from(METHODS))
@settings(max_examples=100, deadline=None)
def test_costs_and_plans_round_trip_through_json(
    costs: list[SegmentCost], budget: int, method: str
) -> None:
    restored = costs_from_dict(json.loads(json.dumps(costs_to_dict(costs))))
    assert restored == costs
    assert restored.capture_time == (costs.capture_time if isinstance(costs, CostTable) else 0.0)
    try:
        p = plan(costs, budget=budget, method=method)
    except InfeasibleBudget:
        return
    saved = json.loads(json.dumps(p.to_dict()))
    assert Plan.from_dict(saved) == p
    assert (
        plan(
            restored,
            budget=saved["budget"],
            base_memory=saved["base_memory"],
            method=saved["method"],
        )
        == p
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"schema": 2, "segments": []}, "schema 2.*schema 1"),
        ({"segments": []}, "schema None"),
        ({"schema": 1}, "segments"),
        (
            {"schema": 1, "segments": [{"name": "b", "options": {}}]},
            "segment 'b'.*activation_bytes",
        ),
        (
            {
                "schema": 1,
                "segments": [
                    {"name": "b", "activation_bytes": 1, "options": {"retain": {"memory": 1}}}
                ],
            },
            "segment 'b'.*'retain'.*'time'",
        ),
        (
            {
                "schema": 1,
                "segments": [
                    {
                        "name": "b",
                        "activation_bytes": 1,
                        "options": {"retain": {"memory": -1, "time": 0}},
                    }
                ],
            },
            "segment 'b'.*'retain'.*-1",
        ),
        (
            {
                "schema": 1,
                "segments": [
                    {
                        "name": "b",
                        "activation_bytes": 1,
                        "options": {"retain": {"memory": 1, "time": 0}},
                    }
                ]
                * 2,
            },
            "duplicate",
        ),
    ],
)
def test_costs_from_dict_rejects_bad_tables(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        costs_from_dict(data)


def test_plan_from_dict_rejects_bad_plans() -> None:
    good = plan(two_blocks(), budget=1000).to_dict()
    with pytest.raises(ValueError, match="schema 7"):
        Plan.from_dict({**good, "schema": 7})
    with pytest.raises(ValueError, match="missing the field 'choices'"):
        Plan.from_dict({k: v for k, v in good.items() if k != "choices"})
    with pytest.raises(ValueError, match="method"):
        Plan.from_dict({**good, "method": "magic"})


# ---------------------------------------------------------------------------------------------
# The documented examples run.


@pytest.mark.parametrize("module", [planner, budget_module])
def test_docstring_examples_run(module: ModuleType) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------
# Preservation pins: allowed options per segment, honoured by every method.


@st.composite
def pinned_tables(draw: st.DrawFn) -> tuple[list[SegmentCost], dict[str, set[str]]]:
    costs = draw(cost_tables(any_times, max_segments=6))
    allowed = {}
    for seg in costs:
        if draw(st.booleans()):
            allowed[seg.name] = set(
                draw(st.lists(st.sampled_from(list(seg.options)), min_size=1, unique=True))
            )
    return costs, allowed


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_method_honours_the_pins(data: st.DataObject) -> None:
    costs, allowed = data.draw(pinned_tables())
    base = data.draw(st.integers(0, 100))
    method = data.draw(st.sampled_from(METHODS))
    budget = data.draw(st.integers(0, 600))
    # The reference: the same method on a table that only has the allowed options.
    cut = [
        SegmentCost(
            c.name,
            c.activation_bytes,
            {o: v for o, v in c.options.items() if o in allowed.get(c.name, c.options)},
        )
        for c in costs
    ]
    if isinstance(costs, CostTable):
        cut = CostTable(cut, capture_time=costs.capture_time)
    assert min_feasible_budget(costs, base, method, allowed=allowed) == min_feasible_budget(
        cut, base, method
    )
    try:
        p = plan(costs, budget=budget, base_memory=base, method=method, allowed=allowed)
    except InfeasibleBudget as err:
        assert err.min_feasible == min_feasible_budget(cut, base, method) > budget
        with pytest.raises(InfeasibleBudget):
            plan(cut, budget=budget, base_memory=base, method=method)
        return
    for name, options in allowed.items():
        assert p.choices[name] in options
    assert p == plan(cut, budget=budget, base_memory=base, method=method)


def test_joint_with_pins_is_optimal_among_pinned_plans() -> None:
    costs = [
        SegmentCost(
            f"b{i}",
            100,
            {"retain": Option(100, 0.0), "whole": Option(40, 1.0), "regions": Option(20, 1.5)},
        )
        for i in range(3)
    ]
    allowed = {"b0": {"retain"}, "b2": {"retain", "whole"}}
    p = plan(costs, budget=220, allowed=allowed)
    plans = [
        (reference_time(costs, combo), reference_peak(costs, combo, 0), combo)
        for combo in itertools.product(*[sorted(allowed.get(c.name, c.options)) for c in costs])
        if reference_peak(costs, combo, 0) <= 220
    ]
    assert (p.extra_time, p.peak_memory, combo_of(costs, p)) == min(plans)
    assert p.choices == {"b0": "retain", "b1": "regions", "b2": "retain"}
    # Without the pin b0 is the one replayed at this budget.
    assert plan(costs, budget=220).choices["b0"] == "regions"


def test_infeasible_with_pins_names_the_pins_and_says_unpinning_helps() -> None:
    costs = two_blocks()
    free = min_feasible_budget(costs)
    pinned = min_feasible_budget(costs, allowed={"a": {"retain"}, "b": {"retain"}})
    assert pinned > free
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=free, allowed={"a": {"retain"}, "b": {"retain"}})
    err = info.value
    assert err.pins == {"a": ("retain",), "b": ("retain",)}
    assert err.min_feasible == pinned and err.unpinned_min_feasible == free
    text = str(err)
    assert "preservation pins {'a': retain, 'b': retain}" in text
    assert "Without the pins the budget fits" in text and str(pinned) in text
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.pins, clone.unpinned_min_feasible, str(clone)) == (
        err.pins,
        err.unpinned_min_feasible,
        text,
    )
    # A pin that restricts nothing is not named.
    with pytest.raises(InfeasibleBudget) as info:
        plan(costs, budget=free - 1, allowed={"a": set(costs[0].options)})
    assert info.value.pins is None and "pins" not in str(info.value)


@pytest.mark.parametrize(
    ("allowed", "error", "message"),
    [
        ({"nope": {"retain"}}, ValueError, "allowed names segment 'nope'"),
        ({"a": set()}, ValueError, r"allowed\['a'\] must be a non-empty set"),
        (
            {"a": {"keep"}},
            ValueError,
            r"allowed\['a'\] must be a non-empty set of options .* got \['keep'\]",
        ),
        ({"a": "retain"}, TypeError, r"allowed\['a'\] must be a set of option names"),
        (["a"], TypeError, "allowed must map segment names"),
        (
            {"b": {"regions"}},
            ValueError,
            r"segment 'b' is pinned to \['regions'\], but its measured options are",
        ),
    ],
)
def test_bad_pins_are_refused(allowed: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        plan(two_blocks(), budget=10**6, allowed=allowed)


# ---------------------------------------------------------------------------------------------
# Through the engine: a pin survives planning under any budget (issue 11, bug 3).


def test_engine_plans_honour_a_preservation_pin_and_name_it_when_infeasible() -> None:
    import copy

    import torch

    import lightning_replay as lr
    from lightning_replay.demos.hazards import QueueModel
    from lightning_replay.verify import grad_diffs, train_steps

    def x(step: int) -> torch.Tensor:
        return torch.randn(64, 32, generator=torch.Generator().manual_seed(step))

    torch.manual_seed(0)
    model = QueueModel(rows=2048, dim=32, write_rows=32)
    ref = copy.deepcopy(model)
    engine = lr.install(model, "blocks.*", budget="min", preservation={"blocks.0": "retain"})
    steps = 1 + 2 * 3 + 1 + 2  # probe, two calibration phases, the plan, two planned steps
    grads, _ = train_steps(model, x, steps)
    ref_grads, _ = train_steps(ref, x, steps)
    assert grad_diffs(ref_grads, grads) == []
    assert engine.plan is not None and engine.plan.choices["blocks.0"] == "retain"
    assert engine.summary()["blocks.0"]["mode"] == "retain"

    costs, base = engine.costs, engine.base_memory
    # a retain pin is never replayed, not even to calibrate the options it excludes
    assert set(next(c for c in costs if c.name == "blocks.0").options) == {"retain"}
    assert engine.summary()["blocks.0"]["replays"] == 0
    lowest = min_feasible_budget(costs, base)
    with pytest.raises(InfeasibleBudget) as info:
        engine.replan(budget=lowest - 1)
    assert info.value.pins == {"blocks.0": ("retain",)}
    assert "'blocks.0': retain" in str(info.value)
    assert engine.plan.choices["blocks.0"] == "retain"  # the plan in force is kept
