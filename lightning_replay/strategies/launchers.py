"""The spawn/fork launcher of the replay strategies: Lightning's, with ranks that end cleanly.

A spawned rank that returns normally goes through interpreter finalization, which destroys the
process group's C++ objects with the rest. Gloo's worker threads still alive then abort the
rank now and then ("terminate called without an active exception", SIGABRT) after a
successful fit, and Lightning's launcher turns that into a failed ``fit`` in the parent, even
with the process group destroyed at teardown. :class:`RankExitLauncher` ends every rank with
``os._exit``, after what finalization would run first: non-daemon threads joined, ``atexit``
handlers (loggers', multiprocessing's) run, standard streams flushed.

Only the rank's own ``atexit`` handlers: a forked rank (``fork``, ``forkserver``) inherits its
parent's, and they are the parent's to run, not each rank's (Python's multiprocessing runs none
in a forked child). Run in every rank, they deleted what the parent still used: wandb's staging
directory for media and tables (``tempfile.TemporaryDirectory``, whose finalizer runs at exit),
so the parent's next ``wandb.Table`` failed with ``FileNotFoundError``, and any
``TemporaryDirectory`` the caller held. A forked rank forgets them as it starts.
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
        if self._start_method in ("fork", "forkserver"):
            # the parent's handlers (and its finalizers' exit hook) are the parent's: see the
            # module docstring. A finalizer made in the rank then does not run at its end, as
            # under a plain os._exit; handlers the rank registers (its loggers') do.
            atexit._clear()
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
