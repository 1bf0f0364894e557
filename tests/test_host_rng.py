"""Host generator fingerprints: moved exactly when the generator's own state says so.

The reference is the generator's full state (``getstate()`` / ``get_state()``), compared
before and after each kind of draw, including the ones that leave the Mersenne Twister words
alone (a cached second Gaussian handed out).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_replay.host_rng import _wrap, fingerprints, global_rngs, moved


def _draws():
    return {
        "nothing": lambda r: None,
        "uniform": lambda r: r.random() if isinstance(r, random.Random) else r.random_sample(),
        "gaussian": lambda r: (
            r.gauss(0, 1) if isinstance(r, random.Random) else r.standard_normal()
        ),
        "reseed same": lambda r: r.seed(7),
        "reseed other": lambda r: r.seed(8),
        "624 words": lambda r: (
            [r.getrandbits(32) for _ in range(624)]
            if isinstance(r, random.Random)
            else r.randint(0, 2**32, size=624, dtype=np.uint64)
        ),
    }


def _same(a, b) -> bool:
    if isinstance(a, tuple) and a and isinstance(a[0], str) and a[0] == "MT19937":
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    return a == b


@pytest.mark.parametrize("kind", ["python", "numpy"])
@pytest.mark.parametrize("draw", list(_draws()))
@pytest.mark.parametrize("gauss_cached", [False, True])
def test_fingerprint_moves_exactly_when_state_does(kind, draw, gauss_cached):
    gen = random.Random(7) if kind == "python" else np.random.RandomState(7)
    if gauss_cached:  # the next Gaussian comes from the cache: only the cache flag moves
        gen.gauss(0, 1) if kind == "python" else gen.standard_normal()
    rng = _wrap(kind, gen)
    before_state, before_fp = rng.get_state(), fingerprints([rng])
    _draws()[draw](gen)
    state_moved = not _same(before_state, rng.get_state())
    assert bool(moved([rng], before_fp)) == state_moved
    if draw in ("uniform", "gaussian", "624 words", "reseed other"):
        assert state_moved  # the reference itself sees these
    if draw == "nothing":
        assert not state_moved


def test_global_generators_fingerprinted():
    rngs = global_rngs()
    assert [r.obj for r in rngs] == [random._inst, np.random.mtrand._rand]
    before = fingerprints(rngs)
    np.random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian
    mid = fingerprints(rngs)
    np.random.standard_normal()  # only the cache moves
    assert [r.name for r in moved(rngs, mid)] == ["numpy.random (global)"]
    random.random()
    assert [r.name for r in moved(rngs, before)] == [r.name for r in rngs]


def test_other_generators_use_their_state():
    class Mine(random.Random):  # a subclass may keep its state elsewhere
        pass

    r = Mine(1)
    rng = _wrap("mine", r)
    assert rng.fingerprint == rng.get_state
    before = fingerprints([rng])
    r.random()
    assert moved([rng], before) == [rng]
    g = np.random.default_rng(0)
    rng = _wrap("gen", g)
    before = fingerprints([rng])
    assert moved([rng], before) == []
    g.random()
    assert moved([rng], before) == [rng]
