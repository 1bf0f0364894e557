"""Subclasses this package makes of a user's classes, leaving the user's classes alone.

The engine routes a segment's forward through a subclass of its class (``attach``), a probe
traces reads through one (``outside_reads``), a rebuilt argument can get one (``arguments``).
Making a subclass runs the ``__init_subclass__`` of the class's bases, and user code does
things there that are meant for the user's own subclasses: a plugin registry keyed by class
name (``REGISTRY[cls.__name__] = cls``) would map the user's name to this package's subclass
for good; a counter would count it; a per-class id (``cls.type_id = next(ids)``) read by the
forward would give the swapped module another one; a wrapper of ``cls.forward`` (transformers'
checkpointing layers, a user's scaling) would run twice, once around this package's forward
and once inside it. :func:`quiet_subclass` makes the subclass without calling
``__init_subclass__`` (the subclass adds nothing but this package's namespace: what the
user's classes set up for themselves is inherited), and undoes what the making (a
metaclass) wrote into the bases and into the globals of the user modules that define them.
Not calling it, rather than calling it and undoing what it did, runs no user code whose
effects cannot be undone (a registry in a nested container, a WeakSet, a file). What it would
have set in the subclass's own ``__dict__`` is there only through the MRO: code that reads
``type(self).__dict__[name]`` of such an entry finds none (attribute lookups find the user's
class's, as they should: a copy would go stale when the user rebinds it).

Example:
    >>> import torch
    >>> class Base(torch.nn.Module):
    ...     seen = []
    ...     def __init_subclass__(cls, **kw):
    ...         super().__init_subclass__(**kw)
    ...         Base.seen.append(cls.__name__)
    >>> class Block(Base):
    ...     pass
    >>> sub = quiet_subclass(Block, {"__qualname__": "Block"})
    >>> issubclass(sub, Block), Base.seen
    (True, ['Block'])
    >>> Base.__dict__["__init_subclass__"] is not None and "__init_subclass__" in Block.__dict__
    False
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from lightning_replay.core.mechanisms.module_globals import _library


def quiet_subclass(cls: type, namespace: dict[str, Any]) -> type:
    """``type(cls.__name__, (cls,), namespace)`` with no ``__init_subclass__`` called, undoing
    what the making wrote into ``cls``'s MRO and their modules' globals (:class:`_Untouched`).
    Raises what the making raises (a metaclass that refuses subclasses), after the undoing."""
    with _Untouched(cls):
        try:  # (put back by _Untouched: the class's own, or none)
            type.__setattr__(cls, "__init_subclass__", _QUIET)
        except (TypeError, AttributeError):  # (a class that takes no attribute: called)
            pass
        return type(cls.__name__, (cls,), namespace)


def _no_init_subclass(cls: type, **kwargs: Any) -> None:
    """Stands for ``__init_subclass__`` while :func:`quiet_subclass` makes its subclass."""


_QUIET = classmethod(_no_init_subclass)


#: items of a container an _Untouched copies (larger: left alone)
_MAX_UNDONE = 4096


class _Untouched:
    """Undoes, on exit, what the block wrote into the classes of ``cls``'s MRO and its
    metaclass's, and into the globals of the user modules that define them: attributes added, rebound or deleted, and
    the contents of the lists, dicts and sets there (put back in place, so that who holds
    them sees the old contents)."""

    def __init__(self, cls: type) -> None:
        # (and the metaclass's: a registry it keeps of the classes it makes)
        meta = [k for k in type(cls).__mro__ if k is not type and k is not object]
        self.classes = [k for k in cls.__mro__ if k is not object] + meta
        mods = {getattr(k, "__module__", None) for k in self.classes}
        self.dicts: list[tuple[Any, dict]] = [(k, dict(vars(k))) for k in self.classes]
        for name in mods:
            mod = sys.modules.get(name or "")
            if mod is not None and not _library(name):
                self.dicts.append((mod, dict(vars(mod))))
        self.contents = [
            (v, copy.copy(v))
            for _, d in self.dicts
            for v in d.values()
            if type(v) in (list, dict, set) and len(v) <= _MAX_UNDONE
        ]

    def __enter__(self) -> "_Untouched":
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, before in self.dicts:
            now = vars(owner)
            if len(now) == len(before) and all(now.get(k, _GONE) is v for k, v in before.items()):
                continue
            # (a class's own setattr, not its metaclass's: one may refuse, a final class)
            put = type.__setattr__ if isinstance(owner, type) else setattr
            drop = type.__delattr__ if isinstance(owner, type) else delattr
            for k in [k for k in now if k not in before]:
                drop(owner, k)
            for k, v in before.items():
                if now.get(k, _GONE) is not v:
                    put(owner, k, v)
        for v, old in self.contents:
            if _same_items(v, old):
                continue
            v.clear()
            if type(v) is list:
                v.extend(old)
            else:
                v.update(old)


def _same_items(a: Any, b: Any) -> bool:
    """Whether two lists, dicts or sets hold the same objects (by identity: items may be
    tensors, whose ``==`` is elementwise)."""
    if len(a) != len(b):
        return False
    if type(a) is dict:
        return all(k in b and b[k] is v for k, v in a.items())
    if type(a) is list:
        return all(x is y for x, y in zip(a, b))
    ids = {id(x) for x in b}
    return all(id(x) in ids for x in a)


_GONE = object()
