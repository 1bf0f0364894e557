"""A segment call's arguments as a flat list and the structure that rebuilds them.

Checkpoint keeps, and version-checks, only the tensors it is passed; anything else reaches the
replay as the live object. A batch object (a ``@dataclass``, torchvision's ``ImageList``, an
HF ``BatchEncoding``, a namedtuple, an object with tensor attributes or ``__slots__``) is no
pytree: read live at replay, a field rebound or written in place after the forward would be
read new. :func:`flatten_call` therefore walks into such objects (to :data:`MAX_DEPTH` levels)
and lists every tensor it reaches, so that the engine captures, guards and preserves them as
arguments; :func:`unflatten_call` rebuilds the call for the replay from those tensors, with
shallow copies of the objects that hold them (fields as they were at the forward, the live
objects untouched).

Only objects that hold a tensor somewhere are copied; everything else passes as it is.
Modules, generators, classes and functions are never walked into.

Example:
    >>> import dataclasses, torch
    >>> @dataclasses.dataclass
    ... class Batch:
    ...     x: torch.Tensor
    ...     n: int
    >>> b = Batch(torch.ones(2), 3)
    >>> flat, spec = flatten_call((b,), {})
    >>> [type(v).__name__ for v in flat]
    ['Tensor', 'int']
    >>> b.x = torch.zeros(2)  # rebound after the forward
    >>> (a,), kw = unflatten_call(flat, spec)
    >>> a.x.tolist(), a is b
    ([1.0, 1.0], False)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import types
import weakref
from typing import Any

import torch
import torch.utils._pytree as _pytree

from torch import nn

from lightning_replay._compat import dict_version
from lightning_replay.core.mechanisms.host_rng import is_host_rng
from lightning_replay.core.mechanisms.subclassing import quiet_subclass

#: how deep :func:`flatten_call` walks into argument objects
MAX_DEPTH = 6
#: at most this many objects and containers per call are walked (a huge list stays opaque)
MAX_NODES = 2048

_OPAQUE = (
    nn.Module,
    torch.Generator,
    torch.dtype,
    torch.device,
    torch.Size,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    enum.Enum,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    range,
    slice,
)


class ArgumentError(TypeError):
    """An argument object that cannot be rebuilt for a replay (:func:`check_rebuild`)."""


class _Node:
    """How one object of the call is rebuilt: ``kind`` is ``leaf`` (one flat item), ``seq``
    (a list or tuple), ``named`` (a namedtuple), ``dict`` (a plain dict), ``obj`` (a copy of
    ``template`` with ``attrs`` and, for a mapping, ``items`` set) or ``ref`` (an object
    already rebuilt: ``target``)."""

    __slots__ = ("kind", "type", "children", "keys", "template", "slots", "target", "name")

    def __init__(self, kind: str, typ: type | None = None) -> None:
        self.kind = kind
        self.type = typ
        self.children: list[_Node] = []
        self.keys: list = []
        self.template: Any = None
        self.slots: list[bool] = []  # per attribute child: set through a slot descriptor
        self.target: _Node | None = None
        self.name = ""


_LEAF = _Node("leaf")


class CallSpec:
    """The structure of one call's ``(args, kwargs)``: :func:`unflatten_call` rebuilds it."""

    __slots__ = ("root", "objects", "too_deep")

    def __init__(self, root: _Node, objects: list[tuple[str, Any]]) -> None:
        self.root = root
        #: (where in the call, object) of each argument object walked into
        self.objects = objects
        #: where objects holding tensors lie deeper than MAX_DEPTH (passed live)
        self.too_deep: list[str] = []


def _holds_tensor(obj: Any, depth: int, budget: list[int], limit: int = MAX_DEPTH) -> bool:
    budget[0] -= 1
    if budget[0] < 0 or depth > limit:
        return False
    if isinstance(obj, torch.Tensor):
        return True
    inner = _callable_parts(obj)
    if inner is not None:
        return any(_holds_tensor(x, depth + 1, budget, limit) for x in inner)
    if isinstance(obj, (set, frozenset)):
        return any(_holds_tensor(x, depth + 1, budget, limit) for x in obj)
    if isinstance(obj, _OPAQUE) or callable(obj) and not dataclasses.is_dataclass(obj):
        return False
    spec = _pytree.SUPPORTED_NODES.get(type(obj))
    if spec is not None and type(obj) not in (list, tuple, dict):
        return any(_holds_tensor(x, depth + 1, budget, limit) for x in spec.flatten_fn(obj)[0])
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(x, depth + 1, budget, limit) for x in obj)
    if isinstance(obj, dict):
        if any(_holds_tensor(x, depth + 1, budget, limit) for x in obj.values()):
            return True
    if _class_tensors(obj):
        return True
    return any(_holds_tensor(v, depth + 1, budget, limit) for _, v, _ in _fields(obj))


