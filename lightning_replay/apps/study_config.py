"""The study's configuration: its methods, the ``study:`` section, and loading a config.

A study config is a LightningCLI ``fit`` config (``trainer``/``model``/``data``) plus a
``study`` section (:class:`StudySettings`). The demo's config is package data,
:data:`DEMO_CONFIG`; the repository's ``configs/dense_queue_cpu.yaml`` is the same file.

Example:
    >>> cfg = load_study_config(DEMO_CONFIG)
    >>> StudySettings.from_config(cfg).methods
    ['none', 'torch_checkpoint', 'torch_sac', 'whole', 'regions', 'eager_whole', 'joint']
    >>> import lightning as L
    >>> names_subclass("lightning_replay.apps.dense_queue.DenseQueueModule", L.LightningModule)
    True
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from importlib import resources
from typing import Any, Mapping, NamedTuple

import yaml

from lightning_replay.core.engine.config import check_count
from lightning_replay.apps.dense_queue import DenseQueueDataModule, DenseQueueModule
from lightning_replay.core.base.budget import parse_budget

__all__ = [
    "METHODS",
    "STATE_AWARE",
    "STATE_UNAWARE",
    "METHOD_DESCRIPTIONS",
    "REPLAY_METHODS",
    "DEMO_CONFIG",
    "ReplayMethod",
    "StudySettings",
    "load_study_config",
    "class_path",
    "names_subclass",
]

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


class ReplayMethod(NamedTuple):
    """How a ``strategy="replay"`` method runs."""

    planner: str
    #: the segments' preservation before the first plan
    preservation: str
    #: planned under the study's measured budget
    budgeted: bool


REPLAY_METHODS = {
    "whole": ReplayMethod("whole_all", "whole", False),
    "regions": ReplayMethod("fixed_regions", "regions", False),
    "eager_whole": ReplayMethod("eager_whole", "auto", True),
    "joint": ReplayMethod("joint", "auto", True),
}

#: The demo's config (``python -m lightning_replay.demos.demo``, ``make demo``): small sizes for
#: 2 CPU cores, a ResNet with one block per stage at width 16 on a synthetic CIFAR-100 of 1,000
#: training and 500 test images, 2 contrastive and 2 probe epochs. It is package data, so an
#: installed package (a wheel, not only this checkout) has it; the repository's
#: ``configs/dense_queue_cpu.yaml`` is a symlink to this one file.
DEMO_CONFIG = resources.files("lightning_replay") / "configs" / "dense_queue_cpu.yaml"


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
            raise ValueError(
                f"study.methods={self.methods!r}: unknown {unknown}; choose from {list(METHODS)}"
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"study.methods={self.methods!r} lists a method twice")
        if (
            not self.seeds
            or len(set(self.seeds)) != len(self.seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds)
        ):
            raise ValueError(f"study.seeds={self.seeds!r} must be distinct ints (at least one)")
        if not 0 <= self.budget_fraction <= 1:
            raise ValueError(f"study.budget_fraction={self.budget_fraction!r} must be in [0, 1]")
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        check_count("study", "measure_steps", self.measure_steps, minimum=2)
        check_count("study", "check_every_n_steps", self.check_every_n_steps, none="no checks")
        check_count("study", "memory_every_n_steps", self.memory_every_n_steps)
        if self.wandb_mode not in (None, "offline", "online", "disabled"):
            raise ValueError(
                f"study.wandb_mode={self.wandb_mode!r} must be offline, online, disabled or null"
            )
        # `none` first: the reference every other method is compared with
        if "none" in self.methods:
            self.methods = ["none"] + [m for m in self.methods if m != "none"]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "StudySettings":
        """The settings of a config's ``study`` section (defaults where it has none)."""
        section = dict(config.get("study") or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(f"study section has unknown keys {unknown}; known: {sorted(names)}")
        return cls(**section)


def load_study_config(source: Any) -> dict[str, Any]:
    """A study config as a dict: from a YAML file (a path, or package data such as
    :data:`DEMO_CONFIG`), a YAML string, or a mapping.

    The config has LightningCLI's ``trainer``/``model``/``data`` sections (the model a
    :class:`DenseQueueModule` or a subclass) and a ``study`` section (:class:`StudySettings`).
    """
    if isinstance(source, Mapping):
        cfg = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        text = str(source)
        if "\n" not in text and os.path.exists(text):
            with open(text) as f:
                text = f.read()
        elif "\n" not in text:
            raise FileNotFoundError(f"study config {text!r} does not exist")
        cfg = yaml.safe_load(text) or {}
    else:  # package data inside a zip (importlib.resources' Traversable), not a file path
        cfg = yaml.safe_load(source.read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError("a study config must be a mapping with trainer/model/data/study")
    for key in ("trainer", "model", "data"):
        cfg.setdefault(key, {})
    if "class_path" not in cfg["model"]:
        cfg["model"] = {"class_path": class_path(DenseQueueModule), "init_args": cfg["model"]}
    if "class_path" not in cfg["data"]:
        cfg["data"] = {"class_path": class_path(DenseQueueDataModule), "init_args": cfg["data"]}
    cfg["model"].setdefault("init_args", {})
    cfg["data"].setdefault("init_args", {})
    return cfg


def class_path(cls: type) -> str:
    """The ``class_path`` a config names ``cls`` by.

    Example:
        >>> class_path(DenseQueueModule)
        'lightning_replay.apps.dense_queue.DenseQueueModule'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def names_subclass(path: Any, base: type) -> bool:
    """Whether a config's ``class_path`` names ``base`` or a subclass of it.

    ``path`` is imported (``"package.module.Class"``), as LightningCLI instantiates it; a bare
    class name, which LightningCLI also accepts, is looked up among ``base`` and its imported
    subclasses. A path that does not import is no subclass of anything (instantiating the
    config reports it).
    """
    if not isinstance(path, str) or not path:
        return False
    module, _, name = path.rpartition(".")
    if not module:
        return any(c.__name__ == name for c in _with_subclasses(base))
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)


def _with_subclasses(base: type) -> list[type]:
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out
