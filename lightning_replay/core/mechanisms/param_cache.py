"""Entries of torch's parametrization cache that a segment's forward created.

Under ``torch.nn.utils.parametrize.cached()`` the first read of a parametrized tensor computes
it and caches the result (keyed by the module and the tensor's name); later reads return the
cached tensor. When that first read happens inside a segment's forward, the parametrization's
ops are part of the segment: a replay that found the forward's entry still cached would skip
them, save fewer tensors than the forward (checkpoint refuses it) and leave the gradient to
the original parameter to the forward's dropped graph. So a replay runs with the entries its
forward created taken out of the cache (it computes them again, from the entry state the
contract swapped in), and after it the forward's entries are put back, as plain training
leaves the cache. Entries cached before the forward (by the root, or an earlier segment) are
inputs of the segment and stay.
"""

from __future__ import annotations

from lightning_replay._compat import parametrization_cache as _cache


def cache_keys() -> set | None:
    """The keys cached now (None: no ``cached()`` context is active: nothing to do)."""
    cache = _cache()
    return set(cache) if cache is not None else None


def born_since(before: set | None) -> tuple | None:
    """The keys cached since ``before`` (taken at the forward's start), or None."""
    cache = _cache()
    if before is None or cache is None or len(cache) == len(before):
        return None
    born = tuple(k for k in cache if k not in before)
    return born or None


def take_out(born: tuple | None) -> dict | None:
    """Before a replay: take the forward's entries out of the cache (returned, to put back)."""
    cache = _cache()
    if not born or cache is None:
        return None
    return {k: cache.pop(k) for k in born if k in cache}


def put_back(born: tuple | None, taken: dict | None) -> None:
    """After a replay: drop what the replay cached under the forward's keys, and put the
    forward's entries back (those still cached when the replay began)."""
    cache = _cache()  # (None: the context ended in between and cleared it: nothing to undo)
    if not born or cache is None:
        return
    for k in born:
        cache.pop(k, None)
    if taken:
        cache.update(taken)
