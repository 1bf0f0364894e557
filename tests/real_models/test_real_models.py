"""Real third-party models (torchvision, timm, HF transformers), tiny configs built in code,
trained with replay and without, compared bit for bit (issue 14).

Each model is trained the way a user would: through ``lr.install`` with a plain loop, and
through ``Trainer(strategy="replay")`` with sampled checks against a plain ``Trainer()``.
"""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_replay as lr
from lightning_replay import ReplayCallback, ReplayStrategy

from .models import GPT2_WITH_CACHE, MODELS, RealModel, build, state, train

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("torchvision")

STEPS = 4
#: Lightning runs: past the first plan (GPT-2's comes at step 5, ResNet-18's at step 8: a
#: probe, two calibration phases of a warm-up and two timed steps each) and four steps more.
TRAINER_STEPS = 12
PLANNED_STEPS = 4
SPECS = list(MODELS.values())


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])
    )


# ---------------------------------------------------------------------- framework-free
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_install_is_exact(spec: RealModel) -> None:
    """Every gradient of every step and the final weights and buffers equal plain training's,
    with every segment really replayed."""
    ref = build(spec)
    model = copy.deepcopy(ref)
    engine = lr.install(model, spec.segments, preservation="auto", on_violation="raise")
    grads = train(model, spec, STEPS)
    ref_grads = train(ref, spec, STEPS)
    for step, (want, got) in enumerate(zip(ref_grads, grads)):
        assert _differing(want, got) == [], f"step {step}"
    assert _differing(state(ref), state(model)) == []
    assert all(s["replays"] == STEPS - 1 for s in engine.summary().values()), engine.summary()
    engine.uninstall()


# ---------------------------------------------------------------------- Lightning
class LitReal(L.LightningModule):
    """A real model under Lightning: the loss its own training would use, plain SGD."""

    def __init__(self, spec: RealModel) -> None:
        super().__init__()
        self.spec = spec
        self.net = build(spec)

    def training_step(self, batch, batch_idx):
        return self.spec.loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(spec: RealModel, steps: int) -> DataLoader:
    return DataLoader([spec.batch(i) for i in range(steps)], batch_size=None)


def _fit(spec: RealModel, root, steps: int = STEPS, **kwargs) -> tuple[L.Trainer, LitReal]:
    L.seed_everything(7)
    module = LitReal(spec)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kwargs,
    )
    trainer.fit(module, _loader(spec, steps))
    return trainer, module


class _PlannedSteps(L.Callback):
    """The steps that ran with a plan in force (the plan is applied as a window begins)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.engine.window_stats()["plan_version"] > 0:
            self.steps.append(trainer.global_step)


def _assert_trainer_matches(spec: RealModel, tmp_path, **kwargs) -> L.Trainer:
    _, ref = _fit(spec, tmp_path / "plain", steps=TRAINER_STEPS, **kwargs)
    planned = _PlannedSteps()
    t, model = _fit(
        spec,
        tmp_path / "replay",
        steps=TRAINER_STEPS,
        strategy="replay",
        callbacks=[ReplayCallback(check_every_n_steps=2), planned],
        **kwargs,
    )
    # the comparison covers steps trained under the plan, not only the probe and calibration
    assert len(planned.steps) >= PLANNED_STEPS, (planned.steps, t.strategy.engine.plan)
    assert _differing(state(ref), state(model)) == []
    summary = t.strategy.engine.summary()
    assert all(s["replays"] >= 1 for s in summary.values()), summary
    records = t.strategy.engine.records.read()
    checks = [r for r in records if r.check in ("grad", "bytes")]
    assert {r.check for r in checks} == {"grad", "bytes"}
    assert {r.segment for r in checks if r.check == "grad"} == set(summary)
    assert [r for r in records if r.outcome != "match"] == []
    return t


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_trainer_replay_matches_plain_trainer(spec: RealModel, tmp_path) -> None:
    _assert_trainer_matches(spec, tmp_path)


def test_trainer_replay_matches_plain_trainer_in_bf16_mixed(tmp_path) -> None:
    _assert_trainer_matches(MODELS["gpt2"], tmp_path, precision="bf16-mixed")


def test_resnet18_auto_segments_follow_activation_bytes(tmp_path, caplog) -> None:
    """Issue 14, item 4: every residual block, layer1's (which hold the most activation
    bytes) included, each printed with its measured share."""
    with caplog.at_level(logging.INFO):
        t, _ = _fit(MODELS["resnet18"], tmp_path, steps=1, strategy="replay")
    names = t.strategy.segment_names
    assert names == [f"net.layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    shares = t.strategy.activation_shares
    assert sum(shares.values()) == pytest.approx(1.0)
    stages = {i: shares[f"net.layer{i}.0"] + shares[f"net.layer{i}.1"] for i in range(1, 5)}
    assert max(stages, key=stages.get) == 1, stages  # the widest maps hold the most
    for name, share in shares.items():
        assert f"{name} " in caplog.text and f"({share:.1%})" in caplog.text


def test_hf_cache_is_refused_at_the_first_step_naming_the_fix(tmp_path) -> None:
    """GPT-2 at its default use_cache=True passes a mutable cache object into every layer,
    which a replay would append to a second time: stop at step one with the fix."""
    with pytest.raises(lr.ReplayError, match="use_cache") as info:
        _fit(
            GPT2_WITH_CACHE,
            tmp_path,
            strategy=ReplayStrategy(),
            callbacks=[ReplayCallback(check_every_n_steps=2)],
        )
    assert "transformer.h.0" in str(info.value)


def test_hf_cache_is_refused_by_install() -> None:
    model = build(GPT2_WITH_CACHE)
    lr.install(model, GPT2_WITH_CACHE.segments)
    with pytest.raises(lr.ReplayError, match="use_cache"):
        train(model, GPT2_WITH_CACHE, 1)
