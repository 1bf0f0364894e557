"""Adversarial models for the slot checks by dict version tags (commit 6ea65e8).

Each model changes what a segment's forward or replay sees by a path meant to move no version
tag the engine reads (or to make the tag path disagree with the identity path), between a
segment's forward and its replay (``after(h)``) or between steps (a schedule). Every case
trains under ``lr.install`` and in plain PyTorch and asserts bit-identical gradients and state
(``assert_exact``), with the version tags in use and with them off (``tokens``).

What this file found is fixed: a float rebound each step at the freed one's address (the guard
keeps the plain objects its signature names alive), a generator in a holder's list
(``slot_generators`` looks inside a holder's containers), an OrderedDict attribute (container
subclasses are put back by their items), a holder held by a holder (captured to four levels);
and four limits of the slot capture that predated the tags (they failed with the tags off as
well): a holder with ``__slots__`` (its slots are captured and put back like a ``__dict__``),
a slot dict reordered by ``move_to_end`` (no tag moves: the order of an OrderedDict slot dict is
compared apart and put back), a hook function swapped under its key (which function each hook
dict holds is part of the token, and the hooks are put back) and a holder inside a container
attribute (holders among container items are captured). The last sections have the next case
of each, the same kinds of change between steps, where the guard must see them (a flag that
gates a read of state outside the segment), and holders read from outside the segment. A
flag on a module outside the segment, flipped between steps, was a strict ``xfail`` until the
guard watched what the segment reads from outside (tests/test_outside_guard.py has the class),
and a flag flipped inside the probe step's window after the segment ran, until the probe traced
which flags the forward reads.
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
    # name: (make the shared cfg, write between forward and replay)
    "SimpleNamespace, setattr": (lambda: types.SimpleNamespace(sharpness=1.0), None),
    "dataclass, hot store": (DataCfg, "hot"),
    "wide plain object, __dict__ replaced": (PlainCfg, "wholesale"),
    "wide plain object, vars().update": (PlainCfg, "vars"),
    "__slots__ object": (SlottedCfg, None),
    "nested holder (cfg.inner.sharpness)": (NestedCfg, "nested"),
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


class HolderAfter(Stack):
    def __init__(self, name) -> None:
        make, self.kind = HOLDERS[name]
        cfg = make()
        super().__init__([Block(cfg), Block(cfg)])  # one holder shared by both blocks
        self.cfg = cfg

    def after(self, h):
        _write_holder(self.kind, self.cfg)


@pytest.mark.parametrize("name", list(HOLDERS))
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


@pytest.mark.parametrize("kind", [dict, collections.OrderedDict], ids=["dict", "OrderedDict"])
def test_holder_in_a_dict_attribute_annealed_between_forward_and_replay(tokens, kind):
    assert_exact(lambda: RegistryAnnealer(kind), SEGS2, "auto")


# ------------------------------------------------------------------ the next case of each
class SlottedPair:
    """A holder with ``__slots__`` and a ``__dict__`` both."""

    __slots__ = ("sharpness", "__dict__")

    def __init__(self) -> None:
        self.sharpness = 1.0
        self.shift = 0.0  # (in the __dict__)


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlotted:
    sharpness: float = 1.0


class ReadsAt(nn.Module):
    """Reads ``sharpness`` (and ``shift`` or ``bias`` if set) from the holder ``get(self)``."""

    def __init__(self, make, get) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.cfgs = make()
        self.get = get

    def forward(self, x):
        cfg = self.get(self)
        w = cfg.sharpness + getattr(cfg, "shift", 0.0) + getattr(cfg, "bias", 0.0)
        return x + torch.tanh(self.lin(x) * w)


def _anneal(cfg):
    cfg.sharpness = cfg.sharpness * 0.9 + 0.05


def _anneal_pair(cfg):
    _anneal(cfg)
    cfg.shift += 0.1


def _frozen_rebound(cfg):
    object.__setattr__(cfg, "sharpness", cfg.sharpness * 0.9 + 0.05)


def _slot_deleted(cfg):
    if hasattr(cfg, "bias"):
        del cfg.bias  # forward read it set; the replay must too
    else:
        cfg.bias = 0.25


class SlottedBias:
    __slots__ = ("sharpness", "bias")

    def __init__(self) -> None:
        self.sharpness = 1.0


def _new_registry_item(reg):
    reg["cfg"] = types.SimpleNamespace(sharpness=reg["cfg"].sharpness * 0.9 + 0.05)


#: name: (make the block's ``cfgs``, get the holder it reads, change made between forward
#: and replay, given the block's ``cfgs``)
IN_CONTAINERS = {
    "__slots__ holder in a list": (
        lambda: [SlottedCfg()],
        lambda b: b.cfgs[0],
        lambda c: _anneal(c[0]),
    ),
    "__slots__ and __dict__ holder": (SlottedPair, lambda b: b.cfgs, _anneal_pair),
    "slot deleted (or set)": (SlottedBias, lambda b: b.cfgs, _slot_deleted),
    "frozen slots dataclass": (FrozenSlotted, lambda b: b.cfgs, _frozen_rebound),
    "list of holders": (
        lambda: [types.SimpleNamespace(sharpness=0.5), types.SimpleNamespace(sharpness=1.0)],
        lambda b: b.cfgs[1],
        lambda c: _anneal(c[1]),
    ),
    "tuple of holders": (
        lambda: (types.SimpleNamespace(sharpness=1.0),),
        lambda b: b.cfgs[0],
        lambda c: _anneal(c[0]),
    ),
    "holder in a holder's dict": (
        lambda: types.SimpleNamespace(sub={"inner": types.SimpleNamespace(sharpness=1.0)}),
        lambda b: b.cfgs.sub["inner"],
        lambda c: _anneal(c.sub["inner"]),
    ),
    "holder in a dict in a list": (
        lambda: [{"cfg": types.SimpleNamespace(sharpness=1.0)}],
        lambda b: b.cfgs[0]["cfg"],
        lambda c: _anneal(c[0]["cfg"]),
    ),
    "registry item rebound to another holder": (
        lambda: {"cfg": types.SimpleNamespace(sharpness=1.0)},
        lambda b: b.cfgs["cfg"],
        _new_registry_item,
    ),
}


class ContainerHolderAfter(Stack):
    def __init__(self, name) -> None:
        make, get, self.change = IN_CONTAINERS[name]
        super().__init__([ReadsAt(make, get), ReadsAt(make, get)])

    def after(self, h):
        for b in self.blocks:
            self.change(b.cfgs)


@pytest.mark.parametrize("name", list(IN_CONTAINERS))
def test_holder_in_a_container_or_with_slots_changed_between_forward_and_replay(tokens, name):
    assert_exact(lambda: ContainerHolderAfter(name), SEGS2, "auto")


class OrderedParams(nn.Module):
    """Weighs its own parameters in registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(D))
        self.b = nn.Parameter(torch.randn(D) * 0.5)
        self._parameters = collections.OrderedDict(self._parameters)

    def forward(self, x):
        ps = list(self.parameters(recurse=False))
        return x + torch.tanh(x * ps[0] + ps[1])


