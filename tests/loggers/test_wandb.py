"""wandb: an offline run read back (metrics, summaries, records and plan tables), and the
dashboard-as-code workspace built offline."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import wandb
from lightning.pytorch.loggers import WandbLogger

from lightning_replay import ReplayCallback, ReplayStrategy
from lightning_replay.loggers import (
    METRICS,
    PLAN_COLUMNS,
    RECORDS_KEY,
    WandbReplayWriter,
    build_workspace,
    plan_rows,
    workspace_spec,
)
from lightning_replay.records import COLUMNS, RecordStore

from tests.helpers.lit_hazards import HazardNet, loader, trainer
from tests.helpers.wandb_reader import find_run_file, read_run


def _table_rows(run_dir: Path, key: str) -> list[list]:
    """Every row of every logged version/increment of the table ``key``."""
    rows = []
    for f in sorted(run_dir.glob(f"files/media/table/{key}_*.table.json")):
        data = json.loads(f.read_text())
        rows.extend(data["data"])
    return rows


def test_offline_run_holds_metrics_summaries_records_and_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="replay-test", save_dir=str(tmp_path))
    cb = ReplayCallback(check_every_n_steps=3)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=9,
        callbacks=[cb],
        logger=logger,
        log_every_n_steps=2,
    )
    try:
        t.fit(HazardNet(), loader(16))
    finally:
        wandb.finish()

    run_file = find_run_file(tmp_path)
    run = read_run(run_file)
    for name in METRICS:
        values = run.column(name)
        assert values, f"{name} missing from history"
    assert run.column("replay/plan_version")[-1] == 1
    assert max(run.column("replay/peak_memory_bytes")) > 0
    # define_metric summaries: wandb keeps {"max": ...} / {"mean": ...} per metric
    assert run.metrics["replay/peak_memory_bytes"]["summary"] == {"max": True}
    assert run.metrics["replay/step_time_ms"]["summary"] == {"mean": True}
    assert run.metrics["replay/divergences"]["step_metric"] == "trainer/global_step"
    assert run.summary["replay/peak_memory_bytes"]["max"] == max(
        run.column("replay/peak_memory_bytes")
    )

    # the incremental records table holds exactly the records of the SQLite file
    logged = run.column(RECORDS_KEY)
    assert logged and all(v["_type"] == "incremental-table-file" for v in logged)
    rows = _table_rows(run_file.parent, RECORDS_KEY)
    with sqlite3.connect(tmp_path / "replay" / "records.sqlite") as db:
        stored = [
            list(r)
            for r in db.execute(
                'SELECT seq, run_id, step, rank, segment, contract_version, "check", outcome, '
                "detail, created_at FROM records ORDER BY seq"
            )
        ]
    assert sorted(rows, key=lambda r: r[0]) == stored
    assert {r[COLUMNS.index("check")] for r in rows} >= {"contract", "grad", "bytes", "plan"}

    # the plan table: one row per segment, the plan in force
    assert run.column("replay/plan")
    plan = _table_rows(run_file.parent, "replay/plan")
    engine = t.strategy.engine
    assert {
        r[PLAN_COLUMNS.index("segment")]: r[PLAN_COLUMNS.index("option")] for r in plan
    } == engine.plan.choices


def test_run_config_holds_the_replay_settings(tmp_path, monkeypatch):
    """Runs can be grouped and filtered by the strategy's and the callback's settings."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="replay-test", save_dir=str(tmp_path))
    strategy = ReplayStrategy(
        budget="1GiB", planner="eager_whole", preservation="whole", calibration_steps=1
    )
    cb = ReplayCallback(check_every_n_steps=7, checks=("grad",), replan_on=("memory",))
    t = trainer(tmp_path, strategy=strategy, max_steps=3, callbacks=[cb], logger=logger)
    try:
        t.fit(HazardNet(), loader(16))
    finally:
        wandb.finish()
    config = read_run(find_run_file(tmp_path)).config
    assert config["replay"] == {
        "budget": "1.00 GiB",
        "budget_bytes": 2**30,
        "planner": "eager_whole",
        "preservation": "whole",
        "on_violation": "record",
        "calibration_steps": 1,
        "segments": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        "world_size": 1,
        "check_every_n_steps": 7,
        "checks": ["grad"],
        "replan_on": ["memory"],
        "memory_headroom": 0.25,
    }
    assert set(cb.settings()) == set(config["replay"])


