"""What each slot of a segment's modules held at forward time, put back for the replay.

A replay must see the objects the forward saw, not only their bytes. Models rebind state as
often as they write it in place: ``self.h = h.detach()`` (a stateful RNN),
``self.queue = torch.cat([k, self.queue[:-B]])`` (a queue written the common non-in-place way),
an attribute re-pointed to a new view, parameters substituted by ``torch.func.functional_call``,
a new ``torch.Generator`` each step, an annealed float, an enum mode. At each forward the engine
takes :func:`capture_slots` of the segment's modules (C-level dict copies, plus copies of small
containers of plain values); at replay :func:`~lightning_replay.slot_restore.swap_slots` puts
every slot whose object or value differs back as it was and returns the live objects, which
:func:`~lightning_replay.slot_restore.restore_slots` reinstates afterwards, so the replay's own
rebinding never leaks either (the restore half lives in :mod:`~lightning_replay.slot_restore`). The same holds for what steers
the forward besides the slots: the order of the parameter, buffer and submodule dicts, the
submodules, the module hooks (and torch's global ones), and the attributes of plain holder
objects the modules hold (a config, also one with ``__slots__``, and those found in container
attributes). Generator objects found in the slots have their states captured too
(:func:`capture_generators`).
"""

from __future__ import annotations

import copy
import enum
import functools
import math
import operator
import random
import sys
import types
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as _module

from lightning_replay._compat import dict_version
from lightning_replay.core.mechanisms.host_rng import as_host_rng, is_host_rng


#: Immutable values that are put back by value.
SCALAR_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    enum.Enum,
    np.generic,
    torch.dtype,
    torch.device,
    torch.Size,
)

#: nn.Module's own bookkeeping in ``__dict__`` (the parameter, buffer and submodule dicts and
#: the hook dicts below are handled separately).
MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"} | {
    "_lightning_replay_runtime",  # an installed module's runtime, see core.engine.attach.RUNTIME_KEY
    "_lightning_replay_engine",
}

#: A module's hook dicts that a forward (and so a replay) runs, or whose backward it builds
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
#: torch's global module hooks (``register_module_forward_hook`` ...), and its flag for them
GLOBAL_HOOK_DICTS = tuple(
    n
    for n in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_with_kwargs",
        "_global_forward_hooks_always_called",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
    if n in _module.__dict__  # (all of them since torch 2.1)
)
_GLOBAL_FLAG = "_global_is_full_backward_hook"

_slot_dicts = operator.itemgetter("_parameters", "_buffers", "_modules")
_hook_dicts = operator.itemgetter(*HOOK_DICTS)
_MAIN_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_main_hook_dicts = operator.itemgetter(*_MAIN_HOOK_DICTS)
_token_dicts = operator.itemgetter("_parameters", "_buffers", "_modules", *_MAIN_HOOK_DICTS)
_global_hook_dicts = operator.itemgetter(*GLOBAL_HOOK_DICTS)
_EMPTY: dict = {}  # (never written)

#: Where the classes of torch's own runtime state live (a composable API's state that FSDP2
#: keeps in a module's ``__dict__``, a device mesh, dynamo's caches): torch updates these
#: objects itself, in a replay too, so they are never holders to capture and put back.
_TORCH_RUNTIME = ("torch.distributed", "torch._")

#: Mutable containers (and their subclasses: ``OrderedDict``, ``defaultdict``, ``Counter``),
#: put back by their items, not by identity.
_CONTAINERS = (list, dict, set)

_CONTAINER_LIMIT = 4096  # items; larger containers of plain values are not copied per step


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


def is_scalar(v: Any) -> bool:
    # (by its type: ``isinstance`` asks the object, and a dead weakref proxy raises)
    return issubclass(type(v), SCALAR_TYPES)


def copy_plain(v: Any, budget: list[int] | None = None) -> Any:
    """A copy of a (nested) list/dict/set/tuple of plain scalars, or ``MISSING`` when ``v``
    holds anything else or is too large to copy every step."""
    if budget is None:
        budget = [_CONTAINER_LIMIT]
    budget[0] -= 1  # (per item, scalars too: a list of 100,000 floats is not copied per step)
    if budget[0] < 0:
        return MISSING
    if is_scalar(v):
        return v
    t = type(v)
    if t in (list, tuple, set, frozenset, dict) and len(v) > budget[0]:
        return MISSING  # (each item costs one: too large, known without a walk)
    if t in (list, tuple, set, frozenset):
        out = []
        for x in v:
            c = copy_plain(x, budget)
            if c is MISSING:
                return MISSING
            out.append(c)
        return t(out)
    if t is dict:
        out_d = {}
        for k, x in v.items():
            c = copy_plain(x, budget)
            if c is MISSING or not is_scalar(k):
                return MISSING
            out_d[k] = c
        return out_d
    return MISSING


def same_value(a: Any, b: Any) -> bool:
    """Equality that never asks a tensor for its truth value: tensors, generators and other
    objects compare by identity; plain values by value (NaN equals NaN); containers item by
    item."""
    if a is b:
        return True
    ta, tb = type(a), type(b)
    if ta is not tb:
        return False
    if issubclass(ta, (list, tuple)):  # and their subclasses: a named tuple, a UserList...
        if len(a) != len(b):
            return False
        # (a shallow copy holds the same objects: told at C speed for a long list)
        return all(map(operator.is_, a, b)) or all(same_value(x, y) for x, y in zip(a, b))
    if issubclass(ta, dict):  # the order too: a forward may iterate it (an OrderedDict...)
        if list(a) != list(b):
            return False
        # (a copy of a dict of plain values holds the same objects: told at C speed)
        return all(map(operator.is_, a.values(), b.values())) or all(
            same_value(a[k], b[k]) for k in a
        )
    if issubclass(ta, (set, frozenset)):
        return a == b
    if is_scalar(a):
        try:
            eq = a == b
            if isinstance(eq, np.ndarray):
                return bool(eq.all())
            if bool(eq):
                return True
        except Exception:  # noqa: BLE001 - a value whose comparison fails is "different"
            return False
        return isinstance(a, (float, np.floating)) and math.isnan(a) and math.isnan(b)
    return False


