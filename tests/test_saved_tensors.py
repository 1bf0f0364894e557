"""Saved tensors modified in place before backward: an error, never wrong gradients.

Autograd skips its "modified by an inplace operation" check for tensors packed by saved-tensor
hooks, and lightning_replay installs such hooks (the probe, exact memory accounting). Its
handles keep the check.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.apps.sparse_write import SparseWriteModel, sparse_write_input
from tests.helpers.compare import assert_same_grads, train_steps


class _ReadsBufferItself(nn.Module):
    """Saves its buffer for backward (no clone); the step writes the buffer afterwards."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("bank", torch.randn(16, 8))

    def forward(self, x):
        return torch.softmax(self.fc(x) @ self.bank.t(), dim=1) @ self.bank


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(_ReadsBufferItself(), _ReadsBufferItself())

    def forward(self, x):
        h = self.blocks(x)
        with torch.no_grad():
            for b in self.blocks:
                b.bank[:2] = h[:2].detach()
        return h


def _loss_backward(model, x):
    model(x).pow(2).mean().backward()


def test_plain_pytorch_rejects_the_model():
    with pytest.raises(RuntimeError, match="inplace operation"):
        _loss_backward(_Net(), torch.randn(4, 8))


@pytest.mark.parametrize(
    "kwargs", [{}, {"track_memory": True}, {"budget": "min"}, {"preservation": "whole"}]
)
def test_engine_raises_instead_of_wrong_gradients(kwargs):
    torch.manual_seed(0)
    model = _Net()
    lr.install(model, "blocks.*", **kwargs)
    with pytest.raises(lr.SavedTensorModified) as err:
        for _ in range(3):
            _loss_backward(model, torch.randn(4, 8))
    msg = str(err.value)
    assert "blocks.1.bank" in msg and "segment 'blocks.1'" in msg
    assert "clone()" in msg and "when saved" in msg and "at backward" in msg
    assert isinstance(err.value, RuntimeError)


def test_accounting_keeps_the_check_outside_segments():
    torch.manual_seed(0)
    model = _Net()
    # only blocks.0 is a segment: blocks.1 runs outside, under the accounting hooks
    engine = lr.install(model, ["blocks.0"], track_memory=True)
    with pytest.raises(lr.SavedTensorModified, match="blocks.1.bank"):
        for _ in range(3):
            with engine.window():
                _loss_backward(model, torch.randn(4, 8))


@pytest.mark.parametrize("preservation", ["auto", "whole", "regions"])
def test_sparse_write_model_trains_exactly(preservation):
    torch.manual_seed(0)
    proto = SparseWriteModel(blocks=3, dim=16, hidden=32, buffer_rows=64, write_rows=4)
    make_input = lambda s: sparse_write_input(s, 8, 16)  # noqa: E731
    g_ref, _ = train_steps(copy.deepcopy(proto), make_input, 4)
    model = copy.deepcopy(proto)
    engine = lr.install(model, proto.segments, preservation=preservation)
    g_rep, _ = train_steps(model, make_input, 4)
    assert_same_grads(g_ref, g_rep)
    assert all(s["replays"] == 3 for s in engine.summary().values())
