"""The preconditions of a replay contract, checked at every forward.

A contract is learned by watching a probe step; it holds only while the segment behaves as it
did then. What steers that behaviour and is reachable from the segment's modules is
fingerprinted at each forward, cheaply (identities and plain values, no tensor bytes):

* the training flag of each module (a BatchNorm unfrozen later, a Dropout in eval at step 0);
* the registered hooks (module and global: their keys, and which function each holds), the
  submodules, and the order of the parameter, buffer and submodule dicts;
* the identity of every parameter, buffer (and its storage: ``resize_``, ``.data =``) and
  tensor attribute, and of every other attribute
  object (a generator replaced by a new one, a tensor rebound instead of written in place,
  parameters substituted by ``torch.func.functional_call``);
* the value of every plain attribute (a dropout ``p`` warming up from 0, an enum mode, a
  tuple of plain values), also of the plain holder objects reachable from the modules (a config's ``use_bank``, with
  ``__dict__`` or ``__slots__``, held directly, by another holder or in a container), of
  their classes' plain attributes (:class:`ClassView`: one set on the class), of a
  ``functools.partial``'s bound arguments and of a user's Python module held as an
  attribute, and the contents of every container attribute (a dict of flags). The walk goes
  ``_WATCH_DEPTH`` levels and ``_WATCH_LIMIT`` items deep; what lies past them is a warning
  naming the segment (:meth:`Guard._reach`), never silently unwatched.

When the fingerprint shows something new, that forward is re-probed (retained and watched, so
exact by construction) and the contract is extended. Fields that vary continuously (identities,
numbers, hook functions, container contents) are re-probed once and then left to the replay,
which puts the forward's objects and values back (:mod:`lightning_replay.slots`); discrete
fields (flags, hook keys, structure, strings, enums) are re-probed at each value not seen
before, so a mode that comes back costs nothing. A flag the probe's forward read and the step
turned after the segment ran, inside the probe's window, stays a precondition
(``probe._read_flags``): the next forward reads a value no probe saw.

Attributes the segment's forward read from outside its modules (a flag on the root, a
temperature on a sibling, a module-level setting: :attr:`Guard.outside`, from the probes) are
fields like its own: by value, with the holders and containers reachable from them, under
keys ``("outside", "a", name)``; a one-element tensor or a small array read from outside also
by its version (a flag written in place), a submodule read from outside by which module the
parent holds (replaced, or added where the probe found none). A flag on the root that gates a read of state the contract
does not cover, flipped between steps, re-probes the next forward. Only attributes some
probe's forward read (or that the segment's code names at module level) are watched, not
everything on the modules around it.
"""

from __future__ import annotations

import functools
import numbers
import operator
import sys
import types
import warnings
import weakref
from collections import OrderedDict
from itertools import islice, repeat
from typing import Any, Hashable

import numpy as np
import torch
from torch import nn

from lightning_replay._compat import dict_version
from lightning_replay.core.mechanisms.module_globals import _library
from lightning_replay.core.mechanisms.outside_reads import COMPARE_OPS, apply_expr
from lightning_replay.core.mechanisms.slots import (
    HOOK_DICTS,
    MISSING,
    MODULE_INTERNALS,
    _WRAPPERS,
    SlotView,
    _holds_no_tensor,
    closure_contents,
    copy_plain,
    global_hooks,
    hook_ids,
    holder_stores,
    identities,
    is_holder,
    is_scalar,
    slot_token,
)

_WATCH_DEPTH = 16  # levels below a module attribute (deeper: warned, see Guard.warn_cut)
_WATCH_LIMIT = 1 << 16  # items of one container (or holder) looked at for others inside it
_CONTAINERS = (list, dict, set)
_SLOT_DICTS = ("_parameters", "_buffers", "_modules")
#: the module index of the fields read from outside the segment's modules (Guard.outside)
OUTSIDE = "outside"

_COMPARE = {n: getattr(operator, n) for n in COMPARE_OPS}
_SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_MAX_WAYS = 9  # per comparison: as read, and up to four changes a forward made before it


def _number(d: dict, name: str) -> Any:
    """``d[name]`` when it is an int or a float (not a bool), else None."""
    v = d.get(name)
    return None if type(v) is bool or not isinstance(v, (int, float)) else v


def _moved(v: Any, way: tuple[str, Any]) -> Any:
    """``v`` changed as a forward changed it before comparing it (see Guard.add_predicates)."""
    kind, step = way
    if kind == "add":
        return v + step
    if kind == "mul":
        return v * step
    return v


def _computed(v: Any, expr: tuple) -> Any:
    """``v`` with a forward's arithmetic ``expr`` applied (see ``outside_reads.apply_expr``);
    None where it fails (a division by zero: an outcome of its own)."""
    if not expr:
        return v
    try:
        return apply_expr(v, expr)
    except (ArithmeticError, ValueError, TypeError):
        return None


