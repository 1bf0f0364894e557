"""Adversarial models, round 2, against held modules as mended in 0bb9878 .. 4248250.

What those commits claim: a module no installed model registers is a holder (a registry by id
with weak references, counted per install); a held module's parameter, buffer, submodule and
hook dicts are put back by contents, and the ones empty at the forward are emptied again; a
holder behind a bound method or a ``functools.partial`` is captured; a probe traces the reads
of modules other installed models register; a class that refuses subclasses is refused by name
as a segment, and read whole as another module; the process walk survives a lazy module.

Each case changes such a module (or what reaches it) between a segment's forward and its replay
in a way those commits' tests do not. The referees are :func:`tests.test_exactness.assert_exact`
and :func:`tests.test_adversary_unregistered.assert_exact_held` (a replayed copy against a plain
copy: bit-identical gradients at each step, identical state after), the registry itself for
counts, and the user's own class registry for side effects of the class swaps.
"""

from __future__ import annotations

import copy
import functools
import gc
import re
import time
import types
import warnings
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.mechanisms import slots
from lightning_replay.core.mechanisms.slots import behind, is_holder
from tests.helpers.compare import assert_same_grads, assert_same_state
from tests.test_adversary_unregistered import PRES, Uses, _held, assert_exact_held
from tests.test_exactness import SEGS2, D, Stack, _fresh, _observable, _train, assert_exact
from tests.test_unregistered_modules import Gain
from tests.test_unsubclassable import FinalMeta  # (refuses subclasses of a `__final__` class)


def _apply(f, h: torch.Tensor) -> torch.Tensor:
    return f(h)


def _apply_kw(h: torch.Tensor, *, f) -> torch.Tensor:
    return f(h)


class _Plain:
    """A plain object whose method (not ``__call__``) reads a gain."""

    def __init__(self) -> None:
        self.gain = 1.0

    def scale(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.gain)


class _ClassGain:
    """State on a class: a classmethod and a staticmethod read it."""

    gain = 1.0

    @classmethod
    def cm(cls, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * cls.gain)

    @staticmethod
    def sm(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * _ClassGain.gain)


class _PMHolder(nn.Module):
    """A module whose ``scaled`` is a ``functools.partialmethod`` (a partial of a bound method
    once looked up on an instance)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0

    def _scaled(self, k: float, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.gain * k)

    scaled = functools.partialmethod(_scaled, 1.5)


def _fn_of(kind: str, act: Gain) -> object:
    """The callable a block keeps in its ``__dict__['fn']`` to reach ``act`` (or a plain
    object, for the plain kinds); ``owner(fn)`` finds the object annealed."""
    if kind == "method of a plain object's other method":
        return _Plain().scale
    if kind == "partial of a partial of a method":
        return functools.partial(_apply, functools.partial(_apply, act.forward))
    if kind == "three partials deep":
        return functools.partial(
            _apply, functools.partial(_apply, functools.partial(_apply, act.forward))
        )
    if kind == "partial with the module as keyword":
        return functools.partial(_apply_kw, f=act)
    if kind == "partialmethod":
        return _PMHolder().scaled
    if kind == "closure":
        return lambda h: act(h)
    if kind == "MethodType":
        return types.MethodType(Gain.forward, act)
    if kind == "method in a config's list":
        return types.SimpleNamespace(fns=[act.forward])
    if kind == "partial in a dict":
        return {"f": functools.partial(_apply, act)}
    raise AssertionError(kind)


def _owner(fn: object) -> object:
    """The object whose ``gain`` the callable reads (found the slow way: through closures,
    partials and methods)."""
    todo, seen = [fn], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if hasattr(x, "gain") and not isinstance(x, type):
            return x
        if isinstance(x, types.SimpleNamespace):
            todo += list(vars(x).values())
        elif isinstance(x, (list, dict)):
            todo += list(x.values()) if isinstance(x, dict) else x
        elif isinstance(x, types.MethodType):
            todo.append(x.__self__)
        elif isinstance(x, functools.partial):
            todo += [x.func, *x.args, *(x.keywords or {}).values()]
        elif isinstance(x, types.FunctionType) and x.__closure__:
            todo += [c.cell_contents for c in x.__closure__]
    raise AssertionError(fn)


class Via(Uses):
    """A block that reaches its activation only through ``__dict__['fn']``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.__dict__["fn"] = _fn_of(kind, Gain())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self.__dict__["fn"]
        if isinstance(fn, types.SimpleNamespace):
            fn = fn.fns[0]
        elif isinstance(fn, dict):
            fn = fn["f"]
        return x + fn(self.lin(x))


class AnnealsVia(Stack):
    def __init__(self, kind: str) -> None:
        super().__init__([Via(kind), Via(kind)])

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            _owner(b.__dict__["fn"]).gain *= 0.9


