"""`python -m lightning_replay.demos.demo` (make demo) and the hazard table it replaced."""

from __future__ import annotations

import yaml

from lightning_replay.demos import demo, hazard_demo

from .conftest import tiny_study_config


def test_demo_prints_table_and_where_things_are(tmp_path, tiny_data, monkeypatch, capsys):
    cfg = tiny_study_config(tmp_path / "unused", tiny_data)
    monkeypatch.setattr(demo, "DEMO_CONFIG", yaml.safe_dump(cfg))
    out_dir = tmp_path / "demo"
    assert (
        demo.main(
            [
                "--methods",
                "none",
                "torch_checkpoint",
                "whole",
                "--seeds",
                "0",
                "--output-dir",
                str(out_dir),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| none | 0 |" in out and "| whole | 0 |" in out and "| torch_checkpoint | 0 |" in out
    assert "byte-identical" in out and "BN counters x2.00" in out
    for line in ("results:", "report:", "records:", "wandb:"):
        assert line in out
    assert str(out_dir / "report.html") in out and (out_dir / "report.html").exists()
    assert str(out_dir / "records.sqlite") in out


def test_demo_defaults_are_the_full_study():
    from lightning_replay.apps.study import METHODS, StudySettings, load_study_config

    s = StudySettings.from_config(load_study_config(demo.DEMO_CONFIG))
    assert s.methods == list(METHODS) and s.seeds == [0, 1]


def test_hazard_table_still_available(capsys):
    assert hazard_demo.main(["--hazard", "queue", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "queue" in out and "exact" in out
