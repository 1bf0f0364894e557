"""The seven-method comparison on the dense-queue application.

Every method trains the same :class:`~lightning_replay.apps.dense_queue.DenseQueueModule` on the
same segments, data and seed, then scores the linear probe on the test split:

========================  ====================================================================
``none``                  no recomputation (the reference; exact by definition)
``torch_checkpoint``      ``torch.utils.checkpoint`` on the segments (state-unaware)
``torch_sac``             torch's selective activation checkpointing, saving matmuls
                          (state-unaware)
``whole``                 ``strategy="replay"``, every segment preserves changing state whole
                          (planner ``whole_all``)
``regions``               ``strategy="replay"``, every segment preserves only the overwritten
                          regions where it can (planner ``fixed_regions``)
``eager_whole``           ``strategy="replay"`` under a budget, greedy over retain/whole
``joint``                 ``strategy="replay"`` under the same budget, the optimal planner
========================  ====================================================================

The budget of ``eager_whole`` and ``joint`` comes from measured costs: a short run under
``strategy="replay"`` measures every segment's options (bytes exactly, time as medians), then
``budget = lo + budget_fraction * (hi - lo)`` with ``lo`` the larger of the two methods'
minimum feasible budgets and ``hi`` the minimum feasible budget of retaining everything — a
budget both methods can meet and that still forces recomputation.

The state-aware methods (``none``, ``whole``, ``regions``, ``eager_whole``, ``joint``) must
give byte-identical test scores and encoder weights within each seed; the result table says
whether they did, and how the state-unaware ones diverged (test top-1 difference, which
encoder tensors differ and by how much, batch-norm counters advanced by replays).

Outputs under ``output_dir``: ``results.md``, ``results.csv``, ``results.json``,
``report.html`` (with ``plots/``), ``records.sqlite`` (every run's records, by run id),
``wandb/`` (one run per method and seed; offline unless configured), and ``runs/<method>-seed<k>/``
(per-step ``telemetry.jsonl`` and the run's effective configuration).

Example:
    >>> cfg = load_study_config(DEMO_CONFIG)
    >>> StudySettings.from_config(cfg).methods
    ['none', 'torch_checkpoint', 'torch_sac', 'whole', 'regions', 'eager_whole', 'joint']
"""
from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import yaml

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI

from lightning_replay import planner as _planner
from lightning_replay.budget import format_bytes, parse_budget
from lightning_replay.callbacks.replay import ReplayCallback
from lightning_replay.records import OUTCOMES, RecordStore
from lightning_replay.strategies.replay import ReplayStrategy
from lightning_replay.apps.dense_queue import weights_digest
from lightning_replay.apps.telemetry import StepTelemetry

__all__ = ["METHODS", "STATE_AWARE", "STATE_UNAWARE", "DEMO_CONFIG", "StudySettings",
           "StudyResult", "load_study_config", "run_study", "measure_budget",
           "describe_divergence", "format_markdown"]

METHODS = ("none", "torch_checkpoint", "torch_sac", "whole", "regions", "eager_whole", "joint")
STATE_AWARE = ("none", "whole", "regions", "eager_whole", "joint")
STATE_UNAWARE = ("torch_checkpoint", "torch_sac")

#: One line per method, for the results and the report.
METHOD_DESCRIPTIONS = {
    "none": "no recomputation: every activation kept (the reference; exact by definition)",
    "torch_checkpoint": "torch.utils.checkpoint on every segment (state-unaware)",
    "torch_sac": "torch's selective activation checkpointing, saving matmul outputs and "
                 "recomputing the rest (state-unaware)",
    "whole": "strategy='replay', every segment replayed, changing state preserved whole "
             "(planner whole_all)",
    "regions": "strategy='replay', every segment replayed, only the overwritten regions "
               "preserved where it can (planner fixed_regions)",
    "eager_whole": "strategy='replay' under the budget, greedy over retain/whole, best bytes "
                   "saved per second added first (planner eager_whole)",
    "joint": "strategy='replay' under the same budget, the optimal plan over every option "
             "(planner joint)",
}


def format_top1(value: float | None) -> str:
    """Test top-1 for people: ``0.0860000029206276`` -> ``'8.60 %'`` (results.json keeps the
    exact float, which the byte-identity verdicts compare).

    Example:
        >>> format_top1(0.0860000029206276)
        '8.60 %'
    """
    return "n/a" if value is None else f"{100 * value:.2f} %"
# method -> (planner, preservation before the first plan, runs under the measured budget)
_REPLAY = {"whole": ("whole_all", "whole", False), "regions": ("fixed_regions", "regions", False),
           "eager_whole": ("eager_whole", "auto", True), "joint": ("joint", "auto", True)}
