"""Module-level values a segment's code reads: part of its contract.

A forward may read a value that lives at module level instead of on a module: a gradient-reversal
coefficient the training loop steps (``GRL["lambda"] *= 0.9``), a global schedule, a feature
flag. No guard sees such a value change, and a replay that reads the new one computes another
gradient than the forward's, silently. The bytecode names those reads: ``LOAD_GLOBAL`` (and
``STORE_GLOBAL``) and ``LOAD_DEREF`` of closure cells in the methods of the segment's module
classes (and in the methods and properties of modules outside it that its forward called,
which the probe's tracing names), in the functions its modules hold in attributes
(:func:`held_functions`: a classmethod reading ``cls.gain``, a static or plain function) and,
up to ``_DEPTH`` calls down, in the module-level functions they name. :func:`globals_read` returns the ones whose values can change unseen,
plain values (numbers, strings, enums, small containers of them), as ``(owner, name)`` pairs. The engine treats them like attributes read from modules outside the segment
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

Reads attributes down are found too (``settings.lam`` of an imported module of the user's,
``CFG.model.use_bank`` of a module-level object), items by a constant key of a dict of any
size or a mapping (``BIG["bank"]``, ``os.environ.get("FLAG")``), and class attributes read as
``self.x`` (none on the instance), ``type(self).x`` or ``cls.x``. A container too large to copy
at every call and read otherwise, or more functions than ``_MAX_FUNCTIONS``, is a warning naming
the segment: never silently unwatched.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Iterable

import torch
from torch import nn

from lightning_replay.core.mechanisms.slots import (
    HOOK_DICTS,
    MISSING,
    MODULE_INTERNALS,
    copy_plain,
    is_holder,
    is_scalar,
)

#: Code from these packages keeps no training state at module level.
_LIBRARY_ROOTS = ("torch", "numpy", "math", "builtins", "typing", "functools", "collections", "abc")
_MAX_ITEMS = 64  # a larger module-level container is not copied every call: its items read
# by constant keys are watched (``BIG["bank"]``), and a warning names the rest
_DEPTH = 4  # module-level functions followed this many calls down
_MAX_FUNCTIONS = 512  # functions scanned per segment at most (more: warned)


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


def _global_names(fn: types.FunctionType) -> "_Names":
    """What ``fn``'s bytecode names outside its locals (see :class:`_Names`)."""
    out = _Names()
    first = fn.__code__.co_varnames[0] if fn.__code__.co_argcount else None
    free = set(fn.__code__.co_freevars)
    for code in _codes(fn.__code__):
        top = code is fn.__code__
        chain: list | None = None  # [("g" | "c", name), attr, ...] being loaded
        key: Any = MISSING  # a constant loaded right after a chain (a subscript's key)
        recent: list = []  # the last few instructions (type(self).x, self.__class__.x)
        for ins in dis.get_instructions(code):
            op, arg = ins.opname, ins.argval
            if op in ("CACHE", "EXTENDED_ARG", "PRECALL", "PUSH_NULL", "KW_NAMES"):
                continue
            if op in ("LOAD_GLOBAL", "STORE_GLOBAL") and isinstance(arg, str):
                out.names.add(arg)
                chain, key = ([("g", arg)] if op == "LOAD_GLOBAL" else None), MISSING
            elif op == "LOAD_DEREF" and top and arg in free:  # a closure cell of ``fn``
                out.cells.add(arg)
                chain, key = [("c", arg)], MISSING
            elif op in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(arg, str):
                if chain is not None and key is MISSING:
                    chain = chain + [arg]
                    out.chains.add(tuple(chain))
                else:
                    chain = None
                r = [(i.opname, i.argval) for i in recent[-4:]]
                if r[-1:] == [("LOAD_FAST", first)] and top:
                    out.own.add(arg)  # self.temp
                elif r[-2:] == [("LOAD_FAST", first), ("LOAD_ATTR", "__class__")] or r[-3:] == [
                    ("LOAD_GLOBAL", "type"),
                    ("LOAD_FAST", first),
                    ("CALL", 1),
                ]:
                    out.cls_own.add(arg)  # type(self).temp, self.__class__.temp
                elif r[-2:] == [("LOAD_GLOBAL", "super"), ("CALL", 0)]:
                    out.super_own.add(arg)  # super().temp: a base's class attribute
                elif r[-1:] == [("BINARY_SUBSCR", None)] and any(
                    o == "LOAD_ATTR" and a in ("__mro__", "__bases__") for o, a in r[:-1]
                ):
                    # cls.__mro__[1].temp, type(self).__bases__[0].temp: some class of the
                    # hierarchy's attribute (which one, the index says at run time): each
                    # class that defines it is watched
                    out.cls_own.add(arg)
                    out.super_own.add(arg)
            elif op == "LOAD_CONST" and chain is not None:
                if key is MISSING:  # (a second constant: ``.get(key, default)``'s default)
                    key = arg  # BIG["bank"], settings["bank"], os.environ.get("FLAG")
            elif op == "BINARY_SUBSCR" and chain is not None and key is not MISSING:
                out.items.add((tuple(chain), key))
                chain, key = None, MISSING
            elif op == "CALL" and chain is not None and key is not MISSING:
                if chain[-1] == "get" and len(chain) > 1:  # a mapping's .get(key, ...)
                    out.items.add((tuple(chain[:-1]), key))
                chain, key = None, MISSING
            else:
                chain, key = None, MISSING
            recent.append(ins)
            del recent[:-5]
    return out


