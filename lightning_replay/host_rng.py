"""Random number generators outside torch that a segment's forward may draw from.

Python's ``random`` module, numpy's global RNG (``np.random.rand`` and friends), and
``random.Random``, ``np.random.RandomState`` or ``np.random.Generator`` objects a module holds
as attributes. Torch's dispatcher never sees them, so the probe compares their states before
and after the segment's forward; those that moved join the contract, and every replay runs
from their forward states and puts them back after (the stream the rest of the step sees is
the one plain PyTorch gives). Each is wrapped in a :class:`HostRNG`, which has the
``get_state``/``set_state`` pair of a ``torch.Generator``: the replay context handles both
alike.

>>> import random
>>> rngs = host_rngs([])
>>> rngs[0].name
'random (Python global)'
>>> before = states(rngs)
>>> _ = random.random()
>>> [r.name for r in advanced(rngs, before)][:1]
['random (Python global)']
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


class HostRNG:
    """One generator outside torch, with a ``torch.Generator``'s state interface."""

    __slots__ = ("name", "obj", "get_state", "set_state")

    def __init__(
        self, name: str, obj: Any, get: Callable[[], Any], set: Callable[[Any], None]
    ) -> None:
        self.name = name
        self.obj = obj  # the generator object itself: its identity says which one it is
        self.get_state = get
        self.set_state = set

    def __repr__(self) -> str:
        return f"HostRNG({self.name!r})"


def is_host_rng(obj: Any) -> bool:
    """A generator outside torch with a state to put back (``random.SystemRandom`` has none:
    it reads the operating system's entropy, which no replay can repeat or needs to)."""
    if isinstance(obj, random.Random):
        return not isinstance(obj, random.SystemRandom)
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, (np.random.RandomState, np.random.Generator))


def as_host_rng(obj: Any, name: str | None = None) -> HostRNG | None:
    """``obj`` wrapped as a :class:`HostRNG`, or None if it is not one (see
    :func:`is_host_rng`)."""
    if not is_host_rng(obj):
        return None
    return _wrap(name or f"{type(obj).__module__}.{type(obj).__qualname__}", obj)


def _wrap(name: str, obj: Any) -> HostRNG | None:
    if isinstance(obj, random.SystemRandom):
        return None
    if isinstance(obj, random.Random):
        return HostRNG(name, obj, obj.getstate, obj.setstate)
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(obj, np.random.RandomState):
        return HostRNG(name, obj, obj.get_state, obj.set_state)
    if isinstance(obj, np.random.Generator):
        bit = obj.bit_generator
        return HostRNG(name, obj, lambda: bit.state, lambda s: setattr(bit, "state", s))
    return None


def host_rngs(modules: Iterable[nn.Module], names: dict[int, str] | None = None) -> list[HostRNG]:
    """The global host generators (Python's; numpy's once numpy is imported) and those held
    as direct attributes of ``modules`` (named ``<module>.<attribute>`` through ``names``,
    module id to qualified name)."""
    out = [HostRNG("random (Python global)", random._inst, random.getstate, random.setstate)]
    np = sys.modules.get("numpy")
    if np is not None:
        # np.random.rand & co. draw from this RandomState (np.random.seed reseeds it)
        out.append(_wrap("numpy.random (global)", np.random.mtrand._rand))
    seen = {id(r.obj) for r in out}
    for m in modules:
        for k, v in vars(m).items():
            if id(v) in seen:
                continue
            rng = _wrap(f"{(names or {}).get(id(m), type(m).__name__)}.{k}", v)
            if rng is not None:
                seen.add(id(v))
                out.append(rng)
    return out


def states(rngs: list[HostRNG]) -> list[Any]:
    return [r.get_state() for r in rngs]


def advanced(rngs: list[HostRNG], before: list[Any]) -> list[HostRNG]:
    """Those of ``rngs`` whose state differs from ``before``."""
    return [r for r, s in zip(rngs, before) if not _same_state(r.get_state(), s)]


def _same_state(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)  # Python's state: a tuple of ints, compared in C
    except ValueError:  # numpy arrays inside: compare element by element
        pass
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (tuple, list)):
        return (
            isinstance(b, (tuple, list))
            and len(a) == len(b)
            and all(_same_state(x, y) for x, y in zip(a, b))
        )
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a numpy array (MT19937's key)
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return a == b


class HostWatch:
    """The global host generators across each window's forward.

    A probe sees only the draws of its own forward; a segment may start drawing later (a noise
    switched on by a schedule nobody guards). Once a global host generator moves in a window's
    forward, every segment call from then on captures it (:attr:`capture`), so every replay
    runs from its forward state. In the window where it first moved it is a :attr:`suspect`:
    each replay of that window reads its state before and after, and one that moves it drew
    other values than its forward did (the engine records that segment). Draws outside the
    segments (the step's own augmentation) move it too, but no replay does: no alarm."""

    def __init__(self) -> None:
        self.capture: list[HostRNG] = []
        self.suspects: tuple[int, list[HostRNG]] | None = None  # (step, generators)
        self._rngs: list[HostRNG] = []
        self._before: list[Any] | None = None

    def begin(self) -> None:
        self._rngs = host_rngs([])
        self._before = states(self._rngs)

    def end(self, step: int) -> list[HostRNG]:
        """Those that moved in this window's forward for the first time (the window's
        suspects from now until its replays are done)."""
        if self._before is None:
            return []
        moved = advanced(self._rngs, self._before)
        self._before = None
        known = {id(r.obj) for r in self.capture}
        new = [r for r in moved if id(r.obj) not in known]
        self.capture += new
        if new:
            self.suspects = (step, new)
        return new

    def suspected(self, step: int) -> list[HostRNG]:
        """The suspects of the window of ``step`` (empty for other windows)."""
        sus = self.suspects
        return sus[1] if sus is not None and sus[0] == step else []
