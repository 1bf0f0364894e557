"""Under a memory budget the probe step keeps no activations (replayed probes), and stays exact.

A probe that kept every segment's activations would peak above a plain step: the user who set a
budget because plain training does not fit would run out of memory on step one. Under a byte
budget each probed forward runs under checkpoint instead; its replay in backward puts back what
the window changed and is compared with the forward's outputs (a ``bytes`` record). The memory
referee here is ``torch.profiler``'s allocation events (tests/helpers/torch_memory.py), which
share no code with the engine.
"""

from __future__ import annotations

import array

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS
from tests.test_engine_hazards import FLAG_FLIPPED
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    clone_model,
    snapshot_state,
    train_steps,
)
from tests.helpers.torch_memory import allocation_peak, live_bytes

STEPS = 4
HUGE = 1 << 40  # a byte budget that every plan meets: only the probe's kind changes


def _bytes_records(engine, outcome=None):
    return [
        r
        for r in engine.records.read(check="probe")
        if json.loads(r.detail).get("what", "").startswith("replayed probe")
        and (outcome is None or r.outcome == outcome)
    ]


@pytest.mark.parametrize("preservation", ["auto", "whole", "regions"])
@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_replayed_probe_is_exact_on_every_hazard(hazard, preservation):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, STEPS)
    model = clone_model(h.model)
    engine = lr.install(model, h.segments, preservation=preservation, budget=HUGE)
    g_rep, _ = train_steps(model, h.make_input, STEPS)
    assert_same_grads(g_ref, g_rep, hazard)
    summary = engine.summary()
    matches = _bytes_records(engine, "match")
    assert not _bytes_records(engine, "divergence")
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
    for name, s in summary.items():
        # the probe step replays too (its forward kept no activations), and so does every
        # later step; each probe's replay was compared with its forward and matched
        assert s["replays"] == STEPS, (name, s)
        assert s["violations"] == 0 and s["divergences"] == 0
    assert {r.segment for r in matches} == set(summary)
    # (and the re-probe of a flag the root flips after the segment: a replayed probe too)
    assert all(r.step == 1 or r.segment in FLAG_FLIPPED.get(hazard, ()) for r in matches)


D = 256


class Wide(nn.Module):
    """A block whose activations are large next to its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.norm = nn.BatchNorm1d(D)  # state written in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class WideStack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Wide() for _ in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()


def test_probe_step_under_a_budget_stays_below_a_plain_step_and_within_the_budget():
    x = torch.randn(512, D, generator=torch.Generator().manual_seed(1))
    base = WideStack()
    plain = copy.deepcopy(base)
    static = live_bytes(list(plain.parameters()) + list(plain.buffers()))
    plain_peak = static + allocation_peak(lambda: _step(plain, x))
    model = copy.deepcopy(base)
    # a budget a plain step does not meet, that recomputing the blocks meets
    budget = static + int(0.7 * (plain_peak - static))
    engine = lr.install(model, "blocks.*", budget=budget)
    probe_peak = static + allocation_peak(lambda: _step(model, x))
    assert all(s["contract_version"] == 1 for s in engine.summary().values())
    assert probe_peak <= budget < plain_peak, (probe_peak, budget, plain_peak)
    # without a budget the probe keeps activations (within 10 % of a plain step)
    other = copy.deepcopy(base)
    lr.install(other, "blocks.*")
    assert static + allocation_peak(lambda: _step(other, x)) <= 1.1 * plain_peak


class Scaled(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        object.__setattr__(self, "_owner", owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + self._owner.shift)


class ShiftedNet(nn.Module):
    """Blocks read a parameter of the root (by addition: autograd saves nothing of it) that
    the step changes in place between the forward and the backward, as an EMA of weights or a
    parameter rescaled in a hook would: parameters are not copied by the probe, their logged
    writes are undone for its replay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shift = nn.Parameter(torch.zeros(16))
        self.blocks = nn.ModuleList(Scaled(self) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out = self.head(x)
        with torch.no_grad():
            self.shift.add_(0.25)
        return out


def test_parameter_written_after_the_forward_is_put_back_for_the_probe_replay():
    make = lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    ref = ShiftedNet()
    g_ref, _ = train_steps(ref, make, STEPS)
    model = ShiftedNet()
    engine = lr.install(model, "blocks.*", budget=HUGE)
    g_rep, _ = train_steps(model, make, STEPS)
    assert_same_grads(g_ref, g_rep)
    assert len(_bytes_records(engine, "match")) == 2
    assert not _bytes_records(engine, "divergence")


class Holder:
    def __init__(self) -> None:
        self.t = torch.full((16,), 0.5)


class ReadsHolder(nn.Module):
    def __init__(self, holder: Holder) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        object.__setattr__(self, "_holder", holder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * self._holder.t)


class RepointedNet(nn.Module):
    """A tensor outside the model's modules, read by the blocks, is pointed at new bytes
    (``.data = ...``: no write, no version bump) after the blocks at every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.holder = Holder()
        self.blocks = nn.ModuleList(ReadsHolder(self.holder) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        self.holder.t.data = self.holder.t.data * 1.5
        return self.head(x)


def test_tensor_repointed_after_the_forward_is_pointed_back_for_the_probe_replay():
    make = lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    ref = RepointedNet()
    g_ref, _ = train_steps(ref, make, 1)
    model = RepointedNet()
    engine = lr.install(model, "blocks.*", budget=HUGE)
    g_rep, _ = train_steps(model, make, 1)
    assert_same_grads(g_ref, g_rep)
    assert len(_bytes_records(engine, "match")) == 2


class _Opaque:
    """A setting store no contract can name: its value sits in a C array, not in a plain
    container or attribute (a dict bound as a default argument is put back since session 29,
    as closure cells are)."""

    def __init__(self, **values: float) -> None:
        self._keys = list(values)
        self._values = array.array("d", values.values())

    def __getitem__(self, key: str) -> float:
        return self._values[self._keys.index(key)]

    def __setitem__(self, key: str, value: float) -> None:
        self._values[self._keys.index(key)] = value


#: a setting read through a closure: no slot, attribute, module-level name or tensor holds it
SETTING = _Opaque(scale=1.0)


def _setting(key: str, _d: _Opaque = SETTING) -> float:
    return (lambda: _d[key])()  # a closure cell and a default: nothing a contract names


class ReadsGlobal(nn.Module):
    """Reads a setting that the step changes after the forward, through a closure: nothing
    of the model holds it, so no probe can put it back; its replay's outputs differ from the
    forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * _setting("scale"))


