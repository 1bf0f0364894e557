"""Exact for the whole run, not only for what the probe step saw (issue 12).

Each model below has state whose behaviour changes *after* the probe step, is rebound instead of
written in place, lives in Python objects, is read where a dispatch mode cannot see it, or is
reached through another segment, ``torch.func.functional_call`` or a re-plan. Every test trains
the same model N SGD steps under ``lr.install`` (``auto``, ``whole``, ``regions``) and in plain
PyTorch from an identical deep copy and identical RNG, and asserts bit-identical gradients at
every step and identical state after. Where it is meaningful, the test also states what plain
``torch.utils.checkpoint`` does on the same model (exact, wrong, or raises).

The models are written for these tests (none is a copy of :mod:`lightning_replay.demos.hazards`).
``after(h)`` hooks run inside the root's forward, i.e. between a segment's forward and its
replay in backward: that is where the step changes state the replay must not see.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import operator
import types
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    diff_state,
    grad_diffs,
    snapshot_state,
    torch_checkpoint,
)

D = 8  # feature width
B = 4  # batch
STEPS = 6
PRESERVATIONS = ["auto", "whole", "regions"]

Schedule = Callable[[nn.Module, int], None]


# ----------------------------------------------------------------------------- harness
def _train(
    model: nn.Module,
    steps: int,
    schedule: Schedule | None = None,
    engine: lr.ReplayEngine | None = None,
    checks: tuple[int, ...] = (),
    step_fn: Callable | None = None,
) -> list[dict[str, torch.Tensor]]:
    """SGD on ``mean(model(x) ** 2)``; inputs from a seeded generator, the global RNG reseeded
    before each step; ``schedule(model, step)`` runs before the step (a warm-up, a mode switch)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1234)
    grads = []
    for step in range(steps):
        if schedule is not None:
            schedule(model, step)
        if engine is not None and step in checks:
            engine.request_check()
        x = torch.randn(B, D, generator=data)
        torch.manual_seed(100 + step)
        opt.zero_grad(set_to_none=True)
        if step_fn is not None:
            step_fn(model, x, engine, step)
        else:
            model(x).pow(2).mean().backward()
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
    return grads


def _fresh(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory()


def assert_exact(
    factory: Callable[[], nn.Module],
    segments: list[str],
    preservation: str,
    steps: int = STEPS,
    schedule: Schedule | None = None,
    min_replays: int = 1,
    checks: tuple[int, ...] = (),
    step_fn: Callable | None = None,
    **install_kw,
) -> tuple[dict, list]:
    """Train a replayed copy and a plain copy; gradients every step and state after must be
    bit-identical. Returns the engine's summary and records."""
    base = _fresh(factory)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, steps, schedule, step_fn=step_fn)
    engine = lr.install(model, segments, preservation=preservation, **install_kw)
    try:
        g_rep = _train(model, steps, schedule, engine, checks, step_fn=step_fn)
        summary, records = engine.summary(), engine.records.read()
    finally:
        engine.uninstall()
    assert all(bool(torch.isfinite(g).all()) for step in g_ref for g in step.values()), (
        "the reference itself diverged: make the model stable before comparing"
    )
    assert_same_grads(g_ref, g_rep, preservation)
    assert_same_state(_observable(ref), _observable(model), preservation)
    replays = sum(s["replays"] for s in summary.values())
    assert replays >= min_replays, f"the test never replayed: {summary}"
    return summary, records


def _observable(model: nn.Module) -> dict[str, object]:
    """:func:`snapshot_state` with sparse tensors made dense (``torch.equal`` has no sparse
    kernel)."""
    return {
        k: v.to_dense() if isinstance(v, torch.Tensor) and v.layout != torch.strided else v
        for k, v in snapshot_state(model).items()
    }


