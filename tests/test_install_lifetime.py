"""A model installed and dropped without ``uninstall()`` is freed with its engine (issue 31).

The classes :func:`lightning_replay.install` swaps in hold the runtimes; before, a global
registry keyed weakly by module held each runtime as its value, and the runtime held the
engine, the engine the model, the model the key: every model installed and never uninstalled
stayed alive for the life of the process, whatever collected. In the full test suite one such
model (from a test that ends without uninstalling) made later tests' tensors outlive their
``uninstall()`` with the cyclic collector off. Referee: weak references and the garbage
collector, never the engine's counters.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import lightning_replay as lr


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Blk() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _steps(model: nn.Module, n: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(n):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("window", ["root", "manual"])
def test_a_model_dropped_without_uninstall_is_freed(window):
    """Model and engine dropped, never uninstalled: one collection frees both."""
    torch.manual_seed(0)
    model = Net()
    engine = lr.install(model, "blocks.*", window=window, on_violation="record")
    eng_ref = weakref.ref(engine)
    del engine
    if window == "root":
        _steps(model)  # the model keeps its engine: replay still runs
        assert eng_ref() is not None and eng_ref().step >= 3
    refs = [weakref.ref(model), weakref.ref(model.blocks[0].a.weight), eng_ref]
    del model
    gc.collect()
    assert all(r() is None for r in refs), "an installed model dropped without uninstall lives on"


def test_uninstalled_model_is_freed_without_the_collector():
    torch.manual_seed(0)
    model = Net()
    engine = lr.install(model, "blocks.*", on_violation="record")
    _steps(model)
    gc.collect()
    gc.disable()
    try:
        engine.uninstall()
        refs = [weakref.ref(p) for p in model.parameters()]
        del model
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_copies_of_an_installed_model_are_plain_and_reinstall_is_refused():
    model = Net()
    engine = lr.install(model, "blocks.*", on_violation="record")
    for cp in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(cp.blocks[0]) is Blk and type(cp) is Net
        lr.install(cp, "blocks.*").uninstall()  # a copy has no engine attached
    with pytest.raises(lr.ReplayConfigError, match="already has lightning_replay installed"):
        lr.install(model, "blocks.*")
    engine.uninstall()
    assert type(model.blocks[0]) is Blk
    lr.install(model, "blocks.*").uninstall()


class _Counts(nn.Module):
    """Reads a load counter buffer, then writes it in place within its own forward (a
    mixture-of-experts balancing counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.register_buffer("load", torch.zeros(16))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x - 0.01 * self.load)))
        self.load.add_(h.detach().abs().mean(0))
        return h


class _CountsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Counts() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize(
    "install",
    [
        {"preservation": "regions"},
        {"budget": "min", "selective": "matmul", "planner": "selective_all"},
    ],
    ids=["regions", "selective_regions"],
)
def test_uninstall_between_forward_and_backward_with_a_logged_write(install):
    """Uninstalled after a forward whose segments wrote a buffer they read (logged in the
    forward's window), before its backward: the replays still undo those writes, match plain
    PyTorch, and give the log back as they release. Before: ``ContractViolation: state
    'blocks.1.load' was written outside the logged window`` (uninstall cleared the log the
    pending replays undo from; keeping it while armed then kept a raising segment's buffer
    alive, since a forward that raised never gave its arms back)."""
    torch.manual_seed(0)
    ref = _CountsNet()
    rep = copy.deepcopy(ref)
    engine = lr.install(rep, ["blocks.0", "blocks.1"], **install)
    for m in (ref, rep):
        _steps(m, 4)
    outs = [m(torch.randn(8, 16, generator=torch.Generator().manual_seed(9))) for m in (ref, rep)]
    engine.uninstall()
    for o in outs:
        o.pow(2).mean().backward()
    for (n, p), q in zip(ref.named_parameters(), rep.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert torch.equal(ref.blocks[1].load, rep.blocks[1].load)
    del outs
    assert not engine.log.logs and not engine.log.armed  # (given back by the replays)
