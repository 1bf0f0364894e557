"""Adversary (session 23): derivative checks under a budget take the replayed segments in turn.

The rule (``check_steps.select_checked``, commit e00e263): the segment whose turn it is goes
first; beside the plan in force with as many following segments as fit, else on a step planned
around its check, else passed over (counted in ``checks_skipped``, named once in a warning).
Nothing can be checked: the step's check is skipped (counted, warned once).

Real models only (nothing of the rule is monkeypatched). Every budget is derived from figures
measured in this process (the plan's predicted peak, ``_checked_peak``, ``min_feasible_budget``
and the retain-all peak), so leftovers of other tests shift them alike. Each segment's class at
a budget is read off the engine as the rule reads it: ``B`` its check fits beside the plan,
``S`` only on a step planned around it, ``-`` neither.
"""

from __future__ import annotations

import copy
import hashlib
import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.base.state import unique_bytes
from lightning_replay.planner import min_feasible_budget, plan, predicted_peak

STEPS_TO_PLAN = 1 + 2 * 3 + 1  # probe, two calibration phases (warm-up + 2 steps), the plan
ROWS = 512


# ------------------------------------------------------------------------------ models


class _Block(nn.Module):
    def __init__(self, hidden, dim=32, p=0.0):
        super().__init__()
        self.a, self.b = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(p) if p else nn.Identity()

    def forward(self, x):
        return x + self.b(self.drop(torch.tanh(self.a(x))))


class _Chain(nn.Module):
    """Residual blocks of the given widths, in order (segments ``blocks.i``)."""

    def __init__(self, widths, p=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(h, p=p) for h in widths)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Shared(nn.Module):
    """A shared block called twice per step, between unshared ones."""

    def __init__(self):
        super().__init__()
        self.pre, self.shared, self.mid, self.post = (
            _Block(64),
            _Block(256),
            _Block(128),
            _Block(64),
        )

    def forward(self, x):
        x = self.shared(self.pre(x))
        return self.post(self.shared(self.mid(x)))


class _Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.mlp = _Block(hidden)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.mlp(x))


class _Nested(nn.Module):
    """Segments three levels down (``encoder.layers.i.mlp``) beside a top-level one."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(h) for h in (64, 128, 256, 512, 64))
        self.head = _Block(96)

    def forward(self, x):
        for layer in self.encoder.layers:
            x = layer(x)
        return self.head(x)


def _x(step):
    return torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(step))


# ------------------------------------------------------------------------------ harness


def _digest(model):
    """The parameters' gradients, bit for bit (a hash over the gradients' own bytes: nothing
    is allocated beside the step, which the engine's real-peak measurement would count)."""
    h = hashlib.blake2b()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(b"-" if p.grad is None else p.grad.detach().numpy().data)
    return h.hexdigest()


def _reference(model, seeds):
    """Plain PyTorch's gradients on a copy of ``model``, per step seed, before anything is
    installed (no optimizer: the parameters stay as they are)."""
    ref, out = copy.deepcopy(model), {}
    for s in seeds:
        torch.manual_seed(10_000 + s)
        ref(_x(s)).pow(2).mean().backward()
        out[s] = _digest(ref)
        ref.zero_grad(set_to_none=True)
    return out


def _step(m, ref, e, s, check=None):
    """One step that begins and ends without gradients; its gradients compared with plain
    PyTorch's on the same input and seed (``ref``: seed -> digest)."""
    if check is not None:
        e.request_check(**check)
    torch.manual_seed(10_000 + s)
    m(_x(s)).pow(2).mean().backward()
    stats = e.window_stats()
    stats["step_plan"] = e._step_choices is not None
    stats["modes"] = {n: v["mode"] for n, v in e.summary().items()}
    if ref is not None and s in ref:
        stats["grads_equal"] = _digest(m) == ref[s]
    m.zero_grad(set_to_none=True)
    return stats


# every step's seed, in the order the steps run (a model whose buffers the forward writes
# needs its copy to have run the same steps before): the measuring steps, then the rotations
SEEDS = [*range(STEPS_TO_PLAN), *range(50, 56), *range(100, 140), *range(300, 310)]
SEEDS += range(500, 512)


