"""torch's parametrization cache (``parametrize.cached()``) as a segment's forward saw it.

Under ``torch.nn.utils.parametrize.cached()`` the first read of a parametrized tensor computes
it and caches the result (keyed by the module and the tensor's name); later reads return the
cached tensor. A replay must read the cache as its forward did:

* entries the forward itself created: their parametrization ran inside the segment. A replay
  that found them still cached would skip it, save fewer tensors than the forward (checkpoint
  refuses it) and leave the gradient to the parameter to the forward's dropped graph. The
  replay runs with them taken out (it computes them again from the entry state the contract
  swapped in), and they are put back after it, as plain training leaves the cache;
* entries cached before the forward (by the root, or an earlier segment) are inputs of the
  segment: they stay;
* a forward under ``cached()`` whose backward runs outside it (the context around the forward
  only): the replay runs under a ``cached()`` of its own holding the entries that were cached
  before the forward, so that a tensor read twice is computed once, as in the forward.

* a forward outside ``cached()`` whose replay runs inside one (the context around backward
  only): the replay runs with caching off, so that it computes every read, as the forward did.
"""

from __future__ import annotations

from typing import Any

from torch.nn.utils import parametrize

from lightning_replay._compat import parametrization_cache as _cache
from lightning_replay._compat import set_parametrization_caching

#: what a forward left for its replay: (keys it cached, entries cached before it)
Record = tuple
#: the record of a forward outside ``cached()``
OFF: Record = ((), None)


def forward_start() -> dict | None:
    """At a forward's start: the entries cached now (None: no ``cached()`` is active)."""
    cache = _cache()
    return dict(cache) if cache is not None else None


def forward_end(before: dict | None) -> Record | None:
    """At the forward's end: its record (:data:`OFF` where it ran outside ``cached()``)."""
    if before is None:
        return OFF
    cache = _cache()
    born = tuple(k for k in cache if k not in before) if cache is not None else ()
    return (born, before)


def replay_enter(rec: Record | None) -> Any:
    """Before a replay: the cache as the forward saw it (returned: what ``replay_exit`` undoes)."""
    if rec is None:
        return None
    born, before = rec
    cache = _cache()
    if before is None:  # the forward ran outside cached()
        return ("off", set_parametrization_caching(0)) if cache is not None else None
    if cache is not None:  # still active: take the forward's own entries out
        return ("taken", {k: cache.pop(k) for k in born if k in cache})
    ctx = parametrize.cached()
    ctx.__enter__()
    try:
        cache = _cache()
        if cache is not None:
            cache.update(before)
    except BaseException:
        ctx.__exit__(None, None, None)
        raise
    return ("ctx", ctx)


def replay_exit(rec: Record | None, token: Any) -> None:
    """After a replay: the cache as plain training leaves it."""
    if token is None or rec is None:
        return
    kind, value = token
    if kind == "off":
        set_parametrization_caching(value)
        return
    if kind == "ctx":
        value.__exit__(None, None, None)  # (clears the replay's cache)
        return
    cache = _cache()  # (None: the context ended in between and cleared it: nothing to undo)
    if cache is None:
        return
    for k in rec[0]:
        cache.pop(k, None)
    cache.update(value)
