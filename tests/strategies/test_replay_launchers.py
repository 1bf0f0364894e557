"""README claims about ReplayStrategy's processes: one device trains without a process group,
and the "replay_notebook" launcher trains two ranks like plain "ddp_notebook"."""

from __future__ import annotations

import os
import tempfile

import lightning as L
import torch

from tests.helpers.lit_hazards import HazardNet, OneThreadInChild, differing, loader, state, trainer


class _SeesProcessGroup(HazardNet):
    def __init__(self) -> None:
        super().__init__()
        self.process_group_seen: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.process_group_seen.append(torch.distributed.is_initialized())
        return super().training_step(batch, batch_idx)


def test_one_device_trains_without_a_process_group(tmp_path):
    L.seed_everything(7)
    ref = HazardNet()
    trainer(tmp_path, max_steps=4).fit(ref, loader(4))
    L.seed_everything(7)
    model = _SeesProcessGroup()
    t = trainer(tmp_path, strategy="replay", devices=1, max_steps=4)
    t.fit(model, loader(4))
    assert model.process_group_seen == [False] * 4
    assert not torch.distributed.is_initialized()
    assert differing(state(ref), state(model)) == []
    assert all(s["replays"] >= 2 for s in t.strategy.engine.summary().values())


def test_notebook_launcher_matches_plain_ddp_notebook(tmp_path):
    L.seed_everything(7)
    ref = HazardNet()
    trainer(
        tmp_path, strategy="ddp_notebook", devices=2, max_steps=4, callbacks=[OneThreadInChild()]
    ).fit(ref, loader(8))
    L.seed_everything(7)
    model = HazardNet()
    t = trainer(tmp_path, strategy="replay_notebook", devices=2, max_steps=4)
    t.fit(model, loader(8))
    assert t.strategy._start_method == "fork"
    untrained = state(HazardNet())
    assert "head.weight" in differing(untrained, state(ref))  # rank 0's weights came back
    assert differing(state(ref), state(model)) == []


def _parent_exit_handler(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def test_forked_ranks_leave_the_parents_exit_handlers_and_temporary_directories(tmp_path):
    """A forked rank inherits its parent's ``atexit`` handlers and finalizers; they are the
    parent's. Run at each rank's end (RankExitLauncher), they deleted what the parent still
    used: wandb's staging directory (a ``TemporaryDirectory`` made at import), so the
    parent's next ``wandb.Table`` failed with ``FileNotFoundError`` (tests/loggers/test_wandb.py,
    run by a parallel worker after a forked test in the same process)."""
    import atexit

    import wandb
    from wandb.sdk.data_types._private import MEDIA_TMP

    held = tempfile.TemporaryDirectory("held-by-the-parent")
    marks = tmp_path / "exit_handlers_run"
    atexit.register(_parent_exit_handler, str(marks))
    try:
        t = trainer(tmp_path, strategy="replay_fork", devices=2, max_steps=2)
        t.fit(HazardNet(), loader(4))
        assert t.strategy._start_method == "fork"
        assert not marks.exists(), (
            f"the parent's exit handler ran in rank processes {marks.read_text().split()}"
        )
        assert os.path.isdir(held.name), "a rank's exit deleted the parent's TemporaryDirectory"
        assert os.path.isdir(MEDIA_TMP.name), "a rank's exit deleted wandb's staging directory"
        run = wandb.init(mode="offline", dir=str(tmp_path), project="launchers")
        try:
            run.log({"table": wandb.Table(columns=["a"], data=[[1]])})
        finally:
            run.finish()
    finally:
        atexit.unregister(_parent_exit_handler)
        held.cleanup()