def _storage_ptr(t: Any) -> int:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _reachable(
    modules: list[nn.Module], outside: list[tuple] = (), cut: list | None = None
) -> list[tuple]:
    """The holder objects and containers reachable from the modules' attributes (a config, a
    dict of flags, a registry of configs, a config's list of options), each once, as (module
    index, path, object, and its :func:`_readers`): a container, a holder with a ``__dict__``
    (itself: the dict can be replaced wholesale), or a
    :class:`~lightning_replay.slots.SlotView` of a holder's slots.
    Their contents steer a forward as much as the module's own attributes do, and change
    without any module slot changing. Also a module's parameter, buffer or submodule dict
    where it is an OrderedDict (its path the dict's name), whose order changes without its
    tag. ``outside``: the guard's :attr:`Guard.outside` reads, whose holders and containers
    are reachable too (module index :data:`OUTSIDE`, paths from their names)."""
    out: list[tuple] = _Watched()
    seen: set[int] = set()
    for i, m in enumerate(modules):
        d = m.__dict__
        for k in _SLOT_DICTS:  # (an OrderedDict one: its order, which moves no tag)
            if type(d[k]) is not dict:
                out.append((i, k, d[k], *_readers(d[k])))
        _walk(out, seen, i, [(k, v, 0) for k, v in d.items() if k not in MODULE_INTERNALS], cut)
    if outside:
        todo = [(label, d.get(n, MISSING), 0) for d, n, label in outside]
        _walk(out, seen, OUTSIDE, todo, cut)
    return out


def _walk(
    out: list[tuple], seen: set[int], i: Any, todo: list[tuple], cut: list | None = None
) -> None:
    """The holders and containers reachable from ``todo``'s ``(path, value, depth)``, into
    ``out`` as :func:`_reachable` lists them (``i``: their module index). Besides holders and
    containers: a ``functools.partial``'s bound arguments and a user's Python module held
    as an attribute (``self.settings = config``), whose plain values steer a forward too.
    Where a limit stops the walk (``_WATCH_DEPTH`` levels, ``_WATCH_LIMIT`` items), the path
    left unwatched goes into ``cut``, so the guard can say so once."""
    while todo:
        path, v, depth = todo.pop()
        t = type(v)  # (by type: ``isinstance`` asks the object, and a dead weak proxy raises)
        if is_scalar(v) or issubclass(t, (torch.Tensor, nn.Module)) or id(v) in seen:
            continue
        if issubclass(t, (*_CONTAINERS, tuple)):
            seen.add(id(v))
            if not isinstance(v, tuple):  # (immutable: who holds it covers it)
                out.append((i, path, v, *_readers(v)))
            items, attr, n = (v.items() if isinstance(v, dict) else enumerate(v)), False, len(v)
        elif t is functools.partial:  # (its arguments are immutable: who holds it covers it)
            seen.add(id(v))
            items, attr, n = [("args", v.args), ("keywords", v.keywords)], True, 2
        elif issubclass(t, types.ModuleType):
            if not _user_module(v):
                continue
            seen.add(id(v))
            out.append((i, path, v, *_readers(v)))
            d = _dict_of(v, "__dict__")  # (its plain values and containers of them only:
            # not the modules, classes and objects it imported, nor what they hold)
            items = [(k, x) for k, x in d.items() if type(x) in (list, dict, set, tuple)]
            attr, n = True, len(items)
        elif v is not MISSING and is_holder(v):
            seen.add(id(v))
            stores = holder_stores(v)
            out += [(i, path, st, *_readers(st)) for st in stores]
            view = _class_view(t)
            if view is not None and id(view) not in seen:  # (once per class)
                seen.add(id(view))
                out.append((i, f"{path}.__class__", view, *_readers(view)))
            items, attr = [(k, x) for st in stores for k, x in _attrs(st).items()], True
            n = len(items)
        else:
            continue
        if depth >= _WATCH_DEPTH:
            if cut is not None and any(not is_scalar(x) for _, x in islice(items, 64)):
                cut.append(path)
            continue
        if n > _WATCH_LIMIT and cut is not None:
            rest = islice(items, _WATCH_LIMIT, None)
            if any(not is_scalar(x) for _, x in rest):  # (plain values: watched by their list)
                cut.append(f"{path} (items past {_WATCH_LIMIT})")
        for k, x in islice(items, _WATCH_LIMIT):
            if not is_scalar(x) and not issubclass(type(x), (types.FunctionType, type)):
                todo.append((f"{path}.{k}" if attr else f"{path}[{k!r}]", x, depth + 1))


def _user_module(m: types.ModuleType) -> bool:
    """A Python module of the user's held as an attribute (``self.settings = config``), not a
    library's or the standard library's (``self.rng = random``), whose values are no settings."""
    name = getattr(m, "__name__", None)
    if not isinstance(name, str) or _library(name):
        return False
    return name.split(".", 1)[0] not in getattr(sys, "stdlib_module_names", ())


def _attrs(o: Any) -> Any:
    """The items of a :func:`_reachable` dict, or the attributes of a holder."""
    return o if isinstance(o, (dict, SlotView, ClassView)) else _dict_of(o, "__dict__")