#: the modules of every installed model, by id: (a weak reference to the module, how many
#: engines installed it). A module outside all of them (held in a plain attribute, a container
#: or a holder, never registered: transformers 5's kernel functions in ``_kernel_funcs``) is
#: captured like a holder. By id, not by the module: a module may define ``__eq__`` (one equal
#: by value to a registered one is another object) or be unhashable (a dataclass module).
_MODEL_MODULES: dict[int, tuple[weakref.ref, int]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    """A registered module died (a model dropped without uninstall): its id is free."""
    entry = _MODEL_MODULES.get(key)
    if entry is not None and entry[0] is ref:
        del _MODEL_MODULES[key]


class Registration:
    """``model``'s modules counted as registered (not holders), until :meth:`release` (the
    engine's uninstall) or the model's death (dropped without uninstall): a module it shares
    with a model still installed is then counted once less, never registered for good."""

    __slots__ = ("_pairs", "_fin", "_mods")

    def __init__(self, model: nn.Module) -> None:
        pairs = []
        # the modules, held until release (as by the engine before 852b3e0: without them, a
        # full suite's test_nothing_outlives_its_step[none-kitchen_sink] found 4 parameters
        # alive after uninstall, after the cases before it; cause not found)
        self._mods = list(model.modules())
        for m in self._mods:
            key = id(m)
            entry = _MODEL_MODULES.get(key)
            if entry is not None and entry[0]() is m:
                _MODEL_MODULES[key] = (entry[0], entry[1] + 1)
                ref = entry[0]
            else:
                ref = weakref.ref(m, lambda r, k=key: _forget(k, r))
                _MODEL_MODULES[key] = (ref, 1)
            pairs.append((key, ref))
        self._pairs = pairs  # (ids and weak references, for the finalizer)
        self._fin = weakref.finalize(model, _drop_counts, pairs)
        self._fin.atexit = False

    def release(self) -> None:
        self._mods = []
        if self._fin.detach() is not None:  # (else the model died: its counts are dropped)
            _drop_counts(self._pairs)


def _drop_counts(pairs: list[tuple[int, weakref.ref]]) -> None:
    for key, ref in pairs:
        entry = _MODEL_MODULES.get(key)
        if entry is None or entry[0] is not ref:
            continue
        if entry[1] > 1:
            _MODEL_MODULES[key] = (ref, entry[1] - 1)
        else:
            del _MODEL_MODULES[key]


def registered_modules(exclude: set[int]) -> list[nn.Module]:
    """The modules installed models register, but for those whose ids are in ``exclude``
    (another engine's model's modules, which this engine's probe traces like its own)."""
    out = []
    while True:
        try:  # (a module dying as the copy allocates runs _forget, which resizes the dict)
            items = list(_MODEL_MODULES.items())
            break
        except RuntimeError:
            continue
    for key, (ref, _) in items:
        m = ref()
        if m is not None and key not in exclude:
            out.append(m)
    return out


def _registered(m: nn.Module) -> bool:
    entry = _MODEL_MODULES.get(id(m))
    return entry is not None and entry[0]() is m


#: the dicts of a module captured as a holder that are put back by contents where they hold
#: something (its parameters, buffers, submodules and the hooks a forward runs), and checked
#: to be still empty where they were (a kernel function module: nothing to compare at each
#: share); its other internals are put back by identity
_MODULE_HOLDER_DICTS = ("_parameters", "_buffers", "_modules", *HOOK_DICTS)
_MODULE_HOLDER_KEPT = MODULE_INTERNALS - set(_MODULE_HOLDER_DICTS)


def _module_holder_kept(d: dict) -> tuple[frozenset, tuple[str, ...]]:
    """Of a module captured as a holder (its ``__dict__`` ``d``): the attributes put back by
    identity, and among them the dicts that are empty now (checked to stay so)."""
    empty = tuple(k for k in _MODULE_HOLDER_DICTS if k in d and not d[k])
    return (_MODULE_HOLDER_KEPT.union(empty) if empty else _MODULE_HOLDER_KEPT), empty


def is_holder(v: Any) -> bool:
    """A plain Python object with attributes of its own (not a tensor, generator, class,
    function, Python module or torch's runtime state): a config namespace, a dataclass, a
    state holder, also one that keeps its attributes in ``__slots__``; and a module that no
    installed model registers (a kernel function module held in a dict attribute), whose
    attributes a forward reads like a config's. An object that raises when asked (a dead
    weakref proxy, a lazy proxy whose ``__dict__`` raises) is not one: nothing of it can be
    captured."""
    t = type(v)
    if issubclass(t, nn.Module):
        return not _registered(v)
    if issubclass(t, (torch.Tensor, torch.Generator, type, *_CONTAINERS, tuple)):
        return False  # (an OrderedDict, a defaultdict: containers, put back by their items)
    m = getattr(t, "__module__", None)
    if not isinstance(m, str) or m in ("builtins", "types.ModuleType", "weakref"):
        return False
    if m.startswith(_TORCH_RUNTIME) or issubclass(t, types.ModuleType):
        return False
    try:
        if callable(v) and (m in ("functools", "operator") or m.startswith("torch.")):
            return False  # (a partial, an itemgetter, a torch function object: no state)
        # (a callable instance of a user's class is one: an activation object with a gain,
        # held in a dict of kernels, reads its attributes at the forward like a config)
        return type(object.__getattribute__(v, "__dict__")) is dict or bool(_slot_members(t))
    except AttributeError:
        return bool(_slot_members(t))
    except Exception:
        return False


# Per class with ``__slots__``: its slots' member descriptors by attribute name.
_SLOT_MEMBERS: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()


def _slot_members(t: type) -> dict:
    """The member descriptors of the ``__slots__`` of ``t`` and its bases, by name (the most
    derived one where a name is declared twice); empty for a class without slots."""
    if getattr(t, "__slots__", None) is None:
        return _EMPTY
    members = _SLOT_MEMBERS.get(t)
    if members is None:
        members = {}
        for c in reversed(t.__mro__):
            if "__slots__" in c.__dict__:  # (``__dict__`` and ``__weakref__`` are no members)
                for v in c.__dict__.values():
                    if type(v) is types.MemberDescriptorType and v.__objclass__ is c:
                        members[v.__name__] = v
        _SLOT_MEMBERS[t] = members
    return members


class SlotView:
    """The ``__slots__`` of a holder object as a mapping of the slots that are set to their
    values: what its ``__dict__`` is to other holders, for the capture, the swap and the
    restore, which read and write a holder's attributes through one."""

    __slots__ = ("obj", "members")

    def __init__(self, obj: Any, members: dict) -> None:
        self.obj = obj
        self.members = members

    def items(self) -> list[tuple[str, Any]]:
        out = []
        for k, m in self.members.items():
            try:
                out.append((k, m.__get__(self.obj)))
            except AttributeError:  # not set (or deleted)
                pass
        return out

    def __iter__(self) -> Any:
        return iter([k for k, _ in self.items()])

    def __len__(self) -> int:
        return len(self.items())

    def keys(self) -> set[str]:
        return {k for k, _ in self.items()}

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    def copy(self) -> dict:
        return dict(self.items())

    def get(self, k: str, default: Any = None) -> Any:
        m = self.members.get(k)
        if m is None:
            return default
        try:
            return m.__get__(self.obj)
        except AttributeError:
            return default

    def __getitem__(self, k: str) -> Any:
        v = self.get(k, MISSING)
        if v is MISSING:
            raise KeyError(k)
        return v

    def __setitem__(self, k: str, v: Any) -> None:
        self.members[k].__set__(self.obj, v)

    def pop(self, k: str, *default: Any) -> Any:
        v = self.get(k, MISSING)
        if v is MISSING:
            if default:
                return default[0]
            raise KeyError(k)
        self.members[k].__delete__(self.obj)
        return v


def holder_stores(obj: Any) -> list[Any]:
    """Where a holder keeps its attributes: its ``__dict__`` (read again at each use: it can
    be replaced wholesale, so the holder itself stands for it) and a :class:`SlotView` of its
    ``__slots__``, either or both."""
    out = []
    try:  # (past a class's own __getattribute__, which may refuse: a lazy proxy)
        if type(object.__getattribute__(obj, "__dict__")) is dict:
            out.append(obj)
    except AttributeError:
        pass
    members = _slot_members(type(obj))
    if members:
        out.append(SlotView(obj, members))
    return out


def _attrs_of(owner: Any) -> Any:
    """The attribute store of a :func:`holder_stores` entry: a dict, or the slot view."""
    return owner if type(owner) is SlotView else object.__getattribute__(owner, "__dict__")


def _same_owner(a: Any, b: Any) -> bool:
    return a is b or (type(a) is SlotView and type(b) is SlotView and a.obj is b.obj)


def _holder_values(d: Any, kept: frozenset = frozenset()) -> dict:
    out = d.copy()
    for k, x in out.items():
        if issubclass(type(x), _CONTAINERS) and k not in kept:
            out[k] = _at_forward(x)
    return out


def _holder_signature(d: Any) -> tuple:
    """Which object each attribute of a holder holds (names and ids, C-level tuples), with the
    dict's version tag (None without one: no tags, or slots) that stands for them while it is
    unchanged."""
    tag = dict_version(d) if dict_version and type(d) is not SlotView else None
    return tag, tuple(d), tuple(map(id, d.values()))


def _holder_same(d: Any, sig: tuple) -> bool:
    """Whether every attribute of the holder whose attribute store is ``d`` holds the object
    it held when ``sig`` was taken: at once when the dict is unchanged since, else by names
    and ids."""
    if sig[0] is not None and dict_version(d) == sig[0]:
        return True
    return sig[1] == tuple(d) and sig[2] == tuple(map(id, d.values()))


def _containers_unchanged(d: Any, saved: dict, containers: tuple, empties: tuple = ()) -> bool:
    """Whether each container attribute holds its captured contents, and each dict that was
    empty (a module holder's hooks) is still empty."""
    return all(same_value(saved[c], d[c]) for c in containers) and not any(
        d.get(k) for k in empties
    )


# Per module and attribute path: the last capture of a plain holder object it holds (a config
# namespace such as transformers' ``PretrainedConfig``, dozens of attributes read by every
# layer), as (holder or slot view, values at forward, signature, container attribute names,
# names of the dicts that were empty: a module holder's).
_HOLDERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _capture_holder(module: nn.Module, name: Any, owner: Any) -> tuple:
    """The values of the attributes in ``owner`` (a :func:`holder_stores` entry) now, shared
    with the module's last capture of it when every attribute still holds the same object and
    every container attribute the same contents (the objects are kept alive by that capture,
    so equal ids are the same objects; immutable values cannot have changed; containers are
    compared by value). Captures are never mutated: a replay gets fresh copies of the
    containers (:func:`~lightning_replay.slot_restore._swap_holder`)."""
    d = _attrs_of(owner)
    cache = _HOLDERS.get(module)
    prev = cache.get(name) if cache is not None else None
    if (
        prev is not None
        and _same_owner(prev[0], owner)
        and _holder_same(d, prev[2])
        and _containers_unchanged(d, prev[1], prev[3], prev[4])
    ):
        return prev
    kept, empties = _module_holder_kept(d) if isinstance(owner, nn.Module) else (frozenset(), ())
    values = _holder_values(d, kept)
    containers = tuple(
        k for k, x in values.items() if issubclass(type(x), _CONTAINERS) and k not in kept
    )
    entry = (owner, values, _holder_signature(d), containers, empties)
    if _entry_holds_tensor(entry):
        return entry  # (kept by no cache past the step that replaced what it held)
    if cache is None:
        cache = _HOLDERS[module] = {}
    cache[name] = entry
    return entry


#: how deep :func:`_capture_holders` follows holders held by holders (``config.text_config``)
#: and containers of holders (a list of configs, a dict of them in a holder); deeper is a
#: warning (:func:`_warn_cut`)
_HOLDER_DEPTH = 8


def holders_in(c: Any, depth: int = 0, budget: list[int] | None = None) -> list[tuple[str, Any]]:
    """The holder objects among the items of a list, tuple, dict or set, and of the containers
    among them (to :data:`_HOLDER_DEPTH` levels), each with its path below ``c``
    (``"['cfg']"``, ``"[0][1]"``): a registry of configs, a list of them.

    A container of plain values only is told by its item types first (a set of types at C
    speed, not charged to ``budget``): a config's table of 10,000 floats costs no per-item walk
    at every forward, and does not use up the count before the holders beside it."""
    if budget is None:
        budget = [_CONTAINER_LIMIT]
    if all(issubclass(t, SCALAR_TYPES) for t in set(map(type, _items_values(c)))):
        return []
    out: list[tuple[str, Any]] = []
    for k, x in _items(c):
        budget[0] -= 1
        if budget[0] < 0:
            break
        if is_scalar(x):
            continue
        if issubclass(type(x), (*_CONTAINERS, tuple)):
            if depth + 1 < _HOLDER_DEPTH:
                out += [(f"[{k!r}]{p}", h) for p, h in holders_in(x, depth + 1, budget)]
        elif is_holder(x):
            out.append((f"[{k!r}]", x))
        else:
            out += [(f"[{k!r}]{p}", h) for p, h in behind(x)]
    return out


def _capture_holders(
    module: nn.Module, name: str, obj: Any, seen: set[int] | None = None
) -> list[tuple]:
    """:func:`_capture_holder` of ``obj``'s attribute stores and of every holder reachable
    from them through holder attributes and the containers among them, each once (``seen``:
    ids of holders already captured), to :data:`_HOLDER_DEPTH` levels (a multimodal config's
    ``text_config``, an options object inside a config, a config in a holder's list): a replay
    puts back what each level held at forward. The captures are swapped in this order, outer
    first."""
    out: list[tuple] = []
    if seen is None:
        seen = set()
    todo = [(name, obj, 0)]
    cut = ""  # the first path past the walk's depth that leads on to a holder
    while todo and len(out) < _CONTAINER_LIMIT:
        path, o, depth = todo.pop(0)
        if id(o) in seen:
            continue
        seen.add(id(o))
        for owner in holder_stores(o):
            key = path if type(owner) is not SlotView else (path, "__slots__")
            entry = _capture_holder(module, key, owner)
            out.append(entry)
            held = isinstance(owner, nn.Module)
            for k, x in entry[1].items():
                if held and k == "_modules":
                    # a held module's submodules (a teacher's layers): its own tree, each
                    # level no level of the walk (the count above bounds it)
                    todo += [(f"{path}.{n}", v, depth) for n, v in x.items() if is_holder(v)]
                    continue
                if depth + 1 >= _HOLDER_DEPTH:
                    if not cut and _leads_on(x):
                        cut = f"{path}.{k}"
                    continue
                if is_holder(x):
                    todo.append((f"{path}.{k}", x, depth + 1))
                elif issubclass(type(x), (*_CONTAINERS, tuple)):
                    todo += [(f"{path}.{k}{p}", h, depth + 1) for p, h in holders_in(x, depth + 1)]
                else:
                    todo += [(f"{path}.{k}{p}", h, depth + 1) for p, h in behind(x)]
    left = [p for p, o, _ in todo if id(o) not in seen]
    if left:
        _warn_cut(module, name, f"more than {_CONTAINER_LIMIT} holders", left[0])
    if cut:
        _warn_cut(module, name, f"holders more than {_HOLDER_DEPTH} levels down", cut)
    return out


def _leads_on(x: Any) -> bool:
    """Whether a value the holder walk leaves past its depth holds a holder: itself, behind
    a callable, or among a container's items."""
    if is_holder(x):
        return True
    if issubclass(type(x), (*_CONTAINERS, tuple)):
        return bool(holders_in(x, _HOLDER_DEPTH - 1))
    return bool(behind(x))


#: (module id, attribute, why) of holder walks cut by a limit, each warned about once: the
#: module by weak reference (an id is another's once it dies)
_CUT: dict[tuple[int, str, str], weakref.ref] = {}


def _warn_cut(module: nn.Module, name: str, why: str, first: str) -> None:
    """Say once per module, attribute and limit that :func:`_capture_holders` stopped at a
    limit (``why``): what lies past it (``first`` the first of it) is not captured, and a
    change there between a forward and its replay would not be put back."""
    key = (id(module), name, why)
    ref = _CUT.get(key)
    if ref is not None and ref() is module:
        return
    for k in [k for k, r in _CUT.items() if r() is None]:
        del _CUT[k]
    _CUT[key] = weakref.ref(module)
    warnings.warn(
        f"lightning_replay: {type(module).__name__}.{name} reaches {why} (objects and modules "
        f"no installed model registers): those from {first} on are not captured, so a change "
        "to them between a forward and its replay would not be put back. Register the held "
        "modules in the model (as submodules), keep such settings nearer the module, or set "
        "preservation='retain' for this segment.",
        stacklevel=4,
    )


_PLANS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _needs_more(v: Any) -> bool:
    """An attribute value that an identity copy of the dict does not cover: containers (copied
    by value, or which objects they hold), plain holder objects, generators, tensors (sparse
    ones are copied), and the callables a holder can stand behind (a bound method, a
    partial: which object they are bound to is read at each capture)."""
    return (
        isinstance(v, (*_CONTAINERS, tuple, torch.Tensor, torch.Generator, *_WRAPPERS))
        or is_host_rng(v)
        or is_holder(v)
    )


#: callables that hold the object they call: a bound method its ``__self__``, a partial its
#: ``func`` and arguments
_WRAPPERS = (types.MethodType, functools.partial, types.FunctionType)


def behind(v: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """The holders a bound method, a ``functools.partial`` or a closure calls or passes
    (``__self__``; ``func``, the arguments and keywords of a partial; the cells a function
    closes over), to six wrappers deep, each with its path below ``v``: ``self.fn =
    act.__call__``, ``partial(act)`` or ``lambda h: act(h)`` reads ``act``'s attributes when
    called, as ``self.act`` would."""
    t = type(v)
    if depth > 6 or not issubclass(t, _WRAPPERS):
        return []
    if issubclass(t, types.FunctionType):
        parts = []
        for i, cell in enumerate(v.__closure__ or ()):
            try:
                parts.append((f".__closure__[{i}]", cell.cell_contents))
            except ValueError:  # an empty cell (a name not bound yet)
                pass
    elif issubclass(t, types.MethodType):
        parts = [(".__self__", v.__self__)]
    else:
        parts = [(".func", v.func)]
        parts += [(f".args[{i}]", a) for i, a in enumerate(v.args)]
        parts += [(f".keywords[{k!r}]", a) for k, a in (v.keywords or {}).items()]
    out = []
    for path, x in parts:
        if is_holder(x):
            out.append((path, x))
        else:
            out += [(path + p, h) for p, h in behind(x, depth + 1)]
    return out


def _attr_plan(module: nn.Module, d: dict) -> tuple:
    """The attribute keys of ``module`` that need more than an identity copy, cached while the
    attribute names and value types stay the same (most forwards: nothing to rescan)."""
    sig = (tuple(d), tuple(map(type, d.values())))
    cached = _PLANS.get(module)
    if cached is not None and cached[0] == sig:
        return cached[1]
    keys = tuple(k for k, v in d.items() if k not in MODULE_INTERNALS and _needs_more(v))
    _PLANS[module] = (sig, keys)
    return keys


def _hooks_of(d: dict) -> tuple:
    try:
        return _hook_dicts(d)
    except KeyError:  # a module built without nn.Module.__init__ (or an old pickle's)
        return tuple(d.get(h) for h in HOOK_DICTS)


def _hooked(d: dict) -> bool:
    """Whether a module has hooks (the other hook dicts only qualify these four's entries)."""
    try:
        return any(_main_hook_dicts(d))
    except KeyError:
        return any(_hooks_of(d))


def hook_ids(hooks: tuple) -> tuple:
    """Which function each hook dict holds under each key, in order (the hook dicts' own
    version tags miss a reorder: ``register_forward_hook(prepend=True)`` is a
    ``move_to_end``)."""
    return tuple((tuple(h), tuple(map(id, h.values()))) if h else () for h in hooks)


_TORCH_MODULE_GLOBALS = _module.__dict__


def global_hooks() -> tuple:
    """torch's global module hook dicts, and its global full-backward-hook flag."""
    g = _TORCH_MODULE_GLOBALS
    return _global_hook_dicts(g), g.get(_GLOBAL_FLAG)


def identities(d: dict) -> tuple:
    """Which object each slot of a module holds, in order, with the slot names: equal for two
    moments exactly when every parameter, buffer, submodule and attribute slot holds the same
    object, in the same order, and every hook dict the same functions (the objects are kept
    alive by the captured slots, so their ids are not reused)."""
    p, b, m = _slot_dicts(d)
    out = (
        tuple(d),
        tuple(map(id, d.values())),
        tuple(p),
        tuple(map(id, p.values())),
        tuple(b),
        tuple(map(id, b.values())),
        tuple(m),
        tuple(map(id, m.values())),
    )
    return out + hook_ids(_hooks_of(d)) if _hooked(d) else out


def slot_token(d: dict) -> tuple:
    """A cheap stand-in for :func:`identities` of the module whose ``__dict__`` is ``d``: the
    version tags of its attribute, parameter, buffer and submodule dicts (equal: none of them
    changed, so every slot holds the same object) and, where there are any, which function
    each hook dict holds; or the identities themselves where the interpreter has no version
    tags to trust (:data:`~lightning_replay._compat.dict_version`).

    An OrderedDict slot dict reordered by ``move_to_end`` moves no tag: its order is compared
    apart, by :func:`same_slots` (and the guard), where a slot dict is one."""
    if dict_version is None:
        return identities(d)
    try:
        p, b, m, fp, fh, bp, bh = _token_dicts(d)
    except KeyError:  # (a module without some hook dict: see _hooks_of)
        return _long_token(d)
    if fp or fh or bp or bh:
        return _long_token(d)
    # (nearly always; an empty dict holds nothing whatever its tag: no tag to read)
    return (
        dict_version(d),
        dict_version(p) if p else 0,
        dict_version(b) if b else 0,
        dict_version(m) if m else 0,
    )


def _long_token(d: dict) -> tuple:
    """:func:`slot_token` of a module with hooks."""
    p, b, m = _slot_dicts(d)
    token = dict_version(d), dict_version(p), dict_version(b), dict_version(m)
    return token + hook_ids(_hooks_of(d)) if _hooked(d) else token


def slot_order(d: dict) -> tuple | None:
    """The order of a module's parameter, buffer and submodule dicts where one of them is not
    a plain dict (an OrderedDict, which ``move_to_end`` reorders without a tag); else None
    (a plain dict's order changes only with its tag)."""
    p, b, m = _slot_dicts(d)
    if type(p) is type(b) is type(m) is dict:
        return None
    return tuple(p), tuple(b), tuple(m)


def same_slots(d: dict, s: "ModuleSlots", token: tuple | None = None) -> bool:
    """Whether every slot of the module whose ``__dict__`` is ``d`` holds the object it held
    when ``s`` was captured, in the same order: at once when no slot dict changed since, else
    by identities (written and put back, or rebound to the same object). A match on
    identities refreshes the capture's token, which then stands for this moment too (both
    have its identities). ``token``: :func:`slot_token` of ``d`` just read, if at hand."""
    if token is None:
        token = slot_token(d)
    if token == s.token:
        # (the same slot dicts as at capture: OrderedDicts then, OrderedDicts now)
        return s.order is None or s.order == slot_order(d)
    if dict_version is None or identities(d) != s.ids:
        return False
    s.token = token
    return True


class ModuleSlots:
    """One module's slots at one moment: parameter, buffer, submodule and attribute objects,
    and the module's hooks.

    ``plain`` is true when the slots are all there is to put back (no container contents,
    holder values or sparse copies, which can change while the slots hold the same objects):
    such a capture stands for any later moment whose :func:`identities` are the same.
    """

    __slots__ = (
        "module",
        "params",
        "buffers",
        "submodules",
        "order",
        "hooks",
        "attrs",
        "copies",
        "layout",
        "shallow",
        "holders",
        "gens",
        "ids",
        "token",
        "plain",
        "holder_entries",
        "found",
    )

    def __init__(self, module: nn.Module, token: tuple | None = None) -> None:
        d = module.__dict__
        self.module = module
        self.token = slot_token(d) if token is None else token
        self.ids = self.token if dict_version is None else identities(d)
        self.found: list | None = None  # slot_generators' scan of this capture, once
        self.params = d["_parameters"].copy()
        self.buffers = d["_buffers"].copy()
        self.submodules = d["_modules"].copy()
        self.order = slot_order(d)
        hooks = _hooks_of(d)
        # (which function each hook dict held, in order; None: no hooks at all)
        self.hooks = {n: h.copy() for n, h in zip(HOOK_DICTS, hooks) if h} if any(hooks) else None
        self.attrs = attrs = d.copy()
        # Sparse (non-strided) tensors have no storage the engine can preserve in place:
        # each is copied whole, and the copy stands in at replay if it was written since.
        layout = None
        for k, v in self.buffers.items():
            if v is not None and v.layout != torch.strided:
                if layout is None:
                    layout = {}
                with torch.no_grad():
                    layout[("b", k)] = (v._version, v.detach().clone())
        copies = shallow = gens = None
        holders: list[tuple] = []
        entries: list[tuple] = []
        seen: set[int] = set()  # holders captured, each once

        def capture_holders(path: str, obj: Any) -> None:
            for entry in _capture_holders(module, path, obj, seen):
                holders.append(entry[:2])
                entries.append(entry)

        for k in _attr_plan(module, d):
            v = attrs[k]
            if isinstance(v, torch.Generator) or is_host_rng(v):
                gens = [v] if gens is None else gens + [v]
            elif isinstance(v, torch.Tensor):
                if v.layout != torch.strided:
                    if layout is None:
                        layout = {}
                    with torch.no_grad():
                        layout[("a", k)] = (v._version, v.detach().clone())
            elif issubclass(type(v), (*_CONTAINERS, tuple)):
                if isinstance(v, tuple):
                    c = MISSING  # (immutable: the slot's identity covers it)
                else:
                    c = copy_plain(v)
                    if c is not MISSING:
                        if copies is None:
                            copies = {}
                        copies[k] = c
                    elif not isinstance(v, set):  # objects, or a subclass: which object each held
                        if shallow is None:
                            shallow = {}
                        shallow[k] = copy_items(v)
                if isinstance(v, (list, tuple)):
                    g = _generators_in(v)
                    if g:
                        gens = g if gens is None else gens + g
                if c is MISSING:
                    # holders among the items (a registry of configs): their attributes too
                    for path, h in holders_in(v):
                        capture_holders(f"{k}{path}", h)
            elif is_holder(v):
                # a plain object the module holds (a config shared with the root...): the
                # values of its attributes at forward, and of the holders it holds in turn
                capture_holders(k, v)
            else:
                for path, h in behind(v):  # (a bound method of one, a partial of one)
                    capture_holders(f"{k}{path}", h)
        self.layout = layout
        self.copies = copies
        self.shallow = shallow
        self.holders = holders or None
        self.holder_entries: list[tuple] | None = entries or None
        self.gens = gens
        self.plain = layout is None and copies is None and shallow is None and not holders


class SlotCaptures(list):
    """:func:`capture_slots` of some modules: one :class:`ModuleSlots` each, and torch's
    global module hooks at the same moment (``hooks``: which function each global hook dict
    held, and the flag; None when there were none)."""

    __slots__ = ("hooks",)


def _capture_global_hooks() -> tuple | None:
    dicts, flag = global_hooks()
    if not any(dicts) and flag is None:
        return None  # (nearly always: nothing registered globally)
    return {n: h.copy() for n, h in zip(GLOBAL_HOOK_DICTS, dicts) if h}, flag


def capture_slots(
    modules: list[nn.Module], tokens_now: list[tuple] | None = None, last: list | None = None
) -> SlotCaptures:
    """The slots of ``modules`` now, and torch's global module hooks.

    ``tokens_now``: each module's :func:`slot_token` just read (by the guard of the same
    forward), if at hand. ``last``: per module, its last capture while its slots have always
    held the same objects (``MISSING`` before the first one, ``None`` once they were seen to
    change: rebound state, annealed values); updated in place. A module whose slots hold the
    same objects as at that capture, with nothing else to put back (or only plain holder
    objects whose attributes hold the same objects and contents), shares it (captures are
    never mutated): the forward of a steady model copies no dicts. Modules seen to change are
    captured afresh every time, so no stale capture keeps old objects alive between steps.
    """
    out = SlotCaptures()
    out.hooks = _capture_global_hooks()
    for i, m in enumerate(modules):
        token = slot_token(m.__dict__) if tokens_now is None else tokens_now[i]
        prev = MISSING if last is None else last[i]
        if (
            prev is not None
            and prev is not MISSING
            and same_slots(m.__dict__, prev, token)
            and _capture_current(prev)
        ):
            out.append(prev)
            continue
        s = ModuleSlots(m, token)
        if last is not None:
            last[i] = s if prev is MISSING and _shareable(s) else None
        out.append(s)
    return out


def _shareable(s: ModuleSlots) -> bool:
    """A capture that stands for a later moment with the same slot objects: nothing else to
    put back (``plain``), or only containers of objects (shallow copies: a replay is given a
    fresh copy of one, never the capture's own) and holder objects, re-checked at each share.
    Copies of plain values and of sparse tensors are made afresh at every capture, and so are
    containers holding tensors, containers or modules with tensors, and modules with a tuple,
    partial or closure holding one: a capture shared past its
    step would keep what they held then alive after the step replaced it, until the next
    capture."""
    if s.layout is not None or s.copies is not None:
        return False
    if s.holder_entries and any(_entry_holds_tensor(e) for e in s.holder_entries):
        return False
    for k, v in s.attrs.items():  # a tuple, partial or closure holding a tensor (its slot's
        # identity covers it, no copy is made of it)
        t = type(v)
        if (t is tuple or t in _WRAPPERS) and k not in MODULE_INTERNALS and _may_hold_tensor(v):
            return False
    return not s.shallow or all(
        _holds_no_tensor(x) for v in s.shallow.values() for _, x in _items(v)
    )


def _entry_holds_tensor(entry: tuple) -> bool:
    """Whether a holder capture holds a tensor: a module with parameters or buffers, or a
    holder with a tensor (or a module with one) among its attributes or their containers' items
    (a state object whose bank a step rebinds). Such a capture is made afresh at each forward:
    kept by a cache or shared, it would keep what the step replaced alive until the next one."""
    owner, values = entry[0], entry[1]
    if isinstance(owner, nn.Module) and not _holds_no_tensor(owner):
        return True
    return any(_may_hold_tensor(v) for v in values.values())


def _may_hold_tensor(x: Any, depth: int = 0) -> bool:
    """A tensor, a module with one, or a container or holder with one among its items or
    attributes (two levels down; deeper, or past ``_CONTAINER_LIMIT`` items, it may: a
    capture that holds a holder which holds a tensor would keep both past the step that
    replaced the holder). Other objects: no."""
    if is_scalar(x):
        return False
    t = type(x)
    if issubclass(t, torch.Tensor):
        return True
    if issubclass(t, nn.Module):
        if not _holds_no_tensor(x):
            return True
    elif issubclass(t, (*_CONTAINERS, tuple)):
        if depth >= 2 or len(x) > _CONTAINER_LIMIT:
            return True
        return any(_may_hold_tensor(i, depth + 1) for i in _items_values(x))
    elif t is functools.partial or t is types.MethodType or t is types.FunctionType:
        # (what it calls with, is bound to, or closes over: ``partial(f, w=w)``, a lambda
        # over ``w``)
        if depth >= 2:
            return True
        if t is functools.partial:
            parts: Any = (x.func, *x.args, *x.keywords.values())
        elif t is types.MethodType:
            parts = (x.__self__,)
        else:
            parts = [c for c in closure_contents(x) if c is not MISSING]
        return any(_may_hold_tensor(i, depth + 1) for i in parts)
    elif not is_holder(x):
        return False
    if depth >= 2:
        return True
    for store in holder_stores(x):
        attrs = _attrs_of(store)
        if len(attrs) > _CONTAINER_LIMIT:
            return True
        for k, v in attrs.items():
            if k not in MODULE_INTERNALS and _may_hold_tensor(v, depth + 1):
                return True
    return False


def closure_contents(fn: types.FunctionType) -> list:
    """What each closure cell of ``fn`` holds, in order (``MISSING`` for an empty one)."""
    out = []
    for c in fn.__closure__ or ():
        try:
            out.append(c.cell_contents)
        except ValueError:  # (an empty cell)
            out.append(MISSING)
    return out


def _holds_no_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor) or issubclass(type(x), _CONTAINERS):
        return False
    t = type(x)
    if t is tuple or t in _WRAPPERS:  # (a tuple, partial or closure over a tensor)
        return not _may_hold_tensor(x)
    if isinstance(x, nn.Module):  # (transformers' kernel function modules hold none)
        return not _module_tensors(x)
    return True


def _module_tensors(m: nn.Module) -> bool:
    """Whether ``m`` or a submodule of it holds a parameter or a buffer, walked by id (a
    module may be unhashable: a dataclass module, which ``nn.Module.modules`` cannot walk)."""
    todo, seen = [m], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        d = x.__dict__
        for k in ("_parameters", "_buffers"):
            if any(v is not None for v in (d.get(k) or {}).values()):
                return True
        todo += [v for v in (d.get("_modules") or {}).values() if v is not None]
    return False


def _capture_current(s: ModuleSlots) -> bool:
    """Whether a shareable capture stands for now (its slots hold the same objects, checked by
    the caller): every container it copied shallowly holds the same objects as then (a dict
    of kernel functions on every attention layer of a transformers model), and every holder
    the same attributes."""
    if s.plain:
        return True
    if s.shallow:
        d = s.module.__dict__
        for k, saved in s.shallow.items():
            if not same_value(d.get(k, MISSING), saved):
                return False
    return not s.holder_entries or _holders_current(s.holder_entries)


def _holders_current(entries: list[tuple] | None) -> bool:
    """Whether every holder still holds the objects and container contents it was captured
    with (then its capture stands for now)."""
    if not entries:
        return False
    for owner, saved, sig, containers, empties in entries:
        d = _attrs_of(owner)
        if not _holder_same(d, sig) or not _containers_unchanged(d, saved, containers, empties):
            return False
    return True


def _is_generator(x: Any) -> bool:
    return isinstance(x, torch.Generator) or is_host_rng(x)


#: per item type: whether an item of it can be a generator (see :func:`_generators_in`)
_GENERATOR_TYPES: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _generators_in(items: Any) -> list[Any]:
    """The generators among ``items`` (a list, a tuple or a dict's values), told by their
    types first (a set of types at C speed: a list of 10,000 floats is one type to ask about,
    not 10,000 items)."""
    kinds = set(map(type, items))
    for t in kinds:
        known = _GENERATOR_TYPES.get(t)
        if known is None:
            known = _GENERATOR_TYPES[t] = issubclass(t, torch.Generator) or _host_rng_type(t)
        if known:
            return [x for x in items if _is_generator(x)]
    return []


def _host_rng_type(t: type) -> bool:
    np = sys.modules.get("numpy")
    if issubclass(t, random.Random):
        return True
    return np is not None and issubclass(t, (np.random.RandomState, np.random.Generator))


def slot_generators(slots: list[ModuleSlots]) -> list[Any]:
    """Generator objects held as attributes (directly, in tuples or lists, in dict attributes,
    or on plain holder objects, directly or in their lists, tuples and dicts) of the modules, each once: torch's, and those outside torch
    (``random.Random``, numpy's ``RandomState`` and ``Generator``) as :class:`HostRNG`."""
    out: list[Any] = []
    seen: set[int] = set()
    for s in slots:
        found = s.found
        if found is None:  # a capture never changes: scanned once, however often it is shared
            found = list(s.gens or ())
            for v in (s.shallow or {}).values():
                found += _generators_in(v.values() if isinstance(v, dict) else v)
            for _, v in s.holders or ():
                for x in v.values():
                    if _is_generator(x):
                        found.append(x)
                    elif type(x) in (list, tuple, dict):  # a holder's list of generators
                        found += _generators_in(x.values() if type(x) is dict else x)
            s.found = found
        for g in found:
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g if isinstance(g, torch.Generator) else as_host_rng(g))
    return out


