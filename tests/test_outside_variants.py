"""More ways a segment reads a flag from outside it (issue 33, past tests/test_adversary_outside.py).

Each case is one more of a kind that the outside-read mechanisms now cover, written against
plain PyTorch: a flag read from outside the segment's modules gates a read of the root's
``bank``, which the step writes in place after the blocks, and is flipped between steps (or
moves by itself). A contract learned with the flag off replays the bank's new bytes once it
is on, so a flip the guard misses gives wrong gradients; every case asserts bit-identical
gradients and state against plain PyTorch (``assert_exact``), with the version tags on and
off (``tokens``), and that a guard re-probed (the flip was seen, not lucky).

* class-level reads and code of modules outside the segment (``outside_reads``): a
  staticmethod of the root naming a module-level dict, a sibling's property reading its
  class's attribute, a cached property;
* what the bytecode scan follows (``module_globals``): a function three calls down, a forward
  pre-hook closing over a dict, a classmethod of the segment reading ``cls.FLAG``, a chain
  three attributes down, ``.get`` with a constant key on a module-level dict of 200 items;
* the guard's walk (``guards._walk``): a flag ten dicts deep, in a partial's keywords, a
  config's class attribute set on the class (the root's config, the block's own);
* numbers gating a branch after arithmetic (``outside_reads._derived``): a negation, a floor
  division, a modulo; a step counter in a config inside the root's config.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from tests.test_adversary_outside import Reader, Root, _run
from tests.test_exactness import D


def _guard_steps(records) -> list[int]:
    return sorted(r.step for r in records if r.check == "guard")


# ------------------------------------------------------ class-level reads of modules outside
GATES = {"bank": False}


class StaticReader(Reader):
    def flag(self, r):
        return r.gate()


class StaticRoot(Root):
    reader = StaticReader

    @staticmethod
    def gate():
        return GATES["bank"]


class Switch(torch.nn.Module):
    ON = False

    @property
    def on(self):
        return type(self).ON


class SiblingPropertyReader(Reader):
    def flag(self, r):
        return r.switch.on


class SiblingPropertyRoot(Root):
    reader = SiblingPropertyReader

    def __init__(self) -> None:
        super().__init__()
        self.switch = Switch()


class CachedReader(Reader):
    def flag(self, r):
        return r.use_bank_cached


class CachedRoot(Root):
    reader = CachedReader

    def __init__(self) -> None:
        super().__init__()
        self.use_bank = False

    @functools.cached_property
    def use_bank_cached(self):
        return self.use_bank


def _cached_on(model):
    model.__dict__["use_bank_cached"] = True  # what a cache reset and a new read leave


# -------------------------------------------------------------- code the scan follows
DEEP3 = {"bank": False}


def _d3():
    return DEEP3["bank"]


def _d2():
    return _d3()


def _d1():
    return _d2()


class ThreeCallsReader(Reader):
    def flag(self, r):
        return _d1()


class ThreeCallsRoot(Root):
    reader = ThreeCallsReader


def _hooked_reader(opts):
    class HookedReader(Reader):
        def __init__(self, index: int) -> None:
            super().__init__(index)
            self.register_forward_pre_hook(lambda m, a: setattr(m, "now", opts["bank"]))

        def flag(self, r):
            return self.now

    return HookedReader


HOOK_OPTS = {"bank": False}


class HookClosureRoot(Root):
    reader = _hooked_reader(HOOK_OPTS)


class ClsReader(Reader):
    FLAG = False

    @classmethod
    def enabled(cls):
        return cls.FLAG

    def flag(self, r):
        return self.enabled()


class ClsRoot(Root):
    reader = ClsReader


OPTS = types.SimpleNamespace(model=types.SimpleNamespace(sub=types.SimpleNamespace(bank=False)))


class ThreeAttrsReader(Reader):
    def flag(self, r):
        return OPTS.model.sub.bank


class ThreeAttrsRoot(Root):
    reader = ThreeAttrsReader


TABLE = {f"k{i}": i for i in range(200)} | {"bank": False}


class GetReader(Reader):
    def flag(self, r):
        return TABLE.get("bank", False)


class GetRoot(Root):
    reader = GetReader


# --------------------------------------------------------------------------- the walk
def _nested(levels: int) -> dict:
    d = {"bank": False}
    for _ in range(levels):
        d = {"inner": d}
    return d


class NestedDictReader(Reader):
    def flag(self, r):
        d = r.nested
        while "inner" in d:
            d = d["inner"]
        return d["bank"]


class NestedDictRoot(Root):
    reader = NestedDictReader

    def __init__(self) -> None:
        super().__init__()
        self.nested = _nested(10)


def _nested_on(model):
    d = model.nested
    while "inner" in d:
        d = d["inner"]
    d["bank"] = True


def _gate_kw(*, opts):
    return opts["bank"]


class PartialKwReader(Reader):
    def flag(self, r):
        return r.gate_fn()


class PartialKwRoot(Root):
    reader = PartialKwReader

    def __init__(self) -> None:
        super().__init__()
        self.gate_fn = functools.partial(_gate_kw, opts={"bank": False})


class BankConfig:
    use_bank = False  # a class default, later set on the class


class RootCfgClassReader(Reader):
    def flag(self, r):
        return r.cfg.use_bank


class RootCfgClassRoot(Root):
    reader = RootCfgClassReader

    def __init__(self) -> None:
        super().__init__()
        self.cfg = BankConfig()


class OwnCfgClassReader(Reader):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.cfg = BankConfig()

    def flag(self, r):
        return self.cfg.use_bank


class OwnCfgClassRoot(Root):
    reader = OwnCfgClassReader


# ------------------------------------------------------ numbers compared after arithmetic
class _Counting(Root):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.temp = 1.0

    def after(self, h):
        super().after(h)
        self.count += 1
        self.temp *= 0.9


def _counting(flag):
    class CaseReader(Reader):
        def flag(self, r):
            return flag(r)

    class CaseRoot(_Counting):
        reader = CaseReader

    return CaseRoot


class _Sched:
    def __init__(self) -> None:
        self.step = 0


class _Cfg:
    def __init__(self) -> None:
        self.sched = _Sched()


class NestedCfgReader(Reader):
    def flag(self, r):
        return r.cfg.sched.step >= 3


class NestedCfgRoot(Root):
    reader = NestedCfgReader

    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Cfg()

    def after(self, h):
        super().after(h)
        self.cfg.sched.step += 1


def _set(obj, name, value):
    return lambda model: setattr(obj, name, value)


def _item(d, key, value):
    return lambda model: d.__setitem__(key, value)


CASES = {
    # (root class, turn on (None: it moves by itself), reset before step 0)
    "staticmethod of the root reads a module dict": (
        StaticRoot,
        _item(GATES, "bank", True),
        _item(GATES, "bank", False),
    ),
    "sibling's property reads its class attribute": (
        SiblingPropertyRoot,
        _set(Switch, "ON", True),
        _set(Switch, "ON", False),
    ),
    "cached property of the root": (CachedRoot, _cached_on, None),
    "module function three calls down": (
        ThreeCallsRoot,
        _item(DEEP3, "bank", True),
        _item(DEEP3, "bank", False),
    ),
    "pre-hook closing over a dict": (
        HookClosureRoot,
        _item(HOOK_OPTS, "bank", True),
        _item(HOOK_OPTS, "bank", False),
    ),
    "classmethod of the segment reads cls.FLAG": (
        ClsRoot,
        _set(ClsReader, "FLAG", True),
        _set(ClsReader, "FLAG", False),
    ),
    "module-level config three attributes down": (
        ThreeAttrsRoot,
        _set(OPTS.model.sub, "bank", True),
        _set(OPTS.model.sub, "bank", False),
    ),
    ".get on a module dict of 201 items": (
        GetRoot,
        _item(TABLE, "bank", True),
        _item(TABLE, "bank", False),
    ),
    "flag ten dicts deep on the root": (NestedDictRoot, _nested_on, None),
    "root's config: class attribute set on the class": (
        RootCfgClassRoot,
        _set(BankConfig, "use_bank", True),
        _set(BankConfig, "use_bank", False),
    ),
    "block's config: class attribute set on the class": (
        OwnCfgClassRoot,
        _set(BankConfig, "use_bank", True),
        _set(BankConfig, "use_bank", False),
    ),
    "partial's keyword dict": (
        PartialKwRoot,
        lambda m: m.gate_fn.keywords["opts"].__setitem__("bank", True),
        None,
    ),
    "negated temperature (-temp > -0.7)": (_counting(lambda r: -r.temp > -0.7), None, None),
    "floor division (count // 2 >= 2)": (_counting(lambda r: r.count // 2 >= 2), None, None),
    "modulo (count % 4 == 3)": (_counting(lambda r: r.count % 4 == 3), None, None),
    "counter in a config inside the root's config": (NestedCfgRoot, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outside_flag_variant_is_exact_and_re_probed(tokens, case):
    root, turn_on, reset = CASES[case]
    try:
        _, records = _run(root, turn_on or (lambda m: None), reset=reset and (lambda m: reset(m)))
    finally:
        if reset is not None:
            reset(None)
    assert _guard_steps(records), "exact, but no guard saw the flip"


def test_a_walk_cut_short_names_the_segment(recwarn):
    """Past the walk's limits the guard warns once, naming the segment and the path."""
    import lightning_replay as lr

    class Deep(NestedDictRoot):
        def __init__(self) -> None:
            super().__init__()
            self.nested = _nested(20)

    model = Deep()
    engine = lr.install(model, ["blocks.0", "blocks.1"])
    try:
        for _ in range(2):
            model(torch.randn(4, D)).sum().backward()
    finally:
        engine.uninstall()
    text = [str(w.message) for w in recwarn if "does not watch" in str(w.message)]
    assert text and "blocks.0" in text[0] and "nested" in text[0], text