#: a module-level setting: the forward names it, so its contract does
MODULE_SETTING = {"scale": 1.0}


class ReadsModuleSetting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * MODULE_SETTING["scale"])


@pytest.mark.parametrize("budget", [None, HUGE], ids=["retained_probe", "replayed_probe"])
def test_a_module_level_setting_changed_after_the_forward_is_put_back_for_the_replay(budget):
    """The value the forward read, not the one the step set after it: every replay (the
    probe's and the steady ones) trains what plain PyTorch trains, with no record."""
    torch.manual_seed(0)
    model = nn.Sequential(ReadsModuleSetting(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    engine = lr.install(model, ["0"], budget=budget, on_violation="raise")
    try:
        for m in (ref, model):
            MODULE_SETTING["scale"] = 1.0
            for step in range(4):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
                out = m(x)
                MODULE_SETTING["scale"] *= 0.5  # annealed between forward and backward
                m.zero_grad()
                out.pow(2).mean().backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
    finally:
        MODULE_SETTING["scale"] = 1.0
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    assert engine.summary()["0"]["replays"] >= 3
    assert [r for r in engine.records.read() if r.outcome != "match"] == []
    assert [a.rsplit(".", 2)[-2:] for a in engine.contracts["0"].outside_attrs] == [
        ["test_memory_probe", "MODULE_SETTING"]
    ]


def test_a_probe_replay_that_differs_is_a_recorded_divergence_never_silent():
    SETTING["scale"] = 1.0
    torch.manual_seed(0)
    model = nn.Sequential(ReadsGlobal(), nn.Linear(16, 1))
    engine = lr.install(model, ["0"], budget=HUGE, on_violation="record")
    x = torch.randn(8, 16)
    out = model(x)
    SETTING["scale"] = 2.0
    try:
        with pytest.warns(RuntimeWarning, match="did not reproduce the forward's outputs"):
            out.pow(2).mean().backward()
    finally:
        SETTING["scale"] = 1.0
    (div,) = _bytes_records(engine, "divergence")
    assert div.segment == "0" and json.loads(div.detail)["action"] == "next probe retained"
    # the next probe keeps its activations: retained probes are exact by construction
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).pow(2).mean().backward()
    assert engine.summary()["0"]["divergences"] == 1


def test_divergence_raises_under_on_violation_raise():
    SETTING["scale"] = 1.0
    torch.manual_seed(0)
    model = nn.Sequential(ReadsGlobal(), nn.Linear(16, 1))
    engine = lr.install(model, ["0"], budget=HUGE, on_violation="raise")
    out = model(torch.randn(8, 16))
    SETTING["scale"] = 3.0
    try:
        with pytest.raises(lr.ReplayError, match="segment '0'"):
            out.pow(2).mean().backward()
    finally:
        SETTING["scale"] = 1.0
    assert len(_bytes_records(engine, "divergence")) == 1


def test_a_replayed_probe_measures_the_activation_bytes_a_retained_probe_does():
    """The plan charges each segment its activation bytes: a replayed probe measures them from
    its replay (its forward's saved tensors are freed at once and their addresses reused, as
    in torchvision's residual blocks), and finds what a retained probe finds."""
    from torchvision.models.resnet import BasicBlock

    x = torch.randn(4, 16, 16, 16, generator=torch.Generator().manual_seed(2))
    found = []
    for budget in (None, HUGE, "min"):
        torch.manual_seed(0)
        model = nn.Sequential(*(BasicBlock(16, 16) for _ in range(3)))
        engine = lr.install(model, ["0", "1", "2"], budget=budget)
        model(x).pow(2).mean().backward()
        found.append({n: s["activation_bytes"] for n, s in engine.summary().items()})
    assert found[0] == found[1] == found[2] and all(v > 0 for v in found[0].values()), found