def capture_generators(gens: list[torch.Generator]) -> list[tuple[torch.Generator, torch.Tensor]]:
    return [(g, g.get_state()) for g in gens]


def slot_tensors(slots: list[ModuleSlots]) -> list[tuple[str, torch.Tensor]]:
    """Non-parameter tensors of the modules (buffers, tensor attributes, tensors inside tuple
    or list attributes) with a local name, each object once."""
    out = []
    seen: set[int] = set()
    for i, s in enumerate(slots):
        items = list(s.buffers.items())
        for k, v in s.attrs.items():
            if k in MODULE_INTERNALS:
                continue
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                items.append((k, v))
            elif type(v) in (tuple, list):
                items.extend(
                    (f"{k}[{j}]", x) for j, x in enumerate(v) if isinstance(x, torch.Tensor)
                )
        for k, v in (s.shallow or {}).items():
            items.extend((f"{k}[{j!r}]", x) for j, x in _items(v) if isinstance(x, torch.Tensor))
        for j, (_, v) in enumerate(s.holders or ()):
            items.extend((f"holder{j}.{k}", x) for k, x in v.items() if isinstance(x, torch.Tensor))
        for k, v in items:
            if v is not None and id(v) not in seen:
                seen.add(id(v))
                out.append((f"{i}:{k}", v))
    return out