_DENSE_QUEUE = "lightning_replay.apps.dense_queue.DenseQueueModule"
_DENSE_QUEUE_DATA = "lightning_replay.apps.dense_queue.DenseQueueDataModule"

#: The embedded default: ``python -m lightning_replay.demos.demo`` and ``configs/dense_queue_cpu.yaml``.
#: Small sizes for 2 CPU cores: a ResNet with one block per stage at width 16 on a synthetic
#: CIFAR-100 of 1,000 training and 500 test images, 2 contrastive and 2 probe epochs.
DEMO_CONFIG = """\
# Dense-queue (MoCo-style) study, CPU demo size. `lightning-replay fit --config` trains one run
# with strategy=replay; `lightning-replay study --config` runs the seven-method comparison.
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 4            # model.encoder_epochs contrastive epochs, then 2 linear-probe epochs
  deterministic: true
  log_every_n_steps: 10
  enable_checkpointing: false
  enable_model_summary: false
  enable_progress_bar: true
  limit_val_batches: 0
  default_root_dir: runs/dense_queue_cpu
  strategy:
    class_path: lightning_replay.strategies.replay.ReplayStrategy
    init_args:
      planner: joint
      on_violation: record
      calibration_steps: 2
  callbacks:
    - class_path: lightning_replay.callbacks.replay.ReplayCallback
      init_args:
        check_every_n_steps: 10
    - class_path: lightning_replay.apps.telemetry.StepTelemetry
model:
  class_path: lightning_replay.apps.dense_queue.DenseQueueModule
  init_args:
    layers: [1, 1, 1, 1]
    width: 16
    proj_dim: 64
    queue_size: 1024
    encoder_epochs: 2
    lr: 0.06
    probe_lr: 0.5
data:
  class_path: lightning_replay.apps.dense_queue.DenseQueueDataModule
  init_args:
    data_dir: runs/data      # synthetic CIFAR-100 is written here unless the real one is
    source: auto
    synthetic_train_per_class: 10
    synthetic_test_per_class: 5
    batch_size: 64
    eval_batch_size: 500
study:
  methods: [none, torch_checkpoint, torch_sac, whole, regions, eager_whole, joint]
  seeds: [0, 1]
  budget_fraction: 0.5
  measure_steps: 10
  check_every_n_steps: 10
  memory_every_n_steps: 4
  output_dir: runs/dense_queue_study
  overwrite: true
"""


