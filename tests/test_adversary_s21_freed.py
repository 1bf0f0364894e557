"""Adversarial tests of forgetting freed memory (``rebase_held`` / ``replan_smaller_base``,
real_peak.py, session 21).

The change lowers every measured figure when two measured steps in a row, at the largest
input measured, begin holding less beside the model than every figure includes
(``_held_ref``). Each scenario below runs the same loop twice: with the change, and with
``real_peak.rebase_held`` patched to return ``(0, 0)`` (the behaviour before it). The referee
is the one of tests/test_freed_memory.py: every measured step's real peak
(``engine.last_real_peak``, matched to the step by the engine's step label) against the
prediction of the plan in force (``plan.peak_memory``) and, where one is given, the byte
budget, within :data:`SLACK`.

To keep the file short the measurement schedule is compressed: ``TRUTH_EVERY = (2, 4)`` (a
measured step every 4 steps after calibration; measured steps 1, 4, 6, 8, 12, 16, 20, ...).
A step whose held memory drops below ``_held_ref`` by enough asks for the next one to be
measured (16 low -> 17 measured).

Scenarios 1-3 were wrong promises of the first version (``forget_freed``, 42ae401), fixed in
``rebase_held``: the numbers in their docstrings are that version's. Scenario 4 is the rule's
limit (``xfail(strict=True)``): the companion ``*_without_the_change`` test shows the same
loop keeps its promise before it. Numbers measured on CPU, torch 2.14.1.
"""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr
import lightning_replay.core.engine.real_peak as real_peak

KiB, MiB = 1 << 10, 1 << 20
SLACK = 1024
EVERY = (2, 4)  # the periodic measurement schedule, compressed (engine.TRUTH_EVERY)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)
        self.extra = None  # the loop sets a callable: unsegmented work of some steps

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if self.extra is not None:
            x = self.extra(x)
        return self.head(x)


