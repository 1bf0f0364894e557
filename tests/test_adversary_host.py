"""Adversarial models for host random generators in the replay contract, and departed replays.

Python's ``random``, numpy's global RNG and ``random.Random`` / ``np.random.RandomState`` /
``np.random.Generator`` objects held as direct module attributes are part of a segment's replay
contract (``lightning_replay/host_rng.py``); ``HostWatch`` records global host generators that
move in a forward no probe saw them move in, and captures them at every segment call after. A
steady replay that takes another path than its forward is a ``replay`` divergence record and an
``lr.ReplayError`` naming the segment (``restore.py``: ``_departed``, ``_replay_departed``).

Each model is something real training code does, trained with plain PyTorch and with
``lr.install`` under both probe kinds (``replayed``: a budget every plan meets; ``retained``: no
budget), with the same seeds per step for torch, ``random`` and numpy (the harness of
``tests/test_adversary_probe.py``). The promise under test: never silently wrong gradients, no
false alarm on a model that is exact, no raw torch error where a ``ReplayError`` naming the
segment is due, no crash on a model plain PyTorch trains. Failures known today are
``xfail(strict=True)`` with the measured failure as the reason.
"""

from __future__ import annotations

import dataclasses
import random
import time
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import lightning as L
import lightning_replay as lr
from tests.helpers.compare import diff_state, grad_diffs, snapshot_state
from tests.test_adversary_probe import (
    KINDS,
    MLP,
    Case,
    D,
    _branch_model,
    outside_reader,
    _params,
    _seed,
    _train,
    stack,
    with_head,
)

TWO = ("blocks.0", "blocks.1")


# --------------------------------------------------------------------------- host-RNG blocks
class SharedRngNoise(nn.Module):
    """Multiplicative noise from a ``random.Random`` that every block shares (one object, set as
    a direct attribute of each block by the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.rng: random.Random | None = None

    def forward(self, x):
        c = torch.tensor([self.rng.uniform(0.5, 1.5) for _ in range(D)])
        return x + self.f(x) * c


def _shared_rng_model() -> nn.Module:
    m = stack(SharedRngNoise)()
    rng = random.Random(3)
    for b in m.blocks:
        b.rng = rng
    return m


class SeededNumpyNoise(nn.Module):
    """A numpy Generator made inside forward from a seed attribute and a call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.seed, self.t = 11, 0

    def forward(self, x):
        self.t += 1
        g = np.random.default_rng(self.seed + self.t)
        return x + self.f(x) * torch.from_numpy(g.random(tuple(x.shape), dtype=np.float32))


class Jitter(random.Random):
    """A ``random.Random`` subclass with a helper method (its state is the base class's)."""

    def jitter(self, n: int) -> list[float]:
        return [1.0 + 0.3 * (self.random() - 0.5) for _ in range(n)]


class SubclassNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.rng = Jitter(5)

    def forward(self, x):
        return x + self.f(x) * torch.tensor(self.rng.jitter(D))


class ReseedInside(nn.Module):
    """``random.seed`` called inside forward from a counter, then draws (per-call reseeding)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.t = 0

    def forward(self, x):
        self.t += 1
        random.seed(1000 + self.t)
        return x + self.f(x) * torch.tensor([random.gauss(1.0, 0.2) for _ in range(D)])


class RejectionSampled(nn.Module):
    """A variable number of draws from Python's ``random`` (rejection sampling; ``gauss``
    keeps a cached second value in the generator's state)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x):
        vals = []
        while len(vals) < D:
            v = random.gauss(0.0, 1.0)
            if abs(v) < 1.0:
                vals.append(1.0 + 0.2 * v)
        return x + self.f(x) * torch.tensor(vals)


class NoGradHostMask(nn.Module):
    """A keep mask drawn from numpy's global RNG inside ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x):
        with torch.no_grad():
            keep = torch.from_numpy((np.random.rand(x.shape[0], 1) < 0.7).astype("float32"))
        return x + self.f(x) * keep


class _HostNoiseFn(torch.autograd.Function):
    """Noise drawn from Python's ``random`` inside a custom Function's forward, saved for its
    backward."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.tensor([random.uniform(0.5, 1.5) for _ in range(x.shape[-1])])
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, g):
        (noise,) = ctx.saved_tensors
        return g * noise


class FunctionNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x):
        return x + _HostNoiseFn.apply(self.f(x))


class InnerNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.rng = np.random.RandomState(2)

    def forward(self, x):
        return x + self.f(x) * torch.from_numpy(self.rng.rand(*x.shape).astype("float32"))


class Outer(nn.Module):
    """A block drawing from Python's global RNG, with a submodule drawing from a RandomState it
    holds (two levels of modules; nested segments are refused at install)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = InnerNoise()
        self.g = nn.Linear(D, D)

    def forward(self, x):
        c = torch.tensor([random.uniform(0.5, 1.5) for _ in range(D)])
        return self.inner(torch.tanh(self.g(x)) * c)


class TorchAndPython(nn.Module):
    """A private ``torch.Generator`` for dropout-like noise and Python's ``random`` for a
    per-call scale."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.gen = torch.Generator().manual_seed(9)

    def forward(self, x):
        s = random.uniform(0.5, 1.5)
        keep = (torch.rand(x.shape, generator=self.gen) < 0.8).float()
        return x + self.f(x) * keep * s


# ---- host generators the contract does not reach
class ContainedRng(nn.Module):
    """A host generator held one level below a module attribute: in a list (one per branch), a
    dict (a config) or a plain holder object (an options namespace)."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__()
        self.f = MLP()
        rng = random.Random(4) if kind == "python" else np.random.default_rng(4)
        self.kind = kind
        if where == "list":
            self.rngs = [rng]
        elif where == "dict":
            self.cfg = {"rng": rng}
        else:
            self.opts = types.SimpleNamespace(rng=rng)
        self.where = where

    def _rng(self):
        if self.where == "list":
            return self.rngs[0]
        if self.where == "dict":
            return self.cfg["rng"]
        return self.opts.rng

    def forward(self, x):
        r = self._rng()
        if self.kind == "python":
            c = torch.tensor([r.uniform(0.5, 1.5) for _ in range(D)])
        else:
            c = torch.from_numpy(r.uniform(0.5, 1.5, size=D).astype("float32"))
        return x + self.f(x) * c


class WarmupNoise(nn.Module):
    """Noise that starts after a number of calls, counted by the module itself (a warm-up):
    the counter changes every call, so the guards re-probe once and then leave it to the
    replay; the draws start after every probe. ``held``: from a ``random.Random`` the module
    holds; else from Python's global ``random``."""

    def __init__(self, held: bool, after: int = 3) -> None:
        super().__init__()
        self.f = MLP()
        self.t, self.after = 0, after
        self.rng = random.Random(8) if held else random

    def forward(self, x):
        self.t += 1
        y = self.f(x)
        if self.t > self.after:
            y = y * torch.tensor([self.rng.uniform(0.5, 1.5) for _ in range(D)])
        return x + y


class PeekedNoise(nn.Module):
    """Draws noise from Python's global RNG and puts the state back after (an RNG fork, so
    that this block does not shift the stream the rest of the program sees): the state is the
    same before and after the forward, yet the forward read it."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x):
        st = random.getstate()
        c = torch.tensor([random.uniform(0.5, 1.5) for _ in range(D)])
        random.setstate(st)
        return x + self.f(x) * c


def _draw_after_forward_step(model, x):
    """The loss draws from Python's ``random`` after the model's forward, before backward
    (a random loss weight): outside every window's forward."""
    out = model(x)
    w = random.uniform(0.5, 1.5)
    (w * out.float() ** 2).mean().backward()


_LOGGED: list[int] = []


class SystemRandomHolder(nn.Module):
    """Holds a ``random.SystemRandom`` (OS entropy, no state) to pick which sample of the batch
    to log; the training computation never depends on it."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.picker = random.SystemRandom()

    def forward(self, x):
        _LOGGED.append(self.picker.randrange(x.shape[0]))  # kept outside: OS entropy differs
        del _LOGGED[:-4]  # from run to run, plain PyTorch's included
        return x + self.f(x)


class NoiseFromAttribute(nn.Module):
    """Noise from whatever numpy Generator its ``rng`` attribute holds."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        return x + self.f(x) * torch.from_numpy(self.rng.random(tuple(x.shape), dtype=np.float32))


