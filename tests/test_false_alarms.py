"""Issue 13: no false alarms and no deep crashes on models that plain PyTorch trains.

Every model here trains under plain PyTorch. Each test trains it twice from one deep copy with
the same RNG stream, once plain and once under ``lightning_replay``, and asserts that the replayed
run raises nothing, warns nothing, and ends with the same gradients at every step and the same
state (parameters, buffers, tensor and tuple attributes, generators, plain attributes), bit for
bit. Where the library must refuse by design, the test asserts one message that names the
segment, the state or argument, and the fix.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao import quantization as tq

import lightning_replay as lr
from lightning_replay.verify import diff_state, snapshot_state
from tests.helpers.compare import assert_same_grads, assert_same_state

# torch.ao.quantization announces its move to torchao on import and on use; the QAT models
# here are what users train today.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.ao.quantization is deprecated:DeprecationWarning",
    "ignore:Please use quant_min and quant_max:UserWarning",
)

D, B = 8, 6
PRESERVATIONS = ("auto", "whole", "regions")


def _x(step: int, dim: int = D, batch: int = B) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(7 + step))


def _mse_step(model: nn.Module, step: int) -> None:
    (model(_x(step)) ** 2).mean().backward()


StepFn = Callable[[nn.Module, int], None]


def _train(model: nn.Module, step_fn: StepFn, steps: int, lr_: float = 0.05) -> list[dict]:
    """SGD; the global RNG reseeded per step; ``step_fn`` runs the forward(s) and backward."""
    opt = torch.optim.SGD(model.parameters(), lr=lr_)
    grads = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        opt.zero_grad(set_to_none=True)
        step_fn(model, step)
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
    return grads


def _replays_exactly(
    make_model: Callable[[], nn.Module],
    segments,
    step_fn: StepFn = _mse_step,
    steps: int = 6,
    lr_: float = 0.05,
    **install_kw,
) -> lr.ReplayEngine:
    """Train plain and under replay from one deep copy; assert no warning, no error, same
    gradients every step and same state after. Returns the (still installed) engine."""
    torch.manual_seed(0)
    base = make_model()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, step_fn, steps, lr_)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = lr.install(model, segments, **install_kw)
        g_rep = _train(model, step_fn, steps, lr_)
    assert_same_grads(g_ref, g_rep, "replay vs plain")
    assert_same_state(snapshot_state(ref), snapshot_state(model), "replay vs plain")
    return engine


def _replayed(engine: lr.ReplayEngine, name: str) -> int:
    return engine.summary()[name]["replays"]


class Stack(nn.Module):
    """``pre`` -> blocks -> head, with an optional ``after(h)`` callback inside forward."""

    def __init__(self, blocks: list[nn.Module], dim: int = D) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 1)

    def after(self, h: torch.Tensor) -> None:
        pass

    def forward(self, x):
        h = self.pre(x)
        for b in self.blocks:
            h = b(h)
        self.after(h)
        return self.head(h)


def _names(n: int) -> list[str]:
    return [f"blocks.{i}" for i in range(n)]


class Mix(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


# ============================================================ false alarms
# ------------------------------------------------ a write whose bytes do not change at step 0
class SymmetricQATBlock(nn.Module):
    """QAT activation fake-quant with a symmetric qint8 observer: ``zero_point`` is written
    (copy_) every step and is always 0; ``scale`` follows the observed range."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.fq = tq.FakeQuantize(
            observer=tq.MovingAverageMinMaxObserver,
            quant_min=-128,
            quant_max=127,
            dtype=torch.qint8,
            qscheme=torch.per_tensor_symmetric,
            averaging_constant=0.5,
        )

    def forward(self, x):
        return x + torch.tanh(self.fq(self.fc(x)))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_fake_quantize_zero_point_written_with_same_bytes(preservation):
    engine = _replays_exactly(
        lambda: Stack([SymmetricQATBlock(), SymmetricQATBlock()]),
        _names(2),
        preservation=preservation,
    )
    assert _replayed(engine, "blocks.1") >= 4