def _measured(model, names):
    """The model installed with ``names`` and measured: a plan at the lowest budget, its first
    steps measured (the real base is known). Returns (model, reference digests, engine)."""
    ref = _reference(model, SEEDS)
    e = lr.install(model, names, budget=10**12)
    for s in range(STEPS_TO_PLAN):
        _step(model, None, e, s)
    e.replan(budget=min_feasible_budget(e.costs, e.real_base_memory, **e.phase_peak_args))
    for s in range(6):
        _step(model, None, e, 50 + s)
    assert all(p.grad is None for p in model.parameters())
    return model, ref, e


def _grads(e):
    return {
        n: 2 * unique_bytes([p for p in rt.module.parameters() if p.requires_grad])
        for n, rt in e.runtimes.items()
    }


def _classes(e):
    """Each replayed segment's class at the budget in force, as the rule judges it."""
    by_name = {c.name: c for c in e.costs}
    grads = _grads(e)
    out = {}
    for n in e.segments:
        if e.plan.choices.get(n, "retain") == "retain":
            continue
        if e._checked_peak(by_name, [n]) <= e.budget:
            out[n] = "B"
        elif e._check_step_plan(by_name, n, grads) is not None:
            out[n] = "S"
        else:
            out[n] = "-"
    return out


def _plans(e):
    """The distinct plans between the lowest budget and retain-all's peak (measured figures),
    each with the budget it was made for, the lowest first."""
    a, base = e.phase_peak_args, e.real_base_memory
    lo = min_feasible_budget(e.costs, base, **a)
    hi = predicted_peak(e.costs, {c.name: "retain" for c in e.costs}, base, **a)
    seen, out = set(), []
    for k in range(41):
        b = lo + (hi - lo) * k // 40
        key = tuple(sorted(plan(e.costs, b, base, **a).choices.items()))
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def _classes_at(e, budget):
    b = e.budget
    try:
        e.budget = budget
        return _classes(e)
    finally:
        e.budget = b


def _edge(e, cls, inside, outside):
    """The budget nearest ``outside`` (where the classes are not ``cls``) at which they still
    are (at ``inside`` they are): the classes only change one way as the budget grows."""
    while abs(outside - inside) > 1:
        mid = (inside + outside) // 2
        if _classes_at(e, mid) == cls:
            inside = mid
        else:
            outside = mid
    return inside


def _centred(e, cls, b, top):
    """Set the budget to the middle of the budgets around ``b`` that give the classes ``cls``
    (up to twice ``top`` above): the real base is re-measured on every step and moves by a few
    bytes, and a class found on its boundary flips with it (seen in CI: a segment classed ``B``
    at a budget equal to its check's peak was planned around on the next step)."""
    lo = _edge(e, cls, b, e.plan.peak_memory - 1)  # never below the plan's own peak
    hi = 2 * top if _classes_at(e, 2 * top) == cls else _edge(e, cls, b, 2 * top)
    e.budget = (lo + hi) // 2
    assert _classes(e) == cls


def _find(e, want):
    """Re-plan and set ``e.budget`` (the plan keeps its choices) to the first measured budget
    whose classes ``want`` accepts (budgets from the plan's peak to its largest single check's
    peak, in twentieths), moved to the middle of the budgets giving those classes. Returns the
    classes, or None (the engine is re-planned at the budget it had, or at the lowest feasible
    one where that is higher)."""
    start = e.plan.choices, e.budget
    for b in _plans(e):
        e.replan(budget=b)
        replayed = [n for n, o in e.plan.choices.items() if o != "retain"]
        if not replayed:
            continue
        by_name = {c.name: c for c in e.costs}
        low = e.plan.peak_memory
        top = max(e._checked_peak(by_name, [n]) for n in replayed)
        for j in range(21):
            e.budget = low + (top - low) * j // 20
            cls = _classes(e)
            if want(cls):
                _centred(e, cls, e.budget, top)
                return cls
    # the base is re-measured on every step, so the budget found in _measured may now be a few
    # bytes short of the lowest plan (seen in CI: 4 bytes)
    lowest = min_feasible_budget(e.costs, e.real_base_memory, **e.phase_peak_args)
    e.replan(budget=max(start[1], lowest))
    return None