class OrderedSeq(nn.Module):
    """A Sequential of two different layers whose ``_modules`` is an OrderedDict: their order
    is the forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.seq._modules = collections.OrderedDict(self.seq._modules)

    def forward(self, x):
        return x + self.seq(x)


class ReorderDict(Stack):
    def __init__(self, blocks, which) -> None:
        super().__init__(blocks)
        self.which = which

    def after(self, h):
        for b in self.blocks:
            d = self.which(b)
            d.move_to_end(next(iter(d)))


class InnerSwapped(Stack):
    """Swaps each block's layer with a spare one (other weights, in a plain list) between the
    block's forward and its replay."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        for b in blocks:
            spare = nn.Linear(D, D)
            with torch.no_grad():
                spare.weight.copy_(b.lin.weight * 0.5)
                spare.bias.copy_(b.lin.bias + 0.1)
            b.spare = [spare]

    def after(self, h):
        for b in self.blocks:
            b._modules["lin"], b.spare[0] = b.spare[0], b._modules["lin"]


REORDERS = {
    "_parameters reordered": (OrderedParams, lambda b: b._parameters),
    "_modules reordered": (OrderedSeq, lambda b: b.seq._modules),
}


@pytest.mark.parametrize("name", list(REORDERS))
def test_slot_dict_order_changed_between_forward_and_replay(tokens, name):
    make, which = REORDERS[name]
    assert_exact(lambda: ReorderDict([make(), make()], which), SEGS2, "auto")