@dataclasses.dataclass
class StudySettings:
    """The ``study:`` section of a config.

    Args:
        methods: which of :data:`METHODS` to run, in this order (``none`` runs first in each
            seed whatever the order, so the others can be compared with it).
        seeds: one run per method per seed (``seed_everything`` and the data seed).
        budget_fraction: where between the lowest feasible budget of ``eager_whole`` and
            ``joint`` (0) and retaining everything (1) their budget is set.
        budget: a fixed budget instead (bytes or ``"2GiB"``); ``None`` measures.
        measure_steps: training steps of the cost-measuring run.
        check_every_n_steps: derivative and byte-level checks every n steps in the replay
            runs (``None``: no checks).
        memory_every_n_steps: on CPU, live tensor memory is tracked (a dispatch mode that
            slows the step) on every n-th step; step times come from the other steps.
        output_dir: where the results, report, records, wandb runs and run folders go.
        overwrite: replace the outputs of an earlier study in ``output_dir``.
        wandb_mode: ``"offline"``, ``"online"`` or ``"disabled"``; ``None``: the
            ``WANDB_MODE`` environment variable, else ``"offline"``.
        wandb_project: the wandb project of the runs.
        report: write ``report.html``.
    """

    methods: list[str] = dataclasses.field(default_factory=lambda: list(METHODS))
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1])
    budget_fraction: float = 0.5
    budget: Any = None
    measure_steps: int = 10
    check_every_n_steps: int | None = 10
    memory_every_n_steps: int = 4
    output_dir: str = "runs/dense_queue_study"
    overwrite: bool = False
    wandb_mode: str | None = None
    wandb_project: str = "lightning_replay"
    report: bool = True

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"study.methods={self.methods!r}: unknown {unknown}; choose from "
                             f"{list(METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"study.methods={self.methods!r} lists a method twice")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or \
                not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds):
            raise ValueError(f"study.seeds={self.seeds!r} must be distinct ints (at least one)")
        if not 0 <= self.budget_fraction <= 1:
            raise ValueError(f"study.budget_fraction={self.budget_fraction!r} must be in [0, 1]")
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        if isinstance(self.measure_steps, bool) or not isinstance(self.measure_steps, int) or \
                self.measure_steps < 2:
            raise ValueError(f"study.measure_steps={self.measure_steps!r} must be an int >= 2")
        if self.check_every_n_steps is not None and (
                isinstance(self.check_every_n_steps, bool) or self.check_every_n_steps < 1):
            raise ValueError(f"study.check_every_n_steps={self.check_every_n_steps!r} must be "
                             "a positive int or null")
        if isinstance(self.memory_every_n_steps, bool) or \
                not isinstance(self.memory_every_n_steps, int) or self.memory_every_n_steps < 1:
            raise ValueError(f"study.memory_every_n_steps={self.memory_every_n_steps!r} must be "
                             "an int >= 1")
        if self.wandb_mode not in (None, "offline", "online", "disabled"):
            raise ValueError(f"study.wandb_mode={self.wandb_mode!r} must be offline, online, "
                             "disabled or null")
        # `none` first: the reference every other method is compared with
        if "none" in self.methods:
            self.methods = ["none"] + [m for m in self.methods if m != "none"]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "StudySettings":
        section = dict(config.get("study") or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(f"study section has unknown keys {unknown}; known: {sorted(names)}")
        return cls(**section)


# ------------------------------------------------------------------------------ config
def load_study_config(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A study config as a dict: from a YAML file path, a YAML string, or a mapping.

    The config has LightningCLI's ``trainer``/``model``/``data`` sections (the model a
    :class:`DenseQueueModule` or a subclass) and a ``study`` section (:class:`StudySettings`).
    """
    if isinstance(source, Mapping):
        cfg = copy.deepcopy(dict(source))
    else:
        text = str(source)
        if "\n" not in text and os.path.exists(text):
            text = Path(text).read_text()
        elif "\n" not in text:
            raise FileNotFoundError(f"study config {text!r} does not exist")
        cfg = yaml.safe_load(text) or {}
    if not isinstance(cfg, dict):
        raise ValueError("a study config must be a mapping with trainer/model/data/study")
    for key in ("trainer", "model", "data"):
        cfg.setdefault(key, {})
    if "class_path" not in cfg["model"]:
        cfg["model"] = {"class_path": _DENSE_QUEUE, "init_args": cfg["model"]}
    if "class_path" not in cfg["data"]:
        cfg["data"] = {"class_path": _DENSE_QUEUE_DATA, "init_args": cfg["data"]}
    cfg["model"].setdefault("init_args", {})
    cfg["data"].setdefault("init_args", {})
    return cfg


# ------------------------------------------------------------------------------ one run
class _RunCLI(LightningCLI):
    """LightningCLI that instantiates one study run: the config's trainer, model and data, with
    the study's strategy, callbacks, logger and root dir in place of the config's."""

    def __init__(self, args: dict[str, Any], trainer_overrides: dict[str, Any]) -> None:
        self._overrides = trainer_overrides
        super().__init__(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                         subclass_mode_data=True, args=args, run=False,
                         save_config_callback=None, auto_configure_optimizers=False)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        kept = [c for c in (self.config_init["trainer"].get("callbacks") or [])
                if not isinstance(c, (ReplayCallback, StepTelemetry))]
        over = dict(self._overrides)
        over["callbacks"] = kept + list(over.get("callbacks", []))
        return super().instantiate_trainer(**{**kwargs, **over})


class _CaptureCosts(Callback):
    def __init__(self) -> None:
        self.costs: list | None = None
        self.base = 0
        self.calibration_steps = 2
        self.options: dict[str, list[str]] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.costs = engine.costs
        self.base = engine.base_memory
        self.calibration_steps = engine.calibration_steps
        self.options = {n: c.available_options() for n, c in engine.contracts.items()}


@dataclasses.dataclass
class _Run:
    method: str
    seed: int
    model: L.LightningModule
    datamodule: L.LightningDataModule
    trainer: L.Trainer
    telemetry: StepTelemetry
    wall_s: float
    run_dir: Path


def _replay_defaults(base: dict[str, Any]) -> dict[str, Any]:
    """init_args of the config's ReplayStrategy / ReplayCallback, if it names them."""
    out: dict[str, Any] = {"strategy": {}, "callback": {}}
    strat = base["trainer"].get("strategy")
    if isinstance(strat, dict) and str(strat.get("class_path", "")).endswith("ReplayStrategy"):
        out["strategy"] = dict(strat.get("init_args") or {})
    for cb in base["trainer"].get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ReplayCallback"):
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
    # the study adds its own ReplayCallback and StepTelemetry (see _fit)
    tr["callbacks"] = [c for c in tr.get("callbacks") or [] if not (
        isinstance(c, dict) and str(c.get("class_path", "")).rsplit(".", 1)[-1] in
        ("ReplayCallback", "StepTelemetry"))]
    tr["default_root_dir"] = str(run_dir)
    return cfg


def _fit(base: dict[str, Any], settings: StudySettings, method: str, seed: int, run_dir: Path,
         records: Path | None, budget: int | None, wandb_mode: str, group: str,
         max_steps: int | None = None, extra_callbacks: Sequence[Callback] = ()) -> _Run:
    run_dir.mkdir(parents=True, exist_ok=True)
    replay = _replay_defaults(base)
    telemetry = StepTelemetry(path=run_dir / "telemetry.jsonl",
                              memory_every_n_steps=settings.memory_every_n_steps)
    callbacks: list[Callback] = [telemetry, *extra_callbacks]
    overrides: dict[str, Any] = {"callbacks": callbacks, "logger": False,
                                 "enable_progress_bar": False, "enable_model_summary": False}
    described: dict[str, Any] = {"method": method, "seed": seed}
    if method in _REPLAY:
        planner, preservation, budgeted = _REPLAY[method]
        kwargs = {k: v for k, v in replay["strategy"].items()
                  if k in ("on_violation", "calibration_steps")}
        kwargs.update(planner=planner, preservation=preservation,
                      budget=budget if budgeted else None)
        overrides["strategy"] = ReplayStrategy(**kwargs)
        described["strategy"] = {"class_path": "lightning_replay.strategies.replay.ReplayStrategy",
                                 "init_args": kwargs}
        if records is not None:
            cb_args = {k: v for k, v in replay["callback"].items()
                       if k not in ("records_path", "check_every_n_steps")}
            cb_args.update(records_path=str(records),
                           check_every_n_steps=settings.check_every_n_steps)
            callbacks.append(ReplayCallback(**cb_args))
            described["replay_callback"] = cb_args
    else:
        overrides["strategy"] = "auto"
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    logger = None
    if wandb_mode != "disabled" and max_steps is None:
        from lightning.pytorch.loggers import WandbLogger
        logger = WandbLogger(project=settings.wandb_project, name=f"{method}-seed{seed}",
                             group=group, job_type="study", save_dir=str(run_dir.parent.parent),
                             mode=wandb_mode, config={"method": method, "seed": seed,
                                                      "budget": budget})
        overrides["logger"] = logger
    args = _run_args(base, method, seed, run_dir)
    (run_dir / "run_config.yaml").write_text(yaml.safe_dump({**args, **described},
                                                            sort_keys=False))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = _RunCLI(args, overrides)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # reported in the results instead (checks_skipped), once per method
        warnings.filterwarnings("ignore", message="derivative check skipped")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - t0
    return _Run(method, seed, cli.model, cli.datamodule, cli.trainer, telemetry, wall, run_dir)


def _test(run: _Run, base: dict[str, Any]) -> dict[str, Any]:
    """Score the probe on the test split with a plain single-device trainer."""
    tr = base["trainer"]
    trainer = L.Trainer(accelerator=tr.get("accelerator", "auto"), devices=1,
                        precision=tr.get("precision"), deterministic=tr.get("deterministic"),
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(run.run_dir))
    trainer.test(run.model, datamodule=run.datamodule, verbose=False)
    result = getattr(run.model, "test_result", None)
    if not result:
        raise RuntimeError(f"{type(run.model).__name__} left no test_result after test(); the "
                           "study needs a DenseQueueModule (or a subclass)")
    return result


# ------------------------------------------------------------------------------ comparing
def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def describe_divergence(ref: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]
                        ) -> dict[str, Any]:
    """How two encoder states differ: counts, the largest relative difference of a floating
    tensor, and how batch-norm counters (``num_batches_tracked``) compare.

    Example:
        >>> a = {"w": torch.ones(3), "bn.num_batches_tracked": torch.tensor(4)}
        >>> b = {"w": torch.tensor([1.0, 1.0, 1.5]), "bn.num_batches_tracked": torch.tensor(8)}
        >>> d = describe_divergence(a, b)
        >>> d["differ"], d["bn_counter_ratio"]
        (2, 2.0)
    """
    differ, worst, worst_name, ratios = 0, 0.0, None, []
    for k, a in ref.items():
        b = other.get(k)
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            differ += 1
            continue
        if torch.equal(a, b):
            continue
        differ += 1
        if k.endswith("num_batches_tracked"):
            if int(a) != 0:
                ratios.append(int(b) / int(a))
            continue
        if a.is_floating_point():
            den = float(a.double().norm())
            rel = float((a.double() - b.double()).norm()) / den if den > 0 else math.inf
            if rel > worst:
                worst, worst_name = rel, k
    return {"differ": differ, "tensors": len(ref), "max_rel_diff": worst,
            "max_rel_diff_tensor": worst_name,
            "bn_counter_ratio": (statistics.median(ratios) if ratios else None)}