class _Names:
    """What a function's bytecode names outside its locals: module-level ``names`` read or
    written; ``chains`` of attributes read from a global or a closure cell (``("g", "CFG"),
    "model", "use_bank"``); constant-key ``items`` read from one (``BIG["bank"]``,
    ``os.environ.get("FLAG")``); the closure ``cells`` it reads; the attributes it reads from
    its first argument (``own``: ``self.temp``, a class attribute where the instance has none),
    from its first argument's class (``cls_own``: ``type(self).temp``) and from its bases
    (``super_own``: ``super().temp``)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.chains: set[tuple] = set()
        self.items: set[tuple] = set()
        self.cells: set[str] = set()
        self.own: set[str] = set()
        self.cls_own: set[str] = set()
        self.super_own: set[str] = set()


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


def class_attrs(klass: type) -> ClassAttrs:
    """The owner that stands for ``klass``'s attributes (one per class)."""
    owner = _CLASSES.get(klass)
    if owner is None:
        owner = _CLASSES[klass] = ClassAttrs(klass)
    return owner


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
            return class_attrs(klass)
    return None


def _plain_key(k: Any) -> bool:
    """A dict key a plain value is kept under: a plain value, or a tuple of them (``G["s", 0]``)."""
    return is_scalar(k) or (type(k) is tuple and all(map(is_scalar, k)))


def _plain(value: Any, tensors: bool = True, depth: int = 0) -> bool:
    """A value to watch and put back: a plain one, a tensor (which one the name holds), or a
    small list, dict, set or tuple of them (``BANK = {"w": t, "scale": 0.5}``, rebound or
    written between a forward and its replay), four levels down at most. Without ``tensors``,
    plain values and containers of them only (a closure cell: watched, its owner would keep
    the function's old tensor alive after the function was replaced)."""
    if is_scalar(value):
        return True
    if isinstance(value, torch.Tensor):
        return tensors
    if type(value) in (list, dict, set, tuple):
        if len(value) > _MAX_ITEMS:
            return False
        if copy_plain(value) is not MISSING:
            return True
        if depth >= 4 or not tensors:
            return False
        if type(value) is dict:
            return all(map(_plain_key, value)) and all(
                _plain(v, tensors, depth + 1) for v in value.values()
            )
        return all(_plain(v, tensors, depth + 1) for v in value)
    if type(value) is functools.partial and tensors and depth:
        # (in a container: ``FNS = [partial(scale, w=t)]``, rebound or replaced; which partial
        # each item is, and what it is bound to, is the container's value)
        return _plain(value.args, tensors, depth) and all(
            _plain(v, tensors, depth + 1) for v in value.keywords.values()
        )
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


