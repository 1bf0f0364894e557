"""Modules a segment reads that are not its submodules: held in a plain attribute, a container
attribute or a config-like holder (transformers 5 keeps its attention kernels as modules in a
dict attribute, ``_kernel_funcs``), with parameters or without. The replay must see them as
the forward saw them: their attributes, and the bytes of the buffers the forward writes.

Before (measured at 921ef1d): an attribute of such a module changed between the forward and the
replay gave wrong gradients from the first planned step, silently. A module held that way was
neither a holder (modules are not) nor one of the segment's modules, so nothing of it was
captured, and the outside-read trace covers the model's own modules only.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import lightning_replay as lr
from tests.test_exactness import D, SEGS2, Stack, assert_exact


class Gain(nn.Module):
    """An activation with a gain attribute (a module without parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.gain)


class Scaled(nn.Module):
    """An activation with a parameter and a gain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.gain = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.scale * self.gain)


class Wrapped(nn.Module):
    """A gain activation one level down: a registered submodule of an unregistered module."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Gain()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner(h)

    @property
    def gain(self) -> float:
        return self.inner.gain

    @gain.setter
    def gain(self, v: float) -> None:
        self.inner.gain = v


KINDS = {"no parameters": Gain, "parameters": Scaled, "nested": Wrapped}


class Holds(nn.Module):
    """Holds its activation, not as a submodule, by one of four ways (``where``)."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.where = where
        act = KINDS[kind]()
        if where == "attribute":
            object.__setattr__(self, "act", act)  # past nn.Module.__setattr__: unregistered
        elif where == "dict":
            self.__dict__["acts"] = {"act": act}
        elif where == "list":
            self.__dict__["acts"] = [act]
        else:  # a config-like holder
            self.__dict__["cfg"] = types.SimpleNamespace(act=act, eps=1e-5)

    def the_act(self) -> nn.Module:
        d = self.__dict__
        if self.where == "attribute":
            return d["act"]
        if self.where == "dict":
            return d["acts"]["act"]
        return d["acts"][0] if self.where == "list" else d["cfg"].act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.the_act()(self.lin(x))


class Anneals(Stack):
    """Anneals each block's activation gain between its forward and its replay (``window``),
    or before the blocks run at every other step (``steps``)."""

    def __init__(self, where: str, kind: str, when: str) -> None:
        super().__init__([Holds(where, kind), Holds(where, kind)])
        self.when = when
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.when == "steps" and self.calls % 2 == 0:
            for b in self.blocks:
                b.the_act().gain *= 0.9
        return super().forward(x)

    def after(self, h: torch.Tensor) -> None:
        if self.when == "window":
            for b in self.blocks:
                b.the_act().gain *= 0.9


@pytest.mark.parametrize("when", ["window", "steps"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", ["attribute", "dict", "list", "holder"])
@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_an_unregistered_module_annealed_is_put_back(preservation, where, kind, when):
    assert_exact(lambda: Anneals(where, kind, when), SEGS2, preservation, min_replays=4)


class RunningMean(nn.Module):
    """Normalizes by a running mean buffer it updates in place at every forward (a statistic
    kept outside the model's registered modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h - self.mean
        with torch.no_grad():
            self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return out


class HoldsStats(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.where = where
        stats = RunningMean()
        if where == "attribute":
            object.__setattr__(self, "stats", stats)
        else:
            self.__dict__["stats_list"] = [stats]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.__dict__["stats"] if self.where == "attribute" else self.stats_list[0]
        return x + torch.tanh(stats(self.lin(x)))


@pytest.mark.parametrize("where", ["attribute", "list"])
@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_an_unregistered_modules_buffer_written_by_the_forward_is_replayed_as_it_was(
    preservation, where
):
    """The replay must normalize by the mean the forward read, not by the one it wrote."""
    assert_exact(
        lambda: Stack([HoldsStats(where), HoldsStats(where)]), SEGS2, preservation, min_replays=4
    )


class ReplacedAfterInstall(Stack):
    """Each block's activation is a new module from the third forward on (after the engine
    was installed), annealed between the forward and the replay."""

    def __init__(self) -> None:
        super().__init__([Holds("dict", "no parameters"), Holds("dict", "no parameters")])
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            for b in self.blocks:
                b.acts["act"] = Gain()
        return super().forward(x)

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            b.the_act().gain *= 0.9


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_a_module_put_in_a_container_after_install_is_put_back(preservation):
    assert_exact(ReplacedAfterInstall, SEGS2, preservation, min_replays=4)


class SharedWithRoot(Stack):
    """Both blocks read an activation registered on the root (outside every segment) through
    a dict attribute; the root anneals it between the forward and the replay."""

    def __init__(self) -> None:
        super().__init__([Holds("dict", "no parameters"), Holds("dict", "no parameters")])
        self.act = Gain()
        for b in self.blocks:
            b.acts["act"] = self.act

    def after(self, h: torch.Tensor) -> None:
        self.act.gain *= 0.9


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_a_registered_module_read_through_a_container_is_put_back(preservation):
    assert_exact(SharedWithRoot, SEGS2, preservation, min_replays=4)


def test_uninstall_leaves_an_unregistered_module_as_it_was():
    """Install and uninstall leave the held modules' classes and attributes untouched."""
    model = Anneals("dict", "parameters", "window")
    acts = [b.the_act() for b in model.blocks]
    before = [(type(a), dict(a.__dict__)) for a in acts]
    engine = lr.install(model, SEGS2)
    for _ in range(4):
        model(torch.randn(2, D)).sum().backward()
    engine.uninstall()
    after = [(type(a), {k: v for k, v in a.__dict__.items() if k != "gain"}) for a in acts]
    assert [t for t, _ in after] == [t for t, _ in before]
    assert [sorted(d) for _, d in after] == [sorted(k for k in d if k != "gain") for _, d in before]


class LateStats(RunningMean):
    """Updates its running mean only once ``tracking`` is switched on (after the probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracking = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h - self.mean
        if self.tracking:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return out


class SwitchesLate(Stack):
    """Each block's unregistered statistic starts writing its buffer at the fifth forward."""

    def __init__(self) -> None:
        super().__init__([HoldsStats("list"), HoldsStats("list")])
        for b in self.blocks:
            b.stats_list[0] = LateStats()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 5:
            for b in self.blocks:
                b.stats_list[0].tracking = True
        return super().forward(x)


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_an_unregistered_module_that_starts_writing_its_buffer_late_is_replayed_exactly(
    preservation,
):
    """State first written after the probe, behind a flag of a module no model registers."""
    assert_exact(SwitchesLate, SEGS2, preservation, min_replays=4)
