"""The `lightning-replay` console script: fit from each CPU config, report, records, help."""

from __future__ import annotations

import json
import base64
import os
import re
import sqlite3
import subprocess
import sys

import pytest

from lightning_replay import cli
from lightning_replay.errors import ReplayConfigError

from .conftest import CONFIGS, REPO, TINY_DATA, guard_launcher_env

TINY_FIT = [
    "--trainer.max_epochs=2",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.layers=[1, 1, 1, 1]",
    "--model.init_args.width=8",
    "--model.init_args.proj_dim=16",
    "--model.init_args.queue_size=64",
    "--model.init_args.encoder_epochs=1",
    "--data.init_args.batch_size=32",
    "--data.init_args.eval_batch_size=200",
] + [f"--data.init_args.{k}={v}" for k, v in TINY_DATA.items()]


def _records(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute('SELECT rank, "check", outcome FROM records').fetchall()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def fit_dir(tmp_path_factory, tiny_data):
    run = tmp_path_factory.mktemp("fit")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "disabled")
    guard_launcher_env(mp)
    try:
        assert (
            cli.main(
                [
                    "fit",
                    "--config",
                    str(CONFIGS / "dense_queue_cpu.yaml"),
                    *TINY_FIT,
                    f"--data.init_args.data_dir={tiny_data}",
                    f"--trainer.default_root_dir={run}",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return run


def test_fit_dense_queue_cpu_config(fit_dir):
    rows = [json.loads(x) for x in (fit_dir / "telemetry.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and rows[0]["plan"]  # 12 encoder + 12 probe steps, replay on
    assert {r["phase"] for r in rows} == {"encoder", "probe"}
    assert rows[0]["plan"]["criterion"] == "probe"
    recs = _records(fit_dir / "replay" / "records.sqlite")
    checks = {c for _, c, _ in recs}
    assert {"contract", "plan", "grad", "bytes"} <= checks
    assert all(o != "divergence" for _, _, o in recs)


def test_report_of_a_fit_run_has_its_images(fit_dir, capsys):
    assert cli.main(["report", str(fit_dir)]) == 0
    assert "report.html" in capsys.readouterr().out
    html = (fit_dir / "report.html").read_text()
    # embedded as data URIs (the page shows its plots wherever it is opened or sent), and
    # written beside it as files too
    images = re.findall(r"<img src='data:image/png;base64,([^']+)' data-file='([^']+)'", html)
    assert {os.path.basename(f) for _, f in images} == {
        "memory.png",
        "step_time.png",
        "plans.png",
        "records.png",
    }
    for data, src in images:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
        assert (fit_dir / src).read_bytes() == png
    assert "src='plots/" not in html


def test_records_queries(fit_dir, capsys):
    assert cli.main(["records", str(fit_dir), "--summary"]) == 0
    out = capsys.readouterr().out
    assert "contract" in out and "grad" in out and "match" in out
    assert (
        cli.main(["records", str(fit_dir), "--check", "grad", "--format", "json", "--limit", "2"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and all(r["check"] == "grad" for r in rows)
    assert rows[0]["seq"] < rows[1]["seq"]
    assert cli.main(["records", str(fit_dir), "--outcome", "divergence"]) == 0
    assert "(no records)" in capsys.readouterr().out
    assert cli.main(["records", str(fit_dir / "nothing")]) == 2
    assert "no records database" in capsys.readouterr().err


def test_test_subcommand_runs_with_a_replay_config(tmp_path, tiny_data):
    assert (
        cli.main(
            [
                "test",
                "--config",
                str(CONFIGS / "dense_queue_cpu.yaml"),
                *TINY_FIT,
                f"--data.init_args.data_dir={tiny_data}",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
        == 0
    )
    metrics = (next(tmp_path.glob("lightning_logs/version_*")) / "metrics.csv").read_text()
    assert "test/top1" in metrics


def test_fit_sparse_write_config(tmp_path):
    assert (
        cli.main(
            [
                "fit",
                "--config",
                str(CONFIGS / "sparse_write.yaml"),
                "--trainer.max_epochs=1",
                "--trainer.enable_progress_bar=false",
                "--model.init_args.blocks=2",
                "--model.init_args.dim=16",
                "--model.init_args.hidden=64",
                "--model.init_args.buffer_rows=256",
                "--model.init_args.write_rows=4",
                "--data.init_args.dim=16",
                "--data.init_args.train_size=512",
                "--data.init_args.val_size=64",
                "--data.init_args.batch_size=64",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
        == 0
    )
    rows = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert len(rows) == 8
    recs = _records(tmp_path / "replay" / "records.sqlite")
    assert "plan" in {c for _, c, _ in recs}
    assert all(o != "divergence" for _, _, o in recs)


def test_fit_ddp_config_two_processes(tmp_path, tiny_data):
    """The DDP config through the console script with Lightning's default (popen) launcher:
    devices=2 on CPU (gloo). The launcher re-runs the command line in the child, so this runs
    as its own process. Replay across ranks itself is covered in-process and bit for bit by
    strategies/test_replay_launchers.py; this test covers only the launch path, so it trains
    as little as that needs: one encoder and one probe epoch of 2 steps each, 8 images per rank
    per step. Steps are not what it costs: 1 or 3 per epoch, or the former 12, all take
    17-25 s on a loaded 2-core machine, nearly all of it the parent and then the child
    starting Python, torch and Lightning one after the other."""
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "lightning_replay.cli",
        "fit",
        "--config",
        str(CONFIGS / "dense_queue_ddp.yaml"),
        *TINY_FIT,
        "--trainer.limit_train_batches=2",
        "--data.init_args.batch_size=8",
        f"--data.init_args.data_dir={tiny_data}",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(tmp_path / "replay" / "records.sqlite")
    assert {r for r, _, _ in recs} == {0, 1}  # both ranks made contracts and recorded them
    assert all(o != "divergence" for _, _, o in recs)
    rows = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["encoder", "encoder", "probe", "probe"]
    # the probe step replays too (under the lowest-memory plan the probe keeps no
    # activations), then steady replays (the probe epochs train the probe head only)
    assert rows[0]["replays"] > 0 and rows[1]["replays"] > 0


def test_help_is_useful(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for cmd in ("fit", "validate", "test", "study", "report", "records"):
        assert cmd in out
    for argv, expect in (
        (["fit", "--help"], "--model.help DenseQueueModule"),
        (["fit", "--model.help", "DenseQueueModule"], "--model.queue_size"),
        (["study", "--help"], "--study.budget_fraction"),
        (["records", "--help"], "--outcome"),
        (["report", "--help"], "RUN_DIR"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
        assert expect in capsys.readouterr().out, argv


def test_help_is_plain_text_for_users(capsys):
    """No reStructuredText markup and no notes for developers in the console help; the
    records help lists every record kind its --check filter takes."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "It is long" not in out, out
    with pytest.raises(SystemExit):
        cli.main(["records", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "grad, bytes, probe, replay, version (checks); contract, plan (events)" in out


def test_study_args_from_config_and_overrides(tmp_path):
    cfg = cli.parse_study_args(
        [
            "--config",
            str(CONFIGS / "dense_queue_cpu.yaml"),
            "--study.seeds=[3, 4]",
            "--model.init_args.width=8",
        ]
    )
    assert cfg["study"]["seeds"] == [3, 4]
    assert cfg["model"]["class_path"].endswith("DenseQueueModule")
    assert cfg["model"]["init_args"]["width"] == 8
    gpu = cli.parse_study_args(["--config", str(CONFIGS / "dense_queue_gpu_study.yaml")])
    assert (
        gpu["trainer"]["max_epochs"] == 125
        and gpu["model"]["init_args"]["encoder_epochs"] == 100
        and len(gpu["study"]["seeds"]) == 6
        and gpu["data"]["init_args"]["source"] == "cifar100"
    )


def test_a_config_that_fails_to_build_is_a_replay_config_error(capsys):
    argv = [
        "--config",
        str(CONFIGS / "dense_queue_cpu.yaml"),
        "--trainer.strategy.init_args.budget=lots",
    ]
    with pytest.raises(cli.ConfigInstantiationError, match="budget='lots'") as info:
        cli.parse_doctor_args(argv)
    # under the package's error tree, and still the ValueError callers caught before
    assert isinstance(info.value, ReplayConfigError) and isinstance(info.value, ValueError)
    assert cli.main(["fit", *argv]) == 2
    err = capsys.readouterr().err
    assert "the config parsed, but building the trainer, model or data from it failed" in err
    assert "Traceback" not in err and "Namespace(" not in err


# ------------------------------------------------------------------------------ README-style run
def _points(ax) -> int:
    """How much data an axis shows: line points, bars and other patches, collections."""
    return (
        sum(len(line.get_xdata()) for line in ax.lines)
        + len(ax.patches)
        + sum(len(c.get_paths()) for c in ax.collections)
    )


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """Two fits appended to one directory, set up as the README shows: strategy="replay" and a
    ReplayCallback, nothing else (no StepTelemetry)."""
    from lightning_replay import ReplayCallback
    from tests.helpers.lit_hazards import HazardNet, loader, trainer

    root = tmp_path_factory.mktemp("readme")
    runs = []
    for steps in (6, 12):
        t = trainer(root, strategy="replay", max_steps=steps, callbacks=[ReplayCallback()])
        # batch 64: replaying a block frees memory (its activations, 8-20 KiB, above the
        # 5 KiB of CPU RNG state a replayed call holds), so the plan replays and is checked
        t.fit(HazardNet(), loader(16, batch=64))
        runs.append((t.strategy.engine.records.run_id, t.callbacks[0]))
    return root, runs


def test_report_of_a_readme_style_run(readme_runs, monkeypatch, capsys):
    """Every plot of the report has data, the headline peak is the steady steps' (not the
    probe step's), and the report shows the latest of the appended fits only."""
    from lightning_replay.apps import report
    from lightning_replay.records import query

    root, runs = readme_runs
    (first, _), (latest, cb) = runs
    seen: dict[str, list[tuple[str, int, float]]] = {}
    save = report._save

    legends: dict[str, list[str]] = {}

    def spy(fig, path):
        legends[path.name] = [
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
        ]
        seen[path.name] = [
            (
                ax.get_title(),
                _points(ax),
                sum(p.get_height() for p in ax.patches if hasattr(p, "get_height")),
            )
            for ax in fig.axes
        ]
        return save(fig, path)

    monkeypatch.setattr(report, "_save", spy)
    assert cli.main(["report", str(root)]) == 0
    assert set(seen) == {"memory.png", "step_time.png", "plans.png", "records.png"}
    for name, axes in seen.items():
        for title, points, _ in axes:
            assert points > 0, (name, title)  # no empty plot
    page = (root / "report.html").read_text()
    assert f"Run <code>{latest}</code>: 12 steps" in page
    assert f"<code>{first}</code>" in page and "--run RUN_ID" in page  # the other run, named
    # the headline peak is the steady steps' peak (plan in force, unchecked), as the callback
    # measured it: not the largest of all steps (a checked step keeps graphs the plan replays)
    tel = [json.loads(x) for x in (root / "replay" / "telemetry.jsonl").read_text().splitlines()]
    mine = [t for t in tel if t["run_id"] == latest]
    assert len(mine) == 12 and len(tel) == 18
    real = cb.fit_summary["real_peak_bytes"]
    assert f"Real peak over those steps {cli_format_bytes(real)}" in page
    predicted, full = (
        cb.fit_summary["predicted_peak_bytes"],
        cb.fit_summary["retain_all_peak_bytes"],
    )
    assert (
        f"Predicted peak {cli_format_bytes(predicted)} vs {cli_format_bytes(full)} retaining "
        "every segment (predicted)" in page
    )
    # the memory plot names each term in its legend (no run hash), the budget among them
    names = legends["memory.png"]
    assert {"real peak (measured)", "predicted peak (plan)"} <= set(names), names
    assert "retaining every segment (predicted)" in names
    assert any(n.startswith("budget ") for n in names), names
    assert not any(latest in n for n in names), names
    # record charts count this run's checks only
    checks = query(root / "replay" / "records.sqlite", run_id=latest, kind="check")
    by_outcome = seen["records.png"][0]
    assert by_outcome[2] == len(checks) > 0

    seen.clear()
    assert cli.main(["report", str(root), "--run", first]) == 0
    assert f"Run <code>{first}</code>: 6 steps" in (root / "report.html").read_text()
    capsys.readouterr()
    assert cli.main(["report", str(root), "--run", "nosuchrun"]) == 2
    err = capsys.readouterr().err
    assert "run 'nosuchrun' is not in" in err and first in err and latest in err


def cli_format_bytes(n: int) -> str:
    from lightning_replay import format_bytes

    return format_bytes(n)


def test_records_command_lists_runs_separates_events_and_emits_plain_json(readme_runs, capsys):
    root, runs = readme_runs
    (first, _), (latest, _) = runs
    assert cli.main(["records", str(root), "--run", "nosuchrun"]) == 2
    err = capsys.readouterr().err
    assert "no run 'nosuchrun'" in err and first in err and latest in err

    assert (
        cli.main(["records", str(root), "--run", latest, "--format", "json", "--limit", "0"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert {r["run_id"] for r in rows} == {latest}
    plan = next(r for r in rows if r["check"] == "plan")
    assert isinstance(plan["detail"], dict) and plan["detail"]["plan_version"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00", rows[0]["created_at"])

    assert (
        cli.main(
            [
                "records",
                str(root),
                "--run",
                latest,
                "--kind",
                "check",
                "--format",
                "json",
                "--limit",
                "0",
            ]
        )
        == 0
    )
    checks = json.loads(capsys.readouterr().out)
    # the sampled checks, and each replayed probe's comparison with its forward
    assert checks and {r["check"] for r in checks} == {"grad", "bytes", "probe"}

    assert cli.main(["records", str(root), "--summary"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()[1:]]
    assert {(ln[1], ln[2]) for ln in lines} == {
        ("event", "contract"),
        ("event", "plan"),
        ("check", "grad"),
        ("check", "bytes"),
        ("check", "probe"),
    }