def held_functions(modules: Iterable[nn.Module]) -> list[tuple[types.FunctionType, Any]]:
    """The Python functions ``modules`` hold in plain attributes and in the lists, tuples and
    dicts there, three levels down (``self.fn = Config.scale_of``, ``self.acts = {"gain":
    Gain.apply}``), each
    with the object its first argument is: a bound method's object or class (a classmethod),
    None for a plain or static function; ``functools.partial`` unwrapped (up to 6 deep). The
    segment's forward calls them: a class attribute or module-level value they read is the
    segment's as much as its own code's (:func:`globals_read`'s ``functions``)."""
    out: list[tuple[types.FunctionType, Any]] = []
    seen: set[int] = set()
    for m in modules:
        for k, v in vars(m).items():
            if k in MODULE_INTERNALS:
                continue
            items, todo = [], [(v, 0)]
            while todo:  # (the lists, tuples and dicts there, three levels down)
                x, depth = todo.pop()
                items.append(x)
                if type(x) in (list, tuple, dict) and len(x) <= _MAX_ITEMS and depth < 3:
                    todo += [(i, depth + 1) for i in (x.values() if type(x) is dict else x)]
            for x in items:
                obj = None
                for _ in range(6):
                    if isinstance(x, functools.partial):
                        x = x.func
                    elif isinstance(x, types.MethodType):
                        obj, x = x.__self__, x.__func__
                    else:
                        break
                x = getattr(x, "__wrapped__", x)
                if isinstance(x, types.FunctionType) and id(x) not in seen:
                    seen.add(id(x))
                    out.append((x, obj))
    return out


def _holder(value: Any) -> bool:
    """A module-level object whose attributes a forward may read as settings: a module or a
    plain instance (not a class, a function, an nn.Module or a tensor)."""
    if isinstance(value, types.ModuleType):
        return not _library(value.__name__)
    if isinstance(value, nn.Module):  # (one no installed model registers: a holder)
        return is_holder(value)
    return (
        not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))
        and type(value).__module__ is not None
        and not _library(type(value).__module__)
        and isinstance(getattr(value, "__dict__", None), dict)
    )


class Owner:
    """Stands for a place a forward reads a value from that is no module's attribute (an
    :class:`Items` of a mapping, a closure :class:`Cell`, a descriptor's value): its
    ``__dict__`` reads and puts back the value by name, as a module's does; ``label`` names
    it in records."""

    __slots__ = ("__weakref__",)  # (a holder read through it is cached by its owner, weakly)
    label: str


class Items(Owner):
    """Stands for a mapping whose items a forward reads by constant keys (``BIG["bank"]`` of
    a module-level dict of any size, ``os.environ.get("FLAG")``): its ``__dict__`` is the
    mapping, so capture_outside and the guard read, put back and restore those items alone."""

    __slots__ = ("mapping", "label", "_view")

    def __init__(self, mapping: Any, label: str) -> None:
        self.mapping, self.label = mapping, label
        self._view = mapping if type(mapping) is dict else _MappingDict(mapping)

    @property
    def __dict__(self) -> Any:  # type: ignore[override]
        return self._view


class _MappingDict:
    """The part of the dict protocol the slots code uses, on a mapping that is no dict
    (``os.environ``)."""

    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def get(self, name: Any, default: Any = None) -> Any:
        return self.m.get(name, default)

    def __getitem__(self, name: Any) -> Any:
        return self.m[name]

    def __setitem__(self, name: Any, value: Any) -> None:
        self.m[name] = value

    def pop(self, name: Any, default: Any = None) -> Any:
        return self.m.pop(name, default)


_ITEMS: dict[int, Items] = {}  # per mapping (by id; the owner keeps it alive)


def _items_owner(mapping: Any, label: str) -> Items:
    owner = _ITEMS.get(id(mapping))
    if owner is None or owner.mapping is not mapping:
        owner = _ITEMS[id(mapping)] = Items(mapping, label)
    return owner


class Cell(Owner):
    """Stands for a closure cell a segment's code reads (``settings`` of a class factory):
    its ``__dict__`` maps the free variable's name to the cell's contents."""

    __slots__ = ("_cells", "label")

    def __init__(self, name: str, cell: Any, label: str) -> None:
        self._cells = _CellDict(name, cell)
        self.label = label

    @property
    def __dict__(self) -> "_CellDict":  # type: ignore[override]
        return self._cells