def test_submodule_replaced_between_forward_and_replay(tokens):
    assert_exact(lambda: InnerSwapped([Block(), Block()]), SEGS2, "auto")


class PreHooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.lin.register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class PreHookSwapper(Stack):
    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.calls = 0

    def after(self, h):
        self.calls += 1
        f = 1.0 / (1 + self.calls)
        for b in self.blocks:
            hooks = b.lin._forward_pre_hooks
            hooks[next(iter(hooks))] = lambda m, args: (args[0] * f,)


class HookAdder(Stack):
    """Adds a hook to each block's layer between its forward and its replay; the next step
    removes it before the forward (``_remove_added``)."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.handles: list = []

    def after(self, h):
        for b in self.blocks:
            self.handles.append(b.lin.register_forward_hook(lambda m, i, o: o * 0.5))


def _remove_added(model, step):
    for handle in model.handles:
        handle.remove()
    model.handles = []


class MarkedLinear(nn.Linear):
    """The only modules a global hook of these tests scales."""


class GlobalHooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = MarkedLinear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _global_scale(f):
    return lambda m, i, o: o * f if isinstance(m, MarkedLinear) else None


class GlobalHookSwapper(Stack):
    """Swaps torch's global forward hook (registered by ``_register_global``) under its key
    between the blocks' forward and their replay."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.calls = 0

    def after(self, h):
        self.calls += 1
        hooks = torch.nn.modules.module._global_forward_hooks
        hooks[_GLOBAL_HANDLES[-1].id] = _global_scale(1.0 / (1 + self.calls))


def _register_global(model, step):
    if step == 0:  # each run from the same hook alone; the last one is removed by the test
        for handle in _GLOBAL_HANDLES:
            handle.remove()
        _GLOBAL_HANDLES.clear()
        handle = torch.nn.modules.module.register_module_forward_hook(_global_scale(1.0))
        model.calls = 0
        _GLOBAL_HANDLES.append(handle)


_GLOBAL_HANDLES: list = []


def test_pre_hook_swapped_between_forward_and_replay(tokens):
    assert_exact(lambda: PreHookSwapper([PreHooked(), PreHooked()]), SEGS2, "auto")


def test_hook_added_between_forward_and_replay(tokens):
    assert_exact(lambda: HookAdder([Hooked(), Hooked()]), SEGS2, "auto", schedule=_remove_added)


def test_global_hook_swapped_between_forward_and_replay(tokens):
    try:
        assert_exact(
            lambda: GlobalHookSwapper([GlobalHooked(), GlobalHooked()]),
            SEGS2,
            "auto",
            schedule=_register_global,
        )
    finally:
        for handle in _GLOBAL_HANDLES:
            handle.remove()
        _GLOBAL_HANDLES.clear()


