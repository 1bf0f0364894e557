"""Moved to ``tests/helpers/compare.py``; import ``tests.helpers.compare`` instead.

This alias keeps older imports working: the old name is the same module object, so classes
and functions are identical whichever name imported them.
"""
import sys

from tests.helpers import compare as _moved

sys.modules[__name__] = _moved
