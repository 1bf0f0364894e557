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


def test_a_gradient_only_cpp_holds_is_counted():
    """A leaf's ``.grad`` lives in C++ until Python reads it: no object of the walk holds it.
    A micro-batch's window begins with the gradients the earlier ones made (grad_accumulation
    in test_adversary_memory: 6 MiB missing from each measured base before)."""
    w = torch.nn.Parameter(torch.randn(1 << 18))  # 1 MiB
    before = process_tensor_bytes(), referee_bytes()
    (w * 2).sum().backward()  # the gradient is made in C++; no Python object holds it
    grad = w.untyped_storage().nbytes()
    assert process_tensor_bytes() - before[0] >= grad
    assert referee_bytes() - before[1] >= grad


def test_a_lazy_modules_uninitialized_parameter_does_not_stop_the_walk():
    """An uninitialized parameter (a lazy module not yet run) raises ``ValueError`` when asked
    for its storage: it made every measured step raise while one was alive anywhere in the
    process (found in a Trainer fit that ran after a test holding a lazy module)."""
    lazy = torch.nn.LazyLinear(4)
    x = torch.zeros(1 << 16)
    assert process_tensor_bytes() >= x.nbytes
    assert referee_bytes() >= x.nbytes
    assert isinstance(lazy.weight, torch.nn.parameter.UninitializedParameter)