def naive_outcome(
    factory: Callable[[], nn.Module],
    segments: list[str],
    steps: int = STEPS,
    schedule: Schedule | None = None,
) -> str:
    """What plain non-reentrant ``torch.utils.checkpoint`` does to the model: ``"exact"``,
    ``"wrong gradients"``, ``"wrong state"`` or the name of the exception it raises."""
    base = _fresh(factory)
    ref, naive = copy.deepcopy(base), torch_checkpoint(copy.deepcopy(base), segments)
    g_ref = _train(ref, steps, schedule)
    try:
        g_naive = _train(naive, steps, schedule)
    except Exception as exc:  # noqa: BLE001 - the kind of failure is the result
        return type(exc).__name__
    if grad_diffs(g_ref, g_naive):
        return "wrong gradients"
    if diff_state(_observable(ref), _observable(naive)):
        return "wrong state"
    return "exact"


class Stack(nn.Module):
    """``blocks`` then a linear head; ``after(h)`` runs between the blocks and the head."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        self.after(x)
        return self.head(x)

    def after(self, h: torch.Tensor) -> None:
        pass


SEGS2 = ["blocks.0", "blocks.1"]


def _blocks(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


# ============================================================ 1. state first used after the probe
class GatedMLP(nn.Module):
    """A gated MLP whose dropout rate is set from outside (a warm-up schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.drop = nn.Dropout(0.0)
        self.down = nn.Linear(D, D)

    def forward(self, x):
        a, g = self.up(x).chunk(2, dim=-1)
        return x + self.down(self.drop(a * torch.sigmoid(g)))


def _dropout_warmup(model, step):
    for m in _blocks(model, nn.Dropout):
        m.p = min(0.4, 0.15 * step)  # 0 at the probe step: no draw from the global RNG


def _dropout_eval_then_train(model, step):
    for m in _blocks(model, nn.Dropout):
        m.p = 0.3
        m.train(step >= 1)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
@pytest.mark.parametrize(
    "schedule", [_dropout_warmup, _dropout_eval_then_train], ids=["p_warmup", "eval_then_train"]
)
def test_dropout_first_drawing_after_the_probe(schedule, preservation):
    factory = lambda: Stack([GatedMLP(), GatedMLP()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=schedule)


@pytest.mark.parametrize(
    "schedule", [_dropout_warmup, _dropout_eval_then_train], ids=["p_warmup", "eval_then_train"]
)
def test_torch_checkpoint_is_exact_on_late_dropout(schedule):
    # the bar: replay must never be worse than torch checkpoint, which preserves the global RNG
    factory = lambda: Stack([GatedMLP(), GatedMLP()])  # noqa: E731
    assert naive_outcome(factory, SEGS2, schedule=schedule) == "exact"


class CountedNoise(nn.Module):
    """Adds noise from a private generator once its own call counter (a buffer it increments in
    place) passes 3: the switch is invisible to identity and flag fingerprints."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gen = torch.Generator().manual_seed(seed)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.lin(x))
        if int(self.calls) > 3:
            h = h + 0.2 * torch.randn(h.shape, generator=self.gen)
        return x + h


class FlaggedNoise(nn.Module):
    """Multiplicative noise from a private generator, switched on by a plain flag."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gen = torch.Generator().manual_seed(seed)
        self.noisy = False

    def forward(self, x):
        h = self.lin(x)
        if self.noisy:
            h = h * (1 + 0.1 * torch.randn(h.shape, generator=self.gen))
        return x + F.silu(h)


def _noise_on_at_3(model, step):
    for m in _blocks(model, FlaggedNoise):
        m.noisy = step >= 3


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_private_generator_first_drawn_at_step_3_by_a_counter(preservation):
    factory = lambda: Stack([CountedNoise(5), CountedNoise(6)])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_private_generator_first_drawn_at_step_3_by_a_flag(preservation):
    factory = lambda: Stack([FlaggedNoise(5), FlaggedNoise(6)])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_noise_on_at_3)
    assert naive_outcome(factory, SEGS2, schedule=_noise_on_at_3) == "wrong gradients"


class NoiseFromSlot(nn.Module):
    """Draws from whatever generator ``self.gen`` holds; the step replaces it every step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x + self.lin(x) * torch.rand(x.shape, generator=self.gen)


class DrawsAfter(Stack):
    def forward(self, x):
        h = super().forward(x)
        # the step draws from the first block's generator after its forward, before its replay
        return h + 0.1 * torch.randn(h.shape, generator=self.blocks[0].gen)


def _new_generators(model, step):
    for i, m in enumerate(_blocks(model, NoiseFromSlot)):
        m.gen = torch.Generator().manual_seed(1000 * i + step)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_generator_replaced_by_a_new_object_every_step(preservation):
    factory = lambda: DrawsAfter([NoiseFromSlot(), NoiseFromSlot()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_new_generators)
    assert naive_outcome(factory, SEGS2, schedule=_new_generators) == "wrong gradients"


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D, momentum=0.3)

    def forward(self, x):
        return x + F.relu(self.bn(self.lin(x)))


def _bn_frozen_then_trained(model, step):
    for m in _blocks(model, nn.BatchNorm1d):
        m.train(step >= 2)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_batchnorm_frozen_at_the_probe_and_trained_later(preservation):
    factory = lambda: Stack([NormBlock(), NormBlock()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_bn_frozen_then_trained)
    assert naive_outcome(factory, SEGS2, schedule=_bn_frozen_then_trained) == "wrong state"


class BankReader(nn.Module):
    """Attends over a memory bank once the step marks it full (``filled``, written in place)."""

    def __init__(self, rows: int = 12) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("bank", torch.zeros(rows, D))
        self.register_buffer("filled", torch.zeros((), dtype=torch.bool))

    def forward(self, x):
        h = self.lin(x)
        if bool(self.filled):
            bank = self.bank.clone()  # a copy, as MoCo reads its queue: the step writes bank
            h = h + torch.softmax(h @ bank.T, dim=-1) @ bank
        return x + torch.tanh(h)


class BankWriter(Stack):
    """Enqueues each block's output into its bank, in place, after the blocks ran."""

    ptr = 0

    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                rows = b.bank.shape[0]
                b.bank[self.ptr : self.ptr + B] = h.detach()
                if self.ptr + B == rows:
                    b.filled.fill_(True)
            self.ptr = (self.ptr + B) % self.blocks[0].bank.shape[0]


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_bank_first_read_after_a_warmup_and_written_after_the_segment(preservation):
    factory = lambda: BankWriter([BankReader(), BankReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, steps=7)
    # the read switches on between a forward and its replay at the fill step
    assert naive_outcome(factory, SEGS2, steps=7) in ("wrong gradients", "CheckpointError")


class LateCentering(nn.Module):
    """Centers by a running mean it starts updating (write, then read) once ``momentum > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.momentum = 0.0
        self.register_buffer("mu", torch.zeros(D))

    def forward(self, x):
        h = self.lin(x)
        if self.momentum > 0:
            with torch.no_grad():
                self.mu.lerp_(h.mean(0), self.momentum)
        return x + torch.tanh(h - self.mu)


def _centering_from_2(model, step):
    for m in _blocks(model, LateCentering):
        m.momentum = 0.0 if step < 2 else 0.25


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_statistic_first_written_inside_the_segment_after_a_warmup(preservation):
    factory = lambda: Stack([LateCentering(), LateCentering()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_centering_from_2)
    assert naive_outcome(factory, SEGS2, schedule=_centering_from_2) == "wrong gradients"


class ScaleReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("scale", torch.ones(D))

    def forward(self, x):
        return x + self.lin(x) * self.scale.clone()


class LateDecay(Stack):
    """From its fourth forward on, the step decays each block's scale in place."""

    seen = 0

    def after(self, h):
        self.seen += 1
        if self.seen > 3:
            with torch.no_grad():
                for b in self.blocks:
                    b.scale.mul_(0.9).add_(0.05 * h.detach().mean(0))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_read_every_step_first_written_by_the_step_after_a_warmup(preservation):
    factory = lambda: LateDecay([ScaleReader(), ScaleReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


# ================================================= 2. tensors rebound rather than written in place
class Elman(nn.Module):
    """A stateful RNN cell: carries ``self.h`` across steps by rebinding it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.rec = nn.Linear(D, D, bias=False)
        self.h = torch.zeros(B, D)

    def forward(self, x):
        h = torch.tanh(self.inp(x) + self.rec(self.h))
        self.h = h.detach()
        return h


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_stateful_rnn_rebinds_its_hidden_state(preservation):
    factory = lambda: Stack([Elman(), Elman()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class QueueAttend(nn.Module):
    def __init__(self, rows: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.register_buffer("queue", torch.randn(rows, D))

    def forward(self, x):
        logits = self.q(x) @ self.queue.T / 0.5
        return x + torch.softmax(logits, -1) @ self.queue


class RebindingEnqueue(Stack):
    """MoCo's enqueue written the common non-in-place way: a new tensor each step."""

    def after(self, h):
        for b in self.blocks:
            b.queue = torch.cat([h.detach(), b.queue[:-B]])


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_queue_rebound_by_cat_after_the_segment(preservation):
    factory = lambda: RebindingEnqueue([QueueAttend(), QueueAttend()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class WindowReader(nn.Module):
    """Reads ``self.rows``, a view into its table that the step re-points (and writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("table", torch.randn(12, D))
        self.rows = self.table[0:4]

    def forward(self, x):
        return x + self.lin(x) * torch.sigmoid(self.rows)


class RepointingStack(Stack):
    offset = 0

    def after(self, h):
        self.offset = (self.offset + 4) % 12
        with torch.no_grad():
            for b in self.blocks:
                b.table[self.offset : self.offset + 4].add_(h.detach())
                b.rows = b.table[self.offset : self.offset + 4]


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_attribute_repointed_to_a_new_view_every_step(preservation):
    factory = lambda: RepointingStack([WindowReader(), WindowReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class GrowingMemory(nn.Module):
    """A memory that grows by rebinding (``torch.cat``) until it holds 12 rows: its shape changes
    every step of the warm-up."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mem = torch.zeros(1, D)

    def forward(self, x):
        h = self.lin(x)
        out = x + torch.softmax(h @ self.mem.T, -1) @ self.mem
        self.mem = torch.cat([self.mem, h.detach()])[-12:]
        return out


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_memory_growing_by_rebinding_inside_the_segment(preservation):
    factory = lambda: Stack([GrowingMemory(), GrowingMemory()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) in ("wrong gradients", "CheckpointError")


# ============================================================ 3. Python state beyond plain types
class Mode(enum.Enum):
    ADD = "add"
    GATE = "gate"
    SQUARE = "square"


class ModalBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mode = Mode.ADD

    def forward(self, x):
        h = self.lin(x)
        if self.mode is Mode.GATE:
            return x * torch.sigmoid(h)
        if self.mode is Mode.SQUARE:
            return x + 0.1 * h * h
        return x + h


class CyclingModes(Stack):
    def after(self, h):
        order = list(Mode)
        for b in self.blocks:
            b.mode = order[(order.index(b.mode) + 1) % len(order)]


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_enum_mode_switched_between_forward_and_backward(preservation):
    factory = lambda: CyclingModes([ModalBlock(), ModalBlock()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) in ("wrong gradients", "CheckpointError")


class NumpyTemp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.temp = np.float32(2.0)
        self.bias_shift = np.float64(0.0)

    def forward(self, x):
        return x + torch.softmax(self.lin(x) / float(self.temp), -1) + float(self.bias_shift)


class NumpyAnneal(Stack):
    def after(self, h):
        for b in self.blocks:
            b.temp = b.temp * np.float32(0.8)
            b.bias_shift += np.float64(0.01)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_numpy_scalars_annealed_between_forward_and_backward(preservation):
    factory = lambda: NumpyAnneal([NumpyTemp(), NumpyTemp()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class Coefficients(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mix = [1.0, 0.5, 0.25]
        self.cfg = {"shift": 0.0, "power": 2, "tags": ("a", "b")}

    def forward(self, x):
        # the values steer what autograd saves (tanh and sigmoid save their outputs): a Python
        # scalar used only as a multiplier is baked into the graph and harmless to a replay
        h = self.lin(x)
        y = torch.tanh(self.mix[0] * h + self.mix[1] * h.pow(self.cfg["power"]))
        return x + y * torch.sigmoid(h + self.cfg["shift"]) + self.mix[2]


class MutateInPlace(Stack):
    def after(self, h):
        for b in self.blocks:
            b.mix[1] *= 0.9  # the list object stays, an element changes
            b.cfg["shift"] -= 0.05
            b.cfg["power"] = 1 if b.cfg["power"] == 2 else 2


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_list_and_dict_elements_mutated_in_place(preservation):
    factory = lambda: MutateInPlace([Coefficients(), Coefficients()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class OwnerTemperature(nn.Module):
    """Reads ``temperature`` from the root module, through an unregistered reference."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.softmax(self.lin(x) / self._owner.temperature, -1)


class AnnealedRoot(Stack):
    def __init__(self, blocks):
        super().__init__(blocks)
        self.temperature = 1.5
        for b in blocks:
            object.__setattr__(b, "_owner", self)  # not a submodule: no cycle in modules()

    def after(self, h):
        self.temperature *= 0.85  # annealed every step, between the forward and its replay


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_root_attribute_read_through_a_reference_and_annealed_every_step(preservation):
    # Passes: the probe records reads of other modules' attributes (OutsideReads) and the
    # replay puts the forward's value back.
    factory = lambda: AnnealedRoot([OwnerTemperature(), OwnerTemperature()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


# ---- beyond the list: state in plain Python objects (not modules) held by a segment
class SharedConfig(nn.Module):
    """Reads an annealed value from a plain config object shared with the root (a
    ``SimpleNamespace``, a dataclass: what most training scripts pass around)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.cfg = cfg

    def forward(self, x):
        return x + torch.softmax(self.lin(x) * self.cfg.sharpness, -1)


class ConfigAnnealer(Stack):
    def __init__(self):
        cfg = types.SimpleNamespace(sharpness=1.0)
        super().__init__([SharedConfig(cfg), SharedConfig(cfg)])
        self.cfg = cfg

    def after(self, h):
        self.cfg.sharpness += 0.5


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_plain_config_object_annealed_between_forward_and_backward(preservation):
    assert_exact(ConfigAnnealer, SEGS2, preservation)


class DictMemory(nn.Module):
    """Keeps its memory tensor in a dict attribute; the step rebinds the dict's value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.store = {"mem": torch.randn(6, D)}

    def forward(self, x):
        mem = self.store["mem"]
        return x + torch.softmax(self.lin(x) @ mem.T, -1) @ mem


class DictRebind(Stack):
    def after(self, h):
        for b in self.blocks:
            b.store["mem"] = torch.cat([h.detach()[:2], b.store["mem"][:-2]])


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_tensor_in_a_dict_attribute_rebound_after_the_segment(preservation):
    factory = lambda: DictRebind([DictMemory(), DictMemory()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)


class Holder:
    """A plain state holder (not a module) with a tensor the step rebinds."""

    def __init__(self) -> None:
        self.centroids = torch.randn(5, D)


class HolderReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.state = Holder()

    def forward(self, x):
        c = self.state.centroids
        return x + torch.softmax(self.lin(x) @ c.T, -1) @ c


class HolderRebind(Stack):
    def after(self, h):
        for b in self.blocks:
            b.state.centroids = 0.9 * b.state.centroids + 0.1 * h.detach().mean(0)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_tensor_in_a_plain_holder_object_rebound_after_the_segment(preservation):
    factory = lambda: HolderRebind([HolderReader(), HolderReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)


class DictGenerators(nn.Module):
    """Private generators kept in a dict; the noise one is first drawn at the fourth call,
    switched on by a counter buffer (nothing a fingerprint sees changes)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gens = {"noise": torch.Generator().manual_seed(seed)}
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if int(self.calls) > 3:
            h = h + 0.2 * torch.randn(h.shape, generator=self.gens["noise"])
        return x + torch.tanh(h)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_generator_in_a_dict_first_drawn_after_the_probe(preservation):
    factory = lambda: Stack([DictGenerators(3), DictGenerators(4)])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)


# ============================================================ 4. reads the dispatch mode cannot see
class HostGains(nn.Module):
    """Reads its gains on the host (``.tolist()``) and uses them as Python floats."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("gains", torch.tensor([1.0, 0.5, 0.1]))

    def forward(self, x):
        a, b, c = self.gains.tolist()
        h = self.lin(x)
        return x + a * torch.tanh(h) + b * h + c * h * h


class GainDecay(Stack):
    def after(self, h):
        with torch.no_grad():
            for blk in self.blocks:
                blk.gains.mul_(torch.tensor([0.9, 1.1, 0.8]))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_read_on_the_host_with_tolist(preservation):
    factory = lambda: GainDecay([HostGains(), HostGains()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class SparseMixer(nn.Module):
    """Mixes features through a sparse COO buffer (a graph adjacency)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        idx = torch.tensor([[0, 1, 2, 3, 5, 7, 6, 4], [1, 2, 3, 0, 4, 6, 7, 5]])
        adj = torch.sparse_coo_tensor(idx, torch.linspace(0.5, 1.2, 8), (D, D)).coalesce()
        self.register_buffer("adj", adj)

    def forward(self, x):
        adj = self.adj.detach().clone()  # a copy, as MoCo reads its queue: the step writes adj
        return x + torch.sparse.mm(adj, self.lin(x).T).T


class SparseDecay(Stack):
    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.adj.mul_(0.8)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_sparse_buffer_written_in_place_after_the_segment(preservation):
    factory = lambda: SparseDecay([SparseMixer(), SparseMixer()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class SparseRebind(Stack):
    def after(self, h):
        for b in self.blocks:
            b.adj = (b.adj * 0.7).coalesce()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_sparse_buffer_rebound_after_the_segment(preservation):
    factory = lambda: SparseRebind([SparseMixer(), SparseMixer()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


# ---- beyond the list: a late writer through ``.data``, a late hook, a late unfreeze
class DataRebound(Stack):
    """From the third step on, the step replaces a block buffer's storage through ``.data``
    (same tensor object, new storage, no version bump): a writer the probe never saw."""

    seen = 0

    def after(self, h):
        self.seen += 1
        if self.seen >= 3:
            for b in self.blocks:
                b.scale.data = b.scale.detach() * 0.9 + 0.1 * h.detach().mean(0)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_buffer_storage_replaced_through_data_after_a_warmup(preservation):
    factory = lambda: DataRebound([ScaleReader(), ScaleReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation)
    assert naive_outcome(factory, SEGS2) == "wrong gradients"


class HookedStack(Stack):
    """The step anneals a gain that a forward hook, registered at step 2, applies to each
    block's output (the hook reads a buffer of the block)."""

    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.scale.mul_(0.8)


def _hook(module, args, out):
    return torch.tanh(out * module.scale.clone())


def _hook_from_2(model, step):
    if step == 2:
        for b in model.blocks:
            b.register_forward_hook(_hook)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_forward_hook_registered_after_the_probe_reads_annealed_state(preservation):
    factory = lambda: HookedStack([ScaleReader(), ScaleReader()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_hook_from_2)
    assert naive_outcome(factory, SEGS2, schedule=_hook_from_2) == "wrong gradients"


def _unfreeze_at_3(model, step):
    for b in model.blocks:
        for p in b.parameters():
            p.requires_grad_(step >= 3)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_blocks_frozen_at_the_probe_and_unfrozen_later(preservation):
    factory = lambda: Stack([NormBlock(), CountedNoise(9)])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, schedule=_unfreeze_at_3)


# ============================================================ 5. a segment that calls another
class Projector(nn.Module):
    """Stateful: batch norm, dropout from the global RNG, a Python call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.drop(self.bn(self.lin(x))) * (1 + 0.1 * (self.calls % 3))


class UsesProjector(nn.Module):
    def __init__(self, proj: Projector, registered: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        if registered:
            self.proj = proj
        else:
            object.__setattr__(self, "proj", proj)  # a hidden reference, not a submodule

    def forward(self, x):
        return x + self.proj(torch.tanh(self.lin(x)))


class SharedProjector(nn.Module):
    def __init__(self, registered: bool) -> None:
        super().__init__()
        self.proj = Projector()  # first in module order: its name is "proj"
        self.blocks = nn.ModuleList([UsesProjector(self.proj, registered) for _ in range(2)])
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.proj(x)  # the installed segment called on its own ...
        for b in self.blocks:
            x = b(x)  # ... and from inside two other installed segments
        return self.head(x)


@pytest.mark.parametrize("preservation", PRESERVATIONS)
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "hidden_reference"])
def test_segment_called_from_inside_other_segments(registered, preservation):
    factory = lambda: SharedProjector(registered)  # noqa: E731
    assert_exact(factory, ["proj", "blocks.0", "blocks.1"], preservation)
    assert naive_outcome(factory, ["proj", "blocks.0", "blocks.1"]) != "exact"


# ============================================================ 6. torch.func.functional_call
class MaskedTwin(nn.Module):
    """Calls its block twice: as itself, and with a masked weight substituted by
    ``torch.func.functional_call`` (the block has batch norm, so both calls write state)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = NormBlock()
        self.other = GatedMLP()
        self.register_buffer("mask", (torch.rand(D, D) > 0.3).float())
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        plain = self.block(x)
        w = {"lin.weight": self.block.lin.weight * self.mask}
        masked = torch.func.functional_call(self.block, w, (x,))
        return self.head(self.other(plain + masked))


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_functional_call_with_substituted_parameters(preservation):
    assert_exact(MaskedTwin, ["block", "other"], preservation)
    assert naive_outcome(MaskedTwin, ["block", "other"]) != "exact"


# ======================================================== 7. options changed while a replay waits
class QueueNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.register_buffer("queue", torch.randn(8, D))

    def forward(self, x):
        h = self.bn(self.lin(x))
        q = self.queue.clone()
        return torch.tanh(x + torch.softmax(h @ q.T, -1) @ q)


class InPlaceEnqueue(Stack):
    ptr = 0

    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.queue[self.ptr : self.ptr + B] = h.detach()
        self.ptr = (self.ptr + B) % 8


OPTION_CYCLE = ["whole", "regions", "retain", "whole"]


def _two_forwards_one_backward(model, x, engine, step):
    """Two forwards share one backward; between them the segments' options change."""
    a = model(x)
    if engine is not None:
        engine.set_options({n: OPTION_CYCLE[(step + i) % 4] for i, n in enumerate(SEGS2)})
    b = model(x.flip(0) * 0.5)
    (a.pow(2).mean() + b.pow(2).mean()).backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_set_options_while_an_invocation_waits_for_backward(preservation):
    factory = lambda: InPlaceEnqueue([QueueNorm(), QueueNorm()])  # noqa: E731
    assert_exact(factory, SEGS2, preservation, step_fn=_two_forwards_one_backward)


def _replan_between_forwards(model, x, engine, step):
    a = model(x)
    if (
        engine is not None
        and engine.costs is not None
        and not engine._calibration
        and engine.plan is not None
    ):
        engine.replan(budget="min" if step % 2 else None)
    b = model(x * 2.0)
    (a.pow(2).mean() + b.pow(2).mean()).backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_replan_while_an_invocation_waits_for_backward(preservation):
    factory = lambda: InPlaceEnqueue([QueueNorm(), QueueNorm()])  # noqa: E731
    assert_exact(
        factory,
        SEGS2,
        preservation,
        steps=10,
        step_fn=_replan_between_forwards,
        budget="min",
        calibration_steps=1,
    )


# ============================================================ 8. checks and the engine's reaction
class Everything(nn.Module):
    """Rebinding (an RNN state), a private generator first drawn at the third call, and a
    buffer first written (then read) inside the segment from the fourth call."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.h = torch.zeros(B, D)
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.lin(x) + self.h)
        if self.calls >= 3:
            h = h + 0.1 * torch.randn(h.shape, generator=self.gen)
        if self.calls >= 4:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
            h = h - self.ema
        self.h = h.detach()
        return h


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_checked_steps_leak_none_of_the_replays_side_effects(preservation):
    factory = lambda: Stack([Everything(1), Everything(2)])  # noqa: E731
    summary, records = assert_exact(
        factory, SEGS2, preservation, steps=7, checks=(1, 2, 3, 4, 5, 6)
    )
    grad_checks = [r for r in records if r.check == "grad"]
    assert grad_checks, "no derivative check ran"
    assert {r.outcome for r in grad_checks} == {"match"}, grad_checks


_KNOB = {"gain": 1.0}


#: read through a module-level ``functools.partial``: out of scope (a module-level value the
#: forward named itself, or a closure cell of a function it calls, would be in its contract),
#: the replay cannot see it change
_knob = functools.partial(operator.getitem, _KNOB)


class GlobalKnob(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + _knob("gain") * torch.tanh(self.lin(x))


class TurnsTheKnob(Stack):
    def after(self, h):
        _KNOB["gain"] *= 1.5


def test_a_divergence_reprobes_then_demotes_to_retain():
    _KNOB["gain"] = 1.0
    factory = lambda: TurnsTheKnob([GlobalKnob(), GlobalKnob()])  # noqa: E731
    base = _fresh(factory)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, 7)
    _KNOB["gain"] = 1.0
    engine = lr.install(model, SEGS2, preservation="whole")
    # step 0 probes; step 1 is checked (diverges: re-probe); step 2 re-probes (retained);
    # step 3 is checked again (diverges: retain for good); steps 4-6 run retained
    g_rep = _train(model, 7, engine=engine, checks=(1, 3))
    records = engine.records.read()
    summary = engine.summary()
    engine.uninstall()
    _KNOB["gain"] = 1.0
    # checked steps train on the reference gradients, re-probes and retained steps are exact
    assert_same_grads(g_ref, g_rep)
    assert_same_state(snapshot_state(ref), snapshot_state(model))
    for seg in SEGS2:
        reactions = [
            json.loads(r.detail)["action"]
            for r in records
            if r.segment == seg and r.check == "reaction"
        ]
        assert reactions == ["re-probe", "retain"], (seg, reactions)
        assert summary[seg]["mode"] == "retain", summary[seg]


@pytest.fixture(autouse=True)
def _reset_knob():
    _KNOB["gain"] = 1.0
    yield
    _KNOB["gain"] = 1.0


class _ListMemoryBlock(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        object.__setattr__(self, "owner", owner)  # a back-reference, not a submodule

    def forward(self, x):
        return torch.tanh(self.fc(x) + self.owner.memory[0])


class _ListMemoryRoot(nn.Module):
    """A tensor kept in a *list* on the root (outside the segments), replaced in the list
    after the blocks, starting at the third step: outside, rebound, and late at once."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = [torch.zeros(D)]
        self.blocks = nn.ModuleList([_ListMemoryBlock(self) for _ in range(2)])
        self.calls = 0

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        self.calls += 1
        if self.calls >= 3:
            self.memory[0] = x.detach().mean(0)
        return x


@pytest.mark.parametrize("preservation", ["auto", "whole", "regions"])
def test_tensor_in_a_list_on_the_root_replaced_after_a_warmup(preservation):
    torch.manual_seed(0)
    base = _ListMemoryRoot()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    engine = lr.install(model, "blocks.*", preservation=preservation)
    for step in range(6):
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(step))
        for m in (ref, model):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), (step, n)
    assert all(s["replays"] >= 4 for s in engine.summary().values())