class PerStepGenerators(nn.Module):
    """Gives its blocks a fresh numpy Generator seeded from its call count every step (per-step
    reproducible noise, as resumable pipelines do): a direct attribute, another object each
    step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NoiseFromAttribute() for _ in range(2))
        self.head = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for i, b in enumerate(self.blocks):
            b.rng = np.random.default_rng(1000 * i + self.calls)
            x = b(x)
        return self.head(x)


class NoiseFromArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x, rng):
        return x + self.f(x) * torch.from_numpy(rng.random(tuple(x.shape), dtype=np.float32))


class PassesGenerator(nn.Module):
    """Passes the numpy Generator it holds to its blocks as an argument (``forward(x, rng)``,
    as diffusers-style code passes ``generator=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NoiseFromArgument() for _ in range(2))
        self.head = nn.Linear(D, D)
        self.rng = np.random.default_rng(6)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, self.rng)
        return self.head(x)


@dataclasses.dataclass(frozen=True)
class Expect:
    """``exact``: the probe can know every host generator involved, so gradients and state must
    equal plain PyTorch's and no rejection or divergence is recorded. Otherwise the first step
    whose gradients differ must carry a rejection or divergence record."""

    case: Case
    exact: bool = True


HOST = {
    "rng_shared_by_two_segments": Expect(Case(_shared_rng_model, TWO)),
    "numpy_generator_from_seed_attribute": Expect(Case(stack(SeededNumpyNoise), TWO)),
    "random_Random_subclass": Expect(Case(stack(SubclassNoise), TWO)),
    "random_seed_called_inside_forward": Expect(Case(stack(ReseedInside), TWO)),
    "rejection_sampling_variable_draws": Expect(Case(stack(RejectionSampled), TWO)),
    "numpy_mask_drawn_under_no_grad": Expect(Case(stack(NoGradHostMask), TWO)),
    "draw_inside_autograd_function": Expect(Case(stack(FunctionNoise), TWO)),
    "inner_module_and_block_both_drawing": Expect(Case(stack(Outer), TWO)),
    "torch_generator_and_python_random": Expect(Case(stack(TorchAndPython), TWO)),
    "loss_draws_after_forward": Expect(
        Case(stack(RejectionSampled), TWO, step=_draw_after_forward_step)
    ),
    # a generator in a container: not restored, but never silently wrong
    "python_random_in_list": Expect(
        Case(stack(lambda: ContainedRng("list", "python")), TWO), False
    ),
    "numpy_generator_in_dict": Expect(
        Case(stack(lambda: ContainedRng("dict", "numpy")), TWO), False
    ),
    "python_random_on_holder": Expect(
        Case(stack(lambda: ContainedRng("holder", "python")), TWO), False
    ),
    # draws that start after every probe: the global one is recorded by HostWatch, then captured
    "global_random_after_warmup": Expect(
        Case(stack(lambda: WarmupNoise(False)), TWO, steps=6), False
    ),
    "held_random_after_warmup": Expect(Case(stack(lambda: WarmupNoise(True)), TWO, steps=6), False),
    # the state is read and put back, not moved: the probe sees the reads themselves
    "peeked_global_random_loss_draws_after": Expect(
        Case(stack(PeekedNoise), TWO, step=_draw_after_forward_step)
    ),
    "system_random_held_for_logging": Expect(Case(stack(SystemRandomHolder), TWO)),
    # a direct attribute, another object each step; a generator passed as an argument
    "generator_rebound_every_step": Expect(Case(PerStepGenerators, TWO, steps=5), False),
    "generator_passed_as_argument": Expect(Case(PassesGenerator, TWO), False),
}

XFAIL: dict[tuple[str, str], str] = {}


def _bad_records(records) -> list:
    return [r for r in records if r.outcome in ("divergence", "rejection")]


@pytest.mark.parametrize(("name", "kind"), _params(HOST, XFAIL))
def test_host_rng_never_silently_wrong(name, kind):
    """Step by step against plain PyTorch: an exact model trains bit for bit, leaves every host
    generator where plain PyTorch leaves it and is never flagged; any other step whose
    gradients differ carries a rejection or divergence record of its own."""
    expect = HOST[name]
    run = _lockstep(expect.case, KINDS[kind])
    assert run.error is None, f"{name} ({kind}) raised {type(run.error).__name__}: {run.error}"
    if expect.exact:
        assert not run.bad and not run.state_bad and not run.leaks and not run.flagged, (
            f"{name} ({kind}): gradients differ at steps {run.wrong_steps}, state "
            f"{run.state_bad[:4]}, host generators differ after steps {run.leaks}; "
            f"records {run.flagged}"
        )
        return
    assert not run.silent_steps, (
        f"{name} ({kind}): silently wrong: gradients differ from plain PyTorch at steps "
        f"{run.wrong_steps}, records only at {run.flagged}"
    )


