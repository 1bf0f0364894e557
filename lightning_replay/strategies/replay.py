"""``Trainer(strategy="replay")``: state-aware activation recomputation under Lightning.

:class:`ReplayStrategy` is a :class:`~lightning.pytorch.strategies.DDPStrategy` that installs the
replay engine on the LightningModule in ``_setup_model`` (after ``configure_model``, precision
conversion and ``model_to_device``, before DDP wrapping and optimizer creation) and makes each
``training_step`` plus its backward one engine window. With one process it trains without a
process group or DDP wrapper, so it matches a plain ``Trainer(devices=1)`` bit for bit; with N
processes it is DDP underneath and every rank runs rank 0's plan.

``import lightning_replay`` registers the names:

* ``"replay"``: the ``popen`` launcher (scripts; ``devices=1`` starts no child process),
* ``"replay_spawn"``, ``"replay_fork"``, ``"replay_notebook"`` (``fork``): the other launchers.

It leans on Lightning internals, hence the ``lightning>=2.4,<2.7`` pin: ``_setup_model``,
``_configure_launcher``, ``_register_ddp_hooks``, ``_precision_plugin``, ``_start_method`` and
the trainer's ``_accelerator_connector.use_distributed_sampler``.

It is long (over 600 lines once ruff-formatted) because a Lightning strategy is where the replay
arguments, their validation, DDP's launchers and hooks, rank 0's plan and the checkpointed
engine state meet; the engine does the work.

Example:
    >>> import lightning as L, lightning_replay
    >>> trainer = L.Trainer(strategy="replay", accelerator="cpu", devices=1, max_steps=1,
    ...                     logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False)
    >>> type(trainer.strategy).__name__
    'ReplayStrategy'
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import multiprocessing
import os
import uuid
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, XLAPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_replay._compat import accelerator_connector, distributed_is_initialized
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.base.budget import Budget, format_bytes
from lightning_replay.core.engine.config import ReplayConfig
from lightning_replay.core.engine.engine import ReplayEngine
from lightning_replay.core.engine.installation import install_config
from lightning_replay.errors import ReplayConfigError, SegmentError
from lightning_replay.core.base.records import RecordStore
from lightning_replay.core.engine.segments import SegmentSpec, default_segments, resolve_segments
from lightning_replay.core.replay.restore import replay_error_from
from lightning_replay.strategies.launchers import RankExitLauncher

#: Registered strategy names and their launcher (``start_method``).
STRATEGY_NAMES: dict[str, str] = {
    "replay": "popen",
    "replay_spawn": "spawn",
    "replay_fork": "fork",
    "replay_notebook": "fork",
}

#: Fraction of CUDA memory used as the budget when ``budget=None``.
DEFAULT_CUDA_FRACTION = 0.9

_INCOMPATIBLE_PRECISION = (FSDPPrecision, DeepSpeedPrecision, XLAPrecision)


class ReplayStrategy(DDPStrategy):
    """DDP with state-aware replay of the LightningModule's segments.

    Args:
        segments: what to replay: qualified names, dotted globs (``"blocks.*"``), module
            classes, a callable ``(name, module) -> bool``, or a list of these. ``None``: the
            LightningModule's ``configure_replay_segments()`` if it defines one, else the
            parameterized children of its largest ``ModuleList``/``Sequential``.
        budget: peak-memory budget: bytes, ``"2GiB"``, a fraction of the device's memory
            (``0.8``: of the CUDA device, or of physical memory on CPU), or ``"min"`` for the
            lowest-memory correct plan (the grammar of :class:`~lightning_replay.budget.Budget`,
            as in ``install()``). ``None``: 90 % of the device on CUDA; on CPU the
            lowest-memory correct plan.
        planner: ``"joint"`` (optimal), ``"eager_whole"``, ``"fixed_regions"``,
            ``"retain_all"``, ``"whole_all"`` or ``"selective_all"``.
        preservation: ``"auto"``, ``"whole"``, ``"regions"``, ``"retain"``, ``"selective"``
            or a dict per
            segment. A segment given one option (a pin, e.g. ``{"blocks.0": "retain"}``) keeps
            it under every plan; a budget that cannot be met with the pins is an
            ``InfeasibleBudget`` naming them.
        on_violation: ``"record"`` (warn, record a rejection, re-probe the segment) or
            ``"raise"``.
        records: where records go: ``None`` (memory, unless a :class:`ReplayCallback` names a
            file), a SQLite path, or a :class:`~lightning_replay.RecordStore`.
        calibration_steps: steps each option is timed before the first plan.
        real_peak: plan for the process's real memory (see ``install(real_peak=...)``): the
            first step of each plan is measured and what it held beyond the engine's
            accounting joins the base. Measured on CPU in one process only, and on CUDA;
            on by default.
        selective: a selective policy (``"matmul"``: keep the outputs of matrix products,
            attention and convolutions; ``"every_other_matmul"``; ``"flops"``), as in
            ``install()``: the planner may also replay a segment selectively, with the same
            preservation as a full replay. ``None``: only segments pinned to
            ``preservation="selective"`` are (under ``"matmul"``).
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes
            (``start_method``, ``timeout``, ...) and what it hands on to
            ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph``, ...).

    Raises:
        ReplayConfigError: on a bad or unknown argument (the message names it and lists the
            valid ones), or at ``Trainer`` construction when combined with an FSDP, DeepSpeed
            or XLA precision plugin or an accelerator other than CPU or CUDA.

    Example:
        >>> strategy = ReplayStrategy(segments="blocks.*", budget="2GiB")
        >>> strategy.budget
        Budget('2.00 GiB')
    """

    strategy_name = "replay"

    def __init__(
        self,
        segments: SegmentSpec | Iterable[SegmentSpec] | None = None,
        budget: int | float | str | None = None,
        planner: str = "joint",
        preservation: str | Mapping[str, str] = "auto",
        on_violation: str = "record",
        records: RecordStore | str | os.PathLike | None = None,
        calibration_steps: int = 2,
        real_peak: bool = True,
        selective: str | None = None,
        **kwargs: Any,
    ) -> None:
        _check_known_kwargs(kwargs)
        super().__init__(**kwargs)
        #: The replay arguments, validated (what the engine is installed with, once the
        #: segments and the budget are resolved for the model and its device).
        self.config = strategy_config(
            "ReplayStrategy",
            segments=segments,
            budget=budget,
            planner=planner,
            preservation=preservation,
            on_violation=on_violation,
            records=records,
            calibration_steps=calibration_steps,
            real_peak=real_peak,
            selective=selective,
        )
        self._records_path: str | None = None
        self.run_id: str | None = None
        self.engine: ReplayEngine | None = None
        self.segment_names: list[str] = []
        self._pending_engine_state: dict[str, Any] | None = None
        self._synced_plan_version = 0
        self._synced_real_base: int | None = None  # the largest real base agreed by the ranks
        self._synced_phases: list[int] | None = None  # this rank's phase row the ranks agreed
        #: Each segment's share of the segments' activation bytes, measured on the probe step
        #: (empty until then).
        self.activation_shares: dict[str, float] = {}

    # The arguments as given (read-only: they are :attr:`config`'s).
    segments_spec = property(lambda self: self.config.segments)
    budget = property(lambda self: self.config.budget, doc="The budget as given (a Budget).")
    planner = property(lambda self: self.config.planner)
    preservation = property(lambda self: self.config.preservation)
    on_violation = property(lambda self: self.config.on_violation)
    calibration_steps = property(lambda self: self.config.calibration_steps)
    real_peak = property(lambda self: self.config.real_peak)
    selective = property(lambda self: self.config.selective)
    _records_arg = property(lambda self: self.config.records)

    # ------------------------------------------------------------------ records
    def configure_records(
        self, path: str | os.PathLike | None, run_id: str | None = None, *, default: bool = False
    ) -> None:
        """Send records to ``path`` (SQLite) under ``run_id``; :class:`ReplayCallback` calls it
        before the engine is installed.

        Args:
            path: the records file.
            run_id: the run id to write under (a resumed run keeps its id).
            default: ``path`` is only a default: records given to the strategy win.

        Raises:
            ReplayConfigError: ``records=`` given to the strategy names another place.
        """
        given = self._records_arg
        if path is not None and given is not None:
            if default:
                path = None  # the strategy's own records win over a default
            else:
                given_path = given.path if isinstance(given, RecordStore) else os.fspath(given)
                if given_path is None or os.path.abspath(given_path) != os.path.abspath(
                    os.fspath(path)
                ):
                    raise ReplayConfigError(
                        f"records are configured twice: ReplayStrategy(records={given_path!r}) "
                        f"and ReplayCallback(records_path={os.fspath(path)!r}). Pass the "
                        "place to one of them."
                    )
        self._records_path = None if path is None else os.fspath(path)
        if run_id is not None:
            self.run_id = run_id

    def _make_records(self) -> RecordStore:
        given = self._records_arg
        if isinstance(given, RecordStore):
            if self.run_id is None:
                self.run_id = given.run_id
            return given
        path = self._records_path or (None if given is None else os.fspath(given))
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex[:12]
        # Every rank writes under rank 0's run id, each with its own rank.
        self.run_id = self.broadcast(self.run_id)
        if path is None or self.world_size == 1:
            return RecordStore(path, run_id=self.run_id, rank=self.global_rank)
        # Ranks that create a new SQLite file at the same moment race on its switch to WAL
        # ("database is locked"): each node's first process creates it, the others then open it.
        store = None
        if self.local_rank == 0:
            store = RecordStore(path, run_id=self.run_id, rank=self.global_rank)
        self.barrier("lightning_replay.records")
        if store is None:
            store = RecordStore(path, run_id=self.run_id, rank=self.global_rank)
        return store

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this once accelerator, devices and precision are final: the earliest
        # point at which a combination that cannot work is known.
        self._check_composable()
        if self.world_size == 1:
            # One process runs in this one, with no launcher, like a plain Trainer(devices=1):
            # Lightning's launchers reset torch's thread count (and set OMP_NUM_THREADS) unless
            # OMP_NUM_THREADS is set, and the CPU kernels then round differently.
            self._launcher = None
            return
        super()._configure_launcher()
        if self._start_method != "popen":  # spawned ranks that end cleanly (see launchers.py)
            self._launcher = RankExitLauncher(self, start_method=self._start_method)

    def _check_composable(self) -> None:
        precision = self._precision_plugin
        if isinstance(precision, _INCOMPATIBLE_PRECISION):
            raise ReplayConfigError(
                f"Trainer(strategy='replay') cannot use the {type(precision).__name__} plugin: "
                "ReplayStrategy is DDP underneath and replays whole-parameter modules, while "
                "that plugin belongs to a sharded or compiled strategy. Use FSDPStrategy's own "
                "activation_checkpointing_policy, or drop the plugin (precision='bf16-mixed' "
                "and '16-mixed' work)."
            )
        devices = self.parallel_devices or []
        bad = sorted({d.type for d in devices} - {"cpu", "cuda"})
        if bad:
            raise ReplayConfigError(
                f"Trainer(strategy='replay') runs on CPU or CUDA devices only, got "
                f"{bad[0]!r} (accelerator {type(self.accelerator).__name__}). Use "
                "accelerator='cpu' or 'cuda'."
            )

    @override
    def setup_environment(self) -> None:
        if self._start_method == "fork" and self.world_size > 1 and torch.get_num_threads() > 1:
            # A forked child inherits the parent's OpenMP thread pool without its threads: the
            # first parallel CPU kernel (batch norm, a large elementwise op) then waits forever
            # once the parent has run one. One intra-op thread per child cannot deadlock.
            rank_zero_info(
                f"ReplayStrategy(start_method='fork'): each process uses 1 CPU "
                f"thread (was {torch.get_num_threads()}); a forked OpenMP pool "
                "deadlocks. Use start_method='spawn' or 'popen' to keep threads."
            )
            torch.set_num_threads(1)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if self.world_size > 1:
            super().setup_distributed()
            return
        # One process: no process group, no DDP wrapper and no DistributedSampler (which would
        # reshuffle the data), exactly like a plain Trainer(devices=1). Nor DDP's reset_seed():
        # re-seeding here would make every random draw differ from the plain Trainer's.
        self.set_world_ranks()
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:
            accelerator_connector(trainer).use_distributed_sampler = False

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.world_size > 1 or trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        # One process, not fitting (validate/test/predict): nothing to replay, and no process
        # group for DDP's module-state broadcast - set up like a single-device strategy.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Install the engine on the LightningModule, then wrap it in DDP (N > 1 processes)."""
        self._install(model)
        if self.world_size > 1:
            return super()._setup_model(model)
        return model

    @override
    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            super()._register_ddp_hooks()

    def _install(self, model: nn.Module) -> None:
        if self.engine is not None and self.engine.installed:
            self.engine.uninstall()
        config = _config_of(self)
        spec, origin = self._resolve_spec(model)
        names = list(resolve_segments(model, spec))
        self._check_segments(model, names)
        budget = self._resolve_budget()
        engine = install_config(
            model, config.replace(segments=spec, budget=budget, records=self._make_records())
        )
        if self._pending_engine_state is not None:
            engine.load_state_dict(self._pending_engine_state)
            self._pending_engine_state = None
            # What this run was given wins over what the checkpoint's run was given (a run
            # given no budget on CPU keeps the checkpoint's); the loaded plan stays until a
            # re-plan (ReplayCallback's "memory" notices a misfit).
            if isinstance(budget, int) or config.budget.min:
                engine.reconfigure(planner=config.planner, budget=budget)
            else:
                engine.reconfigure(planner=config.planner)
        self.engine = engine
        self.segment_names = names
        self.activation_shares = {}
        self._synced_plan_version = engine.plan_version
        rank_zero_info(
            f"ReplayStrategy: replaying {len(names)} segment(s) of {type(model).__name__} "
            f"({origin}): {', '.join(names)}; budget "
            f"{'lowest-memory plan' if budget == 'min' else format_bytes(budget)}, planner "
            f"{self.planner!r}"
        )

    def _resolve_spec(self, model: nn.Module) -> tuple[Any, str]:
        if self.segments_spec is not None:
            return self.segments_spec, "segments=" + repr(self.segments_spec)
        hook = getattr(model, "configure_replay_segments", None)
        if callable(hook):
            spec = hook()
            if spec is None:
                raise SegmentError(
                    f"{type(model).__name__}.configure_replay_segments() returned "
                    "None; return names, glob patterns, module classes or a "
                    "callable"
                )
            return spec, "configure_replay_segments()"
        containers, names = default_segments(model)
        return names, "repeated blocks of " + ", ".join(repr(c) for c in containers)

    def _check_segments(self, model: nn.Module, names: list[str]) -> None:
        for name in names:
            for sub_name, sub in model.get_submodule(name).named_modules():
                if isinstance(sub, nn.SyncBatchNorm):
                    where = f"{name}.{sub_name}" if sub_name else name
                    raise ReplayConfigError(
                        f"segment {name!r} holds a SyncBatchNorm ({where!r}): its replay would "
                        "run collectives a second time on some ranks only. Use "
                        "Trainer(sync_batchnorm=False), or leave that module out of segments=."
                    )

    def _resolve_budget(self) -> int | str:
        """Bytes for this device, or ``"min"`` for the lowest-memory correct plan."""
        budget = self.budget
        if budget.is_none and self.root_device.type == "cuda":
            budget = Budget(fraction=DEFAULT_CUDA_FRACTION)
        if budget.is_none or budget.min:
            return "min"
        try:
            return budget.resolve(self.root_device)
        except ValueError as exc:
            raise ReplayConfigError(f"ReplayStrategy(budget={budget}): {exc}") from None

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with replay_errors(self.engine):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if not self.activation_shares:
            self._report_activation_shares()

    def _report_activation_shares(self) -> None:
        """Once every segment has been probed: each one's share of the segments' activation
        bytes (what replaying it can save), printed once."""
        engine = self.engine
        if engine is None or not engine.installed:
            return
        summary = engine.summary()
        if any(s["contract_version"] == 0 for s in summary.values()):
            return  # a segment has not been probed yet
        sizes = {name: s["activation_bytes"] for name, s in summary.items()}
        total = sum(sizes.values())
        self.activation_shares = {n: (b / total if total else 0.0) for n, b in sizes.items()}
        rank_zero_info(
            f"ReplayStrategy: activation bytes per segment (probe step, {format_bytes(total)} "
            "in all): "
            + ", ".join(
                f"{n} {format_bytes(b)} ({self.activation_shares[n]:.1%})" for n, b in sizes.items()
            )
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None or not engine.installed:
            return super().training_step(*args, **kwargs)
        # The engine may plan as the window begins (after calibration); agree on rank 0's
        # plan before any segment runs, so every rank runs the same plan in this very window.
        if self.optimizers and not engine.tracked_optimizers:
            engine.track_optimizer(*self.optimizers)  # their state is part of the base
        engine.begin_window(inputs=(args, kwargs))  # the batch: its size says when to measure
        try:
            self._sync_plan()
            return super().training_step(*args, **kwargs)
        finally:
            engine.end_forward()

    @override
    def teardown(self) -> None:
        engine = self.engine
        if engine is not None and engine.installed:
            # A later fit() on this strategy continues from here (plan, versions, step).
            self._pending_engine_state = engine.state_dict()
            engine.uninstall()
        super().teardown()
        if (
            self._start_method != "popen"
            and distributed_is_initialized()
            and multiprocessing.parent_process() is not None
        ):
            # A spawned or forked rank exits right after this (RankExitLauncher ends it
            # without interpreter finalization, where gloo's threads could abort it): its
            # process group goes first, while every rank is still there.
            torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------ plans across ranks
    def replan(self, budget: int | str | None = None) -> _planner.Plan | None:
        """Plan again from the measured costs on every rank; every rank then runs rank 0's plan.

        Call it on all ranks at the same point (as :class:`ReplayCallback` does).

        Args:
            budget: ``None`` keeps the engine's budget; bytes or ``"2GiB"`` set a new one;
                ``"min"`` asks for the lowest-memory correct plan.

        Returns:
            The plan in force, or ``None`` while no segment has been probed.

        Raises:
            InfeasibleBudget: rank 0's planner cannot meet the budget (raised on every rank;
                the plan in force is kept).
        """
        engine = self._require_engine()
        error: BaseException | None = None
        if not engine.ready_to_plan:  # nothing measured yet: keep what there is
            if budget is not None:
                engine.reconfigure(budget=budget)
        else:
            try:
                if budget is None:
                    engine.replan()
                else:
                    engine.replan(budget=budget)
            except _planner.InfeasibleBudget as exc:
                error = exc
        if self.world_size > 1:
            error = self.broadcast(error)
            self._sync_plan(force=True)
        if error is not None:
            raise error
        return engine.plan

    def _sync_plan(self, force: bool = False) -> None:
        """Make every rank run rank 0's plan, made for the largest real base and the largest
        measured phase figures of any rank.

        One all-reduce per step, with no further host sync: the largest of each rank's real
        base (its own parameter shards, optimizer state and what its measured step held beyond
        the accountant), whether any rank's plan changed, and whether any rank's measured phase
        figures changed. Each rank measures its own real peak (the engine's CPU referee); ranks'
        bases and phases differ (uneven shards, a rank's own extra tensors, its own backward
        temporaries), and rank 0's plan must fit the worst. When the largest base changes,
        every rank re-fits its plan to it (a prediction that grows, or a new plan over the
        budget); when a rank's phase figures changed, a second all-reduce (only then: at a
        plan's first steps, where the engine measures) agrees the largest of each figure and
        every rank re-fits to those; then rank 0's plan is sent to all.
        """
        engine = self.engine
        if engine is None or self.world_size <= 1 or not distributed_is_initialized():
            return
        changed = engine.plan_version != self._synced_plan_version
        own = engine.base_memory + engine.unaccounted_bytes
        phases = engine.phase_row() if engine.plan is not None else None
        phases_changed = phases is not None and phases != self._synced_phases
        # each rank's prediction of the plan in force: its own measured phases (forward,
        # replays, optimizer) re-fit it on that rank alone
        predicted = engine.plan.peak_memory if engine.plan is not None else 0
        reduced = self.reduce(
            torch.tensor(
                [int(force or changed), own, predicted, int(phases_changed)],
                dtype=torch.int64,
                device=self.root_device,
            ),
            reduce_op="max",
        ).tolist()
        any_changed, top, top_predicted = bool(reduced[0]), int(reduced[1]), int(reduced[2])
        if top != self._synced_real_base:  # the same on every rank: all reduced the same
            self._synced_real_base = top
            engine.agree_real_base(top)
            any_changed = True
        if reduced[3]:
            row = phases if phases is not None else engine.phase_row()
            self._synced_phases = row
            agreed = self.reduce(
                torch.tensor(row, dtype=torch.int64, device=self.root_device), reduce_op="max"
            ).tolist()
            engine.agree_phases(agreed)
            any_changed = True
        if not any_changed:
            # one plan on every rank: its prediction is the largest any rank's phases give
            if engine.plan is not None and top_predicted > engine.plan.peak_memory:
                engine.plan = dataclasses.replace(engine.plan, peak_memory=top_predicted)
            return
        payload = (
            (engine.plan.to_dict() if engine.plan is not None else None, engine.plan_version)
            if self.global_rank == 0
            else None
        )
        plan_dict, version = self.broadcast(payload)
        if plan_dict is not None and self.global_rank != 0:
            engine.adopt_plan(_planner.Plan.from_dict(plan_dict), version, from_rank=0)
        self._synced_plan_version = engine.plan_version

    # ------------------------------------------------------------------ resumable state
    def engine_state_dict(self) -> dict[str, Any] | None:
        """The engine's resumable state (``None`` before the engine is installed)."""
        if self.engine is None:
            return self._pending_engine_state
        return self.engine.state_dict()

    def load_engine_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`engine_state_dict`: applied now, or at install if not yet."""
        state = dict(state)
        if self.run_id is None and state.get("run_id"):
            self.run_id = state["run_id"]
        if self.engine is not None and self.engine.installed:
            self.engine.load_state_dict(state)
            self._synced_plan_version = self.engine.plan_version
        else:
            self._pending_engine_state = state

    def _require_engine(self) -> ReplayEngine:
        if self.engine is None or not self.engine.installed:
            raise ReplayConfigError(
                "ReplayStrategy has no installed engine: it is installed "
                "when trainer.fit() sets up the model"
            )
        return self.engine

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :data:`STRATEGY_NAMES` (not DDP's names) in ``strategy_registry``."""
        register(strategy_registry)


def strategy_config(
    name: str,
    *,
    segments: Any = None,
    budget: Any = None,
    planner: Any = "joint",
    preservation: Any = "auto",
    on_violation: Any = "record",
    records: Any = None,
    calibration_steps: Any = 2,
    real_peak: Any = True,
    selective: Any = None,
) -> ReplayConfig:
    """The :class:`~lightning_replay.config.ReplayConfig` of a replay strategy named ``name``
    (for the messages): manual windows (each ``training_step`` is one), memory always tracked,
    and costs always measured (without a budget the plan is the lowest-memory correct one,
    and after a resume the loaded plan's options keep being timed so a re-plan has costs).

    Raises:
        ReplayConfigError: a bad argument, named as ``name(argument=value)``.
    """
    return ReplayConfig(
        segments=segments,
        budget=budget,
        planner=planner,
        preservation=preservation,
        on_violation=on_violation,
        records=records,
        calibration_steps=calibration_steps,
        real_peak=real_peak,
        selective=selective,
        window="manual",
        track_memory=True,
        measure_costs=True,
        caller=name,
    )


@contextlib.contextmanager
def replay_errors(engine: ReplayEngine | None) -> Iterator[None]:
    """Around a step's backward: a ``CheckpointError`` a replay's checkpoint raised is raised
    as that segment's ReplayError (its divergence record written); any other error as is."""
    try:
        yield
    except CheckpointError as exc:
        error = replay_error_from(engine, exc) if engine is not None else None
        if error is None:
            raise
        raise error from exc


def _check_replay_args(
    name: str,
    *,
    budget: Any,
    planner: Any,
    preservation: Any,
    on_violation: Any,
    records: Any,
    calibration_steps: Any,
    selective: Any = None,
) -> Budget:
    """Validate the replay arguments of a strategy that keeps them as attributes; returns the
    parsed budget. Kept for :class:`ReplayFSDPStrategy`; new code keeps
    :func:`strategy_config` as ``self.config``."""
    return strategy_config(
        name,
        budget=budget,
        planner=planner,
        preservation=preservation,
        on_violation=on_violation,
        records=records,
        calibration_steps=calibration_steps,
        selective=selective,
    ).budget


def _config_of(strategy: Any) -> ReplayConfig:
    """A strategy's config: its ``config``, or one built from the argument attributes of a
    strategy that keeps them so (``ReplayFSDPStrategy``, which shares ``_install``)."""
    config = getattr(strategy, "config", None)
    if isinstance(config, ReplayConfig):
        return config
    return strategy_config(
        type(strategy).__name__,
        segments=strategy.segments_spec,
        budget=strategy.budget,
        planner=strategy.planner,
        preservation=strategy.preservation,
        on_violation=strategy.on_violation,
        records=strategy._records_arg,
        calibration_steps=strategy.calibration_steps,
        real_peak=getattr(strategy, "real_peak", True),
        selective=getattr(strategy, "selective", None),
    )


def _valid_kwargs() -> dict[str, list[str]]:
    """The keyword arguments ReplayStrategy takes, by where they go."""
    from torch.nn.parallel import DistributedDataParallel

    def names(fn: Any, drop: set[str]) -> list[str]:
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in drop
        ]

    return {
        "ReplayStrategy": names(ReplayStrategy.__init__, {"self"}),
        "DDPStrategy": names(DDPStrategy.__init__, {"self"}),
        # DDPStrategy hands its other keywords to DistributedDataParallel; it sets these itself
        "DistributedDataParallel": names(
            DistributedDataParallel.__init__, {"self", "module", "device_ids"}
        ),
    }


