"""Moved to ``tests/helpers/lit_hazards.py``; import ``tests.helpers.lit_hazards`` instead.

This alias keeps older imports working: the old name is the same module object, so classes
and functions are identical whichever name imported them.
"""
import sys

from tests.helpers import lit_hazards as _moved

sys.modules[__name__] = _moved