def _items(c: Any) -> Any:
    return c.items() if isinstance(c, dict) else enumerate(c)


def copy_items(v: Any, depth: int = 0) -> Any:
    """A shallow copy of a list or dict of objects (which object each item held), with the
    lists and dicts among its items copied too: those of plain values by value, the others the
    same way, ``_COPY_DEPTH`` levels down (not in a container of more than ``_CONTAINER_LIMIT``
    items).
    A dict of flags beside a tensor (``{"ws": [t], "opts": {...}}``) written in place between a
    forward and its replay: the replay reads the forward's."""
    c = copy.copy(v)
    if depth >= _COPY_DEPTH or len(c) > _CONTAINER_LIMIT:  # (larger: which object each held)
        return c
    kinds = set(map(type, c.values() if isinstance(c, dict) else c))
    if not any(issubclass(t, (list, dict)) for t in kinds):
        return c
    for k, x in list(c.items() if isinstance(c, dict) else enumerate(c)):
        if isinstance(x, (list, dict)):  # (an OrderedDict, a defaultdict, a dict subclass too)
            p = copy_plain(x)
            c[k] = p if p is not MISSING and type(p) is type(x) else copy_items(x, depth + 1)
    return c


_COPY_DEPTH = 6  # levels of lists and dicts copy_items copies