def _class_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the tensors an object reaches through its class (``type(b).m``, or
    ``b.m`` where the instance has no ``m`` of its own): read live by a replay unless captured."""
    own = getattr(obj, "__dict__", None)
    own = own if isinstance(own, dict) else {}
    out: dict[str, torch.Tensor] = {}
    for cls in type(obj).__mro__:
        if cls is object or cls.__module__ == "builtins":
            continue
        for name, v in vars(cls).items():
            if isinstance(v, torch.Tensor) and name not in own and name not in out:
                out[name] = v
    return list(out.items())


def _callable_parts(obj: Any) -> list | None:
    """What a callable argument carries that a replay would read live: a
    ``functools.partial``'s function, arguments and keywords, or a Python function's closure
    cells and defaults; None for anything else (or a function with an empty cell)."""
    if type(obj) is functools.partial:
        return [obj.func, *obj.args, *obj.keywords.values()]
    if type(obj) is types.FunctionType and (obj.__closure__ or obj.__defaults__):
        try:
            cells = [c.cell_contents for c in obj.__closure__ or ()]
        except ValueError:  # an empty cell (a name not bound yet)
            return None
        return cells + list(obj.__defaults__ or ())
    return None


#: how deep :func:`passed_generators` looks into the call's leaves, and how many objects
GENERATOR_DEPTH = 4
GENERATOR_NODES = 256


def passed_generators(flat: list) -> list[Any]:
    """The generators (``torch.Generator``, and those outside torch: :func:`is_host_rng`) a
    call passes, among its leaves and inside the leaves :func:`flatten_call` passes whole
    (an object, a partial or a container that holds no tensor: ``SimpleNamespace(g=gen)``,
    ``[[gen]]``, ``partial(torch.rand, generator=gen)``), ``GENERATOR_DEPTH`` levels down,
    each once."""
    out: list[Any] = []
    seen: set[int] = set()
    todo = [(x, 0) for x in flat if not isinstance(x, torch.Tensor)]
    while todo and len(seen) < GENERATOR_NODES:
        x, depth = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Generator) or is_host_rng(x):
            out.append(x)
            continue
        if depth >= GENERATOR_DEPTH:
            continue
        parts = _callable_parts(x)  # (a partial, a closure: what it carries)
        if parts is not None:
            items = parts
        elif isinstance(x, _OPAQUE):
            continue
        elif isinstance(x, dict):
            items = list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(x)
        else:
            items = [v for _, v, _ in _fields(x)]
        todo += [(v, depth + 1) for v in items if not isinstance(v, torch.Tensor)]
    return out


def _fields(obj: Any) -> list[tuple[str, Any, bool]]:
    """(name, value, through a slot) of an object's own attributes."""
    out = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out += [(k, v, False) for k, v in d.items()]
    for cls in type(obj).__mro__:
        for s in cls.__dict__.get("__slots__", ()) if "__slots__" in cls.__dict__ else ():
            if isinstance(s, str) and s not in ("__dict__", "__weakref__"):
                try:
                    out.append((s, object.__getattribute__(obj, s), True))
                except AttributeError:
                    pass
    return out


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, CallSpec]:
    """The call's leaves in order (tensors, and every value that is not walked into) and the
    spec that rebuilds it."""
    flat: list = []
    objects: list[tuple[str, Any]] = []
    deep: list[str] = []
    seen: dict[int, _Node] = {}
    budget = [MAX_NODES]

    def walk(obj: Any, depth: int, where: str) -> _Node:
        if isinstance(obj, (torch.Tensor, *_OPAQUE)) and _callable_parts(obj) is None:
            flat.append(obj)
            return _LEAF
        prev = seen.get(id(obj))
        if prev is not None:
            node = _Node("ref")
            node.target = prev
            return node
        if depth > MAX_DEPTH or not _holds_tensor(obj, depth, [budget[0]]):
            if _holds_tensor(obj, depth, [256], 3 * MAX_DEPTH):  # a tensor past the walk's depth
                deep.append(where)  # passed live: said at the probe (see too_deep)
            flat.append(obj)
            return _LEAF
        budget[0] -= 1
        t = type(obj)
        if t in (set, frozenset):
            node = _Node("set", t)
            seen[id(obj)] = node
            node.children = [walk(x, depth + 1, f"{where} element") for x in obj]
            return node
        if _callable_parts(obj) is not None:
            # a partial or a closure: rebuilt with its arguments/cells as at the forward
            node = _Node("call", t)
            node.template = obj
            seen[id(obj)] = node
            node.children = [
                walk(x, depth + 1, f"{where} (captured by {getattr(obj, '__name__', t.__name__)})")
                for x in _callable_parts(obj) or ()
            ]
            return node
        if t in (list, tuple):
            node = _Node("seq", t)
            seen[id(obj)] = node
            node.children = [walk(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(obj)]
            return node
        if isinstance(obj, tuple) and hasattr(t, "_fields") and hasattr(t, "_make"):
            node = _Node("named", t)
            seen[id(obj)] = node
            node.children = [walk(x, depth + 1, f"{where}.{f}") for f, x in zip(t._fields, obj)]
            return node
        spec = _pytree.SUPPORTED_NODES.get(t)
        if spec is not None and t not in (list, tuple, dict):
            # a registered pytree node (OrderedDict, defaultdict, deque, HF's ModelOutput, a
            # user's): flattened and rebuilt by its own registration, as pytree does
            children, context = spec.flatten_fn(obj)
            node = _Node("pytree", t)
            node.template = (spec.unflatten_fn, context)
            seen[id(obj)] = node
            node.children = [walk(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(children)]
            return node
        if t is dict:
            node = _Node("dict", t)
            seen[id(obj)] = node
            node.keys = list(obj.keys())
            node.children = [walk(obj[k], depth + 1, f"{where}[{k!r}]") for k in node.keys]
            return node
        # an object: its attributes (and a dict subclass's items), rebuilt on a shallow copy
        node = _Node("obj", t)
        node.template = obj
        node.name = where
        seen[id(obj)] = node
        objects.append((where, obj))
        if isinstance(obj, dict):
            node.keys = [("item", k) for k in obj.keys()]
            node.children = [walk(v, depth + 1, f"{where}[{k!r}]") for k, v in obj.items()]
        for name, v, slot in _fields(obj):
            node.keys.append(("attr", name))
            node.slots.append(slot)
            node.children.append(walk(v, depth + 1, f"{where}.{name}"))
        for name, v in _class_tensors(obj):  # served by a subclass made for the replay
            node.keys.append(("cls", name))
            node.children.append(walk(v, depth + 1, f"{where}.{name} (a class attribute)"))
        return node

    root = _Node("seq", tuple)
    pos = _Node("seq", tuple)
    named = _Node("dict", dict)
    named.keys = list(kwargs)
    try:
        pos.children = [walk(a, 1, f"argument {i}") for i, a in enumerate(args)]
        named.children = [walk(v, 1, f"argument {k!r}") for k, v in kwargs.items()]
    finally:
        # a recursive closure is a reference cycle (its cell holds it), and it holds ``flat``:
        # the call's tensors would wait for the cyclic collector (issue 31)
        walk = None  # type: ignore[assignment]  (empties the cell: no cycle left)
    root.children = [pos, named]
    spec = CallSpec(root, objects)
    spec.too_deep = deep
    return flat, spec


def unflatten_call(flat: list, spec: CallSpec) -> tuple[tuple, dict]:
    """``(args, kwargs)`` rebuilt from ``flat`` (as :func:`flatten_call` listed it, with any
    tensor replaced): containers and objects that hold tensors are new shallow copies whose
    fields are as they were when the call was flattened."""
    it = iter(flat)
    built: dict[int, Any] = {}

    def build(node: _Node) -> Any:
        kind = node.kind
        if kind == "leaf":
            return next(it)
        if kind == "ref":
            return built[id(node.target)]
        if kind == "seq":
            if node.type is list:
                out: Any = []
                built[id(node)] = out
                out.extend(build(c) for c in node.children)
                return out
            out = tuple(build(c) for c in node.children)
        elif kind == "set":
            out = node.type(build(c) for c in node.children)
        elif kind == "call":
            out = _rebuild_callable(node.template, [build(c) for c in node.children])
        elif kind == "named":
            out = node.type._make(build(c) for c in node.children)
        elif kind == "pytree":
            unflatten, context = node.template
            out = unflatten([build(c) for c in node.children], context)
        elif kind == "dict":
            out = {}
            built[id(node)] = out
            for k, c in zip(node.keys, node.children):
                out[k] = build(c)
            return out
        else:
            out = _shallow_copy(node.template)
            built[id(node)] = out
            slots = iter(node.slots)
            d = getattr(out, "__dict__", None)
            on_class: dict[str, Any] = {}
            for (where, k), c in zip(node.keys, node.children):
                v = build(c)
                if where == "cls":
                    on_class[k] = v
                elif where == "item":
                    dict.__setitem__(out, k, v)
                elif next(slots) or not isinstance(d, dict):
                    object.__setattr__(out, k, v)
                else:
                    d[k] = v
            # a field or item the forward added to the live object (``b.features = y``) was
            # not there when the call was made
            if isinstance(d, dict):
                for k in [k for k in d if ("attr", k) not in node.keys]:
                    del d[k]
            if isinstance(out, dict):
                for k in [k for k in out if ("item", k) not in node.keys]:
                    dict.__delitem__(out, k)
            if on_class:
                # tensors the object reaches through its class: a subclass of its class made
                # for this rebuild holds them as at the forward (no instance layout added)
                cls = type(out)
                sub = quiet_subclass(
                    cls,
                    {
                        **on_class,
                        "__slots__": (),
                        "__qualname__": cls.__qualname__,
                        "__module__": cls.__module__,
                    },
                )
                out.__class__ = sub
            return out
        built[id(node)] = out
        return out

    try:
        args, kwargs = build(spec.root)
    finally:
        build = None  # type: ignore[assignment]  (a recursive closure's cycle, broken)
    return args, kwargs


def _rebuild_callable(fn: Any, parts: list) -> Any:
    """``fn`` (a partial or a function) carrying ``parts`` (:func:`_callable_parts`)."""
    if type(fn) is functools.partial:
        n = len(fn.args)
        kw = dict(zip(fn.keywords, parts[1 + n :]))
        return functools.partial(parts[0], *parts[1 : 1 + n], **kw)
    ncell = len(fn.__closure__ or ())
    cells = tuple(types.CellType(v) for v in parts[:ncell]) if fn.__closure__ else None
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, None, cells)
    out.__defaults__ = tuple(parts[ncell:]) if fn.__defaults__ else None
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    return out


def _shallow_copy(obj: Any) -> Any:
    """``copy.copy(obj)``; where that returns ``obj`` itself (a ``__copy__`` returning
    ``self``, as 'immutable' value classes do), a new instance of its type built without
    ``__init__`` (``__new__``) with the same ``__dict__``/slots and items: the replay must
    never write the user's live object. Returns ``obj`` only where neither works."""
    c = copy.copy(obj)
    if c is not obj:
        return c
    cls = type(obj)
    try:
        c = object.__new__(cls) if cls.__new__ is object.__new__ else cls.__new__(cls)
    except Exception:  # noqa: BLE001 (a __new__ that needs arguments: refused by the caller)
        return obj
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        vars(c).update(d)
    for name, v, slot in _fields(obj):
        if slot:
            object.__setattr__(c, name, v)
    if isinstance(obj, dict):
        dict.update(c, obj)
    elif isinstance(obj, list):
        list.extend(c, obj)
    return c


def check_rebuild(flat: list, spec: CallSpec) -> str | None:
    """Why the call cannot be rebuilt for a replay (an object whose shallow copy fails or
    differs in type), or None."""
    for where, obj in spec.objects:
        try:
            c = _shallow_copy(obj)
        except Exception as exc:  # noqa: BLE001 (any failure of a user's __copy__/__reduce__)
            return f"{where} (a {type(obj).__name__}) cannot be copied: {exc}"
        if c is obj:
            return (
                f"{where} (a {type(obj).__name__}) copies as itself and cannot be rebuilt "
                "another way: the replay would write the live object's fields"
            )
        if type(c) is not type(obj):
            return (
                f"{where} (a {type(obj).__name__}) copies as a {type(c).__name__}: its "
                "fields cannot be rebuilt as they were"
            )
    try:
        unflatten_call(flat, spec)
    except Exception as exc:  # noqa: BLE001
        return f"the arguments cannot be rebuilt: {type(exc).__name__}: {exc}"
    return None


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every tensor :func:`flatten_call` reaches in a call, in its order."""
    flat, _ = flatten_call(args, kwargs)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def held_tensors(modules: list[nn.Module], outputs: Any) -> list[torch.Tensor]:
    """The tensors a step can still reach once a forward has returned: its outputs and what the
    modules keep in plain attributes and buffers (``self.last = h``, a list of features), walked
    as :func:`flatten_call` walks arguments. A tensor reached here may be written in place
    before backward; one reached nowhere can only be written through a reference the model
    does not hold.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> m.last = [torch.ones(1)]
        >>> [t.tolist() for t in held_tensors([m], (torch.zeros(1),))]
        [[1.0], [0.0]]
    """
    internals = frozenset(nn.Module().__dict__) - {"_buffers"}
    held = []
    for m in modules:
        d = object.__getattribute__(m, "__dict__")
        held += [v for k, v in d.items() if k not in internals and not k.startswith("_lightning")]
    return call_tensors((held, outputs), {})


def tensor_attributes(flat: list) -> dict[int, dict]:
    """Per position in ``flat``, the Python attributes of that tensor (``x.gain = 2.0`` set on
    an input), shallow-copied as the contract copies module attributes; tensors without any
    are left out (the common case: an empty dict).

    Example:
        >>> x = torch.ones(2)
        >>> x.gain = 2.0
        >>> tensor_attributes([torch.zeros(1), x, 3])
        {1: {'gain': 2.0}}
    """
    return {
        i: dict(x.__dict__)
        for i, x in enumerate(flat)
        if isinstance(x, torch.Tensor) and x.__dict__
    }


#: per module: (its dict's version tag, the names of its tensor attributes), so that a steady
#: module's attributes are not scanned at every forward (see :func:`state_attributes`)
_TENSOR_KEYS: "weakref.WeakKeyDictionary[nn.Module, tuple[int, tuple[str, ...]]]" = (
    weakref.WeakKeyDictionary()
)


def _tensor_keys(m: nn.Module, d: dict) -> Any:
    if dict_version is None:
        return [k for k, v in d.items() if isinstance(v, torch.Tensor)]
    tag = dict_version(d)
    cached = _TENSOR_KEYS.get(m)
    if cached is not None and cached[0] == tag:
        return cached[1]
    keys = tuple(k for k, v in d.items() if isinstance(v, torch.Tensor))
    _TENSOR_KEYS[m] = (tag, keys)
    return keys


def state_attributes(modules: list[nn.Module]) -> list[tuple[torch.Tensor, dict]]:
    """The Python attributes of the tensors ``modules`` hold (parameters, buffers and tensor
    attributes: ``self.q.ptr``, a muP multiplier ``self.lin.weight.mult``), each tensor once,
    shallow-copied as the contract copies module attributes; tensors without any are left
    out.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> lin.weight.mult = 0.5
        >>> [(tuple(t.shape), d) for t, d in state_attributes([lin])]
        [((2, 2), {'mult': 0.5})]
    """
    out = []
    seen: set[int] = set()
    for m in modules:
        d = m.__dict__
        for group in (d["_parameters"].values(), d["_buffers"].values()):
            for t in group:
                if t is not None and t.__dict__ and id(t) not in seen:
                    seen.add(id(t))
                    out.append((t, dict(t.__dict__)))
        for k in _tensor_keys(m, d):
            t = d.get(k)
            if isinstance(t, torch.Tensor) and t.__dict__ and id(t) not in seen:
                seen.add(id(t))
                out.append((t, dict(t.__dict__)))
    return out


@contextlib.contextmanager
def with_attributes(pairs: list[tuple[Any, dict]]) -> Any:
    """While it is open, each tensor of ``pairs`` holds the attributes given with it (as at a
    forward: :func:`state_attributes`); its own come back when it closes."""
    live = []
    for t, d in pairs:
        live.append((t, dict(t.__dict__)))
        t.__dict__.clear()
        t.__dict__.update(d)
    try:
        yield
    finally:
        for t, d in live:
            t.__dict__.clear()
            t.__dict__.update(d)


def forward_attributes(flat: list, attrs: dict[int, dict]) -> Any:
    """While it is open, each tensor of ``flat`` named in ``attrs`` (see
    :func:`tensor_attributes`) holds the attributes it held at the forward: a replay's
    stand-in copy of an input gets them, and a live input whose attributes were rebound or
    reset after the forward gets its own back when it closes.

    Example:
        >>> x = torch.ones(2)
        >>> x.gain = 2.0
        >>> attrs = tensor_attributes([x])
        >>> x.gain = 7.0
        >>> with forward_attributes([x], attrs):
        ...     x.gain
        2.0
        >>> x.gain
        7.0
    """
    return with_attributes(
        [
            (flat[i], d)
            for i, d in attrs.items()
            if i < len(flat) and isinstance(flat[i], torch.Tensor)
        ]
    )