def _check_known_kwargs(kwargs: Mapping[str, Any]) -> None:
    # DDPStrategy would hand a misspelt replay argument on to DistributedDataParallel, which
    # fails only once a second process wraps the model, and never with one: refuse it here.
    valid = _valid_kwargs()
    known = {n for group in valid.values() for n in group}
    unknown = [k for k in kwargs if k not in known]
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, sorted(known), n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    listed = "; ".join(f"{where}: {', '.join(group)}" for where, group in valid.items())
    raise ReplayConfigError(
        f"ReplayStrategy got unknown argument(s) {', '.join(hints)}. Valid arguments are {listed}."
    )


def register(registry: Any = StrategyRegistry) -> None:
    """Register the strategy names once; a name held by another class is an error."""
    register_names(ReplayStrategy, STRATEGY_NAMES, registry)


def register_names(cls: type, names: Mapping[str, str], registry: Any) -> None:
    """Register ``cls`` under each of ``names`` (name -> ``start_method``) once; a name held by
    another class is an error. ``cls`` from a reloaded module counts as the same class."""
    for name, start_method in names.items():
        if name in registry:
            held = registry[name]["strategy"]
            if (
                getattr(held, "__qualname__", None) == cls.__qualname__
                and getattr(held, "__module__", None) == cls.__module__
            ):
                continue  # ours (possibly from a reloaded module): nothing to do
            raise ReplayConfigError(
                f"strategy name {name!r} is already registered by {held!r}; lightning_replay "
                f"cannot register {cls.__name__} under it. Remove the other registration or use "
                f"{cls.__name__}(...) directly."
            )
        registry.register(
            name,
            cls,
            description=f"lightning_replay {cls.__name__} with start_method {start_method!r}",
            start_method=start_method,
        )
