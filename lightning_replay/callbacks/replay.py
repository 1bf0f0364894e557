"""ReplayCallback: telemetry, re-planning, sampled checks and records for ``strategy="replay"``.

Every training step it measures peak memory (the CUDA allocator, or the engine's exact byte
accounting on CPU), step time, replays and preserved bytes; reads the records the step wrote;
re-plans when memory, contracts (rejections and divergences) or input shapes call for it (every
rank agrees); requests a derivative and byte-level check on the first step after the probe and
calibration, then every ``check_every_n_steps`` windows; logs ``replay/*`` metrics through
``pl_module.log`` (so CSV, TensorBoard and wandb all see them); and writes one JSON line per step
to ``<default_root_dir>/replay/telemetry.jsonl`` next to the records (what
``lightning-replay report`` plots). At the end of fit, rank 0 prints a short summary: the plan,
the real peak against the budget, the predicted peak against what retaining every segment would
take (both predicted), replays, checks (and those skipped, with why) and where the records are. With a ``WandbLogger`` it also puts the replay settings into the run's config, defines metric
summaries and logs the records and the plan as tables.

Memory is said in four terms, each compared only with its like: the **real peak** (what the
process held: the CUDA allocator's peak, or on CPU the profiler-measured peak of the steps the
engine measures), the **predicted peak** (the plan's), the **budget** (a cap on the real peak)
and **retaining every segment** (predicted from the same measured costs and base as the plan).

A callback carries the Lightning hooks of every user-facing piece (check scheduling, the
re-plan shell over :class:`~lightning_replay.replan.ReplanPolicy`, telemetry, wandb tables, the
end-of-fit summary and its resumable state), hence its length; the decisions are in the core.

Example:
    >>> import lightning as L, lightning_replay
    >>> from lightning_replay import ReplayCallback
    >>> trainer = L.Trainer(strategy="replay", callbacks=[ReplayCallback(check_every_n_steps=10)],
    ...                     accelerator="cpu", devices=1, max_steps=1, logger=False,
    ...                     enable_checkpointing=False, enable_progress_bar=False)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_replay._compat import logger_connector
from lightning_replay.core.engine import planner as _planner
from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.engine.config import (
    DEFAULT_REPLAN_ON,
    REPLAN_ON,
    ReplanSettings,
    check_choices,
    check_count,
)
from lightning_replay.errors import ReplayConfigError
from lightning_replay.loggers.wandb import WandbReplayWriter, plan_rows, wandb_runs
from lightning_replay.core.base.records import CHECKS as _CHECK_KINDS
from lightning_replay.core.base.records import CONTRACT, RECORDS_DIR, Record, default_records_path
from lightning_replay.core.engine.replan import ReplanPolicy, input_shapes, settled
from lightning_replay.strategies.replay import ReplayStrategy
from lightning_replay.strategies.replay_fsdp import ReplayFSDPStrategy

CHECKS = ("grad", "bytes")

_SUM_KEYS = ("replays", "matches", "rejections", "divergences")
_MAX_KEYS = (
    "peak_memory_bytes",
    "real_peak_bytes",  # each rank measures its own process: the largest is logged
    # predicted with each rank's own measured phases (real_base_memory is already agreed)
    "retain_all_predicted_bytes",
    "step_time_ms",
    "preserved_bytes",
    "plan_version",
    "checks_skipped",
)
_STATE_VERSION = 1
_MIB = 2**20

TELEMETRY_FILE = "telemetry.jsonl"


def default_telemetry_path(root_dir: str | os.PathLike) -> str:
    """Where :class:`ReplayCallback` writes its per-step rows:
    ``<root_dir>/replay/telemetry.jsonl``, next to the records.

    Example:
        >>> default_telemetry_path("runs/a").replace(os.sep, "/")
        'runs/a/replay/telemetry.jsonl'
    """
    return os.path.join(os.fspath(root_dir), RECORDS_DIR, TELEMETRY_FILE)


class ReplayCallback(Callback):
    """Telemetry, re-planning, checks and records for :class:`ReplayStrategy`.

    Args:
        check_every_n_steps: request a derivative and byte-level check on every n-th training
            step (window); ``None`` turns checks off.
        checks: which checks: ``"grad"`` (replayed gradients against the retained graph's, bit
            for bit) and/or ``"bytes"`` (digests of contract state and replayed outputs).
        replan_on: what re-plans: ``"memory"`` (measured peak above the budget, or far below
            what the plan predicted), ``"violations"`` (a rejection or a check's divergence:
            once no segment is being probed again), ``"shapes"`` (input shapes changed and
            stayed changed); by default these three. ``"times"`` (asked for by name): once per
            plan, after it ran ``time_patience`` steps, the time its replays add per step by
            the medians now is off what it was planned with by more than ``time_drift`` of the
            larger (calibration times each option on a few steps only).
        records_path: the SQLite records file; default
            ``<trainer.default_root_dir>/replay/records.sqlite``. Rows are appended across
            resumes under one run id.
        log_records: log the records (and the plan) as wandb tables when a ``WandbLogger`` is
            attached.
        memory_headroom: the fraction of the budget that may go unused (or that the measured
            peak may differ from the prediction by) before ``"memory"`` re-plans.
        replan_cooldown_steps: steps between two re-plans for ``"memory"`` or ``"shapes"``.
        shape_patience: steps the new input shapes must persist before ``"shapes"`` re-plans
            (a short last batch does not re-plan).
        time_drift: for ``"times"``: the fraction the plan's added time may move by.
        time_patience: for ``"times"``: the steps a plan runs before its times are judged.
        progress_bar: show, in the progress bar, ``replay/real_peak_MiB`` (the last real peak
            measured: the allocator's on GPU, this step's), ``replay/predicted_MiB`` (the
            plan's predicted peak) and ``replay/saved_MiB`` (how far that prediction is below
            retaining every segment, predicted alike), or ``replay/more_MiB`` when above.
        summary: print the end-of-fit summary (rank 0).

    Raises:
        ReplayConfigError: on a bad argument (the message names it and what is allowed), or at
            setup when the trainer's strategy is not a :class:`ReplayStrategy`.

    When to re-plan is decided by the core's :class:`~lightning_replay.replan.ReplanPolicy`
    (what ``install(replan_on=...)`` runs without Lightning); this callback feeds it the step's
    records and peak, has every rank agree on its reasons, and re-plans through the strategy
    (rank 0 plans, every rank adopts its plan).

    Checks run on the first step once every segment has a contract and a plan is in force,
    then on every ``check_every_n_steps``-th step, so that even a short run checks its replays.

    Metrics go through ``pl_module.log`` on the steps Lightning hands to its loggers
    (``log_every_n_steps``, read from the trainer's logger connector: a Lightning internal,
    hence the ``lightning<2.7`` pin), on the last step, and whenever a rejection, a divergence
    or a new plan appears; :attr:`last_metrics` has every step's values.

    Example:
        >>> cb = ReplayCallback(check_every_n_steps=25, checks=("grad",), replan_on=("memory",))
        >>> cb.checks, cb.replan_on
        (('grad',), ('memory',))
    """

    def __init__(
        self,
        check_every_n_steps: int | None = 50,
        checks: Sequence[str] | str = CHECKS,
        replan_on: Sequence[str] | str = DEFAULT_REPLAN_ON,
        records_path: str | os.PathLike | None = None,
        log_records: bool = True,
        memory_headroom: float = 0.25,
        replan_cooldown_steps: int = 10,
        shape_patience: int = 2,
        time_drift: float = 0.25,
        time_patience: int = 8,
        progress_bar: bool = False,
        summary: bool = True,
    ) -> None:
        call = "ReplayCallback"
        self.check_every_n_steps = check_count(
            call, "check_every_n_steps", check_every_n_steps, none="no checks"
        )
        self.checks = check_choices(
            call,
            "checks",
            checks,
            CHECKS,
            allow_empty=False,
            empty_hint=", or check_every_n_steps=None for no checks",
        )
        #: When to re-plan (validated here; the policy itself is the core's).
        self.replan_settings = ReplanSettings(
            replan_on=replan_on,
            replan_cooldown_steps=replan_cooldown_steps,
            memory_headroom=memory_headroom,
            shape_patience=shape_patience,
            time_drift=time_drift,
            time_patience=time_patience,
            caller=call,
        )
        self._policy = ReplanPolicy(self.replan_settings)
        self.records_path = None if records_path is None else _check_records_path(records_path)
        if not isinstance(log_records, bool):
            raise ReplayConfigError(f"ReplayCallback(log_records={log_records!r}) must be a bool")
        self.log_records = log_records
        for name, flag in (("progress_bar", progress_bar), ("summary", summary)):
            if not isinstance(flag, bool):
                raise ReplayConfigError(f"ReplayCallback({name}={flag!r}) must be a bool")
        self.progress_bar = progress_bar
        self.summary = summary
        self.counters: dict[str, int] = dict.fromkeys(("matches", "rejections", "divergences"), 0)
        self.record_seq = 0
        self.last_metrics: dict[str, float] = {}
        self._strategy: ReplayStrategy | None = None
        self._loaded: dict[str, Any] | None = None
        self._t0 = 0.0
        self._replays_total = 0
        self._logged_events: dict[str, float] = {}
        self._writers: list[WandbReplayWriter] = []
        self._logged_plan_version = -1
        self._telemetry: Any = None
        self.telemetry_path: str | None = None
        self._checked_first = False
        self._checked_steps = 0
        self._check_owed: tuple[int, Any] | None = None  # (plan version, budget) at a skip
        self._skipped_before = 0
        self._steady_peak: int | None = None
        self._real_peak: tuple[int, int] | None = None  # (step, bytes): largest settled
        self._settled_at: int | None = None
        self._retain_all_peak: int | None = None
        self._retain_all_accounted: int | None = None
        self.fit_summary: dict[str, Any] | None = None
        """What the end-of-fit summary says, as data (set at the end of fit)."""

    replan_on = property(lambda self: self.replan_settings.replan_on)
    memory_headroom = property(lambda self: self.replan_settings.memory_headroom)
    replan_cooldown_steps = property(lambda self: self.replan_settings.replan_cooldown_steps)
    shape_patience = property(lambda self: self.replan_settings.shape_patience)
    time_drift = property(lambda self: self.replan_settings.time_drift)
    time_patience = property(lambda self: self.replan_settings.time_patience)

    @property
    def replans(self) -> int:
        """Re-plans made so far (across resumes)."""
        return self._policy.replans

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, (ReplayStrategy, ReplayFSDPStrategy)):
            raise ReplayConfigError(
                f"ReplayCallback needs Trainer(strategy='replay') (a ReplayStrategy); this "
                f"trainer uses {type(strategy).__name__}. Add `import lightning_replay` and "
                "pass strategy='replay'."
            )
        path = self.records_path or default_records_path(trainer.default_root_dir)
        _check_records_path(path)
        strategy.configure_records(path, default=self.records_path is None)
        self._strategy = strategy
        if self._loaded is not None:
            self._apply_loaded()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._require_strategy()
        engine = strategy.engine
        store = engine.records
        # Counters count this rank's checks in this run; with a records file they are
        # recounted from it, so a resume continues from what is really there.
        if store.path is not None or self._loaded is None:
            rows = store.read(run_id=store.run_id)
            self.counters = _count(r for r in rows if r.rank == store.rank)
            self.record_seq = max((r.seq for r in rows), default=0)
        else:
            self.record_seq = 0  # a fresh in-memory store starts again at 1
        self._loaded = None
        self._replays_total = sum(s["replays"] for s in engine.summary().values())
        self._checked_first = False
        self._checked_steps = 0
        self._check_owed = None
        self._skipped_before = engine.checks_skipped
        self._steady_peak = None
        self._real_peak = None
        self._settled_at = None
        self._retain_all_peak = None
        self._retain_all_accounted = None
        self.fit_summary = None
        self._writers = []
        if trainer.is_global_zero:
            writers = [WandbReplayWriter(run) for run in wandb_runs(trainer.loggers)]
            for w in writers:
                w.log_config(self.settings(strategy))
            if self.log_records:
                self._writers = writers
                for w in self._writers:
                    w.define_metrics()
            self.telemetry_path = default_telemetry_path(trainer.default_root_dir)
            os.makedirs(os.path.dirname(self.telemetry_path), exist_ok=True)
            # appended across fits and resumes: rows carry the run id, the report picks one
            self._telemetry = open(self.telemetry_path, "a", encoding="utf-8")

    def settings(self, strategy: ReplayStrategy | None = None) -> dict[str, Any]:
        """The strategy's and this callback's settings, JSON-safe: what goes into a wandb run's
        config under ``replay`` (so runs can be grouped and filtered by them)."""
        strategy = strategy or self._require_strategy()
        engine = strategy.engine
        preservation = strategy.preservation
        return {
            "budget": _budget_text(strategy),
            "budget_bytes": _resolved_budget(engine),
            "planner": strategy.planner,
            "preservation": (
                dict(preservation) if isinstance(preservation, Mapping) else preservation
            ),
            "on_violation": strategy.on_violation,
            "calibration_steps": strategy.calibration_steps,
            "segments": list(engine.segments) if engine is not None else [],
            "world_size": strategy.world_size,
            "check_every_n_steps": self.check_every_n_steps,
            "checks": list(self.checks),
            "replan_on": list(self.replan_on),
            "memory_headroom": self.memory_headroom,
        }

    # ------------------------------------------------------------------ every step
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._require_strategy().engine
        owed = self._check_owed is not None and self._check_owed != (
            engine.plan_version,
            engine.budget,
        )
        if self.check_every_n_steps and (
            (engine.step + 1) % self.check_every_n_steps == 0
            or (not self._checked_first and settled(engine))
            or owed
        ):
            # the first settled step too: a run shorter than check_every_n_steps still checks;
            # and a derivative check skipped for want of room is asked again once the plan or
            # the budget has changed (it may fit then)
            self._checked_first = True
            self._check_owed = None
            self._skipped_before = engine.checks_skipped
            engine.request_check(grad="grad" in self.checks, bytes="bytes" in self.checks)
        if self._policy.observe_shapes(input_shapes(batch)):
            # The re-plan at this step's end needs activation bytes at the new shapes: a
            # checked step measures them (the probe's figures are for the old shapes).
            engine.request_check(grad=True, bytes="bytes" in self.checks)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        strategy = self._require_strategy()
        engine = strategy.engine
        stats = engine.window_stats()
        peak = stats["peak_bytes"] or 0
        step_ms = (time.perf_counter() - self._t0) * 1000.0
        summary = engine.summary()
        replays_total = sum(s["replays"] for s in summary.values())
        replays, self._replays_total = replays_total - self._replays_total, replays_total

        store = engine.records
        new = store.read(run_id=store.run_id, since_seq=self.record_seq)
        if new:
            self.record_seq = max(r.seq for r in new)
        mine = [r for r in new if r.rank == store.rank]
        for k, v in _count(mine).items():
            self.counters[k] += v

        wants = self._policy.reasons(
            engine,
            violations=any(r.is_check and r.outcome in ("rejection", "divergence") for r in mine),
            peak=peak,
            checked=bool(stats["checked"]),
        )
        local = {
            "replays": replays,
            **self.counters,
            "peak_memory_bytes": peak,
            "real_peak_bytes": stats.get("real_peak_bytes") or 0,
            "step_time_ms": step_ms,
            "preserved_bytes": sum(s["preserved_bytes"] for s in summary.values()),
            "plan_version": engine.plan_version,
            # checked steps whose derivative check did not fit the budget
            "checks_skipped": engine.checks_skipped,
            "retain_all_predicted_bytes": self._retain_all(engine) or 0,
        }
        totals, votes = _reduce(strategy, local, [r in wants for r in REPLAN_ON])
        real_peak = totals.pop("real_peak_bytes")  # logged in MiB with the other memory terms
        retain_all = int(totals.pop("retain_all_predicted_bytes")) or None
        reasons = [r for r, v in zip(REPLAN_ON, votes) if v]
        if reasons:
            self._replan(trainer, strategy, reasons)
            totals["plan_version"] = engine.plan_version
        self.last_metrics = totals
        checked = bool(stats["checked"]) or any(r.check in _CHECK_KINDS for r in mine)
        if engine.checks_skipped > self._skipped_before:
            self._skipped_before = engine.checks_skipped
            self._check_owed = (engine.plan_version, engine.budget)
        self._checked_steps += checked
        if settled(engine):
            if self._settled_at is None:
                self._settled_at = engine.step
            if not checked and peak:
                self._steady_peak = max(self._steady_peak or 0, peak)
        self._note_real_peak(engine, stats, checked)
        if self._telemetry is not None:
            self._write_telemetry(
                trainer, engine, stats, peak, step_ms, replays, new, checked, retain_all
            )
        if self.progress_bar:
            for name, value in progress_bar_metrics(
                real_peak=stats.get("real_peak_bytes"),
                predicted=stats.get("predicted_peak_bytes"),
                retain_all=retain_all,
            ).items():
                pl_module.log(
                    name,
                    float(value),
                    prog_bar=True,
                    logger=False,
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                )
        # self.log costs about a millisecond per metric: log on the steps Lightning passes to
        # the loggers (log_every_n_steps; it would drop the others), on the last step, and
        # whenever a rejection, a divergence or a new plan appears.
        events = {k: totals[k] for k in ("rejections", "divergences", "plan_version")}
        if (
            logger_connector(trainer).should_update_logs
            or events != self._logged_events
            or _is_last_step(trainer, batch_idx)
        ):
            self._logged_events = events
            mib = {
                "peak_memory_mib": totals["peak_memory_bytes"] / _MIB,
                "preserved_mib": totals["preserved_bytes"] / _MIB,
            }
            # the four memory terms, each under its own name (see the module docstring)
            for name, value in (
                ("real_peak_mib", real_peak),
                ("predicted_peak_mib", stats.get("predicted_peak_bytes")),
                ("retain_all_predicted_mib", retain_all),
                ("budget_mib", engine.budget or (engine.plan.budget if engine.plan else None)),
            ):
                if value:
                    mib[name] = value / _MIB
            for name, value in {**totals, **mib}.items():
                # float64: byte counts stay exact (float32 rounds above 16 MiB).
                pl_module.log(
                    f"replay/{name}",
                    torch.tensor(float(value), dtype=torch.float64),
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                    sync_dist=False,
                )

        if self._writers:
            self._log_wandb(trainer, engine, new)

    def _replan(self, trainer: pl.Trainer, strategy: ReplayStrategy, reasons: list[str]) -> None:
        engine = strategy.engine
        out = self._policy.replan(engine, reasons, replan=strategy.replan)
        if out.error is not None:
            rank_zero_warn(
                f"ReplayCallback: re-plan ({', '.join(reasons)}) failed, keeping "
                f"plan v{engine.plan_version}: {out.error}"
            )
        elif out.changed:
            rank_zero_info(
                f"ReplayCallback: re-planned ({', '.join(reasons)}) at step "
                f"{engine.step}: plan v{engine.plan_version} {out.plan.choices}"
            )

    def _log_wandb(self, trainer: pl.Trainer, engine: Any, new: list[Record]) -> None:
        step = trainer.global_step
        plan_changed = engine.plan is not None and engine.plan_version != self._logged_plan_version
        for w in self._writers:
            w.add_records(new)
            if plan_changed or (trainer.global_step % max(trainer.log_every_n_steps, 1) == 0):
                w.flush_records(step)
            if plan_changed:
                # "min" resolves to bytes only once the first plan is made
                w.log_config({**self.settings(), "budget_bytes": _resolved_budget(engine)})
                w.log_plan(
                    plan_rows(engine.plan_version, engine.plan.choices, engine.summary()), step
                )
        if plan_changed:
            self._logged_plan_version = engine.plan_version

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._require_strategy().engine
        if self._writers:
            new = engine.records.read(run_id=engine.records.run_id, since_seq=self.record_seq)
            if new:
                self.record_seq = max(r.seq for r in new)
            for w in self._writers:
                w.add_records(new)
                w.flush_records(trainer.global_step)
        self._close_telemetry()
        self.fit_summary = self._fit_summary(trainer, engine)
        if self.summary and trainer.is_global_zero:
            rank_zero_info(format_fit_summary(self.fit_summary))

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close_telemetry()

    # ------------------------------------------------------------------ telemetry, summary
    def _retain_all(self, engine: Any) -> int | None:
        """Predicted peak with every segment retained, by the measured costs and on the plan's
        own base (:attr:`~lightning_replay.engine.ReplayEngine.real_base_memory`), so that it
        compares with the plan's predicted peak; the same in the accountant's terms is kept
        for the accounted telemetry."""
        costs = engine.costs if engine.plan is not None else None
        if not costs:
            return self._retain_all_peak
        retain = {c.name: "retain" for c in costs}
        try:
            self._retain_all_peak = _planner.predicted_peak(
                costs, retain, engine.real_base_memory, **engine.phase_peak_args
            )
            self._retain_all_accounted = _planner.predicted_peak(costs, retain, engine.base_memory)
        except (KeyError, ValueError):  # a segment without a measured retain option
            pass
        return self._retain_all_peak

    def _note_real_peak(self, engine: Any, stats: Mapping[str, Any], checked: bool) -> None:
        """Keep the largest real peak of a step run with a plan in force and no check (the
        allocator's for this step on GPU; on CPU the profiler's, for the step it measured)."""
        if self._settled_at is None:
            return
        if engine.peak_is_allocator:
            step, real = (None if checked else engine.step), stats.get("peak_bytes")
        else:
            step, real = stats.get("real_peak_step"), stats.get("real_peak_bytes")
        if step is None or not real or step < self._settled_at:
            return
        if self._real_peak is None or real > self._real_peak[1]:
            self._real_peak = (int(step), int(real))

    def _write_telemetry(
        self,
        trainer: pl.Trainer,
        engine: Any,
        stats: Mapping[str, Any],
        peak: int,
        step_ms: float,
        replays: int,
        new: list[Record],
        checked: bool,
        retain_all: int | None,
    ) -> None:
        plan = {n: s["mode"] for n, s in engine.summary().items()}
        for r in new:  # a segment probed in this step ran retained, under discovery
            if r.check == CONTRACT and r.segment in plan:
                plan[r.segment] = "probe"
        row = {
            "run_id": engine.records.run_id,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "window": engine.step,
            "step_time_ms": step_ms,
            "peak_bytes": peak or None,
            "memory": "cuda"
            if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda"
            else "accounted",
            "accounted_peak_bytes": stats.get("accounted_peak_bytes"),
            "predicted_peak_bytes": (engine.plan.peak_memory if engine.plan is not None else None),
            "retain_all_peak_bytes": retain_all,
            # the real peak of the last step measured (allocator on GPU: this step's)
            "real_peak_bytes": stats.get("real_peak_bytes"),
            "real_peak_step": stats.get("real_peak_step"),
            "budget": engine.budget,
            "plan_budget": _resolved_budget(engine),  # "min" resolved: the lowest plan's
            "plan_version": engine.plan_version,
            "plan": plan,
            "replays": replays,
            "preserved_bytes": stats.get("preserved_bytes"),
            "checked": checked,
            "checks_skipped": engine.checks_skipped,
            "records": {
                o: sum(1 for r in new if r.is_check and r.outcome == o)
                for o in ("match", "rejection", "divergence")
            },
        }
        self._telemetry.write(json.dumps(row) + "\n")
        self._telemetry.flush()

    def _close_telemetry(self) -> None:
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None

    def _fit_summary(self, trainer: pl.Trainer, engine: Any) -> dict[str, Any]:
        m = self.last_metrics
        summary = engine.summary()
        choices = dict(engine.plan.choices) if engine.plan is not None else {}
        return {
            "run_id": engine.records.run_id,
            "steps": engine.step,
            "plan_version": engine.plan_version,
            "planner": engine.planner,
            "budget": engine.budget,
            "segments": {
                n: {
                    "option": choices.get(n, s["mode"]),
                    "contract_version": s.get("contract_version"),
                    "replays": s.get("replays", 0),
                }
                for n, s in summary.items()
            },
            "real_peak_bytes": self._real_peak[1] if self._real_peak else None,
            "real_peak_step": self._real_peak[0] if self._real_peak else None,
            "real_peak_source": "allocator" if engine.peak_is_allocator else "profiler",
            "predicted_peak_bytes": engine.plan.peak_memory if engine.plan is not None else None,
            "retain_all_peak_bytes": self._retain_all_peak,
            "lowest_plan_bytes": _lowest_plan(engine),
            "accounted_peak_bytes": self._steady_peak,
            "retain_all_accounted_bytes": self._retain_all_accounted,
            "replays": int(sum(s.get("replays", 0) for s in summary.values())),
            "checked_steps": self._checked_steps,
            "check_every_n_steps": self.check_every_n_steps,
            "matches": int(m.get("matches", 0)),
            "divergences": int(m.get("divergences", 0)),
            "rejections": int(m.get("rejections", 0)),
            "checks_skipped": int(m.get("checks_skipped", 0)),
            "checks_skipped_reason": getattr(engine, "checks_skipped_reason", None),
            "records_path": engine.records.path,
            "telemetry_path": self.telemetry_path,
            "root_dir": trainer.default_root_dir,
        }

    # ------------------------------------------------------------------ resumable state
    @override
    def state_dict(self) -> dict[str, Any]:
        strategy = self._strategy
        engine_state = strategy.engine_state_dict() if strategy is not None else None
        return {
            "version": _STATE_VERSION,
            "run_id": strategy.run_id if strategy is not None else None,
            "record_seq": self.record_seq,
            "counters": dict(self.counters),
            "replans": self.replans,
            "plan_version": engine_state["plan_version"] if engine_state else 0,
            "engine": engine_state,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ReplayConfigError(
                f"ReplayCallback state has version {state_dict.get('version')!r}; this "
                f"lightning_replay reads version {_STATE_VERSION}. Resume without the "
                "callback's state (it re-probes and re-plans) or with a matching version."
            )
        self._loaded = dict(state_dict)
        self.record_seq = int(state_dict["record_seq"])
        self.counters = {k: int(state_dict["counters"].get(k, 0)) for k in self.counters}
        self._policy.replans = int(state_dict.get("replans", 0))
        if self._strategy is not None:
            self._apply_loaded()

    def _apply_loaded(self) -> None:
        state = self._loaded
        strategy = self._strategy
        if state.get("run_id"):
            strategy.run_id = state["run_id"]
        if state.get("engine"):
            strategy.load_engine_state_dict(state["engine"])

    def _require_strategy(self) -> ReplayStrategy:
        if self._strategy is None or self._strategy.engine is None:
            raise ReplayConfigError(
                "ReplayCallback is not set up: it runs inside trainer.fit() with strategy='replay'"
            )
        return self._strategy


# ---------------------------------------------------------------------- helpers
def format_fit_summary(s: Mapping[str, Any]) -> str:
    """The end-of-fit block :class:`ReplayCallback` prints (from :attr:`~ReplayCallback.fit_summary`).

    Memory is said in four terms, each compared only with its like: the real peak with the
    budget it is held to, the plan's predicted peak with retaining every segment (predicted
    alike). A saving below zero is said as "more".

    Example:
        >>> MiB = 2**20
        >>> print(format_fit_summary({"run_id": "ab12", "steps": 48, "plan_version": 1,
        ...     "planner": "joint", "budget": 12 * MiB,
        ...     "segments": {"blocks.0": {"option": "regions", "contract_version": 1,
        ...                               "replays": 47}},
        ...     "real_peak_bytes": 8 * MiB, "real_peak_step": 3, "real_peak_source": "profiler",
        ...     "predicted_peak_bytes": 9 * MiB, "retain_all_peak_bytes": 12 * MiB,
        ...     "replays": 47, "checked_steps": 1, "check_every_n_steps": 50, "matches": 2,
        ...     "divergences": 0, "rejections": 0, "checks_skipped": 0,
        ...     "records_path": "runs/replay/records.sqlite", "root_dir": "runs"}))
        lightning_replay: 48 steps, run ab12, plan v1 (joint, budget 12.00 MiB)
          blocks.0  regions  contract v1  47 replays
          real peak 8.00 MiB (budget 12.00 MiB; profiler, step 3)
          predicted peak 9.00 MiB vs 12.00 MiB retaining every segment (predicted): 3.00 MiB (25%) saved
          replays 47; checks on 1 step (first settled step, then every 50): 2 matched, 0 diverged; 0 rejections
          records runs/replay/records.sqlite (lightning-replay records runs --summary; report: lightning-replay report runs)
    """
    budget = s.get("budget")
    lines = [
        f"lightning_replay: {s['steps']} steps, run {s['run_id']}, plan "
        f"v{s['plan_version']} ({s['planner']}, "
        f"{'budget ' + format_bytes(budget) if budget else 'lowest-memory plan'})"
    ]
    segs = s.get("segments") or {}
    width = max((len(n) for n in segs), default=0)
    owidth = max((len(str(d["option"])) for d in segs.values()), default=0)
    for name, d in segs.items():
        lines.append(
            f"  {name.ljust(width)}  {str(d['option']).ljust(owidth)}  contract "
            f"v{d['contract_version']}  {d['replays']} replays"
        )
    lines.extend(_memory_lines(s))
    n = s.get("check_every_n_steps")
    cadence = f"first settled step, then every {n}" if n else "checks off"
    step_word = "step" if s["checked_steps"] == 1 else "steps"
    lines.append(
        f"  replays {s['replays']}; checks on {s['checked_steps']} {step_word} "
        f"({cadence}): {s['matches']} matched, {s['divergences']} diverged; "
        f"{s['rejections']} rejections"
    )
    skipped = int(s.get("checks_skipped") or 0)
    if skipped:
        reason = s.get("checks_skipped_reason") or "did not fit the budget"
        lines.append(
            f"  {skipped} derivative check{'s' if skipped != 1 else ''} skipped ({reason})"
        )
    where = s.get("records_path")
    root = s.get("root_dir")
    if where:
        lines.append(
            f"  records {where} (lightning-replay records {root} --summary; report: "
            f"lightning-replay report {root})"
        )
    else:
        lines.append(
            "  records kept in memory (pass ReplayCallback(records_path=...) to keep them)"
        )
    return "\n".join(lines)


def _memory_lines(s: Mapping[str, Any]) -> list[str]:
    """The summary's memory lines: real peak beside the budget; predicted beside predicted."""
    lines = []
    budget = s.get("budget")
    real = s.get("real_peak_bytes")
    source = s.get("real_peak_source") or "measured"
    limit = f"budget {format_bytes(budget)}" if budget else "no budget: lowest-memory plan"
    if real:
        at = f", step {s['real_peak_step']}" if s.get("real_peak_step") is not None else ""
        over = " - above the budget" if budget and real > budget else ""
        lines.append(f"  real peak {format_bytes(real)} ({limit}; {source}{at}){over}")
    else:
        lines.append(f"  real peak: not measured on a step with a plan in force ({limit})")
    predicted, full = s.get("predicted_peak_bytes"), s.get("retain_all_peak_bytes")
    if predicted and full:
        lines.append(
            f"  predicted peak {format_bytes(predicted)} vs {format_bytes(full)} retaining "
            f"every segment (predicted): {_saving(full - predicted, full)}"
        )
    elif predicted:
        lines.append(f"  predicted peak {format_bytes(predicted)}")
    else:
        lines.append("  predicted peak: n/a (no plan was made)")
    options = [str(d.get("option")) for d in (s.get("segments") or {}).values()]
    if options and all(o == "retain" for o in options) and budget:
        lowest = s.get("lowest_plan_bytes")
        lowest_text = f" (the lowest-memory plan predicts {format_bytes(lowest)})" if lowest else ""
        lines.append(
            f"  nothing is recomputed: the budget ({format_bytes(budget)}) holds every "
            "segment's activations. To trade step time for memory set a lower budget, e.g. "
            f'ReplayStrategy(budget="{_suggest_budget(lowest, predicted)}") or '
            f'budget="min"{lowest_text}.'
        )
    return lines


