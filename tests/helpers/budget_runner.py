"""One training run judged step by step by a whole-process referee: plain PyTorch, torch
checkpoint on the same blocks, or replay under a budget (issue 31's budget tests share it).

The model is built inside (from ``make_model``, after ``torch.manual_seed(0)``) and dropped
before the run returns, so no arm's tensors are alive in the next arm's figures.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from lightning_replay.planner import InfeasibleBudget

#: the arms: no recomputation; torch checkpoint on each segment; the replay engine
ARMS = ("plain", "checkpoint", "replay")


class ResidualMlp(nn.Module):
    """``x + down(tanh(up(x)))``: the budget tests' block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ResidualStack(nn.Module):
    """``blocks``: ``n`` :class:`ResidualMlp` blocks of width ``d`` (hidden ``2 d``), then a
    linear head to one output."""

    def __init__(self, d: int, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMlp(d, 2 * d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@dataclasses.dataclass
class ArmRun:
    """What one run measured."""

    #: each step's whole-process peak, in bytes (the referee's, or the engine's where it
    #: measured the step itself)
    peaks: list[int]
    #: how many of those steps ran a plan (replay; the last ones)
    planned: int = 0
    #: the first plan's refusal, if ``keep_refusal`` (its traceback dropped: it held the model)
    refused: InfeasibleBudget | None = None
    #: the engine's preserved bytes before it was uninstalled (replay)
    preserved: int = 0
    #: the trained weights and buffers, if ``keep_state``
    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: each step's predicted peak (the plan in force as the step ended; None before a plan)
    predicted: list[int | None] = dataclasses.field(default_factory=list)


def run_arm(
    make_model: Callable[[], nn.Module],
    names: list[str],
    arm: str,
    referee: Callable | None,
    batch: Callable[[int], torch.Tensor],
    budget: int | str | None = None,
    steps: int = 3,
    keep_refusal: bool = False,
    keep_state: bool = False,
) -> ArmRun:
    """Train ``make_model()`` with AdamW under ``arm`` (one of :data:`ARMS`; ``"ckpt"`` is
    ``"checkpoint"``): ``steps`` steps for plain and checkpoint, and for replay until
    ``steps`` planned steps ran (the probe and calibration steps before them are judged too).
    ``referee(step_fn, engine)`` returns a step's peak first; None runs without one (only the
    trained state is wanted). ``batch(s)`` is step ``s``'s input."""
    if arm == "ckpt":
        arm = "checkpoint"
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = None
    if arm == "checkpoint":
        for n in names:
            mod = model.get_submodule(n)
            f = mod.forward
            mod.forward = lambda *a, _f=f, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    elif arm == "replay":
        engine = lr.install(model, names, budget=budget)
    run = ArmRun(peaks=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps + 30):
            if (engine is None and s == steps) or run.planned == steps:
                break
            run.planned += engine is not None and engine.plan is not None
            x = batch(s)
            gc.collect()

            def step() -> None:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            try:
                if referee is None:
                    step()
                    continue
                run.peaks.append(referee(step, engine)[0])
                plan = engine.plan if engine is not None else None
                run.predicted.append(plan.peak_memory if plan is not None else None)
            except InfeasibleBudget as exc:
                if not keep_refusal:
                    raise
                run.refused = exc.with_traceback(None)
                break
    if engine is not None:
        run.preserved = engine.preserved_bytes
        engine.uninstall()
    if keep_state:
        run.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step = None  # the closure held the model and optimizer
    model = opt = engine = None
    gc.collect()
    return run
