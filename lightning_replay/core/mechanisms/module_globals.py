"""Module-level values a segment's code reads: part of its contract.

A forward may read a value that lives at module level instead of on a module: a gradient-reversal
coefficient the training loop steps (``GRL["lambda"] *= 0.9``), a global schedule, a feature
flag. No guard sees such a value change, and a replay that reads the new one computes another
gradient than the forward's, silently. The bytecode names those reads: ``LOAD_GLOBAL`` (and
``STORE_GLOBAL``) in the methods of the segment's module classes and, one call down, in the
module-level functions they name. :func:`globals_read` returns the ones whose values can change
unseen, plain values (numbers, strings, enums, small containers of them), as ``(module, name)``
pairs. The engine treats them like attributes read from modules outside the segment
(:func:`lightning_replay.slots.capture_outside`): captured at every forward, put back for the
replay and restored after it.

Example:
    >>> import torch
    >>> SCALE = {"lam": 1.0}
    >>> class Grl(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.detach() + SCALE["lam"] * (x - x.detach())
    >>> [name for _, name in globals_read([Grl()])]
    ['SCALE']

Reads one attribute down are found too: ``settings.lam`` of an imported module of the user's,
``FLAGS.on`` of a module-level object.
"""

from __future__ import annotations

import dis
import sys
import types
import weakref
from typing import Any, Iterable

from torch import nn

from lightning_replay.core.mechanisms.slots import HOOK_DICTS, MISSING, copy_plain, is_scalar

#: Code from these packages keeps no training state at module level.
_LIBRARY_ROOTS = ("torch", "numpy", "math", "builtins", "typing", "functools", "collections", "abc")
_MAX_ITEMS = 64  # a larger module-level container is copied every call: left out
_DEPTH = 1  # module-level functions followed this many calls down


#: a module of this package's machinery sets this to True (the swapped classes' ``forward``
#: in ``attach`` reads the runtime/engine keys): its module-level values are never the user's
#: state. Not the whole package: its demos, apps and examples hold models as users write them.
MACHINERY_FLAG = "_REPLAY_MACHINERY"