def test_prepare_qat_model_replays_exactly():
    """A whole model prepared by torch.ao.quantization.prepare_qat (weight and activation
    fake-quant modules in every block; zero points written and unchanged at step 0)."""

    def make():
        m = Stack([Mix(), Mix(), Mix()])
        m.train()
        m.qconfig = tq.get_default_qat_qconfig("x86")
        return tq.prepare_qat(m, inplace=False)

    engine = _replays_exactly(make, _names(3))
    assert all(_replayed(engine, n) >= 4 for n in _names(3))


class MaxNormEmbedBlock(nn.Module):
    """Token embedding with ``max_norm``: the forward renormalizes the looked-up rows in place
    (a parameter written under no_grad). At step 0 no row is over the limit; training pushes
    rows over it later."""

    def __init__(self, vocab: int = 12, dim: int = D) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(0.2)
        self.fc = nn.Linear(dim, dim)

    def forward(self, tokens):
        return torch.tanh(self.fc(self.emb(tokens))).sum(1)


class EmbedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = MaxNormEmbedBlock()
        self.blocks = nn.ModuleList([Mix()])
        self.head = nn.Linear(D, 1)

    def forward(self, tokens):
        return self.head(self.blocks[0](self.embed(tokens)))


def _tokens_step(model, step):
    tokens = torch.randint(0, 12, (B, 5), generator=torch.Generator().manual_seed(step))
    (model(tokens) ** 2).mean().backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_embedding_max_norm_renorm_starts_after_probe(preservation):
    torch.manual_seed(0)
    probe = EmbedModel()
    norms0 = probe.embed.emb.weight.norm(dim=1)
    assert norms0.max() < 1.0  # nothing to renormalize at the probe step
    ref = copy.deepcopy(probe)
    _train(ref, _tokens_step, 8, lr_=2.0)
    assert ref.embed.emb.weight.norm(dim=1).max() > 0.999  # rows got renormalized later
    engine = _replays_exactly(
        EmbedModel, ["embed", "blocks.0"], _tokens_step, steps=8, lr_=2.0, preservation=preservation
    )
    assert _replayed(engine, "embed") >= 5


class WarmupPeakBlock(nn.Module):
    """Write-then-read: ``peak`` tracks max |h| and divides by it. It starts above anything
    the first steps see (the write leaves its bytes unchanged at step 0); from step 3 on the
    inputs are larger and the write changes it."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("peak", torch.tensor(50.0))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.peak.copy_(torch.maximum(self.peak, h.abs().amax()))
        return x + torch.tanh(h / self.peak * 10)


def _growing_step(model, step):
    (model(_x(step) * (1 if step < 3 else 100)) ** 2).mean().backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_write_then_read_buffer_unchanged_at_probe(preservation):
    engine = _replays_exactly(
        lambda: Stack([WarmupPeakBlock(), Mix()]),
        _names(2),
        _growing_step,
        lr_=1e-4,
        preservation=preservation,
    )
    model = engine.model
    assert 50.0 < float(model.blocks[0].peak) < 1e4  # it did move, after the probe step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _replayed(engine, "blocks.0") >= 3


# ------------------------------------------------ writes that bump the version 0 or 2+ times
class DataWriteBlock(nn.Module):
    """Write-then-read through ``.data`` (the owner's version counter does not move) and a
    ``detach_`` on the same buffer (bumps it without touching the bytes)."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("center", torch.zeros(dim))

    def forward(self, x):
        h = self.fc(x)
        self.center.data.mul_(0.8).add_(0.2 * h.detach().mean(0))
        self.center.detach_()
        return x + torch.tanh(h - self.center)


class DataRebindBlock(nn.Module):
    """``buf.data = new``: same tensor object, new storage, every step."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x):
        h = self.fc(x)
        self.scale.data = 0.5 * self.scale + 0.5 * h.detach().std(0)
        return x + torch.tanh(h / self.scale)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_data_and_detach_writes_inside_segment(preservation):
    engine = _replays_exactly(
        lambda: Stack([DataWriteBlock(), Mix()]), _names(2), preservation=preservation
    )
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_data_rebind_inside_segment(preservation):
    engine = _replays_exactly(
        lambda: Stack([DataRebindBlock(), Mix()]), _names(2), preservation=preservation
    )
    assert _replayed(engine, "blocks.0") >= 4


class FusedFakeQuantBlock(nn.Module):
    """QAT with the fused observer + fake-quant op, per-tensor on activations and per-channel
    on weights (whose observer buffers start empty and are resized by the first call)."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.wfq = tq.FusedMovingAvgObsFakeQuantize(
            observer=tq.MovingAveragePerChannelMinMaxObserver,
            quant_min=-128,
            quant_max=127,
            dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
        )
        self.afq = tq.FusedMovingAvgObsFakeQuantize(
            observer=tq.MovingAverageMinMaxObserver,
            quant_min=0,
            quant_max=255,
            dtype=torch.quint8,
            qscheme=torch.per_tensor_affine,
        )

    def forward(self, x):
        return x + torch.tanh(self.afq(F.linear(x, self.wfq(self.fc.weight), self.fc.bias)))


class FusedActivationOnlyBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.afq = tq.FusedMovingAvgObsFakeQuantize(
            observer=tq.MovingAverageMinMaxObserver,
            quant_min=0,
            quant_max=255,
            dtype=torch.quint8,
            qscheme=torch.per_tensor_affine,
        )

    def forward(self, x):
        return x + torch.tanh(self.afq(self.fc(x)))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_fused_fake_quant_activation(preservation):
    engine = _replays_exactly(
        lambda: Stack([FusedActivationOnlyBlock(), Mix()]), _names(2), preservation=preservation
    )
    assert _replayed(engine, "blocks.0") >= 4


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_fused_fake_quant_weight_and_activation(preservation):
    engine = _replays_exactly(
        lambda: Stack([FusedFakeQuantBlock(), FusedFakeQuantBlock()]),
        _names(2),
        preservation=preservation,
    )
    assert _replayed(engine, "blocks.1") >= 4


class HistogramQuantBlock(nn.Module):
    """A HistogramObserver (``detach_().resize_()`` then ``copy_`` on its buffers) whose
    qparams the same forward reads back (write-then-read through host-side search)."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.obs = tq.HistogramObserver(bins=32, dtype=torch.quint8)

    def forward(self, x):
        h = self.obs(self.fc(x))
        scale, zp = self.obs.calculate_qparams()
        return x + torch.tanh(torch.fake_quantize_per_tensor_affine(h, scale, zp, 0, 255))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_histogram_observer_write_then_read(preservation):
    engine = _replays_exactly(
        lambda: Stack([HistogramQuantBlock(), Mix()]), _names(2), steps=5, preservation=preservation
    )
    assert _replayed(engine, "blocks.0") >= 3


class DataQueueMoCo(Stack):
    """MoCo: the blocks read a detached copy of the key queue; after the blocks the step
    enqueues the batch through ``.data`` (no version bump) and advances a pointer buffer."""

    def __init__(self, rows: int = 20, dim: int = D) -> None:
        super().__init__([QueueAttnBlock(self, dim), QueueAttnBlock(self, dim)], dim)
        self.register_buffer("queue", F.normalize(torch.randn(rows, dim), dim=1))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def after(self, h):
        p, n = int(self.ptr), h.shape[0]
        idx = (torch.arange(n) + p) % self.queue.shape[0]
        self.queue.data[idx] = F.normalize(h.detach(), dim=1)
        self.ptr.data.fill_((p + n) % self.queue.shape[0])


class QueueAttnBlock(nn.Module):
    def __init__(self, owner: nn.Module, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        object.__setattr__(self, "_owner", owner)

    def forward(self, x):
        q = self._owner.queue.clone().detach()
        return x + torch.softmax(self.fc(x) @ q.t(), dim=1) @ q


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_moco_queue_enqueued_through_data(preservation):
    engine = _replays_exactly(DataQueueMoCo, _names(2), preservation=preservation)
    assert all(_replayed(engine, n) >= 4 for n in _names(2))
    if preservation == "auto":
        assert engine.summary()["blocks.0"]["mode"] in ("regions", "whole")


# ------------------------------------------------ the probe must not conclude too early
class GateBlock(nn.Module):
    """Reads ``gain`` without autograd saving it (tanh saves its output, not its input)."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("gain", torch.ones(dim))

    def forward(self, x):
        return x + torch.tanh(self.fc(x) * 1.0 + self.gain)


