"""Adversarial models for the slot checks by dict version tags (commit 6ea65e8).

Each model changes what a segment's forward or replay sees by a path meant to move no version
tag the engine reads (or to make the tag path disagree with the identity path), between a
segment's forward and its replay (``after(h)``) or between steps (a schedule). Every case
trains under ``lr.install`` and in plain PyTorch and asserts bit-identical gradients and state
(``assert_exact``), with the version tags in use and with them off (``tokens``).

Cases marked ``xfail`` (strict) fail with the tags off as well: limitations of the slot
capture that predate the tags (what the capture never looks at), kept here as documentation
until they are fixed. Four that this file found are fixed: a float rebound each step at the
freed one's address (the guard now keeps the plain objects its signature names alive), a
generator in a holder's list (``slot_generators`` looks inside a holder's containers), an
OrderedDict attribute (container subclasses are put back by their items), and a holder held
by a holder (captured to four levels).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types

import pytest
import torch
from torch import nn

from tests.test_exactness import D, SEGS2, Stack, assert_exact
from tests.test_slot_tokens import BankWriter


def _guard_records(records):
    return [r for r in records if r.check == "guard"]


# ------------------------------------------------------------------ one block, many readers
class Block(nn.Module):
    """Reads a float attribute, a buffer and ``self.cfg.sharpness`` (``cfg`` any object with
    that attribute, or a mapping when ``keyed``)."""

    def __init__(self, cfg=None, keyed: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = 1.0
        self.register_buffer("mem", torch.randn(4, D))
        self.cfg = cfg if cfg is not None else types.SimpleNamespace(sharpness=1.0)
        self.keyed = keyed

    def sharp(self):
        return self.cfg["sharpness"] if self.keyed else self.cfg.sharpness

    def forward(self, x):
        h = self.lin(x) * self.scale * self.sharp()
        return x + torch.tanh(h) + torch.softmax(h @ self.mem.T, -1) @ self.mem


class After(Stack):
    """``write(block)`` between each block's forward and its replay."""

    def __init__(self, blocks, write) -> None:
        super().__init__(blocks)
        self.write = write

    def after(self, h):
        for b in self.blocks:
            self.write(b)


def _new_dict_wholesale(b):
    d = dict(b.__dict__)
    d["scale"] = b.scale * 0.5 + 0.3
    b.__dict__ = d  # a new dict object: the old one's tag never moves


def _buffers_dict_replaced(b):
    b.__dict__["_buffers"] = {"mem": torch.roll(b.mem, 1, 0) * 0.5}


def _parameters_dict_replaced(b):
    lin = b.lin
    new = collections.OrderedDict(lin._parameters)
    new["weight"] = nn.Parameter(lin.weight.detach() * 0.5)
    object.__setattr__(lin, "_parameters", new)


def _dict_init(b):
    dict.__init__(b.__dict__, scale=b.scale * 0.7 + 0.1)


def _dict_ior(b):
    d = b.__dict__
    d |= {"scale": b.scale * 0.7 + 0.1}


_EXEC = compile("scale = scale * 0.7 + 0.1", "<adversary>", "exec")


def _exec_store_name(b):
    exec(_EXEC, {}, b.__dict__)  # STORE_NAME into the instance dict as locals


def _copy_copy_dict(b):
    d = copy.copy(b.__dict__)
    d["scale"] = b.scale * 0.7 + 0.1
    b.__dict__ = d


def _del_and_readd(b):
    d = b.__dict__
    s = d.pop("scale")
    d["other"] = 1
    d["scale"] = s * 0.7 + 0.1
    del d["other"]


def _hot_store(b):
    for i in range(100):  # the specialized STORE_ATTR of an nn.Module
        object.__setattr__(b, "scale", 0.5 + 0.001 * i)


def _buffer_via_register(b):
    b.register_buffer("mem", torch.roll(b.mem, 1, 0) * 0.5)


def _param_via_setattr(b):
    b.lin.weight = nn.Parameter(b.lin.weight.detach() * 0.5)


WRITES = {
    "__dict__ replaced wholesale": _new_dict_wholesale,
    "_buffers dict replaced": _buffers_dict_replaced,
    "_parameters replaced by an OrderedDict": _parameters_dict_replaced,
    "dict.__init__ on __dict__": _dict_init,
    "__dict__ |= ...": _dict_ior,
    "exec STORE_NAME into __dict__": _exec_store_name,
    "copy.copy(__dict__) assigned": _copy_copy_dict,
    "del and re-add with another object": _del_and_readd,
    "object.__setattr__ in a hot loop": _hot_store,
    "register_buffer over the buffer": _buffer_via_register,
    "parameter rebound by setattr": _param_via_setattr,
}