def _rotate(m, ref, e, rounds=2, start=100):
    """``rounds`` rounds of checked steps (a round: one step per replayed segment). After each
    step planned around a check, one plain step (the plan in force must be back). Returns the
    checked steps' stats, the plain steps' stats and the warnings."""
    replayed = [n for n, o in e.plan.choices.items() if o != "retain"]
    checked, plain = [], []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        s = start
        for _ in range(rounds * max(1, len(replayed))):
            checked.append(_step(m, ref, e, s, check={}))
            s += 1
            if checked[-1]["step_plan"]:
                plain.append(_step(m, ref, e, s))
                s += 1
    return checked, plain, [str(w.message) for w in got if w.category is RuntimeWarning]


def _grad_records(e):
    """Step -> the segments a derivative check recorded an outcome for in that step."""
    out: dict[int, set] = {}
    for r in e.records.read():
        if r.check == "grad":
            out.setdefault(r.step, set()).add(r.segment)
    return out


class _Broken(AssertionError):
    """A promise measured broken (the xfail tests expect exactly this, not a failed
    precondition)."""


def _named(messages, n):
    return sum(f"segment {n!r} skipped" in w for w in messages)


def _assert_rotation(m, ref, e, cls, rounds=2):
    """The promises of one rotation, measured on the steps."""
    version, choices, budget = e.plan_version, dict(e.plan.choices), e.budget
    modes = {n: v["mode"] for n, v in e.summary().items()}
    skipped = e.checks_skipped
    star = e._checks_named[0] == e.plan_version and "*" in e._checks_named[1]
    checked, plain, msgs = _rotate(m, ref, e, rounds)
    replayed = set(cls)
    retained = set(e.segments) - replayed
    info = (cls, [s["checked"] for s in checked], msgs, budget)
    assert e.plan_version == version, info  # the plan stayed
    assert all(s["grads_equal"] for s in checked + plain), info
    for s in checked:
        assert s["peak_bytes"] <= budget, (s["peak_bytes"], budget, s["checked"], info)
        assert not set(s["checked"]) & retained, info  # a retained segment is never checked
        if s["step_plan"]:
            assert len(s["checked"]) == 1 and cls[s["checked"][0]] == "S", info
    seen = set().union(*(s["checked"] for s in checked))
    for n in retained:
        assert _named(msgs, n) == 0, info  # nor named
    none_fit = all(c == "-" for c in cls.values())
    for n, c in cls.items():
        if c == "-":  # named once (the whole step is named instead where none fits)
            assert n not in seen and _named(msgs, n) == (0 if none_fit else 1), (n, info)
        else:
            assert n in seen and _named(msgs, n) == 0, (n, info)  # checked, not named
    whole = sum("derivative check skipped at step" in w for w in msgs)
    assert whole == (1 if none_fit and not star else 0), info  # once, not every step
    if none_fit:
        assert e.checks_skipped - skipped == len(checked), info
    elif "-" in cls.values():
        assert e.checks_skipped > skipped, info
    else:
        assert e.checks_skipped == skipped, info
    for s in plain:  # the step after a step planned around a check runs the plan in force
        assert s["modes"] == modes, (s["modes"], modes)
    assert {n: e.runtimes[n].planned_option for n in choices} == choices
    outcomes = {(r.check, r.outcome) for r in e.records.read() if r.check in ("grad", "bytes")}
    assert outcomes <= {("grad", "match"), ("bytes", "match")}, outcomes
    grad_records = _grad_records(e)
    for s in checked:  # what a step lists as checked was checked: a gradient record each
        assert set(s["checked"]) <= grad_records.get(s["step"], set()), (s, grad_records)
    return checked, msgs


# ------------------------------------------------------------------------------ scenarios


ORDERS = {
    "big_first": (1024, 64, 128, 64, 256),
    "big_middle": (64, 128, 1024, 64, 256),
    "big_last": (64, 128, 256, 64, 1024),
    "rising": (64, 128, 256, 512, 64),
}