def test_run_config_holds_the_resolved_budget_of_a_default_cpu_run(tmp_path, monkeypatch):
    """No budget on CPU is the lowest-memory plan: the config says so, and holds the bytes
    that plan was made for once it is made (not null)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="replay-test", save_dir=str(tmp_path))
    cb = ReplayCallback(check_every_n_steps=None)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=6,
        callbacks=[cb],
        logger=logger,
    )
    try:
        t.fit(HazardNet(), loader(16))
    finally:
        wandb.finish()
    config = read_run(find_run_file(tmp_path)).config["replay"]
    assert config["budget"] == "default: min"
    assert config["budget_bytes"] == t.strategy.engine.plan.budget > 0


def test_writer_without_a_run_file(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = wandb.init(project="replay-test")
    try:
        writer = WandbReplayWriter(run)
        writer.define_metrics()
        store = RecordStore(None, run_id="r")
        for step in (1, 2):
            store.append(
                step=step,
                segment="b0",
                contract_version=1,
                check="grad",
                outcome="match",
                detail={},
            )
        assert writer.add_records(store.read()) == 2
        assert writer.flush_records(step=2) is True
        assert writer.flush_records(step=3) is False  # nothing new: nothing logged
        assert writer.rows_logged == 2
    finally:
        wandb.finish()


def test_plan_rows_follow_the_plan_and_the_summary():
    rows = plan_rows(
        3,
        {"a": "regions", "b": "retain"},
        {
            "a": {
                "mode": "regions",
                "contract_version": 2,
                "activation_bytes": 10,
                "preserved_bytes": 4,
                "replays": 7,
                "checks": 1,
                "divergences": 0,
            },
            "b": {
                "mode": "retain",
                "contract_version": 1,
                "activation_bytes": 5,
                "preserved_bytes": 0,
                "replays": 0,
                "checks": 0,
                "divergences": 0,
            },
        },
    )
    assert [dict(zip(PLAN_COLUMNS, r))["option"] for r in rows] == ["regions", "retain"]
    assert all(r[0] == 3 for r in rows)


def test_workspace_is_built_offline_with_a_panel_per_metric():
    ws = build_workspace("team", "proj", name="replay dashboard")
    plotted = [m for s in ws.sections for p in s.panels for m in getattr(p, "y", [])]
    assert sorted(plotted) == sorted(METRICS)
    assert all(
        p.x == "trainer/global_step" for s in ws.sections for p in s.panels if hasattr(p, "y")
    )
    tables = [p.table_name for s in ws.sections for p in s.panels if hasattr(p, "table_name")]
    assert tables == [RECORDS_KEY, "replay/plan"]

    spec = workspace_spec(ws)
    assert spec["entity"] == "team" and spec["project"] == "proj"
    assert spec["displayName"] == "replay dashboard"
    text = json.dumps(spec)
    for name in METRICS:
        assert json.dumps(name) in text


def test_no_wandb_key_reaches_records_logs_or_run_files(tmp_path, monkeypatch, capfd):
    """A wandb API key in the environment (or in wandb's settings) is never written by a run:
    not to the records database, the run's files, the checkpoint, nor stdout/stderr."""
    secret = "0123456789abcdef" * 2 + "SECRETKEY"  # 41 chars, the shape of a wandb key
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="replay-test", save_dir=str(tmp_path))
    cb = ReplayCallback(check_every_n_steps=2)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=6,
        callbacks=[cb],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=True,
    )
    try:
        t.fit(HazardNet(), loader(16))
    finally:
        wandb.finish()
    out, err = capfd.readouterr()
    assert secret not in out and secret not in err
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "records.sqlite" for p in files)
    assert any(p.suffix == ".wandb" for p in files)
    assert any(p.suffix == ".ckpt" for p in files)
    leaked = [
        str(p.relative_to(tmp_path))
        for p in files
        if secret.encode() in p.read_bytes() or secret[:24].encode() in p.read_bytes()
    ]
    assert leaked == []