class ClassView:
    """The plain class attributes of a holder's class and its user bases (``use_bank =
    False`` in a config's class body, set later on the class: ``Config.use_bank = True``),
    most derived first, as :func:`_reachable` lists an entry: no instance dict moves when
    they change."""

    __slots__ = ("cls", "parts", "__weakref__")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        #: per class of the MRO with plain attributes: its attribute map and their names, read
        #: at C speed at every forward (:func:`_class_ids`; an HF config's class and bases hold
        #: dozens)
        self.parts: list[tuple[Any, tuple[str, ...]]] = []
        for klass in cls.__mro__:
            if klass is object or _library(klass.__module__):
                continue
            names = tuple(
                k for k, v in klass.__dict__.items() if not k.startswith("__") and is_scalar(v)
            )
            if names:
                self.parts.append((klass.__dict__, names))

    def items(self) -> list[tuple[str, Any]]:
        out: dict[str, Any] = {}
        for klass in self.cls.__mro__:
            if klass is object or _library(klass.__module__):
                continue
            for k, v in klass.__dict__.items():
                if k not in out and not k.startswith("__") and is_scalar(v):
                    out[k] = v
        return list(out.items())

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]


_CLASS_VIEWS: "weakref.WeakKeyDictionary[type, ClassView | None]" = weakref.WeakKeyDictionary()


def _class_view(cls: type) -> ClassView | None:
    """The :class:`ClassView` of ``cls`` (one per class), None for a class with no plain
    attributes of a user's class, or one that cannot be held weakly."""
    try:
        view = _CLASS_VIEWS.get(cls, MISSING)
    except TypeError:
        return None
    if view is MISSING:
        view = ClassView(cls)
        if not view.items():
            view = None
        _CLASS_VIEWS[cls] = view
    return view


def _class_ids(v: ClassView) -> tuple:
    return tuple([tuple(map(id, map(d.get, names))) for d, names in v.parts])


_dict_of = object.__getattribute__  # (``o.__dict__`` past a class's own __getattribute__)


def _holder_tag(o: Any) -> int:
    return dict_version(_dict_of(o, "__dict__"))  # (read again: replaced wholesale, it moves)


def _holder_ids(o: Any) -> tuple:
    d = _dict_of(o, "__dict__")
    return tuple(d), tuple(map(id, d.values()))


def _dict_ids(d: dict) -> tuple:
    return tuple(d), tuple(map(id, d.values()))


def _ordered_tag(d: dict) -> tuple:
    return dict_version(d), tuple(d)  # (``move_to_end`` moves no tag)


def _list_ids(c: list) -> tuple:
    return tuple(map(id, c))


def _set_ids(c: set) -> frozenset:
    return frozenset(map(id, c))


def _slot_ids(v: SlotView) -> tuple:
    return tuple([(k, id(x)) for k, x in v.items()])


def _readers(o: Any) -> tuple:
    """How to read which object each item or attribute of a :func:`_reachable` entry holds:
    by its dict's version tag (where there is one), and by names and ids."""
    if type(o) is SlotView:
        return _slot_ids, _slot_ids
    if type(o) is ClassView:
        return _class_ids, _class_ids
    if isinstance(o, list):
        return _list_ids, _list_ids
    if isinstance(o, set):
        return _set_ids, _set_ids
    if isinstance(o, dict):
        return (_ordered_tag if isinstance(o, OrderedDict) else dict_version), _dict_ids
    return _holder_tag, _holder_ids


def _global_token() -> Any:
    dicts, flag = global_hooks()
    return (hook_ids(dicts), flag) if any(dicts) or flag is not None else 0


def _identity_signature(
    modules: list[nn.Module], watched: list[tuple], exact: bool = False, outside: list = ()
) -> tuple:
    """Which object every slot holds (and each buffer's storage, the submodules, the hooks,
    the contents of the holders and containers in ``watched``), cheaply: if it is the same as
    at the last forward, no field can have changed. The plain objects behind its ids are kept
    alive by the guard (:meth:`Guard._settle`), so equal ids are the same objects.

    Each module's slots, submodules and hooks stand as the version tags of their dicts
    (:func:`~lightning_replay.slots.slot_token`), a few C calls, unless ``exact`` or the
    interpreter has none; then as :func:`~lightning_replay.slots.identities`. Two equal
    signatures of the first kind imply equal ones of the second; unequal tags can still hold
    the same objects (a slot written and put back), which the ``exact`` kind tells. The
    modules' entries come last, each with its slot token first
    (:meth:`Guard.take_tokens`); before them, with the holders and containers, which object
    each attribute in ``outside`` (:attr:`Guard.outside`) holds."""
    tags = dict_version is not None and not exact
    read = 3 if tags else 4  # (the entry's reader by tags, or by ids)
    out = [_global_token(), _watched_ids(watched, read, outside)]
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
        out.append((slot_token(d) if tags else identities(d), ptrs))
    return tuple(out)


class _Watched(list):
    """:func:`_reachable`'s list, with the holders among its entries apart (``split``, made at
    the first read): their version tags are read at C speed, a Python call per holder
    costing milliseconds a forward at thousands of them (a list of layer configs)."""

    split: tuple | None = None


