"""Test helpers (the comparison itself lives in lightning_replay.verify)."""
from __future__ import annotations

import copy

from torch import nn

from lightning_replay.verify import (diff_state, grad_diffs, snapshot_state, torch_checkpoint,
                                     train_steps)

grads_equal = grad_diffs

__all__ = ["assert_same_state", "clone_model", "grads_equal", "snapshot_state",
           "torch_checkpoint", "train_steps"]


def assert_same_state(a: dict, b: dict, what: str = "") -> None:
    bad = diff_state(a, b)
    assert not bad, f"{what}: state differs: {bad}"


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
