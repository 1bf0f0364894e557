"""A model moved out of the garbage collector's sight still counts in every figure of a step.

The engine's base is the process's: a walk of the collector's objects at the start of each step
it measures (:func:`~lightning_replay.core.mechanisms.memory.process_tensor_bytes`). The walk
sees only the collector's generations, and ``gc.freeze()`` moves every object alive out of them
for good: a process that forks its data workers freezes after building its model so that the
children keep its pages shared (CPython's documentation recommends it). A frozen model's
parameters and its optimizer's state were then invisible to the walk: the base lacked them and
every prediction was under the real peak by their bytes. The walk now adds the model's and its
optimizers' own tensors, whatever the collector sees.
"""

from __future__ import annotations

import gc
import warnings

import torch

import lightning_replay as lr
from lightning_replay.core.mechanisms.memory import (
    StepPeak,
    live_model_bytes,
    model_tensors,
    process_tensor_bytes,
)
from tests.helpers.budget_runner import ResidualStack

W, N = 64, 256
NAMES = [f"blocks.{i}" for i in range(4)]


def _step(model, opt, s: int) -> None:
    x = torch.randn(N, W, generator=torch.Generator().manual_seed(s))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_frozen_model_counts_in_a_meters_base():
    torch.manual_seed(0)
    model = ResidualStack(W)
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)  # state from the start
    held = live_model_bytes(model, [opt])
    gc.collect()
    gc.freeze()  # (for good: the module's own freeze is tests/conftest.py's)
    # the walk alone no longer sees them ...
    assert process_tensor_bytes() < held
    # ... with the model's own tensors, it does
    assert process_tensor_bytes(also=model_tensors(model, [opt])) >= held
    meter = StepPeak(model, optimizers=[opt])
    meter.start()
    _step(model, opt, 0)
    meter.stop()
    assert meter.base >= held, f"a meter's base {meter.base} B without the frozen model's {held} B"


def _first_plan(frozen: bool) -> tuple[int, int]:
    """Train under a lowest-plan engine until its first plan: its real base and held bytes
    then, with the model and its optimizer frozen before install or not."""
    torch.manual_seed(0)
    model = ResidualStack(W)
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    if frozen:
        gc.collect()
        gc.freeze()
    engine = lr.install(model, NAMES, budget="min")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(8):
                _step(model, opt, s)
                if engine.plan is not None:
                    return engine.real_base_memory, live_model_bytes(model, [opt])
        raise AssertionError("no plan in 8 steps")
    finally:
        engine.uninstall()


def test_the_first_plans_base_is_the_same_frozen_or_not():
    seen, held = _first_plan(frozen=False)
    frozen, _ = _first_plan(frozen=True)
    assert abs(frozen - seen) <= 0.02 * seen, (
        f"the first plan's base with the model frozen: {frozen} B, in sight: {seen} B "
        f"(the model and its optimizer hold {held} B)"
    )
