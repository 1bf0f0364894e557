"""Tracing what a probed forward reads outside its modules' slots, and how it compares numbers.

While a probe's forward runs, the classes of the modules and holder objects it may read from
are swapped for recording subclasses (:class:`OutsideReads`, :class:`HolderReads`): every
attribute read of an object outside the segment's modules is logged, so the contract can
capture and put back what the replay will read (:func:`~lightning_replay.core.mechanisms.slots.
capture_outside`). Numbers read from module attributes come back as plain-looking tracked
numbers whose comparisons are logged inside :func:`comparisons` (a branch predicate the guard
then watches). What the forward's own slots held is :mod:`~lightning_replay.core.mechanisms.
slots`' concern.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import threading
import types
import weakref
from typing import Any

from torch import nn

from lightning_replay.core.mechanisms.module_globals import Owner, class_attrs
from lightning_replay.core.mechanisms.subclassing import quiet_subclass
from lightning_replay.core.mechanisms.slots import (
    HOOK_DICTS,
    MISSING,
    MODULE_INTERNALS,
    _at_forward,
    is_holder,
    is_scalar,
)

# ------------------------------------------------------------------ reads of outside modules
_TRACE_CLASSES: dict[type, type] = {}

#: while a probe's forward is traced: the comparisons of numbers it read from module attributes,
#: as ((the dict that holds it, its name), operator name, the other operand, the result, the
#: number compared, (dict, name) of the other operand when it is such a number too, else None)
_COMPARISONS: list | None = None

#: Held while a probe's patches are in place (``torch.Tensor``'s host reads, Python's and
#: numpy's generators, the classes of every installed model's modules, :data:`_COMPARISONS`,
#: :data:`_LAZY`): every thread shares them. Two probes in two threads at once restored each
#: other's patches out of order and left them in place for the rest of the process (a
#: ``tolist`` watched forever, arithmetic on a number a probe read traced after it; CI,
#: stop 42). Reentrant: a segment probed inside another. Not taken by install/uninstall (a
#: user's lock held across one and taken in a forward would deadlock): a probe's end puts
#: back only the classes still its own (:class:`OutsideReads`).
PATCH_LOCK = threading.RLock()

#: Held only while a module's class is read and swapped (a probe tracing it or putting it
#: back, an install or uninstall swapping it), never across user code: a probe's end in one
#: thread checked the class was still its tracing one, an uninstall in another put the
#: module's own class back, and the probe's end then put the engine's class back on an
#: uninstalled model.
CLASS_LOCK = threading.Lock()

#: how many times an engine swapped each module's class (install, uninstall), by id (a weak
#: reference beside it: a module need not be hashable): a probe's end leaves a module whose
#: class an engine changed meanwhile, and puts back the class it saw of every other (a lazy
#: module that became its ``cls_to_become`` in the forward goes back too)
_ENGINE_SWAPS: dict[int, tuple[weakref.ref, int]] = {}


def engine_swaps(module: nn.Module) -> int:
    """How many times an engine set ``module``'s class."""
    ref, n = _ENGINE_SWAPS.get(id(module), (None, 0))
    return n if ref is not None and ref() is module else 0


def engine_swapped(module: nn.Module) -> None:
    """An engine set ``module``'s class (under :data:`CLASS_LOCK`)."""
    if len(_ENGINE_SWAPS) > 4096:  # (the dead ones go)
        for k in [k for k, (r, _) in _ENGINE_SWAPS.items() if r() is None]:
            del _ENGINE_SWAPS[k]
    _ENGINE_SWAPS[id(module)] = (weakref.ref(module), engine_swaps(module) + 1)


COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")


#: arithmetic a traced number keeps track of: what it was computed from stays a number whose
#: comparisons are logged (``temp * 2.0 < 1.5``), with the steps that computed it
ARITH_OPS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")


