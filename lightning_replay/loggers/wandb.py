"""wandb extras for replay telemetry: the replay settings in the run config, metric summaries,
the records table, the plan table, and a dashboard-as-code workspace.

:class:`ReplayCallback` uses :class:`WandbReplayWriter` for every ``WandbLogger`` of the trainer
(on rank zero). The metrics themselves go through ``pl_module.log`` like any other logger's.
:func:`build_workspace` builds a ``wandb_workspaces`` workspace with a panel per metric and the
records table, offline; saving it (``workspace.save()``) needs the user's API key.

Example:
    >>> ws = build_workspace("my-team", "my-project")
    >>> [s.name for s in ws.sections]
    ['Replay: memory and time', 'Replay: checks and plans', 'Replay: records']
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

from lightning_replay.core.base.records import COLUMNS as RECORD_COLUMNS
from lightning_replay.core.base.records import Record

#: Step metric Lightning's ``WandbLogger`` defines; every replay metric is plotted against it.
STEP_METRIC = "trainer/global_step"

#: The metrics :class:`ReplayCallback` logs, with the wandb summary each keeps.
METRICS: dict[str, str] = {
    "replay/peak_memory_bytes": "max",
    "replay/peak_memory_mib": "max",
    "replay/step_time_ms": "mean",
    "replay/replays": "last",
    "replay/preserved_bytes": "max",
    "replay/preserved_mib": "max",
    "replay/matches": "last",
    "replay/rejections": "last",
    "replay/divergences": "last",
    "replay/plan_version": "last",
    "replay/checks_skipped": "last",
    # the four memory terms (ReplayCallback's docstring): each compared only with its like
    "replay/real_peak_mib": "max",
    "replay/predicted_peak_mib": "last",
    "replay/retain_all_predicted_mib": "last",
    "replay/budget_mib": "last",
}

#: The run-config section holding the strategy's and the callback's settings.
CONFIG_KEY = "replay"

RECORDS_KEY = "replay/records"
PLAN_KEY = "replay/plan"

#: Columns of the plan table.
PLAN_COLUMNS = (
    "plan_version",
    "segment",
    "option",
    "mode",
    "contract_version",
    "activation_bytes",
    "preserved_bytes",
    "replays",
    "checks",
    "divergences",
)


class WandbReplayWriter:
    """Writes replay extras into one wandb run.

    Args:
        run: a ``wandb`` run (``WandbLogger.experiment``).
        step_metric: the x-axis metric, logged with every table so panels line up.

    Example:
        >>> import wandb
        >>> run = wandb.init(mode="disabled")
        >>> writer = WandbReplayWriter(run)
        >>> writer.define_metrics()
        >>> writer.add_records([])
        0
        >>> wandb.finish()
    """

    def __init__(self, run: Any, step_metric: str = STEP_METRIC) -> None:
        self.run = run
        self.step_metric = step_metric
        self._table: Any = None
        self._pending = 0
        self.rows_logged = 0

    def log_config(self, settings: Mapping[str, Any]) -> None:
        """Put the replay settings into the run's config under ``replay`` (``replay.planner``,
        ``replay.budget_bytes``, ...), so runs can be grouped and filtered by them."""
        self.run.config.update({CONFIG_KEY: dict(settings)}, allow_val_change=True)

    def define_metrics(self) -> None:
        """Summaries for each replay metric (``max`` peak memory, ``mean`` step time, ...)."""
        self.run.define_metric(self.step_metric)
        for name, summary in METRICS.items():
            self.run.define_metric(name, step_metric=self.step_metric, summary=summary)

    def add_records(self, records: Iterable[Record]) -> int:
        """Queue records as new rows of the incremental ``replay/records`` table."""
        import wandb

        if self._table is None:
            self._table = wandb.Table(columns=list(RECORD_COLUMNS), log_mode="INCREMENTAL")
        n = 0
        for r in records:
            self._table.add_data(*_record_row(r))
            n += 1
        self._pending += n
        return n

    def flush_records(self, step: int) -> bool:
        """Log the rows queued since the last flush (nothing when there are none)."""
        if not self._pending:
            return False
        self.run.log({RECORDS_KEY: self._table, self.step_metric: step})
        self.rows_logged += self._pending
        self._pending = 0
        return True

    def log_plan(self, rows: Sequence[Sequence[Any]], step: int) -> None:
        """Log the plan in force as a table (one row per segment, :data:`PLAN_COLUMNS`)."""
        import wandb

        table = wandb.Table(columns=list(PLAN_COLUMNS), data=[list(r) for r in rows])
        self.run.log({PLAN_KEY: table, self.step_metric: step})


def plan_rows(
    plan_version: int,
    plan_choices: Mapping[str, str] | None,
    summary: Mapping[str, Mapping[str, Any]],
) -> list[list[Any]]:
    """Rows of the plan table from ``engine.plan.choices`` and ``engine.summary()``.

    Example:
        >>> plan_rows(1, {"b0": "whole"}, {"b0": {"mode": "whole", "contract_version": 1,
        ...     "activation_bytes": 64, "preserved_bytes": 8, "replays": 3, "checks": 1,
        ...     "divergences": 0}})
        [[1, 'b0', 'whole', 'whole', 1, 64, 8, 3, 1, 0]]
    """
    choices = plan_choices or {}
    return [
        [
            plan_version,
            name,
            choices.get(name, s.get("mode")),
            s.get("mode"),
            s.get("contract_version", 0),
            s.get("activation_bytes", 0),
            s.get("preserved_bytes", 0),
            s.get("replays", 0),
            s.get("checks", 0),
            s.get("divergences", 0),
        ]
        for name, s in summary.items()
    ]


def _record_row(r: Record) -> list[Any]:
    d = r.to_dict()
    return [d[c] for c in RECORD_COLUMNS]


def wandb_runs(loggers: Iterable[Any]) -> list[Any]:
    """The wandb runs behind the ``WandbLogger`` instances in ``loggers``."""
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - lightning is a dependency
        return []
    return [lg.experiment for lg in loggers if isinstance(lg, WandbLogger)]


def build_workspace(
    entity: str, project: str, *, name: str = "lightning_replay", step_metric: str = STEP_METRIC
) -> Any:
    """A ``wandb_workspaces.workspaces.Workspace`` with a panel per replay metric and the
    records table. Built offline; ``workspace.save()`` (with your API key) publishes it.

    Args:
        entity: the wandb entity (user or team).
        project: the project the runs log to.
        name: the workspace (view) name.
        step_metric: the x-axis.

    Returns:
        The workspace. :func:`workspace_spec` turns it into the JSON wandb stores.

    Example:
        >>> ws = build_workspace("team", "proj")
        >>> ws.sections[0].panels[0].y
        ['replay/real_peak_mib']
    """
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def line(metric: str, title: str) -> Any:
        return wr.LinePlot(title=title, x=step_metric, y=[metric])

    memory = ws.Section(
        name="Replay: memory and time",
        is_open=True,
        panels=[
            line("replay/real_peak_mib", "Real peak (MiB; allocator on GPU, profiler on CPU)"),
            line("replay/budget_mib", "Budget (MiB)"),
            line("replay/predicted_peak_mib", "Predicted peak (MiB)"),
            line(
                "replay/retain_all_predicted_mib",
                "Retaining every segment, predicted (MiB)",
            ),
            line("replay/peak_memory_mib", "Step peak (MiB; allocator on GPU, accounted on CPU)"),
            line("replay/preserved_mib", "Preserved state (MiB)"),
            line(
                "replay/peak_memory_bytes", "Step peak (bytes; allocator on GPU, accounted on CPU)"
            ),
            line("replay/preserved_bytes", "Preserved state (bytes, exact)"),
            line("replay/step_time_ms", "Step time (ms)"),
            line("replay/replays", "Replays per step"),
        ],
    )
    checks = ws.Section(
        name="Replay: checks and plans",
        is_open=True,
        panels=[
            line("replay/matches", "Checks that matched"),
            line("replay/divergences", "Divergences"),
            line("replay/rejections", "Contract rejections"),
            line("replay/plan_version", "Plan version"),
            line("replay/checks_skipped", "Checks skipped (no budget headroom)"),
        ],
    )
    records = ws.Section(
        name="Replay: records",
        is_open=True,
        panels=[
            wr.WeavePanelSummaryTable(table_name=RECORDS_KEY),
            wr.WeavePanelSummaryTable(table_name=PLAN_KEY),
            wr.MarkdownPanel(
                markdown=(
                    "Records: one row per check or contract event (`match`, `rejection`, "
                    "`divergence`). A divergence means a replay differed from the retained graph; on "
                    "a checked step training used the reference gradients."
                )
            ),
        ],
    )
    return ws.Workspace(
        entity=entity, project=project, name=name, sections=[memory, checks, records]
    )


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The JSON-safe view spec wandb stores for ``workspace`` (no network, no key).

    Example:
        >>> spec = workspace_spec(build_workspace("team", "proj"))
        >>> spec["displayName"]
        'lightning_replay'
    """
    # wandb_workspaces exposes the serialized form only through its internal model.
    model = workspace._to_model()
    return json.loads(json.dumps(model.model_dump(by_alias=True, exclude_none=True), default=str))
