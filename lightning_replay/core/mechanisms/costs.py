"""Measured costs per segment and option: the planner's input.

Memory (bytes held from a segment's forward to its backward) is exact: activations saved by a
retained segment and the input bytes it saves; for a replayed one, checkpoint inputs, the
generator states checkpoint keeps per call (``preserve_rng_state=True``: 5,056 bytes of host
memory, see :func:`~lightning_replay.accounting.checkpoint_rng_bytes`), and snapshot or
region-log bytes.

Time (extra seconds per step over ``retain``) is the median of what the engine timed on
the segment's own replays under each option: capture at forward (snapshots, input copies, the
region log's entries), swap in, recompute, swap out. The capture mode that logs writes costs
every op of the forward, however many segments need it, so it is not in any option's time: the
table carries it once (:attr:`~lightning_replay.planner.CostTable.capture_time`: the ops it saw
in a forward times :attr:`CostMeter.capture_op_seconds`, its cost per op timed in place), and
the options that turn it on say so.

Times are taken with :func:`~lightning_replay.core.base.clock.clock`: on a CPU running one intra-op thread, this thread's CPU
time (the calling thread does the whole step, and other processes' time slices on a shared
machine are not counted); otherwise wall time.
"""

from __future__ import annotations

import dataclasses

import statistics
from collections import defaultdict, deque
from typing import Any

import torch

from lightning_replay.core.base.clock import clock
from lightning_replay.core.base.contract import SELECTIVE, base_option
from lightning_replay.core.base.ports import CostSource
from lightning_replay.core.base.plan_types import CostTable, Option, SegmentCost


_KEEP = 16  # samples kept per segment and option


#: forwards a side from which a segment's selective forward cost is its own difference of
#: medians (fewer: the ratio pooled over segments, see CostMeter.forward_extra)
_OWN_FORWARDS = 3


