"""Under a byte budget, the calibration of the selective options is fitted with what they keep.

A selective option holds the outputs of the ops its policy keeps from its forward to its
replay. Blocks whose products are large and saved by nothing (a product into ``tanh``, which
saves its own output; a product into a residual add) keep far more than a full replay holds.
A calibration step that timed every segment selectively would then exceed a budget that a
full replay meets. The referee is the whole process (:class:`tests.helpers.torch_memory.StepReferee`),
every step judged on its own, as in ``tests/test_budget_every_step.py``.
"""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr

D, H, B = 128, 512, 1024
BLOCKS = 4
MIB = 2**20
TOLERANCE = 1.02


class WideBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))  # both products kept, neither saved


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock() for _ in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _run(referee, arm, steps, budget=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = None
    if arm == "checkpoint":
        for b in model.blocks:
            f = b.forward
            b.forward = lambda *a, _f=f: checkpoint(_f, *a, use_reentrant=False)
    elif arm == "replay":
        engine = lr.install(model, "blocks.*", budget=budget, selective="matmul")
    peaks, modes = [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(B, D, generator=gen)
        gc.collect()
        opt.zero_grad(set_to_none=True)

        def step():
            model(x).pow(2).mean().backward()
            opt.step()

        peaks.append(referee(step, engine)[0])
        if engine is not None:
            modes.append({n: s["mode"] for n, s in engine.summary().items()})
    if engine is not None:
        kept = dict(engine.meter.selective_bytes)
        engine.uninstall()
    else:
        kept = {}
    gc.collect()
    return peaks, modes, kept


def test_calibrating_selective_options_holds_the_budget(referee):
    ckpt = max(_run(referee, "checkpoint", 3)[0][1:])
    kept_all = BLOCKS * B * (H + D) * 4  # what every block replayed selectively keeps
    # room for half the kept outputs above a full replay of every block
    budget = ckpt + kept_all // 2
    peaks, modes, kept = _run(referee, "replay", 12, budget=budget)
    # the kept outputs were measured (before the selective phase, on a warm-up step)
    assert all(v >= B * (H + D) * 4 for v in kept.values()) and len(kept) == BLOCKS, kept
    report = ", ".join(f"{p / MIB:.1f}" for p in peaks)
    over = [(s, round(p / budget, 3)) for s, p in enumerate(peaks) if p > TOLERANCE * budget]
    assert not over, (
        f"budget {budget / MIB:.1f} MiB (checkpoint {ckpt / MIB:.1f}); over: {over}; "
        f"steps {report}; modes {modes}"
    )
    # ... and some segments were still timed selectively, within it
    assert any(m in ("selective", "selective_whole") for step in modes for m in step.values())
