"""A LightningModule that shards itself with FSDP2, for ``Trainer(strategy="replay_fsdp")``.

:class:`ShardedDemoNet` is a stack of residual blocks, each with batch norm (running statistics
written inside the block: state a replay must not update twice) and dropout; its
``configure_model`` shards each block with ``fully_shard`` and then the root, as Lightning's
``ModelParallelStrategy`` expects. :class:`ShardedDemoData` serves random regression data, so
``configs/replay_fsdp_cpu.yaml`` runs anywhere without downloads.

>>> from lightning_replay.demos.sharded import ShardedDemoData, ShardedDemoNet
>>> model = ShardedDemoNet(blocks=3, dim=16)
>>> [type(b).__name__ for b in model.blocks]
['ResidualBNBlock', 'ResidualBNBlock', 'ResidualBNBlock']
>>> data = ShardedDemoData(dim=16, batch_size=8, n_batches=2)
>>> next(iter(data.train_dataloader()))[0].shape
torch.Size([8, 16])
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ResidualBNBlock(nn.Module):
    """``x + dropout(relu(bn(linear(x))))``: a block with state (batch-norm statistics)."""

    def __init__(self, dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.fc(x))))


class ShardedDemoNet(L.LightningModule):
    """Residual batch-norm blocks and a linear head, sharded in ``configure_model``.

    Args:
        blocks: how many blocks (each one FSDP unit, and one replay segment).
        dim: width of the blocks and of the input.
        dropout: dropout probability in each block.
        lr: SGD learning rate (momentum 0.9).
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for every unit.
    """

    def __init__(
        self,
        blocks: int = 4,
        dim: int = 64,
        dropout: float = 0.1,
        lr: float = 0.05,
        reshard_after_forward: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.ModuleList([ResidualBNBlock(dim, dropout) for _ in range(blocks)])
        self.head = nn.Linear(dim, 1)

    def configure_model(self) -> None:
        """Shard each block, then the root, over the data-parallel mesh (FSDP2)."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        reshard = self.hparams.reshard_after_forward
        for block in self.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(self, mesh=mesh, reshard_after_forward=reshard)

    def configure_replay_segments(self) -> str:
        """The blocks: each is its own FSDP unit."""
        return "blocks.*"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).squeeze(-1), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class ShardedDemoData(L.LightningDataModule):
    """Random inputs and a fixed random linear target (seeded: every rank builds the same).

    Args:
        dim: input width (equal to the model's ``dim``).
        batch_size: batch size per process.
        n_batches: batches in the dataset.
        seed: the data's seed.
    """

    def __init__(
        self, dim: int = 64, batch_size: int = 32, n_batches: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        self.dim, self.batch_size, self.n_batches, self.seed = dim, batch_size, n_batches, seed

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.n_batches * self.batch_size, self.dim, generator=g)
        w = torch.randn(self.dim, generator=g) / self.dim**0.5
        return DataLoader(TensorDataset(x, x @ w), batch_size=self.batch_size, shuffle=False)
