"""How the core times things: :func:`clock`.

Times are taken with :func:`clock`: on a CPU running one intra-op thread, this thread's CPU
time (the calling thread does the whole step, and other processes' time slices on a shared
machine are not counted); otherwise wall time. Preservation, restore, the checks and the cost
meter all time with it, so it lives below them.

Example:
    >>> t0 = clock(); t1 = clock()
    >>> t1 >= t0
    True
"""

from __future__ import annotations

import time

import torch


def clock(cuda: bool = False) -> float:
    """Seconds for cost timing: this thread's CPU time on a CPU with one intra-op thread (the
    step runs on the calling thread; a shared machine's load is not counted), else wall time
    (several threads, or a device the CPU only waits for)."""
    if not cuda and torch.get_num_threads() == 1:
        return time.thread_time()
    return time.perf_counter()
