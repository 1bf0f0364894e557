"""The preconditions of a replay contract, checked at every forward.

A contract is learned by watching a probe step; it holds only while the segment behaves as it
did then. What steers that behaviour and is reachable from the segment's modules is
fingerprinted at each forward, cheaply (identities and plain values, no tensor bytes):

* the training flag of each module (a BatchNorm unfrozen later, a Dropout in eval at step 0);
* the registered hooks (module and global), and the submodules;
* the identity of every parameter, buffer (and its storage: ``resize_``, ``.data =``) and
  tensor attribute, and of every other attribute
  object (a generator replaced by a new one, a tensor rebound instead of written in place,
  parameters substituted by ``torch.func.functional_call``);
* the value of every plain attribute (a dropout ``p`` warming up from 0, an enum mode).

When the fingerprint shows something new, that forward is re-probed (retained and watched, so
exact by construction) and the contract is extended. Fields that vary continuously (identities,
numbers) are re-probed once and then left to the replay, which puts the forward's objects and
values back (:mod:`lightning_replay.slots`); discrete fields (flags, hooks, strings, enums) are
re-probed at each value not seen before, so a mode that comes back costs nothing.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import nn
from torch.nn.modules import module as _module

from lightning_replay._compat import dict_version
from lightning_replay.slots import MISSING, MODULE_INTERNALS, identities, is_scalar, slot_token

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def _hooks_token(dicts: list) -> tuple:
    return tuple((len(d), next(reversed(d), None)) if d else 0 for d in dicts)


def _storage_ptr(t: Any) -> int:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _identity_signature(modules: list[nn.Module], exact: bool = False) -> tuple:
    """Which object every slot holds (and each buffer's storage, the submodules, the hooks),
    cheaply: if it is the same as at the last forward, no field can have changed. The plain
    objects behind its ids are kept alive by the guard (:meth:`Guard._settle`), so equal ids
    are the same objects.

    Each module's slots and submodules stand as the version tags of their dicts
    (:func:`~lightning_replay.slots.slot_token`), a few C calls, unless ``exact`` or the
    interpreter has none; then as :func:`~lightning_replay.slots.identities`. Two equal
    signatures of the first kind imply equal ones of the second; unequal tags can still hold
    the same objects (a slot written and put back), which the ``exact`` kind tells."""
    tags = dict_version is not None and not exact
    out = [_hooks_token([getattr(_module, h, {}) for h in _GLOBAL_HOOKS])]
    for m in modules:
        d = m.__dict__
        b = d["_buffers"]
        if b:
            try:  # plain strided buffers (nearly always): no per-buffer Python call
                # (a tensor's own data pointer moves with its storage's, without making a
                # storage object; an offset change alone goes on to the full fingerprint)
                ptrs = tuple([t.data_ptr() for t in b.values()])
            except (AttributeError, RuntimeError, NotImplementedError):  # None, sparse, wrapper
                ptrs = tuple(map(_storage_ptr, b.values()))
        else:
            ptrs = ()
        sub = d["_modules"]
        if (
            d.get("_forward_pre_hooks")
            or d.get("_forward_hooks")
            or d.get("_backward_pre_hooks")
            or d.get("_backward_hooks")
        ):
            hooks = _hooks_token([d.get(h) for h in _HOOK_DICTS])
        else:
            hooks = 0
        if tags:
            out.append((slot_token(d), ptrs, dict_version(sub), hooks))
        else:
            out.append((identities(d), ptrs, tuple(map(id, sub.values())) if sub else (), hooks))
    return tuple(out)


def fingerprint(modules: list[nn.Module], varying: set) -> dict[Hashable, Any]:
    """What the segment's behaviour may depend on, without the fields in ``varying``."""
    fp: dict[Hashable, Any] = {
        "global_hooks": _hooks_token([getattr(_module, h, {}) for h in _GLOBAL_HOOKS])
    }
    for i, m in enumerate(modules):
        d = m.__dict__
        fp[(i, "training")] = d.get("training")
        fp[(i, "hooks")] = _hooks_token([d.get(h) for h in _HOOK_DICTS])
        fp[(i, "modules")] = tuple(map(id, d["_modules"].values()))
        for k, v in d["_parameters"].items():
            key = (i, "p", k)
            if key not in varying:
                fp[key] = id(v)
        for k, v in d["_buffers"].items():
            key = (i, "b", k)
            if key not in varying:
                fp[key] = (id(v), _storage_ptr(v))  # a new storage is a new buffer
        for k, v in d.items():
            if k in MODULE_INTERNALS or k == "training":
                continue
            key = (i, "a", k)
            if key in varying:
                continue
            t = type(v)
            if isinstance(v, (list, dict, set)):
                continue  # put back by value at replay (subclasses too: an OrderedDict)
            fp[key] = (t, v) if is_scalar(v) else (t, id(v))
    return fp


def _discrete(key: Hashable, value: Any) -> bool:
    """Flags, hooks, module structure, strings and enums: each value seen is re-probed once."""
    if not isinstance(key, tuple) or len(key) == 2:
        return True
    if key[1] != "a" or value is _ABSENT:
        return False
    t, v = value
    return is_scalar(v) and not isinstance(v, (int, float, complex)) or t is bool


class Guard:
    """The fingerprint a segment's contract was learned under, and what it has learned varies.

    Example:
        >>> import torch
        >>> block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
        >>> g = Guard(list(block.modules()))
        >>> g.accept()
        >>> g.changed()
        []
        >>> block[1].p = 0.1      # a warm-up: re-probe once, then the replay restores p
        >>> g.changed()
        [(2, 'a', 'p')]
        >>> g.accept(); block[1].p = 0.2; g.changed()
        []
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.varying: set = set()
        self.seen: dict[Hashable, set] = {}
        self.base: dict[Hashable, Any] | None = None
        self._pending: list = []
        self._fast: tuple | None = None
        self._exact: tuple | None = None  # the identities behind ``_fast`` (version tags)
        self._alive: list = []  # the objects ``_exact`` names by id (see _settle)
        self._now: tuple | None = None
        #: per module, its last slot capture while steady (``capture_slots``'s ``last``); held
        #: here so that it lives and dies with the segment, never keeps a model alive
        self.captures: list = [MISSING] * len(modules)

    def take_tokens(self) -> list[tuple] | None:
        """Each module's :func:`~lightning_replay.slots.slot_token` as :meth:`changed` read
        them in this forward, once (``None`` if it has not run since the last take): the slot
        capture that follows in the same forward reuses them instead of reading every module's
        slots again."""
        now, self._now = self._now, None
        return None if now is None else [m[0] for m in now[1:]]

    def changed(self) -> list[Hashable]:
        """Fields that differ from every value the contract has seen (empty: replay on)."""
        fast = self._now = _identity_signature(self.modules)
        exact = None
        if self.base is not None:
            if fast == self._fast:
                self._pending = []
                return []  # the same objects in every slot as last time: nothing can differ
            if dict_version is not None and self._exact is not None:
                # tags moved: the same objects still (written and put back)? then settle on
                # the new tags; else ``exact`` is the signature the fingerprint below settles on
                exact = _identity_signature(self.modules, exact=True)
                if exact == self._exact:
                    self._fast = fast
                    self._pending = []
                    return []
        fp = fingerprint(self.modules, self.varying)
        base = self.base
        if base is None or fp == base:
            self._pending = []
            self._settle(fast, exact)
            return []
        new = []
        for key in fp.keys() | base.keys():
            v, b = fp.get(key, _ABSENT), base.get(key, _ABSENT)
            if v == b:
                continue
            if _discrete(key, v if v is not _ABSENT else b):
                if v in self.seen.get(key, ()):
                    continue
            new.append(key)
        if not new:
            self.base = fp  # a mode seen before came back
            self._settle(fast, exact)
        self._pending = [(k, fp.get(k, _ABSENT)) for k in new]
        return sorted(new, key=repr)

    def _settle(self, fast: tuple, exact: tuple | None = None) -> None:
        """``fast`` (read now) is the signature of a fingerprint the contract covers;
        ``exact``, its identities if already read in this forward.

        The plain objects in the slots now are kept alive with it: a signature names objects
        by id, and a freed object's id is soon another's (a float rebound each step takes
        the freed one's address), which would read as the same object holding another value.
        Tensors are not kept (a rebound queue would stay alive a step longer): a new tensor at
        a freed one's id is a slot whose contract entry the replay captures and checks
        anyway."""
        self._fast = fast
        if exact is None:
            exact = _identity_signature(self.modules, exact=True) if dict_version else fast
        self._exact = exact
        self._alive = [
            [v for v in m.__dict__.values() if not isinstance(v, torch.Tensor)]
            for m in self.modules
        ]

    def learn_varying(self, keys: list[Hashable]) -> None:
        """Fields the probe saw change inside the window: the replay puts them back, so they
        are not preconditions."""
        self.varying.update(keys)
        if self.base is not None:
            for k in keys:
                self.base.pop(k, None)

    def accept(self) -> None:
        """The contract now covers the current fingerprint (after a probe of this forward)."""
        for key, value in self._pending:
            if _discrete(key, value):
                self.seen.setdefault(key, set()).add(value)
            else:
                self.varying.add(key)
        self._pending = []
        self._settle(_identity_signature(self.modules))
        self.base = fingerprint(self.modules, self.varying)
        for key, value in self.base.items():
            if _discrete(key, value):
                self.seen.setdefault(key, set()).add(value)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
