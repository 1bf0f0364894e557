"""The first plan's figures include optimizer state made after the measured warm-up steps.

CI (stop 44) measured a gradient-accumulation loop under AdamW at a budget halfway between torch
checkpoint's and plain training's peak: the first planned step held 1.033 x the budget. The
calibration's measured warm-up window was the first step's second micro-batch, which began
before AdamW's first step made its moments (2 x the parameters' bytes); no measured window saw
them before the first plan, so every replay's figure lacked them. Which plan came out depended
on measured times: with the last two blocks recomputed (their replays are the step's peak) the
prediction was 0.74 x the real peak; with the middle two (the forward's end is the peak, and
its figure was measured later) it held.

The referee here cannot depend on the planner's timing: for every plan of recompute and retain
over the blocks, the prediction from the engine's figures as the first plan is made must bound
the real peak that plan holds in the same loop, each micro-batch judged by the whole-process
:class:`~tests.helpers.torch_memory.StepReferee`.
"""

from __future__ import annotations

import gc
import itertools
import warnings
import weakref

import pytest
import torch

import lightning_replay as lr
from lightning_replay.core.engine.peak import predicted_peak
from tests.helpers.budget_runner import ResidualStack
from tests.helpers.torch_memory import StepReferee

W, N = 64, 512
NAMES = [f"blocks.{i}" for i in range(4)]
TOLERANCE = 1.02
LOOSE = 1.10  # the most a prediction may exceed the real peak by here
STEPS = 6


#: optimizers whose state appears at their first step (and one whose state exists from the start)
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
}


def _units(model, opt, s: int, micro: int):
    """One optimizer step over ``micro`` micro-batches of ``N // micro`` rows: each a unit."""

    def one(j: int) -> None:
        g = torch.Generator().manual_seed(100 * s + j)
        x = torch.randn(N // micro, W, generator=g)
        (model(x).pow(2).mean() / micro).backward()
        if j == micro - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return [lambda j=j: one(j) for j in range(micro)]


def _choices(recomputed) -> dict[str, str]:
    return {n: ("recompute" if i in recomputed else "retain") for i, n in enumerate(NAMES)}


def _first_plan_predictions(optimizer: str, micro: int) -> dict[tuple, int]:
    """Train under the engine until its first plan; return each plan's prediction from the
    figures the first plan was made with."""
    torch.manual_seed(0)
    model = ResidualStack(W)
    opt = OPTIMIZERS[optimizer](model.parameters())
    engine = lr.install(model, NAMES, budget="min")
    out: dict[tuple, int] = {}
    try:
        for s in range(STEPS):
            for unit in _units(model, opt, s, micro):
                unit()
                if engine.plan is not None:
                    args = engine.phase_peak_args
                    base = engine.real_base_memory
                    for k in range(len(NAMES) + 1):
                        for combo in itertools.combinations(range(len(NAMES)), k):
                            out[combo] = predicted_peak(engine.costs, _choices(combo), base, **args)
                    return out
        raise AssertionError(f"no plan in {STEPS} steps")
    finally:
        engine.uninstall()


def _real_peaks(optimizer: str, micro: int, combos, referee) -> dict[tuple, int]:
    """Each plan forced from the first step on (``set_options``); its largest unit peak over
    the last steps, once the optimizer's state exists."""
    out = {}
    for combo in combos:
        torch.manual_seed(0)
        model = ResidualStack(W)
        opt = OPTIMIZERS[optimizer](model.parameters())
        engine = lr.install(model, NAMES, budget="min")
        peaks = []
        for s in range(STEPS):
            gc.collect()
            for unit in _units(model, opt, s, micro):
                if engine.plan is not None:  # (no re-plan over it: no budget to keep)
                    engine.reconfigure(budget=2**40)
                    engine.set_options(_choices(combo))
                try:
                    peak = referee(unit, engine)[0]
                except AssertionError as exc:  # the engine measured the unit across the next
                    if "another profiler" not in str(exc):
                        raise
                    continue
                if s >= STEPS - 3 and engine.plan is not None:
                    peaks.append(peak)
        engine.uninstall()
        model = opt = engine = None
        gc.collect()
        assert peaks, f"{combo}: no unit measured under the plan"
        out[combo] = max(peaks)
    return out


@pytest.fixture(scope="module")
def referee():
    gc.collect()
    r = StepReferee()
    yield r
    r.close()


@pytest.mark.parametrize(
    ("optimizer", "micro"), [("adamw", 2), ("adamw", 3), ("sgd_momentum", 2), ("adagrad", 2)]
)
def test_first_plan_predictions_bound_every_plan(optimizer, micro, referee):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = _first_plan_predictions(optimizer, micro)
        # plans that recompute the last block (its replay at the backward's start is the
        # step's peak) and plans whose peak is the forward's end
        combos = [(3,), (2, 3), (), (1, 2)]
        real = _real_peaks(optimizer, micro, combos, referee)
    rows = [(c, predicted[c], real[c], real[c] / predicted[c]) for c in combos]
    report = "; ".join(f"{c}: predicted {p}, real {r} ({q:.3f})" for c, p, r, q in rows)
    print(report)
    over = [(c, round(q, 3)) for c, _, _, q in rows if q > TOLERANCE]
    assert not over, (
        f"{optimizer}, {micro} micro-batches: real / predicted over {TOLERANCE}: {over}; {report}"
    )
    # ... and the state is charged once (state that existed from the start, Adagrad's, or that
    # a measured step began with, is not added again at the plan)
    under = [(c, round(q, 3)) for c, _, _, q in rows if q < 1 / LOOSE]
    assert not under, f"{optimizer}, {micro}: predicted over {LOOSE} x the real peak: {under}"


def test_the_optimizer_watch_holds_nothing_after_uninstall():
    """The hook that tracks optimizers until the first plan is gone with the engine: no hook
    left on every optimizer's step, and the model's optimizer dies with its last reference
    (the cyclic collector off)."""
    from torch.optim import optimizer as _opt

    torch.manual_seed(0)
    model = ResidualStack(W)
    opt = OPTIMIZERS["adamw"](model.parameters())
    hooks = len(_opt._global_optimizer_post_hooks)
    engine = lr.install(model, NAMES, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for unit in _units(model, opt, 0, 2):
            unit()
    unit = None  # (its closure holds the model and the optimizer)
    assert engine.plan is None and engine.tracked_optimizers == [opt]
    gc.collect()
    gc.disable()
    try:
        engine.uninstall()
        ref = weakref.ref(opt)
        model = opt = None
        assert ref() is None, "the optimizer outlived uninstall"
    finally:
        gc.enable()
    assert len(_opt._global_optimizer_post_hooks) == hooks
