"""The dense-queue application's data: CIFAR-100 batches with per-sample augmentation seeds.

:class:`DenseQueueDataModule` serves training batches as ``(uint8 images, labels, augmentation
seeds)`` from a sampler that fixes the order and the seeds by (seed, epoch), so a run is
deterministic whatever the number of data-loader workers; the model
(:mod:`~lightning_replay.apps.dense_queue`) augments on the device. Configs name it as
``lightning_replay.apps.dense_queue.DenseQueueDataModule`` too.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_replay.apps.cifar_synth import (
    DatasetNotFound,
    has_real_cifar100,
    has_synthetic_cifar100,
    open_cifar100,
    write_synthetic_cifar100,
)


class _SeededSampler(DistributedSampler):
    """Yields ``(index, augmentation seed)``: a permutation and seeds fixed by (seed, epoch).

    A ``DistributedSampler`` (so Lightning keeps it under DDP and calls ``set_epoch``): each of
    ``num_replicas`` ranks takes every ``num_replicas``-th pair of the same global order, the
    tail that does not divide evenly dropped.
    """

    def __init__(
        self,
        indices: Sequence[int],
        seed: int,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        # DistributedSampler's __init__ wants a dataset and a process group; set its fields here
        self.indices = list(indices)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.drop_last = True
        self.num_samples = len(self.indices) // self.num_replicas
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        n = len(self.indices)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
        pairs = list(zip(order, seeds))[: self.total_size][self.rank :: self.num_replicas]
        for pos, s in pairs:
            yield self.indices[pos], s


class _Images(Dataset):
    """uint8 CHW images and labels of a torchvision CIFAR dataset; keys may carry a seed."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Any):
        if isinstance(key, tuple):
            i, seed = key
            return self.images[i], self.labels[i], seed
        return self.images[key], self.labels[key]


class DenseQueueDataModule(L.LightningDataModule):
    """CIFAR-100 (real when ``data_dir`` holds it, else synthetic in its on-disk format).

    Training batches are ``(uint8 images, labels, augmentation seeds)``; the module augments
    on the device. Evaluation batches are ``(uint8 images, labels)``.

    Args:
        data_dir: torchvision's ``root`` (the directory holding ``cifar-100-python/``).
        source: ``"auto"`` (real CIFAR-100 if present, else synthetic), ``"cifar100"`` (the
            real one; an error if missing and ``download`` is false) or ``"synthetic"``.
        download: download the real CIFAR-100 if missing (needs network; never implied).
        synthetic_train_per_class: images per class when a synthetic copy is written.
        synthetic_test_per_class: test images per class for a synthetic copy.
        synthetic_seed: the synthetic generator's seed.
        batch_size: training batch size (the last partial batch is dropped).
        eval_batch_size: validation and test batch size.
        val_size: training images held out for validation (0: no validation).
        train_size: use only this many training images (``None``: all).
        test_size: use only this many test images (``None``: all).
        num_workers: data-loader workers (results do not depend on it).
        seed: shuffling and augmentation seed.
    """

    def __init__(
        self,
        data_dir: str = "data",
        source: str = "auto",
        download: bool = False,
        synthetic_train_per_class: int = 500,
        synthetic_test_per_class: int = 100,
        synthetic_seed: int = 0,
        batch_size: int = 256,
        eval_batch_size: int = 512,
        val_size: int = 0,
        train_size: int | None = None,
        test_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if source not in ("auto", "cifar100", "synthetic"):
            raise ValueError(f"source={source!r} must be 'auto', 'cifar100' or 'synthetic'")
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError("batch_size and eval_batch_size must be >= 1")
        self.save_hyperparameters()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.description = ""

    @override
    def prepare_data(self) -> None:
        hp = self.hparams
        if hp.source != "synthetic" and (has_real_cifar100(hp.data_dir) or hp.download):
            open_cifar100(hp.data_dir, train=True, download=hp.download, source="cifar100")
            return
        if hp.source == "cifar100":
            raise DatasetNotFound(
                f"the real CIFAR-100 is not under data_dir={hp.data_dir!r}. Put "
                "cifar-100-python/ there, pass --data.download=true on a machine with network, "
                "or use --data.source=synthetic"
            )
        write_synthetic_cifar100(
            hp.data_dir,
            hp.synthetic_train_per_class,
            hp.synthetic_test_per_class,
            hp.synthetic_seed,
        )

    @override
    def setup(self, stage: str) -> None:
        hp = self.hparams
        source = hp.source
        if source == "auto":
            source = "cifar100" if has_real_cifar100(hp.data_dir) else "synthetic"
        if source == "synthetic" and not has_synthetic_cifar100(hp.data_dir):
            self.prepare_data()  # a fresh directory in a process that skipped prepare_data
        train = open_cifar100(hp.data_dir, train=True, source=source)
        test = open_cifar100(hp.data_dir, train=False, source=source)
        self.description = (
            f"{'synthetic ' if source == 'synthetic' else ''}CIFAR-100 "
            f"under {os.path.abspath(hp.data_dir)}"
        )
        images = torch.from_numpy(train.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(train.targets, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(hp.seed))
        val_idx = order[: hp.val_size]
        train_idx = order[hp.val_size :]
        if hp.train_size is not None:
            train_idx = train_idx[: hp.train_size]
        self.train_set = _Images(images, labels)
        self.train_indices = sorted(train_idx.tolist())
        self.val_set = _Images(images[val_idx], labels[val_idx]) if hp.val_size else None
        t_images = torch.from_numpy(test.data).permute(0, 3, 1, 2).contiguous()
        t_labels = torch.tensor(test.targets, dtype=torch.long)
        if hp.test_size is not None:
            t_images, t_labels = t_images[: hp.test_size], t_labels[: hp.test_size]
        self.test_set = _Images(t_images, t_labels)

    @override
    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if len(self.train_indices) < hp.batch_size:
            raise ValueError(
                f"batch_size={hp.batch_size} is larger than the "
                f"{len(self.train_indices)} training images"
            )
        trainer = self.trainer  # None when the loader is built outside a Trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = _SeededSampler(self.train_indices, hp.seed, num_replicas=world, rank=rank)
        return DataLoader(
            self.train_set,
            batch_size=hp.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> Any:
        if self.val_set is None:
            return []
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.eval_batch_size,
            num_workers=self.hparams.num_workers,
        )

    @override
    def test_dataloader(self) -> DataLoader:
        return DataLoader(
            self.test_set,
            batch_size=self.hparams.eval_batch_size,
            num_workers=self.hparams.num_workers,
        )
