"""The guard watches what a segment reads from outside its modules.

A block may read a flag that lives elsewhere: on the root, on a config the root holds, in a
dict on the root, on a sibling module, on another segment, at module level, on a class whose
default an instance attribute later shadows. The flag gates a read of state the probe never saw
(the root's bank, written in place after the blocks): a contract learned with the flag off
replays with the bank's new bytes once the flag is on. Each case flips the flag between steps
(after the probe) and must train bit for bit as plain PyTorch, with the flip re-probed at the
next forward (a guard record at that step, and no other).

The last cases are the other side: an outside value that changes every step but is continuous
(an annealed temperature) is re-probed once and then put back by the replay, a flag that comes
back to a value seen before costs nothing, and an attribute of the root the blocks never read
raises nothing.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

from tests.test_exactness import D, SEGS2, Stack, assert_exact

#: module-level flags a block reads (module_globals.globals_read finds them)
USE_BANK = False
FLAGS = types.SimpleNamespace(on=False)
SETTINGS = {"bank": False}


class Gate(nn.Module):
    """A module outside every segment that holds a flag (a sibling of the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False


class WithDefault(nn.Module):
    """A root whose flag is a class default until an instance attribute shadows it."""

    use_bank = False


def _guard_steps(records) -> list[int]:
    return sorted(r.step for r in records if r.check == "guard")


class Root(Stack):
    """Two :class:`Reader` blocks, a bank the step writes in place after them, and every place
    a flag can live outside the blocks."""

    def __init__(self, where: str) -> None:
        super().__init__([Reader(where, 0), Reader(where, 1)])
        self.register_buffer("bank", torch.randn(4, D))
        self.use_bank = False
        self.cfg = types.SimpleNamespace(use_bank=False, inner=types.SimpleNamespace(on=False))
        self.flags = {"bank": False}
        self.opts = [False]
        self.gate = Gate()
        self._private = False
        self.temp = 1.0
        self.counter = 0
        for b in self.blocks:
            b.root = [self]  # (a plain list: not a submodule)

    @property
    def bank_on(self) -> bool:
        return self._private

    def after(self, h):
        with torch.no_grad():
            self.bank.mul_(0.5).add_(h.detach().mean(0))
        self.counter += 1  # read by no block: never a reason to re-probe


class Reader(nn.Module):
    def __init__(self, where: str, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.where = where
        self.index = index

    def flag(self) -> bool:
        r = self.root[0]
        w = self.where
        if w == "root attribute":
            return r.use_bank
        if w == "root attribute created later":
            return getattr(r, "late_flag", False)
        if w == "root holder":
            return r.cfg.use_bank
        if w == "holder in a holder":
            return r.cfg.inner.on
        if w == "root dict":
            return r.flags["bank"]
        if w == "root list":
            return r.opts[0]
        if w == "sibling module":
            return r.gate.on
        if w == "another segment":
            return r.blocks[1 - self.index].__dict__.get("peer_on", False)
        if w == "property":
            return r.bank_on
        if w == "class default shadowed":
            return r.defaults.use_bank
        if w == "module global":
            return USE_BANK
        if w == "module-level holder":
            return FLAGS.on
        if w == "module-level dict":
            return SETTINGS["bank"]
        if w == "annealed":
            return False
        raise AssertionError(w)

    def forward(self, x):
        r = self.root[0]
        h = self.lin(x)
        if self.where == "annealed":
            h = h * r.temp  # (inside tanh: what autograd saves depends on it)
        h = torch.tanh(h)
        if self.flag():
            bank = r.bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


def _turn_on(model: Root, where: str) -> None:
    global USE_BANK
    if where == "root attribute":
        model.use_bank = True
    elif where == "root attribute created later":
        model.late_flag = True
    elif where == "root holder":
        model.cfg.use_bank = True
    elif where == "holder in a holder":
        model.cfg.inner.on = True
    elif where == "root dict":
        model.flags["bank"] = True
    elif where == "root list":
        model.opts[0] = True
    elif where == "sibling module":
        model.gate.on = True
    elif where == "another segment":
        for b in model.blocks:
            b.peer_on = True
    elif where == "property":
        model._private = True
    elif where == "class default shadowed":
        model.defaults.use_bank = True  # an instance attribute over the class's default
    elif where == "module global":
        USE_BANK = True
    elif where == "module-level holder":
        FLAGS.on = True
    elif where == "module-level dict":
        SETTINGS["bank"] = True
    else:
        raise AssertionError(where)


PLACES = [
    "root attribute",
    "root attribute created later",
    "root holder",
    "holder in a holder",
    "root dict",
    "root list",
    "sibling module",
    "another segment",
    "property",
    "class default shadowed",
    "module global",
    "module-level holder",
    "module-level dict",
]


@pytest.fixture(autouse=True)
def _module_flags_off():
    """Module-level flags back off around each test (both copies of a model read them)."""
    global USE_BANK
    USE_BANK, FLAGS.on, SETTINGS["bank"] = False, False, False
    yield
    USE_BANK, FLAGS.on, SETTINGS["bank"] = False, False, False


def _make(where: str):
    def make():
        m = Root(where)
        m.defaults = WithDefault()  # (a submodule outside the blocks)
        return m

    return make


def _flip_at(where: str, step: int = 3, module_level: bool = False):
    """A schedule: the flag on at ``step`` in the model's own copy. Module-level flags are
    shared by the plain copy and the replayed one: set on and back off around each run by
    the schedule's step (the two runs step one after the other)."""

    def schedule(model, s):
        global USE_BANK
        if s == 0 and module_level:
            USE_BANK, FLAGS.on, SETTINGS["bank"] = False, False, False
        if s == step:
            _turn_on(model, where)

    return schedule


@pytest.mark.parametrize("where", PLACES)
def test_outside_flag_flipped_between_steps_is_re_probed(tokens, where):
    module_level = where.startswith("module")
    _, records = assert_exact(
        _make(where), SEGS2, "auto", schedule=_flip_at(where, module_level=module_level)
    )
    assert _guard_steps(records) == [4, 4], records


def test_outside_flag_back_to_a_value_seen_costs_nothing(tokens):
    """On at step 3, off at 5, on at 7: re-probed at the two new values only."""

    def schedule(model, s):
        if s in (3, 7):
            model.use_bank = True
        elif s == 5:
            model.use_bank = False

    _, records = assert_exact(_make("root attribute"), SEGS2, "auto", steps=9, schedule=schedule)
    assert _guard_steps(records) == [4, 4], records


def test_outside_value_annealed_between_steps_is_re_probed_once(tokens):
    def schedule(model, s):
        if s >= 2:
            model.temp *= 0.9

    _, records = assert_exact(_make("annealed"), SEGS2, "auto", steps=7, schedule=schedule)
    assert len(_guard_steps(records)) <= 2, records  # once per block at most, then replayed


def test_outside_attribute_no_block_reads_raises_nothing(tokens):
    """``counter`` on the root changes every step; the blocks never read it."""
    _, records = assert_exact(_make("root attribute"), SEGS2, "auto", steps=6)
    assert _guard_steps(records) == [], records


# ------------------------------------------------------------------ inside the probe's window
class _Cfg:
    """A config the blocks hold; the loss sets ``problem_type`` after them (as HF models do)."""

    def __init__(self) -> None:
        self.problem_type = None
        self.scale = 1.0


class ConfiguredBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.cfg = cfg
        self.mode = "plain"

    def forward(self, x):
        self.dtype_seen = x.dtype  # set before it is read: the forward's own
        h = torch.tanh(self.lin(x) * self.cfg.scale)
        return x + h if self.dtype_seen is torch.float32 else x


class Configured(Stack):
    def __init__(self, holder: str) -> None:
        cfg = _Cfg() if holder == "class" else types.SimpleNamespace(problem_type=None, scale=1.0)
        super().__init__([ConfiguredBlock(cfg), ConfiguredBlock(cfg)])
        self.cfg = cfg

    def after(self, h):
        self.cfg.problem_type = "regression"  # no block reads it
        for b in self.blocks:
            b.mode = "done"  # nor this


def test_fields_no_block_reads_set_in_the_probe_window_raise_nothing():
    """A traced config's field the loss sets in the probe's window, an attribute the forward
    sets before reading, a module attribute the step sets and no forward reads: no re-probe."""
    _, records = assert_exact(lambda: Configured("class"), SEGS2, "auto", steps=5)
    assert _guard_steps(records) == [], records


def test_an_untraced_holder_s_flags_are_all_preconditions():
    """A ``SimpleNamespace`` config cannot be traced: every flag of it the forward could
    reach is a precondition, so a field no block reads, set in the probe's window, costs one
    re-probe per block (exact), then nothing."""
    _, records = assert_exact(lambda: Configured("namespace"), SEGS2, "auto", steps=5)
    assert _guard_steps(records) == [2, 2], records


# ------------------------------------------------ once unseen: vars() and os.environ
class _UnseenReader(nn.Module):
    """Reads the flag by a path no attribute tracing sees: the root's ``__dict__`` item (the
    probe watches every attribute of a module whose ``__dict__`` the forward read), or an
    environment variable (``os.environ.get(KEY)`` with a constant key: an item watched)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.how = how

    def forward(self, x):
        r = self.root[0]
        h = torch.tanh(self.lin(x))
        if self.how == "vars":
            on = vars(r)["use_bank"]
        else:
            on = os.environ.get("LIGHTNING_REPLAY_TEST_BANK") == "1"
        if on:
            bank = r.bank.clone()
            h = h + torch.softmax(h @ bank.T, -1) @ bank
        return x + h


class _UnseenRoot(Stack):
    def __init__(self, how: str) -> None:
        super().__init__([_UnseenReader(how), _UnseenReader(how)])
        self.register_buffer("bank", torch.randn(4, D))
        self.use_bank = False
        for b in self.blocks:
            b.root = [self]

    def after(self, h):
        with torch.no_grad():
            self.bank.mul_(0.5).add_(h.detach().mean(0))


@pytest.mark.parametrize("how", ["vars", "environ"])
def test_a_flag_read_past_the_tracing_is_seen(how, monkeypatch):
    monkeypatch.delenv("LIGHTNING_REPLAY_TEST_BANK", raising=False)

    def schedule(model, s):
        if s == 0:
            os.environ.pop("LIGHTNING_REPLAY_TEST_BANK", None)
        if s == 3:
            model.use_bank = True
            os.environ["LIGHTNING_REPLAY_TEST_BANK"] = "1"

    assert_exact(lambda: _UnseenRoot(how), SEGS2, "auto", schedule=schedule)
