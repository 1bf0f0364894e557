"""The strategies' ``selective=`` argument: validated up front, and a selective plan under
``Trainer(strategy=...)`` trains exactly as a plain Trainer does.

The referee is a plain ``Trainer`` (no recomputation) from the same seed.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_replay import ReplayConfigError, ReplayStrategy
from lightning_replay.contract import SELECTIVE
from lightning_replay.strategies.replay import _config_of
from lightning_replay.strategies.replay_fsdp import ReplayFSDPStrategy
from tests.helpers.lit_hazards import HazardNet, differing, loader, state, trainer


@pytest.mark.parametrize("cls", [ReplayStrategy, ReplayFSDPStrategy])
@pytest.mark.parametrize(
    "value, match",
    [
        ("matmull", r"selective='matmull'\) is not known; use one of \['matmul'"),
        (True, r"selective=True\) is not known"),
    ],
)
def test_a_bad_selective_policy_is_refused_naming_the_argument(cls, value, match):
    with pytest.raises(ReplayConfigError, match=cls.__name__ + r"\(" + match):
        cls(selective=value)


@pytest.mark.parametrize("cls", [ReplayStrategy, ReplayFSDPStrategy])
def test_the_policy_reaches_the_engine_config(cls):
    s = cls(selective="every_other_matmul", budget="min")
    config = _config_of(s)
    assert config.selective == config.selective_policy == "every_other_matmul"
    assert _config_of(cls()).selective_policy is None
    # a pin alone turns selective replays on, under torchtitan's policy
    assert _config_of(cls(preservation="selective")).selective_policy == "matmul"


STEPS = 14  # the first plan runs at step 10 (probe, 4 calibration phases of 2)


class _Seen(L.Callback):
    """Per step: each segment's mode and replay count, and the kept bytes measured."""

    def __init__(self):
        self.modes = []

    def on_train_batch_end(self, trainer, *args):
        engine = trainer.strategy.engine
        self.modes.append({n: (s["mode"], s["replays"]) for n, s in engine.summary().items()})


@pytest.mark.parametrize(
    "policy, how",
    [("matmul", "pinned"), ("every_other_matmul", "pinned"), ("matmul", "planned")],
)
def test_a_selective_plan_under_the_strategy_matches_plain_trainer(tmp_path, policy, how):
    """Queue + batch norm + dropout + private generator, every segment pinned to a
    selective replay: weights, buffers and generator state after 14 steps equal a plain
    Trainer's."""
    ref = HazardNet()
    L.seed_everything(7)
    trainer(tmp_path, max_steps=STEPS).fit(ref, loader(STEPS))

    model = HazardNet()
    seen = _Seen()
    L.seed_everything(7)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(preservation="selective", selective=policy, calibration_steps=1)
        if how == "pinned"
        else ReplayStrategy(planner="selective_all", selective=policy, calibration_steps=1),
        max_steps=STEPS,
        callbacks=[seen],
    )
    t.fit(model, loader(STEPS))

    assert differing(state(ref), state(model)) == []
    assert torch.equal(ref.blocks[2].gen.get_state(), model.blocks[2].gen.get_state())
    engine = t.strategy.engine
    if how == "planned":
        assert engine.plan is not None
        assert set(engine.plan.choices.values()) <= set(SELECTIVE), engine.plan.choices
        assert engine.steps_to_first_plan <= STEPS - 4  # the plan trained 4 steps or more
    last = seen.modes[-1]
    assert all(mode in SELECTIVE and replays >= 2 for mode, replays in last.values()), last
    # the replays really kept outputs (products of the blocks' linears)
    assert all(engine.meter.selective_bytes.get(n, 0) > 0 for n in last), (
        engine.meter.selective_bytes
    )


class CheckEvery(L.Callback):
    """Derivative and byte checks every ``every`` steps (pinned segments: no plan needed)."""

    def __init__(self, every):
        self.every = every

    def on_train_batch_start(self, trainer, *args):
        engine = trainer.strategy.engine
        if engine.step >= 1 and (engine.step + 1) % self.every == 0:
            engine.request_check(grad=True, bytes=True)


def test_fsdp_two_ranks_with_selective_replays_match_plain_model_parallel(tmp_path):
    """ReplayFSDPStrategy(preservation="selective") on two spawned ranks: weights, batch-norm
    stats and the queue after 10 steps equal plain ModelParallelStrategy's, every block
    replayed selectively, and the derivative and byte checks (which replay selectively with
    the kept outputs) all match on both ranks."""
    import sqlite3

    from tests.strategies.test_replay_fsdp import FSDPNet, fit, reference, replay_fsdp
    from tests.strategies.test_replay_fsdp import differing as differ

    L.seed_everything(7)
    want = fit(tmp_path / "plain", reference(), FSDPNet(), steps=10)
    L.seed_everything(7)
    records = tmp_path / "records.sqlite"
    got = fit(
        tmp_path / "replay",
        replay_fsdp(
            records=records, calibration_steps=1, preservation="selective", selective="matmul"
        ),
        FSDPNet(),
        steps=10,
        callbacks=[CheckEvery(3)],
    )
    for r in (0, 1):
        assert differ(want[r]["state"], got[r]["state"]) == [], f"rank {r}"
        assert want[r]["losses"] == got[r]["losses"], f"rank {r}"
        summary = got[r]["summary"]
        assert all(s["mode"] in SELECTIVE and s["replays"] >= 3 for s in summary.values()), summary
    with sqlite3.connect(records) as db:
        rows = db.execute('SELECT rank, "check", outcome FROM records').fetchall()
    assert {(r, c) for r, c, o in rows if o == "match"} >= {(0, "grad"), (1, "grad")}
    assert [row for row in rows if row[2] != "match"] == []