def _at_forward(v: Any) -> Any:
    """What a value must be put back as: a copy of a container of plain values, a shallow
    copy of a list or dict of objects (which object each item held, the lists and dicts among
    them copied too: :func:`copy_items`), else the object."""
    if issubclass(type(v), _CONTAINERS):
        c = copy_plain(v)
        if c is not MISSING:
            return c
        if not isinstance(v, set):
            return copy_items(v)
    return v


def capture_outside(reads: list[tuple[nn.Module, Any]]) -> list[tuple[Any, Any, Any]]:
    """What each attribute a segment read from outside its modules held now (``reads``: the
    module, or Python module, and the name; a buffer as ``(where, name)``), and the
    attributes of the holder objects among them (a config on the root), as :func:`~lightning_replay.slot_restore.swap_outside`
    puts them back."""
    out: list[tuple[Any, Any, Any]] = []
    # one copy per object: a container two places hold (a dict bound as the default of a
    # pre-hook and of a forward hook, which share their state through it) is put back as one
    # copy, which the replay's writes through one place and reads through the other share
    copies: dict[int, Any] = {}
    for m, name in reads:
        d = m.__dict__
        if isinstance(name, tuple) and isinstance(m, nn.Module):
            # a registered buffer: which tensor the slot held (a tuple key of a mapping an
            # Items owner stands for, ``G["s", 0]``, is a name like any other)
            d, name = d[name[0]], name[1]
        v = d.get(name, MISSING)
        if id(v) not in copies:
            copies[id(v)] = _at_forward(v)
        out.append((d, name, copies[id(v)]))
        if is_scalar(v) or isinstance(v, torch.Tensor):
            continue
        if issubclass(type(v), (*_CONTAINERS, tuple)):
            kept = _kept_holders(m, name, v)
            if kept is not None:  # the same holders, none written since the last capture
                out.append((None, name, kept))
                continue
            found = [(f"{name}{p}", h) for p, h in holders_in(v)]
        else:
            found = [(name, v)] if is_holder(v) else [(f"{name}{p}", h) for p, h in behind(v)]
        seen: set[int] = set()
        group = []
        for path, h in found:  # (after the attribute: swapped after it, restored before)
            group.append((None, path, _capture_holders(m, path, h, seen)))
        if issubclass(type(v), (*_CONTAINERS, tuple)) and found:
            kept = _keep_holders(m, name, v, group)
            if kept is not None:
                out.append((None, name, kept))
                continue
        out += group
    return out


