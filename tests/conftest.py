import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_environ():
    """Lightning's launchers leave MASTER_PORT, LOCAL_RANK, NODE_RANK... in the test process;
    a later Trainer would take them for an external launcher's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