class GradHookModel(Stack):
    """A gradient hook on block 0's output adapts block 0's ``gain`` from the gradient's
    scale: a write that happens in backward, before block 0 replays."""

    def __init__(self) -> None:
        super().__init__([GateBlock(), Mix()])

    def forward(self, x):
        h = self.blocks[0](self.pre(x))
        if h.requires_grad:
            gain = self.blocks[0].gain

            def adapt(g):
                with torch.no_grad():
                    gain.mul_(0.9).add_(g.abs().mean(0))

            h.register_hook(adapt)
        return self.head(self.blocks[1](h))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_gradient_hook_on_segment_output_writes_its_state(preservation):
    engine = _replays_exactly(GradHookModel, _names(2), preservation=preservation)
    assert _replayed(engine, "blocks.0") >= 4


class MomentumQueueModel(nn.Module):
    """One encoder shared by the query path (with grad) and the key path (a second, no-grad
    call of the same root per step, which also enqueues its keys). The blocks read the queue
    through a copy; batch norm in block 1 updates its statistics in both calls."""

    def __init__(self, rows: int = 16, dim: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [QueueAttnBlock(self, dim), nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim))]
        )
        self.head = nn.Linear(dim, dim)
        self.register_buffer("queue", F.normalize(torch.randn(rows, dim), dim=1))
        self.ptr = 0

    def forward(self, x):
        h = x
        for b in self.blocks:
            h = b(h)
        out = self.head(h)
        if not torch.is_grad_enabled():  # the key encoder: enqueue
            n = out.shape[0]
            idx = (torch.arange(n) + self.ptr) % self.queue.shape[0]
            self.queue[idx] = F.normalize(out, dim=1)
            self.ptr = (self.ptr + n) % self.queue.shape[0]
        return out


def _momentum_step(model, step):
    x = _x(step)
    q = F.normalize(model(x), dim=1)
    with torch.no_grad():
        k = model(x + 0.1 * _x(step + 100))
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ model.queue.clone().t()], 1)
    F.cross_entropy(logits / 0.2, torch.zeros(B, dtype=torch.long)).backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_second_no_grad_root_call_enqueues(preservation):
    engine = _replays_exactly(
        MomentumQueueModel, _names(2), _momentum_step, preservation=preservation
    )
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


# ------------------------------------------------ two forwards, one backward
class BNStack(Stack):
    def __init__(self) -> None:
        super().__init__(
            [
                nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh()),
                Mix(),
                nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)),
            ]
        )


def _two_forwards_step(model, step):
    loss = (model(_x(step)) ** 2).mean() + (model(_x(step + 50)) - 1).pow(2).mean()
    loss.backward()


def test_two_forwards_one_backward_under_min_budget():
    """With budget='min' the plan comes into force after calibration, possibly between the two
    forwards of one step: both forwards' replays must still be exact."""
    engine = _replays_exactly(
        BNStack, _names(3), _two_forwards_step, steps=8, budget="min", calibration_steps=1
    )
    assert engine.plan is not None
    assert sum(_replayed(engine, n) for n in _names(3)) >= 8


def _inside_and_outside_step(model, step):
    """A consistency term: block 1 called directly on a second view, outside the root."""
    x = _x(step)
    out = model(x)
    h2 = model.blocks[1](model.pre(x + 0.05))
    ((out**2).mean() + (h2 - model.blocks[1](model.pre(x))).pow(2).mean()).backward()