class HolderGroup:
    """The captures of the holders in one container read from outside, with each holder's
    dict version tag at capture: a replay that finds every tag unchanged has nothing of them
    to put back (:func:`~lightning_replay.core.mechanisms.slot_restore.swap_outside`), told by
    one C-level pass instead of a Python call per holder."""

    __slots__ = ("dicts", "tags", "captures")

    def __init__(self, dicts: list, tags: tuple, captures: list) -> None:
        self.dicts, self.tags, self.captures = dicts, tags, captures

    def unchanged(self) -> bool:
        return dict_version is not None and _tags(self.dicts) == self.tags


# Per owner of an outside attribute and its name: the captures of the holders in a container
# read from outside (a list of 3,000 layer configs on the root, one of them read), with what
# makes them current: the container's items (ids) and each holder's dict version tag. A
# forward that finds both unchanged reuses them: no walk of the container, no capture per
# holder (which costs tens of ms a step at thousands of holders).
_KEPT: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _keep_holders(m: Any, name: Any, c: Any, captures: list) -> HolderGroup | None:
    """``captures`` (of the holders in ``c``) as a :class:`HolderGroup`, kept for the next
    forward; None where no tag can stand for them (no tags, a nested container, a slotted
    holder, a holder with container attributes)."""
    if dict_version is None or not _flat(c):
        return None
    dicts = []
    for _, _, entries in captures:
        for entry in entries:
            owner, _, _, containers, empties = entry
            if type(owner) is SlotView or containers or empties:  # (no tag stands for these)
                return None
            if _entry_holds_tensor(entry):  # (kept past the step that replaced what it held)
                return None
            dicts.append(object.__getattribute__(owner, "__dict__"))
    group = HolderGroup(dicts, _tags(dicts), captures)
    try:
        per = _KEPT.setdefault(m, {})
    except TypeError:  # an owner that takes no weak reference
        return group
    per[name] = (c, tuple(map(id, _items_values(c))), group)
    return group


def _kept_holders(m: Any, name: Any, c: Any) -> HolderGroup | None:
    try:
        kept = _KEPT.get(m, {}).get(name)
    except TypeError:
        return None
    if kept is None or kept[0] is not c or dict_version is None:
        return None
    if tuple(map(id, _items_values(c))) != kept[1] or not kept[2].unchanged():
        return None
    return kept[2]


def _tags(dicts: list) -> tuple:
    return tuple(map(dict_version, dicts))


def _items_values(c: Any) -> Any:
    return c.values() if isinstance(c, dict) else c


def _flat(c: Any) -> bool:
    """Whether no item of ``c`` is itself a container (whose items a tag would not cover)."""
    return not any(issubclass(type(x), (*_CONTAINERS, tuple)) for x in _items_values(c))