@pytest.mark.parametrize("order", ["big_first", "big_middle", "big_last"])
def test_unequal_segments_checked_or_named_within_two_rounds(order, collector_off):
    """Segments of very unequal size, the big one at either end or in the middle: at the first
    measured budget where the replayed segments' classes differ (else where one is checked),
    every replayed segment is checked or named within two rounds, under one plan, within the
    budget, with plain PyTorch's gradients."""
    torch.manual_seed(0)
    model = _Chain(ORDERS[order])
    m, ref, e = _measured(model, [f"blocks.{i}" for i in range(len(ORDERS[order]))])
    cls = _find(e, lambda c: len(set(c.values())) > 1) or _find(e, lambda c: "B" in c.values())
    if cls is None:  # the plans retain everything: nothing is checked, nothing named
        checked, _, msgs = _rotate(m, ref, e, rounds=1)
        assert all(s["checked"] == [] and s["grads_equal"] for s in checked), checked
        assert not [w for w in msgs if "skipped" in w]
        return
    _assert_rotation(m, ref, e, cls)


@pytest.mark.parametrize("mix", ["BS", "S-", "B-"])
def test_each_mix_of_classes_in_one_plan(mix, collector_off):
    """A plan whose replayed segments fall in exactly the classes ``mix`` (a rising-width
    chain: the search finds each mix in it). The step planned around a check holds the
    budget, and the plan is back the step after. Where none is passed over, every replayed
    segment is checked within a single round."""
    torch.manual_seed(1)
    m, ref, e = _measured(_Chain(ORDERS["rising"]), [f"blocks.{i}" for i in range(5)])
    cls = _find(e, lambda c: set(c.values()) == set(mix))
    assert cls is not None, f"no measured budget gives the mix {mix}"
    checked, msgs = _assert_rotation(m, ref, e, cls)
    if "S" in mix:
        assert any(s["step_plan"] for s in checked)
    if "-" not in mix:
        first = set().union(*(s["checked"] for s in checked[: len(cls)]))
        assert first == set(cls), (first, cls)


def test_a_shared_block_called_twice_per_step(collector_off):
    """A segment called twice per step (one module, two graphs): its check keeps both. At a
    budget where its check fits (beside the plan or on a step's own plan) and another
    segment's class differs, the rotation holds the budget and matches plain PyTorch."""
    torch.manual_seed(3)
    m, ref, e = _measured(_Shared(), ["pre", "shared", "mid", "post"])
    cls = _find(e, lambda c: c.get("shared") in ("B", "S") and len(set(c.values())) > 1)
    assert cls is not None, "no measured budget checks the shared block beside another class"
    checked, _ = _assert_rotation(m, ref, e, cls)
    assert any("shared" in s["checked"] for s in checked)


def test_stateful_segments_regions_and_whole_with_every_class(collector_off):
    """Blocks that read a buffer the step then overwrites (SparseWrite: the plan gives them
    ``regions`` or ``whole``) of unequal widths: a plan whose replayed segments fall in all
    three classes; a step planned around a check changes their options for one step."""
    from lightning_replay.apps.sparse_write import SparseWriteBlock, SparseWriteModel

    torch.manual_seed(9)
    model = SparseWriteModel(blocks=4, dim=32, hidden=64, buffer_rows=512, write_rows=4)
    model.blocks = nn.ModuleList(SparseWriteBlock(32, h, 512) for h in (64, 512, 128, 256))
    m, ref, e = _measured(model, model.segments)
    cls = _find(e, lambda c: set(c.values()) == {"B", "S", "-"})
    assert cls is not None, "no measured budget gives all three classes"
    checked, _ = _assert_rotation(m, ref, e, cls)
    assert any(s["step_plan"] for s in checked)


def test_nested_segment_names(collector_off):
    """Segments named three levels down, beside a top-level one."""
    torch.manual_seed(4)
    names = [f"encoder.layers.{i}.mlp" for i in range(5)] + ["head"]
    m, ref, e = _measured(_Nested(), names)
    cls = _find(e, lambda c: len(set(c.values())) > 1) or _find(e, lambda c: "B" in c.values())
    assert cls is not None
    _assert_rotation(m, ref, e, cls)


