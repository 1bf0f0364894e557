"""README: `lightning-replay study --config ...` runs the comparison through the console
script's parser, and `lightning-replay records` queries the study directory it wrote."""

from __future__ import annotations

import json

import pytest
import yaml

from lightning_replay import cli

from .conftest import guard_launcher_env, tiny_study_config


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("cli_study")
    out = root / "study"
    config = root / "study.yaml"
    config.write_text(yaml.safe_dump(tiny_study_config(out, tiny_data)))
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "disabled")
    guard_launcher_env(mp)
    try:
        # a config file, then overrides on the command line, as the README writes it
        rc = cli.main(
            ["study", "--config", str(config), "--study.seeds=[0]", "--study.methods=[none, joint]"]
        )
    finally:
        mp.undo()
    assert rc == 0
    return out


def test_study_command_writes_the_comparison(study_dir):
    results = json.loads((study_dir / "results.json").read_text())
    rows = {r["method"]: r for r in results["rows"]}
    assert list(rows) == ["none", "joint"]  # the command-line override won over the file
    assert rows["joint"]["same_weights"] and rows["joint"]["same_top1"]
    for name in ("results.md", "results.csv", "records.sqlite"):
        assert (study_dir / name).is_file(), name


def test_records_command_reads_the_study_directory(study_dir, capsys):
    assert cli.main(["records", str(study_dir), "--summary"]) == 0
    summary = capsys.readouterr().out
    assert "joint" in summary and "match" in summary
    assert (
        cli.main(
            ["records", str(study_dir), "--check", "grad", "--format", "json", "--limit", "1000"]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["outcome"] for r in rows} == {"match"}
    assert cli.main(["records", str(study_dir), "--outcome", "divergence"]) == 0
    assert "(no records)" in capsys.readouterr().out
