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
#: how a step's work is timed in place: seconds now, the device synchronized first where the
#: engine times on CUDA (the runtime's ``_timed_clock`` bound to its engine)
StepClock = Callable[[], float]


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
    """The current step and window as a segment's replay sees it: the step number, the region
    log and its capture, generators seen moving, how deep in segment calls and replays the
    step is, and the model the segments belong to."""

    step: int
    model: Any
    log: Any
    host_watch: Any
    last_replay: Any
    _capturing: Any
    _segment_depth: int
    _replays_this_step: int

    def state_name(self, *args: Any, **kwargs: Any) -> Any: ...

    def _contracts_changed(self) -> None: ...

    def _check_next(self, *args: Any, **kwargs: Any) -> Any: ...

    def on_violation(self, *args: Any, **kwargs: Any) -> Any: ...


class ReplayHost(Device, Accounting, Window, Protocol):
    """Everything around a segment's replay that restore and a replayed probe's replay use:
    its records, its device, its accounting and its window. The engine is one. (The probe and
    the checks take their own, :class:`ProbeHost` and :class:`CheckHost`.)"""

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


# ---------------------------------------------------------------- the probe's and checks' ports
# :class:`~lightning_replay.core.replay.probe.SegmentProbe` and
# :class:`~lightning_replay.core.replay.checks.SegmentChecks` are objects the runtime composes,
# each built from a segment port, a host port, the records sink (and, for the checks, a step
# clock). The ports list exactly what each reads or writes (tests/test_architecture.py holds
# them to it, and bounds their sizes).


class ProbeHost(Protocol):
    """The engine as the probe sees it: the window it probes in (step, model, region log,
    segment depth), the state names it reports, the accounting a replayed probe charges, the
    outside tensors and generators it names, and where a finished contract is announced."""

    step: int
    model: Any
    config: Any
    log: Any
    meter: Any
    accountant: Any
    _cuda_device: Any
    _segment_depth: int
    _external: list
    _pending_probes: set

    def state_name(self, *args: Any, **kwargs: Any) -> Any: ...

    def _contracts_changed(self) -> None: ...


class ProbedSegment(Protocol):
    """One segment as its probe sees it. Read: its name, modules (and their names), forward,
    guard and preservation. Written: what a probe makes of it, the contract and its version,
    the status, the bound state and generators, the outside attributes read, the storages seen
    as state, the pending probes, the input sizes, and the reactions to a probe that diverged
    (``demoted``, ``retained_probe``, ``divergences``); ``_derive`` refreshes the cached figures
    after the contract changed."""

    name: str
    modules: list
    module_names: dict
    orig_forward: Any
    guard: Any
    preservation: str
    outside: list
    probes: list
    contract: ReplayContract | None
    version: int
    status: str
    bound: list
    generators: list
    state_keys: set
    demoted: bool
    retained_probe: bool
    planned_option: str | None
    divergences: int
    input_bytes: int
    input_saved_bytes: int
    contract_size: int  # elements of the step's inputs when its contract was made
    grad_reads: list  # weak references to the tensors whose .grad its forwards read

    def _derive(self) -> None: ...


class CheckHost(Protocol):
    """The engine as the checks see it: whether bytes are checked and costs measured, the window
    (step), how the step is timed (device and synchronization), the accounting and cost meter a
    checked call charges, the window's size and segment depth, the state names, the selective policy
    (``config``), and where a reaction is announced."""

    config: Any
    meter: Any
    accountant: Any
    measure_costs: bool
    step: int  # the window a measured call's bytes add up in (a segment called k times)
    _check_bytes: bool
    _cuda: bool
    _cuda_device: Any
    _sync: bool
    _segment_depth: int
    _window_size: int

    def state_name(self, *args: Any, **kwargs: Any) -> Any: ...

    def _contracts_changed(self) -> None: ...


class CheckedSegment(Protocol):
    """One segment as its checks see it. Read: its name, module(s), forward, its contract's state
    bound to the live model (where it is now), the selective calls not kept, its contract.
    Written: the counters (``checks``, ``divergences``, ``reactions``) and the reaction to a
    divergence (``status``, ``demoted``, ``planned_option``). ``_prepare`` takes one call's
    entry state (restore's invocation), ``_derive`` refreshes the cached figures after the
    contract changed; ``selective_frame`` makes a selective forward's frame and
    ``settle_frame`` settles it after that forward."""

    name: str
    module: Any
    modules: list
    orig_forward: Any
    bound: list  # the contract's state bound to the live model (where it is now)
    sac_skip: set
    contract: ReplayContract | None
    status: str
    demoted: bool
    planned_option: str | None
    checks: int
    divergences: int
    reactions: int

    def _prepare(self, *args: Any, **kwargs: Any) -> Any: ...

    def _derive(self) -> None: ...

    def selective_frame(self, verify: bool = False) -> Any: ...

    def settle_frame(self, frame: Any) -> None: ...
