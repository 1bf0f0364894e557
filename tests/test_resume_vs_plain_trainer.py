"""Resuming a replay run from a checkpoint trains exactly what plain Lightning trains.

The reference is plain ``Trainer()`` training interrupted and resumed at the same step — no
replay code on that side — so a resume path that is wrong in the same way for an interrupted
and an uninterrupted replay run cannot pass. (Lightning's own mid-epoch resume replays the
epoch's first batches; the plain run does the same, so the comparison stays fair.)
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_replay import ReplayCallback, ReplayStrategy
from tests.helpers.lit_hazards import HazardNet, OneThreadInChild, differing, loader, state, trainer

BATCHES = 6  # per epoch
#: Rows per batch: a HazardNet block's activations (8-20 KiB) outweigh the 5,056 bytes of CPU
#: RNG state a replayed call holds, so the resumed run's plan replays blocks and checks them.
BATCH = 64


def _interrupted_and_resumed(root, stop_at: int, replay: bool, devices: int = 1):
    """Train to step ``stop_at``, checkpoint, resume in a fresh Trainer and model (other
    initial weights: what it trains must come from the checkpoint) to two epochs."""

    def make(**kw):
        if not replay:
            if devices == 1:
                return trainer(root, **kw)
            return trainer(
                root, strategy="ddp_fork", devices=devices, callbacks=[OneThreadInChild()], **kw
            )
        strategy = ReplayStrategy(
            calibration_steps=1, start_method="fork" if devices > 1 else "popen"
        )
        return trainer(
            root,
            strategy=strategy,
            devices=devices,
            callbacks=[ReplayCallback(check_every_n_steps=3)],
            **kw,
        )

    L.seed_everything(7)
    first = HazardNet()
    t1 = make(max_steps=stop_at)
    t1.fit(first, loader(BATCHES, batch=BATCH))
    ckpt = root / "interrupted.ckpt"
    t1.save_checkpoint(ckpt)

    L.seed_everything(99)
    resumed = HazardNet(seed=5)
    t2 = make(max_steps=-1, max_epochs=2)
    t2.fit(resumed, loader(BATCHES, batch=BATCH), ckpt_path=ckpt)
    return resumed, t2


@pytest.mark.parametrize("stop_at", [BATCHES, 4], ids=["epoch-boundary", "mid-epoch"])
def test_resumed_replay_run_equals_resumed_plain_trainer(tmp_path, stop_at):
    (tmp_path / "plain").mkdir(), (tmp_path / "replay").mkdir()
    plain, t_plain = _interrupted_and_resumed(tmp_path / "plain", stop_at, replay=False)
    model, t = _interrupted_and_resumed(tmp_path / "replay", stop_at, replay=True)

    assert t.global_step == t_plain.global_step
    assert differing(state(plain), state(model)) == []
    assert torch.equal(plain.blocks[2].gen.get_state(), model.blocks[2].gen.get_state())
    # not vacuous: the resumed run replayed its segments and checked them, all matching
    summary = t.strategy.engine.summary()
    assert all(s["replays"] > 0 for s in summary.values()), summary
    records = t.strategy.engine.records.read()
    assert any(r.check == "grad" and r.step > stop_at for r in records)
    assert not [r for r in records if r.outcome == "divergence"]


def test_resumed_two_rank_replay_run_equals_resumed_plain_ddp(tmp_path):
    """Two ranks (fork): rank 0's weights after resuming equal plain ``ddp_fork``'s."""
    (tmp_path / "plain").mkdir(), (tmp_path / "replay").mkdir()
    plain, _ = _interrupted_and_resumed(tmp_path / "plain", 3, replay=False, devices=2)
    model, _ = _interrupted_and_resumed(tmp_path / "replay", 3, replay=True, devices=2)
    untrained = state(HazardNet(seed=5))
    assert "head.weight" in differing(untrained, state(plain))  # rank 0's weights came back
    assert differing(state(plain), state(model)) == []
