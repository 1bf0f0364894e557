"""The plan's predicted peak bounds the real one, tightly, for shapes whose peak sits in
different phases of the step (issue 31).

A step's real peak can sit at the forward's end (the loss and the head's temporaries on top of
the retained segments), at a replay in backward (with backward's gradient temporaries), or in
the optimizer step. The engine measures some steps' real peaks and folds what its figures miss
into the plans' predictions; one residual measured at one moment and added to every other
moment over- or under-predicts the others. Here, for four shapes of our own (one huge segment;
the last block retained under a large head and loss; large optimizer state; large backward
temporaries), under ``budget="min"`` with AdamW:

- every refereed planned step's real whole-process peak (the live storages a walk of the
  garbage collector finds when it starts + the profiler's net peak inside it; no engine figure)
  is at most the prediction of the plan in force, and that prediction is at most 1.02 x it;
- the lowest plan's prediction is at most 1.02 x torch checkpoint's real peak on the same
  blocks plus the bytes the plan preserves.
"""

from __future__ import annotations

import gc
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from lightning_replay.verify import torch_checkpoint
from tests.helpers.budget_runner import ResidualMlp as _Mlp
from tests.helpers.torch_memory import whole_step_peak

PAGE = 4096  # bytes a bound is checked to (see the assertion)
MiB = 2**20
REFEREED = 3  # planned steps refereed, after the plan's first (which the engine measures)


class _Stack(nn.Module):
    def __init__(self, d: int, hidden: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Mlp(d, hidden) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Net(nn.Module):
    """input projection -> blocks -> head -> cross-entropy (the loss inside the root)."""

    def __init__(
        self, blocks: list[nn.Module], d_in: int, d: int, classes: int, head_width: int = 0
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = (
            nn.Linear(d, classes)
            if not head_width
            else nn.Sequential(nn.Linear(d, head_width), nn.Tanh(), nn.Linear(head_width, classes))
        )

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x), y)


class _HeavyGrad(torch.autograd.Function):
    """``x * w`` whose backward makes temporaries 6 x the input's size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        wide = torch.cat([g, x] * 3, dim=-1)  # 6 x the input's bytes, live at once
        gx = wide[..., : g.shape[-1]] * w
        gw = (wide[..., g.shape[-1] : 2 * g.shape[-1]] * g).sum(0)
        return gx, gw


class _HeavyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.tanh(_HeavyGrad.apply(x, self.w)))


def _shape(name: str) -> tuple[nn.Module, list[str], Callable[[int], tuple]]:
    torch.manual_seed(0)
    if name == "one_huge_segment":  # the segment is nearly the whole model
        model = _Net([_Stack(256, 256, 2)], 32, 256, 16)  # the head saves its wide input
        n, classes, d_in = 512, 16, 32
    elif name == "retained_last_block_big_head":  # logits 8 x a block's width
        model = _Net([_Mlp(64, 128) for _ in range(3)], 32, 64, 2048)
        n, classes, d_in = 128, 2048, 32
    elif name == "big_head_saved_outside_segments":  # freed before the first replay
        model = _Net([_Mlp(64, 128) for _ in range(3)], 32, 64, 16, head_width=2048)
        n, classes, d_in = 128, 16, 32
    elif name == "big_optimizer_state":  # AdamW's state dwarfs the activations
        model = _Net([_Mlp(512, 512) for _ in range(3)], 32, 512, 16)
        n, classes, d_in = 8, 16, 32
    elif name == "heavy_backward_temporaries":
        model = _Net([_HeavyBlock(128) for _ in range(3)], 32, 128, 16)
        n, classes, d_in = 256, 16, 32
    else:  # pragma: no cover
        raise ValueError(name)
    names = [f"blocks.{i}" for i in range(len(model.blocks))]

    def batch(step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)

    return model, names, batch


SHAPES = [
    "one_huge_segment",
    "retained_last_block_big_head",
    "big_head_saved_outside_segments",
    "big_optimizer_state",
    "heavy_backward_temporaries",
]


def _step(model: nn.Module, opt: torch.optim.Optimizer, b: tuple) -> None:
    opt.zero_grad(set_to_none=True)
    model(b).backward()
    opt.step()


def _torch_checkpoint_peak(name: str) -> int:
    model, names, batch = _shape(name)
    torch_checkpoint(model, names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for i in range(4):
        b = batch(i)
        gc.collect()
        peaks.append(whole_step_peak(lambda m=model, o=opt, b=b: _step(m, o, b)))
    del model, opt
    gc.collect()
    return max(peaks[1:])  # (the first step makes AdamW's state)


@pytest.mark.parametrize("name", SHAPES)
def test_the_plans_prediction_bounds_its_real_peak_tightly(name):
    ckpt = _torch_checkpoint_peak(name)  # (first: nothing of the replay run is alive yet)
    model, names, batch = _shape(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lr.install(model, names, budget="min", calibration_steps=1)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while engine.plan is None or step < 2:  # the probe, calibration, the plan's first
                assert step < 20, "no plan after 20 steps"
                _step(model, opt, batch(step))
                step += 1
            rows = []
            for _ in range(REFEREED):
                b = batch(step)
                gc.collect()
                real = whole_step_peak(lambda b=b: _step(model, opt, b))
                rows.append((real, engine.plan.peak_memory, dict(engine.plan.choices)))
                step += 1
        preserved = engine.window_stats()["preserved_bytes"]
    finally:
        engine.uninstall()
    report = [
        f"real {r / MiB:.3f} MiB, predicted {p / MiB:.3f} ({p / r:.4f} x) {c}" for r, p, c in rows
    ]
    print(name, report)
    for real, predicted, _ in rows:
        # (to a page: the referee's reading and the engine's own measured step may place a
        # scalar on either side of a phase boundary: 4 bytes over, once, in a long run)
        assert real <= predicted + PAGE, f"{name}: a planned step overran its prediction: {report}"
        assert predicted <= 1.02 * real, f"{name}: the prediction is loose: {report}"
    lowest = rows[-1][1]
    print(
        f"{name}: torch checkpoint {ckpt / MiB:.3f} MiB, lowest plan predicted {lowest / ckpt:.4f} x"
    )
    assert lowest <= 1.02 * ckpt + preserved, (
        f"{name}: the lowest plan is predicted at {lowest / MiB:.3f} MiB, torch checkpoint "
        f"really peaks at {ckpt / MiB:.3f} MiB, preserved {preserved / MiB:.3f} MiB: {report}"
    )