def _divergence_text(d: dict[str, Any], top1_delta: float) -> str:
    if d["differ"] == 0 and top1_delta == 0:
        return "identical"
    parts = [f"top-1 {top1_delta:+.4f}",
             f"{d['differ']}/{d['tensors']} encoder tensors differ"]
    if d["max_rel_diff_tensor"]:
        parts.append(f"max rel. diff {d['max_rel_diff']:.2e} ({d['max_rel_diff_tensor']})")
    if d["bn_counter_ratio"] not in (None, 1.0):
        parts.append(f"BN counters x{d['bn_counter_ratio']:.2f} (statistics updated again "
                     "on every replay)")
    return "; ".join(parts)


# ------------------------------------------------------------------------------ the study
@dataclasses.dataclass
class StudyResult:
    """What :func:`run_study` measured; ``to_dict()`` is what ``results.json`` holds."""

    settings: StudySettings
    rows: list[dict[str, Any]]
    seeds: dict[int, dict[str, Any]]
    budget: dict[str, Any]
    output_dir: Path
    wall_s: float
    data: str = ""
    paths: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def identical(self) -> bool:
        """Every seed's state-aware methods gave byte-identical scores and weights."""
        return all(s["state_aware_identical"] for s in self.seeds.values())

    def to_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "rows": self.rows,
                "seeds": {str(k): v for k, v in self.seeds.items()}, "budget": self.budget,
                "identical": self.identical, "wall_s": self.wall_s, "data": self.data,
                "paths": self.paths}


