"""Logger extras for replay telemetry (wandb)."""

from lightning_replay.loggers.wandb import (
    METRICS,
    PLAN_COLUMNS,
    RECORDS_KEY,
    WandbReplayWriter,
    build_workspace,
    plan_rows,
    workspace_spec,
)

__all__ = [
    "METRICS",
    "PLAN_COLUMNS",
    "RECORDS_KEY",
    "WandbReplayWriter",
    "build_workspace",
    "plan_rows",
    "workspace_spec",
]