@pytest.mark.parametrize("write", list(WRITES))
def test_module_slot_rebound_between_forward_and_replay(tokens, write):
    fn = WRITES[write]
    assert_exact(lambda: After([Block(), Block()], fn), SEGS2, "auto")


# ------------------------------------------------------------------ holders of every kind
@dataclasses.dataclass
class DataCfg:
    sharpness: float = 1.0
    other: int = 3


class PlainCfg:
    def __init__(self) -> None:
        self.sharpness = 1.0
        for i in range(40):  # many attributes: a wide instance dict
            setattr(self, f"a{i}", i)


class SlottedCfg:
    __slots__ = ("sharpness",)

    def __init__(self) -> None:
        self.sharpness = 1.0


class Inner:
    def __init__(self) -> None:
        self.sharpness = 1.0


class NestedCfg:  # ``cfg.inner.sharpness``: one level below the holder
    def __init__(self) -> None:
        self.inner = Inner()

    @property
    def sharpness(self):
        return self.inner.sharpness


def _hot_holder_store(cfg, value):
    for i in range(100):
        cfg.sharpness = value + 0.001 * i


HOLDERS = {
    # name: (make the shared cfg, write between forward and replay, fails with tags off too)
    "SimpleNamespace, setattr": (lambda: types.SimpleNamespace(sharpness=1.0), None, False),
    "dataclass, hot store": (DataCfg, "hot", False),
    "wide plain object, __dict__ replaced": (PlainCfg, "wholesale", False),
    "wide plain object, vars().update": (PlainCfg, "vars", False),
    "__slots__ object": (SlottedCfg, None, True),
    "nested holder (cfg.inner.sharpness)": (NestedCfg, "nested", False),
}


def _write_holder(kind, cfg):
    if kind is None:
        cfg.sharpness = cfg.sharpness * 0.9 + 0.05
    elif kind == "hot":
        _hot_holder_store(cfg, cfg.sharpness * 0.9)
    elif kind == "wholesale":
        d = dict(cfg.__dict__)
        d["sharpness"] = cfg.sharpness * 0.9 + 0.05
        cfg.__dict__ = d
    elif kind == "vars":
        vars(cfg).update(sharpness=cfg.sharpness * 0.9 + 0.05)
    elif kind == "nested":
        cfg.inner.sharpness = cfg.inner.sharpness * 0.9 + 0.05


def _holder_params():
    out = []
    for name, (_, _, pre) in HOLDERS.items():
        marks = (
            [pytest.mark.xfail(strict=True, reason="pre-existing: capture never sees it")]
            if pre
            else []
        )
        out.append(pytest.param(name, marks=marks, id=name))
    return out


class HolderAfter(Stack):
    def __init__(self, name) -> None:
        make, self.kind, _ = HOLDERS[name]
        cfg = make()
        super().__init__([Block(cfg), Block(cfg)])  # one holder shared by both blocks
        self.cfg = cfg

    def after(self, h):
        _write_holder(self.kind, self.cfg)


@pytest.mark.parametrize("name", _holder_params())
def test_holder_written_between_forward_and_replay(tokens, name):
    assert_exact(lambda: HolderAfter(name), SEGS2, "auto")


class MappingAfter(Stack):
    """``cfg`` a mapping that is not a plain dict (an OrderedDict: ``is_holder`` takes it for
    a holder object and captures its empty ``__dict__``, never its items)."""

    def __init__(self) -> None:
        cfg = collections.OrderedDict(sharpness=1.0)
        super().__init__([Block(cfg, keyed=True), Block(cfg, keyed=True)])
        self.cfg = cfg

    def after(self, h):
        self.cfg["sharpness"] = self.cfg["sharpness"] * 0.9 + 0.05


def test_ordereddict_attribute_written_between_forward_and_replay(tokens):
    assert_exact(MappingAfter, SEGS2, "auto")


