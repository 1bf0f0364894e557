"""Compare a model trained with recomputation against the same model trained without it.

The comparison itself lives in :mod:`lightning_replay.verify` (public, so users can run it on
their own models); these are the assertion forms the tests use.
"""

from __future__ import annotations

import copy

from torch import nn

from lightning_replay.verify import (
    diff_state,
    grad_diffs,
    snapshot_state,
    torch_checkpoint,
    train_steps,
)

__all__ = [
    "assert_same_grads",
    "assert_same_state",
    "clone_model",
    "diff_state",
    "grad_diffs",
    "snapshot_state",
    "torch_checkpoint",
    "train_steps",
]


def assert_same_grads(ga: list[dict], gb: list[dict], what: str = "") -> None:
    """Every step's gradients are bit-identical (same names, same steps)."""
    assert len(ga) == len(gb), f"{what}: {len(ga)} steps against {len(gb)}"
    bad = grad_diffs(ga, gb)
    assert not bad, f"{what}: gradients differ at (step, parameter) {bad[:10]}"


def assert_same_state(a: dict, b: dict, what: str = "") -> None:
    """Two :func:`snapshot_state` results are identical, bit for bit."""
    bad = diff_state(a, b)
    assert not bad, f"{what}: state differs: {bad}"


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
