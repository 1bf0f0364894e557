"""How many segment forwards or replays run now, of every engine in the process.

A segment called inside another segment's forward or replay is part of the outer one: it runs
plain, and the outer contract covers it. Within one engine its ``_segment_depth`` says so; a
segment of another engine (a teacher installed with an engine of its own, run inside a
student's block) must see it too, or it takes the outer segment's checkpoint frame for the
model's own checkpointing. Each engine's ``_segment_depth`` setter keeps this count.

The count is per thread: a model trained in another thread (a second engine, its own
segments) is not inside this thread's segment, and its segments ran plain while one of this
thread's ran (silently keeping their activations; "planned without it" after two windows). A
replay nested in a forward or in another replay runs on the thread that counts the outer one
(the caller's on CPU; on CUDA the autograd engine's device thread, which runs the outer
replay and every backward started inside it).

Example:
    >>> from lightning_replay.core.base import nesting
    >>> before = nesting.segments_running()
    >>> nesting.moved(1); nesting.segments_running() - before
    1
    >>> nesting.moved(-1); nesting.segments_running() - before
    0
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_RUNNING: dict[int, int] = {}  # thread identifier -> segment forwards and replays running


def segments_running() -> int:
    """How many segment forwards or replays of any engine run now on this thread (0: none)."""
    return _RUNNING.get(threading.get_ident(), 0)


def moved(delta: int, thread: int | None = None) -> None:
    """An engine's segment depth moved by ``delta`` on ``thread`` (None: this one)."""
    t = threading.get_ident() if thread is None else thread
    with _LOCK:
        n = _RUNNING.get(t, 0) + delta
        if n:
            _RUNNING[t] = n
        else:
            _RUNNING.pop(t, None)
