"""The spawn/fork launcher of the replay strategies: Lightning's, with ranks that end cleanly.

A spawned rank that returns normally goes through interpreter finalization, which destroys the
process group's C++ objects with the rest. Gloo's worker threads still alive then abort the
rank now and then ("terminate called without an active exception", SIGABRT) after a
successful fit, and Lightning's launcher turns that into a failed ``fit`` in the parent, even
with the process group destroyed at teardown. A forked rank never finalizes: Python ends it
with ``os._exit`` once its work is done. :class:`RankExitLauncher` ends spawned ranks the same
way, after what finalization would run first: non-daemon threads joined, ``atexit`` handlers
(loggers', multiprocessing's) run, standard streams flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, NoReturn

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override


class RankExitLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher whose ranks end without interpreter finalization
    once their results are sent (see the module docstring)."""

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, *args, **kwargs)
        # An exception above propagates as before: torch's spawn wrapper reports it.
        end_rank()


def end_rank(code: int = 0) -> NoReturn:
    """End this process as interpreter exit would, without finalizing the interpreter."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # joins non-daemon threads, as Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
