"""State an op sizes in the forward (an empty buffer a kernel resizes and fills: a lazily
initialized running statistic, a per-channel observer's min/max) is replayed with the shape
the op was given, not the one the window left: the replay takes the forward's branch, and
gradients equal plain PyTorch's bit for bit, the replayed probe's replay (``budget="min"``)
included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_replay as lr

D, B = 16, 8


class LazyStat(nn.Module):
    """A running mean of its input, empty until the first forward fills it with ``out=``."""

    def __init__(self, dim: int | None) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.dim = dim
        self.register_buffer("stat", torch.empty(0))

    def forward(self, x):
        with torch.no_grad():
            if self.stat.numel() == 0:  # first call: sized and filled by the kernel
                if self.dim is None:
                    torch.mean(x, dim=0, out=self.stat)
                else:
                    torch.amax(x, dim=self.dim, out=self.stat)
            else:
                self.stat.mul_(0.5).add_(x.mean(0) if self.dim is None else x.amax(self.dim))
        s = self.stat if self.dim is None else self.stat.mean()
        return x + torch.tanh(self.lin(x)) * (1 + s)


class Net(nn.Module):
    def __init__(self, dim: int | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LazyStat(dim) for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(engine_kw: dict | None, dim: int | None, steps: int = 4):
    torch.manual_seed(0)
    net = Net(dim)
    engine = lr.install(net, ["blocks.0", "blocks.1"], **engine_kw) if engine_kw else None
    grads = _steps(net, steps, lr=0.1)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    if engine is not None:
        engine.uninstall()
    return grads, state


def _steps(net: nn.Module, steps: int, lr: float) -> list[dict]:
    """``steps`` SGD steps on seeded batches: each step's gradients."""
    grads = []
    for s in range(steps):
        x = torch.randn(B, D, generator=torch.Generator().manual_seed(s))
        net(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(lr * p.grad)
                p.grad = None
    return grads


@pytest.mark.parametrize("dim", [None, 1], ids=["mean_per_feature", "amax_per_row"])
@pytest.mark.parametrize("kw", [{}, {"budget": "min"}], ids=["auto", "min"])
def test_state_a_kernel_sizes_in_the_forward_replays_at_its_forward_shape(kw, dim):
    want_grads, want_state = _train(None, dim)
    got_grads, got_state = _train({"on_violation": "raise", **kw}, dim)
    for step, (w, g) in enumerate(zip(want_grads, got_grads)):
        bad = [n for n in w if not torch.equal(w[n], g[n])]
        assert not bad, f"step {step}: gradients differ from plain PyTorch: {bad}"
    bad = [k for k in want_state if not torch.equal(want_state[k], got_state[k])]
    assert not bad, bad


# ------------------------------------------------------------- a freed output's address reused
def _qat_blocks(n: int) -> nn.Module:
    """``n`` quantization-aware blocks (``prepare_qat``, fbgemm: per-channel weight observers
    whose ``min_val``/``max_val`` are empty until ``fused_moving_avg_obs_fake_quant`` sizes
    them in the first forward, and resizes ``scale``/``zero_point`` with them)."""
    from torch.ao import quantization as q

    class QBlk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.out = nn.Linear(D, D)
            self.qconfig = q.get_default_qat_qconfig("fbgemm")

        def forward(self, x):
            return x + self.out(torch.relu(self.lin(x)))

    net = nn.Sequential(*(QBlk() for _ in range(n)))
    for b in net:
        q.prepare_qat(b, inplace=True)
    return net


def _qat_run(net: nn.Module, engine_kw: dict | None, steps: int = 3) -> list[dict]:
    import warnings

    engine = lr.install(net, "*", **engine_kw) if engine_kw is not None else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch.ao's deprecation and observer warnings)
            return _steps(net, steps, lr=0.05)
    finally:
        if engine is not None:
            engine.uninstall()


@pytest.mark.parametrize("kw", [{}, {"budget": "min"}], ids=["auto", "min"])
def test_state_sized_at_a_freed_outputs_address_is_still_state(kw):
    """The probe names the storages the segment's own ops made by address, to leave them out
    of its state. An observer's empty ``min_val`` is given storage inside the forward, and the
    allocator may hand it an address an output freed a moment before had: by address alone it
    was the segment's own, so went unwatched, and the replay saw the forward's running min/max
    with ``scale`` put back at its empty-time shape: ``IndexError: select(): index 1 out of
    range`` inside the fused kernel (or other scales: wrong gradients), in about a third of
    fresh models. Whether an address is reused is the allocator's choice, so a dozen fresh
    models of six blocks each are trained (before the fix, 12 of 16 two-block models passed)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        want = _qat_run(_qat_blocks(6), None)
        for attempt in range(12):
            torch.manual_seed(0)
            got = _qat_run(_qat_blocks(6), {"on_violation": "raise", **kw})
            for step, (w, g) in enumerate(zip(want, got)):
                bad = [n for n in w if not torch.equal(w[n], g[n])]
                assert not bad, f"model {attempt}, step {step}: gradients differ: {bad[:4]}"


def test_an_address_is_the_segments_own_only_while_that_storage_lives():
    """:meth:`DiscoveryMode._made_here`, made deterministic: two storages at one address, the
    first dead before the second is made (numpy memory, as the allocator would reuse it)."""
    import numpy as np

    from lightning_replay.core.mechanisms.discovery import DiscoveryMode
    from lightning_replay.core.mechanisms.preservation import RegionLog
    from lightning_replay.core.base.state import storage_key

    arr = np.zeros(64, dtype=np.float32)
    mode = DiscoveryMode(RegionLog(), set())
    made = torch.from_numpy(arr)
    key = storage_key(made)
    import weakref

    mode.produced[key] = weakref.ref(made.untyped_storage())
    assert mode._made_here(key, made)
    del made
    state = torch.from_numpy(arr)  # another storage, at the same address
    assert storage_key(state) == key
    assert not mode._made_here(key, state)
    assert key not in mode.produced


def test_a_touch_at_another_storages_address_is_kept_apart():
    """:meth:`DiscoveryMode._touched_at`, made deterministic: a second storage at an address
    a touched storage had (two live storages over the same bytes here; in training, the next
    storage the allocator made after a growing ``resize_`` moved the first) is touched anew,
    and the first touch is kept apart under a key no address has, with its own storage."""
    import ctypes

    from lightning_replay.core.mechanisms.discovery import DiscoveryMode
    from lightning_replay.core.mechanisms.preservation import RegionLog
    from lightning_replay.core.base.state import storage_key

    first = torch.arange(4.0)
    addr = first.untyped_storage().data_ptr()
    raw = (ctypes.c_byte * 16).from_address(addr)
    second = torch.frombuffer(raw, dtype=torch.float32)
    assert storage_key(second) == storage_key(first)
    log = RegionLog()
    mode = DiscoveryMode(log, set(), copy_below=1 << 20)
    with mode:
        first.sum()
        second.sum()
    touches = list(mode.touched.values())
    assert len(touches) == 2
    assert {id(t.tensor.untyped_storage()) for t in touches} == {
        id(first.untyped_storage()),
        id(second.untyped_storage()),
    }
    assert mode.touched[storage_key(first)].tensor.untyped_storage() is second.untyped_storage()
    mode.release()
    assert not log.armed.get(storage_key(first))
