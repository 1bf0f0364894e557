"""Which module-level values a segment's contract names (lightning_replay/module_globals.py)."""

from __future__ import annotations

import enum
import types

import pytest
import torch
from torch import nn

from lightning_replay.module_globals import describe, globals_read

SCHEDULE = {"lam": 1.0}
TEMP = 0.5
BIG = list(range(1000))  # copied every call if named: left out
TENSORS = {"w": torch.zeros(2)}  # a small dict of a tensor: named (rebound between a forward
# and its replay it gave wrong gradients, silently, while it was left out; test_adversary_loose_guard)
settings = types.ModuleType("user_settings")
settings.gain = 2.0
settings.table = torch.ones(1)  # a tensor: named (which one the attribute holds)


class _Cfg:
    pass


CFG = _Cfg()
CFG.flag = True


def helper(x):
    return x * TEMP


def _reader(d):
    return lambda k: d[k]


hidden = _reader({"k": 1.0})


class Reads(nn.Module):
    def forward(self, x):
        y = helper(x) * SCHEDULE["lam"] + len(BIG) + TENSORS["w"].sum()
        y = y * settings.gain + settings.table * CFG.flag
        return torch.relu(y) * hidden("k")  # relu: torch's own code, nothing of its own


def _names(modules):
    return sorted(describe(o, n).rsplit(".", 1)[-1] for o, n in globals_read(modules))


def test_names_what_the_code_reads_and_leaves_out_what_cannot_change_unseen_or_is_costly():
    # (``d``: the closure cell of ``hidden``, a module-level function the forward calls)
    with pytest.warns(UserWarning, match=r"test_module_globals\.BIG \(1000 items\)"):
        names = _names([Reads(), nn.ReLU(), nn.Linear(2, 2)])
    assert names == ["SCHEDULE", "TEMP", "TENSORS", "d", "flag", "gain", "table"]


def test_owners_are_the_dicts_the_code_reads_from():
    pairs = {n: o for o, n in globals_read([Reads()])}
    assert vars(pairs["SCHEDULE"])["SCHEDULE"] is SCHEDULE
    assert pairs["gain"] is settings and pairs["flag"] is CFG
    assert describe(settings, "gain") == "user_settings.gain"


def test_library_modules_name_nothing():
    assert globals_read([nn.TransformerEncoderLayer(8, 2, 16), nn.BatchNorm1d(4)]) == []


class WithClassTemp(nn.Module):
    TEMP = 2.0  # a class attribute a loop may anneal
    SHADOWED = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.SHADOWED = 3.0  # the instance's own: a slot, not the class's
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x) * self.TEMP * self.SHADOWED * WithClassTemp.TEMP


def test_class_attributes_read_through_self_or_the_class_are_named_and_put_back():
    m = WithClassTemp()
    [(owner, name)] = globals_read([m])
    assert name == "TEMP" and describe(owner, name) == "WithClassTemp.TEMP"
    d = vars(owner)  # what capture_outside swaps: setting it sets the class attribute
    d["TEMP"] = 0.5
    assert WithClassTemp.TEMP == 0.5 and m.TEMP == 0.5
    d["TEMP"] = 2.0
    assert globals_read([nn.Dropout(0.1)]) == []  # torch's class attributes: library code


class _Mode(enum.Enum):
    NONE = 0
    ON = 1


class ReadsEnum(nn.Module):
    def forward(self, x):
        return x * (_Mode.ON.value + (self.kind is _Mode.NONE))

    kind = _Mode.NONE


def test_enum_members_are_not_class_attributes_to_put_back():
    """An Enum's members cannot be reassigned (and never change): not in any contract. A class
    attribute that holds one (a mode a loop may switch) is."""
    assert [describe(*p) for p in globals_read([ReadsEnum()])] == ["ReadsEnum.kind"]


class _GainBase(nn.Module):
    gain = 1.0


class _ByMro(_GainBase):
    def forward(self, x):
        return x * self.__class__.__mro__[1].gain


class _ByBases(_GainBase):
    def forward(self, x):
        return x * type(self).__bases__[0].gain


@pytest.mark.parametrize("cls", [_ByMro, _ByBases], ids=["__mro__", "__bases__"])
def test_a_class_of_the_hierarchy_read_by_index_is_named(cls):
    """``type(self).__bases__[0].gain``, ``self.__class__.__mro__[1].gain``: which class the
    index reaches is known at run time only, so each class of the hierarchy that defines the
    attribute is named (they were skipped as dunder chains: a base's ``gain`` annealed between
    a forward and its replay gave wrong gradients, silently)."""
    named = {describe(o, n) for o, n in globals_read([cls()])}
    assert "_GainBase.gain" in named
