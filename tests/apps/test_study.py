"""The seven-method study at tiny size: state-aware methods byte-identical within a seed."""

from __future__ import annotations

import csv
import json
import os
import re
import time

import pytest
import torch

from lightning_replay.apps.study import (
    METHODS,
    STATE_AWARE,
    StudySettings,
    describe_divergence,
    format_markdown,
    run_study,
)

from .conftest import LAUNCHER_ENV, guard_launcher_env, tiny_study_config


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("study")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "disabled")
    guard_launcher_env(mp)
    try:
        result = run_study(tiny_study_config(out, tiny_data), progress=False)
        # before mp.undo(): what the study itself left in the environment
        result.env_after = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    finally:
        mp.undo()
    return result


def test_state_aware_methods_identical_within_seed(study):
    rows = {r["method"]: r for r in study.rows}
    assert list(rows) == list(METHODS)
    aware = [rows[m] for m in STATE_AWARE]
    assert len({r["top1"] for r in aware}) == 1, [(r["method"], r["top1"]) for r in aware]
    assert len({r["encoder_digest"] for r in aware}) == 1
    assert all(r["same_top1"] and r["same_weights"] for r in aware)
    assert study.identical and study.seeds[0]["state_aware_identical"]
    assert 0 <= rows["none"]["top1"] <= 1 and rows["none"]["test_images"] == 200


def test_state_unaware_methods_diverge_and_say_how(study):
    rows = {r["method"]: r for r in study.rows}
    ref = rows["none"]["encoder_digest"]
    for m in ("torch_checkpoint", "torch_sac"):
        r = rows[m]
        assert r["encoder_digest"] != ref and not r["same_weights"]
        # batch norm inside a checkpointed stage updates its statistics on every replay too
        assert r["divergence"]["bn_counter_ratio"] == 2.0
        assert "BN counters x2.00" in r["vs_reference"]
        assert r["replays"] > 0 and r["records"] is None


def test_replay_runs_recorded_checks_without_divergence(study):
    rows = {r["method"]: r for r in study.rows}
    for m in ("whole", "regions", "eager_whole", "joint"):
        rec = rows[m]["records"]
        assert rec["match"] > 0 and rec["divergence"] == 0 and rec["rejection"] == 0, (m, rec)
        assert rows[m]["replays"] > 0 and rows[m]["plan"] is not None
    budget = study.budget
    assert (
        budget["min_feasible"]["joint"]
        <= budget["bytes"]
        <= max(budget["min_feasible"]["retain_all"], budget["min_feasible"]["eager_whole"])
    )
    for m in ("eager_whole", "joint"):
        assert rows[m]["budget_bytes"] == budget["bytes"]
        assert rows[m]["plan"]["predicted_peak_bytes"] <= budget["bytes"]
        # the budget held on every steady (planned, unchecked) step
        assert 0 < rows[m]["accounted_peak_bytes"] <= budget["bytes"]
    assert rows["none"]["replays"] == 0
    # unbudgeted replay runs derivative-check every segment; budgeted ones report what they skip
    assert rows["whole"]["checks_skipped"] == rows["regions"]["checks_skipped"] == 0
    assert rows["none"]["checks_skipped"] is None
    for m in ("eager_whole", "joint"):
        if rows[m]["checks_skipped"]:
            assert f"{m} {rows[m]['checks_skipped']}" in format_markdown(study)
    # recomputation really saves memory against retaining everything
    assert rows["whole"]["peak_bytes"] < rows["none"]["peak_bytes"]