class _Junk:
    """A tensor in a reference cycle: freed only when the collector runs."""

    def __init__(self, nbytes: int) -> None:
        self.me = self
        self.t = torch.zeros(nbytes // 4)


@contextlib.contextmanager
def _change(on: bool):
    if on:
        yield
        return
    orig = real_peak.rebase_held
    real_peak.rebase_held = lambda *a: (0, 0)
    try:
        yield
    finally:
        real_peak.rebase_held = orig


def _train(steps, budget, *, on=True, before=None, batch=lambda s: 128, make_x=None):
    """Train ``Net`` under ``budget`` with ``real_peak``; ``before(s, ctx)`` runs at each
    step's start (ctx: model, keep (a list freed at the end)); ``make_x(s)`` gives the batch.
    Returns per step: (the plan in force's prediction, the step's real peak where measured
    else None, that plan)."""
    with _change(on), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gc.collect()
        gc.disable()
        ctx = {"model": model, "keep": []}
        try:
            engine = lr.install(model, "blocks.*", budget=budget, real_peak=True)
            engine.TRUTH_EVERY = EVERY
            engine.track_optimizer(opt)
            plans, labels, reals = [], [], {}
            for s in range(steps + 1):  # (one more: the last step's measurement settles)
                if before is not None:
                    before(s, ctx)
                opt.zero_grad(set_to_none=True)
                if make_x is not None:
                    x = make_x(s)
                else:
                    x = torch.randn(batch(s), 64, generator=torch.Generator().manual_seed(s))
                loss = model(x).pow(2).mean()
                plans.append(engine.plan)
                labels.append(engine.step)
                loss.backward()
                opt.step()
                del loss, x
                if engine.last_real_peak is not None:
                    reals.setdefault(*engine.last_real_peak)
            engine.uninstall()
            return [
                (plan.peak_memory if plan else None, reals.get(label), plan)
                for plan, label in zip(plans[:steps], labels)
            ]
        finally:
            ctx["keep"].clear()
            ctx.clear()
            gc.enable()
            gc.collect()


def _overruns(run, budget=None, after: int = 13):
    """(step, predicted, real) of each measured step after ``after`` (past calibration and
    the first plans) whose real peak exceeds the prediction or the byte budget by more than
    SLACK."""
    out = []
    for s, (predicted, real, _) in enumerate(run):
        if s <= after or predicted is None or real is None:
            continue
        bound = predicted if not isinstance(budget, int) else min(predicted, budget)
        if real > bound + SLACK:
            out.append((s, predicted, real))
    return out


# --------------------------------------------------------------------------------------------
# 1. The first low step's own figures are forgotten
# --------------------------------------------------------------------------------------------


def _extra(x):
    return x + torch.zeros(128 * KiB).sum()  # a 512 KiB transient after the segments


def _lazy_regularizer(s, ctx):
    """A 1 MiB cycle alive through calibration, collected at step 14; from step 14 every other
    step (even steps) runs a 512 KiB unsegmented transient (a regularizer every 2 steps)."""
    if s == 0:
        _Junk(MiB)
    if s == 14:
        gc.collect()
    ctx["model"].extra = _extra if (s >= 14 and s % 2 == 0) else None


def test_first_low_steps_temporaries_without_the_change():
    """Control of the next test (the change off): measured 16 and 20 (the steps with the
    transient) real 1136296, predicted 1743528 throughout: the promise holds."""
    run = _train(22, "min", on=False, before=_lazy_regularizer)
    assert run[16][1] is not None and run[20][1] is not None
    assert not _overruns(run)


def test_first_low_steps_temporaries_are_not_forgotten():
    """Attacks (found against forget_freed; fixed: a low step's figures are raised to the held
    bytes the others include, so what it held on top outlives the forgetting). In the first
    version ``_held_low`` only moved at a step whose figures changed, and the step that
    forgot folded back only its own figures. The first low step (16) measured a transient
    (512 KiB) that the second (17) did not; its figure was below the calibration's (which held
    the 1 MiB cycle) and changed nothing. Lowered by 1 MiB at 17, the figures are below what
    step 16 was measured to hold. Measured: step 20 (another step with the transient) real
    1136296 > predicted 694952 by 441344 bytes."""
    run = _train(22, "min", before=_lazy_regularizer)
    assert run[16][1] is not None and run[20][1] is not None
    assert not _overruns(run), _overruns(run)


# --------------------------------------------------------------------------------------------
# 2. A one-step dip forgets when the measured step before it was a smaller batch
# --------------------------------------------------------------------------------------------


def _labels_and_dip(s, ctx):
    """The loop holds its labels through each step (not passed to the model: 512 KiB at batch
    128); step 16 is a smaller batch (32: 128 KiB of labels); a 1 MiB cache (in a cycle) is
    alive from the start, dropped for step 20 alone and made again at step 21 (the dip
    tests/test_freed_memory.py::test_one_step_with_less_held_forgets_nothing guards)."""
    if s == 0:
        ctx["keep"].append(_Junk(MiB))
    if s == 20:
        ctx["keep"].clear()
        gc.collect()
    if s == 21:
        ctx["keep"].append(_Junk(MiB))
    ctx["y"] = None
    ctx["y"] = torch.zeros(_dip_batch(s), 1024)


def _dip_batch(s):
    return 32 if s == 16 else 128


def test_dip_after_a_smaller_batch_without_the_change():
    """Control of the next test (the change off): measured 16 (batch 32) real 1754480, 20
    (the dip) 1219240, 24 (cache back) 2267816, all predicted 2267816: the promise holds."""
    run = _train(26, "min", on=False, before=_labels_and_dip, batch=_dip_batch)
    assert run[16][1] is not None and run[20][1] is not None and run[24][1] is not None
    assert not _overruns(run)


def test_dip_after_a_smaller_batch_forgets_nothing():
    """Attacks (found against forget_freed; fixed: a step on a smaller input leaves the count
    alone): 'one low step is not enough' (the rule, for a smaller last batch's labels). A measured step below the largest input returns early from forget_freed
    but still becomes ``_held_prev``; the next measured top-size step that begins low (a cache
    dropped for that step only) then forgets on its own, and the cache coming back is over
    the prediction. Measured: step 24 real 2267816 > predicted 1874600 by 393216."""
    run = _train(26, "min", before=_labels_and_dip, batch=_dip_batch)
    assert run[16][1] is not None and run[20][1] is not None and run[24][1] is not None
    assert not _overruns(run), _overruns(run)


# --------------------------------------------------------------------------------------------
# 3. Held bytes that drop with nothing freed: the batch becomes a view of preloaded data
# --------------------------------------------------------------------------------------------


def _copies_then_views():
    """Batches of 128 rows from a 2 MiB preloaded tensor (made here, alive for one run):
    copies until step 14 (an augmented warm-up), then plain slices (views of the preloaded
    storage)."""
    data = torch.randn(8192, 64, generator=torch.Generator().manual_seed(1))

    def make_x(s):
        a = (s * 128) % data.shape[0]
        return data[a : a + 128].clone() if s < 14 else data[a : a + 128]

    return make_x


def test_view_batches_without_the_change():
    """Control of the next test (the change off): predicted 2792104 throughout; measured
    real at most 2792104: the promise holds (and the prediction is tight)."""
    run = _train(22, "min", on=False, make_x=_copies_then_views())
    assert not _overruns(run)


def test_view_batches_forget_nothing():
    """Attacks (found against forget_freed; fixed: held is the process's bytes less the
    model's parameters, buffers and existing gradients, inputs not subtracted): what
    ``_truth_held`` left out was not what the base counts. A batch that is
    a view of a preloaded dataset makes the whole dataset's storage 'the step's inputs', so
    held drops by the dataset's bytes with nothing freed; forget_freed lowers every figure by
    it. Measured: step 18 real 2791592 > predicted 2686492."""
    run = _train(22, "min", make_x=_copies_then_views())
    assert not _overruns(run), _overruns(run)


# --------------------------------------------------------------------------------------------
# 4. Memory freed for two steps that comes back, under a byte budget
# --------------------------------------------------------------------------------------------


def _freed_then_back(s, ctx):
    """A 1 MiB cache (in a cycle) alive through calibration, collected before step 14, made
    again at step 19 (after the two low measured steps 16, 17) and kept."""
    if s == 0:
        ctx["keep"].append(_Junk(MiB))
    if s == 14:
        ctx["keep"].clear()
        gc.collect()
    if s == 19:
        ctx["keep"].append(_Junk(MiB))


@pytest.fixture(scope="module")
def returning_budget():
    """A byte budget 64 KiB above the lowest plan's prediction with the cache alive (the plan
    fits it with the cache), and the two runs under it: (budget, with, without the change)."""
    lowest = _train(13, "min", before=_freed_then_back)[-1][0]
    budget = lowest + 64 * KiB
    return (
        budget,
        _train(22, budget, before=_freed_then_back),
        _train(22, budget, on=False, before=_freed_then_back),
    )


def test_memory_that_comes_back_without_the_change(returning_budget):
    """Control of the next test (the change off): the plan made with the cache in its base
    keeps every measured step within its prediction and the budget (measured: step 20 real
    1798440, predicted 1798440, budget 1809064)."""
    budget, _, run = returning_budget
    assert not _overruns(run, budget)


@pytest.mark.xfail(
    strict=True,
    reason="the rule's limit: memory freed for two measured steps and made again is charged again only in the phases measured after it came back (as memory that appears after calibration, which real_peak then folds in and re-plans for). Measured with forget_freed (42ae401), and partial re-learning: budget 1809064 (the "
    "lowest plan with the cache + 64 KiB). Forgotten at 17, the plan re-made at 18 retains "
    "4 segments (predicted 777576); the cache back at 19: step 20 real 1826152 (over the "
    "budget by 17088, the prediction by 1048576); re-planned (3 retained, predicted "
    "1798440), step 21 measured real 1831208 in a standalone run, still over both (+32768: "
    "a phase the retain-all step 20 did not run kept its lowered figure; not seen in every "
    "run). Without the change: predicted 1798440, real <= 1798440 <= budget.",
)
def test_memory_that_comes_back_keeps_the_budget(returning_budget):
    """Attacks: the premise that memory freed for two measured steps stays freed (a cache
    rebuilt every epoch, a previous model dropped and a new one built, the collector's
    sawtooth). Forgotten at step 17 and re-planned under the budget (more retained), the
    cache back at step 19 puts step 20 over the prediction and the budget. Measured: step 20
    real 1826152 vs predicted 777576, budget 1809064 (standalone, step 21 too: real 1831208
    vs predicted 1798440)."""
    budget, run, _ = returning_budget
    assert not _overruns(run, budget), (budget, _overruns(run, budget))


# --------------------------------------------------------------------------------------------
# 5. What holds
# --------------------------------------------------------------------------------------------


def test_smaller_last_batches_with_loop_held_labels_keep_the_promise():
    """Epochs of 6 steps whose last batch is smaller (32 of 128), labels (512 KiB at 128)
    held by the loop and not passed to the model, and the 1 MiB calibration cycle collected
    at step 14. The smaller batches begin lower (less labels) but never forget on their own;
    the cycle is forgotten (the prediction falls from 2267816 to 1219240) and every measured
    step stays within the prediction (measured: reals 1219240 / 705904 at the small batch)."""

    def batch(s):
        return 32 if s % 6 == 5 else 128

    def before(s, ctx):
        if s == 0:
            _Junk(MiB)
        if s == 14:
            gc.collect()
        ctx["y"] = None
        ctx["y"] = torch.zeros(batch(s), 1024)

    run = _train(30, "min", before=before, batch=batch)
    assert not _overruns(run), _overruns(run)
    assert run[-1][0] < run[12][0] - MiB // 2  # the cycle was forgotten


def test_a_second_model_dropped_then_reinstalled_keeps_the_promise():
    """Two engines in one process: model ``a`` (d=64) and a larger model ``b`` (d=128, its
    Adam state: 2 MiB held outside ``a``) trained side by side until step 14, when ``b`` is
    uninstalled and dropped (a warm-up teacher). ``a``'s engine forgets ``b`` (measured: the
    prediction 2810624 -> 694952 at step 17, real 694952); ``a`` is then uninstalled and
    installed again at step 22 (a fresh engine: no ``_held_low`` carried over). No exception,
    and every measured step of both of ``a``'s engines is within its prediction."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        a, b = Net(), Net(d=128)
        oa, ob = torch.optim.Adam(a.parameters()), torch.optim.Adam(b.parameters())
        gc.collect()
        gc.disable()
        try:

            def install(model, opt):
                engine = lr.install(model, "blocks.*", budget="min", real_peak=True)
                engine.TRUTH_EVERY = EVERY
                engine.track_optimizer(opt)
                return engine

            ea, eb = install(a, oa), install(b, ob)
            runs = [([], [], {})]  # per engine of a: plans, labels, real peaks
            for s in range(31):
                if s == 14:
                    eb.uninstall()
                    del eb, b, ob
                    gc.collect()
                if s == 22:
                    ea.uninstall()
                    ea = install(a, oa)
                    runs.append(([], [], {}))
                pairs = [(a, oa, ea, 64, runs[-1])]
                if s < 14:
                    pairs.append((b, ob, eb, 128, None))
                for model, opt, engine, d, run in pairs:
                    opt.zero_grad(set_to_none=True)
                    x = torch.randn(128, d, generator=torch.Generator().manual_seed(s))
                    loss = model(x).pow(2).mean()
                    if run is not None:
                        run[0].append(engine.plan)
                        run[1].append(engine.step)
                    loss.backward()
                    opt.step()
                    del loss, x
                    if run is not None and engine.last_real_peak is not None:
                        run[2].setdefault(*engine.last_real_peak)
            ea.uninstall()
        finally:
            gc.enable()
            gc.collect()
    first, second = (
        [(p.peak_memory if p else None, reals.get(label), p) for p, label in zip(plans, labels)]
        for plans, labels, reals in runs
    )
    assert first[-1][0] < first[12][0] - MiB  # b's memory was forgotten
    assert not _overruns(first, after=3), _overruns(first, after=3)
    assert not _overruns(second, after=3), _overruns(second, after=3)