def _saving(saved: int, of: int) -> str:
    """``'3.00 MiB (25%) saved'``, or ``'... more'`` below zero: never a bare negative."""
    return f"{format_bytes(abs(saved))} ({abs(saved) / of:.0%}) {'saved' if saved >= 0 else 'more'}"


def _suggest_budget(lowest: int | None, predicted: int | None) -> str:
    """A budget between the lowest-memory plan and retaining everything, rounded up to a
    whole KiB, MiB or GiB as its size reads best.

    Example:
        >>> _suggest_budget(100 * 2**10, 112 * 2**10), _suggest_budget(7 * 2**20, 11 * 2**20)
        ('106KiB', '9MiB')
    """
    if lowest and predicted and predicted > lowest:
        target = (lowest + predicted) // 2
    else:
        target = lowest or 512 * _MIB
    for unit, size in (("GiB", 2**30), ("MiB", _MIB), ("KiB", 2**10)):
        if target >= size or unit == "KiB":
            return f"{-(-target // size)}{unit}"
    return f"{target}B"  # pragma: no cover


def _lowest_plan(engine: Any) -> int | None:
    """The lowest-memory plan's predicted peak for the measured costs (None before costs)."""
    costs = engine.costs if engine.plan is not None else None
    if not costs:
        return None
    try:
        return int(
            _planner.min_feasible_budget(
                costs, engine.real_base_memory, engine.planner, **engine.phase_peak_args
            )
        )
    except (KeyError, ValueError, _planner.InfeasibleBudget):
        return None


