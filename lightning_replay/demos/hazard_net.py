"""A LightningModule with every state hazard at once, for examples and tests (the way
``lightning.pytorch.demos`` ships ``BoringModel``).

>>> from lightning_replay.demos.hazard_net import HazardNet, hazard_loader
>>> model = HazardNet()
>>> [type(b).__name__ for b in model.blocks]
['BNBlock', 'QueueReader', 'PicklableNoiseBlock', 'MLPBlock']
>>> next(iter(hazard_loader(n_batches=1)))[0].shape
torch.Size([8, 16])
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_replay.demos.hazards import BNBlock, MLPBlock, NoiseBlock, QueueReader

DIM = 16
BATCH = 8


class PicklableNoiseBlock(NoiseBlock):
    """NoiseBlock whose private generator travels as its state: torch's multiprocessing pickler
    cannot send a ``torch.Generator`` to a spawned process ("unable to resize file")."""

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["gen"] = d["gen"].get_state().tolist()
        return d

    def __setstate__(self, d: dict) -> None:
        gen = torch.Generator()
        gen.set_state(torch.tensor(d["gen"], dtype=torch.uint8))
        d["gen"] = gen
        self.__dict__.update(d)


class HazardNet(L.LightningModule):
    """Batch norm, a MoCo-style queue read inside and enqueued after the blocks, dropout and a
    private ``torch.Generator``: every one breaks ``torch.utils.checkpoint``."""

    def __init__(self, rows: int = 32, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(
            [
                BNBlock(DIM),
                QueueReader(self, "queue", DIM),
                PicklableNoiseBlock(DIM, seed=1234 + seed),
                MLPBlock(DIM),
            ]
        )
        self.head = nn.Linear(DIM, 1)
        self.register_buffer("queue", F.normalize(torch.randn(rows, DIM), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h)
        if self.training:
            k = F.normalize(h.detach()[: BATCH // 2], dim=1)
            p = int(self.ptr)
            self.queue[p : p + k.shape[0]] = k
            self.ptr.fill_((p + k.shape[0]) % self.queue.shape[0])
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = (self(x) ** 2).mean()
        self.log("loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    # The private generator is state outside the state dict: keep it with the checkpoint so a
    # resumed run draws the same noise as an uninterrupted one.
    # (The global RNG too: Lightning does not checkpoint it, and dropout draws from it.)
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["noise_generator"] = self.blocks[2].gen.get_state()
        checkpoint["torch_rng"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.blocks[2].gen.set_state(checkpoint["noise_generator"])
        torch.set_rng_state(checkpoint["torch_rng"])


def hazard_loader(n_batches: int = 8, seed: int = 3, batch: int = BATCH) -> DataLoader:
    """Batches of random inputs for :class:`HazardNet` (no downloads)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch, DIM, generator=g)
    return DataLoader(TensorDataset(x), batch_size=batch, shuffle=False)
