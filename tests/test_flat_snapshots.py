"""Whole snapshots taken as one flat buffer per invocation (issue 16) keep the byte-level
semantics of one copy per storage.

Every test trains a model under ``lr.install(preservation="whole")`` and in plain PyTorch from
identical copies and asserts bit-identical gradients at every step and identical state after
(the harness of ``tests/test_exactness.py``). The state is chosen to stress what one flat buffer
could get wrong: storages of several dtypes and sizes (odd byte counts, so the entries of the
flat buffer are not aligned to their element size), non-contiguous and offset views, two state
tensors over one storage, storages larger than the swap's bounded temporary, and a storage
swapped for another between a segment's forward and its replay.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_exactness import SEGS2, Stack, assert_exact

D = 8


class MixedState(nn.Module):
    """Reads and updates (in place, like batch-norm statistics) state of several dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("f64", torch.zeros(3, D, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("flags", torch.zeros(5, dtype=torch.bool))  # 5 bytes: misaligns
        self.register_buffer("h16", torch.ones(7, dtype=torch.float16))
        base = torch.arange(4 * D, dtype=torch.float32).reshape(D, 4)
        self.register_buffer("base", base)
        self.t_view = self.base.t()  # non-contiguous view of a buffer: a second entry
        self.tail = self.base[2:, 1:]  # an offset, strided view of the same storage

    def forward(self, x):
        h = self.lin(x) + self.f64[0].float() + self.t_view[1] * 0.01 + self.tail.sum() * 1e-3
        h = h * self.h16.float().mean() + self.count.float() * 0.1
        h = h if bool(self.flags[int(self.count) % 5]) else -h
        with torch.no_grad():  # in-place writes inside the segment (replay must not leak)
            self.f64.mul_(0.5).add_(h.detach().double().mean(0))
            self.count.add_(1)
            self.flags[int(self.count) % 5] = ~self.flags[int(self.count) % 5]
            self.h16.mul_(0.9).add_(0.1)
            self.tail.add_(0.25)  # writes through the view: the whole storage is state
        return x + torch.tanh(h)


class ShiftAfter(Stack):
    """After the blocks the step writes every block's state again, before backward."""

    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.f64.add_(h.detach().double().sum())
                b.base.mul_(1.01)
                b.h16.add_(0.5)


def test_state_of_mixed_dtypes_views_and_aliases_written_in_and_after_the_segment():
    summary, _ = assert_exact(lambda: ShiftAfter([MixedState(), MixedState()]), SEGS2, "whole")
    assert all(s["mode"] == "whole" for s in summary.values()), summary


class BigAndSmall(nn.Module):
    """Small statistics next to a bank larger than the swap's 4 MiB temporary."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("bank", torch.zeros(rows, D))
        self.register_buffer("mean", torch.zeros(D))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        h = self.lin(x) + self.bank[:64].mean(0) + self.mean
        with torch.no_grad():
            self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            self.steps.add_(1)
        return x + torch.tanh(h) * (1 + self.steps.float() * 0.01)


class BankShift(Stack):
    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.bank[:64].add_(h.detach().mean())


@pytest.mark.parametrize("rows", [160_000, 8], ids=["bank_5MiB", "bank_tiny"])
def test_large_and_small_snapshots_in_one_invocation(rows):
    assert_exact(lambda: BankShift([BigAndSmall(rows), BigAndSmall(8)]), SEGS2, "whole", steps=4)


class Rebinder(Stack):
    """Replaces a block's buffer storage after the segment, without a write (``.data =``), and
    resizes another one: the replay must read the forward's bytes, the step the new ones."""

    def after(self, h):
        with torch.no_grad():
            b0, b1 = self.blocks
            b0.f64.data = b0.f64.data * 2 + 1
            b1.h16.resize_(9).fill_(0.5)


def test_storage_replaced_and_resized_between_forward_and_replay():
    assert_exact(lambda: Rebinder([MixedState(), MixedState()]), SEGS2, "whole")


class Twice(Stack):
    """The first block runs twice per step: two calls of one segment wait for backward at once,
    each with its own snapshot (and the step writes the state between and after them)."""

    def forward(self, x):
        b0, b1 = self.blocks
        x = b0(x)
        with torch.no_grad():
            b0.f64.add_(1.0)
        x = b1(b0(x))
        self.after(x)
        return self.head(x)


def test_one_segment_called_twice_per_step_with_state_written_between():
    assert_exact(lambda: Twice([MixedState(), MixedState()]), SEGS2, "whole", min_replays=3)


def test_snapshot_pools_and_slot_captures_do_not_keep_a_model_alive():
    import gc
    import weakref

    import lightning_replay as lr

    model = ShiftAfter([MixedState(), MixedState()])
    engine = lr.install(model, SEGS2, preservation="whole")
    for _ in range(3):  # probe, then steady steps that reuse the pools and captures
        model(torch.randn(4, D)).pow(2).mean().backward()
    assert all(s["replays"] for s in engine.summary().values())
    engine.uninstall()
    ref = weakref.ref(model)
    del model, engine
    gc.collect()
    assert ref() is None
