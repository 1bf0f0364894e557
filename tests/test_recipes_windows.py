"""Issue 33, classes 4, 5, 6, 10 and 11 (and issue 34's never-called segment): windows and
backward passes that real training recipes open, against plain PyTorch / a plain ``Trainer()``.

- 4: a segment called twice inside one manual window (a GAN's steps in one ``training_step``);
- 5: a second backward through a stateful segment (R1, gradient penalty, second-order MAML,
  ``retain_graph=True``): the second replay swaps in the same preserved state, freed with the
  graph;
- 6: ``torch.autograd.grad`` inside a segment's forward (energy and Hamiltonian nets);
- 10: a segment called inside a custom ``autograd.Function``'s backward (reversible blocks);
- 11: segments that never replayed, silently: a backward that does not reach them, ``eval()``
  segments whose weights train, a segment never called (named, planned without, checked).
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import lightning_replay as lr
from lightning_replay import ReplayCallback, ReplayStrategy
from lightning_replay.verify import snapshot_state
from tests.helpers.compare import assert_same_grads, assert_same_state
from tests.helpers.lit_hazards import differing, state, trainer

D, B = 8, 6
PRESERVATIONS = ("auto", "whole", "regions")


def _x(step: int, dim: int = D) -> torch.Tensor:
    return torch.randn(B, dim, generator=torch.Generator().manual_seed(7 + step))


StepFn = Callable[[nn.Module, int], None]


def _train(model: nn.Module, step_fn: StepFn, steps: int, wrap=None) -> list[dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    grads = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        opt.zero_grad(set_to_none=True)
        if wrap is None:
            step_fn(model, step)
        else:
            with wrap():
                step_fn(model, step)
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
    return grads


def _exact(
    make: Callable[[], nn.Module],
    segments,
    step_fn: StepFn,
    steps: int = 6,
    manual: bool = False,
    **install_kw,
) -> lr.ReplayEngine:
    """Plain and replayed from one deep copy: no warning, same gradients every step, same
    state after, and nothing preserved past a step. Returns the engine (installed)."""
    torch.manual_seed(0)
    base = make()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, step_fn, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = lr.install(model, segments, window="manual" if manual else "root", **install_kw)
        g_rep = _train(model, step_fn, steps, wrap=engine.window if manual else None)
    assert_same_grads(g_ref, g_rep, "replay vs plain")
    assert_same_state(snapshot_state(ref), snapshot_state(model), "replay vs plain")
    assert engine.preserved_bytes == 0 and not engine.log.armed  # freed with each graph
    return engine


def _replays(engine: lr.ReplayEngine) -> dict[str, int]:
    return {n: s["replays"] for n, s in engine.summary().items()}


class BNBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x):
        return torch.tanh(self.bn(self.fc(x)))


class SNBlock(nn.Module):
    """Spectral norm: its power iteration writes ``u``/``v`` in every training forward."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = parametrizations.spectral_norm(nn.Linear(dim, dim))

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], n: int = 2) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.pre(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


BLOCKS = ["blocks.0", "blocks.1"]


# ============================================================ class 4: manual windows
def _twice_before_backward(m, step):
    x = _x(step)
    (m(x).pow(2).mean() + m(2 * x).pow(2).mean()).backward()


def _call_backward_call(m, step):
    x = _x(step)
    m(x).pow(2).mean().backward()
    m(2 * x).pow(2).mean().backward()


def _three_calls_two_backwards(m, step):
    x = _x(step)
    a = m(x).pow(2).mean()
    (a + m(0.5 * x).pow(2).mean()).backward()
    m(-x).pow(2).mean().backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
@pytest.mark.parametrize(
    "step_fn", [_twice_before_backward, _call_backward_call, _three_calls_two_backwards]
)
def test_segment_called_several_times_in_one_manual_window_is_exact(step_fn, preservation):
    """Backward runs inside the manual window, where the window's capture mode is on: the
    replays' own swaps and writes are not the window's (they were logged, and the next replay
    expected their versions: a false ContractViolation)."""
    engine = _exact(lambda: Stack(BNBlock), BLOCKS, step_fn, manual=True, preservation=preservation)
    assert all(n >= 5 for n in _replays(engine).values()), _replays(engine)


@pytest.mark.parametrize("preservation", ["regions", "auto"])
def test_manual_window_violations_recorded_none_and_segments_replay(preservation):
    """Under on_violation="record" the false alarm was a warning, a re-probe every step, and
    ``regions`` never replayed: now no rejection is recorded and every segment replays."""
    engine = _exact(
        lambda: Stack(BNBlock),
        BLOCKS,
        _twice_before_backward,
        manual=True,
        preservation=preservation,
        on_violation="record",
    )
    assert engine.records.read(check="version") == []
    assert all(s["status"] == "active" for s in engine.summary().values())


class PlainGAN(nn.Module):
    """G and a BN critic D, both segments; one step = a D update and a G update."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, D), nn.BatchNorm1d(D), nn.Tanh())
        self.D = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU(), nn.Linear(D, 1))


def _gan_step(m, step):
    # one manual window holds both updates, as ReplayStrategy's training_step does
    z = torch.randn(B, 4, generator=torch.Generator().manual_seed(step))
    real = _x(step)
    d_loss = F.softplus(m.D(m.G(z).detach())).mean() + F.softplus(-m.D(real)).mean()
    d_loss.backward()
    with torch.no_grad():  # the D update, inside the window
        for p in m.D.parameters():
            p -= 0.05 * p.grad
            p.grad = None
    F.softplus(-m.D(m.G(z))).mean().backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_gan_with_an_update_between_critic_calls_in_one_window_is_exact(preservation):
    engine = _exact(PlainGAN, ["G", "D"], _gan_step, manual=True, preservation=preservation)
    assert _replays(engine)["D"] >= 10


class LitGAN(L.LightningModule):
    """Manual optimization with toggle_optimizer: D called three times per training_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, D), nn.BatchNorm1d(D), nn.Tanh())
        self.D = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU(), nn.Linear(D, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x = batch[0]
        opt_g, opt_d = self.optimizers()
        z = torch.randn(x.shape[0], 4)
        self.toggle_optimizer(opt_d)
        fake = self.G(z).detach()
        loss_d = F.softplus(self.D(fake)).mean() + F.softplus(-self.D(x)).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        loss_g = F.softplus(-self.D(self.G(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.G.parameters(), 1e-2),
            torch.optim.Adam(self.D.parameters(), 1e-2),
        ]


def _gan_loader(n: int = 64):
    ds = torch.utils.data.TensorDataset(
        torch.randn(n, D, generator=torch.Generator().manual_seed(3))
    )
    return torch.utils.data.DataLoader(ds, batch_size=8)


@pytest.mark.parametrize("preservation", ["regions", "auto"])
def test_lightning_manual_optimization_gan_matches_plain_trainer(tmp_path, preservation):
    ref = LitGAN()
    L.seed_everything(7)
    trainer(tmp_path, max_steps=8).fit(ref, _gan_loader())
    model = LitGAN()
    L.seed_everything(7)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = trainer(
            tmp_path,
            strategy=ReplayStrategy(segments=["D", "G"], preservation=preservation),
            max_steps=8,
        )
        t.fit(model, _gan_loader())
    assert differing(state(ref), state(model)) == []
    assert not [
        w for w in seen if "ContractViolation" in str(w.message) or "segment '" in str(w.message)
    ]
    engine = t.strategy.engine
    assert engine.records.read(check="version") == []
    assert _replays(engine)["D"] >= 12, engine.summary()


# ============================================================ class 5: double backward
def _r1(m, step):
    """R1: the critic's loss plus the squared norm of its input gradient (create_graph)."""
    x = _x(step).requires_grad_(True)
    out = m(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (F.softplus(-out).mean() + 5.0 * g.pow(2).sum(1).mean()).backward()


def _gradient_penalty(m, step):
    """WGAN-GP: only the penalty's backward, through the first one's graph."""
    x = _x(step).requires_grad_(True)
    (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    (g.norm(2, dim=1) - 1).pow(2).mean().backward()


def _maml(m, step):
    """Second order: the inner gradients' own graph, differentiated by the outer loss."""
    params = list(m.parameters())
    x = _x(step)
    grads = torch.autograd.grad(m(x).pow(2).mean(), params, create_graph=True)
    adapted = sum((g * g).sum() for g in grads)
    (adapted + m(0.5 * x).pow(2).mean()).backward()


def _retain_twice(m, step):
    loss = m(_x(step)).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
@pytest.mark.parametrize("block", [BNBlock, SNBlock], ids=["batchnorm", "spectral_norm"])
@pytest.mark.parametrize("step_fn", [_r1, _gradient_penalty, _maml, _retain_twice])
def test_double_backward_through_a_stateful_segment_is_exact(step_fn, block, preservation):
    engine = _exact(lambda: Stack(block), BLOCKS, step_fn, preservation=preservation)
    assert all(n >= 10 for n in _replays(engine).values()), _replays(engine)


@pytest.mark.parametrize("step_fn", [_r1, _gradient_penalty])
def test_double_backward_on_checked_steps_and_replayed_probes_is_exact(step_fn):
    """Every step derivative-checked (the check runs at the first backward, the second
    trains on the segment's own graph); and under a budget, where the probe itself replays."""
    torch.manual_seed(0)
    base = Stack(BNBlock)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, step_fn, 5)
    engine = lr.install(model, BLOCKS)

    def checked(m, step):
        engine.request_check()
        step_fn(m, step)

    assert_same_grads(g_ref, _train(model, checked, 5), "checked vs plain")
    grads = engine.records.read(check="grad")
    assert grads and all(r.outcome == "match" for r in grads)
    engine.uninstall()
    _exact(lambda: Stack(SNBlock), BLOCKS, step_fn, steps=8, budget="min")


def test_preserved_state_of_a_kept_graph_is_freed_with_the_graph():
    """A graph kept by retain_graph=True and then dropped without a second backward: what
    the replay kept for another is released when the graph dies, not held for good."""
    torch.manual_seed(0)
    model = Stack(BNBlock)
    engine = lr.install(model, BLOCKS, preservation="whole")
    for step in range(2):
        model(_x(step)).pow(2).mean().backward()
    loss = model(_x(3)).pow(2).mean()
    loss.backward(retain_graph=True)
    assert engine.preserved_bytes > 0  # kept for a second backward
    del loss
    assert engine.preserved_bytes == 0


# ============================================================ class 6: grad inside forward
class Energy(nn.Module):
    """Forces as the negative gradient of a learned energy (create_graph: trained through)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(D) if norm else nn.Identity()
        self.fc1 = nn.Linear(D, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        with torch.enable_grad():
            x = self.norm(x)
            if not x.requires_grad:
                x = x.detach().requires_grad_(True)
            energy = self.fc2(torch.tanh(self.fc1(x))).sum()
            (force,) = torch.autograd.grad(energy, x, create_graph=True)
        return -force


class Hamiltonian(nn.Module):
    """One leapfrog-like step: (q, p) moved along (dH/dp, -dH/dq)."""

    def __init__(self) -> None:
        super().__init__()
        self.H = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        (g,) = torch.autograd.grad(self.H(x).sum(), x, create_graph=True)
        dq, dp = g.chunk(2, dim=1)
        return x + 0.1 * torch.cat([dp, -dq], 1)


class GradFeature(nn.Module):
    """An input gradient without create_graph, used as a feature: the backward inside the
    forward frees its own graph, yet the step's backward replays the segment again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x):
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.tanh(self.bn(self.fc(xx))).pow(2).sum(), xx)
        return torch.tanh(self.bn(self.fc(x))) + g


def _mse(m, step):
    m(_x(step)).pow(2).mean().backward()


@pytest.mark.parametrize("preservation", PRESERVATIONS)
@pytest.mark.parametrize(
    "block",
    [Energy, lambda: Energy(norm=True), Hamiltonian, GradFeature],
    ids=["energy", "energy_batchnorm", "hamiltonian", "grad_feature"],
)
def test_autograd_grad_inside_a_segment_forward_is_exact(block, preservation):
    engine = _exact(lambda: Stack(block), BLOCKS, _mse, preservation=preservation)
    assert all(n >= 5 for n in _replays(engine).values()), _replays(engine)


def test_autograd_grad_inside_a_segment_forward_under_a_budget_is_exact():
    """The probe replays under a budget: the backward inside the forward reads the tensors the
    forward saved (it is not the probe's replay point, nor a reason to recompute)."""
    _exact(lambda: Stack(lambda: Energy(norm=True)), BLOCKS, _mse, steps=10, budget="min")


# ============================================================ class 10: calls inside backward
class _Reversible(torch.autograd.Function):
    """y1 = x1 + F(x2), y2 = x2 + G(y1); the backward re-runs G and F on the outputs."""

    @staticmethod
    def forward(ctx, x, f, g, *params):
        ctx.f, ctx.g = f, g
        with torch.no_grad():
            x1, x2 = x.chunk(2, 1)
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.save_for_backward(y1, y2)
        return torch.cat([y1, y2], 1)

    @staticmethod
    def backward(ctx, grad):
        y1, y2 = ctx.saved_tensors
        gy1, gy2 = grad.chunk(2, 1)
        f, g = ctx.f, ctx.g
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gout = g(y1)
            torch.autograd.backward(gout, gy2, inputs=[y1, *g.parameters()])
            gy1 = gy1 + y1.grad
            x2 = (y2 - gout).detach().requires_grad_()
            torch.autograd.backward(f(x2), gy1, inputs=[x2, *f.parameters()])
        return (torch.cat([gy1, gy2 + x2.grad], 1), None, None) + (None,) * (
            len(ctx.needs_input_grad) - 3
        )


class Half(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(D // 2, D // 2)
        self.norm = nn.BatchNorm1d(D // 2) if norm else nn.Identity()

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class RevBlock(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.f, self.g = Half(norm), Half(norm)

    def forward(self, x):
        return _Reversible.apply(x, self.f, self.g, *self.parameters())


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "batchnorm"])
@pytest.mark.parametrize(
    "segments",
    [["blocks.0.f", "blocks.0.g", "blocks.1.f", "blocks.1.g"], BLOCKS],
    ids=["F_and_G", "whole_blocks"],
)
def test_reversible_blocks_calling_segments_in_backward_are_exact(segments, norm):
    """F and G run under no_grad in the forward and inside the Function's backward: there is
    no checkpoint. They run plain (as in plain PyTorch) and are named as such; whole
    reversible blocks as segments replay. (With batch norm, retaining a reversible block, which
    keeps no activations, holds less than any replay, which keeps the statistics as the forward
    saw them: under ``"min"`` calibration never replays it and the plan retains it, so its
    replays are asked for with ``preservation="whole"``.)"""
    torch.manual_seed(0)
    base = Stack(lambda: RevBlock(norm))
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, _mse, 6)
    pinned = {"preservation": "whole"} if norm and segments == BLOCKS else {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = lr.install(model, segments, budget="min", **pinned)
        g_rep = _train(model, _mse, 6)
    assert_same_grads(g_ref, g_rep, "replay vs plain")
    assert_same_state(snapshot_state(ref), snapshot_state(model), "replay vs plain")
    messages = [str(w.message) for w in seen]
    if segments == BLOCKS:
        assert messages == [] and all(n >= 3 for n in _replays(engine).values())
    else:
        assert all(s["mode"] == "plain" for s in engine.summary().values()), engine.summary()
        for name in segments:
            assert any(f"{name!r}" in m and "inside a backward" in m for m in messages), messages


# ============================================================ class 11: never replayed
class Probed(nn.Module):
    """A backbone of segments under a linear head, and a spare block never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BNBlock(), BNBlock()])
        self.spare = BNBlock()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _linear_probe_warmup(m, step):
    loss = m(_x(step)).pow(2).mean()
    if step < 3:  # the head alone first: the backward does not reach the segments
        loss.backward(inputs=list(m.head.parameters()))
    else:
        loss.backward()


def _eval_blocks(m, step):
    for b in m.blocks:
        b.eval()  # frozen statistics, trained weights
    m(_x(step)).pow(2).mean().backward()


def _frozen_bn(m, step):
    for b in m.blocks:
        b.bn.eval()
    m(_x(step)).pow(2).mean().backward()


@pytest.mark.parametrize("step_fn", [_linear_probe_warmup, _eval_blocks, _frozen_bn])
def test_segments_not_reached_or_in_eval_mode_still_replay(step_fn):
    engine = _exact(Probed, BLOCKS, step_fn, steps=7)
    assert all(s["status"] == "active" for s in engine.summary().values()), engine.summary()
    assert all(n >= 3 for n in _replays(engine).values()), _replays(engine)


def test_a_never_called_segment_is_named_and_the_others_replay():
    torch.manual_seed(0)
    base = Probed()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, _mse, 10)  # past the first plan (step 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = lr.install(model, [*BLOCKS, "spare"], on_violation="record", budget="min")
        g_rep = _train(model, _mse, 10)
    assert_same_grads(g_ref, g_rep, "replay vs plain")
    named = [str(w.message) for w in seen if "'spare'" in str(w.message)]
    assert len(named) == 1 and "never called in the model's forward" in named[0]
    summary = engine.summary()
    assert summary["spare"]["mode"] == "not called"
    assert engine.plan is not None and "spare" not in engine.plan.choices
    assert all(summary[n]["replays"] >= 2 for n in BLOCKS), summary


def test_a_never_called_segment_stops_the_run_under_raise_after_the_first_window():
    model = Probed()
    lr.install(model, [*BLOCKS, "spare"])  # on_violation="raise"
    _mse(model, 0)
    with pytest.raises(lr.ReplayConfigError, match="'spare' was never called"):
        _mse(model, 1)


class LayerDropStack(Stack):
    """Skips its second block on the first steps (LayerDrop, stochastic depth over a list)."""

    def __init__(self) -> None:
        super().__init__(BNBlock, n=3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.pre(x)
        for i, b in enumerate(self.blocks):
            if i == 1 and self.calls <= 3:
                continue
            h = b(h)
        return self.head(h)


def test_a_segment_skipped_while_its_siblings_run_is_not_refused():
    """Not called in the first windows while the other items of its list ran: skipped, not
    missing. No error under raise, no warning; it is probed once called and replays."""
    engine = _exact(LayerDropStack, ["blocks.0", "blocks.1", "blocks.2"], _mse, steps=7)
    assert engine.summary()["blocks.1"]["replays"] >= 2, engine.summary()


class LitProbed(L.LightningModule):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Probed()
        self.twice = twice

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = self.net(x).pow(2).mean()
        if self.twice:  # a second view through the same segments
            loss = loss + self.net(0.5 * x).pow(2).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_lightning_never_called_segment_is_named_others_planned_and_checked(tmp_path):
    ref = LitProbed()
    L.seed_everything(7)
    trainer(tmp_path, max_steps=12).fit(ref, _gan_loader(96))
    model = LitProbed()
    L.seed_everything(7)
    with pytest.warns(RuntimeWarning, match="'net.spare' was never called in the model's forward"):
        t = trainer(
            tmp_path,
            strategy=ReplayStrategy(segments=["net.blocks.0", "net.blocks.1", "net.spare"]),
            callbacks=[ReplayCallback(check_every_n_steps=2)],
            max_steps=12,
        )
        t.fit(model, _gan_loader(96))
    assert differing(state(ref), state(model)) == []
    engine = t.strategy.engine
    assert engine.plan is not None and set(engine.plan.choices) == {"net.blocks.0", "net.blocks.1"}
    assert engine.summary()["net.spare"]["mode"] == "not called"
    grads = engine.records.read(check="grad")
    assert grads and all(r.outcome == "match" for r in grads), grads
    assert {r.segment for r in grads} <= {"net.blocks.0", "net.blocks.1"}


def test_lightning_segment_called_twice_per_training_step_replays(tmp_path):
    ref = LitProbed(twice=True)
    L.seed_everything(7)
    trainer(tmp_path, max_steps=10).fit(ref, _gan_loader(80))
    model = LitProbed(twice=True)
    L.seed_everything(7)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(segments=["net.blocks.0", "net.blocks.1"]),
        callbacks=[ReplayCallback(check_every_n_steps=2)],
        max_steps=10,
    )
    t.fit(model, _gan_loader(80))
    assert differing(state(ref), state(model)) == []
    summary = t.strategy.engine.summary()
    # replayed (calibration), then planned: the tiny blocks may be cheapest retained
    assert all(s["status"] in ("active", "retain") for s in summary.values()), summary
    assert all(s["replays"] >= 6 for s in summary.values()), summary
