"""A plan's predicted peak charges each gradient only where it exists (issue 30).

With ``zero_grad(set_to_none=True)`` (what Lightning and most loops do) no gradient exists at
the forward's end, and at a segment's replay only those backward has already made (the head's
and the later segments'). The engine's base used to charge every parameter's gradient at every
moment of the step, so predictions ran high by up to the gradients' bytes and the planner chose
slower plans than the budget allowed.

The referee is the whole process (``tests.helpers.torch_memory.whole_step_peak``: the live
storages a walk of the garbage collector finds as the step begins + the profiler's net peak
inside it; no engine figure). For models of our own whose gradients are a large part of the
step (so a prediction that charges them where they do not exist is visibly loose), every
refereed planned step's real peak is at most the prediction of the plan in force, and that
prediction is at most ``1.05 x`` the real peak (+ 64 KiB):

- gradients set to None each step, under the plan keeping every activation (the forward's end
  peaks) and under the lowest-memory plan (the replays peak);
- gradients kept (``set_to_none=False``): they exist all step, and are charged all step;
- a parameter shared between the first and the last segment: its gradient is made at the first
  backward that reaches it (the last segment's) and is charged from there on;
- an untied input embedding outside the segments: its gradient is made last;
- gradient accumulation: the gradients of the first micro-step exist through the second (the
  prediction bounds every micro-step and charges them once: within the largest micro-step's
  peak plus the gradients' bytes).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from tests.helpers.budget_runner import ResidualMlp as _Mlp
from tests.helpers.torch_memory import whole_step_peak

PAGE = 4096  # bytes a bound is checked to (see the assertion)
MiB = 2**20
SLACK = 64 * 1024
REFEREED = 3  # planned steps refereed, after the plan's first (which the engine measures)


class _Net(nn.Module):
    """embedding -> blocks -> head -> cross-entropy. ``tie``: the last block's ``up`` is the
    first block's (one parameter, two segments)."""

    def __init__(self, vocab: int, d: int, hidden: int, n: int, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)  # outside the segments: its gradient comes last
        self.blocks = nn.ModuleList(_Mlp(d, hidden) for _ in range(n))
        if tie:
            self.blocks[-1].up = self.blocks[0].up
        self.head = nn.Linear(d, 16)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, y = batch
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x), y)


def _model(tie: bool = False) -> tuple[nn.Module, list[str]]:
    torch.manual_seed(0)
    # gradients of 8.8 MiB (a large embedding and wide blocks) beside activations of ~20 MiB
    model = _Net(vocab=4096, d=256, hidden=1024, n=3, tie=tie)
    return model, [f"blocks.{i}" for i in range(3)]


def _batch(step: int, rows: int = 640) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 4096, (rows,), generator=g), torch.randint(0, 16, (rows,), generator=g)


def _run(model, names, budget, set_to_none: bool = True, accumulate: int = 1):
    """Train to a plan, then referee ``REFEREED`` planned steps (every micro-step of them):
    ``[(real, predicted, choices)]``."""
    gc.collect()  # nothing of an earlier test counts in this one's base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lr.install(model, names, budget=budget, calibration_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def zero(i: int) -> None:  # before the step: the step begins with what it leaves
        if i % accumulate == 0:
            opt.zero_grad(set_to_none=set_to_none)

    def body(i: int) -> None:
        model(_batch(i)).backward()
        if i % accumulate == accumulate - 1:
            opt.step()

    def step(i: int) -> None:
        zero(i)
        body(i)

    rows = []
    try:
        i = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while engine.plan is None:  # the probe, calibration
                assert i < 30, "no plan after 30 steps"
                step(i)
                i += 1
            # the plan's first two windows (the engine measures the first; two profilers at
            # once would perturb the referee's reading), then to an accumulation window's start
            for _ in range(2):
                step(i)
                i += 1
            while i % accumulate:
                step(i)
                i += 1
            for _ in range(REFEREED * accumulate):
                zero(i)
                gc.collect()
                real = whole_step_peak(lambda i=i: body(i))
                rows.append((real, engine.plan.peak_memory, dict(engine.plan.choices)))
                i += 1
    finally:
        engine.uninstall()
    return rows


def _judge(rows, what: str, allowance: int = 0) -> None:
    report = [
        f"real {r / MiB:.3f} MiB, predicted {p / MiB:.3f} ({p / r:.4f} x) {c}" for r, p, c in rows
    ]
    print(what, report)
    for real, predicted, _ in rows:
        # (to a page: the referee's reading and the engine's own measured step may place a
        # scalar on either side of a phase boundary: 4 bytes over, once, in a long run)
        assert real <= predicted + PAGE, f"{what}: a planned step overran its prediction: {report}"
    top = max(r for r, _, _ in rows)  # (accumulation: the plan holds for every micro-step)
    for real, predicted, _ in rows:
        assert predicted <= 1.05 * top + SLACK + allowance, (
            f"{what}: the prediction charges gradients that do not exist yet: {report}"
        )


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("budget", [2**60, "min"], ids=["keep_all", "lowest"])
def test_gradients_set_to_none_are_charged_where_they_exist(budget):
    model, names = _model()
    _judge(_run(model, names, budget), f"set_to_none, budget {budget}")


@pytest.mark.parametrize("budget", [2**60, "min"], ids=["keep_all", "lowest"])
def test_gradients_kept_are_charged_all_step(budget):
    model, names = _model()
    _judge(_run(model, names, budget, set_to_none=False), f"kept, budget {budget}")


@pytest.mark.parametrize("budget", [2**60, "min"], ids=["keep_all", "lowest"])
def test_a_parameter_shared_by_two_segments_is_charged_from_its_first_backward(budget):
    model, names = _model(tie=True)
    _judge(_run(model, names, budget), f"tied, budget {budget}")


def test_gradient_accumulation_charges_the_gradients_of_the_first_micro_step():
    """The second micro-step begins with the first's gradients: once a window began with them,
    nothing is credited again (the formula with gradients kept), and every micro-step stays
    within the prediction, which charges them once: within the largest micro-step's peak plus
    the gradients' bytes. (A guard, not a test that fails without the credit: the referee read
    the second micro-step below the first, 20.0 against 23.8 MiB, although it begins with
    10 MiB of gradients; in plain PyTorch the same reading ranged 25-35 MiB with the step's
    history, so it is not judged tightly here.)"""
    model, names = _model()
    rows = _run(model, names, "min", accumulate=2)
    _judge(rows, "accumulation", allowance=_grad_bytes(model))
