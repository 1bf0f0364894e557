"""What the lower layers need from the runtime and the engine, as small protocols.

Probe, restore, checks and the cost meter run inside a segment's call, and need a few things
from around them: where to record, how to time, what to restore, which accounting to charge.
They name those things here, by protocol, instead of importing
:class:`~lightning_replay.core.runtime.SegmentRuntime` or
:class:`~lightning_replay.core.engine.engine.ReplayEngine` from the layers above (the layer map:
``docs/architecture.md``). The runtime and the engine satisfy these protocols structurally: the
engine composes them, and nothing below it needs to know the classes that do.

Each protocol lists exactly the members its users touch; a member added to a lower module's use
is added here, where a reader sees how wide each interface is.

Example:
    >>> from lightning_replay.core.base.records import RecordStore
    >>> isinstance(RecordStore(), RecordSink)
    True
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from lightning_replay.core.base.contract import ReplayContract

#: how to time: seconds, ``clock(cuda)`` (:func:`~lightning_replay.core.base.clock.clock`)
Clock = Callable[[bool], float]


@runtime_checkable
class RecordSink(Protocol):
    """Where checks and contract events are recorded (a
    :class:`~lightning_replay.core.base.records.RecordStore`): rows are appended, never
    dropped."""

    def append(self, *args: Any, **kwargs: Any) -> Any: ...


class Device(Protocol):
    """Where a step runs, as timing needs it: whether on CUDA, which device, whether to
    synchronize it before reading a clock."""

    _cuda: bool
    _cuda_device: Any
    _sync: bool


class Accounting(Protocol):
    """The step's memory accounting: the accountant (or None), bytes held by preserved state,
    the cost meter, and whether costs are being measured."""

    accountant: Any
    meter: Any
    measure_costs: bool
    _held_bytes: int

    def _replay_started(self, activation_bytes: int) -> None: ...

    def _record_replay_time(self, invocation: Any, seconds: float) -> None: ...


class Window(Protocol):
    """The current step and window as a segment's call sees it: the step number, the region
    log and its capture, generators seen moving, how deep in segment calls and replays the
    step is, and the model the segments belong to."""

    step: int
    model: Any
    config: Any
    log: Any
    host_watch: Any
    last_replay: Any
    _capturing: Any
    _segment_depth: int
    _replays_this_step: int
    _window_size: int
    _external: list
    _pending_probes: set
    _check_bytes: bool

    def state_name(self, *args: Any, **kwargs: Any) -> Any: ...

    def _contracts_changed(self) -> None: ...

    def _check_next(self, *args: Any, **kwargs: Any) -> Any: ...

    def on_violation(self, *args: Any, **kwargs: Any) -> Any: ...


class ReplayHost(Device, Accounting, Window, Protocol):
    """Everything around a segment's call that probe, restore and checks use: its records, its
    device, its accounting and its window. The engine is one."""

    records: RecordSink


class CostSource(Protocol):
    """What the cost meter reads to build the planner's table: the segments in forward order,
    each one's runtime (its contract and input bytes), and how figures measured at one input
    size scale to the largest seen."""

    segments: list[str]
    runtimes: dict[str, Any]
    probe_size: int

    def size_scale(self, size: int) -> float: ...


class ReplaySegment(Protocol):
    """One segment as the lower layers see it: what to restore (its modules, bound state,
    generators, outside attributes, contract and version), its counters, where its events go
    (``engine``: a :class:`ReplayHost`), and the callbacks by which it reacts to a violation or
    an observation. The per-segment runtime is one."""

    name: str
    engine: ReplayHost
    contract: ReplayContract
    version: int
    status: str
    modules: list
    bound: Any
    generators: list
    outside: list
    guard: Any
    probes: list
    retained_probe: Any
    replays: int
    divergences: int
    last_preserved_bytes: int
    _entry_plan: Any

    def _violation(self, *args: Any, **kwargs: Any) -> Any: ...

    def _check_state_digests(self, invocation: Any) -> None: ...

    def _observe(self, probe: Any) -> None: ...

    def _replay_path_error(self, probe: Any, exc: BaseException) -> BaseException: ...

    def _compare_grads(self, *args: Any, **kwargs: Any) -> Any: ...
