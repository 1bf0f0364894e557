"""Overhead of lightning_replay against torch.utils.checkpoint on a stateless model.

Same model, same segments, interleaved runs, medians. Prints the step-time ratio
(replay / torch.utils.checkpoint) and the bytes each holds for backward.

    python benchmarks/overhead.py [--width 1024 --blocks 6 --batch 256 --repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.demos.hazards import MLPBlock
from lightning_replay.verify import torch_checkpoint


class Stack(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[float, int]:
    """One forward+backward; returns (seconds, bytes of tensors saved through autograd hooks)."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).pow(2).mean()
    loss.backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt, sum(saved.values())


def run(
    width: int = 1024, blocks: int = 6, batch: int = 256, repeats: int = 15, warmup: int = 3
) -> dict:
    torch.manual_seed(0)
    base = Stack(width, blocks)
    names = [f"blocks.{i}" for i in range(blocks)]
    naive = torch_checkpoint(copy.deepcopy(base), names)
    replay = copy.deepcopy(base)
    engine = lr.install(replay, names)
    x = torch.randn(batch, width)
    for _ in range(warmup):  # the first replay step is the probe
        _step(naive, x)
        _step(replay, x)
    t_naive, t_replay, b_naive, b_replay = [], [], 0, 0
    for i in range(repeats):
        order = [(naive, t_naive), (replay, t_replay)]
        if i % 2:
            order.reverse()  # interleave, alternating who goes first
        for model, times in order:
            dt, b = _step(model, x)
            times.append(dt)
            if model is naive:
                b_naive = b
            else:
                b_replay = b + engine.preserved_bytes
    assert all(s["mode"] == "recompute" for s in engine.summary().values())
    med_n, med_r = statistics.median(t_naive), statistics.median(t_replay)
    return {
        "ratio": med_r / med_n,
        "replay_step_s": med_r,
        "torch_step_s": med_n,
        "replay_saved_bytes": b_replay,
        "torch_saved_bytes": b_naive,
        "width": width,
        "blocks": blocks,
        "batch": batch,
        "repeats": repeats,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    r = run(a.width, a.blocks, a.batch, a.repeats)
    print(
        f"stateless {a.blocks}x MLP width {a.width}, batch {a.batch}, {a.repeats} interleaved "
        f"pairs: replay {r['replay_step_s'] * 1e3:.1f} ms, torch.utils.checkpoint "
        f"{r['torch_step_s'] * 1e3:.1f} ms, ratio {r['ratio']:.3f}; saved bytes "
        f"{r['replay_saved_bytes']} vs {r['torch_saved_bytes']}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
