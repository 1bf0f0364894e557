"""A budget some plan meets is never refused (issue 31, the refusal before calibrating).

Refusing a budget stops a user's training: the worst failure of a budget. The engine refuses
(``InfeasibleBudget``) once its measured figures show that no plan meets the budget: after the
untimed warm-up step (``calibration.refuse_before_calibrating``) or at the first plan. Either
refusal is right only where the lowest plan's real peak is over the budget.

Each model's lowest plan (``budget="min"``) is run first and its planned steps' real peak taken
by the whole-process referee (live storages at the step's start + the profiler's net peak);
then the same model trains under a budget 1 % above that peak and must reach its first plan
without a refusal. Models: the adversary's shapes (session 14) and the refusal test's stateful
ones; stateful, stateless, view, shared and generator state, many small or one giant segment.
Strict xfails carry what was measured where the planner over-estimates the lowest plan.
"""

from __future__ import annotations

import pytest
import torch

from tests import test_adversary_s14_budget as s14
from tests import test_refusal_before_calibration as stateful
from tests.helpers.budget_runner import run_arm

MIB = 2**20
MARGIN = 1.01  # the budget over the lowest plan's real peak


def _case(kind: str):
    """(model builder, segment names, step -> batch) of a model named ``family:name``."""
    family, name = kind.split(":")
    if family == "s14":
        make, names, width = s14.SHAPES[name]
        return make, names, lambda s: torch.randn(s14.N, width, generator=_gen(s))
    n = len(stateful.MODELS[name]())
    return (
        lambda: stateful._model(name),
        [f"0.{i}" for i in range(n)],
        lambda s: torch.randn(stateful.N, stateful.W, generator=_gen(s)),
    )


def _gen(s: int) -> torch.Generator:
    return torch.Generator().manual_seed(s)


#: model -> why the planner refuses a budget its lowest plan meets (measured; strict xfail)
XFAIL = {
    "s14:big_root_buffer_read_by_every_segment": (
        "measured: the lowest plan (regions for blocks.0-2, retain blocks.3) peaks at 2.806 "
        "MiB; a budget of 2.834 is refused naming 3.166 MiB after the warm-up (3.181 at the "
        "first plan without the early refusal): the planner's lowest figure is 1.13 x the real "
        "peak; its measured replay extras are 265-461 KB a segment (cause not found)"
    ),
    "stateful:every_segment_an_average": (
        "measured: the lowest plan peaks at 2.869 MiB; a budget of 2.898 (1.01 x) is refused "
        "naming 2.908 MiB, 1.014 x the real peak, after the warm-up (the same figure at the "
        "first plan without the early refusal); 1.02 x is met"
    ),
}

KINDS = [
    "s14:one_giant_segment",
    "s14:big_int64_state_index_add",
    "s14:big_bool_mask_flipped_by_root",
    "s14:big_frozen_parameter_as_state",
    "s14:a_generator_per_segment",
    "s14:big_input_into_the_first_segment",
    "s14:big_auxiliary_output_dropped_by_the_root",
    "stateful:averages_through_a_slice",
    "stateful:queues_and_stateless",
    *XFAIL,
]


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            k, marks=[pytest.mark.xfail(strict=True, reason=XFAIL[k])] if k in XFAIL else []
        )
        for k in KINDS
    ],
)
def test_a_budget_the_lowest_plan_meets_is_not_refused(kind, referee):
    make, names, batch = _case(kind)
    low = run_arm(make, names, "replay", referee, batch, budget="min", steps=2)
    low_peak = max(low.peaks[len(low.peaks) - low.planned :])
    budget = int(low_peak * MARGIN)
    run = run_arm(make, names, "replay", None, batch, budget=budget, steps=1, keep_refusal=True)
    assert run.refused is None, (
        f"{kind}: a budget of {budget / MIB:.3f} MiB refused naming "
        f"{run.refused.min_feasible / MIB:.3f}; the lowest plan really peaks at "
        f"{low_peak / MIB:.3f}"
    )
    assert run.planned == 1, f"{kind}: no plan under {budget} B"