def _tags_read(watched: list[tuple]) -> tuple:
    split = getattr(watched, "split", None)
    if split is None:
        holders = [w[2] for w in watched if w[3] is _holder_tag]
        others = [w for w in watched if w[3] is not _holder_tag]
        split = (holders, others)
        if type(watched) is _Watched:
            watched.split = split
    holders, others = split
    tags = tuple(map(dict_version, map(_dict_of, holders, repeat("__dict__"))))
    return tags, tuple([w[3](w[2]) for w in others])


def _watched_ids(watched: list[tuple], read: int, outside: list) -> tuple:
    ids = _tags_read(watched) if read == 3 else tuple([w[read](w[2]) for w in watched])
    if not outside:
        return ids
    return ids, tuple([_outside_token(d.get(n, MISSING)) for d, n, _ in outside])


def _contents(o: Any) -> Any:
    """A container's items as a value to compare: copies of plain values (keys in order),
    else which object each item holds."""
    c = copy_plain(o)
    if c is not MISSING:
        return tuple(c.items()) if isinstance(c, dict) else c
    if isinstance(o, dict):
        return tuple([(k, _token(v)) for k, v in o.items()])
    return frozenset(map(_token, o)) if isinstance(o, (set, frozenset)) else tuple(map(_token, o))


def _token(v: Any, depth: int = 0) -> Any:
    """An item or attribute as a value to compare: a plain value by value; a tuple, a
    ``functools.partial``, a closure or a bound method by what it holds (a new one each
    step, equal, is the same value; one the guard does not keep, freed and another at its
    address, is told apart by what it holds); other objects by id (kept by the guard)."""
    t = type(v)
    if is_scalar(v):
        return (t, v)
    if depth < _TOKEN_DEPTH:
        if t is tuple:
            return (tuple, tuple([_token(x, depth + 1) for x in islice(v, _WATCH_LIMIT)]))
        if t is functools.partial:
            kw = tuple([(k, _token(x, depth + 1)) for k, x in v.keywords.items()])
            return (t, _token(v.func, depth + 1), _token(v.args, depth + 1), kw)
        if t is types.FunctionType and v.__closure__:
            return (t, id(v.__code__), tuple([_token(c, depth + 1) for c in closure_contents(v)]))
        if t is types.MethodType:
            return (t, id(v.__func__), _token(v.__self__, depth + 1))
    return id(v)


_TOKEN_DEPTH = 4


