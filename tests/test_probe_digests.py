"""A probe under a byte budget keeps a digest, not a copy, of big state (issue 31).

Its replay then puts a big storage back from the region log alone. Where a write comes that no
log sees, the probe still copies (an op that writes without a schema annotation: batch norm's
running statistics) or, where it cannot, says so: a write after the window's forward to big
state, or a replay's write no log saw, is a recorded divergence (``ReplayError`` under
``on_violation="raise"``), never silently wrong gradients or state. The reference is plain
PyTorch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.mechanisms.discovery import COPY_BELOW
from lightning_replay.errors import ReplayError

W = 64


class Norm(nn.Module):
    """A block with a batch norm whose running statistics are bigger than what a probe copies
    by size (:data:`COPY_BELOW`)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.a = nn.Linear(W, features)
        self.bn = nn.BatchNorm1d(features)
        self.b = nn.Linear(features, W)

    def forward(self, x):
        return self.b(torch.tanh(self.bn(self.a(x))))


class Reads(nn.Module):
    """A block that reads ``rows`` rows of a buffer."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.l = nn.Linear(W, W)
        self.register_buffer("buf", torch.randn(rows, W))

    def forward(self, x):
        return torch.tanh(self.l(x)) * self.buf[: x.shape[0]].sum(0)


def _train(make, names, budget, steps=3, window=False, write_after=None):
    """Train ``make()`` with SGD (replay if ``budget`` is not False); returns its state and
    its last gradients. ``write_after(model)`` runs after the forward, before backward,
    inside the window if ``window``."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = lr.install(model, names, budget=budget) if budget is not False else None
    grads = []
    try:
        for s in range(steps):
            x = torch.randn(8, W, generator=torch.Generator().manual_seed(s))
            ctx = engine.window() if window and engine is not None else contextlib.nullcontext()
            with ctx:
                loss = model(x).pow(2).mean()
                if write_after is not None:
                    write_after(model)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    finally:
        if engine is not None:
            engine.uninstall()
    return {k: v.clone() for k, v in model.state_dict().items()}, grads


def _same(a, b) -> None:
    (sa, ga), (sb, gb) = a, b
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs from plain PyTorch"
    assert all(torch.equal(x, y) for x, y in zip(ga, gb)), "gradients differ from plain PyTorch"


@pytest.mark.parametrize("budget", ["min", None])
def test_big_batch_norm_statistics_are_copied_before_their_unannotated_write(budget):
    """Eager batch norm writes its running statistics with no schema annotation: no log sees
    it. A probe that kept only their digest could not put them back, and its replay would
    update them a second time (outputs alike: training mode reads the batch's statistics)."""
    features = 2 * COPY_BELOW // 4  # float32 statistics of twice the size copied by size

    def make():
        return nn.Sequential(Norm(features), Norm(16), nn.Linear(W, 1))

    want = _train(make, ["0", "1"], False)
    _same(_train(make, ["0", "1"], budget), want)


@pytest.mark.parametrize("rows", [16, 4 * COPY_BELOW // (4 * W)])
def test_big_state_written_after_the_window_forward_is_never_silent(rows):
    """State written after the window's forward (no capture runs there) and before backward:
    a small storage's first-touch copy puts it back for the probe's replay; a big one's digest
    finds the change, which is refused loudly, naming it. Written inside the window, both
    are exact."""

    def make():
        return nn.Sequential(Reads(rows), Reads(16), nn.Linear(W, 1))

    def write(model):
        model[0].buf.mul_(0.5)

    want = _train(make, ["0", "1"], False, write_after=write)
    if rows * W * 4 <= COPY_BELOW:
        _same(_train(make, ["0", "1"], "min", write_after=write), want)
    else:
        with pytest.raises(ReplayError, match=r"0\.buf changed with no logged write"):
            _train(make, ["0", "1"], "min", write_after=write)
    _same(_train(make, ["0", "1"], "min", window=True, write_after=write), want)
    # without a byte budget the probe is retained: nothing to put back, and the contract
    # preserves the buffer whole
    _same(_train(make, ["0", "1"], None, write_after=write), want)


class Unlogged(nn.Module):
    """A block whose big buffer is written by an op that declares no write (a custom op with
    a wrong schema): no dispatch mode sees the write as one."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(W, W)
        self.register_buffer("buf", torch.zeros(4 * COPY_BELOW // (4 * W), W))

    def forward(self, x):
        h = torch.tanh(self.l(x))
        with torch.no_grad():
            _undeclared_add(self.buf, 1.0)
        return h


_LIB = torch.library.Library("probe_digests_test", "DEF")
_LIB.define("undeclared_add(Tensor t, float v) -> ()")


def _undeclared_impl(t, v):
    t.data.add_(v)  # (below dispatch: the write reaches no mode)


_LIB.impl("undeclared_add", _undeclared_impl, "CompositeExplicitAutograd")


def _undeclared_add(t, v):
    torch.ops.probe_digests_test.undeclared_add(t, v)


def test_a_replay_write_no_log_sees_is_a_divergence_not_silent():
    """The replay of a probe that kept a digest of a big buffer writes it again with an op
    that declares no write: the buffer would be written twice this step. It is refused."""

    def make():
        return nn.Sequential(Unlogged(), Reads(16), nn.Linear(W, 1))

    with pytest.raises(ReplayError, match=r"0\.buf with an op that no capture logs"):
        _train(make, ["0", "1"], "min")