def test_dropout_segments_on_step_plans_match_plain_pytorch(collector_off):
    """Random segments (dropout): a step planned around a check replays them under other
    options than the plan's; the gradients are still plain PyTorch's, bit for bit."""
    torch.manual_seed(5)
    m, ref, e = _measured(_Chain(ORDERS["rising"], p=0.1), [f"blocks.{i}" for i in range(5)])
    cls = _find(e, lambda c: "S" in c.values())
    assert cls is not None
    checked, _ = _assert_rotation(m, ref, e, cls)
    assert any(s["step_plan"] for s in checked)


def test_nothing_fits_then_named_segments_are_checked_exactly(collector_off):
    """Every replayed segment's check fits no plan: each checked step is skipped and counted,
    one warning over two rounds, no segment named (the whole step is). Then
    ``request_check(segments=[...])`` checks exactly the named replayed ones (a retained one has
    no replay to compare), at
    that budget and at one where everything fits: nothing skipped, nothing warned."""
    torch.manual_seed(6)
    m, ref, e = _measured(_Chain(ORDERS["rising"]), [f"blocks.{i}" for i in range(5)])
    cls = _find(e, lambda c: set(c.values()) == {"-"})
    assert cls is not None
    checked, msgs = _assert_rotation(m, ref, e, cls)
    assert all(s["checked"] == [] for s in checked)
    assert sum("derivative check skipped at step" in w for w in msgs) == 1
    assert not any("of segment '" in w for w in msgs), msgs

    skipped, s = e.checks_skipped, 500
    replayed = sorted(cls)
    retained = sorted(set(e.segments) - set(cls))
    asks = [[replayed[0]], replayed, retained[:1], [replayed[-1], retained[-1]], []]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for budget in (e.budget, 10**12):
            e.budget = budget
            for names in asks:
                stats = _step(m, ref, e, s, check={"segments": names})
                s += 1
                # (a retained segment has no replay to compare: it is not listed as checked;
                # before, window_stats listed it)
                want = sorted(n for n in names if n in cls)
                assert stats["checked"] == want, (names, stats["checked"])
                assert stats["grads_equal"]
    assert e.checks_skipped == skipped
    assert not [str(w.message) for w in got if "skipped" in str(w.message)]


def test_no_budget_checks_every_segment_every_checked_step():
    torch.manual_seed(7)
    model = _Chain(ORDERS["big_middle"])
    ref = _reference(model, range(14))
    names = [f"blocks.{i}" for i in range(5)]
    e = lr.install(model, names)
    for s in range(3):
        _step(model, ref, e, s)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for s in range(4):
            stats = _step(model, ref, e, 10 + s, check={})
            assert stats["checked"] == sorted(names) and stats["grads_equal"]
    assert e.checks_skipped == 0
    assert not [str(w.message) for w in got if "skipped" in str(w.message)]


def test_checks_at_budgets_exactly_their_predicted_peaks_hold_real_memory(collector_off):
    """The budget set to exactly one check's predicted peak beside the plan, then to all of
    them together: each checked step's accounted peak is within it, and so is the whole
    process's real peak (profiler referee, on the steps the engine does not profile itself);
    at the second, every replayed segment is checked in one step."""
    from tests.helpers.torch_memory import whole_step_peak

    torch.manual_seed(10)
    m, ref, e = _measured(_Chain(ORDERS["rising"]), [f"blocks.{i}" for i in range(5)])
    replayed = [n for n, o in e.plan.choices.items() if o != "retain"]
    assert len(replayed) >= 2, e.plan.choices
    by_name = {c.name: c for c in e.costs}
    budgets = [e._checked_peak(by_name, [n]) for n in replayed]
    budgets.append(e._checked_peak(by_name, replayed))
    version, s, refereed = e.plan_version, 300, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for budget in budgets:
            e.budget = budget
            got = {}
            if e._truth is None:  # (the engine's own profiler is not running: referee)
                real = whole_step_peak(lambda: got.update(_step(m, ref, e, s, check={})))
                refereed.append((real, budget))
            else:
                got = _step(m, ref, e, s, check={})
            s += 1
            assert got["checked"] and got["grads_equal"], got
            assert got["peak_bytes"] <= budget, (got["peak_bytes"], budget)
            if got["step_plan"]:
                _step(m, ref, e, s)
                s += 1
    assert got["checked"] == sorted(replayed)
    assert refereed and all(real <= budget for real, budget in refereed), refereed
    assert e.plan_version == version