#: ("closure" and "three partials deep" failed at db61581, silently: behind() followed no
#: closure and two wrappers only)


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize(
    "kind",
    [
        "method of a plain object's other method",
        "partial of a partial of a method",
        "three partials deep",
        "partial with the module as keyword",
        "partialmethod",
        "MethodType",
        "method in a config's list",
        "partial in a dict",
        "closure",
    ],
)
def test_a_holder_behind_a_callable_is_put_back(kind, preservation):
    # (two builds from one seed, not deep copies: a deep copy of a function shares its
    # closure, so a deep-copied reference would anneal the replayed model's activation too)
    ref, model = _fresh(lambda: AnnealsVia(kind)), _fresh(lambda: AnnealsVia(kind))
    assert _owner(ref.blocks[0].__dict__["fn"]) is not _owner(model.blocks[0].__dict__["fn"])
    g_ref = _train(ref, 6)
    engine = lr.install(model, SEGS2, preservation=preservation)
    try:
        g_rep = _train(model, 6, engine=engine)
        replays = sum(s["replays"] for s in engine.summary().values())
    finally:
        engine.uninstall()
    assert_same_grads(g_ref, g_rep, preservation)
    assert_same_state(_observable(ref), _observable(model), preservation)
    assert replays >= 4


_GLOBAL_GAIN = {"gain": 1.0}


def _reads_global(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h * _GLOBAL_GAIN["gain"])


class ViaClass(Uses):
    """Holds a function that reads state outside any module: a class attribute through a
    classmethod or a staticmethod, or a module-level dict through a plain function; held
    as a plain attribute, in a dict, in a list, or behind a partial."""

    def __init__(self, which: str) -> None:
        super().__init__()
        fn = {
            "classmethod": _ClassGain.cm,
            "staticmethod": _ClassGain.sm,
            "classmethod in a dict": _ClassGain.cm,
            "partial of a classmethod": functools.partial(_ClassGain.cm),
            "staticmethod in a list": _ClassGain.sm,
            "function reading a global, in a dict": _reads_global,
        }[which]
        self.where = "list" if "list" in which else "dict" if "dict" in which else "attr"
        self.__dict__["fns"] = {"fn": fn} if self.where == "dict" else [fn]
        self.__dict__["fn"] = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        fn = (
            d["fn"]
            if self.where == "attr"
            else d["fns"]["fn"]
            if self.where == "dict"
            else d["fns"][0]
        )
        return x + fn(self.lin(x))


class AnnealsClass(Stack):
    def __init__(self, which: str) -> None:
        super().__init__([ViaClass(which), ViaClass(which)])

    def after(self, h: torch.Tensor) -> None:
        _ClassGain.gain *= 0.9
        _GLOBAL_GAIN["gain"] *= 0.9


def _reset_class(model: nn.Module, step: int) -> None:
    if step == 0:
        _ClassGain.gain = 1.0
        _GLOBAL_GAIN["gain"] = 1.0


#: ("classmethod" and "staticmethod" were strict xfails until 2d32955, wrong gradients from
#: step 1, silently: the code of a function a module holds was not scanned for the class
#: attributes and globals it reads; probe.py passes module_globals.held_functions now)


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize(
    "which",
    [
        "classmethod",
        "staticmethod",
        "classmethod in a dict",
        "partial of a classmethod",
        "staticmethod in a list",
        "function reading a global, in a dict",
    ],
)
def test_a_class_attribute_behind_a_classmethod_is_put_back(which, preservation):
    assert_exact(
        lambda: AnnealsClass(which), SEGS2, preservation, min_replays=4, schedule=_reset_class
    )


class NewMethodEachStep(Stack):
    """The root makes a fresh ``types.MethodType`` at each forward onto an activation it keeps
    only in a plain attribute of its own, and hands it to the blocks."""

    def __init__(self) -> None:
        super().__init__([Via("MethodType"), Via("MethodType")])
        self.__dict__["_act"] = Gain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            b.__dict__["fn"] = types.MethodType(Gain.forward, self.__dict__["_act"])
        return super().forward(x)

    def after(self, h: torch.Tensor) -> None:
        self.__dict__["_act"].gain *= 0.9


@pytest.mark.parametrize("preservation", PRES)
def test_a_method_made_at_each_step_is_put_back(preservation):
    assert_exact(NewMethodEachStep, SEGS2, preservation, min_replays=4)


