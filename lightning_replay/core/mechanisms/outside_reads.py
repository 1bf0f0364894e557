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
from typing import Any

from torch import nn

from lightning_replay.core.mechanisms.slots import MISSING, MODULE_INTERNALS, _at_forward, is_scalar

# ------------------------------------------------------------------ reads of outside modules
_TRACE_CLASSES: dict[type, type] = {}

#: while a probe's forward is traced: the comparisons of numbers it read from module attributes,
#: as ((the dict that holds it, its name), operator name, the other operand, the result, the
#: number compared, (dict, name) of the other operand when it is such a number too, else None)
_COMPARISONS: list | None = None

COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")


def _tracked_number_class(base: type) -> type:
    """A subclass of ``int`` or ``float`` whose comparisons are logged while a probe traces
    (:data:`_COMPARISONS`): a number that gates a branch (``if self.step >= warmup``, ``if
    temp < 0.7``) changes every step, so its value is no precondition of a contract, but the
    outcome of that comparison is (see ``guards.Guard.add_predicates``). Arithmetic on it gives
    plain numbers; out of a probe it is its value."""

    def compare(name: str):
        op = getattr(operator, name)

        def method(self, other):
            if type(other) is bool or not isinstance(other, (int, float)):
                return getattr(base, f"__{name}__")(self, other)
            field = getattr(other, "_lightning_replay_where", None)  # another traced number
            other = float(other) if isinstance(other, float) else int(other)
            result = op(base(self), other)  # a mixed int/float pair too
            log = _COMPARISONS
            if log is not None:
                log.append((self._lightning_replay_where, name, other, result, base(self), field))
            return result

        return method

    def __bool__(self):
        result = base(self) != 0
        log = _COMPARISONS
        if log is not None:
            log.append((self._lightning_replay_where, "ne", base(0), result, base(self), None))
        return result

    def __reduce__(self):  # pickled, copied: the plain number
        return (base, (base(self),))

    methods = {f"__{n}__": compare(n) for n in COMPARE_OPS}
    return type(
        f"Tracked{base.__name__.title()}",
        (base,),
        {**methods, "__bool__": __bool__, "__hash__": base.__hash__, "__reduce__": __reduce__},
    )


_TRACKED = {int: _tracked_number_class(int), float: _tracked_number_class(float)}


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


def _trace_class(cls: type) -> type:
    """A subclass of ``cls`` that records which plain attributes are read (probe only)."""
    new = _TRACE_CLASSES.get(cls)
    if new is not None:
        return new

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        d = object.__getattribute__(self, "__dict__")
        reads = d.get("_lightning_replay_reads")
        if (
            reads is not None
            and name not in MODULE_INTERNALS
            and not isinstance(value, nn.Module)
            and (None, name) not in reads
        ):
            if name in d:
                reads[None, name] = _at_forward(value)  # as first read (before any write)
            elif is_scalar(value):
                # a class's default (``use_bank = False`` in the class body): read while the
                # instance has none of its own, which a later ``root.use_bank = True`` sets
                reads[None, name] = MISSING
        if reads is not None and name in d:
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
            for where in ("_buffers", "_modules"):  # which tensor, or which module
                if name in d[where] and (where, name) not in reads:
                    reads[where, name] = value
        return value

    new = _TRACE_CLASSES[cls] = _recording_subclass(
        cls, __getattribute__=__getattribute__, __getattr__=__getattr__
    )
    return new


def _recording_subclass(cls: type, **methods: Any) -> type:
    """A subclass of ``cls`` under its own names (``type(x).__name__``, reprs and pickling
    see the user's class) with ``methods`` over its own."""
    return type(
        cls.__name__,
        (cls,),
        {**methods, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
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

    def __enter__(self) -> "OutsideReads":
        for m in self.modules:
            cls = type(m)
            self.classes.append(cls)
            m.__dict__["_lightning_replay_reads"] = {}
            m.__class__ = _trace_class(cls)
        return self

    def __exit__(self, *exc) -> None:
        self.reads = []
        self.first: list[tuple[dict, str, Any]] = []  # (dict, name, value as first read)
        for m, cls in zip(self.modules, self.classes):
            m.__class__ = cls
            reads = m.__dict__.pop("_lightning_replay_reads", {})
            for where, name in sorted(reads, key=lambda r: (r[0] or "", r[1])):
                self.reads.append((m, name if where is None else (where, name)))
                d = m.__dict__ if where is None else m.__dict__[where]
                self.first.append((d, name, reads[where, name]))


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
        if _COMPARISONS is not None and type(value) in _TRACKED:
            try:  # an instance attribute (a slotted holder has no __dict__: not tracked)
                d = object.__getattribute__(self, "__dict__")
            except AttributeError:
                return value
            if d.get(name, MISSING) is value:
                return _tracked(value, d, name)
        return value

    new = _HOLDER_TRACE_CLASSES[cls] = _recording_subclass(
        cls, __slots__=(), __getattribute__=__getattribute__
    )
    return new


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