def apply_expr(v: Any, expr: tuple) -> Any:
    """``v`` with the arithmetic steps ``expr`` (as a traced number logs them) applied."""
    for name, other, reflected in expr:
        if name in ("neg", "abs"):
            v = getattr(operator, name)(v)
            continue
        op = getattr(operator, name)
        v = op(other, v) if reflected else op(v, other)
    return v


def _tracked_number_class(base: type) -> type:
    """A subclass of ``int`` or ``float`` whose comparisons are logged while a probe traces
    (:data:`_COMPARISONS`): a number that gates a branch (``if self.step >= warmup``, ``if
    temp < 0.7``) changes every step, so its value is no precondition of a contract, but the
    outcome of that comparison is (see ``guards.Guard.add_predicates``). Arithmetic on it with
    a plain number, while a probe traces, gives a traced number again, which logs the steps
    that made it (``temp * 2.0 < 1.5``: the guard scales the number as it is then); out of a
    probe it is its value and its arithmetic gives plain numbers."""

    def compare(name: str):
        op = getattr(operator, name)

        def method(self, other):
            if type(other) is bool or not isinstance(other, (int, float)):
                return getattr(base, f"__{name}__")(self, other)
            field = getattr(other, "_lightning_replay_where", None)  # another traced number
            if field is not None and getattr(other, "_lightning_replay_expr", ()):
                field = None  # (a number computed from one: compared as its value)
            other = float(other) if isinstance(other, float) else int(other)
            result = op(base(self), other)  # a mixed int/float pair too
            log = _COMPARISONS
            if log is not None:
                expr = self._lightning_replay_expr
                where = self._lightning_replay_where
                raw = self._lightning_replay_raw if expr else base(self)
                log.append(((*where, expr) if expr else where, name, other, result, raw, field))
            return result

        return method

    def arith(name: str, reflected: bool):
        op = getattr(operator, name)

        def method(self, other):
            if type(other) is bool or not isinstance(other, (int, float)):
                return NotImplemented
            plain = float(other) if isinstance(other, float) else int(other)
            result = op(plain, base(self)) if reflected else op(base(self), plain)
            return _derived(self, result, (name, plain, reflected))

        return method

    def unary(name: str):
        op = getattr(operator, name)

        def method(self):
            return _derived(self, op(base(self)), (name, None, False))

        return method

    def __bool__(self):
        result = base(self) != 0
        log = _COMPARISONS
        if log is not None:
            expr = self._lightning_replay_expr
            where = self._lightning_replay_where
            raw = self._lightning_replay_raw if expr else base(self)
            log.append(((*where, expr) if expr else where, "ne", base(0), result, raw, None))
        return result

    def __reduce__(self):  # pickled, copied: the plain number
        return (base, (base(self),))

    methods = {f"__{n}__": compare(n) for n in COMPARE_OPS}
    methods.update({f"__{n}__": arith(n, False) for n in ARITH_OPS})
    methods.update({f"__r{n}__": arith(n, True) for n in ARITH_OPS})
    methods.update({f"__{n}__": unary(n) for n in ("neg", "abs")})
    return type(
        f"Tracked{base.__name__.title()}",
        (base,),
        {
            **methods,
            "__bool__": __bool__,
            "__hash__": base.__hash__,
            "__reduce__": __reduce__,
            "_lightning_replay_expr": (),
        },
    )


_TRACKED = {int: _tracked_number_class(int), float: _tracked_number_class(float)}
_TRACKED_TYPES = frozenset(_TRACKED.values())
_MAX_EXPR = 8  # arithmetic steps kept per traced number (more: a plain number)


def _derived(src: Any, result: Any, step: tuple) -> Any:
    """``result`` of arithmetic on the traced number ``src``: traced too while a probe traces
    (with the steps from the number as read), else plain."""
    cls = _TRACKED.get(type(result))
    expr = src._lightning_replay_expr
    if cls is None or _COMPARISONS is None or len(expr) >= _MAX_EXPR:
        return result
    out = cls(result)
    out._lightning_replay_where = src._lightning_replay_where
    out._lightning_replay_expr = (*expr, step)
    out._lightning_replay_raw = src._lightning_replay_raw if expr else type(src).__mro__[1](src)
    return out


