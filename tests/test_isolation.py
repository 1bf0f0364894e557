"""The per-test isolation in tests/conftest.py restores what tests are known to leak."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.conftest import BASELINE
from tests.helpers.isolation import isolated_globals, torch_switches


def test_fixture_gives_every_test_the_baseline():
    assert torch_switches() == BASELINE
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    torch.manual_seed(0)
    expected = torch.rand(3)
    with isolated_globals(BASELINE):
        assert torch.equal(torch.rand(3), expected)  # seeded on entry


def test_restores_torch_switches_environment_and_sys_path():
    port = os.environ.get("MASTER_PORT")
    with isolated_globals(BASELINE):
        torch.use_deterministic_algorithms(True)  # what Trainer(deterministic=True) does
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(3)
        torch.set_anomaly_enabled(True)
        torch.set_float32_matmul_precision("medium")
        os.environ["MASTER_PORT"] = "12910"
        sys.path.insert(0, "/nowhere")
    assert torch_switches() == BASELINE
    assert os.environ.get("MASTER_PORT") == port
    assert "/nowhere" not in sys.path


def test_lightning_deterministic_trainer_does_not_outlive_the_test(tmp_path):
    import lightning as L

    with isolated_globals(BASELINE):
        L.Trainer(
            deterministic=True, accelerator="cpu", logger=False, default_root_dir=str(tmp_path)
        )
        assert torch.are_deterministic_algorithms_enabled()  # Lightning turned it on for good
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch_switches() == BASELINE


def test_wandb_reads_the_mode_afresh_after_an_offline_run(tmp_path, monkeypatch):
    """wandb keeps the settings of its first run process-wide: without the reset, a
    ``disabled`` run after an ``offline`` one writes an offline run into the cwd."""
    import wandb

    monkeypatch.chdir(tmp_path)
    with isolated_globals(BASELINE):
        os.environ["WANDB_MODE"] = "offline"
        wandb.init(project="isolation", dir=str(tmp_path / "offline")).finish()
    assert list((tmp_path / "offline").glob("wandb/offline-run-*"))
    with isolated_globals(BASELINE):
        os.environ["WANDB_MODE"] = "disabled"
        run = wandb.init(project="isolation")
        assert run.settings.mode == "disabled"
        run.finish()
    assert not list(Path(tmp_path).glob("wandb/offline-run-*"))
