"""How many segment forwards or replays run now, of every engine in the process.

A segment called inside another segment's forward or replay is part of the outer one: it runs
plain, and the outer contract covers it. Within one engine its ``_segment_depth`` says so; a
segment of another engine (a teacher installed with an engine of its own, run inside a
student's block) must see it too, or it takes the outer segment's checkpoint frame for the
model's own checkpointing. Each engine's ``_segment_depth`` setter keeps this count.

Example:
    >>> from lightning_replay.core.base import nesting
    >>> before = nesting.segments_running()
    >>> nesting.moved(1); nesting.segments_running() - before
    1
    >>> nesting.moved(-1); nesting.segments_running() - before
    0
"""

from __future__ import annotations

_RUNNING = [0]


def segments_running() -> int:
    """How many segment forwards or replays of any engine run now (0: none)."""
    return _RUNNING[0]


def moved(delta: int) -> None:
    """An engine's segment depth moved by ``delta``."""
    _RUNNING[0] += delta