# ------------------------------------------------------------------ the same, between steps
class OutsideBank(Stack):
    """The blocks read the root's bank (outside every segment) once their flag is on, and the
    step writes the bank in place after them: a contract learned with the flag off would
    replay with the bank's new bytes. Only the guard, seeing the flag flip, saves the step."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.register_buffer("bank", torch.randn(4, D))
        for b in blocks:
            b.root = [self]  # (a plain list: not a submodule)

    def after(self, h):
        with torch.no_grad():
            self.bank.mul_(0.5).add_(h.detach().mean(0))


class SlottedFlag:
    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


def _ns_flag():
    return types.SimpleNamespace(on=False)


#: where the flag lives: (make the block's ``opts``, read the flag, turn it on)
FLAG_PLACES = {
    "holder": (_ns_flag, lambda o: o.on, lambda o: setattr(o, "on", True)),
    "__slots__ holder": (SlottedFlag, lambda o: o.on, lambda o: setattr(o, "on", True)),
    "dict attribute": (
        lambda: {"on": False},
        lambda o: o["on"],
        lambda o: o.__setitem__("on", True),
    ),
    "list attribute": (lambda: [False], lambda o: o[0], lambda o: o.__setitem__(0, True)),
    "holder in a dict attribute": (
        lambda: collections.OrderedDict(cfg=_ns_flag()),
        lambda o: o["cfg"].on,
        lambda o: setattr(o["cfg"], "on", True),
    ),
    "holder in a list attribute": (
        lambda: [_ns_flag()],
        lambda o: o[0].on,
        lambda o: setattr(o[0], "on", True),
    ),
    "holder in a tuple attribute": (
        lambda: (_ns_flag(),),
        lambda o: o[0].on,
        lambda o: setattr(o[0], "on", True),
    ),
    "holder in a holder's dict": (
        lambda: types.SimpleNamespace(sub={"inner": _ns_flag()}),
        lambda o: o.sub["inner"].on,
        lambda o: setattr(o.sub["inner"], "on", True),
    ),
    "__slots__ holder in a holder's list": (
        lambda: types.SimpleNamespace(items=[SlottedFlag()]),
        lambda o: o.items[0].on,
        lambda o: setattr(o.items[0], "on", True),
    ),
}


class FlaggedBank(nn.Module):
    def __init__(self, place: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        make, self.read, self.turn_on = FLAG_PLACES[place]
        self.opts = make()

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.read(self.opts):
            bank = self.root[0].bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


def _flag_on_at_step_3(model, step):
    if step == 3:  # after the probe; the engine counts steps from 1
        for b in model.blocks:
            b.turn_on(b.opts)


@pytest.mark.parametrize("place", list(FLAG_PLACES))
def test_flag_in_a_holder_or_container_flipped_between_steps_is_guarded(tokens, place):
    _, records = assert_exact(
        lambda: OutsideBank([FlaggedBank(place), FlaggedBank(place)]),
        SEGS2,
        "auto",
        schedule=_flag_on_at_step_3,
    )
    assert {r.step for r in _guard_records(records)} == {4}, _guard_records(records)


def _buffers_reordered_at_step_3(model, step):
    if step == 3:
        for b in model.blocks:
            b._buffers.move_to_end(next(iter(b._buffers)))  # no tag moves


def _reads_bank(model, only=nn.Module):
    """A hook that reads the root's bank (outside the segments, written after them)."""

    def hook(m, i, o):
        if not isinstance(m, only):
            return None
        bank = model.bank.clone()
        return o + torch.softmax(o @ bank.T, -1) @ bank

    return hook


def _layers_reordered_at_step_3(model, step):
    if step == 3:
        for b in model.blocks:
            b.seq._modules.move_to_end(next(iter(b.seq._modules)))  # no tag moves


def _hook_swapped_at_step_3(model, step):
    if step == 3:
        for b in model.blocks:
            hooks = b.lin._forward_hooks
            hooks[next(iter(hooks))] = _reads_bank(model)


def _global_hook_swapped_at_step_3(model, step):
    _register_global(model, step)
    if step == 3:
        hooks = torch.nn.modules.module._global_forward_hooks
        hooks[_GLOBAL_HANDLES[-1].id] = _reads_bank(model, MarkedLinear)


#: what changes at step 3: (the model, the schedule); the new hooks read the root's bank
BETWEEN_STEPS = {
    "buffer order": (lambda: Stack([Ordered(), Ordered()]), _buffers_reordered_at_step_3),
    "submodule order": (lambda: Stack([OrderedSeq(), OrderedSeq()]), _layers_reordered_at_step_3),
    "hook function": (lambda: OutsideBank([Hooked(), Hooked()]), _hook_swapped_at_step_3),
    "global hook function": (
        lambda: OutsideBank([GlobalHooked(), GlobalHooked()]),
        _global_hook_swapped_at_step_3,
    ),
}


