"""The whole-process walk that measures a step's base survives what a process may hold: a dead
weak proxy (``isinstance`` on it raises ``ReferenceError``) made every measured step raise for
the rest of the process, in the full suite's order only."""

from __future__ import annotations

import weakref

import torch

from lightning_replay.memory import process_tensor_bytes
from tests.helpers.torch_memory import process_tensor_bytes as referee_bytes


class _Thing:
    pass


def test_a_dead_weak_proxy_does_not_stop_the_walk():
    thing = _Thing()
    held = [weakref.proxy(thing)]  # a list keeps the proxy tracked by the collector
    del thing
    x = torch.zeros(1 << 16)
    assert process_tensor_bytes() >= x.nbytes
    assert referee_bytes() >= x.nbytes
    assert len(held) == 1
