"""The study's configuration: the packaged demo config and class paths resolved to types."""

from __future__ import annotations

from pathlib import Path

import yaml

import lightning_replay
from lightning_replay.apps.study_config import DEMO_CONFIG, load_study_config, names_subclass
from lightning_replay.apps.telemetry import StepTelemetry
from lightning_replay.callbacks.replay import ReplayCallback
from lightning_replay.strategies.replay import ReplayStrategy

from .conftest import CONFIGS


class _MyReplayStrategy(ReplayStrategy):
    """A user's subclass, named by a class_path whose last part is not 'ReplayStrategy'."""


def test_demo_config_is_package_data_and_the_repository_config():
    packaged = Path(str(DEMO_CONFIG))
    # inside the package, where setup.cfg's package_data ships it in a wheel
    assert packaged.is_file()
    assert packaged.parent.parent == Path(lightning_replay.__file__).parent
    # one copy: the repository's configs/ entry is that file, not a second text to keep equal
    assert (CONFIGS / "dense_queue_cpu.yaml").resolve() == packaged.resolve()
    cfg = load_study_config(DEMO_CONFIG)
    assert cfg == load_study_config(str(CONFIGS / "dense_queue_cpu.yaml"))
    assert cfg["study"]["seeds"] == [0, 1] and cfg["model"]["init_args"]["width"] == 16


def test_config_loads_from_yaml_text_path_and_mapping(tmp_path):
    text = "model:\n  width: 8\nstudy:\n  seeds: [3]\n"
    (tmp_path / "c.yaml").write_text(text)
    for source in (text, tmp_path / "c.yaml", str(tmp_path / "c.yaml"), yaml.safe_load(text)):
        cfg = load_study_config(source)
        # a bare model/data section is the dense-queue application's arguments
        assert cfg["model"] == {
            "class_path": "lightning_replay.apps.dense_queue.DenseQueueModule",
            "init_args": {"width": 8},
        }
        assert cfg["data"]["class_path"].endswith(".DenseQueueDataModule")
        assert cfg["study"] == {"seeds": [3]}


def test_class_paths_are_matched_by_type_not_by_name():
    here = f"{__name__}._MyReplayStrategy"
    assert names_subclass("lightning_replay.strategies.replay.ReplayStrategy", ReplayStrategy)
    assert names_subclass("lightning_replay.strategies.ReplayStrategy", ReplayStrategy)  # re-export
    assert names_subclass(here, ReplayStrategy)  # a subclass under another name
    assert names_subclass("ReplayStrategy", ReplayStrategy)  # LightningCLI's short form
    assert names_subclass("_MyReplayStrategy", ReplayStrategy)
    # a name that merely ends like one, or a path that does not import, is not one
    assert not names_subclass("mypkg.NotAReplayStrategy", ReplayStrategy)
    assert not names_subclass("lightning_replay.apps.telemetry.StepTelemetry", ReplayCallback)
    assert names_subclass("lightning_replay.apps.telemetry.StepTelemetry", StepTelemetry)
    assert not names_subclass(
        "lightning_replay.strategies.replay_fsdp.ReplayFSDPStrategy", ReplayStrategy
    )
    assert not names_subclass(None, ReplayStrategy) and not names_subclass("", ReplayStrategy)