class ViaRegistered(Uses):
    """A block reaching a gain activation the model registers (on the root) through a bound
    method of it: a registered module, no holder, read by the outside-read trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.__dict__["fn"](self.lin(x))


class AnnealsRegisteredBehind(Stack):
    def __init__(self) -> None:
        super().__init__([ViaRegistered(), ViaRegistered()])
        self.src = Gain()
        for b in self.blocks:
            b.__dict__["fn"] = self.src.forward

    def after(self, h: torch.Tensor) -> None:
        self.src.gain *= 0.9


@pytest.mark.parametrize("preservation", PRES)
def test_a_bound_method_of_a_registered_module_is_exact_and_no_capture(preservation):
    assert_exact(AnnealsRegisteredBehind, SEGS2, preservation, min_replays=4)
    model = AnnealsRegisteredBehind()
    engine = lr.install(model, SEGS2)
    try:
        assert behind(model.blocks[0].__dict__["fn"]) == []  # registered: nothing to capture
    finally:
        engine.uninstall()


class SelfHelper(nn.Module):
    """A segment that keeps a bound method of itself (``self.fn = self.helper``) and a held
    activation that keeps bound methods of itself and of its twin (a cycle)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.__dict__["fn"] = self.helper
        a, b = Gain(), Gain()
        a.__dict__["twin"], b.__dict__["twin"] = b.forward, a.forward
        a.__dict__["me"], b.__dict__["me"] = a.forward, b.forward
        self.__dict__["act"] = a.forward

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        act = self.__dict__["act"].__self__
        return torch.tanh(self.lin(x)) * act.gain + act.__dict__["twin"](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.__dict__["fn"](x)


class AnnealsCycle(Stack):
    def __init__(self) -> None:
        super().__init__([SelfHelper(), SelfHelper()])

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            a = b.__dict__["act"].__self__
            a.gain *= 0.9
            a.__dict__["twin"].__self__.gain *= 0.8


@pytest.mark.parametrize("preservation", PRES)
def test_bound_methods_in_a_cycle_are_put_back(preservation):
    t0 = time.perf_counter()
    assert_exact(AnnealsCycle, SEGS2, preservation, min_replays=4)
    assert time.perf_counter() - t0 < 30


# --------------------------------------------------------------- 2. hooks on held modules
def _plus(mod: nn.Module, args: tuple) -> tuple:
    return (args[0] + 0.5,)


def _times(mod: nn.Module, args: tuple) -> tuple:
    return (args[0] * 2.0,)


def _kw_plus(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
    return (args[0] + 0.25,), kwargs


def _fwd_sq(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * torch.sigmoid(out)


def _grad_twice(mod: nn.Module, gin: tuple, gout: tuple) -> tuple:
    return tuple(None if g is None else g * 2 for g in gin)


def _grad_out_twice(mod: nn.Module, gout: tuple) -> tuple:
    return tuple(None if g is None else g * 2 for g in gout)


class HookGames(Stack):
    """Each block's held activation has a pre-hook ``_plus`` at each forward; in the window
    (``after``) ``what`` happens to its hooks; the forward puts the same hooks back first."""

    def __init__(self, what: str) -> None:
        super().__init__([_held(Gain()), _held(Gain())])
        self.what = what

    def _acts(self) -> list[nn.Module]:
        return [b.act() for b in self.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a in self._acts():
            for k in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks"):
                setattr(a, k, OrderedDict())  # (torch's own attributes: set through __dict__)
            a.__dict__["_forward_hooks_always_called"] = OrderedDict()
            a.__dict__["_backward_hooks"] = OrderedDict()
            a.__dict__["_backward_pre_hooks"] = OrderedDict()
            a.__dict__["_is_full_backward_hook"] = None
            a.register_forward_pre_hook(_plus)
        return super().forward(x)

    def after(self, h: torch.Tensor) -> None:
        for a in self._acts():
            w = self.what
            if w == "add to a non-empty dict":
                a.register_forward_pre_hook(_times)
            elif w == "replace under the same key":
                (k,) = a._forward_pre_hooks
                a._forward_pre_hooks[k] = _times
            elif w == "prepend":
                a.register_forward_pre_hook(_times, prepend=True)
            elif w == "reorder":
                (k,) = a._forward_pre_hooks
                a.register_forward_pre_hook(_times)
                a._forward_pre_hooks.move_to_end(k)  # now _times then _plus
            elif w == "with_kwargs":
                a.register_forward_pre_hook(_kw_plus, with_kwargs=True)
            elif w == "always_call":
                a.register_forward_hook(_fwd_sq, always_call=True)
            elif w == "dict replaced":
                new = OrderedDict()
                new[next(iter(a._forward_pre_hooks))] = _times
                a.__dict__["_forward_pre_hooks"] = new
            elif w == "full backward hook":
                a.register_full_backward_hook(_grad_twice)
            elif w == "backward pre-hook":
                a.register_full_backward_pre_hook(_grad_out_twice)
            elif w == "dict replaced by an empty one":
                a.__dict__["_forward_pre_hooks"] = OrderedDict()
            else:
                raise AssertionError(w)


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize(
    "what",
    [
        "add to a non-empty dict",
        "replace under the same key",
        "prepend",
        "reorder",
        "with_kwargs",
        "always_call",
        "dict replaced",
        "dict replaced by an empty one",
        "full backward hook",
        "backward pre-hook",
    ],
)
def test_hook_games_on_a_held_module_in_the_window(what, preservation):
    assert_exact(lambda: HookGames(what), SEGS2, preservation, min_replays=4)


class SeqGames(Stack):
    """Each block's held activation is an ``nn.Sequential`` (a gain); in the window a module is
    appended to it, or its only one is replaced, or deleted (``what``); each forward
    rebuilds it as it was."""

    def __init__(self, what: str) -> None:
        super().__init__([_held(nn.Sequential(Gain())), _held(nn.Sequential(Gain()))])
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            seq = b.act()
            g = seq._modules.get("0")
            seq._modules.clear()
            seq.add_module("0", g if isinstance(g, Gain) else b.__dict__["gain0"])
            b.__dict__["gain0"] = seq[0]
        return super().forward(x)

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            seq = b.act()
            if self.what == "append":
                seq.append(nn.Tanh())
            elif self.what == "replace":
                seq[0] = nn.Sigmoid()
            elif self.what == "delete":
                del seq[0]


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize("what", ["append", "replace", "delete"])
def test_a_held_modules_submodules_changed_in_the_window(what, preservation):
    assert_exact(lambda: SeqGames(what), SEGS2, preservation, min_replays=4)


# ------------------------------------------------------------------------------ 3. registry
def _count(m: nn.Module) -> int:
    entry = slots._MODEL_MODULES.get(id(m))
    return entry[1] if entry is not None and entry[0]() is m else 0


def test_two_engines_on_models_sharing_a_module_count_it():
    shared = nn.Linear(D, D)
    a = Stack([nn.Sequential(shared), nn.Linear(D, D)])
    b = Stack([nn.Linear(D, D), nn.Sequential(shared)])
    ea = lr.install(a, SEGS2)
    eb = lr.install(b, SEGS2)
    try:
        assert _count(shared) == 2 and not is_holder(shared)
        ea.uninstall()
        assert _count(shared) == 1 and not is_holder(shared)
        b(torch.randn(2, D)).sum().backward()
    finally:
        eb.uninstall()
        if ea.model is not None and _count(shared) == 2:  # (only if the first uninstall raised)
            ea.uninstall()
    assert _count(shared) == 0 and is_holder(shared)
    assert all(_count(m) == 0 for m in [*a.modules(), *b.modules()])


class AddedAfterInstall(Stack):
    """A gain activation added to the root with ``add_module`` after install (registered in the
    model, not in the registry), held by both blocks in a dict and annealed in the window."""

    def __init__(self) -> None:
        super().__init__([Uses(), Uses()])
        for b in self.blocks:
            b.__dict__["acts"] = {"act": nn.Identity()}

    def adopt(self) -> None:
        g = Gain()
        self.add_module("late", g)
        for b in self.blocks:
            b.__dict__["acts"]["act"] = g

    def after(self, h: torch.Tensor) -> None:
        if "late" in self._modules:
            self.late.gain *= 0.9


def _adopt_at(k: int):
    def schedule(model: nn.Module, step: int) -> None:
        if step == k:
            model.adopt()

    return schedule


@pytest.mark.parametrize("preservation", PRES)
def test_a_submodule_added_after_install_and_held_is_put_back(preservation):
    assert_exact(
        AddedAfterInstall, SEGS2, preservation, steps=7, schedule=_adopt_at(2), min_replays=4
    )


def _drop_a_model_sharing(act: nn.Module) -> None:
    """Model A (installed, never uninstalled) and model B (installed, then uninstalled) both
    register ``act``; A and its engine are dropped (garbage, never uninstalled)."""
    a = nn.Sequential(nn.Linear(D, D), nn.Sequential(act))
    b = nn.Sequential(nn.Linear(D, D), nn.Sequential(act))
    ea, eb = lr.install(a, ["0"]), lr.install(b, ["0"])
    a(torch.randn(2, D)).sum().backward()
    wa = weakref.ref(a)
    del a, ea
    gc.collect()
    assert wa() is None  # (A is gone: nothing but the registry remembers it)
    eb.uninstall()


#: (failed at db61581: a dropped model's counts stayed in the registry for good; the model's
#: finalizer drops them now)


def test_a_model_dropped_without_uninstall_leaves_no_registration():
    gc.collect()
    before = len(slots._MODEL_MODULES)
    act = Gain()
    _drop_a_model_sharing(act)
    gc.collect()
    assert is_holder(act), "a module no live model registers still reads as registered"
    assert len(slots._MODEL_MODULES) == before, "registrations of the dropped model remain"


#: (the hook cases failed at db61581, silently: a module registered outside the segment that
#: calls it had its hook dicts neither captured nor traced; a probe now traces the hook dicts
#: nn.Module.__call__ reads, and a dropped or removed model's registrations no longer hide a
#: held module)


def _hook_cases() -> list:
    out = []
    for kind in ("annealed", "pre-hook added", "hook dict replaced"):
        for other in (
            "dropped",
            "installed",
            "this model's root",
            "removed after install",
            "the other segment",
        ):
            out.append(pytest.param(kind, other, id=f"{kind}-{other}"))
    return out


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize("kind,other", _hook_cases())
def test_a_module_another_model_registered_is_put_back_when_held(kind, other, preservation):
    """The activations the dropped model registered, held by a third model in dicts and
    annealed (or hooked) in the window: exact (whether they read as registered or not)."""
    factories = {
        "annealed": lambda: AnnealsHeldShared(Gain()),
        "pre-hook added": lambda: HookGames("add to a non-empty dict"),
        "hook dict replaced": lambda: HookGames("dict replaced"),
    }
    model = _fresh(factories[kind])
    if other in ("this model's root", "removed after install"):  # (outside the segments)
        model.acts = nn.ModuleList([b.act() for b in model.blocks])
    if other == "the other segment":  # (block 0's activation registered in block 1, and back)
        model.blocks[1].other_act = model.blocks[0].act()
        model.blocks[0].other_act = model.blocks[1].act()
    ref = copy.deepcopy(model)
    others = []
    if other == "dropped":
        for b in model.blocks:
            _drop_a_model_sharing(b.act())
    elif other == "installed":  # (a second model registers them, installed for the run)
        second = nn.Sequential(nn.Linear(D, D), nn.Sequential(*[b.act() for b in model.blocks]))
        others.append(lr.install(second, ["0"]))
    engine = lr.install(model, SEGS2, preservation=preservation)
    if other == "removed after install":  # (registered at install, no model's module since)
        del model.acts, ref.acts
    g_ref = _train(ref, 6)
    try:
        g_rep = _train(model, 6, engine=engine)
        replays = sum(s["replays"] for s in engine.summary().values())
    finally:
        engine.uninstall()
        for e in others:
            e.uninstall()
    assert_same_grads(g_ref, g_rep, preservation)
    assert_same_state(_observable(ref), _observable(model), preservation)
    assert [b.act().gain for b in ref.blocks] == [b.act().gain for b in model.blocks]
    assert replays >= 4


class AnnealsHeldShared(Stack):
    def __init__(self, act: nn.Module) -> None:
        super().__init__([_held(act), _held(act)])

    def after(self, h: torch.Tensor) -> None:
        self.blocks[0].act().gain *= 0.9


class GainBlock(nn.Module):
    """A block with a linear layer and a gain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.gain)


class _SegHeld(nn.Module):
    """Model A, whose segment ``blocks.0`` is a gain block, and model B, whose block 0 holds
    that same block in a dict (A's segment, called inside B's segment) and anneals its gain in
    B's window. (A's block is trained by A's loss and by B's.)"""

    def __init__(self) -> None:
        super().__init__()
        self.a = Stack([GainBlock(), GainBlock()])
        self.b = Stack([_held(self.a.blocks[0]), _held(Gain())])

        def after(h: torch.Tensor, b=self.b) -> None:
            b.blocks[0].act().gain *= 0.9

        self.b.__dict__["after"] = after

    def __deepcopy__(self, memo: dict) -> "_SegHeld":
        torch.manual_seed(0)
        new = _SegHeld()
        new.load_state_dict(self.state_dict())
        return new


def _train_ab(pair: _SegHeld, steps: int) -> list[dict]:
    opt = torch.optim.SGD(pair.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(5)
    grads = []
    for step in range(steps):
        x = torch.randn(4, D, generator=data)
        torch.manual_seed(400 + step)
        opt.zero_grad(set_to_none=True)
        pair.b(x).pow(2).mean().backward()
        pair.a(x).pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in pair.named_parameters() if p.grad is not None})
        opt.step()
    return grads


#: (failed at db61581 with a ReplayConfigError that blamed the model's own checkpointing: a
#: segment inside another engine's segment now runs plain, part of the outer one)


@pytest.mark.parametrize("preservation", PRES)
def test_another_engines_segment_held_and_annealed_in_this_window(preservation):
    base = _fresh(_SegHeld)
    ref, pair = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train_ab(ref, 6)
    engines = [lr.install(m, SEGS2, preservation=preservation) for m in (pair.a, pair.b)]
    try:
        g_rep = _train_ab(pair, 6)
        replays = [sum(s["replays"] for s in e.summary().values()) for e in engines]
    except lr.ReplayConfigError as exc:  # (a refusal is fine if it names the real cause)
        assert re.search(r"another (engine|installed model)", str(exc)), str(exc)
        return
    finally:
        for e in reversed(engines):
            e.uninstall()
    assert_same_grads(g_ref, g_rep, preservation)
    assert_same_state(_observable(ref), _observable(pair), preservation)
    assert ref.a.blocks[0].gain == pair.a.blocks[0].gain
    assert min(replays) >= 4, replays
    assert type(pair.a.blocks[0]) is GainBlock


# ---------------------------------------------------- 4. nested engines: a teacher mid-window
class Teacher(Stack):
    def __init__(self) -> None:
        super().__init__([_held(Gain()), _held(Gain())])
        self.gain_mod = Gain()  # registered: read by block 0's activation through a dict

    def after(self, h: torch.Tensor) -> None:
        self.gain_mod.gain *= 0.95
        for b in self.blocks:
            b.act().gain *= 0.9


class Student(Uses):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.__dict__["teacher"](x)
        return x + torch.tanh(self.lin(x)) * self.__dict__["teacher"].gain_mod.gain + 0.1 * t.sum()


class StudentStack(Stack):
    def __init__(self, teacher: Teacher) -> None:
        super().__init__([Student(), Student()])
        for b in self.blocks:
            b.__dict__["teacher"] = teacher

    def after(self, h: torch.Tensor) -> None:
        self.blocks[0].__dict__["teacher"].gain_mod.gain *= 0.9


class _Both(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = Teacher()
        self.__dict__["student"] = StudentStack(self.teacher)

    def __deepcopy__(self, memo: dict) -> "_Both":
        new = _Both.__new__(_Both)
        nn.Module.__init__(new)
        new.teacher = copy.deepcopy(self.teacher, memo)
        new.__dict__["student"] = copy.deepcopy(self.__dict__["student"], memo)
        return new


def _train_both(both: _Both, steps: int) -> list[dict]:
    s, t = both.__dict__["student"], both.teacher
    opt = torch.optim.SGD([*s.parameters(), *t.parameters()], lr=0.05)
    data = torch.Generator().manual_seed(7)
    grads = []
    for step in range(steps):
        x = torch.randn(4, D, generator=data)
        torch.manual_seed(300 + step)
        opt.zero_grad(set_to_none=True)
        s(x).pow(2).mean().backward()  # (the teacher runs mid-window, under no_grad)
        t(x).pow(2).mean().backward()  # (then its own step, its own windows)
        g = {f"s.{k}": p.grad.clone() for k, p in s.named_parameters() if p.grad is not None}
        g.update({f"t.{k}": p.grad.clone() for k, p in t.named_parameters() if p.grad is not None})
        grads.append(g)
        opt.step()
    return grads


@pytest.mark.parametrize("preservation", PRES)
def test_a_teacher_with_its_own_engine_inside_the_students_window(preservation):
    base = _fresh(_Both)
    ref, both = copy.deepcopy(base), copy.deepcopy(base)
    assert ref.__dict__["student"].blocks[0].__dict__["teacher"] is ref.teacher
    g_ref = _train_both(ref, 6)
    classes = [type(m) for m in [*both.modules(), *both.__dict__["student"].modules()]]
    et = lr.install(both.teacher, SEGS2, preservation=preservation)
    es = lr.install(both.__dict__["student"], SEGS2, preservation=preservation)
    try:
        g_rep = _train_both(both, 6)
        replays = [sum(s["replays"] for s in e.summary().values()) for e in (et, es)]
    finally:
        es.uninstall()
        et.uninstall()
    assert_same_grads(g_ref, g_rep, preservation)
    for k in ("teacher",):
        assert_same_state(_observable(getattr(ref, k)), _observable(getattr(both, k)), k)
    assert_same_state(
        _observable(ref.__dict__["student"]), _observable(both.__dict__["student"]), "student"
    )
    assert min(replays) >= 4, replays
    assert [type(m) for m in [*both.modules(), *both.__dict__["student"].modules()]] == classes
    assert all(_count(m) == 0 for m in both.modules())


# ------------------------------------------------------------------------ 5. unsubclassable
class MetaFinal(nn.Module, metaclass=FinalMeta):
    __final__ = True

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.gain)


class MetaFinalGain(nn.Module, metaclass=FinalMeta):
    __final__ = True

    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * self.gain)


class _Plugin(nn.Module):
    """A plugin base: each subclass registers itself by name; a duplicate name raises (the
    swapped subclass keeps the name of the class it swaps)."""

    REGISTRY: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__name__ in _Plugin.REGISTRY:
            raise TypeError(f"plugin {cls.__name__!r} already registered")
        _Plugin.REGISTRY[cls.__name__] = cls


class PluginBlock(_Plugin):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.gain)


class _LastWins(nn.Module):
    """A plugin base whose registry keeps the last class of a name (no error)."""

    REGISTRY: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _LastWins.REGISTRY[cls.__name__] = cls


class LastWinsBlock(_LastWins):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def test_a_plugin_class_refusing_a_duplicate_name_installs_and_keeps_its_registry():
    """(PluginBlock was refused by name from 4f59a0c: its ``__init_subclass__`` raises on the
    swapped subclass's name. The subclasses are made without calling it now.)"""
    before = dict(_Plugin.REGISTRY)
    assert_exact(lambda: Stack([nn.Linear(D, D), PluginBlock()]), SEGS2, "auto", min_replays=2)
    assert _Plugin.REGISTRY == before


@pytest.mark.parametrize("cls", [MetaFinal], ids=lambda c: c.__name__)
def test_a_segment_class_refusing_subclasses_another_way_is_refused_by_name(cls):
    model = Stack([nn.Linear(D, D), cls()])
    classes = [type(m) for m in model.modules()]
    with pytest.raises(lr.ReplayConfigError, match=r"segment 'blocks.1'.*subclass"):
        lr.install(model, SEGS2)
    assert [type(m) for m in model.modules()] == classes
    assert all(_count(m) == 0 for m in model.modules())


#: (a strict xfail until attach._Untouched: the registry mapped 'LastWinsBlock' to the swapped
#: subclass after install, and still after uninstall)


_PLUGINS: dict = {}  # a module-level registry by name, as plugin systems keep one


class _Counted(nn.Module):
    """A base that counts, lists and registers (at module level) its subclasses."""

    COUNT = 0
    ALL: list = []

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _Counted.COUNT += 1
        _Counted.ALL.append(cls)
        _PLUGINS[cls.__name__] = cls


class CountedBlock(_Counted):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.__dict__["gain"] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) * self.__dict__["gain"])


class OutsideCounted(Stack):
    """Counted blocks read a counted module outside them (the probe traces its reads through a
    subclass of its class too)."""

    def __init__(self) -> None:
        super().__init__([CountedBlock(), CountedBlock()])
        self.src = CountedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.src.__dict__["gain"]


def test_the_class_swap_leaves_a_users_subclass_registry_alone():
    model = Stack([LastWinsBlock(), LastWinsBlock()])
    engine = lr.install(model, SEGS2)
    try:
        model(torch.randn(2, D)).sum().backward()
    finally:
        engine.uninstall()
    assert _LastWins.REGISTRY["LastWinsBlock"] is LastWinsBlock
    assert list(_LastWins.REGISTRY) == ["LastWinsBlock"]


@pytest.mark.parametrize("window", ["root", "manual"])
def test_the_class_swaps_leave_a_counter_a_list_and_a_module_registry_alone(window):
    """Segments, the root (``window="root"``) and the outside modules a probe traces are all
    subclassed: none of it is counted, listed or registered by the user's base."""
    before = (_Counted.COUNT, list(_Counted.ALL), dict(_PLUGINS))
    assert _PLUGINS["CountedBlock"] is CountedBlock
    model = OutsideCounted()
    engine = lr.install(model, SEGS2, window=window)
    try:
        for _ in range(3):
            if window == "manual":
                with engine.window():
                    model(torch.randn(2, D)).sum().backward()
            else:
                model(torch.randn(2, D)).sum().backward()
        assert sum(s["replays"] for s in engine.summary().values()) >= 2
    finally:
        engine.uninstall()
    assert (_Counted.COUNT, _Counted.ALL, _PLUGINS) == before


class HeldFinal(Stack):
    """A held activation whose class refuses subclasses (``kind``: a metaclass, or a registry
    by name), annealed in the window; or the same as a registered module outside the segments
    that the blocks read through a dict."""

    def __init__(self, kind: str, where: str) -> None:
        act = MetaFinalGain()
        super().__init__([_held(act), _held(act)])
        if where == "registered outside":
            self.act = act

    def after(self, h: torch.Tensor) -> None:
        self.blocks[0].act().gain *= 0.9


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize("where", ["held", "registered outside"])
def test_a_metaclass_final_module_annealed_in_the_window(where, preservation):
    assert_exact_held(lambda: HeldFinal("meta", where), lambda m: [m.blocks[0].act()], preservation)


def test_the_replay_strategy_names_a_metaclass_final_segment(tmp_path):
    import lightning as L

    from tests.helpers.lit_hazards import DIM, loader, trainer

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(DIM, DIM), _MetaFinalDim()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

        def training_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def configure_replay_segments(self):
            return ["blocks.0", "blocks.1"]

    class _MetaFinalDim(nn.Module, metaclass=FinalMeta):
        __final__ = True

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x):
            return x + self.lin(x)

    t0 = time.perf_counter()
    with pytest.raises(lr.ReplayConfigError, match=r"'blocks.1'"):
        trainer(tmp_path, strategy="replay", max_steps=2).fit(Lit(), loader(2))
    assert time.perf_counter() - t0 < 20


# ------------------------------------------------------------ 6. what _may_hold_tensor walks
class _Raises:
    """A holder whose property raises."""

    def __init__(self) -> None:
        self.gain = 1.0

    @property
    def boom(self) -> float:
        raise RuntimeError("do not touch")


ODD = ["10,000 floats in a config", "a holder cycle", "a property that raises"]


class Odd(Uses):
    """A block holding a held activation and (``odd``) a config with a 10,000-float list, a
    cycle of holders (one of which holds the activation), or a holder with a raising property."""

    def __init__(self, odd: str | None) -> None:
        super().__init__()
        act = Gain()
        self.__dict__["acts"] = {"act": act}
        if odd == ODD[0]:
            self.__dict__["cfg"] = types.SimpleNamespace(table=[0.5] * 10_000)
        elif odd == ODD[1]:
            a, b = types.SimpleNamespace(), types.SimpleNamespace()
            a.b, b.a, a.act = b, a, act
            self.__dict__["cfg"] = types.SimpleNamespace(cyc=a)
        elif odd == ODD[2]:
            self.__dict__["raiser"] = _Raises()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        if "cfg" in d and hasattr(d["cfg"], "table"):
            x = x * d["cfg"].table[0] * 2
        if "raiser" in d:
            x = x * d["raiser"].gain
        return super().forward(x)


class AnnealsOdd(Stack):
    def __init__(self, odd: str | None) -> None:
        super().__init__([Odd(odd), Odd(odd)])

    def after(self, h: torch.Tensor) -> None:
        for b in self.blocks:
            b.act().gain *= 0.9
            if "raiser" in b.__dict__:
                b.__dict__["raiser"].gain *= 0.95


def _step_time(odd: str | None, steps: int = 10) -> float:
    torch.manual_seed(0)
    model = AnnealsOdd(odd)
    engine = lr.install(model, SEGS2)
    try:
        x = torch.randn(4, D)
        model(x).sum().backward()  # (the probe)
        model(x).sum().backward()
        # this process's CPU time: the suite's other worker does not count in it
        t0 = time.process_time()
        for _ in range(steps):
            model(x).sum().backward()
        return (time.process_time() - t0) / steps
    finally:
        engine.uninstall()


@pytest.mark.parametrize("preservation", PRES)
@pytest.mark.parametrize("odd", ODD)
def test_odd_holders_are_put_back(odd, preservation):
    assert_exact(lambda: AnnealsOdd(odd), SEGS2, preservation, min_replays=4)


#: (the 10,000 floats failed at db61581: ~12 ms a step in a config, ~20 ms as a plain attribute,
#: against ~0.85 ms without, every item asked whether it is a generator at every forward; a
#: generator scan asks each item type once now: 3.1 ms against 0.86, under load; at 5d10fff,
#: 14.1 and 15.8 ms against 3.6 and 2.7 in full runs on 2 workers: ``holders_in`` asked each of
#: the 10,000 items whether it is a plain value at every forward (82,600 calls in 10 steps);
#: it asks each item type once now: 5.6 ms against 2.2, alone)


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(ODD[0], id="floats"),
        *[pytest.param(o, id=o.split()[1]) for o in ODD[1:]],
    ],
)
def test_odd_holders_do_not_blow_up_the_step_time(odd):
    plain = min(_step_time(None) for _ in range(2))
    slow = min(_step_time(odd) for _ in range(2))
    assert slow < 3 * plain + 0.003, (slow, plain)


