"""Adversarial models (session 19): storage the allocator gives an address another storage had,
at the moment the engine still names state by that address.

The engine names storages by ``storage_key`` = (device, data pointer). A growing ``resize_``
frees a storage's old bytes in place (the tensor and storage objects stay), an output freed
inside the forward leaves its address free, a rebound buffer (``self.buf = new``) drops the
old one: the next allocation of that size (glibc hands a freed 4 KiB block back at once) is
another storage at the same address. Each model here makes that happen where real training
code does: lazily sized state (``resize_``, ``out=`` ops, fused observers, ``nn.Lazy*``),
queues and memory banks grown inside the forward or between forward and backward, a
temporary of the state's size freed just before the state is sized, buffers rebound in the
forward, state whose size changes every step, torch.ao QAT (fbgemm per-channel, qnnpack
per-tensor, the non-fused ``FakeQuantize`` with a per-channel moving-average observer), and
``untyped_storage().resize_(0)`` then regrow of a buffer, as FSDP does with parameters.

Referee: plain PyTorch with the same seeds, every step's gradients and the final state bit for
bit, under ``{}``, ``preservation="whole"``, ``preservation="regions"`` and ``budget="min"``,
with ``on_violation="raise"`` (a raised violation or any torch traceback is a failure). Where
whether an address is reused is the allocator's choice, a few fresh models are trained in one
test, so that a per-model chance becomes near-certain.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import lightning_replay as lr
from tests.helpers.compare import diff_state, grad_diffs, snapshot_state

D, B = 8, 4
STEPS = 4
SEGS = ["blocks.0", "blocks.1", "blocks.2"]


def _churn(nbytes: int) -> None:
    """Allocate and free ``nbytes``: glibc hands the block back to the next allocation of that
    size (a storage sized right after gets the address a just-freed one had)."""
    a = torch.empty(nbytes // 4)
    del a


# --------------------------------------------------------------------------- the blocks
class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def core(self, x, s):
        return x + self.out(torch.tanh(self.lin(x) * (1 + s)))


class LazyQueue(Base):
    """A queue empty until the first forward, then grown by ``resize_`` inside every forward
    (its old bytes freed, a temporary of the new size freed right before), its new rows
    written, and read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("queue", torch.empty(0))

    def forward(self, x):
        with torch.no_grad():
            n = self.queue.numel() // D
            t = torch.tanh(x) * 0.5  # a temporary, freed before the queue grows
            row = t.mean(0)
            del t
            _churn((n + 1) * D * 4)
            self.queue.resize_(n + 1, D)
            self.queue[n].copy_(row)
        return self.core(x, self.queue.mean(0))


class OutSized(Base):
    """State sized by an ``out=`` op every forward; the batch size changes every step, so the
    state is reallocated to another size each time (growing and shrinking)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cum", torch.empty(0))

    def forward(self, x):
        with torch.no_grad():
            _churn(x.numel() * 4)
            torch.cumsum(x.detach(), 0, out=self.cum)
        return self.core(x, self.cum[-1] * 0.1)


class RebindInForward(Base):
    """``self.buf = ...`` inside the forward (an EMA rebound, not written in place): the old
    buffer dies there, and the new one may get the address of a temporary freed a moment
    before."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(D))

    def forward(self, x):
        with torch.no_grad():
            m = x.detach().mean(0)
            self.buf = self.buf * 0.9 + m * 0.1
        return self.core(x, self.buf)