@pytest.mark.parametrize("what", list(BETWEEN_STEPS))
def test_order_or_hook_changed_between_steps_is_guarded(tokens, what):
    make, schedule = BETWEEN_STEPS[what]
    try:
        _, records = assert_exact(make, SEGS2, "auto", schedule=schedule)
    finally:
        for handle in _GLOBAL_HANDLES:
            handle.remove()
        _GLOBAL_HANDLES.clear()
    assert {r.step for r in _guard_records(records)} == {4}, _guard_records(records)


# ------------------------------------------------------------------ read from outside the segment
class ReadsRoot(nn.Module):
    """Reads a value of the root (outside every segment): ``root.cfg.temp``, through a dict of
    configs ``root.cfgs["a"].temp``, or gated by ``root.use_bank``, the root's bank."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.what = what

    def forward(self, x):
        r = self.root[0]
        h = self.lin(x)
        if self.what == "holder":
            h = h * r.cfg.temp  # (inside tanh: what autograd saves depends on it)
        elif self.what == "holder in a dict":
            h = h * r.cfgs["a"].temp
        h = torch.tanh(h)
        if self.what == "flag" and r.use_bank:
            bank = r.bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


class Root(OutsideBank):
    def __init__(self, what: str) -> None:
        super().__init__([ReadsRoot(what), ReadsRoot(what)])
        self.cfg = types.SimpleNamespace(temp=1.0)
        self.cfgs = {"a": types.SimpleNamespace(temp=1.0)}
        self.use_bank = False
        self.anneal = what != "flag"

    def after(self, h):
        super().after(h)
        if self.anneal:
            self.cfg.temp *= 0.8
            self.cfgs["a"].temp *= 0.8


@pytest.mark.parametrize("what", ["holder", "holder in a dict"])
def test_outside_holder_annealed_between_forward_and_replay(tokens, what):
    """A config on the root that the blocks read (an outside read): the replay puts back its
    attributes, not only which object the root held."""
    assert_exact(lambda: Root(what), SEGS2, "auto")


def _root_flag_on_at_step_3(model, step):
    if step == 3:
        model.use_bank = True


def test_outside_flag_flipped_between_steps_is_guarded(tokens):
    _, records = assert_exact(lambda: Root("flag"), SEGS2, "auto", schedule=_root_flag_on_at_step_3)
    assert {r.step for r in _guard_records(records)} == {4}, _guard_records(records)


# ------------------------------------------------------------------ changed inside the probe's window
class ModuleFlag(nn.Module):
    """:class:`FlaggedBank` with the flag as the block's own attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.on = False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.on:
            bank = self.root[0].bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


class LateFlag(nn.Module):
    """:class:`ModuleFlag` whose flag does not exist until someone sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if getattr(self, "on", False):
            bank = self.root[0].bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


class FlipsInTheProbeWindow(OutsideBank):
    """Turns each block's flag on after the blocks ran, in the first (probe) step only: the
    next forward reads the bank, which the probe's forward did not."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.flipped = False

    def after(self, h):
        if not self.flipped:
            self.flipped = True
            for b in self.blocks:
                if isinstance(b, (ModuleFlag, LateFlag)):
                    b.on = True
                else:
                    b.turn_on(b.opts)
        super().after(h)


@dataclasses.dataclass
class FlagConfig:
    on: bool = False


FLAG_PLACES["dataclass holder"] = (
    FlagConfig,
    lambda o: o.on,
    lambda o: setattr(o, "on", True),
)

IN_THE_PROBE_WINDOW = {
    "module attribute": ModuleFlag,
    "module attribute created there": LateFlag,
    **{f"{place} attribute": (lambda p=place: FlaggedBank(p)) for place in FLAG_PLACES},
}


@pytest.mark.parametrize("where", list(IN_THE_PROBE_WINDOW))
def test_flag_flipped_inside_the_probe_window_is_guarded(tokens, where):
    """A flag the forward read, turned after it inside the probe's window, stays a
    precondition (probe._read_flags traces the reads: every one was wrong from step 1 at
    e5622ea): the next forward is re-probed."""
    make = IN_THE_PROBE_WINDOW[where]
    _, records = assert_exact(lambda: FlipsInTheProbeWindow([make(), make()]), SEGS2, "auto")
    assert {r.step for r in _guard_records(records)} == {2}, _guard_records(records)
