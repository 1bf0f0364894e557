"""Every test starts from the same global state and leaves it as it found it.

A test alone and the same test in a full run, in any order (``pytest -p randomly``), must
see the same world: see :mod:`tests.helpers.isolation` for what is restored and why.
"""

from __future__ import annotations

import gc
import os

# One intra-op thread everywhere, set before torch starts its pool: bit-exact comparisons need
# equal thread counts in every test, alone or in a full run, and Lightning's launcher, child
# processes and subprocess tests keep OMP_NUM_THREADS when it is set (else Lightning resets
# the count to the cores). The tests' models are tiny: on this 2-core machine under load, two
# OpenMP threads made a small step up to 90x slower (98 ms against 1.1 ms), which is what made
# the suite's time swing between runs.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.isolation import isolated_globals, torch_switches  # noqa: E402
from tests.helpers.torch_memory import StepReferee  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
BASELINE = torch_switches()


@pytest.fixture(scope="module", autouse=True)
def _earlier_objects_frozen():
    """Every object alive when a module starts (torch, Lightning, transformers, the collected
    test modules, what earlier modules left) moved out of the garbage collector's sight
    (``gc.freeze``) before the module's first test: each ``gc.collect()`` and each walk of
    live tensor storages (the engine's and the referees' alike) then scans only what the
    module makes. In a full run's process of over half a million objects a collection took
    0.4 s and a walk 0.3 s, about half of a budget test's time.

    What a module makes stays in sight: its models, engines, steps and leftovers, whatever its
    fixtures build. A tensor alive before is constant to every arm of a comparison, and the
    engine counts what its model and optimizers hold whether frozen or not
    (:func:`lightning_replay.core.mechanisms.memory.process_tensor_bytes`). Never unfrozen:
    ``gc.unfreeze`` would put every earlier module's objects back in sight."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _isolated_globals():
    with isolated_globals(BASELINE):
        yield


@pytest.fixture
def collector_off():
    """The garbage collector off for one test, after a collection: a test whose claim holds
    one plan over several steps (a collection in the middle frees memory, and the engine
    plans again two measured steps later)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(params=["tags", "identities"])
def tokens(request, monkeypatch):
    """Run a test with the slot checks' dict version tags (this interpreter has trusted ones)
    and without them (the identity comparison of interpreters without): tests/test_slot_tokens.py
    and tests/test_adversary_slot_tokens.py."""
    from lightning_replay import _compat, guards, slots

    if request.param == "tags":
        assert _compat.dict_version is not None, "CPython 3.11 has version tags to trust"
    else:
        monkeypatch.setattr(slots, "dict_version", None)
        monkeypatch.setattr(guards, "dict_version", None)
    return request.param


@pytest.fixture(scope="module")
def referee():
    """One whole-process memory referee (:class:`tests.helpers.torch_memory.StepReferee`) for a
    module's budget tests, started after a collection of what earlier tests left behind and
    closed after the module's last test (what earlier modules left is out of the walks' sight:
    :func:`_earlier_objects_frozen`)."""
    gc.collect()
    r = StepReferee()
    yield r
    r.close()