def _steady_cutoff(runs: Sequence[dict[str, Any]]) -> int:
    """First step at which every replay run had its plan in force (1 if none is replayed)."""
    firsts = []
    for tel in runs:
        first = next((r["step"] for r in tel if (r.get("plan_version") or 0) >= 1), None)
        if first is not None:
            firsts.append(first)
    return max(firsts, default=1)


def _steady(rows: list[dict[str, Any]], cutoff: int) -> list[dict[str, Any]]:
    enc = [r for r in rows if r.get("phase", "encoder") == "encoder"]
    steady = [r for r in enc if r["step"] >= cutoff and not r.get("checked")]
    return steady or enc


def _records_by_outcome(path: Path, run_id: str | None) -> dict[str, int] | None:
    if run_id is None or not path.exists():
        return None
    store = RecordStore(path, run_id=run_id)
    try:
        return store.counts(run_id=run_id, kind="check")  # contract/plan events are no checks
    finally:
        store.close()


def _clean(out: Path) -> None:
    for name in ("results.md", "results.csv", "results.json", "report.html", "study_config.yaml",
                 "records.sqlite", "records.sqlite-wal", "records.sqlite-shm"):
        (out / name).unlink(missing_ok=True)
    for name in ("runs", "wandb", "plots", "measure"):
        shutil.rmtree(out / name, ignore_errors=True)


# Set by Lightning's DDP launcher even for one process (ReplayStrategy is a DDPStrategy) and by
# seed_everything; one run must not leave them to the next, or to the caller.
_RUN_ENV = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@contextlib.contextmanager
def _own_env():
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
def _quiet(enabled: bool):
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


def measure_budget(base: dict[str, Any], settings: StudySettings, out: Path,
                   seed: int) -> dict[str, Any]:
    """Measure every segment's options in a short replay run and set the budget from them."""
    cap = _CaptureCosts()
    with _own_env():
        run = _fit(base, settings, "joint", seed, out / "measure", None, None, "disabled",
                   "measure", max_steps=settings.measure_steps, extra_callbacks=[cap])
    costs, basemem = cap.costs, cap.base
    # a probe step, a warm-up plus calibration_steps per calibration phase (two), the plan
    needed = 2 + 2 * (cap.calibration_steps + 1)
    unmeasured = [f"{c.name}:{o}" for c in costs or [] for o in cap.options.get(c.name, [])
                  if o not in c.options]
    if not costs or unmeasured:
        raise RuntimeError(f"study.measure_steps={settings.measure_steps} was too short to "
                           f"measure every option (unmeasured: {unmeasured[:4]}); use "
                           f"{needed} or more")
    mins = {m: _planner.min_feasible_budget(costs, basemem, m)
            for m in ("joint", "eager_whole", "retain_all")}
    lo = max(mins["joint"], mins["eager_whole"])
    hi = max(mins["retain_all"], lo)
    budget = lo + int(round(settings.budget_fraction * (hi - lo)))
    if settings.budget is not None:
        budget = settings.budget
    del run
    return {"bytes": budget, "fraction": settings.budget_fraction,
            "explicit": settings.budget is not None, "base_memory": basemem,
            "min_feasible": mins, "costs": _planner.costs_to_dict(costs)}