def _library(module_name: str | None) -> bool:
    root = (module_name or "").split(".", 1)[0]
    if root in _LIBRARY_ROOTS:
        return True
    return bool(getattr(sys.modules.get(module_name or ""), MACHINERY_FLAG, False))


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _global_names(
    fn: types.FunctionType,
) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """The module-level names ``fn`` reads or writes, the ``(name, attribute)`` pairs it
    reads one attribute down (``settings.lam``, ``FLAGS.on``), and the attributes it reads
    from its first argument (``self.temp``: a class attribute where the instance has none)."""
    names: set[str] = set()
    attrs: set[tuple[str, str]] = set()
    own: set[str] = set()
    first = fn.__code__.co_varnames[0] if fn.__code__.co_argcount else None
    for code in _codes(fn.__code__):
        prev = None
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "STORE_GLOBAL") and isinstance(ins.argval, str):
                names.add(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev is not None:
                if not isinstance(ins.argval, str):
                    pass
                elif prev.opname == "LOAD_GLOBAL":
                    attrs.add((prev.argval, ins.argval))
                elif prev.opname == "LOAD_FAST" and prev.argval == first and code is fn.__code__:
                    own.add(ins.argval)
            if ins.opname not in ("CACHE", "EXTENDED_ARG"):
                prev = ins
    return names, attrs, own


class Globals:
    """Stands for a globals dict no module in ``sys.modules`` owns (code run by ``exec``, a
    doctest): its ``__dict__`` is that dict, which is what capture_outside swaps in."""

    def __init__(self, d: dict) -> None:
        self.__dict__ = d

    def __repr__(self) -> str:
        return f"<globals of {self.__dict__.get('__name__', '?')}>"


def _owner(fn: types.FunctionType) -> Any:
    """The module whose ``__dict__`` is ``fn``'s globals, else a :class:`Globals` for it."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    return mod if mod is not None and mod.__dict__ is fn.__globals__ else Globals(fn.__globals__)


class ClassAttrs:
    """Stands for a user class whose attribute a forward reads (``self.temp`` with no instance
    attribute, ``Block.temp``, ``type(self).temp``): its ``__dict__`` sets and removes class
    attributes, which is how capture_outside puts one back (a class's own ``__dict__`` is
    read-only)."""

    __slots__ = ("cls", "_attrs")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self._attrs = _ClassDict(cls)

    @property
    def __dict__(self) -> "_ClassDict":  # type: ignore[override]
        return self._attrs


class _ClassDict:
    """The part of the dict protocol the slots code uses, on a class's attributes."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def get(self, name: str, default: Any = None) -> Any:
        return self.cls.__dict__.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self.cls.__dict__[name]

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.cls, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.cls.__dict__.get(name, default)
        if name in self.cls.__dict__:
            delattr(self.cls, name)
        return value


_CLASSES: "weakref.WeakKeyDictionary[type, ClassAttrs]" = weakref.WeakKeyDictionary()


def _class_owner(cls: type, name: str) -> ClassAttrs | None:
    """The user class in ``cls``'s MRO that defines ``name`` with a plain value, as an owner."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            if (
                _library(klass.__module__)
                or type(klass) is not type  # an Enum's members and the like: not settable
                or not _plain(klass.__dict__[name])
            ):
                return None
            owner = _CLASSES.get(klass)
            if owner is None:
                owner = _CLASSES[klass] = ClassAttrs(klass)
            return owner
    return None


def _plain(value: Any) -> bool:
    if is_scalar(value):
        return True
    if type(value) in (list, dict, set, tuple):
        return len(value) <= _MAX_ITEMS and copy_plain(value) is not MISSING
    return False


def _functions(cls: type) -> Iterable[types.FunctionType]:
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or _library(klass.__module__):
            continue
        for v in vars(klass).values():
            fn = getattr(v, "__func__", v)  # static and class methods too
            if isinstance(fn, property):
                fn = fn.fget
            fn = getattr(fn, "__wrapped__", fn)
            if isinstance(fn, types.FunctionType):
                yield fn


def _hook_functions(modules: list[nn.Module]) -> Iterable[types.FunctionType]:
    """The Python functions registered as hooks on ``modules`` (bound methods and partials
    unwrapped)."""
    for m in modules:
        for name in HOOK_DICTS:
            hooks = m.__dict__.get(name)
            for h in hooks.values() if isinstance(hooks, dict) else ():
                fn = getattr(h, "func", h)  # functools.partial
                fn = getattr(fn, "__func__", fn)  # a bound method
                fn = getattr(fn, "__wrapped__", fn)
                if isinstance(fn, types.FunctionType):
                    yield fn


def _holder(value: Any) -> bool:
    """A module-level object whose attributes a forward may read as settings: a module or a
    plain instance (not a class, a function, an nn.Module or a tensor)."""
    if isinstance(value, types.ModuleType):
        return not _library(value.__name__)
    return (
        not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, nn.Module))
        and type(value).__module__ is not None
        and not _library(type(value).__module__)
        and isinstance(getattr(value, "__dict__", None), dict)
    )


def globals_read(modules: Iterable[nn.Module]) -> list[tuple[Any, str]]:
    """The module-level plain values the code of ``modules``' classes reads or writes, each
    once, as ``(owner, name)``: a module and a global name, or a module-level object (or an
    imported module) and the attribute read from it. Library code (torch's) is left out."""
    out: dict[tuple[int, str], tuple[Any, str]] = {}
    seen: set[int] = set()
    modules = list(modules)
    classes = {type(m) for m in modules}
    todo = [(fn, 0) for cls in classes for fn in _functions(cls)]
    todo += [(fn, 0) for fn in _hook_functions(modules)]  # (the replay runs them too)
    read_from_self: set[str] = set()
    while todo:
        fn, depth = todo.pop()
        if id(fn.__code__) in seen or _library(fn.__module__):
            continue
        seen.add(id(fn.__code__))
        owner = _owner(fn)
        names, attrs, own = _global_names(fn)
        if depth == 0:
            read_from_self |= own
        for name in names:
            value = fn.__globals__.get(name, MISSING)
            if value is MISSING or name.startswith("__"):
                continue
            if isinstance(value, types.FunctionType):
                if depth < _DEPTH:
                    todo.append((value, depth + 1))
            elif _plain(value):
                out.setdefault((id(vars(owner)), name), (owner, name))
        for name, attr in attrs:
            holder = fn.__globals__.get(name, MISSING)
            if holder is MISSING or attr.startswith("__"):
                continue
            if isinstance(holder, type):  # Block.temp: a class attribute
                cls_owner = _class_owner(holder, attr)
                if cls_owner is not None:
                    out.setdefault((id(cls_owner.cls), attr), (cls_owner, attr))
                continue
            if not _holder(holder):
                continue
            value = vars(holder).get(attr, MISSING)
            if value is not MISSING and _plain(value):
                out.setdefault((id(vars(holder)), attr), (holder, attr))
    # self.temp where no instance holds ``temp``: the class's attribute, which a training
    # loop may anneal (Block.temp *= 0.9) with no guard seeing it
    for m in modules:
        inst = vars(m)
        for name in read_from_self:
            if name.startswith("__") or name in inst or name in inst.get("_modules", ()):
                continue
            if name in inst.get("_parameters", ()) or name in inst.get("_buffers", ()):
                continue
            cls_owner = _class_owner(type(m), name)
            if cls_owner is not None:
                out.setdefault((id(cls_owner.cls), name), (cls_owner, name))
    return sorted(out.values(), key=lambda p: (_label(p[0]), p[1]))


def _label(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, Globals):
        return str(owner.__dict__.get("__name__", "?"))
    if isinstance(owner, ClassAttrs):
        return owner.cls.__qualname__
    return type(owner).__qualname__


def describe(owner: Any, name: str) -> str:
    """How a contract names a module-level value: ``module.name`` or ``Type.name``."""
    return f"{_label(owner)}.{name}"