# ------------------------------------------------------------------ order, class, hooks
class Ordered(nn.Module):
    """Reads its buffers in registration order: the order of ``_buffers`` steers the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("a", torch.randn(D))
        self.register_buffer("b", torch.randn(D) * 3)
        self._buffers = collections.OrderedDict(self._buffers)

    def forward(self, x):
        bs = list(self.buffers(recurse=False))
        return x + torch.tanh(self.lin(x) * bs[0] + bs[1])


class Reorder(Stack):
    def after(self, h):
        for b in self.blocks:
            b._buffers.move_to_end(next(iter(b._buffers)))  # no dict write: no tag moves


@pytest.mark.xfail(strict=True, reason="pre-existing: the order of a slot dict is not put back")
def test_buffer_order_changed_between_forward_and_replay(tokens):
    assert_exact(lambda: Reorder([Ordered(), Ordered()]), SEGS2, "auto")


class ClassScaled(nn.Module):
    gain = 1.0  # read through the class: no instance slot holds it

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x) * self.gain)


class ClassWriter(Stack):
    def after(self, h):
        ClassScaled.gain = ClassScaled.gain * 0.9 + 0.05


def test_class_attribute_written_between_forward_and_replay(tokens):
    def reset(model, step):  # both runs start from the same class attribute
        if step == 0:
            ClassScaled.gain = 1.0

    try:
        assert_exact(
            lambda: ClassWriter([ClassScaled(), ClassScaled()]), SEGS2, "auto", schedule=reset
        )
    finally:
        ClassScaled.gain = 1.0


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.lin.register_forward_hook(lambda m, i, o: o * 1.0)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class HookSwapper(Stack):
    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.calls = 0

    def after(self, h):
        self.calls += 1
        f = 1.0 / (1 + self.calls)
        for b in self.blocks:
            hooks = b.lin._forward_hooks  # same key, same count: another function
            k = next(iter(hooks))
            hooks[k] = lambda m, i, o: o * f


@pytest.mark.xfail(strict=True, reason="pre-existing: a hook swapped under its key")
def test_hook_function_swapped_between_forward_and_replay(tokens):
    assert_exact(lambda: HookSwapper([Hooked(), Hooked()]), SEGS2, "auto")


# ------------------------------------------------------------------ generators
class Drawing(nn.Module):
    """Draws a mask from a generator found at ``where``: a tuple attribute, a dict attribute,
    a holder's attribute, a list on a holder."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        g = torch.Generator().manual_seed(7)
        self.where = where
        if where == "tuple":
            self.gens = (g,)
        elif where == "dict":
            self.gens = {"g": g}
        elif where == "holder":
            self.cfg = types.SimpleNamespace(gen=g)
        elif where == "holder list":
            self.cfg = types.SimpleNamespace(gens=[g])

    def gen(self):
        w = self.where
        if w == "tuple":
            return self.gens[0]
        if w == "dict":
            return self.gens["g"]
        if w == "holder":
            return self.cfg.gen
        return self.cfg.gens[0]

    def forward(self, x):
        mask = (torch.rand(x.shape, generator=self.gen()) > 0.3).float()
        return x + torch.tanh(self.lin(x)) * mask


def _new_generators(model, step):
    if step == 3:  # another generator object, by a path that bypasses __setattr__
        for b in model.blocks:
            g = torch.Generator().manual_seed(100 + step)
            w = b.where
            if w == "tuple":
                b.__dict__["gens"] = (g,)
            elif w == "dict":
                b.gens["g"] = g
            elif w == "holder":
                b.cfg.__dict__["gen"] = g
            else:
                b.cfg.gens[0] = g


@pytest.mark.parametrize(
    "where",
    [
        "tuple",
        "dict",
        "holder",
        "holder list",
    ],
)
def test_generators_drawn_and_rebound_between_steps(tokens, where):
    assert_exact(
        lambda: Stack([Drawing(where), Drawing(where)]), SEGS2, "auto", schedule=_new_generators
    )


