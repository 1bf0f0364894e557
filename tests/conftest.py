"""Every test starts from the same global state and leaves it as it found it.

A test alone and the same test in a full run, in any order (``pytest -p randomly``), must
see the same world: see :mod:`tests.helpers.isolation` for what is restored and why.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.isolation import isolated_globals, torch_switches

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Bit-exact comparisons need equal thread counts in every test, alone or in a full run.
torch.set_num_threads(2)
BASELINE = torch_switches()


@pytest.fixture(autouse=True)
def _isolated_globals():
    with isolated_globals(BASELINE):
        yield
