"""The sparse-write workload: where keeping only the overwritten regions pays off.

Each block has large activations (a wide MLP) and reads a large per-block memory buffer densely
inside its segment (soft attention over all rows). After all blocks have run, the step writes a
few rows of every buffer (data-dependent ``index_copy_``). Replaying a block needs its buffer as
the forward saw it: ``whole`` keeps a copy of the full buffer per block, ``regions`` keeps only
the rows the step overwrote.

``SparseWriteModel`` is the plain ``nn.Module``; ``SparseWriteModule`` and
``SparseWriteDataModule`` wrap it for Lightning (``configs/sparse_write.yaml``).

Example:
    >>> m = SparseWriteModel(blocks=2, dim=32, hidden=64, buffer_rows=128, write_rows=4)
    >>> m(torch.randn(8, 32)).shape
    torch.Size([8, 1])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseWriteBlock(nn.Module):
    """Wide MLP plus dense soft attention over its own memory buffer."""

    def __init__(self, dim: int, hidden: int, buffer_rows: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.query = nn.Linear(dim, dim)
        self.register_buffer("memory", torch.randn(buffer_rows, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(x)))
        # A copy, as MoCo reads its queue: backward needs the rows this forward read, and the
        # step overwrites some of them before backward (plain PyTorch rejects reading the
        # buffer itself; lightning_replay raises SavedTensorModified for it).
        mem = self.memory.clone()
        attn = torch.softmax(self.query(x) @ mem.t(), dim=-1)
        return x + h + attn @ mem


class SparseWriteModel(nn.Module):
    """``blocks`` sparse-write blocks, then a few rows of every buffer are overwritten.

    Args:
        blocks: number of blocks (segments ``blocks.0`` ... ``blocks.{n-1}``).
        dim: model width.
        hidden: MLP width (sets the activation bytes per block).
        buffer_rows: rows of each block's buffer (sets the ``whole`` snapshot bytes).
        write_rows: rows written per buffer per step (sets the ``regions`` bytes).
    """

    def __init__(
        self,
        blocks: int = 4,
        dim: int = 128,
        hidden: int = 1024,
        buffer_rows: int = 8192,
        write_rows: int = 16,
    ) -> None:
        super().__init__()
        if not 0 < write_rows <= buffer_rows:
            raise ValueError(f"write_rows={write_rows} must be in 1..buffer_rows={buffer_rows}")
        self.blocks = nn.ModuleList(
            SparseWriteBlock(dim, hidden, buffer_rows) for _ in range(blocks)
        )
        self.head = nn.Linear(dim, 1)
        self.write_rows = write_rows

    @property
    def segments(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            h = b(h)
        self.write(h.detach())
        return self.head(h)

    @torch.no_grad()
    def write(self, h: torch.Tensor) -> None:
        """Overwrite ``write_rows`` data-dependent rows of every buffer."""
        rows = h[: self.write_rows]
        for b in self.blocks:
            n = b.memory.shape[0]
            idx = (rows[:, 0].abs() * 1e4).long() % n
            b.memory.index_copy_(0, idx, F.normalize(rows, dim=1))


def sparse_write_input(step: int, batch: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, dim, generator=g)


try:  # the Lightning shells; the model above never needs Lightning
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    class _Synthetic(Dataset):
        def __init__(self, n: int, dim: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, dim, generator=g)
            self.y = torch.tanh(self.x[:, :1] * 2 - self.x[:, 1:2])

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):
            return self.x[i], self.y[i]

    class SparseWriteDataModule(L.LightningDataModule):
        """Synthetic regression data sized for the sparse-write model."""

        def __init__(
            self,
            dim: int = 128,
            batch_size: int = 256,
            train_size: int = 4096,
            val_size: int = 512,
            seed: int = 0,
        ) -> None:
            super().__init__()
            self.save_hyperparameters()

        def setup(self, stage: str | None = None) -> None:
            hp = self.hparams
            self.train_set = _Synthetic(hp.train_size, hp.dim, hp.seed)
            self.val_set = _Synthetic(hp.val_size, hp.dim, hp.seed + 1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=False)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

        def test_dataloader(self) -> DataLoader:
            return self.val_dataloader()

    class SparseWriteModule(L.LightningModule):
        """LightningModule around :class:`SparseWriteModel` (segments: its blocks)."""

        def __init__(
            self,
            blocks: int = 4,
            dim: int = 128,
            hidden: int = 1024,
            buffer_rows: int = 8192,
            write_rows: int = 16,
            lr: float = 0.01,
        ) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = SparseWriteModel(blocks, dim, hidden, buffer_rows, write_rows)

        def configure_replay_segments(self) -> list[str]:
            return [f"model.{s}" for s in self.model.segments]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", F.mse_loss(self(x), y))

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test/loss", F.mse_loss(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
except ImportError:  # pragma: no cover - lightning is a dependency, but keep the core usable
    pass
