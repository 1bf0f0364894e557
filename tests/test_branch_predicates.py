"""A number that gates a branch: the outcome of its comparison is a precondition.

A step counter or an annealed value changes every step, so the guard treats it as continuous:
the replay puts the forward's value back, and the value itself never re-probes. But when the
forward compares it (``if step >= warmup``, ``if temp < 0.7``), the branch it opens may read
state the contract never learned; here the branch reads the root's ``bank``, which the step
writes in place after the blocks, so a missed crossing replays the bank's new bytes. The probe
traces the numbers it reads from module attributes as numbers whose comparisons are logged
(``outside_reads.comparisons``); the guard re-probes when one of those comparisons has an outcome no
probe saw (``Guard.add_predicates``).

Every case trains under ``lr.install`` and in plain PyTorch and asserts bit-identical gradients
and state (``assert_exact``), with the version tags on and off (``tokens``).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lightning_replay.core.mechanisms import outside_reads
from tests.test_adversary_outside import Reader, Root, _run


def _guard_records(records) -> list:
    return [r for r in records if r.check == "guard"]


class _Counting(Root):
    """A root whose ``count`` goes 0, 1, 2, ... (one per step, after the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.warm = 0
        self.phase = 0
        self.temp = 1.0

    def after(self, h):
        super().after(h)
        self.count += 1
        self.phase = min(self.count, 2)
        self.temp *= 0.9


def _case(flag):
    class CaseReader(Reader):
        def flag(self, r):
            return flag(r)

    class CaseRoot(_Counting):
        reader = CaseReader

    return CaseRoot


CASES = {
    # the comparison, and what turns it (None: the step's own after())
    "reflected comparison (3 <= count)": (lambda r: 3 <= r.count, None),
    "int against a float (count > 2.5)": (lambda r: r.count > 2.5, None),
    "float against an int (temp < 1)": (lambda r: r.temp < 1, None),
    "equality of a phase (phase == 2)": (lambda r: r.phase == 2, None),
    "inequality (count != 0)": (lambda r: r.count != 0 and r.count != 1, None),
    "truthiness of an int set by the loop": (lambda r: bool(r.warm), "warm"),
    "a chained comparison (2 < count < 9)": (lambda r: 2 < r.count < 9, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_number_gating_a_branch_is_re_probed_when_it_crosses(tokens, case):
    flag, attr = CASES[case]
    turn_on = (lambda m: setattr(m, attr, 1)) if attr else (lambda m: None)
    _, records = _run(_case(flag), turn_on, steps=6)
    assert _guard_records(records), "the crossing was exact but not by a re-probe"


def test_a_comparison_whose_outcome_never_changes_costs_no_probe(tokens):
    """``temp > 0`` while temp anneals: every forward's outcome was seen; no re-probe, and the
    blocks replay from the first steady step."""
    summary, records = _run(_case(lambda r: r.temp > 0.0), lambda m: None, steps=6)
    assert not _guard_records(records)
    assert all(s["replays"] >= 4 for s in summary.values()), summary


def test_a_branch_that_toggles_is_probed_once_per_outcome(tokens):
    """``count % 2``-style toggling through a comparison of the number itself: after both
    outcomes were probed, none re-probes again."""

    class ToggleRoot(_Counting):
        class reader(Reader):  # noqa: N801
            def flag(self, r):
                return r.phase != 1  # 0 (step 0), then 1, then 2 from step 2 on

    _, records = _run(ToggleRoot, lambda m: None, steps=6)
    steps = sorted({r.step for r in _guard_records(records)})
    assert len(steps) <= 2, steps


def test_a_number_compared_after_arithmetic(tokens):
    """``temp * 2.0 < 1.5``: arithmetic on a traced number gives a traced number that logs
    the steps; the guard applies them to the number as it is at each forward."""
    _, records = _run(_case(lambda r: r.temp * 2.0 < 1.5), lambda m: None, steps=6)
    assert _guard_records(records)


def test_a_counter_the_forward_bumps_before_comparing(tokens):
    """``self.calls += 1`` in the forward, then ``self.calls > 3``: the guard, which runs
    before the forward, compares the number with the forward's step added too."""

    class SelfCounting(Reader):
        def __init__(self, index: int) -> None:
            super().__init__(index)
            self.calls = 0

        def flag(self, r):
            self.calls += 1
            return self.calls > 3

    class SelfRoot(Root):
        reader = SelfCounting

    _, records = _run(SelfRoot, lambda m: None, steps=6)
    assert _guard_records(records)


def test_an_annealed_value_the_forward_scales_before_comparing(tokens):
    """``self.temp *= 0.9`` in the forward, then ``self.temp < 0.7``: the change is a factor;
    the guard compares the number scaled by it."""

    class SelfAnnealing(Reader):
        def __init__(self, index: int) -> None:
            super().__init__(index)
            self.temp = 1.0

        def flag(self, r):
            self.temp *= 0.9
            return self.temp < 0.6  # 0.9, 0.81, 0.729, 0.656, 0.59 (forward 5 crosses)

    class SelfRoot(Root):
        reader = SelfAnnealing

    _, records = _run(SelfRoot, lambda m: None, steps=7)
    assert _guard_records(records)


def test_two_moving_numbers_compared_with_each_other(tokens):
    """``count >= limit``, both moving every step: the outcome flips while neither number's
    comparison with the other's value at the probe does (3 >= 5 and 2 <= 0 stay False); the
    guard compares the two as they both are at each forward."""

    class TwoReader(Reader):
        def flag(self, r):
            return r.count >= r.limit  # 0 >= 5, 1 >= 4, 2 >= 3, 3 >= 2 (crosses at step 3)

    class TwoRoot(Root):
        reader = TwoReader

        def __init__(self) -> None:
            super().__init__()
            self.count, self.limit = 0, 5

        def after(self, h):
            super().after(h)
            self.count += 1
            self.limit -= 1

    _, records = _run(TwoRoot, lambda m: None, steps=6)
    assert _guard_records(records)


def test_traced_numbers_are_plain_numbers_outside_the_probe():
    """What the probe's traced read returns: equal, hashed, pickled and copied as the plain
    number; its arithmetic gives plain numbers; it logs only inside ``comparisons()``."""
    d = {"n": 3}
    with outside_reads.comparisons() as log:
        n = outside_reads._tracked(3, d, "n")
        x = outside_reads._tracked(0.5, d, "x")
        assert (n >= 3, 2 < n, n == 3.0, x < 1, bool(n)) == (True, True, True, True, True)
    assert type(n + 1) is int and type(x * 2) is float  # out of the context: plain numbers
    assert [(op, other, res) for _, op, other, res, _, _ in log] == [
        ("ge", 3, True),
        ("gt", 2, True),  # reflected: 2 < n is n > 2
        ("eq", 3.0, True),
        ("lt", 1, True),
        ("ne", 0, True),
    ]
    assert n >= 3 and len(log) == 5  # out of the context: nothing logged
    assert hash(n) == hash(3) and {n: 1}[3] == 1
    assert type(pickle.loads(pickle.dumps(n))) is int and type(copy.deepcopy(x)) is float
    assert outside_reads._tracked(3, d, "n") == 3 and type(outside_reads._tracked(3, d, "n")) is int
    assert type(outside_reads._tracked(True, d, "b")) is bool
    with outside_reads.comparisons() as log:  # arithmetic inside: traced, with its steps
        y = 2 * outside_reads._tracked(3, d, "n") + 1
        assert isinstance(y, int) and y == 7 and y > 6
    steps = (("mul", 2, True), ("add", 1, False))
    assert [entry[0] for entry in log] == [(d, "n", steps), (d, "n", steps)]
    assert outside_reads.apply_expr(5, steps) == 11
    t = torch.zeros(4)
    with outside_reads.comparisons():
        k, p = outside_reads._tracked(2, d, "k"), outside_reads._tracked(0.25, d, "p")
        assert t[:k].shape == (2,) and torch.full((k,), p).sum().item() == 0.5


class _Config:
    def __init__(self) -> None:
        self.step = 0


def test_a_number_in_a_config_the_block_holds_gating_a_branch(tokens):
    """The number read from a holder object the block holds (a config, as HF blocks hold
    theirs), which the loop advances: traced by ``outside_reads.HolderReads``, which returns it as a
    number that logs its comparisons too."""

    class ConfigReader(Reader):
        def __init__(self, index: int) -> None:
            super().__init__(index)
            self.cfg = _Config()

        def flag(self, r):
            return self.cfg.step >= 3

    class ConfigRoot(Root):
        reader = ConfigReader

        def after(self, h):
            super().after(h)
            for b in self.blocks:
                b.cfg.step += 1

    _, records = _run(ConfigRoot, lambda m: None, steps=6)
    assert _guard_records(records)


def test_a_number_in_a_config_the_root_holds_gating_a_branch(tokens):
    class ConfigReader(Reader):
        def flag(self, r):
            return r.cfg.step >= 3

    class ConfigRoot(Root):
        reader = ConfigReader

        def __init__(self) -> None:
            super().__init__()
            self.cfg = _Config()

        def after(self, h):
            super().after(h)
            self.cfg.step += 1

    _, records = _run(ConfigRoot, lambda m: None, steps=6)
    assert _guard_records(records)
