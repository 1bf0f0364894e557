"""What a replay leaves behind once backward has ended: nothing (no reference cycle that only
the garbage collector would free, holding a step's recomputation until it runs), by the
process's own referees: checkpoint frames, and weak references to the tensors a step made."""

from __future__ import annotations

import gc

import torch

import lightning_replay as lr
from lightning_replay.demos.hazards import QueueModel
from lightning_replay.verify import train_steps
from tests.helpers.torch_memory import (
    outlived,
    process_tensor_storages,
    snapshot_pool_storages,
    state_storages,
    tensors_outside,
)


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
        existing = set(process_tensor_storages())
        train_steps(m, x, 3)  # the probe, then steps that replay every block
        left = tensors_outside(state_storages(m) | existing | snapshot_pool_storages(e))
        train_steps(m, lambda s: x(s + 3), 2)
        assert sum(s["replays"] for s in e.summary().values()) >= 2 * len(e.segments)
        assert _frames() == before
        # the process's referee: no tensor a step made outlives it (weak references, the
        # collector off), unless it became the model's state
        kept = outlived(left, m)
        assert not kept, [(tuple(t.shape), t.dtype) for t in kept]
    finally:
        if was:
            gc.enable()