def plain_number(value: Any) -> Any:
    """``value`` as the plain number it stands for, if it is a traced one: what a forward
    stores (``self.calls += 1``) is never a traced number."""
    t = type(value)
    if t in _TRACKED_TYPES:
        return t.__mro__[1](value)
    return value


def _tracked(value: Any, d: dict, name: str) -> Any:
    """``value`` as a number whose comparisons are logged, when it is an ``int`` or ``float``
    read from ``d[name]`` while a probe traces; else ``value``."""
    cls = _TRACKED.get(type(value))
    if cls is None or _COMPARISONS is None:
        return value
    out = cls(value)
    out._lightning_replay_where = (d, name)
    return out


@contextlib.contextmanager
def comparisons():
    """Log the comparisons of the numbers traced reads return (``_trace_class``) inside it;
    yields the log."""
    global _COMPARISONS
    outer, _COMPARISONS = _COMPARISONS, []
    log = _COMPARISONS
    try:
        yield log
    finally:
        _COMPARISONS = outer


def _class_attr(cls: type, name: str) -> tuple[Any, type | None]:
    """What ``cls``'s MRO holds under ``name`` (without calling a descriptor) and which class
    holds it; ``(MISSING, None)`` where none does."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name], klass
    return MISSING, None


def _code_of(attr: Any) -> Any:
    """The Python function behind a class attribute a forward read (a method, classmethod,
    staticmethod or property getter), else None."""
    if isinstance(attr, property):
        attr = attr.fget
    attr = getattr(attr, "__func__", attr)
    attr = getattr(attr, "__wrapped__", attr)
    return attr if isinstance(attr, types.FunctionType) else None


def _record_class_read(cls: type, reads: dict, name: str, value: Any) -> None:
    """A read of ``name`` that the instance's ``__dict__`` did not answer: a class attribute
    (set on the class, ``Root.use_bank = True``), a descriptor's value (a property, a data
    descriptor keeping per-instance values elsewhere), or a method the forward calls. Logged so
    that the contract watches where the value really lives: the class's attribute, the value
    as the descriptor gives it, or the code of the method (its module-level reads)."""
    attr, klass = _class_attr(cls, name)
    if klass is None or name in MODULE_INTERNALS or name.startswith("__"):
        return
    fn = _code_of(attr)
    if fn is not None:
        reads.setdefault(("__code__", name), fn)
        if not isinstance(attr, property):
            return
    if not is_scalar(value):
        return
    if hasattr(type(attr), "__get__"):  # a property or another descriptor: re-read its value
        reads.setdefault(("__get__", name), value)
    elif is_scalar(attr):
        reads.setdefault(("__class__", name), klass)


def _internal_caller() -> bool:
    """Whether the code reading an attribute is torch's or this package's (``nn.Module``'s
    ``__getattr__`` reads ``self.__dict__`` for every buffer)."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name.startswith(("torch", "lightning_replay.core", "lightning_replay.lightning"))


#: the hook dicts ``nn.Module.__call__`` reads: a module outside the segment that the segment
#: calls runs them, so the replay must run the forward's (a hook added, removed or replaced
#: between the forward and the replay)
_CALLED_HOOKS = frozenset(HOOK_DICTS)


def _registered_module(v: Any) -> bool:
    """A module an installed model registers (its reads are its own trace's); a module no
    model registers is read like a holder."""
    return isinstance(v, nn.Module) and not is_holder(v)


