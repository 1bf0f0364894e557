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

import ctypes
import random
import sys
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


class HostRNG:
    """One generator outside torch, with a ``torch.Generator``'s state interface.

    ``fingerprint()`` is a value that changes exactly when the state does (the state itself,
    or its raw bytes where those are cheap to read: see :func:`_raw_fingerprint`), to tell
    whether the generator moved without building its state every step."""

    __slots__ = ("name", "obj", "get_state", "set_state", "fingerprint")

    def __init__(
        self,
        name: str,
        obj: Any,
        get: Callable[[], Any],
        set: Callable[[Any], None],
        fingerprint: Callable[[], Any] | None = None,
    ) -> None:
        self.name = name
        self.obj = obj  # the generator object itself: its identity says which one it is
        self.get_state = get
        self.set_state = set
        self.fingerprint = fingerprint or _raw_fingerprint(obj) or get

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


_GLOBALS: list[HostRNG] = []


def global_rngs() -> list[HostRNG]:
    """Python's global generator, and numpy's once numpy is imported (``np.random.rand`` & co.
    draw from ``np.random.mtrand._rand``; ``np.random.seed`` reseeds that object in place).
    Both are fixed objects for the life of the process: wrapped once."""
    np = sys.modules.get("numpy")
    if not _GLOBALS:
        # the instance's own methods, not the module's names (which a probe may wrap a while)
        inst = random._inst
        _GLOBALS.append(HostRNG("random (Python global)", inst, inst.getstate, inst.setstate))
    if np is not None and len(_GLOBALS) == 1:
        _GLOBALS.append(_wrap("numpy.random (global)", np.random.mtrand._rand))
    return list(_GLOBALS)


def host_rngs(modules: Iterable[nn.Module], names: dict[int, str] | None = None) -> list[HostRNG]:
    """The global host generators (:func:`global_rngs`) and those held as direct attributes
    of ``modules`` (named ``<module>.<attribute>`` through ``names``, module id to qualified
    name)."""
    out = global_rngs()
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


def fingerprints(rngs: list[HostRNG]) -> list[Any]:
    """Each generator's :attr:`HostRNG.fingerprint`, for :func:`moved`."""
    return [r.fingerprint() for r in rngs]


def moved(rngs: list[HostRNG], before: list[Any]) -> list[HostRNG]:
    """Those of ``rngs`` whose fingerprint differs from ``before`` (:func:`fingerprints`)."""
    return [r for r, f in zip(rngs, before) if not same_state(r.fingerprint(), f)]


# ------------------------------------------------------------------ raw-byte fingerprints
# Building a generator's state every step costs: Python's ``getstate()`` makes a tuple of 625
# ints (about 8 us), numpy's ``get_state()`` a dict and a key array (about 27 us). Their whole
# state is a few kilobytes of plain memory, read and compared as bytes in well under a
# microsecond: CPython's Mersenne Twister object (index and 624 words after the object
# header; ``gauss_next`` is an instance attribute), and numpy's legacy ``RandomState`` (its C
# struct, which holds the cached second Gaussian, ``has_gauss``/``gauss``) with its MT19937
# bit generator's state (key and position). Each layout is verified on a private generator
# before it is used: a mismatch (another Python or numpy build) falls back to the state.
_HEADER = object.__basicsize__  # reference count and type pointer: not state
_MT_BYTES = 625 * 4  # numpy's mt19937_state: uint32 key[624]; int pos
_LAYOUT_OK: dict[str, bool] = {}


def _raw_fingerprint(obj: Any) -> Callable[[], Any] | None:
    """A raw-byte fingerprint of ``obj`` if it is exactly one of the two layouts above and
    that layout checks out here, else None."""
    if type(obj) is random.Random and _layout_ok("random"):
        return _python_fingerprint(obj)
    np = sys.modules.get("numpy")
    if np is not None and type(obj) is np.random.RandomState and _layout_ok("numpy"):
        return _numpy_fingerprint(obj, np)
    return None