class CostMeter:
    """Timing and byte samples per segment and option."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, deque]] = defaultdict(
            lambda: defaultdict(lambda: deque(maxlen=_KEEP))
        )
        self.input_bytes: dict[str, int] = {}
        # the step's input size (elements) each figure was measured at: the engine scales
        # activation and input bytes up to the largest input seen (ReplayEngine.size_scale)
        self.input_size: dict[str, int] = {}
        self.activation_size: dict[str, int] = {}
        self.region_bytes: dict[str, int] = {}
        # generator states checkpoint keeps per replayed call, in the budget's memory
        self.rng_bytes: dict[str, int] = {}
        # the whole copies of read-only state a segment's calls of one window used (the most
        # over measured windows): one copy serves every call that reads the same bytes
        # (restore._Invocation._share), so a segment called k times holds it once, not k times
        self.shared_bytes: dict[str, int] = {}
        # outputs a selective replay's forward kept for its replay (matrix products, ...)
        self.selective_bytes: dict[str, int] = {}
        # of those, the ones autograd saves too: a selective replay does not re-materialize them
        self.selective_saved_bytes: dict[str, int] = {}
        # A(s) measured on a derivative-checked step (the probe's until then): one call's (the
        # most a call of the window saved), what one replay re-materializes
        self.activation_bytes: dict[str, int] = {}
        # a segment called k times in a window (a shared layer, a block applied twice) keeps
        # all k calls' activations when retained: (step, bytes summed over the window's
        # measured calls, calls measured), the probe's or a checked step's (issue 31)
        self.window_activation: dict[str, tuple[int, int, int]] = {}
        # bytes a measured step's options held beyond their costs (the accountant's figure at
        # the forward's end over the formula's): charged to those options, not to the base
        # every plan is made with (see real_peak.phase_residuals)
        self.option_extra: dict[tuple[str, str], int] = {}
        # ops the capture mode saw in one step's forward, per timed step that ran it
        self.capture_ops: deque = deque(maxlen=_KEEP)
        # a segment's own forward seconds without and with a capture mode of its own, and the
        # ops that mode saw: what the mode costs per op in place (see capture_time)
        self.forward_times: dict[str, dict[bool, deque]] = defaultdict(
            lambda: {False: deque(maxlen=_KEEP), True: deque(maxlen=_KEEP)}
        )
        self.forward_ops: dict[str, deque] = defaultdict(lambda: deque(maxlen=_KEEP))
        # (segment, option) -> seconds standing in for a time not measured yet: a segment
        # first called after the plan was made is planned at once with its measured bytes;
        # its first timed replay replaces the stand-in (ReplayEngine._plan_late_segments)
        self.stand_ins: dict[tuple[str, str], float] = {}
        # a segment's own forward seconds per option it ran under (no capture sample): a
        # selective option's caching mode costs its forward more than the others' do
        self.option_forward: dict[str, dict[str, deque]] = defaultdict(
            lambda: defaultdict(lambda: deque(maxlen=_KEEP))
        )

    def add_call_activation(self, segment: str, step: int, nbytes: int) -> None:
        """One measured call's activation bytes in window ``step``: the calls of one window
        add up (a retained segment keeps them all), the per-call figure is their largest."""
        st, total, n = self.window_activation.get(segment, (-1, 0, 0))
        if st != step:
            total, n = 0, 0
            self.activation_bytes[segment] = nbytes
        else:
            self.activation_bytes[segment] = max(self.activation_bytes.get(segment, 0), nbytes)
        self.window_activation[segment] = (step, total + nbytes, n + 1)

    def charge_miss(self, chosen: dict[str, tuple[str, int]], miss: int) -> None:
        """A measured step's segments held ``miss`` bytes more than the costs of the options
        it ran (``chosen``: segment -> (option, its costed bytes)): each option is charged its
        share, by its costed bytes, so that the plans choosing it again predict it."""
        total = sum(b for _, b in chosen.values())
        if miss <= 0 or total <= 0:
            return
        for name, (o, b) in chosen.items():
            share = miss * b // total
            if share:
                self.option_extra[(name, o)] = self.option_extra.get((name, o), 0) + share

    def window_activation_bytes(self, segment: str, per_call: int, calls: int) -> int:
        """Bytes a retained segment called ``calls`` times per window keeps: the window's
        measured calls, and ``per_call`` (the largest call's) for each call not measured."""
        _, total, n = self.window_activation.get(segment, (-1, 0, 0))
        if calls < n:  # fewer calls now than measured: each at most the largest call's
            return max(min(total, calls * per_call), per_call)
        return max(total + max(calls - n, 0) * per_call, per_call)

    def held_bytes(
        self, segment: str, c: Any, option: str, calls: int, regions: int | None = None
    ) -> tuple[int, int]:
        """What a segment called ``calls`` times per window holds under ``option`` beyond its
        inputs: (per call, once per window). Per call: the whole snapshots of what each call
        copies for itself (parameters and state the segment writes). Once per window: the
        regions the log holds (one log per storage serves every call: the first call's mark
        sees every later write, :attr:`region_bytes` is that figure) and the whole copies of
        read-only state (one copy per window while the bytes stay the same: as measured in
        :attr:`shared_bytes`, else one per call). ``regions``: the region bytes to charge
        instead of the measured ones (calibration: the probe's estimate, before any replay
        measured them)."""
        base = base_option(option)
        if base in ("retain", "recompute"):
            return 0, 0
        per_call = shared = 0
        for s in c.changing:
            if base == "regions" and s.regions_ok and not s.unannotated_write:
                continue
            if s.kind == "parameter" or s.written_by_segment:
                per_call += s.nbytes
            else:
                shared += s.nbytes
        if shared and calls > 1:
            measured = self.shared_bytes.get(segment)
            shared = (
                calls * shared if measured is None else min(max(measured, shared), calls * shared)
            )
        window = shared
        if base == "regions":
            window += self.region_bytes.get(segment, 0) if regions is None else regions
        return per_call, window

    def add_time(self, segment: str, option: str, seconds: float) -> None:
        self.times[segment][option].append(seconds)
        self.stand_ins.pop((segment, option), None)

    def measured(self, segment: str, option: str) -> bool:
        """A time was measured (not stood in) for ``option`` of ``segment``."""
        return bool(self.times.get(segment, {}).get(option))

    def has(self, segment: str, option: str) -> bool:
        return self.measured(segment, option) or (segment, option) in self.stand_ins

    def median(self, segment: str, option: str) -> float:
        if not self.measured(segment, option):
            return self.stand_ins[segment, option]
        return float(statistics.median(self.times[segment][option]))

    def add_option_forward(self, segment: str, option: str, seconds: float) -> None:
        self.option_forward[segment][option].append(seconds)

    def _forward_sides(self, segment: str, option: str) -> tuple[list[float], list[float]]:
        """``segment``'s own forward seconds under ``option`` and under the full replays."""
        times = self.option_forward.get(segment, {})
        mine = list(times.get(option, ()))
        others = [t for o, d in times.items() if o not in SELECTIVE and o != "retain" for t in d]
        return mine, others

    def forward_extra(self, segment: str, option: str) -> float:
        """Seconds ``option`` adds to ``segment``'s own forward over the full replays (the
        median of its forwards under ``option`` less that under the other replayed options;
        0 until both were timed, or where the difference is negative: noise).

        With fewer than :data:`_OWN_FORWARDS` forwards on either side (calibration times only
        the steps that run no capture sample, about half of each phase: one or two forwards a
        side at the default ``calibration_steps``), one forward's noise is the size of the cost:
        the segment takes the median, over every segment timed both ways, of the ratio of its
        medians, times its own full-replay forward (or, without one, its own under ``option``).
        """
        mine, others = self._forward_sides(segment, option)
        if len(mine) >= _OWN_FORWARDS and len(others) >= _OWN_FORWARDS:
            return max(float(statistics.median(mine) - statistics.median(others)), 0.0)
        ratios = []
        for name in self.option_forward:
            m, o = self._forward_sides(name, option)
            if m and o and statistics.median(o) > 0:
                ratios.append(statistics.median(m) / statistics.median(o))
        if not ratios or not (mine or others):
            return 0.0
        r = float(statistics.median(ratios))
        if others:
            return max((r - 1.0) * float(statistics.median(others)), 0.0)
        return max(float(statistics.median(mine)) * (1.0 - 1.0 / r), 0.0) if r > 0 else 0.0

    def add_forward_time(self, segment: str, seconds: float, capture: Any = None) -> None:
        """A segment's own forward time; ``capture``: the capture mode it ran under, if any."""
        self.forward_times[segment][capture is not None].append(seconds)
        if capture is not None:
            self.forward_ops[segment].append(capture.ops)

    @property
    def capture_op_seconds(self) -> float:
        """What the capture mode adds to one op of the forward, in place.

        Calibration steps run some segments' forwards under a capture mode of their own and
        some without (see ``ReplayEngine._capture_sample``); per segment, the difference of the
        median times over the ops the mode saw; the median over segments. In place, between a
        step's large kernels, the mode's Python work runs with cold caches, and costs several
        times what :func:`dispatch_overhead` measures in a warm loop (about 20 us against 4 us
        per op on this machine), which stays the figure until a segment was timed both ways.
        """
        rates = []
        for name, times in self.forward_times.items():
            if times[True] and times[False] and self.forward_ops[name]:
                ops = statistics.median(self.forward_ops[name])
                if ops > 0:
                    diff = statistics.median(times[True]) - statistics.median(times[False])
                    rates.append(diff / ops)
        if not rates:
            return dispatch_overhead()
        return max(float(statistics.median(rates)), 0.0)

    @property
    def capture_time(self) -> float:
        """Seconds the capture mode adds to a step's forward (0 before a timed step ran it)."""
        if not self.capture_ops:
            return 0.0
        return float(statistics.median(self.capture_ops)) * self.capture_op_seconds

    def costs(self, engine: CostSource) -> CostTable:
        """One :class:`SegmentCost` per probed segment, in forward order, with every option
        that has been measured (``retain`` always is), and the capture mode's time."""
        out = []
        for name in peak_order(engine):
            rt = engine.runtimes[name]
            c = rt.contract
            if c is None:
                continue
            inputs = self.input_bytes.get(name, rt.input_bytes)
            act = self.activation_bytes.get(name, c.activation_bytes)
            # called k times per window (issue 31): retained, it keeps k calls' activations and
            # saved inputs at once; replayed, it keeps k calls' inputs, generator states and
            # preserved copies, and replays k times (each re-materializing one call's)
            k = max(getattr(rt, "window_calls", 1), 1)
            kept_act = self.window_activation_bytes(name, act, k)
            # measured at smaller inputs than the largest seen: scaled up with the input size
            grow = engine.size_scale(self.activation_size.get(name, engine.probe_size))
            grow_in = engine.size_scale(self.input_size.get(name, engine.probe_size))
            act, inputs, kept_act = int(act * grow), int(inputs * grow_in), int(kept_act * grow)
            opts = {
                "retain": Option(
                    memory=kept_act + k * int(rt.input_saved_bytes * grow_in), time=0.0
                )
            }
            for o in c.available_options():
                if o == "retain" or not self.has(name, o):
                    continue
                # (the read-only whole copies and the region log: once per window)
                held, once = self.held_bytes(name, c, o, k)
                replay = None
                if o in SELECTIVE:
                    # the kept op outputs, measured at this segment's forward: held until its
                    # replay, which re-materializes the activations autograd saves less the
                    # kept ones and consumes the others (each goes as its op is replayed): it
                    # adds its activations less every kept output (issue 30: measured)
                    kept = int(self.selective_bytes.get(name, 0) * grow_in)
                    held += kept
                    replay = max(act - kept, 0)
                rng = self.rng_bytes.get(name, 0)
                opts[o] = Option(
                    memory=k * (inputs + rng + held) + once,
                    time=k * self.median(name, o)
                    + (k * self.forward_extra(name, o) if o in SELECTIVE else 0.0),
                    capture=c.needs_capture(o),
                    replay=replay,
                )
            for o, opt in list(opts.items()):
                more = self.option_extra.get((name, o), 0)
                if more:
                    opts[o] = dataclasses.replace(opt, memory=opt.memory + more)
            out.append(SegmentCost(name=name, activation_bytes=act, options=opts))
        return CostTable(out, capture_time=self.capture_time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "times": {s: {o: list(v) for o, v in d.items()} for s, d in self.times.items()},
            "input_bytes": dict(self.input_bytes),
            "region_bytes": dict(self.region_bytes),
            "shared_bytes": dict(self.shared_bytes),
            "rng_bytes": dict(self.rng_bytes),
            "selective_bytes": dict(self.selective_bytes),
            "selective_saved_bytes": dict(self.selective_saved_bytes),
            "activation_bytes": dict(self.activation_bytes),
            "window_activation": {k: list(v) for k, v in self.window_activation.items()},
            "capture_ops": list(self.capture_ops),
        }


def peak_order(engine: CostSource) -> list[str]:
    """The segments in the order the peak formula sums them: forward order, or where a
    segment is called again later in the forward (block 0 of 0, 1, 0, 2), the order of the
    segments' last calls: its first replay comes at its last call's backward, holding what
    every segment before that call holds."""
    names = list(engine.segments)
    if any(getattr(engine.runtimes[n], "window_calls", 1) > 1 for n in names):
        names.sort(key=lambda n: getattr(engine.runtimes[n], "last_call", -1))
    return names


_DISPATCH_OVERHEAD: float | None = None


def dispatch_overhead() -> float:
    """Seconds the regions capture mode adds to one aten op of a forward on this machine, in
    a warm loop: the figure :attr:`CostMeter.capture_op_seconds` falls back on until it has
    timed the mode in place (where it costs several times more).

    Measured once, with the capture mode armed as in a window that logs writes, on the ops a
    layer runs (``linear``: a transpose and an ``addmm``; an activation; a view; an in-place
    add; a layer norm, on 64x64 tensors). Ops with several arguments and outputs cost the mode
    more than a lone ``add`` of a tiny tensor, which understates the overhead about 2x.
    """
    global _DISPATCH_OVERHEAD
    if _DISPATCH_OVERHEAD is None:
        from lightning_replay.core.mechanisms.preservation import (
            idle_capture_mode,
        )  # (imports this one)

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

        mode = idle_capture_mode()  # armed: every write is looked at
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


_SAVED_TENSOR_OVERHEAD: float | None = None


def saved_tensor_overhead() -> float:
    """Seconds ``torch.utils.checkpoint`` spends per saved tensor of a replayed segment outside
    the points where the engine times a replay, on this machine.

    The engine times each replayed call in place (see :class:`~lightning_replay.runtime.SegmentRuntime`):
    its preparation, checkpoint's frame around the forward, checkpoint's work from the start of
    the recomputation to the replay context and from the context's end to checkpoint's check
    of the recomputed tensors, and the replay context itself. What it cannot time in place is
    the work per saved tensor spread through the forward and backward: the pack hook at each
    saved tensor of the forward and the unpack hook at each use in backward. That is measured
    here once, as the slope over the number of saved tensors of checkpoint's extra time
    (forward and backward under checkpoint, against the same without it, less the time inside
    the recomputation context), on a chain of ``sin`` ops on small tensors, so that the ops
    themselves cost next to nothing; the least of interleaved repeats (a busy machine only adds
    time). The per-call part of checkpoint's work does not depend on the count and drops out
    of the slope. Measured outside any step (0.0, not kept, when called inside one, where the
    engine's own hooks would be timed instead). In a real step the caches are colder than in this loop, so this is a lower
    bound; it is a few microseconds per tensor against the per-call work measured in place.
    """
    global _SAVED_TENSOR_OVERHEAD
    if _SAVED_TENSOR_OVERHEAD is None:
        import contextlib

        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if (
            torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or _get_current_dispatch_mode_stack()
        ):
            # inside a step (the engine's accounting hooks, a capture mode): the loops below
            # would time those instead. The engine measures this when it is installed.
            return 0.0

        from torch.utils.checkpoint import checkpoint

        x = torch.randn(8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        inside = [0.0]

        class _Timed:
            def __enter__(self) -> None:
                self.t0 = clock()

            def __exit__(self, *exc: Any) -> bool:
                inside[0] += clock() - self.t0
                return False

        def chain(k: int):
            def fn(t: torch.Tensor) -> torch.Tensor:
                for _ in range(k):
                    t = torch.sin(t)  # saves its input
                return t

            return fn

        def ctx():
            return contextlib.nullcontext(), _Timed()

        def remainder(k: int, n: int = 20) -> float:
            fn = chain(k)
            t0 = clock()
            for _ in range(n):
                fn(x).sum().backward()
            plain = clock() - t0
            inside[0] = 0.0
            t0 = clock()
            for _ in range(n):
                checkpoint(fn, x, use_reentrant=False, context_fn=ctx).sum().backward()
            ckpt = clock() - t0
            return (ckpt - plain - inside[0]) / n

        lo, hi = 1, 17
        remainder(lo), remainder(hi)  # warm-up
        few = min(remainder(lo) for _ in range(5))
        many = min(remainder(hi) for _ in range(5))
        x.grad = None
        _SAVED_TENSOR_OVERHEAD = max(many - few, 0.0) / (hi - lo)
    return _SAVED_TENSOR_OVERHEAD
