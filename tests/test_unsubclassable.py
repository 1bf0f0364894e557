"""Module classes that forbid subclasses of them (a metaclass that raises, as a final class's
does). lightning_replay routes a segment's forward, and the root's window, through a subclass
of the module's class, and traces the attributes a probe reads from the model's other modules
through one.

Before (measured at 0bb9878, found by the adversary of session 17): such a class as a segment
failed the install with the class's own ``TypeError`` (a deep traceback), and as any other
module of the model it failed the first forward the same way.

A class whose ``__init_subclass__`` raises (final by that route) is no obstacle since the
subclasses are made without calling it (``subclassing.quiet_subclass``): it installs and
trains exactly, the last test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.engine.attach import RUNTIME_KEY
from lightning_replay.core.mechanisms.slots import is_holder
from tests.test_exactness import D, SEGS2, Stack, assert_exact


class FinalMeta(type(nn.Module)):
    """A metaclass that refuses subclasses of a class marked final."""

    def __new__(mcs, name, bases, ns, **kw):
        for b in bases:
            if getattr(b, "__final__", False):
                raise TypeError(f"{name}: {b.__name__} may not be subclassed")
        return super().__new__(mcs, name, bases, ns, **kw)


class Final(nn.Module, metaclass=FinalMeta):
    """A block whose class refuses subclasses; its ``gain`` is read by the forward."""

    __final__ = True

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.gain)


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def test_a_segment_whose_class_refuses_subclasses_is_refused_by_name():
    model = Stack([Blk(), Final()])
    classes = [type(m) for m in model.modules()]
    with pytest.raises(lr.ReplayConfigError, match=r"segment 'blocks.1'.*Final.*subclass"):
        lr.install(model, SEGS2)
    # nothing was swapped or left behind, and the model installs with other segments
    assert [type(m) for m in model.modules()] == classes
    assert all(RUNTIME_KEY not in m.__dict__ for m in model.modules())
    engine = lr.install(model, ["blocks.0"])
    try:
        model(torch.randn(2, D)).sum().backward()
    finally:
        engine.uninstall()
    # (the refused install registered nothing for good: a module of the model is no holder
    # while installed, and a holder again after)
    assert is_holder(model.blocks[1])


class Reads(nn.Module):
    """A segment that reads the gain of the root's final module (outside every segment)."""

    def __init__(self, root_box: list) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.root_box = root_box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.root_box[0].act.gain)


class RootHoldsFinal(Stack):
    """The root registers a final module; the blocks read its gain, which the root anneals
    between the blocks' forward and their replay."""

    def __init__(self) -> None:
        box: list = []
        super().__init__([Reads(box), Reads(box)])
        self.act = Final()
        box.append(self)

    def after(self, h: torch.Tensor) -> None:
        self.act.gain *= 0.9


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_an_outside_module_whose_class_refuses_subclasses_is_put_back(preservation):
    """Its reads cannot be traced: every plain attribute of it counts as read."""
    assert_exact(RootHoldsFinal, SEGS2, preservation, min_replays=4)


class FinalRoot(nn.Module, metaclass=FinalMeta):
    __final__ = True

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Blk(), Blk()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_root_whose_class_refuses_subclasses_says_to_open_windows_by_hand():
    model = FinalRoot()
    with pytest.raises(lr.ReplayConfigError, match=r"model's class FinalRoot.*window='manual'"):
        lr.install(model, SEGS2)
    assert all(RUNTIME_KEY not in m.__dict__ for m in model.modules())
    assert [type(b) for b in model.blocks] == [Blk, Blk]
    engine = lr.install(model, SEGS2, window="manual")
    try:
        for _ in range(4):
            with engine.window():
                model(torch.randn(2, D)).sum().backward()
        assert sum(s["replays"] for s in engine.summary().values()) >= 2
    finally:
        engine.uninstall()


class InitFinal(nn.Module):
    """A block whose ``__init_subclass__`` refuses subclasses (and would count them)."""

    made = 0

    def __init_subclass__(cls, **kwargs):
        InitFinal.made += 1
        raise TypeError(f"{cls.__name__}: InitFinal may not be subclassed")

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.gain)


class AnnealsInitFinal(Stack):
    def __init__(self) -> None:
        super().__init__([InitFinal(), InitFinal()])

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            b.gain *= 0.9


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_a_class_whose_init_subclass_refuses_installs_and_is_exact(preservation):
    """(Refused by name from 4f59a0c, a deep TypeError before: now the subclass is made without
    calling ``__init_subclass__``, which never runs.)"""
    assert_exact(AnnealsInitFinal, SEGS2, preservation, min_replays=4)
    assert InitFinal.made == 0