@pytest.mark.parametrize("budget", [None, "min"])
def test_segment_called_inside_and_outside_root_forward(budget):
    engine = _replays_exactly(
        BNStack, _names(3), _inside_and_outside_step, steps=8, budget=budget, calibration_steps=1
    )
    assert _replayed(engine, "blocks.1") >= 4


# ------------------------------------------------ gradient penalty through a stateless segment
class SmoothStack(Stack):
    def __init__(self) -> None:
        super().__init__([nn.Sequential(nn.Linear(D, D), nn.Softplus()), Mix()])


def _penalty_step(model, step):
    x = _x(step).requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    ((out**2).mean() + 0.5 * g.pow(2).sum(1).mean()).backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_gradient_penalty_through_stateless_segments(preservation):
    engine = _replays_exactly(SmoothStack, _names(2), _penalty_step, preservation=preservation)
    assert all(_replayed(engine, n) >= 5 for n in _names(2))


# ============================================================ deep crashes
# ------------------------------------------------ a tuple of tensors as a segment attribute
class StatefulLSTMBlock(nn.Module):
    """Truncated-BPTT style: the recurrent state ``(h, c)`` is a tuple attribute set in
    ``__init__`` and rebound (detached) by every forward."""

    def __init__(self, dim: int = D, batch: int = B) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(dim, dim)
        self.hc = (torch.zeros(batch, dim), torch.zeros(batch, dim))

    def forward(self, x):
        h, c = self.cell(x, self.hc)
        self.hc = (h.detach(), c.detach())
        return x + h


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_tuple_state_attribute_lstm(preservation):
    engine = _replays_exactly(
        lambda: Stack([StatefulLSTMBlock(), StatefulLSTMBlock()]),
        _names(2),
        preservation=preservation,
    )
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


def test_diff_state_on_tuple_attributes():
    """The verify helpers users are pointed to: a tuple attribute is snapshotted by value and
    a difference in any member is reported under the attribute's name."""
    torch.manual_seed(0)
    a = Stack([StatefulLSTMBlock()])
    b = copy.deepcopy(a)
    assert diff_state(snapshot_state(a), snapshot_state(b)) == []
    snap = snapshot_state(a)
    a(_x(0))  # rebinds blocks.0.hc
    assert diff_state(snap, snapshot_state(a)) == ["blocks.0.hc"]
    b.blocks[0].hc = (b.blocks[0].hc[0], b.blocks[0].hc[1] + 1)
    assert diff_state(snap, snapshot_state(b)) == ["blocks.0.hc"]
    b.blocks[0].hc = b.blocks[0].hc[:1]
    assert diff_state(snap, snapshot_state(b)) == ["blocks.0.hc"]


# ------------------------------------------------ a buffer grown with resize_
class GrowingMemoryModel(Stack):
    """The blocks read the mean of a memory buffer that the step grows with ``resize_``
    (append a row after the blocks): the replay must see the forward's rows."""

    def __init__(self) -> None:
        super().__init__([MemoryMeanBlock(self), MemoryMeanBlock(self)])
        self.register_buffer("memory", torch.randn(2, D))

    def after(self, h):
        n = self.memory.shape[0]
        with torch.no_grad():
            self.memory.resize_(n + 1, D)
            self.memory[n] = h.mean(0)


