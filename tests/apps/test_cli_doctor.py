"""`lightning-replay doctor --config`: the fit config's model and data, diagnosed on copies."""

from __future__ import annotations

import json

from lightning_replay import cli

from .conftest import CONFIGS, TINY_DATA

TINY = [
    "--model.init_args.layers=[1, 1, 1, 1]",
    "--model.init_args.width=8",
    "--model.init_args.proj_dim=16",
    "--model.init_args.queue_size=64",
    "--data.init_args.batch_size=16",
] + [f"--data.init_args.{k}={v}" for k, v in TINY_DATA.items()]


def _doctor(tmp_path, tiny_data, *extra):
    return cli.main(
        [
            "doctor",
            "--config",
            str(CONFIGS / "dense_queue_cpu.yaml"),
            *TINY,
            f"--data.init_args.data_dir={tiny_data}",
            f"--trainer.default_root_dir={tmp_path}",
            *extra,
        ]
    )


def test_doctor_dense_queue_config(tmp_path, tiny_data, capsys):
    assert _doctor(tmp_path, tiny_data) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "doctor.json").read_text())
    # The MoCo queue is enqueued after the loss reads it, and every ResNet stage updates its
    # batch-norm statistics: torch checkpoint gets both wrong, replay neither.
    assert data["verdict"].startswith("torch checkpoint silently differs in ")
    assert f"verdict: {data['verdict']}" in out
    differing = {s["name"] for s in data["torch_checkpoint"]["state"]}
    assert "criterion.queue" in differing
    assert "encoder_q.backbone.layer1.0.bn1.num_batches_tracked" in differing
    assert data["replay"]["exact"] is True
    assert data["segments"] == [
        "encoder_q.backbone.layer1",
        "encoder_q.backbone.layer2",
        "encoder_q.backbone.layer3",
        "encoder_q.backbone.layer4",
        "criterion",
    ]
    criterion = {d["name"]: d for d in data["diagnoses"]}["criterion"]
    assert ("criterion.queue", True) in [
        (s["name"], s["changes_in_window"]) for s in criterion["state"]
    ]
    page = (tmp_path / "doctor.html").read_text()
    assert "<section id='lightning-replay-doctor'>" in page and data["verdict"] in page


def test_doctor_bad_segments_is_one_clear_error(tmp_path, tiny_data, capsys):
    rc = _doctor(tmp_path, tiny_data, "--trainer.strategy.init_args.segments=[nope]")
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().startswith(
        "lightning-replay doctor: error: segment 'nope' is not a submodule of DenseQueueModule"
    )
    assert "Traceback" not in err and not (tmp_path / "doctor.json").exists()


def test_doctor_selective_flag_names_the_policy_in_the_methods_table(tmp_path, tiny_data, capsys):
    """``--selective POLICY`` reaches diagnose: the methods table compares torch's selective
    checkpoint and replay's selective option under that policy; torch's is not exact on the
    MoCo queue and batch norm, ours is."""
    assert _doctor(tmp_path, tiny_data, "--selective", "every_other_matmul") == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "doctor.json").read_text())
    assert data["selective_policy"] == "every_other_matmul"
    assert "torch selective checkpoint ('every_other_matmul')" in out
    assert "lightning_replay selective ('every_other_matmul')" in out
    assert data["torch_selective"]["exact"] is False
    assert data["replay_selective"]["exact"] is True


def test_doctor_selective_none_leaves_the_selective_runs_out(tmp_path, tiny_data, capsys):
    assert _doctor(tmp_path, tiny_data, "--selective", "none") == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "doctor.json").read_text())
    assert data["selective_policy"] is None and data["torch_selective"] is None
    assert "torch selective checkpoint" not in out


def test_doctor_unknown_selective_policy_is_a_usage_error(tmp_path, tiny_data, capsys):
    try:
        rc = _doctor(tmp_path, tiny_data, "--selective", "matmull")
    except SystemExit as exc:  # argparse's usage error
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "argument --selective: invalid choice: 'matmull'" in err
    assert "every_other_matmul" in err  # the choices are listed
    assert not (tmp_path / "doctor.json").exists()