def _python_fingerprint(r: random.Random) -> Callable[[], Any]:
    addr, size = id(r) + _HEADER, random.Random.__mro__[1].__basicsize__ - _HEADER
    string_at = ctypes.string_at
    return lambda: (string_at(addr, size), r.__dict__.get("gauss_next"))


def _numpy_fingerprint(rs: Any, np: Any) -> Callable[[], Any]:
    addr, size = id(rs) + _HEADER, type(rs).__basicsize__ - _HEADER
    mt = np.random.MT19937
    string_at = ctypes.string_at

    def fingerprint() -> Any:
        bg = rs._bit_generator  # np.random.set_bit_generator may replace it
        if type(bg) is not mt:
            return rs.get_state(legacy=False)
        return string_at(addr, size), string_at(bg.ctypes.state_address, _MT_BYTES)

    return fingerprint


def _layout_ok(kind: str) -> bool:
    ok = _LAYOUT_OK.get(kind)
    if ok is None:
        try:
            ok = _check_python_layout() if kind == "random" else _check_numpy_layout()
        except Exception:  # noqa: BLE001 - any surprise: use the states themselves
            ok = False
        _LAYOUT_OK[kind] = ok
    return ok


def _check_python_layout() -> bool:
    """CPython's ``_random.Random``: an int index, then the 624 state words."""
    r = random.Random(20240)
    r.random()
    raw = ctypes.string_at(id(r) + _HEADER, 4 * 625)
    internal = r.getstate()[1]  # (624 words..., index)
    expected = internal[-1].to_bytes(4, sys.byteorder) + b"".join(
        w.to_bytes(4, sys.byteorder) for w in internal[:624]
    )
    return (
        random.Random.__mro__[1].__basicsize__ - _HEADER >= len(raw)
        and raw == expected
        and _changes(_python_fingerprint(r), r.random)
    )


def _check_numpy_layout() -> bool:
    """numpy's ``RandomState`` on MT19937: the key and position at the bit generator's state
    address, and a change in the RandomState's own bytes when it only hands out its cached
    second Gaussian (the bit generator does not move then)."""
    import numpy as np

    rs = np.random.RandomState(20240)
    st = rs._bit_generator.state["state"]
    raw = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_BYTES)
    if raw != st["key"].astype(np.uint32).tobytes() + int(st["pos"]).to_bytes(4, sys.byteorder):
        return False
    fp = _numpy_fingerprint(rs, np)
    rs.standard_normal()  # draws a pair, caches the second
    if rs.get_state()[3] != 1:
        return False
    before_mt = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_BYTES)
    ok = _changes(fp, rs.standard_normal)  # hands out the cached one: only has_gauss moves
    after_mt = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_BYTES)
    return ok and before_mt == after_mt and _changes(fp, rs.random_sample)


def _changes(fingerprint: Callable[[], Any], draw: Callable[[], Any]) -> bool:
    a = fingerprint()
    b = fingerprint()
    draw()
    return a == b and fingerprint() != a


def advanced(rngs: list[HostRNG], before: list[Any]) -> list[HostRNG]:
    """Those of ``rngs`` whose state differs from ``before``."""
    return [r for r, s in zip(rngs, before) if not same_state(r.get_state(), s)]


def same_state(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)  # Python's state: a tuple of ints, compared in C
    except ValueError:  # numpy arrays inside: compare element by element
        pass
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (tuple, list)):
        return (
            isinstance(b, (tuple, list))
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b))
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
        self._rngs = global_rngs()
        self._before = fingerprints(self._rngs)

    def end(self, step: int) -> list[HostRNG]:
        """Those that moved in this window's forward for the first time (the window's
        suspects from now until its replays are done)."""
        if self._before is None:
            return []
        drawn = moved(self._rngs, self._before)
        self._before = None
        known = {id(r.obj) for r in self.capture}
        new = [r for r in drawn if id(r.obj) not in known]
        self.capture += new
        if new:
            self.suspects = (step, new)
        return new

    def suspected(self, step: int) -> list[HostRNG]:
        """The suspects of the window of ``step`` (empty for other windows)."""
        sus = self.suspects
        return sus[1] if sus is not None and sus[0] == step else []