class MemoryMeanBlock(nn.Module):
    def __init__(self, owner: nn.Module, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        object.__setattr__(self, "_owner", owner)

    def forward(self, x):
        return x + torch.tanh(self.fc(x) + self._owner.memory.mean(0))


class SelfGrowingBlock(nn.Module):
    """Appends its input's mean to its own buffer with ``resize_`` and reads it back."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("seen", torch.zeros(1, dim))

    def forward(self, x):
        n = self.seen.shape[0]
        with torch.no_grad():
            self.seen.resize_(n + 1, x.shape[1])
            self.seen[n] = x.mean(0)
        return x + torch.tanh(self.fc(x) - self.seen.mean(0))


class RebindQueueMoCo(DataQueueMoCo):
    """As above, but the step rebinds the queue buffer to a new tensor (``torch.cat``)."""

    def after(self, h):
        self.queue = torch.cat([F.normalize(h.detach(), dim=1), self.queue])[: self.queue.shape[0]]


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_of_outside_module_rebound_after_segment(preservation):
    engine = _replays_exactly(RebindQueueMoCo, _names(2), preservation=preservation)
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_grown_with_resize_after_segment(preservation):
    engine = _replays_exactly(GrowingMemoryModel, _names(2), preservation=preservation)
    assert engine.model.memory.shape[0] == 2 + 6
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_grown_with_resize_inside_segment(preservation):
    engine = _replays_exactly(
        lambda: Stack([SelfGrowingBlock(), Mix()]), _names(2), preservation=preservation
    )
    assert _replayed(engine, "blocks.0") >= 4


# ------------------------------------------------ a reassigned attribute that carries grad
class ContextBlock(nn.Module):
    """Reads ``self.ctx``, a tensor the root computes (with grad) and assigns each step."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.ctx = None

    def forward(self, x):
        return x + torch.tanh(self.fc(x) * self.ctx)


class ContextModel(Stack):
    """FiLM-like conditioning through an attribute: set before each block, cleared after
    (so at backward the attribute holds another tensor, or None)."""

    def __init__(self) -> None:
        super().__init__([ContextBlock(), ContextBlock()])
        self.ctx = nn.Linear(D, D)

    def forward(self, x):
        h = self.pre(x)
        for i, b in enumerate(self.blocks):
            b.ctx = torch.sigmoid(self.ctx(x) + i)
            h = b(h)
            b.ctx = None if i else b.ctx[:1]
        return self.head(h)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_reassigned_attribute_carrying_grad(preservation):
    engine = _replays_exactly(ContextModel, _names(2), preservation=preservation)
    assert all(_replayed(engine, n) >= 4 for n in _names(2))


# ------------------------------------------------ in-place ops on the segment's input
class LeakyFirst(nn.Sequential):
    def __init__(self, dim: int = D) -> None:
        super().__init__(nn.LeakyReLU(0.1, inplace=True), nn.Linear(dim, dim), nn.Tanh())


class ReluInplaceBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        x = x.relu_()
        return self.fc(x) + x


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_inplace_activation_first_in_segment(preservation):
    engine = _replays_exactly(
        lambda: Stack([LeakyFirst(), Mix(), ReluInplaceBlock(), LeakyFirst()]),
        _names(4),
        preservation=preservation,
    )
    assert all(_replayed(engine, n) >= 4 for n in _names(4))


class ResidualIntoInput(Stack):
    """``h += block(h)``: the block's input is updated in place after the block (the blocks
    start with tanh, which saves its output and not its input, so plain PyTorch allows it)."""

    def __init__(self) -> None:
        super().__init__([nn.Sequential(nn.Tanh(), nn.Linear(D, D)) for _ in range(3)])

    def forward(self, x):
        h = self.pre(x)
        for b in self.blocks:
            h += b(h)
        return self.head(h)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_inplace_residual_into_segment_input(preservation):
    engine = _replays_exactly(ResidualIntoInput, _names(3), preservation=preservation)
    assert all(_replayed(engine, n) >= 4 for n in _names(3))


class InplaceOnRootInput(Stack):
    """The first block clamps the user's batch (no grad) in place."""

    def __init__(self) -> None:
        super().__init__([Mix(), Mix()])
        self.blocks.insert(0, nn.Hardtanh(-0.5, 0.5, inplace=True))

    def forward(self, x):
        h = self.blocks[0](x)
        h = self.pre(h)
        for b in self.blocks[1:]:
            h = b(h)
        return self.head(h)


def test_inplace_on_root_input_without_grad():
    engine = _replays_exactly(InplaceOnRootInput, _names(3))
    assert _replayed(engine, "blocks.1") >= 4


# ------------------------------------------------ lazy modules
class LazyBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_lazy_linear_segment_keeps_replaying(preservation):
    def make():
        m = Stack([LazyBlock(), LazyBlock()])
        m(_x(99))  # materialize before the deep copies (plain and replay start equal)
        return m

    engine = _replays_exactly(make, _names(2), preservation=preservation)
    assert all(_replayed(engine, n) == 5 for n in _names(2))


def test_lazy_linear_materialized_under_replay():
    """Installed before its first forward: the probe materializes it; later steps replay."""
    torch.manual_seed(0)
    base = Stack([LazyBlock(), LazyBlock()])
    model = copy.deepcopy(base)
    torch.manual_seed(1)
    ref = copy.deepcopy(base)
    ref(_x(99))
    torch.manual_seed(1)
    engine = lr.install(model, _names(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(_x(99))
        g_ref = _train(ref, _mse_step, 5)
        g_rep = _train(model, _mse_step, 5)
    assert_same_grads(g_ref, g_rep)
    assert all(s["replays"] >= 4 and s["status"] == "active" for s in engine.summary().values())


# ============================================================ record mode
class TempBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.temp = 1.0

    def forward(self, x):
        return x + torch.tanh(self.fc(x) / self.temp)


class PeriodicWriterModel(Stack):
    """A schedule flips block 0's temperature every second step (a plain attribute its
    forward reads: a precondition the step-0 probe cannot see), and every third step the step
    rescales block 1's gain through a NumPy view after the blocks (a write no version counter
    and no dispatch mode sees: only a check finds it)."""

    def __init__(self, numpy_write: bool) -> None:
        super().__init__([TempBlock(), GateBlock()])
        self.calls = 0
        self.numpy_write = numpy_write

    def forward(self, x):
        self.blocks[0].temp = 1.0 + (self.calls // 2) % 2
        return super().forward(x)

    def after(self, h):
        self.calls += 1
        if self.numpy_write and self.calls % 3 == 0:
            self.blocks[1].gain.numpy()[:] *= 0.5


def _record_run(steps: int, checked: bool):
    torch.manual_seed(0)
    base = PeriodicWriterModel(numpy_write=checked)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, _mse_step, steps)
    engine = lr.install(model, _names(2), on_violation="record")
    versions = []

    def step_fn(m, step):
        if checked:
            engine.request_check()
        _mse_step(m, step)
        versions.append(engine.summary()["blocks.0"]["contract_version"])

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        g_rep = _train(model, step_fn, steps)
    return g_ref, g_rep, versions, engine, ref, model


def test_record_mode_periodic_writer_converges():
    g_ref, g_rep, versions, engine, ref, model = _record_run(12, checked=False)
    guard = [r for r in engine.records.read() if r.check == "guard"]
    assert guard and all(r.segment == "blocks.0" for r in guard)
    assert versions[-1] == versions[5] <= 3, versions  # one period seen, then no growth
    assert engine.summary()["blocks.0"]["replays"] >= 6
    assert_same_grads(g_ref, g_rep)
    assert_same_state(snapshot_state(ref), snapshot_state(model))


def test_record_mode_rejected_steps_train_on_exact_gradients():
    """With a check on every step, the steps whose replay diverged train on the reference
    gradients: the whole run is exact."""
    g_ref, g_rep, versions, engine, ref, model = _record_run(12, checked=True)
    outcomes = {
        (r.segment, r.outcome)
        for r in engine.records.read()
        if r.check in ("grad", "bytes", "version")
    }
    assert ("blocks.1", "divergence") in outcomes or ("blocks.1", "rejection") in outcomes
    assert_same_grads(g_ref, g_rep)
    assert_same_state(snapshot_state(ref), snapshot_state(model))


# ============================================================ refusals by design
def test_nested_segment_specs_refused_with_one_clear_message():
    model = Stack([nn.Sequential(Mix(), Mix()), Mix()])
    with pytest.raises(lr.SegmentError) as info:
        lr.install(model, ["blocks.0", "blocks.0.1"])
    msg = str(info.value)
    assert "'blocks.0'" in msg and "'blocks.0.1'" in msg and "nested" in msg
    assert "Choose one" in msg


class StatefulBackwardTwice(Stack):
    def __init__(self) -> None:
        super().__init__([nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), Mix()])


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_backward_twice_through_stateful_replay_matches_plain(preservation):
    """retain_graph=True then a second backward: the second replay swaps in the same
    preserved state (kept until the backward that frees the graph), as plain PyTorch's graph
    keeps the forward's activations."""

    def step_fn(model, step):
        loss = (model(_x(step)) ** 2).mean()
        loss.backward(retain_graph=True)
        loss.backward()

    engine = _replays_exactly(StatefulBackwardTwice, _names(2), step_fn, preservation=preservation)
    assert _replayed(engine, "blocks.0") >= 10
    assert engine.preserved_bytes == 0  # nothing kept past the graph


def test_backward_twice_through_stateless_replay_matches_plain():
    def step_fn(model, step):
        loss = (model(_x(step)) ** 2).mean()
        loss.backward(retain_graph=True)
        loss.backward()

    engine = _replays_exactly(lambda: Stack([Mix(), Mix()]), _names(2), step_fn)
    assert all(_replayed(engine, n) >= 5 for n in _names(2))


class KVCache:
    """A stand-in for an HF ``DynamicCache``: an object that layers append to."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        return torch.cat(self.keys)


class CacheArgBlock(Mix):
    def forward(self, x, past=None):
        if past is not None:
            x = x + past.update(x.detach())[-x.shape[0] :]
        return super().forward(x)


class CacheArgModel(Stack):
    def __init__(self) -> None:
        super().__init__([CacheArgBlock(), Mix()])
        self.last = None

    def forward(self, x):
        self.last = KVCache()
        return self.head(self.blocks[1](self.blocks[0](self.pre(x), past=self.last)))


def test_mutable_argument_object_refused_naming_argument():
    torch.manual_seed(0)
    model = CacheArgModel()
    lr.install(model, _names(2))
    with pytest.raises(lr.ReplayConfigError) as info:
        _mse_step(model, 0)
    msg = str(info.value)
    assert "'blocks.0'" in msg and "'past'" in msg and "KVCache" in msg and "use_cache" in msg


def test_a_model_that_blew_up_is_no_divergence():
    """NaN gradients in the reference and the same NaN in the replay are equal bit for bit:
    the derivative check records a match, not a divergence (NaN != NaN under torch.equal)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    engine = lr.install(model, ["0"])
    x = torch.randn(8, 4)
    model(x).sum().backward()  # probe
    engine.request_check()
    bad = x.clone()
    bad[0, 0] = float("nan")
    model(bad).sum().backward()
    assert torch.isnan(model[0].weight.grad).any()
    grads = [r for r in engine.records.read() if r.check == "grad"]
    assert [r.outcome for r in grads] == ["match"]


def test_a_per_channel_observer_resized_from_empty_is_state_from_its_first_probe():
    """A per-channel weight observer's ``min_val``/``max_val`` start empty (no storage) and are
    resized and written inside one op (``fused_moving_avg_obs_fake_quant``) at the first
    forward: the first probe names them as changing state (before, nothing watched them, and
    whether a later probe found them under their names hung on where the allocator put them)."""
    torch.manual_seed(0)
    m = Stack([Mix(), Mix()])
    m.train()
    m.qconfig = tq.get_default_qat_qconfig("x86")
    model = tq.prepare_qat(m, inplace=False)
    engine = lr.install(model, _names(2))
    _train(model, _mse_step, 1)
    for name in _names(2):
        changing = engine.summary()[name]["changing_state"]
        for v in ("min_val", "max_val"):
            assert f"{name}.fc.weight_fake_quant.activation_post_process.{v}" in changing
