"""Helpers to train the demo LightningModules, and fault-injecting ones, shared by the Lightning
tests (:class:`HazardNet` itself lives in :mod:`lightning_replay.demos.hazard_net`)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_replay.demos.hazard_net import BATCH, DIM, HazardNet, PicklableNoiseBlock
from lightning_replay.demos.hazard_net import hazard_loader as loader
from lightning_replay.demos.hazards import MLPBlock

__all__ = ["BATCH", "DIM", "HazardNet", "PicklableNoiseBlock", "loader"]  # shared by the tests


def trainer(
    root: str | os.PathLike, strategy: Any = "auto", max_steps: int = 6, **kwargs: Any
) -> L.Trainer:
    """A quiet CPU trainer."""
    opts = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    opts.update(kwargs)
    return L.Trainer(strategy=strategy, **opts)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights and buffers (the state dict), detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def differing(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bit-identical (or missing on one side)."""
    return sorted(
        k
        for k in a.keys() | b.keys()
        if k not in a
        or k not in b
        or a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(a[k], b[k])
    )


class SaveRankState(L.Callback):
    """Saves each rank's weights, buffers, generator state and engine summary at train end."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = str(out_dir)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        torch.save(
            {
                "state": state(pl_module),
                "gen": pl_module.blocks[2].gen.get_state(),
                "summary": engine.summary() if engine is not None else None,
                "plan": engine.plan.to_dict() if engine is not None and engine.plan else None,
                "plan_version": engine.plan_version if engine is not None else None,
                "metrics": {
                    k: float(v)
                    for k, v in trainer.callback_metrics.items()
                    if k.startswith("replay/")
                },
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


class Temperature:
    """A tensor that lives outside the model (not a module, not in the state dict)."""

    def __init__(self) -> None:
        self.value = torch.full((DIM,), 1.0)


class TemperatureBlock(nn.Module):
    def __init__(self, temperature: Temperature) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        object.__setattr__(self, "_temperature", temperature)  # a plain reference, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) * self._temperature.value)


class OutsideStateNet(L.LightningModule):
    """A block reads a temperature held outside the model; ``on_before_backward`` changes it
    through ``.data`` (no version bump) at the steps in ``bump_at`` - after the segment's
    forward and before its replay. No contract can restore that."""

    def __init__(self, bump_at: tuple[int, ...] = (), seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.temperature = Temperature()
        self.blocks = nn.Sequential(
            MLPBlock(DIM), TemperatureBlock(self.temperature), MLPBlock(DIM)
        )
        self.head = nn.Linear(DIM, 1)
        self.bump_at = tuple(bump_at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return (self(x) ** 2).mean()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.global_step in self.bump_at:
            self.temperature.value.data.mul_(1.5)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OneThreadInChild(L.Callback):
    """For plain ``ddp_fork`` references: a forked child deadlocks in its first parallel CPU
    kernel once the parent has used its OpenMP pool (ReplayStrategy does the same itself)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


class ShiftBlock(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        object.__setattr__(self, "_owner", owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + self._owner.shift)


class ViolationNet(L.LightningModule):
    """A buffer read by a segment is constant while probed, then changed in place (a version
    bump) between the segment's forward and its replay at the steps in ``bump_at``: a contract
    violation, recorded as a rejection and answered by a new contract version."""

    def __init__(self, bump_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("shift", torch.zeros(DIM))
        self.blocks = nn.ModuleList([MLPBlock(DIM), ShiftBlock(self), MLPBlock(DIM)])
        self.head = nn.Linear(DIM, 1)
        self.bump_at = tuple(bump_at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self(batch[0]) ** 2).mean()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.global_step in self.bump_at:
            self.shift.add_(0.5)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
