"""Overhead of lightning_replay against torch.utils.checkpoint on a stateless model.

Same model, same segments, interleaved runs (three arms: torch checkpoint twice, the second
one measuring the run's noise, and lightning_replay), medians of per-round ratios. Prints the
step-time ratio (replay / torch.utils.checkpoint) and the bytes each forward holds for backward
(by the allocator, see :func:`_held_for_backward`).

    python benchmarks/overhead.py [--width 1024 --blocks 6 --batch 256 --repeats 36 --copies 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

from bench_common import arms_side_by_side, device, paired_ratio, torch_and_replay_arms
from lightning_replay.demos.hazards import MLPBlock


class Stack(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _step(model: nn.Module, x: torch.Tensor, clock=time.thread_time) -> float:
    """One forward+backward; returns its seconds."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    model(x).pow(2).mean().backward()
    if cuda:
        torch.cuda.synchronize()
    dt = clock() - t0
    model.zero_grad(set_to_none=True)
    return dt


def _held_for_backward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward allocates and still holds when backward begins: everything kept for
    backward (saved activations, segment inputs, RNG states, preserved copies) and the loss.

    Measured by the allocator, not by saved-tensor hooks: a replay's segment inputs are kept
    by the engine and its saved tensors pass through the user's hooks in backward, so a hook
    sees another set of tensors under each method. CUDA: the caching allocator's allocated
    bytes; CPU: the net sum of the profiler's allocation events."""
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(x.device)
        loss = model(x).pow(2).mean()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(x.device) - before
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(x).pow(2).mean()
        held = sum(
            e.nbytes()
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def run(
    width: int = 1024,
    blocks: int = 6,
    batch: int = 256,
    repeats: int = 15,
    warmup: int = 3,
    copies: int = 3,
) -> dict:
    """``repeats`` rounds of three arms (torch checkpoint, a second torch checkpoint arm as the
    noise control, lightning_replay), ``copies`` copies each, stepped in turn
    (:func:`bench_common.arms_side_by_side`). On CPU: one intra-op thread, this thread's CPU
    time (see ``sparse_map._clock``)."""
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        base = Stack(width, blocks).to(dev)
        names = [f"blocks.{i}" for i in range(blocks)]
        x = torch.randn(batch, width, device=dev)
        arms, engines = torch_and_replay_arms(
            base, names, copies, lambda m, _: _step(m, x, clock), warmup
        )
        t_naive, t_control, t_replay = arms_side_by_side(
            arms, lambda m, r: _step(m, x, clock), repeats
        )
        assert all(s["mode"] == "recompute" for s in engines[0].summary().values())
        b_naive = _held_for_backward(arms[0][0], x)
        b_replay = _held_for_backward(arms[2][0], x)
    finally:
        torch.set_num_threads(threads)
    reference = [(a + b) / 2 for a, b in zip(t_naive, t_control)]
    return {
        "ratio": paired_ratio(t_replay, reference),
        "torch_vs_torch": paired_ratio(t_control, t_naive),
        "replay_step_s": statistics.median(t_replay),
        "torch_step_s": statistics.median(reference),
        "replay_saved_bytes": b_replay,
        "torch_saved_bytes": b_naive,
        "width": width,
        "blocks": blocks,
        "batch": batch,
        "repeats": repeats,
        "copies": copies,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=36)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    r = run(a.width, a.blocks, a.batch, a.repeats, copies=a.copies)
    print(
        f"stateless {a.blocks}x MLP width {a.width}, batch {a.batch}, {a.repeats} interleaved "
        f"rounds: replay {r['replay_step_s'] * 1e3:.1f} ms, torch.utils.checkpoint "
        f"{r['torch_step_s'] * 1e3:.1f} ms, ratio {r['ratio']:.3f} (torch vs torch "
        f"{r['torch_vs_torch']:.3f}); saved bytes "
        f"{r['replay_saved_bytes']} vs {r['torch_saved_bytes']}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