class _Conditional(_Chain):
    """A chain one of whose blocks the step may leave out (``skip``): an auxiliary branch,
    alternating tasks."""

    skip = None

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if f"blocks.{i}" != self.skip:
                x = b(x)
        return x


# (found against e00e263: the cursor moved past a segment that did not run; 6 checked steps
# listed blocks.2 in window_stats()['checked'] 3 times, recorded 0 derivative checks of it and
# named it in no warning. check_steps.missed_turn gives it the next turn again.)
def test_a_segment_left_out_on_its_turns_is_still_checked_or_named(collector_off):
    torch.manual_seed(11)
    names = [f"blocks.{i}" for i in range(5)]
    m, _, e = _measured(_Conditional(ORDERS["rising"]), names)
    cls = _find(e, lambda c: len(c) >= 3 and set(c.values()) == {"B"})
    assert cls is not None
    by_name = {c.name: c for c in e.costs}
    e.budget = max(e._checked_peak(by_name, [n]) for n in cls)  # any one fits, not all
    version = e.plan_version
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        first = [_step(m, None, e, 100 + s, check={})["checked"] for s in range(2)]
        # the precondition: two steps check every replayed segment, each once
        assert not set(first[0]) & set(first[1]) and set(first[0]) | set(first[1]) == set(cls)
        left_out = first[1][-1]  # left out of every other step from now on: its turns
        seen = []
        for s in range(2 * len(cls)):
            m.skip = left_out if s % 2 else None
            seen.append(_step(m, None, e, 102 + s, check={}))
        m.skip = None
    assert e.plan_version == version
    records = _grad_records(e)
    really = {n for st in seen for n in st["checked"] if n in records.get(st["step"], set())}
    named = any(f"segment {left_out!r} skipped" in str(w.message) for w in got)
    listed = sum(left_out in st["checked"] for st in seen)
    if left_out not in really and not named:
        raise _Broken(
            f"{left_out} listed checked {listed}/{len(seen)} steps, derivative-checked 0, "
            f"named in no warning, checks_skipped {e.checks_skipped}; checked: "
            f"{[st['checked'] for st in seen]}"
        )


# (found against e00e263: state_dict() after a step planned around a check saved that step's
# options as planned_option, and the resumed engine ran blocks.0 'recompute' on 3 of 3 steps
# while its plan said 'retain'. The state saves the plan's options.)
def test_a_checkpoint_after_a_step_planned_around_a_check_resumes_the_plan(collector_off):
    torch.manual_seed(12)
    names = [f"blocks.{i}" for i in range(5)]
    model = _Chain(ORDERS["rising"])
    fresh = copy.deepcopy(model)
    m, ref, e = _measured(model, names)
    cls = _find(e, lambda c: "S" in c.values())
    assert cls is not None
    plan_modes = {n: v["mode"] for n, v in e.summary().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(2 * len(cls)):
            if _step(m, ref, e, 100 + s, check={})["step_plan"]:
                break
        assert e._step_choices is not None and e._step_choices != e.plan.choices
        state = e.state_dict()  # as a checkpoint at the end of that step saves it
        fresh.load_state_dict(m.state_dict())
        e2 = lr.install(fresh, names, budget=10**12)
        e2.load_state_dict(state)
        assert e2.plan.choices == e.plan.choices
        modes = [_step(fresh, None, e2, 600 + s)["modes"] for s in range(3)]
    saved = {n: d["planned_option"] for n, d in state["segments"].items()}
    if modes[-1] != plan_modes or saved != e.plan.choices:
        raise _Broken(f"resumed modes {modes} vs the plan's {plan_modes}; saved {saved}")
