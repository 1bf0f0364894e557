"""What an option's measured time covers: checkpoint's own work around each replayed call.

A replayed segment costs the step more than its replay context: ``torch.utils.checkpoint``
sets up a frame around the forward, packs every saved tensor, forks the RNG before the
recomputation and checks the recomputed tensors after it. The engine times that work in place
(it is several times its micro-benchmark in a real step, where the kernels evict the caches),
and these tests make it expensive on purpose to see that the option's time carries it.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.costs import clock, saved_tensor_overhead
from lightning_replay.verify import train_steps

DELAY = 0.02  # seconds of CPU work added to one piece of checkpoint's own work per call


def _busy(seconds: float) -> None:
    # CPU time, not a sleep: costs are timed by this thread's CPU time on one thread
    t0 = clock()
    while clock() - t0 < seconds:
        pass


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _replay_time(monkeypatch: pytest.MonkeyPatch | None) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    engine = lr.install(model, ["0", "1"], budget="min", calibration_steps=2)
    steps = engine.steps_to_first_plan
    x = lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    if monkeypatch is not None:
        fork = torch.random.fork_rng

        @contextlib.contextmanager
        def slow_fork(*args, **kwargs):
            # checkpoint forks the RNG around a recomputation, before the replay context
            _busy(DELAY)
            with fork(*args, **kwargs):
                yield

        monkeypatch.setattr(torch.random, "fork_rng", slow_fork)
    train_steps(model, x, steps)
    assert engine.plan is not None
    cost = {c.name: c for c in engine.costs}["1"]
    option = next(o for o in ("recompute", "whole") if o in cost.options)
    times = engine.meter.times["1"][option]
    assert times, "no replay of segment 1 was timed"
    return statistics.median(times)


def test_replay_time_includes_checkpoints_work_before_the_replay_context(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the costs' clock is this thread's CPU time
    try:
        base = _replay_time(None)
        slowed = _replay_time(monkeypatch)
    finally:
        torch.set_num_threads(threads)
    # every recomputation of segment 1 paid DELAY in checkpoint's frame, outside the context
    assert slowed - base >= 0.8 * DELAY, (base, slowed)


def test_saved_tensor_overhead_is_measured_and_small():
    per_tensor = saved_tensor_overhead()
    assert per_tensor == saved_tensor_overhead()  # measured once per process
    # a pack and an unpack hook: microseconds, not nothing and not milliseconds
    assert 0.0 < per_tensor < 1e-3, per_tensor
    t0 = time.perf_counter()
    saved_tensor_overhead()
    assert time.perf_counter() - t0 < 1e-3
