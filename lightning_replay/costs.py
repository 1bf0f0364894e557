"""Measured costs per segment and option: the planner's input.

Memory (bytes held from a segment's forward to its backward) is exact: activations saved by a
retained segment and the input bytes it saves, checkpoint inputs, and snapshot or region-log
bytes. Time (extra seconds per step over ``retain``) is the median of what the engine timed on
the segment's own replays under each option: capture at forward (snapshots, input copies, the
region log's share of the capture mode), swap in, recompute, swap out.

Times are taken with :func:`clock`: on a CPU running one intra-op thread, this thread's CPU
time (the calling thread does the whole step, and other processes' time slices on a shared
machine are not counted); otherwise wall time.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any

import torch

from lightning_replay.planner import Option, SegmentCost

if TYPE_CHECKING:
    from lightning_replay.engine import ReplayEngine

_KEEP = 16  # samples kept per segment and option


def clock(cuda: bool = False) -> float:
    """Seconds for cost timing: this thread's CPU time on a CPU with one intra-op thread (the
    step runs on the calling thread; a shared machine's load is not counted), else wall time
    (several threads, or a device the CPU only waits for)."""
    if not cuda and torch.get_num_threads() == 1:
        return time.thread_time()
    return time.perf_counter()


class CostMeter:
    """Timing and byte samples per segment and option."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, deque]] = defaultdict(
            lambda: defaultdict(lambda: deque(maxlen=_KEEP))
        )
        self.input_bytes: dict[str, int] = {}
        self.region_bytes: dict[str, int] = {}
        # A(s) measured on a derivative-checked step (the probe's until then)
        self.activation_bytes: dict[str, int] = {}

    def add_time(self, segment: str, option: str, seconds: float) -> None:
        self.times[segment][option].append(seconds)

    def has(self, segment: str, option: str) -> bool:
        return bool(self.times.get(segment, {}).get(option))

    def median(self, segment: str, option: str) -> float:
        return float(statistics.median(self.times[segment][option]))

    def costs(self, engine: "ReplayEngine") -> list[SegmentCost]:
        """One :class:`SegmentCost` per probed segment, in forward order, with every option
        that has been measured (``retain`` always is)."""
        out = []
        for name in engine.segments:
            rt = engine.runtimes[name]
            c = rt.contract
            if c is None:
                continue
            inputs = self.input_bytes.get(name, rt.input_bytes)
            act = self.activation_bytes.get(name, c.activation_bytes)
            opts = {"retain": Option(memory=act + rt.input_saved_bytes, time=0.0)}
            for o in c.available_options():
                if o == "retain" or not self.has(name, o):
                    continue
                if o == "regions":
                    held = self.region_bytes.get(name, 0) + sum(
                        s.nbytes
                        for s in c.changing
                        if not (s.regions_ok and not s.unannotated_write)
                    )
                else:
                    held = c.preserved_bytes(o)
                opts[o] = Option(memory=inputs + held, time=self.median(name, o))
            out.append(SegmentCost(name=name, activation_bytes=act, options=opts))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "times": {s: {o: list(v) for o, v in d.items()} for s, d in self.times.items()},
            "input_bytes": dict(self.input_bytes),
            "region_bytes": dict(self.region_bytes),
            "activation_bytes": dict(self.activation_bytes),
        }


_DISPATCH_OVERHEAD: float | None = None


def dispatch_overhead() -> float:
    """Seconds the regions capture mode adds to one aten op of a forward on this machine.

    Measured once, with the capture mode armed as in a window that logs writes, on the ops a
    layer runs (``linear``: a transpose and an ``addmm``; an activation; a view; an in-place
    add; a layer norm, on 64x64 tensors). Ops with several arguments and outputs cost the mode
    more than a lone ``add`` of a tiny tensor, which understates the overhead about 2x.
    """
    global _DISPATCH_OVERHEAD
    if _DISPATCH_OVERHEAD is None:
        from lightning_replay.preservation import CaptureMode, RegionLog  # (imports this one)
        from lightning_replay.state import storage_key

        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen) for s in ((64, 64), (64, 64), (64,)))
        n = 40

        def loop() -> float:
            t0 = clock()
            for _ in range(n):
                y = torch.relu(torch.nn.functional.linear(x, w, b))
                y.view(-1).add_(1.0)
                torch.nn.functional.layer_norm(y, (64,))
            return clock() - t0

        log = RegionLog()
        unrelated = torch.zeros(1)
        log.arm(storage_key(unrelated), unrelated)  # armed: every write is looked at
        mode = CaptureMode(log)
        with mode:
            loop()
        ops = mode.ops  # of one loop
        loop()
        plain, moded = [], []
        for _ in range(5):  # interleaved, the least of each: a busy machine only adds time
            plain.append(loop())
            with mode:
                moded.append(loop())
        _DISPATCH_OVERHEAD = max(min(moded) - min(plain), 0.0) / max(ops, 1)
    return _DISPATCH_OVERHEAD
