"""Adversary session 28: the selective option against wrapper subclasses, replays run inside
another segment's forward, and returned products written by ways no version counter shows.

Harness: ``tests/test_adversary_s25b.py``'s ``_compare`` (plain copy and installed copy from the
same seed, same inputs, one thread; every step's gradients and the final state bit for bit; no
divergence record). Each test's docstring gives what failed before this session's fixes.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import lightning_replay as lr
from lightning_replay.errors import ReplayConfigError

from tests.test_adversary_s25b import POLICIES, D, _compare, _one_thread  # noqa: F401


# ----------------------------------------------------------- 1. wrapper tensor subclasses
class _WrapperBlock(nn.Module):
    """A bias-free Linear on a 3-d wrapper-subclass input (``mm`` + ``_unsafe_view`` under the
    wrapper's dispatch), its product scaled in place when ``write``."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.write = write

    def forward(self, x):
        h = self.a(x)
        if self.write:
            h.mul_(2.0)
        return x + self.c(torch.tanh(h))


def _wrapper_net(write: bool):
    class WrapperNet(nn.Module):
        """Activations carried as a ``__torch_dispatch__`` wrapper subclass (torch's
        TwoTensor: the kind DTensor and float8/NF4 wrappers are) through the head too (the
        loss unwrapped at the head instead hid the wrong gradients, before the fix)."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_WrapperBlock(write) for _ in range(2))
            self.head = nn.Linear(D, D)

        def forward(self, x):
            t = TwoTensor(x, x * 0.5)
            for b in self.blocks:
                t = b(t)
            return self.head(t)

    return WrapperNet


@pytest.mark.parametrize("policy", POLICIES)
def test_wrapper_subclass_product_written_in_place(policy):
    """Before: wrong gradients from step 1 under every policy, no record (max abs 3.1e-2 on
    blocks.1.a.weight, 21 (step, parameter) pairs off): a wrapper has no storage of its own,
    so the kept product's writes were never matched to it (``_storages`` skipped it) while
    ``_keepable`` still kept it. A wrapper's outputs are not kept now: their ops run again."""
    _compare(_wrapper_net(write=True), policy=policy)


def test_wrapper_subclass_under_the_planner():
    """Before: ``RuntimeError: Attempted to access the data pointer on an invalid python
    storage`` from ``SelectiveFrame.kept_tensors`` at step 1 of ``budget="min",
    selective="matmul"`` (the kept wrapper output's storage asked for its address)."""
    _compare(_wrapper_net(write=False), budget="min", policy="matmul", steps=6)


# ------------------------------------------- 2. a replay run inside another segment's forward
class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc(x)))


class _Differentiates(nn.Module):
    """Differentiates the first segment's output with respect to the model's input inside its
    own forward (an input-gradient feature, a PDE residual): the first segment replays inside
    this segment's forward, and again inside its replay."""

    def __init__(self, create_graph: bool) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
        self.create_graph = create_graph

    def forward(self, h, x):
        (g,) = torch.autograd.grad(
            h.pow(2).sum(), x, create_graph=self.create_graph, retain_graph=True
        )
        return self.fc2(torch.tanh(self.fc(g))) + self.fc(h)


def _pinn(create_graph: bool):
    class Pinn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _Inner(), _Differentiates(create_graph)
            self.head = nn.Linear(D, D)

        def forward(self, x):
            x = x.detach().requires_grad_(True)
            return self.head(self.b(self.a(x), x))

    return Pinn