# ------------------------------------------------------- 7. past the holder walk's count
class _Wide(nn.Module):
    """A held module tree of ``n`` identities and, last in breadth-first order, a gain
    activation (a held teacher with many modules)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[nn.Identity() for _ in range(n)], Gain())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.seq(h)


class AnnealsWide(Stack):
    def __init__(self, n: int) -> None:
        w = _Wide(n)
        super().__init__([_held(w), _held(w)])

    def after(self, h: torch.Tensor) -> None:
        self.blocks[0].act().seq[-1].gain *= 0.9


#: (4,200 was a strict xfail until this test's warning: the annealed activation, past
#: _capture_holders' count (_CONTAINER_LIMIT = 4096 holders), was not captured and nothing
#: said so: wrong gradients from step 1, silently)


@pytest.mark.parametrize("n", [100, 4200])
def test_a_held_module_tree_past_the_walks_count(n):
    """Exact within the holder walk's count; past it, what is left uncaptured is said, once,
    naming the attribute and what to do."""
    if n < 4096:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # nothing to say
            assert_exact(lambda: AnnealsWide(n), SEGS2, "auto", steps=4, min_replays=4)
        return
    torch.manual_seed(0)
    model = AnnealsWide(n)
    with pytest.warns(UserWarning, match=r"reaches more than 4096 holders .* not captured") as got:
        engine = lr.install(model, SEGS2)
        try:
            for _ in range(3):
                model(torch.randn(2, D)).sum().backward()
        finally:
            engine.uninstall()
    said = [w for w in got if "4096 holders" in str(w.message)]
    assert "_Wide" in str(said[0].message) or "act" in str(said[0].message), said[0].message
    assert "preservation='retain'" in str(said[0].message)
