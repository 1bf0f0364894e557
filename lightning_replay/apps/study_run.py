"""The study's runs: one method and seed trained through LightningCLI, its probe scored on the
test split, and the short run that measures the costs the budget comes from.

Each run instantiates the config's trainer, model and data, with the study's strategy (a
:class:`~lightning_replay.strategies.replay.ReplayStrategy` for the replay methods, ``"auto"``
otherwise), its :class:`~lightning_replay.callbacks.replay.ReplayCallback` and
:class:`~lightning_replay.apps.telemetry.StepTelemetry`, its logger and a run directory in
place of the config's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger

from lightning_replay.core.engine import planner as _planner
from lightning_replay.apps.dense_queue import weights_digest
from lightning_replay.apps.study_config import (
    REPLAY_METHODS,
    STATE_AWARE,
    STATE_UNAWARE,
    StudySettings,
    class_path,
    names_subclass,
)
from lightning_replay.apps.telemetry import StepTelemetry
from lightning_replay.callbacks.replay import ReplayCallback
from lightning_replay.core.base.records import RecordStore
from lightning_replay.strategies.replay import ReplayStrategy

__all__ = [
    "Run",
    "fit_run",
    "test_run",
    "measure_budget",
    "result_row",
    "finish_wandb",
    "own_env",
    "quiet_lightning",
]


class _RunCLI(LightningCLI):
    """LightningCLI that instantiates one study run: the config's trainer, model and data, with
    the study's strategy, callbacks, logger and root dir in place of the config's."""

    def __init__(self, args: dict[str, Any], trainer_overrides: dict[str, Any]) -> None:
        self._overrides = trainer_overrides
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=False,
            save_config_callback=None,
            auto_configure_optimizers=False,
        )

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        # the config's own callbacks (less those the study adds itself, see _run_args) first
        configured = self.config_init["trainer"].get("callbacks") or []
        over = dict(self._overrides)
        over["callbacks"] = list(configured) + list(over.get("callbacks", []))
        return super().instantiate_trainer(**{**kwargs, **over})


class _CaptureCosts(Callback):
    """What the cost-measuring run's engine measured, taken as training ends."""

    def __init__(self) -> None:
        self.costs: list | None = None
        self.base = 0
        self.steps_to_first_plan = 0
        self.options: dict[str, list[str]] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.costs = engine.costs
        self.base = engine.base_memory
        self.steps_to_first_plan = engine.steps_to_first_plan
        self.options = {n: c.available_options() for n, c in engine.contracts.items()}


@dataclasses.dataclass
class Run:
    """One trained run of the study: its model, data, trainer and telemetry."""

    method: str
    seed: int
    model: L.LightningModule
    datamodule: L.LightningDataModule
    trainer: L.Trainer
    telemetry: StepTelemetry
    wall_s: float
    run_dir: Path


def _replay_defaults(base: dict[str, Any]) -> dict[str, Any]:
    """init_args of the config's ReplayStrategy / ReplayCallback (or subclasses), if it names
    them."""
    out: dict[str, Any] = {"strategy": {}, "callback": {}}
    strat = base["trainer"].get("strategy")
    if isinstance(strat, dict) and names_subclass(strat.get("class_path"), ReplayStrategy):
        out["strategy"] = dict(strat.get("init_args") or {})
    for cb in base["trainer"].get("callbacks") or []:
        if isinstance(cb, dict) and names_subclass(cb.get("class_path"), ReplayCallback):
            out["callback"] = dict(cb.get("init_args") or {})
    return out


def _run_args(base: dict[str, Any], method: str, seed: int, run_dir: Path) -> dict[str, Any]:
    cfg = copy.deepcopy({k: base[k] for k in ("trainer", "model", "data")})
    cfg["seed_everything"] = seed
    cfg["data"]["init_args"]["seed"] = seed
    cfg["model"]["init_args"]["recompute"] = method if method in STATE_UNAWARE else "none"
    tr = cfg["trainer"]
    tr.pop("strategy", None)
    tr.pop("logger", None)
    # the study adds its own ReplayCallback and StepTelemetry (see fit_run)
    tr["callbacks"] = [
        c
        for c in tr.get("callbacks") or []
        if not (
            isinstance(c, dict)
            and (
                names_subclass(c.get("class_path"), ReplayCallback)
                or names_subclass(c.get("class_path"), StepTelemetry)
            )
        )
    ]
    tr["default_root_dir"] = str(run_dir)
    return cfg