def _carries_tensor(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` holds a tensor (or a module with one that no installed model registers),
    in its items, attributes, or what a partial, closure or bound method holds, to
    ``_TOKEN_DEPTH`` levels down: kept by the guard, one that a step replaces would keep the
    tensor alive until the next forward."""
    t = type(v)
    if issubclass(t, torch.Tensor):
        return True
    if issubclass(t, nn.Module):
        return is_holder(v) and not _holds_no_tensor(v)
    if depth >= _TOKEN_DEPTH or is_scalar(v):
        return False
    if issubclass(t, (list, tuple, set, frozenset)):
        items: Any = v
    elif issubclass(t, dict):
        items = v.values()
    elif t is functools.partial:
        items = (v.func, *v.args, *v.keywords.values())
    elif t is types.FunctionType:
        items = closure_contents(v)
    elif t is types.MethodType:
        items = (v.__self__,)
    elif t is SlotView:
        items = v.values()
    elif is_holder(v):
        items = [x for store in holder_stores(v) for x in _attrs(store).values()]
    else:
        return False
    return any(_carries_tensor(x, depth + 1) for x in islice(items, _WATCH_LIMIT))


#: types whose values hold nothing: a container of only these is passed over at C speed
_PLAIN_TYPES = frozenset({int, float, bool, str, bytes, complex, type(None)})


def _carrier_items(items: Any, carriers: dict) -> bool:
    """Whether ``items`` (a watched container's or holder's) include a tensor or an unregistered
    module with one; the tuples, partials and closures among them that carry one go into
    ``carriers`` (by id). Containers and holders among them are watched entries of their own."""
    if set(map(type, items)) <= _PLAIN_TYPES:
        return False
    found = False
    for v in items:
        t = type(v)
        if t in _PLAIN_TYPES:
            continue
        if issubclass(t, torch.Tensor):
            found = True
        elif issubclass(t, nn.Module):
            found = found or (is_holder(v) and not _holds_no_tensor(v))
        elif (t is tuple or t in _WRAPPERS) and _carries_tensor(v):
            carriers[id(v)] = v
            found = True
    return found


def _parts(v: Any, out: list, depth: int = 0) -> None:
    """What a tuple, partial, closure or bound method that carries a tensor holds, into
    ``out``, save the tensors and what carries them: the objects its :func:`_token` names by
    id, which the guard keeps (modules by weak reference) where it does not keep ``v``. A
    container or holder adds nothing: its items are its watched entry's."""
    t = type(v)
    if t is tuple:
        items: Any = v
    elif t is functools.partial:
        items = (v.func, *v.args, *v.keywords.values())
    elif t is types.FunctionType:
        items = closure_contents(v)
    elif t is types.MethodType:
        items = (v.__func__, v.__self__)
    else:
        return
    for x in islice(items, _WATCH_LIMIT):
        if is_scalar(x) or issubclass(type(x), torch.Tensor):
            continue
        if issubclass(type(x), nn.Module):
            out.append(x)  # (named by weak reference)
        elif depth + 1 < _TOKEN_DEPTH and _carries_tensor(x, depth + 1):
            _parts(x, out, depth + 1)
        else:
            out.append(x)


def fingerprint(
    modules: list[nn.Module],
    varying: set,
    watched: list[tuple] | None = None,
    outside: list[tuple] = (),
) -> dict[Hashable, Any]:
    """What the segment's behaviour may depend on, without the fields in ``varying``.

    ``watched``: :func:`_reachable` of the modules now, if at hand. A holder's attributes are
    fields like the module's own (``(i, "a", "cfg.use_bank")``); a container's contents are one
    field (a list appended to by every forward changes once, then is left to the replay, which
    puts its forward contents back); hook functions are fields of their own (the replay runs
    the forward's), the hooks' keys, the order of the slot dicts and the submodules are
    structure. ``outside``: attributes read from outside the modules (:attr:`Guard.outside`),
    fields ``(OUTSIDE, "a", name)`` like the modules' own."""
    if watched is None:
        watched = _reachable(modules, outside)
    dicts, flag = global_hooks()
    # how many global hooks, not their handles' keys, as for a module's own hooks below: a
    # global hook registered around each forward (activation statistics) is the same structure
    fp: dict[Hashable, Any] = {"global_hooks": (tuple(len(h) if h else 0 for h in dicts), flag)}
    key = (0, "h", "<torch global hooks>")
    if any(dicts) and key not in varying:
        fp[key] = hook_ids(dicts)
    for i, m in enumerate(modules):
        d = m.__dict__
        hooks = [d.get(h) for h in HOOK_DICTS]
        sub = d["_modules"]
        fp[(i, "training")] = d.get("training")
        # how many hooks, not their handles' keys: a hook removed and registered again each
        # step (a logging callback) is the same structure; its function is a field below
        fp[(i, "hooks")] = tuple(len(h) if h else 0 for h in hooks)
        fp[(i, "modules")] = tuple(sub), tuple(map(_submodule_tag, sub.values()))
        fp[(i, "order")] = tuple(d["_parameters"]), tuple(d["_buffers"])
        for name, h in zip(HOOK_DICTS, hooks):
            key = (i, "h", name)
            if h and key not in varying:
                fp[key] = tuple(map(id, h.values()))
        for k, v in d["_parameters"].items():
            key = (i, "p", k)
            if key not in varying:
                fp[key] = id(v)
        for k, v in d["_buffers"].items():
            key = (i, "b", k)
            if key not in varying:
                fp[key] = (id(v), _storage_ptr(v))  # a new storage is a new buffer
        for k, v in d.items():
            if k in MODULE_INTERNALS or k == "training" or issubclass(type(v), _CONTAINERS):
                continue  # (containers: with the holders below)
            key = (i, "a", k)
            if key not in varying:
                fp[key] = _value(v)
    for d, n, label in outside:
        key = (OUTSIDE, "a", label)
        v = d.get(n, MISSING)
        if key not in varying and not issubclass(type(v), _CONTAINERS):
            fp[key] = _outside_value(v)  # (containers: with the holders below)
    for i, path, o, *_ in watched:
        if path in _SLOT_DICTS:
            continue  # (their order is structure, above)
        if issubclass(type(o), _CONTAINERS):
            key = (i, "a", path)
            if key not in varying:
                fp[key] = (type(o), _contents(o))
            continue
        for k, v in _attrs(o).items():
            key = (i, "a", f"{path}.{k}")
            if key not in varying and not issubclass(type(v), _CONTAINERS):
                fp[key] = _value(v)
    return fp


def _submodule_tag(m: Any) -> Any:
    """A submodule as module structure: a stateless one (no parameter, buffer, tensor or
    generator in its subtree: an activation, a dropout rebuilt each step with the scheduled
    rate) by its class, as the replay puts the forward's object back (slots) and a new one
    adds nothing to preserve; any other by identity (new state the contract does not cover)."""
    if not isinstance(m, nn.Module):
        return id(m)
    for s in m.modules():
        d = s.__dict__
        if d["_parameters"] or d["_buffers"]:
            return id(m)
        for v in d.values():
            if isinstance(v, (torch.Tensor, torch.Generator)):
                return id(m)
    return type(m)


def _watch_ids(watched: list[tuple]) -> list[tuple]:
    return [(i, p, id(o.obj) if type(o) is SlotView else id(o)) for i, p, o, *_ in watched]


def _hooks(m: nn.Module) -> list[dict]:
    d = m.__dict__
    return [h for h in (d.get(n) for n in HOOK_DICTS) if h]


def _value(v: Any) -> tuple:
    """An attribute as a fingerprint field: plain values by value (a tuple of them too: one
    re-created equal each step is the same value), other objects by id."""
    if is_scalar(v):
        return (type(v), v)
    if type(v) is tuple:
        c = copy_plain(v)
        if c is not MISSING:
            return (tuple, c)
    return (type(v), _token(v))


def _outside_token(v: Any) -> Any:
    """Which object an attribute read from outside holds, and for a one-element tensor or a
    small array (a flag, a step counter), its bytes' version: written in place, it is
    another value."""
    t = type(v)
    try:
        if issubclass(t, torch.Tensor) and v.numel() <= 1:
            return id(v), v._version
        if issubclass(t, np.ndarray) and v.size <= 64:
            return id(v), v.tobytes()
    except Exception:  # (a wrapper tensor without a version, a dead buffer)
        pass
    return id(v)


def _outside_value(v: Any) -> tuple:
    """An attribute read from outside as a fingerprint field (see :func:`_outside_token`)."""
    tok = _outside_token(v)
    return (type(v), tok) if type(tok) is tuple else _value(v)


def _discrete(key: Hashable, value: Any) -> bool:
    """Flags, hooks, module structure, strings and enums: each value seen is re-probed once."""
    if not isinstance(key, tuple) or len(key) == 2:
        return True
    if key[1] != "a" or value is _ABSENT:
        return False
    return is_flag(value[1])


def is_flag(v: Any) -> bool:
    """A plain value whose change is a change of mode (a bool, a string or enum, None, a
    dtype): a discrete field. Numbers, numpy's too, are continuous (a step counter, a
    schedule's value)."""
    return is_scalar(v) and (type(v) is bool or not isinstance(v, numbers.Number))


def _flag_death(flag: list, _ref: Any) -> None:
    """A weak reference's callback: an object a guard names by weak reference died."""
    flag[0] = True


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

    def __init__(self, modules: list[nn.Module], name: str = "") -> None:
        self.modules = modules
        self.name = name  # the segment's, for the warning a limit of the walk gives
        self._cut: set[str] = set()  # paths past the walk's limits already warned about
        self.varying: set = set()
        self.seen: dict[Hashable, set] = {}
        self.base: dict[Hashable, Any] | None = None
        self._pending: list = []
        self._fast: tuple | None = None
        self._exact: tuple | None = None  # the identities behind ``_fast`` (version tags)
        self._alive: list = []  # the objects ``_exact`` names by id (see _settle)
        # ... and those it names by weak reference (modules: their tensors), with the flag
        # their deaths set (a cell, not the guard: no cycle through the callbacks)
        self._weak: list[weakref.ref] = []
        self._died = [False]
        self._on_death = functools.partial(_flag_death, self._died)
        self._watched: list[tuple] = []  # the holders and containers it covers (_reachable)
        #: attributes the segment's forward read from outside its modules, as (the dict that
        #: holds it, its name, its name in the model): fields like the modules' own
        self.outside: list[tuple[dict, str, str]] = []
        #: comparisons of numbers the probes' forwards read (``add_predicates``): per (dict,
        #: name, operator, other operand), [dict, name, label, operator, other operand, the
        #: outcomes probes saw per way, the other operand's (dict, name, label) or None]
        self.predicates: dict[tuple, list] = {}
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
        return None if now is None else [m[0] for m in now[2:]]

    def add_predicates(self, items: list[tuple]) -> None:
        """Comparisons a probe's forward made of numbers it read, as (the dict that holds the
        number, its name, its name in the model, the operator's name, the other operand, the
        number before the forward, the number compared, and when the other operand is such a
        number too, its (dict, name, name in the model), else None): a step counter or a
        schedule's value gating a branch. The number itself is no precondition (it changes
        every step, and the replay puts the forward's back); each comparison's outcome is: one
        no probe saw makes the forward a probe (:meth:`changed`), which learns the branch it
        opens. Two such numbers compared (``count >= limit``, both moving) are compared as
        they both are then.

        The guard runs before the forward, so it compares the number as it is then. A forward
        that changes the number before comparing it (``self.calls += 1``) compared another
        value than that: the change is kept as a step (added, and as a factor), and the guard
        compares the number so changed too, each way with the outcomes probes saw that way."""
        for d, name, label, op, operand, before, value, field, *rest in items:
            expr = rest[0] if rest else ()  # arithmetic on the number before the comparison
            other = operand if field is None else field[2]  # (a number's name: key, record)
            key = (id(d), name, op, other, expr)
            entry = self.predicates.get(key)
            if entry is None:
                entry = self.predicates[key] = [d, name, label, op, other, {}, field, expr]
            ways = entry[5]
            new = [("as", None)]
            if value != before and len(ways) < _MAX_WAYS:
                new.append(("add", value - before))
                if before:
                    new.append(("mul", value / before))
            for way in new:
                x = _computed(_moved(before, way), expr)
                r = "error" if x is None else _COMPARE[op](x, operand)
                ways.setdefault(way, set()).add(r)

    def _outcomes(self, entry: list) -> list[tuple[set, bool]] | None:
        """Each way's outcomes seen (:meth:`add_predicates`) beside its outcome now; None when
        either operand is no longer a number (the fingerprint's own fields say so)."""
        d, name, _, op, other, ways, field, expr = entry
        v = _number(d, name)
        if field is not None:
            other = _number(field[0], field[1])
        if v is None or other is None:
            return None
        compare = _COMPARE[op]
        out = []
        for way, seen in ways.items():
            x = _computed(_moved(v, way), expr)
            out.append((seen, "error" if x is None else compare(x, other)))
        return out

    def _turned(self) -> list[Hashable]:
        """The comparisons (:meth:`add_predicates`) whose outcome now no probe saw."""
        out = []
        for entry in self.predicates.values():
            now = self._outcomes(entry)
            if now is not None and any(r not in seen for seen, r in now):
                label, op, other, expr = entry[2], entry[3], entry[4], entry[7]
                if expr:
                    label = f"{label} (after {' '.join(step[0] for step in expr)})"
                out.append((OUTSIDE, "p", f"{label} {_SYMBOLS[op]} {other!r}"))
        return out

    def changed(self) -> list[Hashable]:
        """Fields that differ from every value the contract has seen (empty: replay on)."""
        if self.predicates:
            turned = self._turned()
            if turned:
                self._pending = []
                return turned
        watched = self._watched
        fast = self._now = _identity_signature(self.modules, watched, outside=self.outside)
        exact = None
        # (an object the signatures name by weak reference died: its id may be another's now,
        # so the fingerprint, which names an object by its type too, tells)
        if self.base is not None and not self._died[0]:
            if fast == self._fast:
                self._pending = []
                return []  # the same objects in every slot as last time: nothing can differ
            if dict_version is not None and self._exact is not None:
                # tags moved: the same objects still (written and put back)? then settle on
                # the new tags; else ``exact`` is the signature the fingerprint below settles on
                exact = self._exact_now(fast)
                if exact == self._exact:
                    self._fast = fast
                    self._pending = []
                    return []
        watched = _reachable(self.modules, self.outside)
        fp = fingerprint(self.modules, self.varying, watched, self.outside)
        base = self.base
        if base is None or fp == base:
            self._pending = []
            self._settle(fast, exact, watched)
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
            self._settle(fast, exact, watched)
        self._pending = [(k, fp.get(k, _ABSENT)) for k in new]
        return sorted(new, key=repr)

    def _exact_now(self, fast: tuple) -> tuple:
        """The exact signature now, given ``fast`` read now: read again only for the parts
        whose tags moved since the last settle (a config that a model writes and puts back at
        every forward; one module's annealed value), the settled one's elsewhere (equal tags:
        the same objects)."""
        out = list(self._exact)
        for k, (now, then) in enumerate(zip(fast, self._fast)):
            if now == then:
                continue
            if k == 0:
                out[0] = now  # (the global hooks' part has no tags)
            elif k == 1:
                out[1] = _watched_ids(self._watched, 4, self.outside)
            else:
                out[k] = identities(self.modules[k - 2].__dict__), now[1]
        return tuple(out)

    def _settle(self, fast: tuple, exact: tuple | None = None, watched: list | None = None) -> None:
        """``fast`` (read now) is the signature of a fingerprint the contract covers;
        ``exact``, its identities if already read in this forward; ``watched``, the holders
        and containers reachable now (:func:`_reachable`), if at hand. Both signatures are
        read again where those are not the ones they were read with.

        The plain objects in the slots now are kept alive with it: a signature names objects
        by id, and a freed object's id is soon another's (a float rebound each step takes
        the freed one's address), which would read as the same object holding another value.
        Tensors are not kept (a rebound queue would stay alive a step longer): a new tensor at
        a freed one's id is a slot whose contract entry the replay captures and checks
        anyway. Modules (a module held in a container attribute, with its parameters) are
        named by weak reference: one replaced is freed with the step that replaced it, and
        its death makes the next :meth:`changed` read the fingerprint.

        Containers and holders are not kept where one of them holds a tensor (or a module
        with one that no installed model registers): a step that rebinds the container would
        keep what it held alive until the next forward. The signatures are then no proof, and
        every forward reads the fingerprint."""
        if watched is None:
            watched = _reachable(self.modules, self.outside)
        alive = [v for m in self.modules for v in m.__dict__.values()]
        alive += [d.get(n) for d, n, _ in self.outside]
        alive += [f for m in self.modules for h in _hooks(m) for f in h.values()]
        alive += [f for h in global_hooks()[0] if h for f in h.values()]
        carriers: dict[int, Any] = {}
        loose = False
        for _, path, o, *_ in watched:
            items = list(o) if isinstance(o, (list, set)) else _attrs(o).values()
            alive += items
            if path not in _SLOT_DICTS and type(o) is not ClassView:
                loose = _carrier_items(items, carriers) or loose
        for m in self.modules:  # (a tuple, partial or closure the module holds directly)
            _carrier_items(
                [v for k, v in m.__dict__.items() if k not in MODULE_INTERNALS], carriers
            )
        _carrier_items([d.get(n) for d, n, _ in self.outside], carriers)
        if loose or carriers:
            # An object the signatures name holds a tensor (a container or holder with one, a
            # tuple, a partial or closure over one): kept here, one that a step rebinds
            # (``self.bank = {"w": new}``) would keep what it held alive until the next
            # forward. No container, holder or carrier is kept; without them equal ids prove
            # nothing, so every forward reads the fingerprint (by value, and by what the
            # carriers hold: _token); what they hold but tensors stays kept, and the tensors
            # are the contract's, captured at each step.
            gone = {id(o.obj if type(o) is SlotView else o) for _, _, o, *_ in watched}
            gone.update(carriers)
            parts: list = []
            for v in carriers.values():
                _parts(v, parts)
            alive = [v for v in alive if id(v) not in gone] + parts
            self._watched, self._fast, self._exact = _Watched(), None, None
        else:
            if _watch_ids(watched) != _watch_ids(self._watched):
                fast = _identity_signature(self.modules, watched, outside=self.outside)
                exact = None
            self._watched = watched
            self._fast = fast
            if exact is None:
                exact = (
                    _identity_signature(self.modules, watched, exact=True, outside=self.outside)
                    if dict_version
                    else fast
                )
            self._exact = exact
        keep, weak = [], []
        for v in alive:
            t = type(v)
            if issubclass(t, nn.Module):
                weak.append(weakref.ref(v, self._on_death))
            elif not issubclass(t, torch.Tensor):
                keep.append(v)
        self._alive, self._weak = keep, weak
        self._died[0] = False

    def learn_varying(self, keys: list[Hashable], keep: set = frozenset()) -> None:
        """Fields the probe saw change inside the window: the replay puts them back, so they
        are not preconditions. So are the attribute fields that changed since the probe's
        forward began (:meth:`accept`) and this window's end, now, among them those only the
        guard reads: a holder's attributes (a config's ``problem_type`` that the loss sets
        after the layers ran), a container's contents. Except those in ``keep``: flags the
        probe's forward read as they were when it began, which stay preconditions (the next
        forward reads the new value)."""
        keys = list(keys)
        base = self.base
        if base is not None:
            now = fingerprint(self.modules, self.varying, outside=self.outside)
            keys += [
                k
                for k in now.keys() | base.keys()
                if isinstance(k, tuple)
                and len(k) == 3
                and k[1] == "a"
                and k not in keep
                and now.get(k, _ABSENT) != base.get(k, _ABSENT)
            ]
        self.varying.update(keys)
        if base is not None:
            for k in keys:
                base.pop(k, None)

    def accept(self) -> None:
        """The contract now covers the current fingerprint (after a probe of this forward)."""
        for entry in self.predicates.values():
            for seen, r in self._outcomes(entry) or ():
                seen.add(r)
        for key, value in self._pending:
            if _discrete(key, value):
                self.seen.setdefault(key, set()).add(value)
            else:
                self.varying.add(key)
        self._pending = []
        watched = self._reach()
        self._settle(
            _identity_signature(self.modules, watched, outside=self.outside), watched=watched
        )
        self.base = fingerprint(self.modules, self.varying, watched, self.outside)
        for key, value in self.base.items():
            if _discrete(key, value):
                self.seen.setdefault(key, set()).add(value)

    def _reach(self) -> list[tuple]:
        """:func:`_reachable` at a probe, warning once per path the walk's limits leave
        unwatched (a config nested deeper than ``_WATCH_DEPTH``, a list longer than
        ``_WATCH_LIMIT``): a flag there changed between steps would go unseen."""
        cut: list = []
        watched = _reachable(self.modules, self.outside, cut)
        new = [p for p in cut if p not in self._cut]
        if new:
            self._cut.update(new)
            warnings.warn(
                f"lightning_replay: segment '{self.name or '?'}': the guard does not watch "
                f"what lies below {', '.join(map(str, new[:4]))} (deeper than {_WATCH_DEPTH} "
                f"levels or past {_WATCH_LIMIT} items). A flag there changed between steps is "
                "seen only by the sampled checks; keep such settings nearer the module, or set "
                "preservation='retain' for this segment.",
                stacklevel=3,
            )
        return watched

    def watch_outside(self, reads: list[tuple[dict, str, str, Any]]) -> None:
        """Attributes a probe's forward read from outside the segment's modules, as (the dict
        that holds it, its name, its name in the model, its value as the forward first read
        it), join the fingerprint: the contract was learned under those values. An attribute
        already watched keeps its entry."""
        known = {(id(d), n) for d, n, _ in self.outside}
        new = [r for r in reads if (id(r[0]), r[1]) not in known]
        if not new:
            return
        self.outside = self.outside + [(d, n, label) for d, n, label, _ in new]
        watched = self._reach()
        if self.base is not None:
            now = fingerprint(self.modules, self.varying, watched, self.outside)
            # as the forward first read them, before any write of its own: one it wrote is
            # learned as varying at the window's end (learn_varying), as a module's own is
            for d, n, label, v in new:
                key, cur = (OUTSIDE, "a", label), d.get(n, MISSING)
                if key in self.varying:
                    continue
                if not issubclass(type(cur), _CONTAINERS):
                    now[key] = _outside_value(v)
                elif issubclass(type(v), _CONTAINERS):
                    now[key] = (type(cur), _contents(v))
            for key, value in now.items():
                if key in self.base or not (isinstance(key, tuple) and key[0] == OUTSIDE):
                    continue
                self.base[key] = value
                if _discrete(key, value):
                    self.seen.setdefault(key, set()).add(value)
        self._settle(
            _identity_signature(self.modules, watched, outside=self.outside), watched=watched
        )


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