# ------------------------------------------------------------------ guard: flips between steps
class Banked(nn.Module):
    """Reads its bank (written in place after the segment) once ``gain`` exceeds 0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 0.0
        self.register_buffer("bank", torch.randn(4, D))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.gain > 0.5:
            bank = self.bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


def _flip_by_dict_init(model, step):
    if step == 3:
        for b in model.blocks:
            dict.__init__(b.__dict__, gain=1.0)


def _flip_by_new_dict(model, step):
    if step == 3:
        for b in model.blocks:
            b.__dict__ = {**b.__dict__, "gain": 1.0}


def _flip_by_exec(model, step):
    if step == 3:
        for b in model.blocks:
            exec("gain = 1.0", {}, b.__dict__)


def _flip_by_register_after_probe(model, step):
    if step == 3:
        for b in model.blocks:
            b.__dict__.pop("gain")
            b.register_buffer("gain", torch.tensor(1.0))


def _flip_at_a_reused_address(model, step):
    # each step a new float object; the old one is freed first, so the new one takes its
    # address (the float free list): at the flip, the slot holds another value at the id the
    # guard last settled on
    for b in model.blocks:
        b.gain = None
        b.gain = float(step >= 3)


FLIPS = {
    "float rebound at a reused address": _flip_at_a_reused_address,
    "dict.__init__": _flip_by_dict_init,
    "__dict__ replaced": _flip_by_new_dict,
    "exec STORE_NAME": _flip_by_exec,
    "attribute becomes a registered buffer": _flip_by_register_after_probe,
}


def _flip_params():
    out = []
    for name in FLIPS:
        out.append(pytest.param(name, id=name))
    return out


@pytest.mark.parametrize("flip", _flip_params())
def test_flip_between_steps_is_guarded(tokens, flip):
    _, records = assert_exact(
        lambda: BankWriter([Banked(), Banked()]), SEGS2, "auto", schedule=FLIPS[flip]
    )
    assert {r.step for r in _guard_records(records)} == {4}, _guard_records(records)


# ------------------------------------------------------------------ written and put back
class PutBackMany(Stack):
    """Every step: each block's slots rebound by many paths and put back to the same objects,
    including a key deleted and re-added (its position in the dict moves)."""

    def after(self, h):
        for b in self.blocks:
            d = b.__dict__
            scale, mem, cfg = d["scale"], b.mem, d["cfg"]
            d["scale"] = scale + 1
            del d["scale"]
            d["scale"] = scale  # same object, another position
            b._buffers["mem"] = mem + 1
            b._buffers["mem"] = mem
            sharp = cfg.sharpness
            cfg.sharpness = sharp + 1
            del cfg.sharpness
            cfg.sharpness = sharp
            vars(b).update(scale=scale)


def test_put_back_every_step_never_reprobes(tokens):
    cfg = types.SimpleNamespace(sharpness=1.0)
    _, records = assert_exact(lambda: PutBackMany([Block(cfg), Block(cfg)]), SEGS2, "auto")
    assert not _guard_records(records), _guard_records(records)


def _put_back_between_steps(model, step):
    for b in model.blocks:
        d = b.__dict__
        s = d.pop("scale")
        d["scale"] = s
        p = b.lin._parameters
        w = p.pop("weight")
        p["weight"] = w  # parameter order changed, same objects


def test_put_back_between_steps_never_reprobes(tokens):
    _, records = assert_exact(
        lambda: Stack([Block(), Block()]), SEGS2, "auto", schedule=_put_back_between_steps
    )
    assert not _guard_records(records), _guard_records(records)


# ------------------------------------------------------------------ functional_call
class Functional(Stack):
    """The root calls each block through ``torch.func.functional_call`` with scaled weights
    (parameters substituted for the call, then put back)."""

    def forward(self, x):
        for b in self.blocks:
            params = {k: v * 1.0 for k, v in b.named_parameters()}
            x = torch.func.functional_call(b, params, (x,))
        return self.head(x)


def test_functional_call_substitutes_parameters(tokens):
    assert_exact(lambda: Functional([Block(), Block()]), SEGS2, "auto")


class InPlaceWhenOn(nn.Module):
    """Writes its input in place once ``gain`` exceeds 0.5: a contract learned without the
    write replays from the live (written) input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 0.0

    def forward(self, x):
        if self.gain > 0.5:
            x.mul_(0.5)
        return x + torch.tanh(self.lin(x))


def test_flip_seen_by_the_guard_writes_input_in_place(tokens):
    def flip(model, step):
        if step == 3:
            for b in model.blocks:
                b.gain = 1.0

    _, records = assert_exact(
        lambda: Stack([InPlaceWhenOn(), InPlaceWhenOn()]), SEGS2, "auto", schedule=flip
    )
    assert {r.step for r in _guard_records(records)} == {4}


def test_flip_at_a_reused_address_writes_input_in_place(tokens):
    assert_exact(
        lambda: Stack([InPlaceWhenOn(), InPlaceWhenOn()]),
        SEGS2,
        "auto",
        schedule=_flip_at_a_reused_address,
    )


# ------------------------------------------------------------------ holders inside containers
class FromRegistry(nn.Module):
    """Reads a config object held in a dict attribute (a registry of configs)."""

    def __init__(self, registry) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.registry = registry

    def forward(self, x):
        return x + torch.tanh(self.lin(x) * self.registry["cfg"].temp)


class RegistryAnnealer(Stack):
    def __init__(self, kind) -> None:
        registry = kind(cfg=types.SimpleNamespace(temp=1.0))
        super().__init__([FromRegistry(registry), FromRegistry(registry)])
        self.registry = registry

    def after(self, h):
        self.registry["cfg"].temp *= 0.8


@pytest.mark.xfail(
    strict=True,
    reason="pre-existing: a holder inside a container attribute is not captured (the container "
    "keeps the same holder object, whose attributes the replay does not put back)",
)
@pytest.mark.parametrize("kind", [dict, collections.OrderedDict], ids=["dict", "OrderedDict"])
def test_holder_in_a_dict_attribute_annealed_between_forward_and_replay(tokens, kind):
    assert_exact(lambda: RegistryAnnealer(kind), SEGS2, "auto")
