"""An independent memory referee: what the CPU allocator really handed out during a step.

``torch.profiler`` with ``profile_memory=True`` records one event per allocation (+bytes) and
per free (-bytes) of the CPU allocator, with a timestamp. The peak of their running sum over a
step, plus the bytes already live when it began, is the step's real peak. None of this shares
code with ``lightning_replay.accounting`` (which counts saved tensors and snapshots through
hooks), so it can referee the engine's budget claims.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def allocation_peak(fn: Callable[[], object]) -> int:
    """Run ``fn`` under the profiler; return the peak of the running sum of its CPU
    allocation events: bytes allocated during ``fn`` and live at once, above the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    if not events:
        raise AssertionError(
            "torch.profiler recorded no CPU memory events: is the allocator "
            "reporting to the profiler?"
        )
    running = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        running += nbytes
        peak = max(peak, running)
    return peak


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type == "cpu":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
