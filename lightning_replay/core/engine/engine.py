"""The replay engine: one model's windows, plan and accounting.

:func:`~lightning_replay.installation.install` validates the arguments once (a
:class:`~lightning_replay.config.ReplayConfig`, kept as ``engine.config``), resolves the segments
and builds the :class:`ReplayEngine`, which routes the model's forwards through itself by class
swaps (:mod:`~lightning_replay.installation`); copies of an installed model are plain models.
:class:`ReplayEngine` owns what spans segments: windows and steps, the region log and its
capture mode, memory accounting and the real-peak measurement, calibration and where the plan
is made (:meth:`ReplayEngine.replan`, :meth:`ReplayEngine.adopt_plan`), check selection,
records, and resumable state. After install, its configuration and plan change only through
its own methods (:meth:`ReplayEngine.reconfigure`, :meth:`ReplayEngine.replan`,
:meth:`ReplayEngine.adopt_plan`, :meth:`ReplayEngine.load_state_dict`). When to re-plan is
:mod:`~lightning_replay.replan`'s.

A segment's own life (guards, probe, contract, preserved replays, checks and their reaction)
is in :mod:`~lightning_replay.runtime`, :mod:`~lightning_replay.probe`,
:mod:`~lightning_replay.restore` and :mod:`~lightning_replay.checks`.

Three concerns of the engine live in modules of their own, as functions over it: what a step
really held and what the base learns from it (:mod:`~lightning_replay.core.engine.real_peak`),
which option each segment is timed with in a calibration step
(:mod:`~lightning_replay.core.engine.calibration`), and which segments a step checks under a
budget (:mod:`~lightning_replay.core.engine.check_steps`). What stays here is the window
bookkeeping, accounting, planning and resumable state, which read and write the same per-step
state (the accountant, the step counter, the plan); it holds no per-segment logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.engine import rank_phases as _rank_phases
from lightning_replay._compat import at_backward_end, top_saved_tensors_hooks, tree_leaves
from lightning_replay.core.mechanisms.accounting import MemoryAccountant
from lightning_replay.core.base.budget import Budget, format_bytes
from lightning_replay.core.engine.config import PIN_OPTIONS
from lightning_replay.core.engine.config import ReplayConfig
from lightning_replay.core.base.contract import OPTIONS, ReplayContract
from lightning_replay.core.mechanisms.costs import CostMeter
from lightning_replay.errors import ReplayConfigError
from lightning_replay.core.mechanisms.host_rng import HostWatch
from lightning_replay.core.mechanisms.memory import (
    StepPeak,
    live_model_bytes,
    model_tensors,
    process_tensor_bytes,
    profiler_busy,
)
from lightning_replay.core.engine.planner import InfeasibleBudget
from lightning_replay.core.mechanisms.preservation import CaptureMode, RegionLog, idle_capture_mode
from lightning_replay.core.base import nesting as _nesting
from lightning_replay.core.mechanisms.slots import Registration
from lightning_replay.core.base.records import RecordStore
from lightning_replay.core.engine.replan import ReplanPolicy, StateGrowth, input_shapes
from lightning_replay.core.engine.calibration import (
    calibration_held,
    fit_calibration,
    fit_to,
    refuse_before_calibrating,
)
from lightning_replay.core.engine.check_steps import (
    check_step_plan,
    checked_peak,
    missed_turn,
    select_checked,
)
from lightning_replay.core.engine.step_graph import StepGraph, give_back, previous_step
from lightning_replay.core.engine.real_peak import (
    _REPLAY,
    drop_stale_hooks,
    fold_optimizer_growth,
    forward_begins,
    forward_ends,
    grad_credits,
    observe_fresh_grads,
    observe_grads,
    settle_real_peak,
    start_truth,
    stop_truth,
    unwatch_optimizers,
    watch_optimizers,
)
from lightning_replay.core.replay.restore import _Invocation
from lightning_replay.core.engine import attach as _attach
from lightning_replay.core.engine.attach import _new_plain  # noqa: F401  (named by older pickles)
from lightning_replay.core.runtime import NOT_CALLED, SegmentRuntime, idle_message
from lightning_replay.core.base.state import (
    StateIndex,
    storage_key,
)
from lightning_replay.core.base.state import unique_bytes as _unique_bytes

_UNCHANGED = object()  # an argument left out: keep the current value


def _input_bytes(inputs: Any) -> int:
    """Bytes of the step's input tensors (each storage once): made before the step, so a
    profiler started with it does not see them, yet live through it."""
    seen: dict = {}
    for t in tree_leaves(inputs) if inputs is not None else ():
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            key = storage_key(t)
            if key is not None:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _input_numel(inputs: Any) -> int:
    """Elements of the step's input tensors."""
    if inputs is None:
        return 0
    return sum(t.numel() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))


def _rank_count() -> int:
    """Processes in the default group (1 without one). On several ranks the CPU real-peak
    measurement runs only where a strategy agrees the ranks' bases (see
    :meth:`ReplayEngine.agree_real_base`): every rank runs one plan, so a residual measured on
    one rank must reach the plan of all."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _model_cuda_device(model: nn.Module) -> torch.device | None:
    """The CUDA device the model's parameters live on (the first, if several)."""
    devs = {p.device for p in model.parameters() if p.is_cuda}
    return min(devs, key=lambda d: d.index or 0) if devs else None