def fit_run(
    base: dict[str, Any],
    settings: StudySettings,
    method: str,
    seed: int,
    run_dir: Path,
    records: Path | None,
    budget: int | None,
    wandb_mode: str,
    group: str,
    max_steps: int | None = None,
    extra_callbacks: Sequence[Callback] = (),
) -> Run:
    """Train ``method`` with ``seed`` as the config ``base`` describes, in ``run_dir``.

    Replay methods record their checks into ``records`` (none if ``None``); budgeted ones plan
    under ``budget``. A wandb run (``wandb_mode``, in ``group``) logs all but a ``max_steps``
    run. The run's effective configuration is written to ``run_dir/run_config.yaml``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    replay = _replay_defaults(base)
    telemetry = StepTelemetry(
        path=run_dir / "telemetry.jsonl", memory_every_n_steps=settings.memory_every_n_steps
    )
    callbacks: list[Callback] = [telemetry, *extra_callbacks]
    overrides: dict[str, Any] = {
        "callbacks": callbacks,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    described: dict[str, Any] = {"method": method, "seed": seed}
    if method in REPLAY_METHODS:
        planner, preservation, budgeted = REPLAY_METHODS[method]
        kwargs = {
            k: v
            for k, v in replay["strategy"].items()
            if k in ("on_violation", "calibration_steps")
        }
        kwargs.update(
            planner=planner, preservation=preservation, budget=budget if budgeted else None
        )
        # The study's budget is set between the methods' lowest feasible budgets in the
        # accountant's terms (what its summary compares): held in those terms, not as the
        # process's real memory (which also holds the optimizer state, the batch, temporaries).
        kwargs["real_peak"] = False
        overrides["strategy"] = ReplayStrategy(**kwargs)
        described["strategy"] = {"class_path": class_path(ReplayStrategy), "init_args": kwargs}
        if records is not None:
            cb_args = {
                k: v
                for k, v in replay["callback"].items()
                if k not in ("records_path", "check_every_n_steps")
            }
            cb_args.update(
                records_path=str(records), check_every_n_steps=settings.check_every_n_steps
            )
            callbacks.append(ReplayCallback(**cb_args))
            described["replay_callback"] = cb_args
    else:
        overrides["strategy"] = "auto"
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    logger = None
    if wandb_mode != "disabled" and max_steps is None:
        logger = WandbLogger(
            project=settings.wandb_project,
            name=f"{method}-seed{seed}",
            group=group,
            job_type="study",
            save_dir=str(run_dir.parent.parent),
            mode=wandb_mode,
            config={"method": method, "seed": seed, "budget": budget},
        )
        overrides["logger"] = logger
    args = _run_args(base, method, seed, run_dir)
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({**args, **described}, sort_keys=False))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = _RunCLI(args, overrides)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # reported in the results instead (checks_skipped), once per method
        warnings.filterwarnings("ignore", message="derivative check skipped")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - t0
    return Run(method, seed, cli.model, cli.datamodule, cli.trainer, telemetry, wall, run_dir)


def test_run(run: Run, base: dict[str, Any]) -> dict[str, Any]:
    """Score the probe on the test split with a plain single-device trainer."""
    tr = base["trainer"]
    trainer = L.Trainer(
        accelerator=tr.get("accelerator", "auto"),
        devices=1,
        precision=tr.get("precision"),
        deterministic=tr.get("deterministic"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(run.run_dir),
    )
    trainer.test(run.model, datamodule=run.datamodule, verbose=False)
    result = getattr(run.model, "test_result", None)
    if not result:
        raise RuntimeError(
            f"{type(run.model).__name__} left no test_result after test(); the "
            "study needs a DenseQueueModule (or a subclass)"
        )
    return result


def result_row(
    run: Run, result: dict[str, Any], records: Path, budget: int | None
) -> dict[str, Any]:
    """A run's row of the results: its test score, encoder digest, replays, check records and
    plan (the comparison with its reference and the steady figures are added later)."""
    engine = getattr(run.trainer.strategy, "engine", None)
    run_id = getattr(run.trainer.strategy, "run_id", None) if engine is not None else None
    rows = run.telemetry.rows
    replays = sum(r.get("replays") or 0 for r in rows)
    plan = None
    if engine is not None and engine.plan is not None:
        plan = {
            "choices": dict(engine.plan.choices),
            "version": engine.plan_version,
            "predicted_peak_bytes": engine.plan.peak_memory,
            "extra_time_s": engine.plan.extra_time,
        }
    return {
        "method": run.method,
        "seed": run.seed,
        "kind": "state-aware" if run.method in STATE_AWARE else "state-unaware",
        "top1": result["top1"],
        "test_images": result["total"],
        "encoder_digest": weights_digest(run.model.encoder_q),
        "replays": replays,
        "records": _records_by_outcome(records, run_id),
        "checks_skipped": engine.checks_skipped if engine is not None else None,
        "budget_bytes": (
            budget if run.method in REPLAY_METHODS and REPLAY_METHODS[run.method].budgeted else None
        ),
        "plan": plan,
        "run_id": run_id,
        "wall_s": run.wall_s,
        "steps": len(rows),
        "run_dir": str(run.run_dir),
        "wandb_dir": None,
    }  # set by finish_wandb


def finish_wandb(run: Run, row: dict[str, Any]) -> None:
    """Put the run's results into its wandb run's summary and finish it (if it has one)."""
    logger = run.trainer.logger
    if not isinstance(logger, WandbLogger):
        return
    exp = logger.experiment
    summary = {
        "study/method": row["method"],
        "study/seed": row["seed"],
        "test/top1": row["top1"],
        "encoder_digest": row["encoder_digest"],
        "replays": row["replays"],
    }
    for k, v in (row.get("records") or {}).items():
        summary[f"records/{k}"] = v
    exp.summary.update(summary)
    run_dir = getattr(exp, "dir", None)
    row["wandb_dir"] = str(Path(run_dir).parent) if run_dir else None
    exp.finish()


def _records_by_outcome(path: Path, run_id: str | None) -> dict[str, int] | None:
    if run_id is None or not path.exists():
        return None
    store = RecordStore(path, run_id=run_id)
    try:
        return store.counts(run_id=run_id, kind="check")  # contract/plan events are no checks
    finally:
        store.close()


# Set by Lightning's DDP launcher even for one process (ReplayStrategy is a DDPStrategy) and by
# seed_everything; one run must not leave them to the next, or to the caller.
_RUN_ENV = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


@contextlib.contextmanager
def own_env() -> Iterator[None]:
    """Put back the launcher and seed variables of the environment a run sets."""
    saved = {k: os.environ.get(k) for k in _RUN_ENV}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def quiet_lightning(enabled: bool) -> Iterator[None]:
    """Lightning's per-trainer banners and known-harmless warnings, off for a study's many runs."""
    if not enabled:
        yield
        return
    names = ["lightning.pytorch", "lightning.fabric", "lightning_replay"]
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*litlogger.*")
        warnings.filterwarnings("ignore", message=".*is smaller than the logging interval.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory.*")
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
        try:
            yield
        finally:
            for n, lvl in levels.items():
                logging.getLogger(n).setLevel(lvl)


#: the cost-measuring run's budget: more bytes than any run holds, so that no option is left
#: untimed for not fitting
_UNBOUNDED = 2**60


def measure_budget(
    base: dict[str, Any], settings: StudySettings, out: Path, seed: int
) -> dict[str, Any]:
    """Measure every segment's options in a short replay run and set the budget from them."""
    cap = _CaptureCosts()
    with own_env():
        # a byte budget nothing reaches: every option is timed (under "min", the engine's
        # default, calibration times only the options the lowest plan can pick)
        run = fit_run(
            base,
            settings,
            "joint",
            seed,
            out / "measure",
            None,
            _UNBOUNDED,
            "disabled",
            "measure",
            max_steps=settings.measure_steps,
            extra_callbacks=[cap],
        )
    costs, basemem = cap.costs, cap.base
    unmeasured = [
        f"{c.name}:{o}"
        for c in costs or []
        for o in cap.options.get(c.name, [])
        if o not in c.options
    ]
    if (not costs or unmeasured) and settings.measure_steps < cap.steps_to_first_plan:
        raise RuntimeError(
            f"study.measure_steps={settings.measure_steps} was too short to "
            f"measure every option (unmeasured: {unmeasured[:4]}); use "
            f"{cap.steps_to_first_plan} or more"
        )
    if not costs or unmeasured:
        raise RuntimeError(
            f"the cost-measuring run ({settings.measure_steps} steps, its first plan at step "
            f"{cap.steps_to_first_plan}) did not measure every option (unmeasured: "
            f"{unmeasured[:4]})"
        )
    mins = {
        m: _planner.min_feasible_budget(costs, basemem, m)
        for m in ("joint", "eager_whole", "retain_all")
    }
    lo = max(mins["joint"], mins["eager_whole"])
    hi = max(mins["retain_all"], lo)
    budget = lo + int(round(settings.budget_fraction * (hi - lo)))
    if settings.budget is not None:
        budget = settings.budget
    del run
    return {
        "bytes": budget,
        "fraction": settings.budget_fraction,
        "explicit": settings.budget is not None,
        "base_memory": basemem,
        "min_feasible": mins,
        "costs": _planner.costs_to_dict(costs),
    }