def _trace_class(cls: type) -> type:
    """A subclass of ``cls`` that records which plain attributes are read (probe only)."""
    new = _TRACE_CLASSES.get(cls)
    if new is not None:
        return new

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        d = object.__getattribute__(self, "__dict__")
        reads = d.get("_lightning_replay_reads")
        if reads is not None and name == "__dict__" and not _internal_caller():
            # ``vars(root)["flag"]``: the item read is unknown, so every attribute is
            for k, v in d.items():
                if (
                    k not in MODULE_INTERNALS
                    and not k.startswith("_lightning_replay")
                    and not _registered_module(v)
                    and (None, k) not in reads
                ):
                    reads[None, k] = _at_forward(v)
            return value
        if (
            reads is not None
            and (name not in MODULE_INTERNALS or name in _CALLED_HOOKS)
            and not _registered_module(value)
            and (None, name) not in reads
        ):
            if name in d:
                reads[None, name] = _at_forward(value)  # as first read (before any write)
            else:
                if is_scalar(value):
                    # a class's default (``use_bank = False`` in the class body): read while
                    # the instance has none of its own, which a later ``root.use_bank = True``
                    # sets
                    reads[None, name] = MISSING
                _record_class_read(cls, reads, name, value)
        if reads is not None and name in d:
            if _LAZY is not None and not is_scalar(value):
                _trace_lazily(value)
            return _tracked(value, d, name)
        return value

    def __getattr__(self, name):  # registered buffers (parameters and submodules aside)
        d = object.__getattribute__(self, "__dict__")
        reads = d.get("_lightning_replay_reads")
        try:
            value = cls.__getattr__(self, name)
        except AttributeError:
            # absent (``getattr(root, "flag", False)``): the forward ran without it, and one
            # set later is another forward's (a plain value, or a module: ``_modules``)
            if reads is not None and name not in MODULE_INTERNALS and (None, name) not in reads:
                reads[None, name] = MISSING
                reads["_modules", name] = MISSING
            raise
        if reads is not None:
            found = False
            for where in ("_buffers", "_modules", "_parameters"):  # which tensor, or module
                if name in d[where]:
                    found = True
                    if where != "_parameters" and (where, name) not in reads:
                        reads[where, name] = value
            if not found and is_scalar(value) and name not in MODULE_INTERNALS:
                # the class's own ``__getattr__`` answered (settings kept in a dict): the value
                # as it gives it is what the contract holds
                reads.setdefault(("__get__", name), value)
        return value

    def __setattr__(self, name, value):
        cls.__setattr__(self, name, plain_number(value))

    new = _TRACE_CLASSES[cls] = _recording_subclass(
        cls, __getattribute__=__getattribute__, __getattr__=__getattr__, __setattr__=__setattr__
    )
    return new


class Getter(Owner):
    """Stands for a module's attribute that its instance ``__dict__`` does not hold, read as
    the module gives it (a property, a data descriptor, the class's own ``__getattr__``): its
    ``__dict__`` reads ``getattr(module, name)``, and puts a value back with ``setattr`` where
    the attribute can be set (a property without a setter cannot: the guard still re-probes
    when its value changes between steps)."""

    __slots__ = ("_view", "label")

    def __init__(self, module: nn.Module, label: str) -> None:
        self._view = _GetterDict(module)
        self.label = label

    @property
    def __dict__(self) -> "_GetterDict":  # type: ignore[override]
        return self._view