def test_result_files(study):
    out = study.output_dir
    md = (out / "results.md").read_text()
    assert "byte-identical" in md and md.count("\n| ") >= len(METHODS)
    # people read a percentage; the CSV and JSON keep every digit (what identity compares)
    assert f"| {100 * study.rows[0]['top1']:.2f} % |" in md
    assert repr(study.rows[0]["top1"]) not in md
    assert all(f"- `{m}`: " in md for m in METHODS)  # every method explained
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == list(METHODS)
    assert float(table[0]["top1"]) == study.rows[0]["top1"]
    data = json.loads((out / "results.json").read_text())
    assert data["identical"] is True and len(data["rows"]) == len(METHODS)
    assert "costs" in data["budget"] and data["budget"]["costs"]["segments"]
    html = (out / "report.html").read_text()
    images = re.findall(r"<img src='data:image/png;base64,[^']+' data-file='([^']+)'", html)
    assert len(images) == 4  # embedded, and written beside the page
    for src in images:
        assert (out / src).stat().st_size > 1000
    # accounted and live peaks side by side, methods explained, top-1 as a percentage
    assert "peak, accounted" in html and "peak, live tensors" in html
    assert all(f"<dt><code>{m}</code></dt>" in html for m in METHODS)
    assert f"{100 * study.rows[0]['top1']:.2f} %" in html
    for m in METHODS:
        assert (out / "runs" / f"{m}-seed0" / "telemetry.jsonl").stat().st_size > 0


def test_settings_are_validated():
    with pytest.raises(ValueError, match="unknown"):
        StudySettings(methods=["none", "fastest"])
    with pytest.raises(ValueError, match="seeds"):
        StudySettings(seeds=[])
    with pytest.raises(ValueError, match="budget_fraction"):
        StudySettings(budget_fraction=1.5)
    assert StudySettings(methods=["joint", "none"]).methods == ["none", "joint"]
    assert StudySettings(budget="1MiB").budget == 2**20


def test_output_dir_is_guarded(tmp_path, tiny_data, study):
    (tmp_path / "mine.txt").write_text("not a study")
    with pytest.raises(FileExistsError, match="holds no study"):
        run_study(tiny_study_config(tmp_path, tiny_data), progress=False)
    assert (tmp_path / "mine.txt").exists()
    cfg = tiny_study_config(study.output_dir, tiny_data, overwrite=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        run_study(cfg, progress=False)


def test_too_short_a_cost_measurement_is_an_error(tmp_path, tiny_data):
    cfg = tiny_study_config(tmp_path / "s", tiny_data, methods=["none", "joint"], measure_steps=3)
    with pytest.raises(RuntimeError, match="too short to measure every option"):
        run_study(cfg, progress=False)


def test_describe_divergence():
    a = {"w": torch.ones(4), "b": torch.zeros(2), "n.num_batches_tracked": torch.tensor(3)}
    same = describe_divergence(a, {k: v.clone() for k, v in a.items()})
    assert same["differ"] == 0 and same["bn_counter_ratio"] is None
    b = dict(a, w=torch.tensor([1.0, 1.0, 1.0, 3.0]))
    d = describe_divergence(a, b)
    assert d["differ"] == 1 and d["max_rel_diff_tensor"] == "w"
    assert d["max_rel_diff"] == pytest.approx(1.0)


def _complete(path, timeout=30.0):
    """wandb.finish() can return before the service has flushed the run's exit record."""
    from tests.helpers.wandb_reader import iter_records

    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in iter_records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record"
        time.sleep(0.1)
    return path


def test_offline_wandb_runs_are_written(tmp_path, tiny_data, monkeypatch):
    from tests.helpers.wandb_reader import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_study_config(tmp_path / "study", tiny_data, methods=["none", "whole"], report=False)
    result = run_study(cfg, progress=False)
    assert result.identical
    files = sorted((tmp_path / "study" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    runs = [read_run(_complete(f)) for f in files]
    by_name = {r.summary.get("study/method"): r for r in runs}
    assert set(by_name) == {"none", "whole"}
    for m, r in by_name.items():
        assert (
            r.summary["test/top1"]
            == result.rows[[x["method"] for x in result.rows].index(m)]["top1"]
        )
    assert any("replay/peak_memory_bytes" in h for h in by_name["whole"].history)


def test_study_leaves_no_launcher_environment(study):
    """Its runs use a DDPStrategy subclass, whose launcher sets LOCAL_RANK and friends."""
    assert study.env_after == dict.fromkeys(LAUNCHER_ENV), study.env_after
