"""Moved to ``tests/helpers/wandb_reader.py``; import ``tests.helpers.wandb_reader`` instead.

This alias keeps older imports working: the old name is the same module object, so classes
and functions are identical whichever name imported them.
"""
import sys

from tests.helpers import wandb_reader as _moved

sys.modules[__name__] = _moved
