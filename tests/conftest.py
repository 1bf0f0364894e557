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