def _first_param_is_cuda(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.is_cuda


def _drop_depth(cell: list) -> None:
    for thread, n in cell[1].items():  # (on whichever thread collects the engine)
        _nesting.moved(-n, thread)
    cell[0] = 0
    cell[1].clear()


class ReplayEngine:
    """State-aware replay for the segments of one model. Made by :func:`install`."""

    @property
    def _segment_depth(self) -> int:
        """> 0 inside one of this engine's segment forwards or replays (also counted in
        :func:`~lightning_replay.core.base.nesting.segments_running`, for every engine)."""
        return self._depth[0]

    @_segment_depth.setter
    def _segment_depth(self, value: int) -> None:
        cell = self.__dict__.get("_depth")
        if cell is None:  # (a cell the finalizer reads: an engine dropped mid-segment, as by
            # an error no frame caught, leaves no count behind for every later segment)
            cell = self.__dict__["_depth"] = [0, {}]  # (its depth, and each thread's part)
            weakref.finalize(self, _drop_depth, cell).atexit = False
        delta, thread = value - cell[0], threading.get_ident()
        n = cell[1].get(thread, 0) + delta
        if n:
            cell[1][thread] = n
        else:
            cell[1].pop(thread, None)
        _nesting.moved(delta)
        cell[0] = value

    def __init__(
        self,
        model: nn.Module,
        segments: Mapping[str, nn.Module],
        config: ReplayConfig,
        records: RecordStore,
    ) -> None:
        self._model: nn.Module | None = model  # weak after uninstall (see the property)
        self._model_ref = weakref.ref(model)
        #: What the engine was installed with; :meth:`reconfigure` and :meth:`replan` keep its
        #: budget and planner current.
        self.config = config
        self.records = records
        self.log = RegionLog()
        self.step = 0
        self._budget = _resolve_budget(config, model)
        self._check_budget_floor()
        self.plan: _planner.Plan | None = None
        self.plan_version = 0
        self._why: tuple[str, ...] = ()  # why a plan is being made (see _because)
        self.plan_transform: Callable[[_planner.Plan], _planner.Plan] | None = None
        self.meter = CostMeter()
        self.measure_costs = (
            bool(config.measure_costs) or self._budget is not None or config.budget.min
        )
        #: The re-plan policy the engine runs between windows (``None``: ``replan_on=()``).
        self.replan_policy = ReplanPolicy(config.replan) if config.replan.replan_on else None
        self.accountant: MemoryAccountant | None = None
        self._acct_hooks: Any = None
        self._calibration: list[str] = []
        self._warmup = False
        self._last_peak = 0
        self._base_saved = 0
        self._capture_entry_time: dict = {}  # this step's seconds logging each storage
        self._capture_ops = 0  # ops the capture mode saw in this step's forward
        self._capture_timed = False  # whether this step's count is a cost sample
        # On CUDA, times are only taken while calibrating (synchronized), and peaks come from
        # the allocator.
        self._cuda = _first_param_is_cuda(model)
        self._sync = False
        if config.track_memory or self.measure_costs:
            self.track_memory(True)
        self._external: list[Any] = []
        self._pending_probes: set[SegmentRuntime] = set()
        # segments planned with a stood-in replay time (see _plan_late_segments)
        self._stood_in: set[str] = set()
        self._idle_warned: set[str] = set()  # segments named as not replaying (see runtime)
        self._held_bytes = 0
        self._replays_this_step = 0
        self._truth: StepPeak | None = None  # measuring a step's real peak (CPU)
        self._truth_pending = False
        self._truth_peak: int | None = None
        self._truth_hook: Any = None
        self._truth_rounds = 0  # steps measured so far
        self._truth_off = False  # another profiler refused ours: measure nothing more
        self._profiler_warned = False  # a step's real peak went unmeasured: said once
        self._next_truth = 0  # the step of the next periodic measurement
        self._truth_gap = self.TRUTH_EVERY[0]
        self._truth_plan: _planner.Plan | None = None  # the plan the measured step ran
        self._truth_state = 0  # the model's state bytes as the measured step began
        self._state_now = 0  # ... as this step began (measured only where real peaks are)
        self.state_growth = StateGrowth()  # peak per byte of state grown (replan.StateGrowth)
        self._truth_opt = 0  # bytes the measured step began with beyond the model and batch
        self._truth_held = 0  # ... as the process walk found them when it began
        self._truth_base = 0  # the process's live tensor bytes as the measured step began
        self._truth_checked = False  # whether the last step began was derivative-checked
        self._window_plan = -1  # the plan version the last step began under
        self._truth_budget: int | None = None  # the budget the measured step ran under
        self._past_plan_said = -1  # the plan version _held_past_plan last spoke of
        self._truth_inputs = 0  # bytes of the measured step's inputs, made before it began
        self._truth_size: int | None = None  # the largest input (elements) measured at
        self._window_size = 0  # elements of this window's inputs (0: not known)
        self._truth_step_size = 0  # ... of the step being measured
        self._residual_size = 0  # ... of the step whose residual is in force
        self._residual_top = 0  # ... of the largest step measured
        self._residual_fixed = 0  # optimizer state's bytes in the residual (not input-sized)
        # what the process held beside the model as measured steps began: what every figure
        # in force includes at least, and the last step's (real_peak.rebase_held)
        self._held_ref: int | None = None
        self._held_prev: int | None = None
        # the optimizers' state bytes the figures include (the most any measured step began
        # with; state made after it is added at the first plan: real_peak.fold_optimizer_growth)
        self._held_opt = 0
        self._opt_watch: Any = None  # until the first plan: adopts the optimizers that step
        self._truth_opt_start = 0  # ... the measured step began with
        self._max_size = 0  # the largest seen
        self.probe_size = 0  # the largest before the first plan (the probes' inputs)
        self._over_budget_warned = -1  # the plan version last warned for a real overrun
        self._optimizers: list[Any] = []
        self._residual = 0  # bytes a measured step held beyond the accountant's figures
        # ... per phase (see real_peak.phase_residuals), the largest measured: the forward's
        # end, loss and backward until the first replay; each segment's replay (backward from
        # it on).
        # The residual above is the least of them, held in the base; the rest is charged at
        # its own moment (phase_peak_args)
        self._over_fwd: int | None = None
        self._over_replay: dict[str, int] = {}
        # ... and inside each segment's forward under each option, beyond what the segments
        # before it and it itself keep ((segment, option) -> bytes; real_peak.forward_begins)
        self._over_seg_fwd: dict[tuple[str, str], int] = {}
        self._raw_seg_fwd: dict[tuple[str, str], int] = {}
        self._truth_forward: dict[str, str] = {}  # the measured step's segment forwards: option
        self._phase_forward: dict[tuple[str, str], int] = {}  # ... and what each held over
        self._floor = 0  # the real peak of a measured step's optimizer phase (its inputs' part
        self._floor_inputs = 0  # grows with the input size: _floor_size)
        self._floor_size = 0
        self._truth_phases: dict[str, int] = {}  # the measured step's real peak per phase
        # per replay phase of the step in hand: the preserved bytes its call gave back at the
        # replay's end (see real_peak.phase_residuals)
        self._replay_released: dict[str, int] = {}
        self._truth_released: dict[str, int] = {}  # those of the measured step
        self._truth_pre_hook: Any = None
        # gradients that do not exist yet (real_peak.grad_credits): storage key -> bytes of
        # those None as every window so far began (None before the first), as this window
        # began (when any are still credited) and as the measured step began; where a
        # measured step found each made (the least segment position whose replay found it
        # None, the greatest that found it made); the measured step's observations
        self._grad_fresh: dict | None = None
        self._grad_now: dict = {}
        self._truth_fresh: dict = {}
        self._grad_none_at: dict = {}
        self._grad_made_at: dict = {}
        self._grad_seen: list = []
        self._grad_end_hooked = False
        # the phases' figures as if every gradient were charged all step (no credit), for
        # inputs larger than measured; what each phase of the last measured step was credited
        self._raw_fwd: int | None = None
        self._raw_replay: dict[str, int] = {}
        self._phase_credit: dict[str, int] = {}
        # CUDA: the allocator's peak per phase of the step (read and reset as each begins)
        self._cuda_phases: dict[str, int] = {}
        self._cuda_label = "start"
        self._plan_extras: tuple = ()  # (plan, phase figures) the plan's prediction was made with
        self._ranks_base: int | None = None  # the largest real base over the ranks (a strategy)
        self._ranks_phases: dict[str, Any] | None = None  # the ranks' largest phase figures
        self.host_watch = HostWatch()  # Python's and numpy's global RNGs across each forward
        self.last_replay: tuple | None = None  # (runtime, step, contract version) last replayed
        self.last_real_peak: tuple[int, int] | None = None  # (step, bytes) last measured
        self._window_depth = 0
        # the step in hand's graph: whether a backward reached it (see step_graph)
        self._step_graph: StepGraph | None = None
        self._phase_taken: str | None = None  # the calibration phase this window took
        # running the lowest plan on inputs larger than any measured step, until it is measured
        self._low_until_measured = False
        self._calib_size = 0  # the largest input (elements) of a step since the probe
        self._explicit_windows = 0  # root or manual windows opened so far
        self._segment_depth = 0  # > 0 inside a segment's forward or replay
        self._cuda_device: torch.device | None = None
        self._capture: CaptureMode | None = None
        self._capturing = False
        self._forward_open = False  # a window's forward is open and its capture decided
        self._needs_capture = True
        self._check_grad = False
        self._checked: frozenset = frozenset()  # segments chosen to be checked this window
        self._checked_ran: set[str] = set()  # ... of which ran under their check
        self._check_turn: tuple[frozenset, list[str]] | None = None  # (chosen, in turn order)
        self._check_missed: dict[str, int] = {}  # turns in a row a chosen segment did not run
        self._check_cursor = 0
        # derivative checks that did not fit the budget: a checked window that checked nothing,
        # and each turn of a segment passed over while others were checked
        self.checks_skipped = 0
        self.checks_skipped_reason: str | None = None  # why the last one was skipped
        # (plan version, what a skipped-check warning named: segments, "*" for a whole step)
        self._checks_named: tuple[int, set[str]] = (0, set())
        self._step_choices: dict[str, str] | None = None  # a checked step's own plan, if any
        self._check_bytes = False
        self._check_next: tuple[bool, bool] | None = None
        self._replays_last_step = 0
        self._preserved_last_step = 0
        self._last_step = 0
        self._last_cuda_peak = 0
        self._cuda_held = 0  # allocator bytes held as the last window began (CUDA)
        self._suspended = False
        self._order = 0
        self._window_last_order: float = -1  # the last segment called in this window (order)
        self._hooks: list = []
        self.runtimes: dict[str, SegmentRuntime] = {}
        # (a module outside the model, which a segment holds in an attribute, is a holder)
        self._registration = Registration(model)
        try:
            for name, mod in segments.items():
                self.runtimes[name] = SegmentRuntime(self, name, mod, config.preservation_of(name))
            self._root_class = _attach.attach(self)
        except BaseException:
            self._registration.release()  # (refused: the model is as it was)
            raise
        self.installed = True

    # ---------------------------------------------------------------- public
    @property
    def model(self) -> nn.Module | None:
        """The model the engine is installed on. After :meth:`uninstall` the engine no longer
        keeps it alive: this is the model while something else holds it, else ``None``."""
        return self._model if self._model is not None else self._model_ref()

    @property
    def budget(self) -> int | None:
        """The budget in bytes plans are made for (``None``: the lowest-memory correct plan,
        or no planning). Setting it is :meth:`reconfigure` with ``budget=``."""
        return self._budget

    @budget.setter
    def budget(self, value: int | str | None) -> None:
        self.reconfigure(budget=value)

    @property
    def planner(self) -> str:
        """The planner method (:data:`lightning_replay.planner.METHODS`)."""
        return self.config.planner

    @property
    def on_violation(self) -> str:
        return self.config.on_violation

    @property
    def calibration_steps(self) -> int:
        return self.config.calibration_steps

    @property
    def real_peak(self) -> bool:
        return self.config.real_peak

    @property
    def ready_to_plan(self) -> bool:
        """Costs have been measured (every segment probed at least once): :meth:`replan` can
        plan. Before that it raises."""
        return bool(self.costs)

    @property
    def contracts(self) -> dict[str, ReplayContract]:
        """Current contract of each probed segment."""
        return {n: rt.contract for n, rt in self.runtimes.items() if rt.contract is not None}

    @property
    def segments(self) -> list[str]:
        """Segment names in forward execution order (module order until first run)."""
        return sorted(
            self.runtimes, key=lambda n: (self.runtimes[n].order < 0, self.runtimes[n].order)
        )

    @property
    def preserved_bytes(self) -> int:
        """Bytes held right now for pending replays (whole copies plus region logs)."""
        return self._held_bytes + self.log.nbytes

    @property
    def costs(self) -> list[_planner.SegmentCost] | None:
        """Measured costs per segment and option (None before any segment is probed)."""
        costs = self.meter.costs(self)
        return costs or None

    @property
    def base_memory(self) -> int:
        """Bytes outside the segments in the accountant's terms: parameters, buffers and
        their gradients, tensors saved for backward outside segments (measured), plus
        ``base_memory`` given to install. Plans use :attr:`real_base_memory`."""
        return self._static_bytes() + self._base_saved

    @property
    def unaccounted_bytes(self) -> int:
        """What a measured step held beyond all of the accountant's figures (0 until one is
        measured)."""
        return self._residual

    @property
    def peak_is_allocator(self) -> bool:
        """Whether ``window_stats()["peak_bytes"]`` is the allocator's real peak (CUDA), not
        the accountant's (CPU)."""
        return self._cuda

    @property
    def real_base_memory(self) -> int:
        """:attr:`base_memory` plus what a measured step held beyond the accountant's figures
        (backward temporaries, optimizer state; see :mod:`lightning_replay.memory`): the base
        plans are made with, so that their predicted peak bounds the real one. On ranks that
        run one plan, the largest rank's (:meth:`agree_real_base`) where it is larger.

        Less the gradients that do not exist at the forward's end (None as every window
        began, once a step was measured against that figure: ``zero_grad(set_to_none=True)``);
        :attr:`phase_peak_args` charges each segment's moment those that exist by then.

        Plus the config's ``reserve_memory``, which no measurement absorbs."""
        # the part that is not optimizer state (backward temporaries, the batch) grows with
        # the input, like the activations (see size_scale)
        residual = self._scaled_residual()
        fixed = min(self._residual_fixed, residual)
        grows = (residual - fixed) * self.size_scale(self._residual_size)
        credit = grad_credits(self)[0]
        own = self.base_memory + fixed + int(grows) - credit
        if self._ranks_base is not None:
            own = max(own, self._ranks_base - credit)
        return own + self.config.reserve_memory

    @property
    def phase_peak_args(self) -> dict[str, int]:
        """The measured phases of the step beyond :attr:`real_base_memory`, as the keyword
        arguments of :func:`~lightning_replay.planner.predicted_peak`, :func:`~lightning_replay.planner.plan`
        and :func:`~lightning_replay.planner.min_feasible_budget`: ``forward_extra``, what a
        measured step held at its forward's end, loss and backward before the first replay
        beyond what its replays held over the formula (head and loss temporaries on top of
        the retained segments), and ``floor``, its optimizer phase's real peak (no plan goes
        under it). Both 0 until a step is measured.

        On ranks that run one plan, each figure is the largest of this rank's and the ranks'
        largest as last agreed (:meth:`agree_phases`)."""
        return _rank_phases.largest(self._own_phase_args(), self._ranks_phases)

    def _own_phase_args(self) -> dict[str, Any]:
        """:attr:`phase_peak_args` as this rank alone measured them."""
        residual = self._scaled_residual()
        fixed = min(self._residual_fixed, residual)
        scale = self.size_scale(self._residual_size)
        over_fwd, over_replay = self._phase_overs()

        def beyond(over: int) -> int:  # beyond the base's residual, grown with the input
            return max(int((over - fixed) * scale) - int((residual - fixed) * scale), 0)

        floor = self._floor
        if floor:
            floor += int(self._floor_inputs * (self.size_scale(self._floor_size) - 1))
        args: dict[str, Any] = {
            "forward_extra": beyond(over_fwd) if over_fwd is not None else 0,
            "floor": floor,
        }
        # the gradients the base leaves out (real_base_memory) that exist at each segment's
        # moment: those backward has made by then
        transient = self._forward_transients(beyond)
        if transient:
            args["forward_transient"] = transient
        credit, made = grad_credits(self)
        if over_replay:
            # a segment never measured replaying: the largest any replay held
            most = beyond(max(over_replay.values()))
            args["replay_extra"] = {
                n: (beyond(over_replay[n]) if n in over_replay else most) + made.get(n, 0)
                for n in self.segments
            }
        elif credit:
            args["replay_extra"] = {n: made.get(n, 0) for n in self.segments}
        return args

    def _forward_transients(self, beyond: Any) -> dict[str, dict[str, int]]:
        """Per segment and option, what its forward held beyond the segments before it and
        its own kept bytes (measured; ``beyond`` the base's residual). An option never measured
        is charged the most its segment's measured options held (a forward that keeps its
        activations holds at most what a replayed one drops beside them), a segment never
        measured the most any held."""
        scaled = self.size_scale(self._residual_size) > 1.0 and self._raw_fwd is not None
        seg_fwd = self._raw_seg_fwd if scaled and self._raw_seg_fwd else self._over_seg_fwd
        if not seg_fwd:
            return {}
        most = max(seg_fwd.values())
        out: dict[str, dict[str, int]] = {}
        for name, rt in self.runtimes.items():
            if rt.contract is None:
                continue
            mine = {o: t for (n, o), t in seg_fwd.items() if n == name}
            fallback = beyond(max(mine.values()) if mine else most)
            opts = {"retain", *rt.contract.available_options()}
            out[name] = {o: beyond(mine[o]) if o in mine else fallback for o in sorted(opts)}
        return out

    def _scaled_residual(self) -> int:
        """The residual held in the base: the least of the phases' (each phase's excess over
        it is charged at its own moment), or, at inputs larger than any measured step, the
        largest, at every moment: which phase's excess grows with the input (backward and loss
        temporaries) and which does not (gradients made by a replay's moment) is not known."""
        if self.size_scale(self._residual_size) > 1.0:
            over_fwd, over_replay = self._phase_overs()
            overs = [*over_replay.values()] + ([over_fwd] if over_fwd is not None else [])
            overs.append(max(min(overs), 0) if overs else self._residual)
            return max(overs)
        return self._residual

    def _phase_overs(self) -> tuple[int | None, dict[str, int]]:
        """What measured steps held beyond the formula's figures at the forward's end and at
        each replay: beyond the figures that credit gradients which do not exist yet, or, at
        inputs larger than measured (where nothing is credited), beyond those that charge every
        gradient all step."""
        if self.size_scale(self._residual_size) > 1.0 and self._raw_fwd is not None:
            return self._raw_fwd, self._raw_replay
        return self._over_fwd, self._over_replay

    def agree_real_base(self, nbytes: int) -> None:
        """Plan with ``nbytes`` as the real base where it exceeds this rank's own: the largest
        ``base_memory + unaccounted_bytes`` over the ranks that run one plan (a strategy reduces
        it across ranks and calls this on every rank at the same point). It also lets each rank
        measure its own real peak on CPU (see :func:`_rank_count`). The plan in force is
        re-fitted as after a measured step: its prediction grows, or, over the budget, it is
        made again."""
        self._ranks_base = int(nbytes)
        self._refit_plan()

    def phase_row(self) -> list[int]:
        """This rank's own measured phase figures as a row of integers, the same length on
        every rank (see :mod:`~lightning_replay.core.engine.rank_phases`): a strategy reduces
        the rows with ``max`` and hands the result to :meth:`agree_phases` on every rank."""
        return _rank_phases.phase_row(self._own_phase_args(), self.segments)

    def agree_phases(self, row: Iterable[int]) -> None:
        """Plan with each phase figure at least the largest over the ranks that run one plan
        (``row``: the element-wise ``max`` of every rank's :meth:`phase_row`; a strategy
        reduces it and calls this on every rank at the same point). Rank 0 makes the plan
        every rank runs: with its own figures alone, another rank's prediction for that plan
        can exceed the budget. The plan in force is re-fitted as after a measured step."""
        self._ranks_phases = _rank_phases.phase_args(list(row), self.segments)
        self._refit_plan()

    def _static_bytes(self) -> int:
        """Parameters, buffers, gradients and the caller's extra base: held all step."""
        static: dict = {}
        grads: dict = {}
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            local = getattr(t, "_local_tensor", t)  # an FSDP2 shard: this rank's bytes
            key = storage_key(local)
            if key is not None:
                static[key] = local.untyped_storage().nbytes()
                if t.requires_grad:
                    grads[key] = static[key]
        return sum(static.values()) + sum(grads.values()) + self.config.base_memory

    def state_name(self, t: torch.Tensor) -> str | None:
        """The model's name for the storage of ``t`` (a parameter, buffer or attribute)."""
        key = storage_key(t)
        refs = StateIndex(self.model).lookup(key) if key is not None else []
        return refs[0].name if refs else None

    def track_memory(self, enabled: bool = True) -> None:
        """Turn exact byte accounting on (every step pays a saved-tensor hook) or off."""
        if enabled and self.accountant is None:
            self.accountant = MemoryAccountant()
            self.accountant.namer = self.state_name
            self.accountant.extra = lambda: self.log.nbytes
        elif not enabled:
            self.accountant = None

    def step_stats(self) -> dict[str, Any]:
        """The last *closed* window: accounted peak bytes (base included), replays, preserved
        bytes, plan version. A window closes when the next one begins, so after a step's
        backward this is still the step before; :meth:`window_stats` is the step in hand.
        ``peak_bytes`` is None when memory tracking is off."""
        return {
            "step": self._last_step,
            "peak_bytes": (
                self._last_cuda_peak
                if self._cuda
                else self._static_bytes() + self._last_peak
                if self.accountant is not None
                else None
            ),
            "replays": self._replays_last_step,
            "preserved_bytes": self._preserved_last_step,
            "plan_version": self.plan_version,
        }

    def window_stats(self) -> dict[str, Any]:
        """The current window: the step in progress, or, once its backward has run (after
        ``loss.backward()``, in ``on_train_batch_end``), the step just trained.

        Keys as :meth:`step_stats`, plus ``checked`` (the segments derivative-checked in this
        window), ``accounted_peak_bytes``: the accountant's peak in the planner's terms
        (parameters, buffers, gradients, the extra base, and everything saved, snapshotted or
        re-materialized so far), and, side by side, ``predicted_peak_bytes`` (the plan's
        prediction of the real peak, None before a plan) and ``real_peak_bytes`` /
        ``real_peak_step``: the last real peak measured, by the CUDA allocator or, on CPU, by
        profiler memory events on the first step of each plan (a step's real peak is known
        once its optimizer step has run, so on CPU it lags). ``peak_bytes`` is the CUDA
        allocator's peak since the window began on GPU, and the accounted peak on CPU; the
        accounted figures are None when memory tracking is off. Nothing here synchronizes the
        device.
        """
        acct = self.accountant
        accounted = self._static_bytes() + acct.peak if acct is not None else None
        peak = accounted
        real = self.last_real_peak
        if self._cuda:
            # the caching allocator's counters are host-side: no synchronization needed
            peak = int(torch.cuda.max_memory_allocated(self._cuda_device))
            real = (self.step, peak)
        return {
            "step": self.step,
            "peak_bytes": peak,
            "accounted_peak_bytes": accounted,
            "predicted_peak_bytes": self.plan.peak_memory if self.plan else None,
            "real_peak_bytes": real[1] if real else None,
            "real_peak_step": real[0] if real else None,
            "checked": sorted(self._checked & self._checked_ran) if self._check_grad else [],
            "replays": self._replays_this_step,
            "preserved_bytes": sum(rt.last_preserved_bytes for rt in self.runtimes.values()),
            "plan_version": self.plan_version,
        }

    def replan(
        self, budget: int | str | None | object = _UNCHANGED, method: str | None = None
    ) -> _planner.Plan:
        """Plan again from the measured costs (optionally with a new budget or method).

        A segment pinned with ``preservation={name: option}`` is planned only with that option
        (``"whole"``/``"regions"`` also allow ``recompute`` where the segment is stateless);
        ``"auto"`` leaves it to the planner.

        Args:
            budget: new budget (bytes, a string such as ``"2GiB"``, or a fraction of the
                model's device); ``"min"`` or ``None`` plans the lowest-memory correct plan;
                omitted keeps the current budget.
            method: new planner method; omitted keeps the current one.

        Raises:
            InfeasibleBudget: the budget is below what the method can reach (with the
                preservation pins, which the error names); the error says the smallest
                feasible budget.
            ReplayConfigError: no costs measured yet (no segment probed: see
                :attr:`ready_to_plan`), or a pin that none of the segment's measured options
                honours.
        """
        self.reconfigure(budget=budget, planner=method)
        costs = self.costs
        if not costs:
            raise ReplayConfigError(
                "replan() needs measured costs: run at least one training "
                "step so every segment is probed"
            )
        measured = {c.name for c in costs}
        allowed = {
            name: PIN_OPTIONS[rt.preservation]
            for name, rt in self.runtimes.items()
            if rt.preservation in PIN_OPTIONS and name in measured
        }
        base = self.real_base_memory
        phases = self.phase_peak_args
        budget_bytes = self.budget
        try:
            if budget_bytes is None:  # the lowest-memory correct plan
                budget_bytes = _planner.min_feasible_budget(
                    costs, base, self.planner, allowed=allowed, **phases
                )
            p = _planner.plan(
                costs,
                budget=budget_bytes,
                base_memory=base,
                method=self.planner,
                allowed=allowed,
                **phases,
            )
        except _planner.InfeasibleBudget as exc:
            if exc.pins or not allowed:
                raise
            # A pinned segment is never calibrated in the options its pin excludes, so the
            # planner saw no restriction; the pins are still part of why nothing fits.
            raise _planner.InfeasibleBudget(
                exc.budget,
                exc.min_feasible,
                exc.method,
                exc.joint_min_feasible,
                pins={n: tuple(sorted(o)) for n, o in allowed.items()},
            ) from None
        except ValueError as exc:  # a pin that no measured option honours
            pins = {name: self.runtimes[name].preservation for name in allowed}
            raise ReplayConfigError(f"preservation={pins}: {exc}") from None
        if self.plan_transform is not None:
            p = self.plan_transform(p)
        self._apply_plan(p)
        return p

    @contextlib.contextmanager
    def _because(self, *reasons: str) -> Iterator[None]:
        """Plans made inside name ``reasons`` in their record (after those of an enclosing
        call: a re-plan for memory that falls back to the lowest plan names both)."""
        outer = self._why
        self._why = outer + tuple(r for r in reasons if r not in outer)
        try:
            yield
        finally:
            self._why = outer

    def _plan_reasons(self) -> list[str]:
        """Why the plan being recorded was made: the reasons of :meth:`_because`, or
        ``["requested"]`` (a caller's :meth:`replan`)."""
        return list(self._why) or ["requested"]

    def reconfigure(
        self, *, budget: int | str | None | object = _UNCHANGED, planner: str | None = None
    ) -> None:
        """Change the budget or the planner the next plan is made with (the plan in force
        stays until :meth:`replan`).

        Args:
            budget: bytes, a string such as ``"2GiB"``, a fraction of the model's device, or
                ``"min"``/``None`` for the lowest-memory correct plan; omitted keeps it.
            planner: a planner method; omitted keeps it.

        Raises:
            ReplayConfigError: a budget or method outside the grammar.
        """
        changes: dict[str, Any] = {}
        if budget is not _UNCHANGED:
            changes["budget"] = Budget(min=True) if budget is None else budget
        if planner is not None:
            changes["planner"] = planner
        if not changes:
            return
        config = self.config.replace(caller="replan", **changes)
        self._budget = _resolve_budget(config, self.model)
        self.config = config.replace(caller=self.config.caller)

    def _check_budget_floor(self) -> None:
        """At install, a budget below the parameters, buffers and their gradients is refused at
        once: no plan can meet it, and every step until the first plan would run over it. (A
        budget changed later is judged by the re-plan, with the measured figures.)"""
        if self._budget is not None:
            floor = self._static_bytes()
            if self._budget < floor:
                raise InfeasibleBudget(self._budget, floor, self.config.planner, floor=True)

    def adopt_plan(self, plan: _planner.Plan, version: int, from_rank: int = 0) -> None:
        """Run ``plan``, made by rank ``from_rank``, as plan ``version`` (a strategy makes every
        rank run rank 0's plan), and record it."""
        if self.plan is None or self.plan.choices != plan.choices:
            self._set_options(plan.choices)
            self._measure_plan()
        self.plan = plan
        self.plan_version = version
        self.records.append(
            step=self.step,
            segment="*",
            contract_version=version,
            check="plan",
            outcome="match",
            detail={
                "plan_version": version,
                "adopted_from_rank": from_rank,
                "reasons": self._plan_reasons(),
                **plan.to_dict(),
            },
        )

    def _apply_plan(self, p: _planner.Plan) -> None:
        if self.plan is not None and p.choices == self.plan.choices:
            self.plan = p  # same choices: no new plan version, no re-plan record
            return
        self._set_options(p.choices)
        self.plan = p
        self._measure_plan()
        self.plan_version += 1
        self.records.append(
            step=self.step,
            segment="*",
            contract_version=self.plan_version,
            check="plan",
            outcome="match",
            detail={
                "plan_version": self.plan_version,
                "reasons": self._plan_reasons(),
                **p.to_dict(),
            },
        )

    def state_dict(self) -> dict[str, Any]:
        """Resumable engine state: step, plan, contract versions, counters, record run id, and
        the measured real base (what measured steps held beyond the accountant's figures, and
        the largest base agreed over the ranks), so that a resumed run plans with it from its
        first step instead of the accountant's figures alone until it measures again."""
        return {
            "step": self.step,
            "plan_version": self.plan_version,
            "plan": self.plan.to_dict() if self.plan else None,
            "budget": self.budget,
            "planner": self.planner,
            "run_id": self.records.run_id,
            "unaccounted_bytes": self._residual,
            "unaccounted_phases": {
                "forward": self._over_fwd,
                "replays": dict(self._over_replay),
                "optimizer": self._floor,
                "segment_forwards": [[n, o, t] for (n, o), t in self._over_seg_fwd.items()],
            },
            "ranks_base_bytes": self._ranks_base,
            "segments": {
                n: {
                    "version": rt.version,
                    "forwards": rt.forwards,
                    "replays": rt.replays,
                    "violations": rt.violations,
                    "checks": rt.checks,
                    "divergences": rt.divergences,
                    # (a step planned around a check runs options of its own: the plan's)
                    "planned_option": (
                        self.plan.choices.get(n, rt.planned_option)
                        if self._step_choices is not None and self.plan is not None
                        else rt.planned_option
                    ),
                }
                for n, rt in self.runtimes.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: contracts are re-probed on the next step and get
        the next version; the plan is re-applied once they exist. The checkpoint's budget and
        planner replace this engine's (:meth:`reconfigure` afterwards to override them)."""
        self.step = int(state["step"])
        self.plan_version = int(state["plan_version"])
        self.plan = _planner.Plan.from_dict(state["plan"]) if state.get("plan") else None
        if "budget" in state:
            b = state["budget"]
            self._budget = b
            self.config = self.config.replace(
                budget=Budget(bytes=b)
                if b is not None
                else Budget(min=True)
                if self.plan
                else Budget()
            )
        if state.get("planner"):
            self.config = self.config.replace(planner=state["planner"])
        # the measured real base (state dicts from before it was saved have none: measured
        # again, as then); the run's own measurements only raise it
        self._residual = max(self._residual, int(state.get("unaccounted_bytes") or 0))
        phases = state.get("unaccounted_phases") or {}
        if phases.get("forward") is not None:
            self._over_fwd = max(self._over_fwd or phases["forward"], int(phases["forward"]))
        for name, over in (phases.get("replays") or {}).items():
            self._over_replay[name] = max(self._over_replay.get(name, over), int(over))
        self._floor = max(self._floor, int(phases.get("optimizer") or 0))
        for n, o, t in phases.get("segment_forwards") or []:
            self._over_seg_fwd[n, o] = max(self._over_seg_fwd.get((n, o), int(t)), int(t))
        if state.get("ranks_base_bytes") is not None:
            self._ranks_base = max(self._ranks_base or 0, int(state["ranks_base_bytes"]))
        for n, d in state.get("segments", {}).items():
            rt = self.runtimes.get(n)
            if rt is None:
                continue
            rt.version = int(d["version"])
            rt.forwards, rt.replays = int(d["forwards"]), int(d["replays"])
            rt.violations, rt.checks = int(d["violations"]), int(d["checks"])
            rt.divergences = int(d["divergences"])
            rt.planned_option = d.get("planned_option")
        if self.plan is not None and not self.config.measure_costs:
            self.measure_costs = False

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per segment: mode, replays, contract version, violations, bytes."""
        return {n: self.runtimes[n].summary() for n in self.segments}

    def request_check(
        self, grad: bool = True, bytes: bool = True, segments: Iterable[str] | None = None
    ) -> None:
        """Check the replays of the next window (derivative and/or byte-level).

        A derivative check keeps the segment's graph from forward to backward. ``segments``
        names the segments to derivative-check; by default every replayed segment, or, under a
        budget, as many as the plan's headroom allows without the step exceeding the budget
        (by the measured costs), in rotation so that every segment is checked in turn: the one
        whose turn it is first, on a step planned around its check where it does not fit beside
        the plan; one whose check fits no plan is counted in :attr:`checks_skipped` and named in
        a warning. Byte checks are cheap and cover every replay.
        """
        if segments is not None:
            segments = list(segments)
            unknown = [n for n in segments if n not in self.runtimes]
            if unknown:
                raise ReplayConfigError(
                    f"request_check(segments=...): {unknown} are not installed segments; "
                    f"installed: {self.segments}"
                )
        self._check_next = (bool(grad), bool(bytes), segments)

    def set_options(self, choices: Mapping[str, str]) -> None:
        """Apply a plan by hand: one option per segment (``retain``/``recompute``/``whole``/
        ``regions``, or a selective option). The choices stay in force until the next plan is
        made: after a step planned around its derivative check (more segments replayed for
        that step), the plan's choices are not put back over them."""
        self._step_choices = None
        self._set_options(choices)

    def _set_options(self, choices: Mapping[str, str]) -> None:
        """Apply one option per segment: the engine's own (a plan, a checked step's plan)."""
        for name, opt in choices.items():
            if name not in self.runtimes:
                raise ReplayConfigError(
                    f"plan names segment {name!r}, which is not installed; "
                    f"installed: {sorted(self.runtimes)}"
                )
            if opt not in OPTIONS:
                raise ReplayConfigError(
                    f"plan gives segment {name!r} option {opt!r}; options are {OPTIONS}"
                )
            self.runtimes[name].set_option(opt)
        if self._forward_open and self._capture is None and not self._segment_depth:
            # Applied while a window's forward is open (a strategy adopts rank 0's plan after
            # this rank's window began, before its segments run): segments that log regions
            # need the capture from now on, or this step they keep whole copies instead, above
            # what the plan predicts. Writes before now are no segment's concern: each arms
            # its storages at its own forward. (set_option brought _needs_capture up to date.)
            if self._needs_capture:
                self._start_capture()

    def _capture_if_open(self) -> None:
        """Start the capture now if a window's forward is open without one, no segment runs
        and a contract needs it (a segment re-probed mid-window: its guard fired)."""
        if self._needs_capture and self._forward_open and self._capture is None:
            if not self._segment_depth:
                self._start_capture()

    def _start_capture(self) -> None:
        """Run the capture mode (writes to armed storages are logged) until the window's
        forward ends."""
        self._capture = CaptureMode(self.log)
        self._capture.__enter__()
        self._capturing = True

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Mark a window's forward part by hand (the Lightning strategy wraps training_step)."""
        self._explicit_windows += 1
        self.begin_window()
        try:
            yield
        finally:
            self.end_forward()

    def begin_window(self, continuation: bool = False, inputs: Any = None) -> None:
        """Open a window (a training step's forward part), or, with ``continuation``, reopen
        the current one: a no-grad forward of the root inside the step (a momentum encoder
        that enqueues) or a segment called after the root's forward belongs to the step whose
        backward is still to come, so its writes must be logged like the rest of the window.
        ``inputs``: the step's inputs, whose shapes the re-plan policy watches."""
        self._window_depth += 1
        if self._window_depth > 1:
            return
        if continuation and self.step > 0:
            if self._needs_capture or self.log.armed:
                self._start_capture()
            self._forward_open = True
            return
        self._window_last_order = -1  # (a forward joining the step's starts over, too)
        step_was = previous_step(self)
        if step_was == "pending":
            # the step's graph still waits for its backward (two forwards, one backward of
            # their sum): this forward is the same training step's, measured with it
            if self._needs_capture or self.log.armed:
                self._start_capture()
            if self.accountant is not None and self._acct_hooks is None:
                self._acct_hooks = self.accountant.saved_tensors_hooks()
                self._acct_hooks.__enter__()
            self._forward_open = True
            return
        if step_was == "dropped":  # no training step: its phase and measurement go back
            give_back(self, self._step_graph)
        graph = self._step_graph = StepGraph(self)
        for rt in list(self._pending_probes):
            rt.finish_stale_probes()
        if self.step >= 1:
            self._name_idle_segments()
        if self._capture_timed and self._capture_ops:
            self.meter.capture_ops.append(self._capture_ops)
        self._capture_ops = 0
        self._capture_entry_time = {}
        self._replays_last_step = self._replays_this_step
        self._last_step = self.step
        self._preserved_last_step = sum(rt.last_preserved_bytes for rt in self.runtimes.values())
        grads_now = observe_fresh_grads(self)  # before a re-fit: the plan holds for this step
        if self.plan is None and self._opt_watch is None and self.real_peak:
            self._opt_watch = watch_optimizers(self)
        measured = self.last_real_peak
        settle_real_peak(self)
        if self.last_real_peak is not measured and self._truth_plan is not None:
            self.state_growth.measured(
                self._truth_plan.choices, self._truth_state, self.last_real_peak[1]
            )
        self._grad_now = grads_now
        if self._low_until_measured and self.last_real_peak is not measured:
            # the step on inputs larger than any measured ran the lowest plan, measured: the
            # plan for the budget is made with its real figure
            self._low_until_measured = False
            with self._because("larger_inputs_measured"):
                try:
                    self.replan()
                except InfeasibleBudget as exc:
                    self._lowest_plan_instead(exc)
        policy = self.replan_policy
        if policy is not None:  # install(replan_on=...): judge the step just trained
            if self.step > 0:
                policy.after_step(self)
            if (
                inputs is not None
                and "shapes" in policy.settings.replan_on
                and policy.observe_shapes(input_shapes(inputs))
            ):
                # the re-plan needs activation bytes at the new shapes: a checked step
                # measures them (the probe's figures are for the old shapes)
                asked = self._check_next or (True, False, None)
                self._check_next = (True, asked[1], asked[2])
        size = _input_numel(inputs)
        self._window_size = size
        probing = self.plan is None and any(
            rt.contract is None or rt.status in ("probe", "probing")
            for rt in self.runtimes.values()
        )
        if probing:
            # the size the probes' figures are measured at (calibration steps on larger
            # inputs measure no activations: the figures are scaled up to them, size_scale)
            self.probe_size = max(self.probe_size, size)
        larger = self._max_size > 0 and size > self._max_size
        self._max_size = max(self._max_size, size)
        if self.plan is None and not probing:
            # a calibration step: it, the refusal before calibrating and the first plan are
            # for the inputs the steps since the probe run, not a larger probe batch seen once
            # (a later larger step re-plans before it runs, _refit_for_inputs, and runs the
            # lowest plan until measured)
            self._calib_size = max(self._calib_size, size)
            self._max_size = self._calib_size
        if larger and self.plan is not None and self.measure_costs:
            self._refit_for_inputs()  # before the step: activations grow with the inputs
        self._phase_taken = None
        self._maybe_plan()
        graph.phase = self._phase_taken
        self._plan_late_segments()
        if self.plan is not None:
            if self.real_peak and self.accountant is not None:
                self._state_now = live_model_bytes(self.model, grads=False)
                self._refit_plan()  # a buffer that grew (a queue rebuilt larger) grows the base
            if self._truth_size is not None and size > self._truth_size:
                # larger inputs than any measured step: activations the probe did not see
                self._lowest_until_measured()
                self._measure_plan(periodic=True, gap=False)
            elif self.step >= self._next_truth:
                # state that grows later is seen, too; while it grows, at the shortest gap
                grows = self.state_growth.grew(self.plan.choices, self._state_now)
                self._measure_plan(periodic=not grows)
            elif self._held_past_plan():
                self._measure_plan()  # (its real figure re-plans, as any measured step's)
        self._window_plan = self.plan_version
        if self._truth_pending and self.accountant is not None and profiler_busy():
            self._profiler_blinds()  # another profiler runs: measure a later step
        elif (
            self._truth_pending
            and self.accountant is not None
            and (_rank_count() == 1 or self._ranks_base is not None)
        ):
            self._truth_pending = False
            self._truth_rounds += 1
            self._truth_plan = self.plan
            self._truth_budget = self.budget  # (a replan before it settles: judged by this)
            self._truth_state = self._state_now
            self._truth_inputs = _input_bytes(inputs)
            graph.truth_size = self._truth_size
            size = self._truth_step_size = self._window_size
            self._truth_size = size if self._truth_size is None else max(self._truth_size, size)
            start_truth(self)
            graph.truth = weakref.ref(self._truth) if self._truth is not None else None
        self.step += 1
        # the capture mode's ops are a cost sample on timed steps (a probe's forward does more)
        self._capture_timed = (
            self.measure_costs
            and not self._warmup
            and not self._pending_probes
            and not any(rt.status in ("probe", "probing") for rt in self.runtimes.values())
        )
        self.host_watch.begin()
        self._replays_this_step = 0
        chk, self._check_next = self._check_next, None
        if self._step_choices is not None:  # the last checked step ran a plan of its own
            self._step_choices = None
            if self.plan is not None:
                self._set_options(self.plan.choices)
        self._check_grad, self._check_bytes = chk[:2] if chk else (False, False)
        self._truth_checked = self._check_grad  # a checked step holds more than the plan says
        missed_turn(self)  # (the last window's chosen segments that did not run)
        self._checked = select_checked(self, chk[2]) if self._check_grad else frozenset()
        self._checked_ran = set()
        self._cuda = _first_param_is_cuda(self.model)
        self._cuda_device = _model_cuda_device(self.model) if self._cuda else None
        self._sync = self._cuda and bool(self._calibration)
        acct = self.accountant
        if self._cuda:  # each window's allocator peak is its own
            dev = self._cuda_device
            self._last_cuda_peak = max(
                torch.cuda.max_memory_allocated(dev), *self._cuda_phases.values(), 0
            )
            torch.cuda.reset_peak_memory_stats(dev)
            self._cuda_phases, self._cuda_label = {}, "start"
            self._replay_released = {}
            # held as the step begins (host-side counter, no synchronization): the peak counts
            # it, and what of it is not the model's does not grow with the input
            self._cuda_held = int(torch.cuda.memory_allocated(dev))
        if acct is not None:
            self._last_peak = acct.peak
            acct.set_static([*self.model.parameters(), *self.model.buffers()])
            acct.reset_peak()
            # (the user's hooks below it still apply to what replays save: runtime.py)
            self._hooks_below_accountant = top_saved_tensors_hooks()
            self._acct_hooks = acct.saved_tensors_hooks()
            self._acct_hooks.__enter__()
        # pending invocations armed under an earlier plan still need their writes logged
        if self._needs_capture or self.log.armed:
            self._start_capture()
        self._forward_open = True  # (options set from now on see whether it captures)

    def end_forward(self) -> None:
        """Close the window's forward part."""
        if self._window_depth == 0:
            return
        self._window_depth -= 1
        if self._window_depth > 0:
            return
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture_ops += self._capture.ops
            for key, seconds in self._capture.entry_time.items():  # a continuation adds
                self._capture_entry_time[key] = self._capture_entry_time.get(key, 0.0) + seconds
            self._capture = None
        self._capturing = False
        self._forward_open = False
        self.host_watch.end(self.step)  # replays of this window check its suspects
        if self._acct_hooks is not None:
            self._acct_hooks.__exit__(None, None, None)
            self._acct_hooks = None
            if self.measure_costs:
                self._base_saved = max(self._base_saved, self.accountant.by_tag.get("base", 0))

    def uninstall(self) -> None:
        """Put the model back exactly as it was before :func:`install`."""
        if not self.installed:
            return
        while self._window_depth:
            self.end_forward()
        if self._truth is not None:
            stop_truth(self, self._truth)
        unwatch_optimizers(self)
        drop_stale_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _attach.detach(self, self._root_class)
        self._root_class = None
        self._registration.release()
        if not self.log.armed:
            self.log.clear()
        # else a forward's replay is still to come (uninstalled between forward and
        # backward): its undo entries go as it releases them (RegionLog arms count readers;
        # a forward that raised gave its arms back as it raised)
        self.installed = False
        self._release()

    def _release(self) -> None:
        """Drop every reference the engine holds to the model, its tensors and the objects
        around it (optimizers, outside state, generators, caches), without leaving a cycle that
        only the cyclic garbage collector could free: after :meth:`uninstall`, dropping the
        model and its optimizer frees all of their tensors at once. What is kept is metadata:
        the records, the contracts (names, shapes, versions), the plan, the counters."""
        for rt in self.runtimes.values():
            rt.release()
        self._external = []
        self._optimizers = []
        self._pending_probes = set()
        self._truth_plan = None
        self._step_graph = None
        self.host_watch = HostWatch()
        self.last_replay = None
        _release_caches(self)
        self._model = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run segments as plain modules (no probe, no replay) inside this block."""
        prev, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = prev

    # ---------------------------------------------------------------- internal

    def _refit_plan(self) -> None:
        """The real base grew past the one the plan was made with, or a measured phase holds
        more than the plan was predicted with: re-plan if the plan no longer fits the budget,
        else only its prediction grows."""
        plan = self.plan
        if plan is None:
            return
        grown = self.real_base_memory - plan.base_memory
        extras = self.phase_peak_args
        # state grown since the plan's last measured step grows what reads it too
        bound = self.state_growth.bound(plan.choices, self._state_now) or 0
        if grown <= 0 and self._plan_extras == (plan, extras) and bound <= plan.peak_memory:
            return
        self._plan_extras = (plan, extras)
        predicted = plan.peak_memory + max(grown, 0)
        costs = [c for c in self.costs or [] if plan.choices.get(c.name) in c.options]
        formula = bool(costs) and len(costs) == len(plan.choices)
        if formula:  # the formula, with every phase's figure
            predicted = _planner.predicted_peak(
                costs,
                {c.name: plan.choices[c.name] for c in costs},
                max(self.real_base_memory, plan.base_memory),
                **extras,
            )
        predicted = max(predicted, bound)
        if predicted < plan.peak_memory and formula and grown <= 0:
            # A phase measured since (a retained segment's forward, charged at first the most
            # its other options held) holds less than the plan was predicted with: the
            # prediction is the formula's with the measured figure. Under the lowest-memory
            # plan ("min"), another plan may now be lower: make it again.
            if self.budget is None and self._lower_plan_known(predicted):
                with self._because("lower_plan_measured"):
                    self.replan()
                return
            self.plan = dataclasses.replace(plan, peak_memory=predicted)
            self._plan_extras = (self.plan, extras)
            return
        if predicted <= plan.peak_memory:
            return
        if self.budget is not None and predicted > self.budget:
            with self._because("measured_over_budget"):
                try:
                    self.replan()  # the plan no longer fits once the real figure is known
                except InfeasibleBudget as exc:
                    self._lowest_plan_instead(exc)
        else:  # it still fits: only its prediction changes
            self.plan = dataclasses.replace(
                plan,
                peak_memory=predicted,
                base_memory=max(self.real_base_memory, plan.base_memory),
            )
            self._plan_extras = (self.plan, extras)

    def _held_past_plan(self) -> bool:
        """Whether the step just trained held more than its plan predicts, by the engine's own
        accounting (CPU; a lower bound on the real memory), at inputs no larger than measured:
        activations that follow the data, not the input's shape (a router sending tokens to
        experts of unequal width). Said once per plan, and the next step is measured; until
        then the plan ran over the budget for as long as the periodic measurements' doubling
        gaps (measured: 7 steps 16.8 % over, no warning)."""
        acct = self.accountant
        if (
            acct is None
            or self._cuda
            or self.plan is None
            or not isinstance(self.budget, int)
            or self._truth_checked
            or self._pending_probes
            or self._window_plan != self.plan_version
            or self._past_plan_said == self.plan_version
        ):
            return False
        held = self._static_bytes() + acct.peak
        predicted = self.plan.peak_memory
        if held <= predicted:
            return False
        self._past_plan_said = self.plan_version
        detail = {
            "seen": "the step held more than its plan predicts at inputs of a measured size "
            "(activations that follow the data)",
            "accounted_bytes": held,
            "predicted_bytes": predicted,
            "budget": self.budget,
            "action": "the next step is measured and re-planned",
            "reasons": ["held_past_plan"],
        }
        self.records.append(
            step=self.step,
            segment="*",
            contract_version=self.plan_version,
            check="plan",
            outcome="rejection",
            detail=detail,
        )
        warnings.warn(
            f"step {self.step}: the engine accounted {format_bytes(held)} held, more than the "
            f"plan predicts ({format_bytes(predicted)}) at inputs of a size it measured: "
            "activations that follow the data (routing, masks, variable-length content). The "
            "budget may have been exceeded on that step; the next step's real peak is measured "
            "and the plan made again from it.",
            RuntimeWarning,
            stacklevel=4,
        )
        return True

    def _lowest_until_measured(self) -> None:
        """A step on inputs larger than any measured one, under a byte budget: the plan in
        force was predicted with figures scaled from smaller inputs (backward temporaries,
        what grows with the batch are not all known to scale), so a plan that keeps more than
        the lowest could run over the budget (measured: 1.17 x, a plan that retains every
        segment on a batch twice the measured ones). This step runs the lowest-memory plan
        and is measured; the plan for the budget is made again with its real figure."""
        if self.budget is None or self._low_until_measured or self._truth_off:
            return
        if not self.real_peak or self.accountant is None or self._cuda:
            return
        budget = self.config.budget
        try:
            with self._because("larger_inputs_lowest_until_measured"):
                self.replan(budget=None)
        finally:
            self.reconfigure(budget=budget)
        self._low_until_measured = True

    def _lower_plan_known(self, predicted: int) -> bool:
        """Whether, with the figures measured so far, a plan lower than ``predicted`` (the plan
        in force's prediction) exists."""
        try:
            lowest = _planner.min_feasible_budget(
                self.costs, self.real_base_memory, **self.phase_peak_args
            )
        except (ValueError, InfeasibleBudget):
            return False
        return lowest < predicted

    def _profiler_blinds(self) -> None:
        """A step whose real peak was due to be measured runs under someone else's profiler
        (one at a time per process): it is measured later. Under a budget, while that lasts
        (a profiler on every step) the plan is never checked against the real peak and the
        budget can be broken unseen: say so once, and record it."""
        if self._profiler_warned or self.budget is None:
            return
        self._profiler_warned = True
        detail = {
            "event": "real_peak_unmeasured",
            "reason": "profiler_active",
            "plan_version": self.plan_version,
            "budget": self.budget,
        }
        self.records.append(
            step=self.step,
            segment="*",
            contract_version=self.plan_version,
            check="plan",
            outcome="rejection",
            detail=detail,
        )
        warnings.warn(
            f"step {self.step}: the real memory peak of this step was due to be measured "
            f"against the budget ({format_bytes(self.budget)}), but another torch.profiler is "
            "running (one per process), so it was not: the plan's prediction counts only what "
            "the engine accounts, and the budget can be broken without a warning while a "
            "profiler runs on every step. Profile only some steps (torch.profiler's schedule) "
            "or pass budget=None while profiling.",
            RuntimeWarning,
            stacklevel=4,
        )

    #: steps between the periodic measurements of the real peak (CPU): doubling from the first
    #: to the last, so that state that grows after a plan's first steps is seen early
    TRUTH_EVERY = (2, 128)

    def _measure_plan(self, periodic: bool = False, gap: bool = True) -> None:
        """Measure the real peak of the next step (CPU): the first under a new plan, then
        periodically, at gaps doubling from ``TRUTH_EVERY[0]`` to ``TRUTH_EVERY[1]`` steps,
        and the first at new input shapes (``gap=False``: the schedule stays)."""
        if not (self.measure_costs and self.real_peak) or self._cuda or self._truth_off:
            return
        self._truth_pending = True
        if not gap:
            return
        if not periodic:
            self._truth_gap = self.TRUTH_EVERY[0]
        self._next_truth = self.step + self._truth_gap
        if periodic:
            self._truth_gap = min(2 * self._truth_gap, self.TRUTH_EVERY[1])

    def track_optimizer(self, *optimizers: Any) -> None:
        """Count these optimizers' state in the base memory the plan is made with. An
        optimizer that steps the model's parameters is also found on its own, at the first
        step whose real peak is measured."""
        self._optimizers = list(optimizers)

    @property
    def tracked_optimizers(self) -> list[Any]:
        return list(self._optimizers)

    def size_scale(self, measured_at: int) -> float:
        """How much larger than ``measured_at`` elements the largest step input planned for
        is: activation and input bytes measured at smaller inputs are scaled by it, so that
        plans are made for the largest step seen. Below 1 only for figures a probe measured on
        a larger batch than any step since (a big first batch: the first plan is made for the
        inputs the calibration steps ran, see _maybe_plan). 1 where sizes are not known."""
        if measured_at <= 0 or self._max_size <= 0 or self._max_size == measured_at:
            return 1.0
        return self._max_size / measured_at

    def _refit_for_inputs(self) -> None:
        """A step's inputs are larger than any before: its activations are predicted scaled
        with the input size; a plan that no longer fits the budget is made again for them
        (or the lowest-memory plan runs, with a warning), else only its prediction grows."""
        plan = self.plan
        costs = {c.name: c for c in self.costs or []}
        if plan is None or not costs:
            return
        planned = [c for c in costs.values() if plan.choices.get(c.name) in c.options]
        predicted = _planner.predicted_peak(
            planned,
            {c.name: plan.choices[c.name] for c in planned},
            self.real_base_memory,
            **self.phase_peak_args,
        )
        if self.budget is not None and predicted > self.budget:
            with self._because("larger_inputs"):
                try:
                    self.replan()
                except InfeasibleBudget as exc:
                    self._lowest_plan_instead(exc)
        elif predicted > plan.peak_memory:
            self.plan = dataclasses.replace(plan, peak_memory=predicted)

    def _lowest_plan_instead(self, exc: InfeasibleBudget) -> None:
        """No plan fits the budget once the step's real figure is known: run the lowest-memory
        plan (the nearest to the budget there is), predicted with the real figure, and say so.
        The budget stays the user's: a later re-plan aims for it again."""
        budget = self.config.budget
        try:
            with self._because("budget_unreachable_lowest_plan"):
                self.replan(budget=exc.min_feasible)
        finally:
            self.reconfigure(budget=budget)
        warnings.warn(
            f"the budget ({format_bytes(exc.budget)}) cannot hold the measured step: it held "
            f"{format_bytes(self._residual)} outside what the engine accounts (backward "
            "temporaries, optimizer state), and the lowest-memory plan needs "
            f"{format_bytes(exc.min_feasible)} ({exc.min_feasible} bytes). Running that plan; "
            "raise the budget to at least that to make it a promise.",
            RuntimeWarning,
            stacklevel=3,
        )

    @property
    def steps_to_first_plan(self) -> int:
        """Training steps from the first (probe) step to the one that runs the first plan: the
        probe, then per calibration phase (replay; regions where a contract offers it) a
        warm-up step and ``calibration_steps`` timed ones, then the plan's step. Before every
        segment is probed, both phases are counted."""
        probed = all(rt.contract is not None for rt in self.runtimes.values())
        offered = {
            o
            for rt in self.runtimes.values()
            if rt.contract is not None
            for o in rt.contract.available_options()
        }
        selective = self.config.selective_policy is not None
        phases = (
            1
            + (not probed or "regions" in offered)
            + (selective and (not probed or bool(offered & {"selective", "selective_whole"})))
            + (selective and (not probed or "selective_regions" in offered))
        )
        return 1 + phases * (self.calibration_steps + 1) + 1

    def _maybe_plan(self) -> None:
        """Between windows: calibrate each option for a few steps, then plan."""
        if (
            not self.measure_costs
            or self._pending_probes
            or any(
                (rt.contract is None or rt.status == "probe") and not self._never_trained(rt)
                for rt in self.runtimes.values()
            )
        ):
            return
        if all(rt.contract is None for rt in self.runtimes.values()):
            return  # no segment replays (see _name_idle_segments): nothing to plan
        if self.plan is None and not self._calibration:
            offered = {
                o
                for rt in self.runtimes.values()
                if rt.contract is not None
                for o in rt.contract.available_options()
            }
            phases = ["replay"] if offered & {"recompute", "whole"} else []
            if "regions" in offered:
                phases.append("regions")
            if offered & {"selective", "selective_whole"}:
                phases.append("selective")
            if "selective_regions" in offered:
                phases.append("selective_regions")
            phases = phases or ["replay"]
            # each phase starts with a warm-up step whose timings are not kept
            self._calibration = [
                ph for ph in phases for ph in [ph + ":warmup"] + [ph] * self.calibration_steps
            ]
            self._calibration.append("plan")
        self._warmup = False
        if not self._calibration:
            return
        phase = self._phase_taken = self._calibration.pop(0)
        if phase == "plan":
            fold_optimizer_growth(self)
            with self._because("calibrated"):
                self.replan()
            return
        phase, _, warm = phase.partition(":")
        self._warmup = bool(warm)
        if warm and self.real_peak and not self._cuda and not self._truth_off:
            # an untimed step: what it holds beyond the accountant's figures is known before
            # the first plan is made (the profiler would slow the timed ones)
            self._truth_pending = True
        choices: dict[str, str] = {}
        allowed: dict[str, list[str]] = {}
        for name, rt in self.runtimes.items():
            if rt.contract is None:  # never trained (see _never_trained): nothing to time
                continue
            # a pinned segment is calibrated only in the options its pin allows
            opts = allowed[name] = [
                o
                for o in rt.contract.available_options()
                if o in PIN_OPTIONS.get(rt.preservation, OPTIONS)
            ]
            # each phase times its options: a full replay, regions, a selective replay
            # (whole or nothing preserved), a selective one with regions
            first = {
                "replay": ("recompute", "whole"),
                "regions": ("regions",),
                "selective": ("selective", "selective_whole"),
                "selective_regions": ("selective_regions",),
            }[phase]
            for o in first:
                if o in opts:
                    choices[name] = o
                    break
            if name in choices and _retain_dominates(self, rt, opts):
                # keeping its activations holds less than any replay of it (state bigger
                # than its activations: a buffer that is a view of a bigger one, issue 31) and
                # takes no time: no plan picks a replay of it, so none is timed (and none
                # takes a calibration step over what the plans hold)
                choices[name] = "retain"
        refuse_before_calibrating(self, allowed)  # what was measured shows no plan fits
        if warm and self.budget is not None and not self._truth_rounds and not self._residual:
            # Nothing real measured yet: what the step holds beyond the accountant's figures
            # (backward and optimizer temporaries) is unknown, so no prediction bounds it. This
            # untimed step runs every segment at its lowest option and measures it; the timed
            # steps after it are fitted with that figure.
            fit_to(self, choices, allowed, lambda: True)
        fit_calibration(self, choices, allowed)
        for name, o in choices.items():
            self.runtimes[name].set_option(o)
        for rt in self.runtimes.values():
            rt.planned_option = None  # calibration is not a plan

    def _plan_late_segments(self) -> None:
        """A segment first called after the plan was made (a block a progressive-growing
        schedule adds) is probed then; its contract made, it joins the plan at the next step,
        before its activations are dropped under a plan that never counted them (every step
        would run over the budget, and predictions would not bound it). Its bytes are
        measured; a replay time not yet measured is stood in by the other segments' measured
        seconds per activation byte. Its first planned step runs the lowest-memory plan and
        measures its real peak; the plan for the budget is made again once the segment's
        first replay is timed."""
        plan = self.plan
        if plan is None or not self.measure_costs or self._pending_probes:
            return
        if any(rt.status in ("probe", "probing") for rt in self.runtimes.values()):
            return
        meter = self.meter
        late = [
            rt
            for rt in self.runtimes.values()
            if rt.contract is not None and rt.name not in plan.choices
        ]
        timed = [n for n in self._stood_in if not any(k[0] == n for k in meter.stand_ins)]
        if not late and not timed:
            return
        for rt in late:
            rates = [
                meter.median(n, o) / max(meter.activation_bytes.get(n, c.activation_bytes), 1)
                for n, other in self.runtimes.items()
                if (c := other.contract) is not None
                for o in ("recompute", "whole")
                if meter.measured(n, o)
            ]
            act = meter.activation_bytes.get(rt.name, rt.contract.activation_bytes)
            for o in ("recompute", "whole"):
                if o in rt.contract.available_options() and not meter.measured(rt.name, o):
                    meter.stand_ins[rt.name, o] = max(rates, default=0.0) * act
                    self._stood_in.add(rt.name)
        self._stood_in.difference_update(timed)
        if late:
            # its first planned step runs the lowest-memory plan, measured: what the joined
            # segment holds beyond its counted bytes (its backward temporaries) is not known
            # yet, so no prediction bounds a plan that keeps more
            budget = self.config.budget
            try:
                with self._because("late_segments_lowest_until_measured"):
                    self.replan(budget=None)
            finally:
                self.reconfigure(budget=budget)
            self._measure_plan()
            return
        with self._because("stand_ins_measured"):
            try:
                self.replan()
            except InfeasibleBudget as exc:
                self._lowest_plan_instead(exc)

    def _calibration_base(self) -> int:
        """The base a calibration step is predicted with: the real base, or, where larger (no
        step measured yet, or more held since), what the process holds as this step begins
        (CPU: every live tensor storage; CUDA: the allocator's count), plus the gradients still
        to be made and what is saved outside segments."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = _unique_bytes([p for p in params if p.grad is None])
        if self._cuda:
            dev = _model_cuda_device(self.model)
            held = int(torch.cuda.memory_allocated(dev))
        else:
            held = process_tensor_bytes(also=model_tensors(self.model, self._optimizers))
        # (less the gradients the phases charge at their own moments, as the real base)
        credit = grad_credits(self)[0]
        return max(self.real_base_memory, held + grads + self._base_saved - credit)

    def _never_trained(self, rt: SegmentRuntime) -> bool:
        """A segment that has not run under autograd in training mode through two whole steps
        (a frozen teacher under ``torch.no_grad``, a branch not taken): it holds no activations
        to plan for, and the other segments are planned without it. Should it run with
        autograd later, it is probed then, and joins the next plan."""
        return rt.idle_reason() is not None or (
            rt.forwards == 0 and rt.contract is None and self.step >= 2
        )

    def _name_idle_segments(self) -> None:
        """Once per segment, after the first windows: a segment that will not replay is named,
        with why (:meth:`SegmentRuntime.idle_reason`). One never called in the model's forward
        is a configuration error under ``on_violation="raise"``."""
        warned = self._idle_warned
        fresh = [rt for rt in self.runtimes.values() if rt.name not in warned and rt.idle_reason()]
        if not fresh:
            return
        # (one skipped at random, its list's other items called, is warned about, never
        # stopped: plain PyTorch trains it)
        uncalled = [rt for rt in fresh if rt.idle_reason() == NOT_CALLED and not rt.skipped()]
        if uncalled and self.on_violation == "raise":
            raise ReplayConfigError(
                "; ".join(idle_message(rt) for rt in uncalled)
                + " (on_violation='raise': stopped here)."
            )
        for rt in fresh:
            warned.add(rt.name)
            reason = rt.idle_reason()
            self.records.append(
                step=self.step,
                segment=rt.name,
                contract_version=0,
                check="probe",
                outcome="rejection",
                detail={"seen": reason, "action": "planned without it"},
            )
            warnings.warn(idle_message(rt) + ".", RuntimeWarning, stacklevel=4)

    def _check_step_plan(
        self, by_name: Mapping[str, _planner.SegmentCost], checked: str, grads: Mapping[str, int]
    ) -> _planner.Plan | None:
        """A plan for one checked step (:func:`~lightning_replay.core.engine.check_steps.check_step_plan`)."""
        return check_step_plan(self, by_name, checked, grads)

    def _checked_peak(
        self,
        by_name: Mapping[str, _planner.SegmentCost],
        checked: list[str],
        grads: Mapping[str, int] | None = None,
    ) -> int:
        """The plan's predicted peak with ``checked`` keeping their graphs
        (:func:`~lightning_replay.core.engine.check_steps.checked_peak`)."""
        return checked_peak(self, by_name, checked, grads)

    def _capture_sampling(self) -> bool:
        """Whether this step's timed segment forwards measure the capture mode in place.

        In calibration steps, every other segment, alternating from step to step, runs its own
        forward under one more capture mode, one that logs nothing: the difference of its
        forward times with and without is what a mode costs in place
        (:attr:`CostMeter.capture_op_seconds`), whether or not the step runs the engine's
        mode as well (region logs and guards need it in every step of their phase).
        """
        return self._capture_timed and self.plan is None

    def _capture_sample(self, rt: SegmentRuntime) -> CaptureMode | None:
        """The extra capture mode ``rt``'s forward runs under in a sampling step (one that
        looks at every write as the engine's armed mode does and logs nothing), or None."""
        return None if (rt.order + self.step) % 2 else idle_capture_mode()

    def _record_replay_time(self, inv: _Invocation, seconds: float) -> None:
        if self._warmup and inv.step == self.step:
            return
        total = inv.t_prep + seconds
        if inv.option in ("regions", "selective_regions"):
            # the capture mode's own time is the table's, paid once (CostTable.capture_time)
            total += sum(self._capture_entry_time.get(k, 0.0) for k, _ in inv.regions)
            self.meter.region_bytes[inv.rt.name] = max(
                self.meter.region_bytes.get(inv.rt.name, 0) if inv.step > 0 else 0,
                inv.rt.last_preserved_bytes - inv.preserved_bytes,
            )
        self.meter.add_time(inv.rt.name, inv.option, total)

    def _replay_started(self, activation_bytes: int, released: int = 0) -> None:
        """A replay begins: a phase of the step (see
        :func:`~lightning_replay.core.engine.real_peak.phase_residuals`). ``released``:
        the preserved bytes the call gives back when its replay ends, before the backward of
        what it re-materialized (where that phase peaks, a retained segment's backward holds
        no such bytes)."""
        acct = self.accountant
        if acct.replay_bytes == 0:
            # the re-materialized activations are gone when this backward ends
            at_backward_end(lambda: acct.set_replay(0))
        # each segment's replay begins a phase of the step: its real peak and the formula's
        # figure are paired apart from the others'
        label = _REPLAY + (self.last_replay[0].name if self.last_replay else "")
        if acct.phase != label:
            acct.begin_phase(label)
            if self._truth is not None:
                self._truth.mark(label)
                observe_grads(self, self.last_replay[0].name if self.last_replay else "")
            elif self._cuda and self._cuda_device is not None and self.plan is not None:
                dev = self._cuda_device  # host-side counters: no synchronization
                last = self._cuda_label
                peak = int(torch.cuda.max_memory_allocated(dev))
                self._cuda_phases[last] = max(self._cuda_phases.get(last, 0), peak)
                torch.cuda.reset_peak_memory_stats(dev)
                self._cuda_label = label
        self._replay_released[label] = max(self._replay_released.get(label, 0), released)
        acct.set_replay(activation_bytes)

    @contextlib.contextmanager
    def _tagged(self, name: str) -> Iterator[None]:
        rt = self.runtimes.get(name)
        if rt is not None and rt.order >= 0:
            self._window_last_order = rt.order  # (where a segment first called later goes)
        acct = self.accountant
        if acct is None:
            yield
            return
        prev, acct.tag = acct.tag, name
        truth = forward_begins(self, name)  # a measured step: the forward is a phase of its own
        try:
            yield
        finally:
            acct.tag = prev
            if truth is not None:
                forward_ends(self, truth, name)

    def _next_order(self) -> float:
        """The forward-order key of a segment called for the first time: after the segment
        called before it in this window and before the next known one. A segment first called
        after the others (a block a schedule switches on in the middle) sits at its place in
        the forward, where the peak formula sums it (the segments after it hold its bytes
        when they replay), not after every segment known before it."""
        last = self._window_last_order
        later = [rt.order for rt in self.runtimes.values() if rt.order > last]
        if last >= 0 and later:
            return (last + min(later)) / 2
        self._order += 1
        return self._order

    @contextlib.contextmanager
    def _implicit_window(self) -> Iterator[None]:
        # A segment called outside any window: after a root (or manual) window it belongs to
        # that step (a consistency term computed after the forward); otherwise (a user calling
        # model.block(x) as the step) it gets a window of its own call.
        if self._window_depth:
            yield
            return
        self.begin_window(continuation=self._explicit_windows > 0)
        try:
            yield
        finally:
            self.end_forward()

    def _contracts_changed(self) -> None:
        self._needs_capture = bool(self._pending_probes) or any(
            rt.status in ("probe", "probing")
            or (
                rt.contract is not None
                and any(s.preservation in ("regions", "guard") for s in rt.contract.state)
            )
            for rt in self.runtimes.values()
        )


def _release_caches(engine: ReplayEngine) -> None:
    """The module-level caches keyed by the engine or its runtimes (restore.py)."""
    from lightning_replay.core.replay import restore

    restore._SHARED.pop(engine, None)
    for rt in engine.runtimes.values():
        restore._POOLS.pop(rt, None)


def _resolve_budget(config: ReplayConfig, model: nn.Module) -> int | None:
    """``config.budget`` in bytes for ``model``'s device (its first parameter or buffer; CPU
    without either); ``None`` for ``"min"`` and for no budget."""
    device = next(
        (t.device for t in model.parameters()),
        next((t.device for t in model.buffers()), torch.device("cpu")),
    )
    try:
        return config.budget.resolve(device)
    except ValueError as exc:
        raise ReplayConfigError(f"{config.caller}(budget={config.budget}): {exc}") from None


def _retain_dominates(eng: ReplayEngine, rt: SegmentRuntime, opts: list[str]) -> bool:
    """Whether retaining ``rt`` holds fewer bytes from its forward to its backward than any of
    its replayed options ``opts`` (a replay holds those and re-materializes its activations on
    top, and takes time): then no plan, whatever its budget, replays it. (A tie is timed: the
    figures are the probe's, and a replay that holds as much may hold less at another input.)"""
    if "retain" not in opts or len(opts) < 2:
        return False
    kept = calibration_held(eng, rt, "retain")[0]
    return all(calibration_held(eng, rt, o)[0] > kept for o in opts if o != "retain")