def _host_states(model: nn.Module) -> list:
    """Python's and numpy's global generator states, and those of host generators a module of
    ``model`` holds (directly, in a list or dict, or on a plain holder object)."""
    out = [random.getstate(), np.random.get_state()[1].tolist()]
    for name, m in model.named_modules():
        for k, v in vars(m).items():
            inner = (
                v
                if isinstance(v, (list, tuple))
                else list(v.values())
                if isinstance(v, dict)
                else list(vars(v).values())
                if isinstance(v, types.SimpleNamespace)
                else [v]
            )
            for r in inner:
                if isinstance(r, random.Random) and not isinstance(r, random.SystemRandom):
                    out.append((name, k, r.getstate()))
                elif isinstance(r, np.random.RandomState):
                    out.append((name, k, r.get_state()[1].tolist()))
                elif isinstance(r, np.random.Generator):
                    out.append((name, k, repr(r.bit_generator.state)))
    return out


def _lockstep(case: Case, budget: int | None):
    """Plain PyTorch and the engine side by side from the same initial state and seeds, both
    trained on plain PyTorch's gradients, so that each step is compared from the same weights
    (a difference does not carry into later steps, unlike ``_train``, whose first differing step
    is all it can judge).

    Returns the (step, parameter) pairs whose gradients differ, the steps after which a host
    generator's state differs from plain PyTorch's (the stream the rest of the program sees),
    the final state differences, the records and the error."""
    _seed(-100)
    ref = case.model()
    _seed(-100)
    model = case.model()
    eng = lr.install(model, list(case.segments), budget=budget, on_violation="record")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    bad, leaks, warned, error = [], [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            for step in range(case.steps):
                n_caught = len(caught)
                for o in opts:
                    o.zero_grad(set_to_none=True)
                _seed(step)
                case.step(ref, case.make_input(step))
                host_ref = _host_states(ref)
                _seed(step)
                case.step(model, case.make_input(step))
                if _host_states(model) != host_ref:
                    leaks.append(step + 1)
                ps = dict(model.named_parameters())
                for n, p in ref.named_parameters():
                    q = ps[n]
                    if (p.grad is None) != (q.grad is None) or (
                        p.grad is not None and not torch.equal(p.grad, q.grad)
                    ):
                        bad.append((step + 1, n))
                    q.grad = None if p.grad is None else p.grad.clone()
                for o in opts:
                    o.step()
                warned += [step + 1] * sum(
                    issubclass(w.category, RuntimeWarning) for w in caught[n_caught:]
                )
        except Exception as e:  # noqa: BLE001 (the tests classify it)
            error = e
    records = eng.records.read()
    if error is None:
        eng.uninstall()
    state_bad = diff_state(snapshot_state(ref), snapshot_state(model))
    return Run(bad, leaks, state_bad, records, error, warned)


@dataclasses.dataclass
class Run:
    bad: list  # (step, parameter) whose gradients differ from plain PyTorch's
    leaks: list  # steps after which a host generator's state differs from plain PyTorch's
    state_bad: list  # parameters and buffers that differ at the end
    records: list
    error: Exception | None
    warned: list = dataclasses.field(default_factory=list)  # the step of each RuntimeWarning

    @property
    def flagged(self) -> list:
        """(step, check) of each rejection or divergence record."""
        return sorted({(r.step, r.check) for r in _bad_records(self.records)})

    @property
    def wrong_steps(self) -> list:
        return sorted({s for s, _ in self.bad})

    @property
    def silent_steps(self) -> list:
        """Steps whose gradients differ from plain PyTorch's with no record at that step."""
        flagged = {s for s, _ in self.flagged}
        return [s for s in self.wrong_steps if s not in flagged]


# --------------------------------------------------------------------------- departed replays
def _early_stop_off_step(model, x):
    """torch's documented use of ``set_checkpoint_early_stop``: around the forward only ("This
    context manager only needs to be active when forward is run"), backward outside."""
    with set_checkpoint_early_stop(False):
        out = model(x)
    (out.float() ** 2).mean().backward()


_LEN = {"n": D}  # a sequence length (a curriculum) held in a closure, stepped in the window
_len = outside_reader(_LEN)


class Truncated(nn.Module):
    """Reads the first ``_len('n')`` features: another length takes the same ops on other
    shapes (the same number of saved tensors, other metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)

    def forward(self, x):
        n = _len("n")
        return torch.tanh(x[:, :n] @ self.w[:n])


def _truncated_model():
    _LEN["n"] = D

    def shorten(m, x, y):
        _LEN["n"] = D if _LEN["n"] < D else D // 2

    return with_head(Truncated, shorten)()


DEPARTED = {
    # exact models: no departure at all
    "early_stop_off_around_forward": (Case(stack(MLP), TWO, step=_early_stop_off_step), False),
    # departures: a ReplayError naming the segment, after a divergence record
    "same_count_other_shapes": (Case(_truncated_model, ("blk",), steps=4), True),
    # fewer saved tensors with early stop off: checkpoint's own count check, after the replay
    "early_stop_off_branch_skipped": (
        Case(_branch_model(False), ("blk",), steps=6, step=_early_stop_off_step),
        True,
    ),
    "early_stop_off_branch_more_work": (
        Case(_branch_model(True), ("blk",), steps=6, step=_early_stop_off_step),
        True,
    ),
}
XFAIL_DEPARTED: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(("name", "kind"), _params(DEPARTED, XFAIL_DEPARTED))
def test_departed_replays(name, kind):
    """An exact model trains as plain PyTorch does, with no error and no record; a replay that
    departs from its forward is a ReplayError naming the segment after a divergence record.
    (``_train``, not ``_lockstep``: these models keep module-level state, which two models
    trained side by side would share.)"""
    case, departs = DEPARTED[name]
    g_ref, _, _, plain_error = _train(case, None, engine=False)
    assert plain_error is None, repr(plain_error)
    grads, _, records, error = _train(case, KINDS[kind], engine=True)
    flagged = sorted({(r.step, r.check) for r in _bad_records(records)})
    if not departs:
        assert error is None, f"{name} ({kind}): raised {type(error).__name__}: {error}"
        assert not grad_diffs(g_ref, grads) and not flagged, (name, kind, flagged)
        return
    assert isinstance(error, lr.ReplayError), (
        f"{name} ({kind}): expected a ReplayError naming the segment, got {error!r}"
    )
    assert "'blk'" in str(error) and "another path" in str(error), str(error)
    assert any(c in ("replay", "probe") for _, c in flagged), flagged
    # the step's gradients were never trained on: every step before it equals plain PyTorch's
    assert not grad_diffs(g_ref[: len(grads)], grads), (name, kind)


# --------------------------------------------------------------------------- HostWatch
class Jittered(nn.Module):
    """Input jitter drawn in the root forward, outside every segment (Python's and numpy's
    global RNGs), from the call ``start`` on (augmentation switched on after a warm-up); the
    blocks draw nothing."""

    def __init__(self, start: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(D, D)
        self.calls, self.start = 0, start

    def forward(self, x):
        self.calls += 1
        if self.calls >= self.start:
            x = x * random.uniform(0.9, 1.1) + float(np.random.normal(0.0, 0.01))
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _guard_records(run: Run) -> list:
    return [r.step for r in run.records if r.check == "guard" and r.outcome == "rejection"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_draws_outside_the_segments_every_step_are_no_alarm(kind):
    """The root forward draws from the global host generators every step, the segments never
    do. Exact step by step, and quiet: HostWatch makes the first step's replays check the
    generators, and none of them draws."""
    run = _lockstep(Case(Jittered, TWO, steps=5), KINDS[kind])
    assert run.error is None, repr(run.error)
    assert not run.bad and not run.leaks and not run.state_bad, (run.wrong_steps, run.leaks)
    assert _guard_records(run) == [], run.flagged
    assert run.warned == [] and run.flagged == [], (run.warned, run.flagged)


@pytest.mark.parametrize("kind", list(KINDS))
def test_draws_outside_the_segments_from_a_later_step_are_no_false_alarm(kind):
    """Augmentation in the root forward switched on at step 3; the segments never draw: exact,
    so neither a record nor a warning."""
    run = _lockstep(Case(lambda: Jittered(start=3), TWO, steps=5), KINDS[kind])
    assert run.error is None, repr(run.error)
    assert not run.bad and not run.leaks, (run.wrong_steps, run.leaks)
    assert not run.flagged and not run.warned, (run.flagged, run.warned)


class _PyNoiseBlock(nn.Module):
    """Per-feature scale noise from Python's global ``random`` inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.f = MLP()

    def forward(self, x):
        return x + self.f(x) * torch.tensor([random.uniform(0.8, 1.2) for _ in range(D)])


class AugmentingModule(L.LightningModule):
    """DataLoader-style augmentation inside ``training_step`` (a random flip from Python's
    ``random``, additive noise from numpy's global RNG), before blocks that draw from Python's
    ``random`` themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PyNoiseBlock() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if random.random() < 0.5:
            x = x.flip(1)
        x = x + torch.from_numpy(np.random.normal(0.0, 0.1, size=tuple(x.shape)).astype("float32"))
        return (self(x) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_augmenting(root, strategy):
    L.seed_everything(5, verbose=False)
    model = AugmentingModule()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.randn(40, D, generator=torch.Generator().manual_seed(2))
        ),
        batch_size=8,
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        trainer.fit(model, data)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, state, [w for w in caught if "drew from" in str(w.message)]


def test_lightning_augmentation_in_training_step(tmp_path):
    """Under ``Trainer(strategy="replay")`` (a replayed probe: budget "min"), augmentation in
    ``training_step`` draws from the global host generators outside the segments every step:
    the weights equal plain ``Trainer()``'s bit for bit, with no record and no warning (no
    replay draws)."""
    _, plain, _ = _fit_augmenting(tmp_path / "plain", "auto")
    trainer, ours, moved = _fit_augmenting(tmp_path / "replay", "replay")
    assert [k for k in plain if not torch.equal(plain[k], ours[k])] == []
    records = trainer.strategy.engine.records.read()
    assert not [r for r in records if r.check in ("guard", "replay")], records
    assert not [r for r in records if r.outcome == "divergence"]
    assert moved == [], [str(w.message) for w in moved]
    assert sum(s["replays"] for s in trainer.strategy.engine.summary().values()) > 0


# --------------------------------------------------------------------------- cost
class ManyTiny(nn.Module):
    """50 tiny segments; with ``draw``, the root forward draws from Python's and numpy's global
    generators once per step (outside the segments), so that HostWatch captures both at every
    one of the 50 segment calls and every replay swaps them in and out."""

    def __init__(self, draw: bool, n: int = 50) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.draw = draw

    def forward(self, x):
        if self.draw:
            x = x * random.uniform(0.9, 1.1) * float(np.random.uniform(0.9, 1.1))
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _step_times(draw: bool, engine: bool, steps: int = 12) -> tuple[list[float], list]:
    _seed(-100)
    model = ManyTiny(draw)
    eng = lr.install(model, "blocks.*", on_violation="record") if engine else None
    times, grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(steps):
            _seed(step)
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            # this process's CPU time: the suite's other worker does not count in it
            t0 = time.process_time()
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            times.append(time.process_time() - t0)
            grads.append([p.grad.clone() for p in model.parameters()])
    if eng is not None:
        eng.uninstall()
    return times[4:], grads  # steady steps (after the probe and calibration)


def test_host_capture_cost_on_fifty_tiny_segments(capsys):
    """HostWatch's capture at every segment call, measured (reported, not asserted: timing on
    a shared 2-core machine): steady step time with and without host draws, plain and engine.
    The captured configuration is exact."""
    med, grads = {}, {}
    for draw in (False, True):
        for engine in (False, True):
            t, grads[draw, engine] = _step_times(draw, engine)
            med[draw, engine] = sorted(t)[len(t) // 2] * 1e3
    for draw in (False, True):
        assert all(
            torch.equal(a, b)
            for ga, gb in zip(grads[draw, False], grads[draw, True])
            for a, b in zip(ga, gb)
        ), f"50 segments (host draws: {draw}): gradients differ from plain PyTorch"
    with capsys.disabled():
        print(
            "\n50 tiny segments, median steady step (ms): "
            f"plain {med[False, False]:.2f}, engine {med[False, True]:.2f} (no host draws); "
            f"plain {med[True, False]:.2f}, engine {med[True, True]:.2f} (host draws, captured "
            f"at every call): capture adds {med[True, True] - med[True, False] - (med[False, True] - med[False, False]):+.2f} ms/step"
        )
