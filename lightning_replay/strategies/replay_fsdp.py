"""``Trainer(strategy="replay_fsdp")``: state-aware replay under FSDP2.

:class:`ReplayFSDPStrategy` is Lightning's
:class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2: the LightningModule shards
itself with ``fully_shard`` in ``configure_model``) with the replay engine installed on the
sharded model. Segment names and ``state_dict`` keys are those of the unsharded model.

How the two compose: each segment lies inside one FSDP unit (it is a unit, or a submodule of
one). FSDP gathers the unit's parameters before the unit's forward (the segment's forward runs
on them, under ``torch.utils.checkpoint``) and again before its backward (FSDP's pre-backward
hook, registered on the unit's outputs), so the replay, which runs inside that backward, sees
the gathered parameters with either ``reshard_after_forward``. The replay calls the segment's
own forward, not the unit's hooks: no collective runs inside a replay. The all-gather and
reshard of parameters is parameter traffic, not state: the probe does not watch it, nothing
of it is snapshotted, and it is never a violation.

Every rank runs rank 0's plan (as :class:`ReplayStrategy` does) and writes its own records.

Memory, per rank: the base holds this rank's parameter shards, their gradients, the optimizer's
state (its shards) and FSDP's gathered parameters at their most (every unit that keeps its
parameters gathered from forward to backward: the root, and any unit with
``reshard_after_forward=False``; plus the two largest of the units that reshard, one running and
one prefetched). A segment saves the gathered parameters it multiplies by, but FSDP frees and
refills them on its own schedule whatever the plan does: they are never a segment's cost (the
probe leaves them out of its activation bytes, and the accountant counts them in the base only),
so the plan's predicted peak and the accounted peak agree. Backward's transient buffers (FSDP's
all-gather and reduce-scatter buffers, unsharded gradients) are not accounted (but every plan
keeps two units' unsharded gradients free on top of its figures, the engine's
``reserve_memory``: when the collective frees them varies from step to step, see
:meth:`_GatheredParameters.reduce_bytes`): on CPU each rank
measures its own real peak on the first step of each plan (the engine's profiler referee, see
:mod:`lightning_replay.memory`), and what it held beyond the accountant joins that rank's base.
Ranks' bases differ (uneven shards, a rank's own tensors), so rank 0 plans for the largest real
base of any rank, reduced in the step's one plan-sync all-reduce (:meth:`ReplayFSDPStrategy.
_sync_plan`). Under FSDP the profiler now and then misses the free of a buffer of one unit's
gathered size (17,160 B on the demo config's model: one free event fewer on the main thread, the
same allocations), so a step's measured peak can read one to three units high: the base that
joins the plan is then high (safe); a referee that uses the profiler reads such steps high too.

``import lightning_replay`` registers ``"replay_fsdp"`` (the ``popen`` launcher, for scripts);
``ReplayFSDPStrategy(start_method="spawn" | "fork")`` runs the ranks in child processes.

It leans on Lightning internals, hence the ``lightning>=2.4,<2.7`` pin: ModelParallelStrategy's
``setup`` and ``_configure_launcher``, the ``_MultiProcessingLauncher``. The GPU (NCCL) path is
written for but has only been tested on CPU with gloo.

Example:
    >>> import lightning as L, lightning_replay
    >>> trainer = L.Trainer(strategy="replay_fsdp", accelerator="cpu", devices=2, max_steps=1,
    ...                     logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False)
    >>> type(trainer.strategy).__name__
    'ReplayFSDPStrategy'
"""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from typing import Any, Iterable, Literal, Mapping

import torch
from torch import nn

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_replay._compat import distributed_is_initialized
from lightning_replay.core.base.budget import Budget
from lightning_replay.core.engine.engine import ReplayEngine
from lightning_replay.errors import ReplayConfigError, SegmentError
from lightning_replay.core.mechanisms.memory import live_model_bytes
from lightning_replay.core.base.records import RecordStore
from lightning_replay.core.engine.segments import SegmentSpec, resolve_segments
from lightning_replay.strategies.launchers import RankExitLauncher
from lightning_replay.strategies.replay import (
    ReplayStrategy,
    _check_replay_args,
    register_names,
    replay_errors,
)