class _CellDict:
    __slots__ = ("name", "cell")

    def __init__(self, name: str, cell: Any) -> None:
        self.name, self.cell = name, cell

    def get(self, name: str, default: Any = None) -> Any:
        if name != self.name:
            return default
        try:
            return self.cell.cell_contents
        except ValueError:  # an empty cell
            return default

    def __getitem__(self, name: str) -> Any:
        v = self.get(name, MISSING)
        if v is MISSING:
            raise KeyError(name)
        return v

    def __setitem__(self, name: str, value: Any) -> None:
        self.cell.cell_contents = value

    def pop(self, name: str, default: Any = None) -> Any:
        v = self.get(name, default)
        try:
            del self.cell.cell_contents
        except ValueError:
            pass
        return v


class Defaults(Owner):
    """Stands for the default arguments of a function a segment's code runs (``def hook(m,
    inp, holder=holder)``, the usual way to bind a loop variable in a hook): its ``__dict__``
    maps each parameter with a default to that default, and puts one back by rebinding the
    function's ``__defaults__`` (or ``__kwdefaults__``). A container written through its
    default (a call counter in a dict) is state the replay must see as the forward did, as a
    closure cell is (before: the replay's calls counted again, and a hook that computes on
    every third call computed at the replay where it had not at the forward)."""

    __slots__ = ("_defaults", "label")

    def __init__(self, fn: types.FunctionType) -> None:
        self._defaults = _DefaultsDict(fn)
        self.label = f"{fn.__qualname__}.<defaults>"

    @property
    def __dict__(self) -> "_DefaultsDict":  # type: ignore[override]
        return self._defaults


class _DefaultsDict:
    __slots__ = ("fn",)

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn

    def _positional(self) -> dict[str, int]:
        code, defaults = self.fn.__code__, self.fn.__defaults__ or ()
        names = code.co_varnames[: code.co_argcount]
        first = len(names) - len(defaults)
        return {n: i - first for i, n in enumerate(names) if i >= first}

    def get(self, name: str, default: Any = None) -> Any:
        i = self._positional().get(name)
        if i is not None:
            return self.fn.__defaults__[i]
        return (self.fn.__kwdefaults__ or {}).get(name, default)

    def __getitem__(self, name: str) -> Any:
        v = self.get(name, MISSING)
        if v is MISSING:
            raise KeyError(name)
        return v

    def __setitem__(self, name: str, value: Any) -> None:
        i = self._positional().get(name)
        if i is not None:
            d = list(self.fn.__defaults__)
            d[i] = value
            self.fn.__defaults__ = tuple(d)
        elif name in (self.fn.__kwdefaults__ or {}):
            self.fn.__kwdefaults__[name] = value  # (in place: whoever holds it sees it)

    def pop(self, name: str, default: Any = None) -> Any:
        return self.get(name, default)  # (a default cannot be removed: left as it is)


