"""The steady path's slot checks trust dict version tags: every way of rebinding a slot must
move one (issue 16's overhead work; issue 12's promise).

The guard at each forward and the replay's slot check compare each module's version tags
(:func:`lightning_replay.slots.slot_token`) before they compare the objects themselves. These
models rebind the state a segment reads by every path that bypasses ``nn.Module.__setattr__``
(the instance dict itself, ``object.__setattr__``, ``vars().update``, the parameter and buffer
dicts, a holder object's dict, the interpreter's specialized attribute stores), between a
segment's forward and its replay and between steps, and write a slot and put it back (tags
move, objects do not). Each trains under ``lr.install`` and in plain PyTorch and asserts
bit-identical gradients and state, with the version tags in use and with them off (the
identity comparison every interpreter without trusted tags gets).
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay import _compat, guards, slots
from tests.test_exactness import D, SEGS2, Stack, assert_exact

PRESERVATIONS = ["auto", "whole", "regions"]


class Scaled(nn.Module):
    """Reads a plain float, a buffer and a holder's value; each steers what autograd saves."""

    def __init__(self, holder) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = 1.0
        self.register_buffer("mem", torch.randn(4, D))
        self.holder = holder

    def forward(self, x):
        h = self.lin(x) * self.scale * self.holder.sharpness
        return x + torch.tanh(h) + torch.softmax(h @ self.mem.T, -1) @ self.mem


class Holder:  # a plain class: its instances' attribute stores get specialized
    def __init__(self) -> None:
        self.sharpness = 1.0


#: one rebinding path each: ``write(block, holder, new_scale, new_mem, new_sharpness)``
PATHS = {
    "attribute: instance dict": lambda b, h, s, m, k: b.__dict__.__setitem__("scale", s),
    "attribute: object.__setattr__": lambda b, h, s, m, k: object.__setattr__(b, "scale", s),
    "attribute: vars().update": lambda b, h, s, m, k: vars(b).update(scale=s),
    "attribute: pop, setdefault": lambda b, h, s, m, k: (
        b.__dict__.pop("scale"),
        b.__dict__.setdefault("scale", s),
    ),
    "buffer: buffer dict": lambda b, h, s, m, k: b._buffers.__setitem__("mem", m),
    "buffer: buffer dict update": lambda b, h, s, m, k: b._buffers.update(mem=m),
    "buffer: through the instance dict": lambda b, h, s, m, k: b.__dict__["_buffers"].__setitem__(
        "mem", m
    ),
    "holder: instance dict": lambda b, h, s, m, k: h.__dict__.__setitem__("sharpness", k),
    "holder: specialized store": lambda b, h, s, m, k: _store_often(h, k),
}


def _store_often(h, value) -> None:
    for i in range(10):  # the same store bytecode, often enough to be specialized
        h.sharpness = value + 0.001 * i


class Rebinder(Stack):
    """Rebinds one kind of slot of each block between its forward and its replay, by one path
    that bypasses ``nn.Module.__setattr__``."""

    def __init__(self, path: str) -> None:
        self.holder = Holder()
        super().__init__([Scaled(self.holder), Scaled(self.holder)])
        self.path = path

    def after(self, h):
        for b in self.blocks:
            PATHS[self.path](
                b,
                self.holder,
                b.scale * 0.9 + 0.05,
                torch.roll(b.mem, 1, 0) * 0.5,
                self.holder.sharpness * 0.97,
            )


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_slot_rebound_around_setattr_between_forward_and_replay(tokens, preservation, path):
    assert_exact(lambda: Rebinder(path), SEGS2, preservation)


class PutBack(Stack):
    """Binds every block's slots to other objects and back between forward and replay: the
    version tags move, every slot holds its forward object again."""

    def after(self, h):
        for b in self.blocks:
            scale, mem, w = b.scale, b.mem, b.lin.weight
            b.__dict__["scale"] = scale + 1.0
            b._buffers["mem"] = mem + 1.0
            b.lin._parameters["weight"] = nn.Parameter(w.detach() + 1.0)
            b.__dict__["scale"] = scale
            b._buffers["mem"] = mem
            b.lin._parameters["weight"] = w


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_slots_written_and_put_back_between_forward_and_replay(tokens, preservation):
    holder = Holder()
    summary, records = assert_exact(
        lambda: PutBack([Scaled(holder), Scaled(holder)]), SEGS2, preservation
    )
    # the same objects every step: the guards settle, nothing is re-probed
    assert not [r for r in records if r.check == "guard"], records


