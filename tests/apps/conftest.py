"""Fixtures for the application tests: wandb off, a tiny synthetic CIFAR-100, tiny sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_replay.apps.cifar_synth import write_synthetic_cifar100

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

#: 400 training and 200 test images; with batch 32, 12 steps per epoch.
TINY_DATA = {"synthetic_train_per_class": 4, "synthetic_test_per_class": 2}
TINY_MODEL = {
    "layers": [1, 1, 1, 1],
    "width": 8,
    "proj_dim": 16,
    "queue_size": 64,
    "encoder_epochs": 1,
}


@pytest.fixture(autouse=True)
def _wandb_off(monkeypatch):
    # a test that wants offline runs sets WANDB_MODE=offline itself
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")


LAUNCHER_ENV = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def guard_launcher_env(mp: pytest.MonkeyPatch) -> None:
    """Make ``mp.undo()`` remove what Lightning's DDP launcher sets even for one process
    (ReplayStrategy is a DDPStrategy). For module-scoped fixtures: tests/conftest.py restores
    the environment after each test, not after a module fixture."""
    import os

    for k in LAUNCHER_ENV:
        mp.setenv(k, "x")  # records the current value (or its absence) for undo
        if k in os.environ:
            mp.delenv(k)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar100(
        root,
        train_per_class=TINY_DATA["synthetic_train_per_class"],
        test_per_class=TINY_DATA["synthetic_test_per_class"],
    )
    return root


def tiny_study_config(out: Path, data_dir: Path, **study: object) -> dict:
    """The demo study config shrunk to seconds: ResNet width 8, 400 images, 1+1 epochs."""
    from lightning_replay.apps.study import DEMO_CONFIG, load_study_config

    cfg = load_study_config(DEMO_CONFIG)
    cfg["trainer"]["max_epochs"] = 2
    cfg["model"]["init_args"].update(TINY_MODEL)
    cfg["data"]["init_args"].update(
        data_dir=str(data_dir), batch_size=32, eval_batch_size=200, **TINY_DATA
    )
    cfg["study"].update(
        output_dir=str(out), seeds=[0], check_every_n_steps=5, memory_every_n_steps=2, **study
    )
    return cfg
