"""What a replay leaves behind once backward has ended: nothing (no reference cycle that only
the garbage collector would free, holding a step's recomputation until it runs)."""

from __future__ import annotations

import gc

import torch

import lightning_replay as lr
from lightning_replay.demos.hazards import QueueModel
from lightning_replay.verify import train_steps


def _frames() -> int:
    return sum(type(o).__name__ == "_CheckpointFrame" for o in gc.get_objects())


def test_no_checkpoint_frame_outlives_its_backward_without_the_garbage_collector():
    torch.manual_seed(0)
    m = QueueModel(rows=256, dim=16, write_rows=4)
    e = lr.install(m, "blocks.*", preservation="whole")

    def x(step):
        return torch.randn(32, 16, generator=torch.Generator().manual_seed(step))

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        before = _frames()
        train_steps(m, x, 4)  # the probe, then steps that replay every block
        assert sum(s["replays"] for s in e.summary().values()) >= 2 * len(e.segments)
        assert _frames() == before
    finally:
        if was:
            gc.enable()