def run_study(config: str | os.PathLike | Mapping[str, Any], *, progress: bool = True,
              quiet: bool = True, echo: Callable[[str], None] | None = None) -> StudyResult:
    """Run the comparison a study config describes and write its results.

    Args:
        config: a study config (see :func:`load_study_config`).
        progress: show a progress bar over the runs (on stderr).
        quiet: silence Lightning's per-trainer banners during the runs.
        echo: called with a line of text after each run (e.g. ``print``).

    Returns:
        The :class:`StudyResult`; its files are under ``settings.output_dir``.

    Raises:
        FileExistsError: ``output_dir`` holds an earlier study and ``overwrite`` is false.
    """
    from tqdm.auto import tqdm

    base = load_study_config(config)
    settings = StudySettings.from_config(base)
    out = Path(settings.output_dir)
    if (out / "results.json").exists() and not settings.overwrite:
        raise FileExistsError(f"{out} holds an earlier study (results.json); set "
                              "study.overwrite: true or choose another study.output_dir")
    if out.is_dir() and any(out.iterdir()) and not (out / "study_config.yaml").exists():
        # never clean a directory the study did not make
        raise FileExistsError(f"study.output_dir={str(out)!r} is a non-empty directory that "
                              "holds no study; choose a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)  # an earlier (or interrupted) study here
    (out / "study_config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    records = out / "records.sqlite"
    wandb_mode = settings.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
    if wandb_mode == "dryrun":
        wandb_mode = "offline"
    group = f"study-{time.strftime('%Y%m%d-%H%M%S')}"
    budgeted = [m for m in settings.methods if m in _REPLAY and _REPLAY[m][2]]
    total = len(settings.methods) * len(settings.seeds) + (1 if budgeted else 0)
    t_start = time.perf_counter()
    bar = tqdm(total=total, desc="study", unit="run", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    budget: dict[str, Any] = {"bytes": None}
    raw: list[dict[str, Any]] = []
    telemetry: dict[tuple[str, int], list[dict[str, Any]]] = {}
    refs: dict[int, dict[str, Any]] = {}
    data_desc = ""
    try:
        with _quiet(quiet):
            if budgeted:
                bar.set_postfix_str("measuring costs")
                budget = measure_budget(base, settings, out, settings.seeds[0])
                bar.update(1)
                if echo:
                    echo(f"budget for eager_whole/joint: {format_bytes(budget['bytes'])} "
                         f"(min feasible: joint {format_bytes(budget['min_feasible']['joint'])}"
                         f", eager_whole {format_bytes(budget['min_feasible']['eager_whole'])}"
                         f", retain all {format_bytes(budget['min_feasible']['retain_all'])})")
            for seed in settings.seeds:
                for method in settings.methods:
                    bar.set_postfix_str(f"{method} seed {seed}")
                    run_dir = out / "runs" / f"{method}-seed{seed}"
                    with _own_env():
                        run = _fit(base, settings, method, seed, run_dir, records,
                                   budget["bytes"], wandb_mode, group)
                        result = _test(run, base)
                    data_desc = getattr(run.datamodule, "description", "") or data_desc
                    row = _row(run, result, records, budget["bytes"])
                    state = _state(run.model.encoder_q)
                    if seed not in refs and method in STATE_AWARE:
                        refs[seed] = {"method": method, "state": state, "top1": row["top1"]}
                    ref = refs.get(seed)
                    if ref is not None:
                        d = describe_divergence(ref["state"], state)
                        delta = row["top1"] - ref["top1"]
                        row["reference"] = ref["method"]
                        row["same_top1"] = row["top1"] == ref["top1"]
                        row["same_weights"] = d["differ"] == 0
                        row["divergence"] = d
                        row["vs_reference"] = _divergence_text(d, delta)
                    _finish_wandb(run, row)
                    telemetry[(method, seed)] = list(run.telemetry.rows)
                    raw.append(row)
                    bar.update(1)
                    if echo:
                        echo(f"{method:>16} seed {seed}: top-1 {format_top1(row['top1'])}  "
                             f"encoder {row['encoder_digest'][:12]}  "
                             f"{row.get('vs_reference', '')}  ({row['wall_s']:.1f} s)")
                    del run
    finally:
        bar.close()
    cutoff = _steady_cutoff([t for (m, _), t in telemetry.items() if m in _REPLAY])
    for row in raw:
        steady = _steady(telemetry[(row["method"], row["seed"])], cutoff)
        peaks = [r["peak_bytes"] for r in steady if r.get("peak_bytes") is not None]
        row["peak_bytes"] = max(peaks) if peaks else None
        acc = [r["accounted_peak_bytes"] for r in steady if r.get("accounted_peak_bytes")]
        row["accounted_peak_bytes"] = max(acc) if acc else None
        timed = [r for r in steady if not r.get("memory_tracked")] or steady
        row["median_step_ms"] = statistics.median(r["step_time_ms"] for r in timed)
        row["steady_steps"] = len(steady)
    seeds = _seed_summaries(raw, settings)
    result = StudyResult(settings, raw, seeds, {**budget, "steady_from_step": cutoff}, out,
                         time.perf_counter() - t_start, data_desc)
    _write(result)
    return result


def _row(run: _Run, result: dict[str, Any], records: Path, budget: int | None
         ) -> dict[str, Any]:
    engine = getattr(run.trainer.strategy, "engine", None)
    run_id = getattr(run.trainer.strategy, "run_id", None) if engine is not None else None
    rows = run.telemetry.rows
    replays = sum(r.get("replays") or 0 for r in rows)
    plan = None
    if engine is not None and engine.plan is not None:
        plan = {"choices": dict(engine.plan.choices), "version": engine.plan_version,
                "predicted_peak_bytes": engine.plan.peak_memory,
                "extra_time_s": engine.plan.extra_time}
    return {"method": run.method, "seed": run.seed,
            "kind": "state-aware" if run.method in STATE_AWARE else "state-unaware",
            "top1": result["top1"], "test_images": result["total"],
            "encoder_digest": weights_digest(run.model.encoder_q),
            "replays": replays, "records": _records_by_outcome(records, run_id),
            "checks_skipped": engine.checks_skipped if engine is not None else None,
            "budget_bytes": budget if run.method in _REPLAY and _REPLAY[run.method][2] else None,
            "plan": plan, "run_id": run_id, "wall_s": run.wall_s,
            "steps": len(rows), "run_dir": str(run.run_dir),
            "wandb_dir": getattr(run, "wandb_dir", None)}


def _finish_wandb(run: _Run, row: dict[str, Any]) -> None:
    logger = run.trainer.logger
    if logger is None or type(logger).__name__ != "WandbLogger":
        return
    exp = logger.experiment
    summary = {"study/method": row["method"], "study/seed": row["seed"],
               "test/top1": row["top1"], "encoder_digest": row["encoder_digest"],
               "replays": row["replays"]}
    for k, v in (row.get("records") or {}).items():
        summary[f"records/{k}"] = v
    exp.summary.update(summary)
    run_dir = getattr(exp, "dir", None)
    row["wandb_dir"] = str(Path(run_dir).parent) if run_dir else None
    exp.finish()


def _seed_summaries(rows: list[dict[str, Any]], settings: StudySettings) -> dict[int, Any]:
    out = {}
    for seed in settings.seeds:
        mine = [r for r in rows if r["seed"] == seed]
        aware = [r for r in mine if r["kind"] == "state-aware"]
        identical = all(r.get("same_top1") and r.get("same_weights") for r in aware)
        out[seed] = {
            "reference": aware[0]["method"] if aware else None,
            "state_aware": [r["method"] for r in aware],
            "state_aware_identical": identical,
            "top1": aware[0]["top1"] if aware else None,
            "encoder_digest": aware[0]["encoder_digest"] if aware else None,
            "not_identical": [r["method"] for r in aware
                              if not (r.get("same_top1") and r.get("same_weights"))],
            "state_unaware": {r["method"]: r.get("vs_reference") for r in mine
                              if r["kind"] == "state-unaware"},
        }
    return out


# ------------------------------------------------------------------------------ output
def _fmt_records(rec: dict[str, int] | None) -> str:
    if rec is None:
        return "n/a"
    return " / ".join(str(rec.get(o, 0)) for o in OUTCOMES)


def format_markdown(result: StudyResult) -> str:
    """The result table (one row per method and seed) and the per-seed verdicts, in Markdown."""
    lines = ["| method | seed | test top-1 | encoder digest | peak memory (live) | "
             "median step (steady) | replays | checks (match / rejection / divergence) | "
             "vs reference |",
             "|---|---:|---|---|---:|---:|---:|---|---|"]
    for r in result.rows:
        peak = format_bytes(r["peak_bytes"]) if r.get("peak_bytes") is not None else "n/a"
        lines.append(
            f"| {r['method']} | {r['seed']} | {format_top1(r['top1'])} | "
            f"`{r['encoder_digest'][:16]}` | "
            f"{peak} | {r['median_step_ms']:.1f} ms | {r['replays']} | "
            f"{_fmt_records(r.get('records'))} | "
            f"{'reference' if r.get('reference') == r['method'] else r.get('vs_reference', '')}"
            " |")
    lines.append("")
    for seed, s in result.seeds.items():
        if len(s["state_aware"]) == 1:
            lines.append(f"- seed {seed}: {s['state_aware'][0]} is the only state-aware method "
                         "run: nothing to compare it with.")
        elif s["state_aware_identical"]:
            lines.append(f"- seed {seed}: state-aware methods {', '.join(s['state_aware'])} give "
                         f"**byte-identical** test top-1 ({format_top1(s['top1'])}) and "
                         "encoder weights "
                         f"(`{s['encoder_digest'][:16]}`).")
        else:
            lines.append(f"- seed {seed}: state-aware methods are **NOT identical**: "
                         f"{', '.join(s['not_identical'])} differ from {s['reference']}.")
        for m, how in s["state_unaware"].items():
            lines.append(f"- seed {seed}: {m} (state-unaware): {how}.")
    b = result.budget
    if b.get("bytes") is not None:
        mf = b["min_feasible"]
        how = "given" if b["explicit"] else f"fraction {b['fraction']}"
        lines.append(
            f"- budget of eager_whole and joint: {format_bytes(b['bytes'])} "
            f"({how}; minimum feasible "
            f"budgets from measured costs: joint {format_bytes(mf['joint'])}, eager_whole "
            f"{format_bytes(mf['eager_whole'])}, retain all {format_bytes(mf['retain_all'])}).")
        held = []
        for m in ("eager_whole", "joint"):
            peaks = [r["accounted_peak_bytes"] for r in result.rows
                     if r["method"] == m and r.get("accounted_peak_bytes")]
            if peaks:
                held.append(f"{m} {format_bytes(max(peaks))}")
        if held:
            lines.append(f"- the engine's accounted peak (the quantity the budget bounds) over "
                         f"the steady steps, largest over seeds: {', '.join(held)}; the live "
                         "tensor peak in the table also counts what the engine does not "
                         "(optimizer state, the batch and its augmentations, temporaries).")
    skipped = {}
    for r in result.rows:
        if r.get("checks_skipped"):
            skipped[r["method"]] = max(skipped.get(r["method"], 0), r["checks_skipped"])
    if skipped:
        lines.append(
            "- derivative checks skipped under the budget (keeping even one segment's graph "
            "would exceed it; byte checks still ran on those steps), most in one run: "
            + ", ".join(f"{m} {n}" for m, n in skipped.items()) + ".")
    cutoff = b.get("steady_from_step", 1)
    when = (f"from step {cutoff}, when every replay run's plan is in force; checked steps "
            "excluded" if cutoff > 1 else "all of them")
    lines.append(f"- peak memory and median step time over the contrastive steps ({when}); "
                 "peak memory is the largest live tensor bytes of a "
                 "step (on CPU tracked every "
                 f"{result.settings.memory_every_n_steps} steps, whose times are left out of "
                 "the median; the CUDA allocator's peak on GPU).")
    lines.append("")
    lines.append("Methods:")
    for m in result.settings.methods:
        lines.append(f"- `{m}`: {METHOD_DESCRIPTIONS.get(m, '')}")
    return "\n".join(lines) + "\n"


_CSV_COLUMNS = ("method", "seed", "kind", "top1", "test_images", "encoder_digest", "peak_bytes",
                "accounted_peak_bytes", "median_step_ms", "replays", "records_match",
                "records_rejection", "records_divergence", "budget_bytes", "same_top1",
                "same_weights", "vs_reference", "wall_s", "run_id", "run_dir")


def _write(result: StudyResult) -> None:
    out = result.output_dir
    (out / "results.md").write_text(format_markdown(result))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in result.rows:
        rec = r.get("records") or {}
        w.writerow({**r, "top1": repr(r["top1"]),
                    **{f"records_{o}": rec.get(o, "") if r.get("records") else ""
                       for o in OUTCOMES}})
    (out / "results.csv").write_text(buf.getvalue())
    result.paths = {"results_md": str(out / "results.md"), "results_csv": str(out / "results.csv"),
                    "results_json": str(out / "results.json"),
                    "records": str(out / "records.sqlite"),
                    "wandb": str(out / "wandb"), "runs": str(out / "runs")}
    if result.settings.report:
        from lightning_replay.apps.report import write_report
        result.paths["report"] = str(write_report(out, result=result.to_dict()))
    (out / "results.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))