class _GetterDict:
    __slots__ = ("ref",)

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def get(self, name: str, default: Any = None) -> Any:
        m = self.ref()
        if m is None:
            return default
        try:
            return getattr(m, name)
        except Exception:  # noqa: BLE001 - absent, or a getter that fails: not there now
            return default

    def __getitem__(self, name: str) -> Any:
        v = self.get(name, MISSING)
        if v is MISSING:
            raise KeyError(name)
        return v

    def __setitem__(self, name: str, value: Any) -> None:
        m = self.ref()
        if m is not None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(m, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        v = self.get(name, default)
        m = self.ref()
        if m is not None:
            with contextlib.suppress(AttributeError, TypeError):
                delattr(m, name)
        return v


_GETTERS: "weakref.WeakKeyDictionary[nn.Module, Getter]" = weakref.WeakKeyDictionary()


def getter_owner(module: nn.Module, label: str) -> Getter:
    owner = _GETTERS.get(module)
    if owner is None:
        owner = _GETTERS[module] = Getter(module, label)
    return owner


def _recording_subclass(cls: type, **methods: Any) -> type:
    """A subclass of ``cls`` under its own names (``type(x).__name__``, reprs and pickling
    see the user's class) with ``methods`` over its own."""
    return quiet_subclass(
        cls, {**methods, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


class OutsideReads:
    """Records the attributes a segment's forward reads from modules outside it.

    A block may read a value that lives on another module (a temperature on the root that is
    annealed every step, a flag on a sibling). For the probe's forward every other module of
    the model gets a recording subclass; the reads become part of the contract and their
    values are captured at each forward and put back for the replay like the segment's own.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.classes: list[type] = []
        self.traced: dict[int, type] = {}  # index -> the tracing class it was given
        self.swaps: list[int] = []  # engine_swaps() of each as the probe began

    def __enter__(self) -> "OutsideReads":
        global _LAZY
        self._lazy = _LAZY is None  # the outermost one traces the holders read, lazily
        if self._lazy:
            _LAZY = []
        for m in self.modules:
            with CLASS_LOCK:
                self._trace(m)
        return self

    def _trace(self, m: nn.Module) -> None:
        cls = type(m)
        self.classes.append(cls)
        self.swaps.append(engine_swaps(m))
        try:
            traced = _trace_class(cls)
        except Exception:  # noqa: BLE001 - a class that forbids subclasses of it
            # no read can be traced: every plain attribute counts as read, as it is now
            # (before the forward), as ``vars(m)`` is read
            d = m.__dict__
            d["_lightning_replay_reads"] = {
                (None, k): _at_forward(v)
                for k, v in list(d.items())
                if k not in MODULE_INTERNALS
                and not k.startswith("_lightning_replay")
                and not _registered_module(v)
            }
            return
        m.__dict__["_lightning_replay_reads"] = {}
        m.__class__ = traced
        self.traced[len(self.classes) - 1] = traced

    def __exit__(self, *exc) -> None:
        global _LAZY
        if self._lazy:
            for h, cls in reversed(_LAZY or ()):
                _HOLDER_READS.pop(id(h), None)
                h.__class__ = cls
            _LAZY = None
        self.reads = []
        self.first: list[tuple[dict, str, Any]] = []  # (dict, name, value as first read)
        #: the code of methods and properties of these modules the forward called, with the
        #: module: its module-level reads join the contract (module_globals.globals_read)
        self.functions: list[tuple[Any, nn.Module]] = []
        for i, (m, cls) in enumerate(zip(self.modules, self.classes)):
            with CLASS_LOCK:
                if type(m) is self.traced.get(i, cls) or engine_swaps(m) == self.swaps[i]:
                    # (else an engine installed or uninstalled on it meanwhile, here or in
                    # another thread, and put the class it wants)
                    m.__class__ = cls
            reads = m.__dict__.pop("_lightning_replay_reads", {})
            for where, name in sorted(reads, key=lambda r: (r[0] or "", r[1])):
                value = reads[where, name]
                if where == "__code__":
                    self.functions.append((value, m))
                    continue
                if where == "__class__":  # a class attribute, set on the class
                    owner = class_attrs(value)
                    self.reads.append((owner, name))
                    self.first.append((vars(owner), name, value.__dict__.get(name, MISSING)))
                    continue
                if where == "__get__":  # as its descriptor or ``__getattr__`` gives it
                    owner = getter_owner(m, f"{type(m).__qualname__}.{name}")
                    self.reads.append((owner, name))
                    self.first.append((vars(owner), name, value))
                    continue
                self.reads.append((m, name if where is None else (where, name)))
                d = m.__dict__ if where is None else m.__dict__[where]
                self.first.append((d, name, value))


#: per traced holder (by id), the attributes read from it and their values as first read
_HOLDER_READS: dict[int, dict[str, Any]] = {}
_HOLDER_TRACE_CLASSES: dict[type, type] = {}


def _holder_trace_class(cls: type) -> type:
    """A subclass of a holder's class that records which attributes are read (probe only);
    ``__slots__ = ()`` keeps the layout, so slotted holders take it too."""
    new = _HOLDER_TRACE_CLASSES.get(cls)
    if new is not None:
        return new
    get = cls.__getattribute__  # the class's own (a config's attribute map)

    def __getattribute__(self, name):
        reads = _HOLDER_READS.get(id(self))
        if reads is None or name.startswith("__"):
            return get(self, name)
        try:
            value = get(self, name)
        except AttributeError:
            reads.setdefault(name, MISSING)  # absent: ``getattr(cfg, "flag", False)``
            raise
        if name not in reads:
            reads[name] = value
        if _LAZY is not None and not is_scalar(value):
            _trace_lazily(value)  # a holder inside a holder (``cfg.sched.step``)
        if _COMPARISONS is not None and type(value) in _TRACKED:
            try:  # an instance attribute (a slotted holder has no __dict__: not tracked)
                d = object.__getattribute__(self, "__dict__")
            except AttributeError:
                return value
            if d.get(name, MISSING) is value:
                return _tracked(value, d, name)
        return value

    setter = cls.__setattr__

    def __setattr__(self, name, value):
        setter(self, name, plain_number(value))

    new = _HOLDER_TRACE_CLASSES[cls] = _recording_subclass(
        cls, __slots__=(), __getattribute__=__getattribute__, __setattr__=__setattr__
    )
    return new


#: while a probe's forward runs: the holders traced because the forward read them from a
#: module outside the segment or from another traced holder (a config the root holds), with
#: their classes, to put back at its end (:class:`OutsideReads` owns the list)
_LAZY: list | None = None


def _trace_lazily(value: Any) -> None:
    """Trace ``value``'s attribute reads from now on, if it is a holder not yet traced: the
    numbers read from it then log their comparisons (a step counter in the root's config)."""
    if id(value) in _HOLDER_READS or not is_holder(value):
        return
    cls = type(value)
    if cls in _HOLDER_TRACE_CLASSES and _HOLDER_TRACE_CLASSES[cls] is cls:
        return  # (its class cannot be swapped)
    try:
        value.__class__ = _holder_trace_class(cls)
    except Exception:  # noqa: BLE001 - a built-in type, a layout or metaclass it cannot share
        _HOLDER_TRACE_CLASSES.setdefault(cls, cls)
        return
    _HOLDER_READS[id(value)] = {}
    _LAZY.append((value, cls))


class HolderReads:
    """Records the attributes a forward reads from holder objects (a config, a dataclass of
    options), by swapping each holder's class for a recording subclass while it runs. Holders
    whose class cannot be swapped (``types.SimpleNamespace`` and other built-in types) are
    left out: :attr:`reads` has no entry for them.

    ``holders``: the objects to watch. After the block, ``reads[id(holder)]`` maps each name
    read to its value as first read (``MISSING``: absent).
    """

    def __init__(self, holders: list[Any]) -> None:
        self.holders = holders
        self.swapped: list[tuple[Any, type]] = []
        self.reads: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> "HolderReads":
        for h in self.holders:
            cls = type(h)
            if id(h) in _HOLDER_READS or cls in _HOLDER_TRACE_CLASSES.values():
                continue
            try:
                h.__class__ = _holder_trace_class(cls)
            except Exception:  # a built-in type, a layout or a metaclass it cannot share
                _HOLDER_TRACE_CLASSES.setdefault(cls, cls)  # (not tried again)
                continue
            self.swapped.append((h, cls))
            _HOLDER_READS[id(h)] = self.reads[id(h)] = {}
        return self

    def __exit__(self, *exc) -> None:
        for h, cls in self.swapped:
            _HOLDER_READS.pop(id(h), None)
            h.__class__ = cls
        self.swapped = []