class Banked(nn.Module):
    """Reads its bank only once ``use_bank`` is set; the step writes the bank in place after
    the segment, so a contract learned without the bank would replay with its new bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.use_bank = False
        self.register_buffer("bank", torch.randn(4, D))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.use_bank:
            bank = self.bank.clone()  # a copy, as MoCo reads its queue: the step writes bank
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


class BankWriter(Stack):
    def after(self, h):
        with torch.no_grad():
            for b in self.blocks:
                b.bank.mul_(0.5).add_(h.detach().mean(0))


def _flip_through_the_dict(model, step):
    if step == 3:  # after the probe, by a path nn.Module.__setattr__ never sees
        for b in model.blocks:
            b.__dict__["use_bank"] = True


@pytest.mark.parametrize("preservation", PRESERVATIONS)
def test_flag_flipped_through_the_instance_dict_is_guarded(tokens, preservation):
    summary, records = assert_exact(
        lambda: BankWriter([Banked(), Banked()]),
        SEGS2,
        preservation,
        schedule=_flip_through_the_dict,
    )
    guarded = [r for r in records if r.check == "guard"]
    # both segments re-probed at the flip's step (the engine counts steps from 1), and only then
    assert len(guarded) == 2 and {r.step for r in guarded} == {4}, guarded
    assert all("use_bank" in r.detail for r in guarded), guarded


def test_version_tags_move_on_every_rebinding_path():
    """What the engine relies on, on this interpreter (the accessor's own test runs at import
    and turns the tags off where any path fails)."""
    read = _compat.dict_version
    assert read is not None
    m = nn.Linear(2, 2)
    d, p, b = m.__dict__, m._parameters, m._buffers
    m.register_buffer("buf", torch.zeros(1))

    def moved(write) -> bool:
        before = slots.slot_token(d)
        write()
        return slots.slot_token(d) != before

    assert moved(lambda: setattr(m, "x", object()))
    assert moved(lambda: d.__setitem__("x", object()))
    assert moved(lambda: object.__setattr__(m, "x", object()))
    assert moved(lambda: p.__setitem__("weight", nn.Parameter(torch.zeros(2, 2))))
    assert moved(lambda: b.__setitem__("buf", torch.zeros(1)))
    assert moved(lambda: delattr(m, "x"))
    assert not moved(lambda: getattr(m, "weight"))
    assert read(d) == read(d)
    with torch.no_grad():
        before = slots.slot_token(d)
        m.weight.add_(1)  # bytes, not bindings: versions of tensors cover these
        assert slots.slot_token(d) == before


class ConfigHolder(Holder):
    """A config like transformers' (``id2label``, ``label2id``): containers among its
    attributes, which each replay gets its own copies of where they changed."""

    def __init__(self) -> None:
        super().__init__()
        self.id2label = {0: "LABEL_0", 1: "LABEL_1"}
        self.architectures = ["Scaled"]


@pytest.mark.parametrize("holder_cls", [Holder, ConfigHolder], ids=["holder", "config"])
def test_engine_steady_steps_take_the_tag_path(monkeypatch, holder_cls):
    """A steady model's guards and replays compare no identities at all: nothing the engine
    does in a step (its replays' swaps and restores included) moves a tag the next forward's
    guard reads."""
    calls = {"n": 0}
    real = slots.identities
    real_exact = guards.Guard._exact_now

    def counted(d):
        calls["n"] += 1
        return real(d)

    def counted_exact(self, fast):
        calls["n"] += 1
        return real_exact(self, fast)

    torch.manual_seed(0)
    holder = holder_cls()
    model = Stack([Scaled(holder), Scaled(holder)])
    engine = lr.install(model, SEGS2)
    try:
        for _ in range(3):  # probe, plan, steady
            model(torch.randn(2, D)).sum().backward()
        monkeypatch.setattr(slots, "identities", counted)
        monkeypatch.setattr(guards, "identities", counted)
        monkeypatch.setattr(guards.Guard, "_exact_now", counted_exact)
        for _ in range(3):
            model(torch.randn(2, D)).sum().backward()
        assert sum(s["replays"] for s in engine.summary().values()) >= 6
    finally:
        engine.uninstall()
    assert calls["n"] == 0


class _Scales(list):
    """A list subclass (what a library's own container types look like)."""


#: an attribute container of a subclass type, and how the step changes it in place
CONTAINERS = {
    "OrderedDict value": (
        lambda: collections.OrderedDict(a=1.0, b=0.5),
        lambda c: c.__setitem__("a", c["a"] * 0.9 + 0.05),
    ),
    "OrderedDict order": (
        lambda: collections.OrderedDict(a=1.0, b=0.5),
        lambda c: c.move_to_end(next(iter(c))),
    ),
    "defaultdict new key": (
        lambda: collections.defaultdict(float, a=1.0),
        lambda c: c.__setitem__("b", c["b"] + 0.25),
    ),
    "Counter": (lambda: collections.Counter(a=2, b=1), lambda c: c.update(a=1)),
    "list subclass": (lambda: _Scales([1.0, 0.5]), lambda c: c.append(c[0] * 0.5)),
    "OrderedDict of tensors rebound": (
        lambda: collections.OrderedDict(w=torch.ones(D)),
        lambda c: c.__setitem__("w", c["w"] * 0.5 + 0.1),
    ),
}


class FromContainer(nn.Module):
    """Steers what autograd saves by the items (and their order) of a container attribute."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.c = CONTAINERS[kind][0]()

    def forward(self, x):
        h = self.lin(x)
        values = list(self.c.values()) if isinstance(self.c, dict) else list(self.c)
        for i, v in enumerate(values):  # order matters: each item weighs the next
            h = torch.tanh(h * (v if isinstance(v, torch.Tensor) else float(v)) + i)
        return x + h


class ContainerWriter(Stack):
    def __init__(self, kind: str) -> None:
        super().__init__([FromContainer(kind), FromContainer(kind)])
        self.kind = kind

    def after(self, h):
        for b in self.blocks:
            CONTAINERS[self.kind][1](b.c)


@pytest.mark.parametrize("kind", list(CONTAINERS))
@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_container_subclass_attribute_changed_between_forward_and_replay(
    tokens, preservation, kind
):
    """An OrderedDict, defaultdict, Counter or list subclass is a container: its items (and
    their order) are put back for the replay as they were at forward, like a plain dict's."""
    assert_exact(lambda: ContainerWriter(kind), SEGS2, preservation)


class SubConfig:
    def __init__(self, parent) -> None:
        self.sharpness = 1.0
        self.parent = parent  # a cycle back to the outer config


class OuterConfig:
    def __init__(self) -> None:
        self.text_config = SubConfig(self)
        self.extra = types.SimpleNamespace(options=types.SimpleNamespace(shift=0.0))


class ReadsNested(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.cfg = cfg

    def forward(self, x):
        h = self.lin(x) * self.cfg.text_config.sharpness + self.cfg.extra.options.shift
        return x + torch.tanh(h)


class NestedAnnealer(Stack):
    def __init__(self) -> None:
        self.cfg = OuterConfig()
        super().__init__([ReadsNested(self.cfg), ReadsNested(self.cfg)])

    def after(self, h):
        self.cfg.text_config.sharpness *= 0.9  # one level down
        self.cfg.extra.options.shift += 0.1  # two levels down


@pytest.mark.parametrize("preservation", ["auto", "whole"])
def test_nested_config_annealed_between_forward_and_replay(tokens, preservation):
    """A config's sub-configs (a multimodal model's ``text_config``), with a cycle back to the
    outer one, are put back for the replay at every level."""
    assert_exact(NestedAnnealer, SEGS2, preservation)