def progress_bar_metrics(
    real_peak: int | None, predicted: int | None, retain_all: int | None
) -> dict[str, float]:
    """What ``ReplayCallback(progress_bar=True)`` shows, in MiB: the real peak, the predicted
    peak, and the prediction's saving against retaining every segment (predicted alike) as
    ``saved_MiB``, or ``more_MiB`` when the plan is predicted to hold more; never negative.

    Example:
        >>> progress_bar_metrics(8 * 2**20, 9 * 2**20, 12 * 2**20)
        {'replay/real_peak_MiB': 8.0, 'replay/predicted_MiB': 9.0, 'replay/saved_MiB': 3.0}
        >>> progress_bar_metrics(None, 2 * 2**20, 2**20)
        {'replay/predicted_MiB': 2.0, 'replay/more_MiB': 1.0}
    """
    bar: dict[str, float] = {}
    if real_peak:
        bar["replay/real_peak_MiB"] = real_peak / _MIB
    if predicted:
        bar["replay/predicted_MiB"] = predicted / _MIB
        if retain_all:
            saved = retain_all - predicted
            bar["replay/saved_MiB" if saved >= 0 else "replay/more_MiB"] = abs(saved) / _MIB
    return bar


def _budget_text(strategy: Any) -> str:
    """The budget as the strategy takes it: ``'1.00 GiB'``, ``'0.5 of device memory'``,
    ``'min'``; no budget is the default, said as what it means on this device."""
    budget = strategy.budget
    if getattr(budget, "is_none", False):
        on_gpu = strategy.root_device.type == "cuda"
        return "default: 0.9 of device memory" if on_gpu else "default: min"
    return str(budget)