#: Registered strategy names and their launcher (``start_method``).
STRATEGY_NAMES: dict[str, str] = {"replay_fsdp": "popen"}

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ReplayFSDPStrategy(ModelParallelStrategy):
    """FSDP2 (:class:`~lightning.pytorch.strategies.ModelParallelStrategy`) with state-aware
    replay of the LightningModule's segments.

    The LightningModule shards itself in ``configure_model`` with ``fully_shard`` (each block,
    then the root), as for ``ModelParallelStrategy``; the engine is installed on the sharded
    model. Each segment must lie inside one FSDP unit: be a unit, or a submodule of one that
    contains no other unit.

    Args:
        segments: what to replay, as for :class:`ReplayStrategy`: names, globs
            (``"blocks.*"``), module classes, a callable ``(name, module) -> bool``, or a list;
            ``None``: ``configure_replay_segments()`` if the LightningModule defines one, else
            the parameterized children of its largest ``ModuleList``/``Sequential``.
        budget: peak-memory budget *per rank* (bytes, ``"2GiB"``, a fraction of the device's
            memory, or ``"min"``); ``None``: 90 % of the device on CUDA, the lowest-memory
            correct plan on CPU.
        planner: ``"joint"``, ``"eager_whole"``, ``"fixed_regions"``, ``"retain_all"`` or
            ``"whole_all"``.
        preservation: ``"auto"``, ``"whole"``, ``"regions"``, ``"retain"`` or a dict per
            segment (a pin).
        on_violation: ``"record"`` or ``"raise"``.
        records: ``None``, a SQLite path or a :class:`~lightning_replay.RecordStore`.
        calibration_steps: steps each option is timed before the first plan.
        selective: a selective policy (``"matmul"``, ``"every_other_matmul"`` or
            ``"flops"``), as for :class:`ReplayStrategy`; ``None``: only segments pinned to
            ``preservation="selective"`` replay selectively.
        start_method: ``"popen"`` (a script launches its ranks), ``"spawn"``, ``"fork"`` or
            ``"forkserver"`` (child processes of this one; notebooks and tests).
        data_parallel_size, tensor_parallel_size: the device mesh. Unlike
            ``ModelParallelStrategy`` (whose ``"auto"`` makes every device of a node
            tensor-parallel), ``"auto"`` here shards over the data-parallel dimension, as FSDP
            does: ``data_parallel_size`` = every device (nodes x devices),
            ``tensor_parallel_size=1``; with one of them given, the other is what is left of
            the devices.
        save_distributed_checkpoint, process_group_backend, timeout: as for
            ``ModelParallelStrategy``.

    Raises:
        ReplayConfigError: a bad argument; at setup, a model that ``configure_model`` did not
            shard with ``fully_shard``.
        SegmentError: at setup, a segment that crosses FSDP units.

    Example:
        >>> strategy = ReplayFSDPStrategy(segments="blocks.*", budget="2GiB",
        ...                               data_parallel_size=2, tensor_parallel_size=1)
        >>> strategy.budget
        Budget('2.00 GiB')
    """

    strategy_name = "replay_fsdp"

    def __init__(
        self,
        segments: SegmentSpec | Iterable[SegmentSpec] | None = None,
        budget: int | float | str | None = None,
        planner: str = "joint",
        preservation: str | Mapping[str, str] = "auto",
        on_violation: str = "record",
        records: RecordStore | str | os.PathLike | None = None,
        calibration_steps: int = 2,
        selective: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        name = type(self).__name__
        self.budget: Budget = _check_replay_args(
            name,
            budget=budget,
            planner=planner,
            preservation=preservation,
            on_violation=on_violation,
            records=records,
            calibration_steps=calibration_steps,
            selective=selective,
        )
        if start_method not in _START_METHODS:
            raise ReplayConfigError(
                f"{name}(start_method={start_method!r}) is not known; use "
                f"one of {list(_START_METHODS)}"
            )
        self.segments_spec = segments
        self.planner = planner
        self.preservation = preservation
        self.on_violation = on_violation
        self.calibration_steps = calibration_steps
        self.selective = selective
        self._start_method = start_method
        self._records_arg = records
        self._records_path: str | None = None
        self.run_id: str | None = None
        self.engine: ReplayEngine | None = None
        self.segment_names: list[str] = []
        self._pending_engine_state: dict[str, Any] | None = None
        self._synced_plan_version = 0
        self._synced_real_base: int | None = None
        self._synced_phases: list[int] | None = None
        #: Each segment's share of the segments' activation bytes (probe step; empty until).
        self.activation_shares: dict[str, float] = {}
        #: Each segment's FSDP unit (the segment itself, or the unit it lies in).
        self.fsdp_units: dict[str, str] = {}
        self._full_state_dict: dict[str, Any] | None = None
        self._gathered: _GatheredParameters | None = None
        #: Bytes of gathered parameters FSDP holds at its most on this rank (0 until setup).
        self.gathered_bytes = 0
        #: Bytes every plan keeps free (the engine's ``reserve_memory``) for unsharded
        #: gradients a reduce-scatter holds a moment longer on some steps than on the step
        #: the engine measured (0 until setup).
        self.reduce_bytes = 0

    # The replay half is ReplayStrategy's own code (the same functions, not copies): records,
    # segment resolution, budget, install, the one plan for all ranks, and resumable state.
    # They use only what every ParallelStrategy has (broadcast, barrier, ranks, reduce).
    configure_records = ReplayStrategy.configure_records
    _make_records = ReplayStrategy._make_records
    _resolve_spec = ReplayStrategy._resolve_spec
    _check_segments = ReplayStrategy._check_segments
    _resolve_budget = ReplayStrategy._resolve_budget
    _report_activation_shares = ReplayStrategy._report_activation_shares
    replan = ReplayStrategy.replan
    engine_state_dict = ReplayStrategy.engine_state_dict
    load_engine_state_dict = ReplayStrategy.load_engine_state_dict
    _require_engine = ReplayStrategy._require_engine
    _sync_plan = ReplayStrategy._sync_plan

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        devices = self.parallel_devices or []
        bad = sorted({d.type for d in devices} - {"cpu", "cuda"})
        if bad:
            raise ReplayConfigError(
                f"Trainer(strategy='replay_fsdp') runs on CPU or CUDA devices only, got "
                f"{bad[0]!r} (accelerator {type(self.accelerator).__name__}). Use "
                "accelerator='cpu' or 'cuda'."
            )
        if self._start_method == "popen":
            super()._configure_launcher()
            return
        self._launcher = _ShardedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        if self._start_method == "fork" and self.world_size > 1 and torch.get_num_threads() > 1:
            # A forked child inherits the parent's OpenMP pool without its threads (see
            # ReplayStrategy.setup_environment): one intra-op thread per child cannot deadlock.
            rank_zero_info(
                f"ReplayFSDPStrategy(start_method='fork'): each process uses 1 CPU "
                f"thread (was {torch.get_num_threads()}); a forked OpenMP pool "
                "deadlocks. Use start_method='spawn' or 'popen' to keep threads."
            )
            torch.set_num_threads(1)
        self._data_parallel_size, self._tensor_parallel_size = fsdp_mesh(
            self._data_parallel_size,
            self._tensor_parallel_size,
            self.num_nodes * self.num_processes,
        )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """ModelParallelStrategy's setup (``configure_model`` has sharded the model), then the
        engine on the sharded LightningModule when fitting."""
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._install(self.lightning_module)

    def _install(self, model: nn.Module) -> None:
        spec, _ = self._resolve_spec(model)
        self.fsdp_units = _fsdp_units(model, list(resolve_segments(model, spec)))
        ReplayStrategy._install(self, model)
        self._gathered = _GatheredParameters(model)
        self.gathered_bytes = self._gathered.held_bytes()
        self.reduce_bytes = self._gathered.reduce_bytes()
        self._base_given = _base_memory(self.engine)
        self._count_base()

    def _count_base(self) -> None:
        """The engine's extra base on this rank: gathered parameters and optimizer state."""
        engine = self.engine
        base = (
            self._base_given
            + self.gathered_bytes
            + live_model_bytes(nn.Module(), list(self.optimizers))
        )
        if base != _base_memory(engine):
            _set_base_memory(engine, base)
        if engine.config.reserve_memory != self.reduce_bytes:
            engine.config = engine.config.replace(reserve_memory=self.reduce_bytes)
        if engine.accountant is not None:
            engine.accountant.counted_elsewhere = self._gathered

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if not self.activation_shares:
            self._report_activation_shares()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None or not engine.installed:
            return super().training_step(*args, **kwargs)
        # As ReplayStrategy: optimizer state is part of the base; the plan may be made as the
        # window begins, so agree on rank 0's before any segment runs.
        if self.optimizers and not engine.tracked_optimizers:
            engine.track_optimizer(*self.optimizers)
        self._count_base()  # before a plan is made: the optimizer's state exists from step 2
        engine.begin_window()
        try:
            self._sync_plan()
            return super().training_step(*args, **kwargs)
        finally:
            engine.end_forward()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with replay_errors(self.engine):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def teardown(self) -> None:
        engine = self.engine
        if engine is not None and engine.installed:
            self._pending_engine_state = engine.state_dict()
            engine.uninstall()
        super().teardown()
        if (
            self._start_method != "popen"
            and distributed_is_initialized()
            and multiprocessing.parent_process() is not None
        ):
            # The launcher hands the parent the trained weights after this, with no process
            # group left: gather them now, on every rank (a collective).
            self._full_state_dict = _full_state_dict(self.lightning_module)
            # A child rank exits right after this (see launchers.py): its process group goes
            # first, while every rank is still there.
            torch.distributed.destroy_process_group()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :data:`STRATEGY_NAMES` in ``strategy_registry``."""
        register(strategy_registry)


class _ShardedMultiProcessingLauncher(RankExitLauncher):
    """Lightning's spawn/fork launcher, handing the parent the trained weights unsharded.

    The stock launcher sends rank 0's ``state_dict()`` back: under FSDP2 those are rank 0's
    shards (DTensors of a process group the parent does not have). The strategy gathers the
    full state dict at teardown (``_full_state_dict``), and rank 0 sends that instead.
    """

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        full = getattr(self._strategy, "_full_state_dict", None)
        if full is None:
            return super()._collect_rank_zero_results(trainer, results)
        module = trainer.lightning_module
        module.state_dict = lambda *args, **kwargs: full  # what the stock launcher sends
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


def _full_state_dict(module: nn.Module | None) -> dict[str, Any] | None:
    """The unsharded state dict, gathered on every rank (CPU copies); None if not sharded."""
    if module is None or not _is_sharded(module):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _base_memory(engine: ReplayEngine) -> int:
    # The engine keeps install's base_memory in its ReplayConfig (H-core's refactor, not yet
    # committed when this was written), before that as extra_base_memory.
    config = getattr(engine, "config", None)
    return config.base_memory if config is not None else engine.extra_base_memory


def _set_base_memory(engine: ReplayEngine, nbytes: int) -> None:
    config = getattr(engine, "config", None)
    if config is not None:
        engine.config = config.replace(base_memory=nbytes)
    else:
        engine.extra_base_memory = nbytes


class _GatheredParameters:
    """FSDP2's gathered (unsharded) parameters of a model, on this rank.

    Called on a tensor, says whether its storage is one of them (how the accountant leaves
    them to the base). FSDP creates each gathered parameter at its first all-gather and
    afterwards frees and refills the same storage, so the set is complete after one step.
    FSDP2 has no public view of them: its states are read (private, hence the torch pin).
    """

    def __init__(self, model: nn.Module) -> None:
        self.units = _fsdp_param_groups(model)
        self._storages: set[int] = set()
        self._complete = False

    def __call__(self, t: torch.Tensor) -> bool:
        if not self._complete:
            self._refresh()
        return t.untyped_storage()._cdata in self._storages

    def _refresh(self) -> None:
        params = [
            getattr(fp, "_unsharded_param", None)
            for _, _, group in self.units
            for fp in group.fsdp_params
        ]
        self._storages = {
            getattr(p, "_local_tensor", p).untyped_storage()._cdata for p in params if p is not None
        }
        self._complete = all(p is not None for p in params)

    def held_bytes(self) -> int:
        """The most bytes of gathered parameters FSDP holds at once on this rank: every unit
        that keeps them from its forward to its backward (the root, ``reshard_after_forward=
        False``), plus the two largest units that reshard (one running, one prefetched)."""
        kept, resharded = 0, []
        for _, root, group in self.units:
            nbytes = sum(_unsharded_bytes(fp, group) for fp in group.fsdp_params)
            reshards = (
                group.post_forward_mesh_info is not None
                and group.post_forward_mesh_info == group.mesh_info
            )
            if root or not reshards:  # FSDP never reshards the root after forward
                kept += nbytes
            else:
                resharded.append(nbytes)
        return kept + sum(sorted(resharded, reverse=True)[:2])

    def reduce_bytes(self) -> int:
        """What every plan keeps free for the reduce-scatter's timing: the unsharded gradients of the
        two largest units that have trainable parameters, in the reduce dtype.

        FSDP reduce-scatters each unit's unsharded gradients after its backward; the
        collective (gloo's own threads, NCCL's stream) frees its input when it completes,
        a moment that varies from step to step. The engine measures a step's real peak now
        and then, and the plan is made from those figures, so another step can hold one or
        two more units' unsharded gradients than the measured one did: measured on CPU, one
        block's (4,480-4,676 B) on one step in a few runs, over a budget the prediction met
        with 1,192 B to spare; two blocks' once, under load."""
        sizes = []
        for _, _, group in self.units:
            policy = getattr(group, "mp_policy", None)
            nbytes = 0
            for fp in group.fsdp_params:
                if not fp.sharded_param.requires_grad:
                    continue
                dtype = (
                    getattr(policy, "reduce_dtype", None)
                    or getattr(policy, "param_dtype", None)
                    or fp.sharded_param.dtype
                )
                nbytes += (
                    fp.padded_sharded_param_size.numel()
                    * fp.mesh_info.shard_mesh_size
                    * dtype.itemsize
                )
            sizes.append(nbytes)
        return sum(sorted(sizes, reverse=True)[:2])


def _fsdp_param_groups(model: nn.Module) -> list[tuple[str, bool, Any]]:
    """``(unit name, is a root unit, parameter group)`` for each FSDP2 unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    out = []
    for name in units:
        root = not any(u != name and (u == "" or name.startswith(u + ".")) for u in units)
        state = model.get_submodule(name)._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before 2.8: one group per unit
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        out += [(name, root, g) for g in groups]
    return out


def _unsharded_bytes(fsdp_param: Any, group: Any) -> int:
    """Bytes of one gathered parameter: the padded shard times the shard group's size, in the
    mixed-precision policy's parameter dtype if it has one (FSDP sets its own dtype attributes
    only at the first forward)."""
    policy = getattr(group, "mp_policy", None)
    dtype = getattr(policy, "param_dtype", None) or fsdp_param.sharded_param.dtype
    return (
        fsdp_param.padded_sharded_param_size.numel()
        * fsdp_param.mesh_info.shard_mesh_size
        * dtype.itemsize
    )


def _fsdp_units(model: nn.Module, segments: list[str]) -> dict[str, str]:
    """Each segment's FSDP unit; refuses a model with none, and a segment crossing units.

    Raises:
        ReplayConfigError: no module of ``model`` is sharded with ``fully_shard``.
        SegmentError: a segment contains another unit (its replay would need that unit's
            parameters gathered, which FSDP does only around the unit's own hooks) or lies in
            no unit at all (nothing gathers or reduces its parameters).
    """
    from torch.distributed.fsdp import FSDPModule

    units = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    if not units:
        raise ReplayConfigError(
            f"{type(model).__name__}.configure_model() sharded nothing: no module is an FSDP2 "
            "unit. Trainer(strategy='replay_fsdp') replays a model sharded with "
            "torch.distributed.fsdp.fully_shard in configure_model (each block, then the root "
            "module), as for ModelParallelStrategy; for an unsharded model use "
            "strategy='replay'."
        )
    out = {}
    for seg in segments:
        inner = sorted(u for u in units if u.startswith(seg + "."))
        if inner:
            raise SegmentError(
                f"segment {seg!r} crosses FSDP units: it contains the unit(s) {inner}. Its "
                "replay in backward would need their parameters gathered, which FSDP does only "
                "around each unit's own forward and backward. Replay each unit instead "
                f"(segments={inner!r}), or shard {seg!r} as one unit."
            )
        owner = [u for u in units if u in (seg, "") or seg.startswith(u + ".")]
        if not owner:
            raise SegmentError(
                f"segment {seg!r} lies in no FSDP unit: nothing gathers or reduces its "
                f"parameters. Call fully_shard on it (or on the root module) in configure_model."
            )
        out[seg] = max(owner, key=len)
    return out


def fsdp_mesh(
    data_parallel: int | str, tensor_parallel: int | str, devices: int
) -> tuple[int | str, int | str]:
    """The mesh ``"auto"`` means for a strategy named FSDP: shard over the data-parallel
    dimension (every device), no tensor parallelism; a size given stays as given.

    Example:
        >>> fsdp_mesh("auto", "auto", 2), fsdp_mesh("auto", 2, 4), fsdp_mesh(1, "auto", 2)
        ((2, 1), (2, 2), (1, 2))
    """
    if data_parallel == "auto" and tensor_parallel == "auto":
        return devices, 1
    if data_parallel == "auto":
        return max(devices // int(tensor_parallel), 1), tensor_parallel
    if tensor_parallel == "auto":
        return data_parallel, max(devices // int(data_parallel), 1)
    return data_parallel, tensor_parallel


def register(registry: Any = StrategyRegistry) -> None:
    """Register the strategy names once; a name held by another class is an error."""
    register_names(ReplayFSDPStrategy, STRATEGY_NAMES, registry)