@pytest.mark.parametrize("create_graph", [True, False], ids=["create_graph", "no_graph"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_segment_replays_inside_another_segments_forward(policy, create_graph):
    """Before (matmul, every_other_matmul): wrong gradients from step 1, no record (1.1e-2 on
    b.fc2.weight, 27 (step, parameter) pairs off over 4 steps): ``a``'s replay ran inside
    ``b``'s forward mode, which counted the ops it let through as ``b``'s own; at ``b``'s
    replay ``a`` replayed again with its kept outputs gone, so more ops reached ``b``'s replay
    mode, its per-op call counts shifted and ``b``'s kept ``addmm`` #0 stood in for another
    call of the same shape. A frame now counts only the ops of its own forward and replay
    (``selective._REPLAYS``)."""
    _compare(_pinn(create_graph), segments=["a", "b"], policy=policy)


def test_a_segment_replays_inside_another_segments_forward_under_the_planner():
    """Before: 117 (step, parameter) pairs off from step 4 with ``budget="min"``, every
    segment selective (``planner="selective_all"``)."""
    _compare(
        _pinn(True), segments=["a", "b"], budget="min", policy="matmul", planner="selective_all"
    )


# ------------------------------------ 3. a returned product written through an unsafe alias
class _ReturnsProduct(nn.Module):
    """Returns its ``addmm`` product and a gate it computed from it (sigmoid saves its own
    output: the product is what a selective replay reads to rebuild it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.s = nn.Parameter(torch.ones(D))

    def forward(self, x):
        h = self.fc(x)
        return h, torch.sigmoid(h) * self.s


class _SplitsItsInput(nn.Module):
    """The next segment writes half of its input through ``unsafe_chunk`` (an alias with a
    version counter of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h, g):
        q, _ = h.unsafe_chunk(2, -1)
        q.mul_(2.0)
        return self.fc(g + h)


def _writes_returned(by: str):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _ReturnsProduct(), _SplitsItsInput()
            self.head = nn.Linear(D, D)

        def forward(self, x):
            h, g = self.a(x)
            if by == "caller":
                q, _ = h.unsafe_split(D // 2, -1)
                q.mul_(0.5)
                return self.head(g + h)
            return self.head(self.b(h, g))

    return Net


@pytest.mark.parametrize("by", ["caller", "next_segment"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_returned_product_written_through_an_unsafe_alias(policy, by):
    """Before: wrong gradients from step 1 under every policy, no record (1.9e-3 on a.s by the
    caller, 2.1e-3 by the next segment): the alias ``unsafe_split``/``unsafe_chunk`` made
    outside the segment moved no counter the frame held. A product the segment returns is not
    kept now (``SelectiveFrame.watch_outputs``)."""
    _compare(
        _writes_returned(by), segments=["a", "b"] if by == "next_segment" else ["a"], policy=policy
    )


# ------------------------------------------------ 4. a generator passed to the segments
@dataclasses.dataclass
class _Draws:
    gen: torch.Generator


#: how the caller passes the step's generator, and how the segment gets it back: directly, in
#: a dict beside the input, and in what the argument walk passes whole (an object, a
#: dataclass, a partial or containers that hold no tensor)
PASS = {
    "argument": (lambda x, g: g, lambda x, a: (x, a)),
    "dict": (lambda x, g: {"x": x, "gen": g}, lambda x, a: (a["x"], a["gen"])),
    "list": (lambda x, g: [g], lambda x, a: (x, a[0])),
    "namespace": (lambda x, g: types.SimpleNamespace(g=g), lambda x, a: (x, a.g)),
    "dataclass": (lambda x, g: _Draws(g), lambda x, a: (x, a.gen)),
    "partial": (
        lambda x, g: functools.partial(torch.rand, generator=g),
        lambda x, a: (x, a.keywords["generator"]),
    ),
    "nested": (lambda x, g: {"cfg": [[g]]}, lambda x, a: (x, a["cfg"][0][0])),
}


class _DrawsFromPassed(nn.Module):
    """Noise drawn from a generator the caller passes, as :data:`PASS` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.how = how

    def forward(self, x, arg):
        x, gen = PASS[self.how][1](x, arg)
        noise = torch.rand(x.shape, generator=gen)
        return x + torch.tanh(self.fc(x)) * noise


def _passes_a_generator(how: str):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_DrawsFromPassed(how) for _ in range(2))
            self.head = nn.Linear(D, D)

        def forward(self, x):
            # a generator made for this step (no object the probe saw): both segments draw
            gen = torch.Generator().manual_seed(int(x[0, 0, 0].abs() * 1000))
            for b in self.blocks:
                x = b(x, PASS[how][0](x, gen))
            return self.head(x)

    return Net


@pytest.mark.parametrize("how", list(PASS))
@pytest.mark.parametrize(
    "install",
    [{}, {"preservation": "whole"}, {"preservation": "selective", "selective": "matmul"}],
    ids=["default", "whole", "selective"],
)
def test_a_generator_passed_to_the_segments(install, how):
    """Before (every install): wrong gradients from step 1, no record (1.6e-2): the replay
    drew from where the step's later draws left the generator. Its state at each call is
    put back for the replay now, as a generator outside torch passed in already was. (The
    namespace, dataclass, partial and nested forms were still missed by the first fix: a
    later adversary.)"""
    _compare(_passes_a_generator(how), install=install)


# ------------------------------------------ 5. a torch.func transform inside a segment's forward
class _FuncGrad(nn.Module):
    """Descends the gradient of an energy it computes with ``torch.func.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, 1)

    def forward(self, x):
        def energy(t):
            return self.fc2(torch.tanh(self.fc(t))).sum()

        return x - 0.1 * torch.func.grad(energy)(x) + self.fc2(torch.tanh(self.fc(x)))


class _Holds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _FuncGrad()

    def forward(self, x):
        return self.inner(x) * 2


@pytest.mark.parametrize("nested", [False, True], ids=["own_forward", "inner_module"])
def test_a_torch_func_transform_inside_a_segment_is_named(nested):
    """Before: torch's ``RuntimeError: torch.func.{grad, vjp, jacrev, hessian} don't yet
    support saved tensor hooks`` from deep in functorch at the first step. Now a
    ``ReplayConfigError`` naming the segment whose hooks the transform refused (the outer
    one where the transform runs in a module inside it) and what to do."""
    model = nn.Sequential(_Holds() if nested else _FuncGrad(), nn.Linear(D, D))
    engine = lr.install(model, ["0"])
    try:
        with pytest.raises(ReplayConfigError, match=r"segment '0' runs a torch.func transform"):
            model(torch.randn(4, D)).sum().backward()
    finally:
        engine.uninstall()


# ------------------------- 6. a segment called inside another that differentiates its output
class _Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _CallsAndDifferentiates(nn.Module):
    """Calls segment ``a`` again inside its own forward (held in a plain list: ``a`` runs as
    part of this segment there) and differentiates that output with respect to the model's
    input: the gradient reaches tensors this segment's forward saved so far, so checkpoint
    replays this segment while its forward still runs."""

    def __init__(self, a: nn.Module, create_graph: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.sib = [a]
        self.create_graph = create_graph

    def forward(self, h, x):
        s = self.sib[0](h)
        (g,) = torch.autograd.grad(s.sum(), x, create_graph=self.create_graph, retain_graph=True)
        return self.fc(s) + g


def _calls_and_differentiates(create_graph: bool):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = _Tanh()
            self.b = _CallsAndDifferentiates(self.a, create_graph)

        def forward(self, x):
            x = x.detach().requires_grad_(True)
            return self.b(self.a(x), x)

    return Net


@pytest.mark.parametrize("create_graph", [True, False], ids=["create_graph", "no_graph"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_segment_replayed_while_its_own_forward_runs(policy, create_graph):
    """Before (matmul, flops): ``KeyError: 0`` from deep in the selective replay mode at the
    first replayed step: the replay run inside the forward consumed and released what the
    frame had kept so far. Such a replay is a full one now (the frame keeps on)."""
    _compare(_calls_and_differentiates(create_graph), segments=["a", "b"], policy=policy)


class _Counted(_Tanh):
    """``_Tanh`` that counts its calls in a buffer (written under no_grad) and scales by it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cnt", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.cnt.add_(1)
        return super().forward(x) * (1 + 0.1 * self.cnt)


class _CountedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Counted()
        self.b = _CallsAndDifferentiates(self.a, True)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        return self.b(self.a(x), x)


def test_regions_counter_of_a_segment_called_inside_a_self_replaying_one():
    """Before: under ``preservation="regions"``, ``ContractViolation: state 'a.cnt' was written
    outside the logged window (version 4 at forward, 7 at replay, expected 6)``, a false one
    (``whole`` trains it exactly): ``a``'s replay runs inside ``b``'s backward replay (``b``'s
    autograd.grad), after that replay wrote ``a.cnt`` (``a``'s call inside ``b``: unlogged
    while a replay runs, undone and its version reset only as ``b``'s replay ends). A replay
    nested in another reads the enclosing replay's state at the versions it began with."""
    _compare(_CountedNet, segments=["a", "b"], install={"preservation": "regions"})


def test_whole_counter_of_a_segment_called_inside_a_self_replaying_one():
    """The same model under ``whole`` (and the default): exact."""

    _compare(_CountedNet, segments=["a", "b"], install={"preservation": "whole"})