def _resolved_budget(engine: Any) -> int | None:
    """The budget in bytes the plan is held to: the resolved budget, or for ``"min"`` the
    lowest-memory plan's own (None until that plan is made)."""
    if engine is None:
        return None
    if engine.budget:
        return int(engine.budget)
    plan = engine.plan
    return int(plan.budget) if plan is not None and plan.budget else None


def _count(records: Iterable[Record]) -> dict[str, int]:
    out = {"matches": 0, "rejections": 0, "divergences": 0}
    for r in records:
        if r.is_event and r.outcome == "match":
            continue
        out[
            {"match": "matches", "rejection": "rejections", "divergence": "divergences"}[r.outcome]
        ] += 1
    return out


def _is_last_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the fit loop stops after this batch (max_steps, max_epochs or should_stop)."""
    if trainer.should_stop:
        return True
    if (
        trainer.max_steps is not None
        and trainer.max_steps >= 0
        and trainer.global_step >= trainer.max_steps
    ):
        return True
    max_epochs = trainer.max_epochs
    return (
        max_epochs is not None
        and max_epochs >= 0
        and trainer.current_epoch + 1 >= max_epochs
        and batch_idx + 1 >= trainer.num_training_batches
    )


def _reduce(
    strategy: ReplayStrategy, local: Mapping[str, float], votes: list[bool]
) -> tuple[dict[str, float], list[bool]]:
    """Sum counts and votes, max sizes and times, across ranks (two all-reduces)."""
    if strategy.world_size <= 1 or not torch.distributed.is_initialized():
        return dict(local), votes
    device = strategy.root_device
    sums = torch.tensor(
        [float(local[k]) for k in _SUM_KEYS] + [float(v) for v in votes],
        dtype=torch.float64,
        device=device,
    )
    maxes = torch.tensor([float(local[k]) for k in _MAX_KEYS], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM)
    torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
    out = dict(zip(_SUM_KEYS, sums.tolist()))
    out.update(zip(_MAX_KEYS, maxes.tolist()))
    return out, [v > 0 for v in sums.tolist()[len(_SUM_KEYS) :]]


def _check_records_path(path: Any) -> str:
    """A records path that can be created and written, without creating anything."""
    if not isinstance(path, (str, os.PathLike)):
        raise ReplayConfigError(f"ReplayCallback(records_path={path!r}) must be a path")
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise ReplayConfigError(
            f"records path {path!r} is a directory; name a file such as "
            f"{os.path.join(path, 'records.sqlite')!r}"
        )
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ReplayConfigError(f"records path {path!r} exists but is not writable")
        return path
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ReplayConfigError(
            f"records path {path!r} cannot be created: {parent!r} is not a "
            "writable directory. Pass records_path= to a writable place."
        )
    return path
