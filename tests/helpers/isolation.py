"""Process-wide state a test can change and must not leak to the next one.

Torch's global switches (deterministic algorithms, default dtype, grad mode, thread count,
anomaly mode, matmul precision, cuDNN flags), the RNGs, the process environment, ``sys.path``
and wandb's process-wide settings all outlive a test: ``Trainer(deterministic=True)`` turns
deterministic algorithms on for good, Lightning's launcher resets the thread count and leaves
``MASTER_PORT`` and friends behind, and wandb keeps the mode of its first run for every later
``wandb.init``. ``tests/conftest.py`` runs every test inside :func:`isolated_globals`.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from typing import Iterator

import torch


def torch_switches() -> dict:
    """The global torch settings a test may flip."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "anomaly": torch.is_anomaly_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }


def set_torch_switches(s: dict) -> None:
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["deterministic_warn_only"])
    torch.set_default_dtype(s["default_dtype"])
    torch.set_grad_enabled(s["grad"])
    torch.set_num_threads(s["threads"])
    torch.set_anomaly_enabled(s["anomaly"])
    torch.set_float32_matmul_precision(s["matmul_precision"])
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]


def reset_wandb() -> None:
    """Finish a run left open and drop wandb's process-wide settings, so the next
    ``wandb.init`` reads ``WANDB_MODE`` afresh (else a ``disabled`` run after an ``offline``
    one still writes an offline run into the working directory)."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    if wandb.run is not None:
        wandb.finish()
    from wandb.sdk import wandb_setup

    if wandb_setup._singleton is not None:  # no public "is set up" query
        wandb.teardown()


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too
    import numpy as np

    np.random.seed(seed)


@contextlib.contextmanager
def isolated_globals(baseline: dict, seed: int = 0) -> Iterator[None]:
    """Start from ``baseline`` torch switches and seeded RNGs; on exit restore the switches,
    the environment and ``sys.path``, and reset wandb."""
    environ = dict(os.environ)
    path = list(sys.path)
    set_torch_switches(baseline)
    seed_everything(seed)
    try:
        yield
    finally:
        reset_wandb()
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        set_torch_switches(baseline)