class History(Base):
    """A rolling history rebound by ``torch.cat`` in the forward: its size changes every step
    (up to a cap, then rolls)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("hist", torch.zeros(1, D))

    def forward(self, x):
        with torch.no_grad():
            self.hist = torch.cat([self.hist, x.detach().mean(0, keepdim=True)])[-3:]
        return self.core(x, self.hist.mean(0))


class Bank(Base):
    """A memory bank read by the forward; the root grows it by ``resize_`` after the forward
    (see :class:`GrowAfter`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bank", torch.randn(2, D))

    def forward(self, x):
        return self.core(x, self.bank.mean(0))


class Net(nn.Module):
    def __init__(self, blk: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blk() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def after_block(self, i: int, blk: nn.Module, y: torch.Tensor) -> None:
        pass

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            self.after_block(i, b, x)
        return self.head(x)


class GrowAfter(Net):
    """After each block's forward (inside the window): its bank grows by ``resize_`` (old bytes
    freed), a temporary of the old size is allocated there and written in place, then freed;
    the next block's activations follow."""

    def __init__(self) -> None:
        super().__init__(Bank)

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n = blk.bank.shape[0]
            blk.bank.resize_(n + 1, D)
            blk.bank[n].copy_(y.detach().mean(0))
            tmp = torch.empty(n, D)  # likely at the bank's old address
            tmp.fill_(3.0)
            tmp.mul_(2.0)
            del tmp


class StealAfter(Net):
    """After each block's forward: its bank grows (old bytes freed); the *next* block's bank
    is rebound to a new tensor of the old size (likely at the old address) and written in
    place there, in the window of both."""

    def __init__(self) -> None:
        super().__init__(Bank)

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n, old = blk.bank.shape[0], blk.bank.data_ptr()
            blk.bank.resize_(n + 1, D)
            blk.bank[n].copy_(y.detach().mean(0))
            if i + 1 < len(self.blocks):
                nxt = self.blocks[i + 1]
                # the allocator's choice made near-certain: the first of a few fresh tensors
                # of the old size that lands at the old address
                pool = [torch.empty(n, D) for _ in range(16)]
                new = next((a for a in pool if a.data_ptr() == old), pool[0])
                del pool
                new.copy_(nxt.bank[:n] if nxt.bank.shape[0] >= n else nxt.bank.mean(0))
                new.mul_(0.5)
                nxt.bank = new


class FreeRegrow(Net):
    """FSDP's free and regather, on a buffer: after each block's forward its bank's storage is
    freed (``untyped_storage().resize_(0)``) and a blocker of the same size takes the address;
    regrown (elsewhere) and refilled before the block's backward."""

    def __init__(self) -> None:
        super().__init__(Bank)
        self.keep: dict[int, torch.Tensor] = {}
        self.blockers: list[torch.Tensor] = []

    def after_block(self, i, blk, y):
        with torch.no_grad():
            self.keep[i] = blk.bank.detach().clone()
            blk.bank.untyped_storage().resize_(0)
            b = torch.empty_like(self.keep[i])
            b.fill_(7.0)  # a write at the freed address
            self.blockers.append(b)
        y.register_hook(lambda g, i=i, blk=blk: self._regrow(i, blk, g))

    def _regrow(self, i, blk, g):
        st = blk.bank.untyped_storage()
        keep = self.keep.pop(i)
        if st.nbytes() == 0:
            st.resize_(keep.numel() * keep.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(blk.bank):
                blk.bank.copy_(keep)
        return g

    def forward(self, x):
        self.blockers = []
        return super().forward(x)


# --------------------------------------------------------------------------- QAT
def _qat(backend: str, fused: bool = True) -> Callable[[], nn.Module]:
    def make():
        from torch.ao import quantization as q

        if fused:
            qconfig = q.get_default_qat_qconfig(backend)
        else:  # the non-fused FakeQuantize with per-channel moving-average observers
            qconfig = q.QConfig(
                activation=q.FakeQuantize.with_args(
                    observer=q.MovingAverageMinMaxObserver, quant_min=0, quant_max=255
                ),
                weight=q.FakeQuantize.with_args(
                    observer=q.MovingAveragePerChannelMinMaxObserver,
                    quant_min=-128,
                    quant_max=127,
                    dtype=torch.qint8,
                    qscheme=torch.per_channel_symmetric,
                ),
            )

        class QBlk(Base):
            def __init__(self) -> None:
                super().__init__()
                self.qconfig = qconfig

            def forward(self, x):
                return x + self.out(torch.relu(self.lin(x)))

        net = Net(QBlk)
        for b in net.blocks:
            q.prepare_qat(b, inplace=True)
        return net

    return make


def _qat_schedule(model: nn.Module, step: int) -> None:
    """A QAT schedule: observers reset at step 1 (their ``min_val``/``max_val`` rebound to
    empty tensors, sized again by the next forward's fused op), turned off from step 2 (the
    scales frozen), fake quantization off at step 3."""
    from torch.ao import quantization as q

    if step == 1:
        for m in model.modules():
            if hasattr(m, "reset_min_max_vals"):
                m.reset_min_max_vals()
    if step == 2:
        model.apply(q.disable_observer)
    if step == 3:
        model.apply(q.disable_fake_quant)


class Twice(nn.Module):
    """One block called twice per step (weights shared, a recurrent step): its lazy queue
    grows by ``resize_`` inside each call, so each call reads another storage, the second
    maybe at an address the first call freed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LazyQueue() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(b(x))
        return self.head(x)


class LazyBlk(Base):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(D)

    def forward(self, x):
        return self.core(x, 0.0)


class BNBlk(Base):
    """BatchNorm whose ``track_running_stats`` the root turns off and on between steps
    (see :func:`_toggle_bn`), momentum ``None`` (a cumulative average: it reads
    ``num_batches_tracked``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D, momentum=None)

    def forward(self, x):
        return x + self.out(torch.tanh(self.bn(self.lin(x))))


def _toggle_bn(model: nn.Module, step: int) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.track_running_stats = step % 2 == 1


# --------------------------------------------------------------------------- referee
class Written(Net):
    """A bank each block reads, written in place by the training loop after the model's
    forward, before backward (outside the window: see :func:`_write_banks`). Plain PyTorch
    never saved it; a replay that reads it new is wrong, so the engine must either keep its
    forward's bytes or refuse (a violation) by its version."""

    def __init__(self) -> None:
        super().__init__(Bank)


class StealThenWritten(StealAfter):
    """:class:`StealAfter` (the next block's bank rebound where this block's grown bank was),
    and the banks written in place after the forward, outside the window."""


def _write_banks(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        for b in model.blocks:
            b.bank.mul_(0.5)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    before: Callable | None = None  # (model, step) before the forward
    after: Callable | None = None  # (model, step) after the forward, before backward
    refusal_ok: bool = False  # a ContractViolation (the engine saw the write) is a right answer


MODELS: dict[str, Case] = {
    "lazy_queue_resized_in_forward": Case(lambda: Net(LazyQueue)),
    "out_sized_state_size_changes_every_step": Case(lambda: Net(OutSized)),
    "buffer_rebound_in_forward": Case(lambda: Net(RebindInForward)),
    "history_rebound_by_cat_in_forward": Case(lambda: Net(History)),
    "bank_grown_then_temp_written_at_old_address": Case(GrowAfter),
    "bank_grown_then_next_bank_rebound_at_old_address": Case(StealAfter),
    "bank_written_after_forward": Case(Written, after=_write_banks, refusal_ok=True),
    "bank_rebound_at_old_address_then_written_after_forward": Case(
        StealThenWritten, after=_write_banks, refusal_ok=True
    ),
    "buffer_storage_freed_and_regrown": Case(FreeRegrow),
    "qat_fbgemm_per_channel": Case(_qat("fbgemm")),
    "qat_qnnpack_per_tensor": Case(_qat("qnnpack")),
    "qat_fakequantize_per_channel_moving_average": Case(_qat("fbgemm", fused=False)),
    "qat_fbgemm_observers_reset_then_disabled": Case(_qat("fbgemm"), before=_qat_schedule),
    "qat_fakequantize_observers_reset_then_disabled": Case(
        _qat("fbgemm", fused=False), before=_qat_schedule
    ),
    "lazy_queue_block_called_twice": Case(Twice),
    "lazy_linear": Case(lambda: Net(LazyBlk)),
    "batchnorm_track_running_stats_toggled": Case(lambda: Net(BNBlk), before=_toggle_bn),
}

SETTINGS = {
    "auto": {},
    "whole": {"preservation": "whole"},
    "regions": {"preservation": "regions"},
    "min": {"budget": "min"},
}

#: fresh models trained per test (whether an address is reused is the allocator's choice)
FRESH = 3


def _x(step: int) -> torch.Tensor:
    n = B + (step % 2) * 2  # the batch size changes every step
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1000 + step))


def _train(case: Case, setting: dict | None):
    torch.manual_seed(0)
    model = case.make()
    eng = lr.install(model, SEGS, on_violation="raise", **setting) if setting is not None else None
    grads = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch.ao's deprecation and observer warnings)
            for step in range(STEPS):
                if case.before is not None:
                    case.before(model, step)
                torch.manual_seed(100 + step)
                loss = (model(_x(step)) ** 2).mean()
                if case.after is not None:
                    case.after(model, step)
                loss.backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(0.05 * p.grad)
                        p.grad = None
    finally:
        if eng is not None:
            eng.uninstall()
    return grads, snapshot_state(model)


def _problems(name: str, setting: str) -> list[str]:
    case = MODELS[name]
    with torch.random.fork_rng():
        want_g, want_s = _train(case, None)
        out = []
        for attempt in range(FRESH):
            try:
                g, s = _train(case, SETTINGS[setting])
            except Exception as e:  # noqa: BLE001 (a crash is a failure: say which)
                if case.refusal_ok and isinstance(e, lr.ContractViolation):
                    continue  # the engine saw the write it cannot undo, and said so
                out.append(f"model {attempt}: {type(e).__name__}: {str(e)[:300]}")
                break
            diffs = grad_diffs(want_g, g)
            if diffs:
                out.append(f"model {attempt}: gradients differ at {diffs[:4]}")
            if diff_state(want_s, s):
                out.append(f"model {attempt}: state differs: {diff_state(want_s, s)[:4]}")
            if out:
                break
    return out


XFAIL: dict[tuple[str, str], str] = {}


def _cases():
    for name in MODELS:
        for setting in SETTINGS:
            marks = []
            reason = XFAIL.get((name, setting)) or XFAIL.get((name, "*"))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            yield pytest.param(name, setting, id=f"{name}-{setting}", marks=marks)


@pytest.mark.parametrize("name,setting", list(_cases()))
def test_reused_address_trains_as_plain(name, setting):
    """Every step's gradients and the final state as plain PyTorch's, bit for bit, for
    ``FRESH`` fresh models (a refusal is right only where the model writes state outside the
    window after the forward)."""
    problems = _problems(name, setting)
    assert not problems, "; ".join(problems)


# --------------------------------------------------------------------------- unit tests
def _second_at_same_address(first: torch.Tensor) -> torch.Tensor:
    """Another live storage over ``first``'s bytes: what the allocator makes after a growing
    ``resize_`` freed ``first``'s old bytes (both at one address), made deterministic."""
    import ctypes

    nbytes = first.untyped_storage().nbytes()
    raw = (ctypes.c_byte * nbytes).from_address(first.untyped_storage().data_ptr())
    return torch.frombuffer(raw, dtype=first.dtype).view(first.shape)


def test_a_shared_copy_serves_only_its_own_storage():
    """:meth:`SharedWhole.serves`: a read-only copy taken for one segment's buffer is shared
    with a later call only while that call reads the same storage. Before the fix, a storage
    at the same address, of the same size and version, was served the first one's copy (the
    byte comparison reads the first storage, which a grown bank still holds): the next block's
    buffer rebound where this block's bank was replayed with this block's bank."""
    from lightning_replay.core.base.state import storage_key
    from lightning_replay.core.mechanisms.preservation import SharedWhole

    first = torch.arange(8.0).view(2, 4)
    second = _second_at_same_address(first)
    assert storage_key(second) == storage_key(first) and second._version == first._version
    sw = SharedWhole(first)
    assert sw.serves(first)
    assert not sw.serves(second)


def test_parameter_traffic_is_by_storage_not_address():
    """:meth:`DiscoveryMode._traffic`: an FSDP-managed parameter's storage read by the segment
    is left out of its state; another storage at its address (state sized after FSDP freed
    the parameter) is state."""
    import weakref

    from lightning_replay.core.base.state import storage_key
    from lightning_replay.core.mechanisms.discovery import DiscoveryMode
    from lightning_replay.core.mechanisms.preservation import RegionLog

    param = torch.arange(4.0)
    state = _second_at_same_address(param)
    key = storage_key(param)
    mode = DiscoveryMode(RegionLog(), set(), copy_below=1 << 20)
    mode.parameter_traffic[key] = weakref.ref(param.untyped_storage())
    assert mode._traffic(key, param)
    with mode:
        state.sum()
    assert [t.tensor.untyped_storage() for t in mode.touched.values()] == [state.untyped_storage()]
    mode.release()