def _mutable_defaults(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """(name, value) of ``fn``'s default arguments that can be written in place (a dict, a
    list, a set: not a plain value, which the code can only rebind locally)."""
    code = fn.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = fn.__defaults__ or ()
    pairs = list(zip(names[len(names) - len(defaults) :], defaults))
    pairs += list((fn.__kwdefaults__ or {}).items())
    return [(n, v) for n, v in pairs if type(v) in (list, dict, set)]


#: per function (by id; checked against the owner's function), the owner of its defaults
_DEFAULTS: "weakref.WeakValueDictionary[int, Defaults]" = weakref.WeakValueDictionary()


def _defaults_owner(fn: types.FunctionType) -> Defaults:
    owner = _DEFAULTS.get(id(fn))
    if owner is None or owner.__dict__.fn is not fn:
        owner = _DEFAULTS[id(fn)] = Defaults(fn)
    return owner


#: per cell (by id; checked against the owner's cell), its owner while someone holds it (a
#: segment's outside reads): not kept here, a cell kept for good keeps what it holds (a
#: function replaced each step: its tensor) for good
_CELLS: "weakref.WeakValueDictionary[int, Cell]" = weakref.WeakValueDictionary()


def _cell_owner(fn: types.FunctionType, name: str) -> Cell | None:
    i = fn.__code__.co_freevars.index(name)
    cell = (fn.__closure__ or ())[i] if i < len(fn.__closure__ or ()) else None
    if cell is None:
        return None
    owner = _CELLS.get(id(cell))
    if owner is None or owner.__dict__.cell is not cell:
        owner = _CELLS[id(cell)] = Cell(name, cell, f"{fn.__qualname__}.<closure>")
    return owner


#: module-level values left unwatched because of a limit, already warned about (per label)
_WARNED: set[str] = set()


def _warn_unwatched(segment: str, what: str, why: str) -> None:
    if what in _WARNED:
        return
    _WARNED.add(what)
    warnings.warn(
        f"lightning_replay: segment '{segment or '?'}' reads {what}, which is not watched "
        f"({why}). If it changes between a forward and its backward or between steps, the "
        "replay may compute other gradients than the forward's, seen only by the sampled "
        "checks; set preservation='retain' for this segment, or keep the value on a module.",
        stacklevel=3,
    )


def globals_read(
    modules: Iterable[nn.Module],
    functions: Iterable[tuple[types.FunctionType, Any]] = (),
    segment: str = "",
) -> list[tuple[Any, str]]:
    """The module-level plain values the code of ``modules``' classes reads or writes, each
    once, as ``(owner, name)``: a module and a global name, or a module-level object (or an
    imported module) and the attribute read from it, as many attributes down as the code
    reads (``CFG.model.use_bank``); an item a constant key reads (``BIG["bank"]``: an
    :class:`Items`); a closure cell (a :class:`Cell`); a class attribute (a
    :class:`ClassAttrs`). Module-level functions the code calls are followed
    ``_DEPTH`` calls down. Library code (torch's) is left out.

    ``functions``: more functions to scan, each with the object its first argument is (a
    property or method of a module outside the segment that its forward read). ``segment``:
    its name, for the warning a limit reached gives (a container too large to watch, too many
    functions to follow)."""
    out: dict[tuple[int, Any], tuple[Any, Any]] = {}
    seen: set[int] = set()
    modules = list(modules)
    classes = {type(m) for m in modules}
    todo = [(fn, 0) for cls in classes for fn in _functions(cls)]
    todo += [(fn, 0) for fn in _hook_functions(modules)]  # (the replay runs them too)
    instances: list[Any] = list(modules)
    for fn, obj in functions:
        fn = getattr(fn, "__wrapped__", fn)
        if isinstance(fn, types.FunctionType):
            todo.append((fn, 0))
            if obj is not None and all(o is not obj for o in instances):
                instances.append(obj)
    read_from_self: set[str] = set()
    class_reads: set[str] = set()
    super_reads: set[str] = set()
    budget = _MAX_FUNCTIONS

    def add(owner: Any, name: Any) -> None:
        out.setdefault((id(vars(owner)), name), (owner, name))

    while todo:
        fn, depth = todo.pop()
        if id(fn.__code__) in seen or _library(fn.__module__):
            continue
        seen.add(id(fn.__code__))
        budget -= 1
        if budget < 0:
            _warn_unwatched(
                segment,
                f"code past {_MAX_FUNCTIONS} functions ({fn.__qualname__})",
                "too many functions to follow",
            )
            break
        owner = _owner(fn)
        n = _global_names(fn)
        if depth == 0:
            read_from_self |= n.own
        class_reads |= n.cls_own
        super_reads |= n.super_own
        roots = {}
        for name in n.names:
            value = fn.__globals__.get(name, MISSING)
            if value is MISSING or name.startswith("__"):
                continue
            roots["g", name] = (owner, value)
            if isinstance(value, types.FunctionType):
                if depth < _DEPTH:
                    todo.append((value, depth + 1))
            elif _plain(value):
                add(owner, name)
            elif type(value) in (list, dict, set, tuple) and len(value) > _MAX_ITEMS:
                _warn_unwatched(
                    segment,
                    f"{describe(owner, name)} ({len(value)} items)",
                    f"module-level containers are watched up to {_MAX_ITEMS} items",
                )
        for name in n.cells:
            cell = _cell_owner(fn, name)
            value = vars(cell).get(name, MISSING) if cell is not None else MISSING
            if value is MISSING:
                continue
            roots["c", name] = (cell, value)
            if isinstance(value, types.FunctionType):
                if depth < _DEPTH:
                    todo.append((value, depth + 1))
            elif _plain(value, tensors=False):
                add(cell, name)
        for name, value in _mutable_defaults(fn):
            if _plain(value, tensors=False):
                add(_defaults_owner(fn), name)
        for chain in n.chains:
            found = _follow(roots, chain)
            if isinstance(found, types.FunctionType):
                if depth < _DEPTH:
                    todo.append((found, depth + 1))
            elif found is not None:
                add(*found)
        for chain, key in n.items:
            holder = _follow(roots, chain, value=True)
            if _plain(holder) or not issubclass(type(holder), Mapping):
                continue  # (a plain dict is watched whole, by who holds it)
            try:
                value = holder.get(key, MISSING)
            except Exception:  # noqa: BLE001 - an unhashable key, a mapping that refuses
                continue
            if value is MISSING or _plain(value):  # (absent: a flag set later is another's)
                add(_items_owner(holder, _chain_label(chain)), key)
    # self.temp where no instance holds ``temp``: the class's attribute, which a training
    # loop may anneal (Block.temp *= 0.9) with no guard seeing it; type(self).temp always,
    # and cls.temp in a classmethod (its first argument is the class)
    for m in instances:
        try:
            inst = vars(m)
        except TypeError:  # (an object with __slots__ only: its reads are its slots')
            inst = {}
        for name in read_from_self | class_reads:
            if name.startswith("__"):
                continue
            if (
                name not in class_reads
                and not isinstance(m, type)
                and (
                    name in inst
                    or name in inst.get("_modules", ())
                    or name in inst.get("_parameters", ())
                    or name in inst.get("_buffers", ())
                )
            ):
                continue
            cls_owner = _class_owner(m if isinstance(m, type) else type(m), name)
            if cls_owner is not None:
                add(cls_owner, name)
        for name in super_reads:  # (each base that defines it: which one super() finds
            # depends on the class whose method reads it)
            for klass in (m if isinstance(m, type) else type(m)).__mro__[1:]:
                if name in vars(klass):
                    cls_owner = _class_owner(klass, name)
                    if cls_owner is not None:
                        add(cls_owner, name)
    return sorted(out.values(), key=lambda p: (_label(p[0]), str(p[1])))


def _chain_label(chain: tuple) -> str:
    return ".".join([chain[0][1], *chain[1:]])


def _follow(roots: dict, chain: tuple, value: bool = False) -> Any:
    """Where an attribute chain a function reads ends: ``(owner, name)`` of a plain value to
    watch, a function to follow, or None; with ``value``, the object it ends at."""
    start = roots.get(chain[0])
    if start is None:
        return None
    obj = start[1]
    for k, attr in enumerate(chain[1:]):
        if attr.startswith("__"):
            return None
        last = k == len(chain) - 2
        if isinstance(obj, type):  # Block.temp: a class attribute
            if value:
                obj = obj.__dict__.get(attr, MISSING)
                if obj is MISSING:
                    return None
                continue
            cls_owner = _class_owner(obj, attr)
            return (cls_owner, attr) if cls_owner is not None else None
        if not _holder(obj):
            return None
        try:
            v = vars(obj).get(attr, MISSING)
        except TypeError:
            return None
        if v is MISSING:
            return None
        if value:
            obj = v
            continue
        if isinstance(v, types.FunctionType):
            return v if isinstance(obj, types.ModuleType) else None
        if _plain(v):
            return obj, attr
        if last:
            return None
        obj = v
    return obj if value else None


def _label(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, Globals):
        return str(owner.__dict__.get("__name__", "?"))
    if isinstance(owner, ClassAttrs):
        return owner.cls.__qualname__
    if isinstance(owner, Owner):
        return owner.label
    return type(owner).__qualname__


def describe(owner: Any, name: str) -> str:
    """How a contract names a module-level value: ``module.name`` or ``Type.name``."""
    return f"{_label(owner)}.{name}"
