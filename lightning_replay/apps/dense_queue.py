"""The dense-queue application: MoCo-v2-style contrastive learning on CIFAR-100, then a linear probe.

A query encoder (a CIFAR ResNet built from torchvision's ``BasicBlock``, plus a two-layer MLP
projector) and a momentum key encoder (an exponential moving average of it) embed two
augmentations of each image. :class:`QueueInfoNCE` scores each query against its key and
against a dense queue of ``queue_size`` keys from earlier steps, then the step's keys are
enqueued — the queue is read (all of it) inside the loss and overwritten after it, every step.
That, and the batch-norm statistics the ResNet stages write, is what replay has to get right:

* segments (``configure_replay_segments``): the four ResNet stages of the query encoder and the
  loss module ``criterion`` (which reads the queue);
* ``torch.utils.checkpoint`` on the same segments replays the loss against the queue as it is
  *after* the enqueue and updates the batch-norm statistics twice per step.

One ``fit`` runs ``encoder_epochs`` epochs of contrastive training, then the remaining epochs
up to ``trainer.max_epochs`` train a linear probe on the frozen encoder's features (the encoder
in eval mode, no gradients); ``test`` scores the probe's top-1 on the test split with
torchmetrics. Augmentation runs batched on the device from per-sample seeds that the sampler
draws, so a run is deterministic whatever the number of data-loader workers.

The encoder, the momentum encoder, the queue loss, the linear probe and their LightningModule
are kept in one place for readers of the study; the data (CIFAR-100 and the seeded sampler) is
in :mod:`~lightning_replay.apps.dense_queue_data`, importable from here as before.

Example:
    >>> import lightning as L
    >>> model = DenseQueueModule(layers=(1, 1, 1, 1), width=8, queue_size=64)
    >>> model.configure_replay_segments()
    ['encoder_q.backbone.layer*', 'criterion']
"""

from __future__ import annotations

import copy
import hashlib
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import BasicBlock
from torchvision.ops import roi_align

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_replay.apps.torch_recompute import (
    DEFAULT_SAC_OPS,
    METHODS as RECOMPUTE_METHODS,
    apply_torch_recompute,
)

from lightning_replay.apps.dense_queue_data import (  # (importable from here as before)
    DenseQueueDataModule as DenseQueueDataModule,
    _Images as _Images,
    _SeededSampler as _SeededSampler,
)

__all__ = [
    "CifarResNet",
    "MoCoEncoder",
    "QueueInfoNCE",
    "BatchAugment",
    "DenseQueueModule",
    "DenseQueueDataModule",
    "weights_digest",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DEFAULT_SEGMENTS",
]

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
DEFAULT_SEGMENTS = ("encoder_q.backbone.layer*", "criterion")


# ------------------------------------------------------------------------------------ model
class CifarResNet(nn.Module):
    """A ResNet for 32x32 images from torchvision's ``BasicBlock``: 3x3 stem, no max-pool.

    torchvision's ``resnet18`` itself cannot be used as is: its 7x7 stride-2 stem and max-pool
    shrink a 32x32 image to 8x8 before the first stage, and its stage widths are fixed.

    With ``layers=(2, 2, 2, 2)`` and ``width=64`` this is torchvision's ResNet-18 with the usual
    CIFAR stem (the layout MoCo's CIFAR recipes use); ``(3, 4, 6, 3)`` is ResNet-34. Smaller
    ``width`` scales every stage (``width``, ``2 width``, ``4 width``, ``8 width`` channels).

    Args:
        layers: blocks per stage (four stages).
        width: channels of the first stage.

    Example:
        >>> net = CifarResNet(layers=(1, 1, 1, 1), width=8)
        >>> net(torch.zeros(2, 3, 32, 32)).shape, net.feature_dim
        (torch.Size([2, 64]), 64)
    """

    def __init__(self, layers: Sequence[int] = (2, 2, 2, 2), width: int = 64) -> None:
        super().__init__()
        layers = tuple(int(n) for n in layers)
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"layers={layers!r} must be four positive block counts")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r} must be a positive int")
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        inplanes = width
        for i, n in enumerate(layers):
            planes = width * 2**i
            stride = 1 if i == 0 else 2
            blocks = []
            for _ in range(n):
                down = None
                if stride != 1 or inplanes != planes:
                    down = nn.Sequential(
                        nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
                    )
                blocks.append(BasicBlock(inplanes, planes, stride, down))
                inplanes, stride = planes, 1
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.feature_dim = inplanes
        for m in self.modules():  # torchvision's ResNet initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # global average pool as a mean: adaptive_avg_pool2d's CUDA backward has no
        # deterministic implementation, and every run of the study must be bit-reproducible
        return x.mean(dim=(2, 3))


class MoCoEncoder(nn.Module):
    """Backbone plus MoCo v2's MLP projector; outputs unit-length embeddings."""

    def __init__(self, layers: Sequence[int], width: int, proj_dim: int) -> None:
        super().__init__()
        self.backbone = CifarResNet(layers, width)
        d = self.backbone.feature_dim
        self.projector = nn.Sequential(
            nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, proj_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.projector(self.backbone(x)), dim=1)


class QueueInfoNCE(nn.Module):
    """InfoNCE against the key and a dense queue of earlier keys; :meth:`enqueue` after.

    The queue is a ``[dim, queue_size]`` buffer read whole by every forward (as MoCo does, a
    detached clone) and written ``batch`` columns at a time by :meth:`enqueue`.

    Example:
        >>> crit = QueueInfoNCE(dim=4, queue_size=8, temperature=0.2)
        >>> q = F.normalize(torch.randn(2, 4), dim=1)
        >>> k = F.normalize(torch.randn(2, 4), dim=1)
        >>> loss = crit(q, k); crit.enqueue(k)
        >>> int(crit.queue_ptr), torch.equal(crit.queue[:, :2], k.t())
        (2, True)
    """

    def __init__(self, dim: int, queue_size: int, temperature: float) -> None:
        super().__init__()
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size!r} must be >= 1")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        self.temperature = float(temperature)
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        l_pos = (q * k).sum(dim=1, keepdim=True)
        l_neg = q @ self.queue.clone().detach()
        logits = torch.cat([l_pos, l_neg], dim=1) / self.temperature
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits, labels)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Write ``keys`` (``[batch, dim]``) over the oldest columns of the queue."""
        size = self.queue.shape[1]
        keys = keys[-size:]
        ptr = int(self.queue_ptr)
        n = keys.shape[0]
        first = min(n, size - ptr)
        self.queue[:, ptr : ptr + first] = keys[:first].t()
        if first < n:  # wrap around
            self.queue[:, : n - first] = keys[first:].t()
        self.queue_ptr.fill_((ptr + n) % size)


class BatchAugment(nn.Module):
    """MoCo v2's CIFAR augmentation, batched on the device, driven by an explicit generator.

    Random resized crop (scale ``(crop_min_scale, 1)``, ratio ``(3/4, 4/3)``; bilinear via
    ``torchvision.ops.roi_align``), horizontal flip, colour jitter (brightness, contrast,
    saturation 0.4, hue 0.1; probability 0.8), grayscale (probability 0.2), then CIFAR-100
    normalization. ``light=True`` keeps only crop and flip (the linear probe's augmentation).
    """

    def __init__(self, image_size: int = 32, crop_min_scale: float = 0.2) -> None:
        super().__init__()
        if not 0 < crop_min_scale <= 1:
            raise ValueError(f"crop_min_scale={crop_min_scale!r} must be in (0, 1]")
        self.image_size = int(image_size)
        self.crop_min_scale = float(crop_min_scale)
        self.register_buffer("mean", torch.tensor(CIFAR100_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(CIFAR100_STD).view(1, 3, 1, 1), persistent=False)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 or [0, 1] images to normalized float, resized to ``image_size`` if needed."""
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(
                x,
                size=(self.image_size, self.image_size),
                mode="bilinear",
                align_corners=False,
                antialias=True,
            )
        return (x - self.mean) / self.std

    @torch.no_grad()
    def forward(
        self, images: torch.Tensor, gen: torch.Generator, light: bool = False
    ) -> torch.Tensor:
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        b, _, h, w = x.shape
        dev = x.device

        def rand(*shape):  # draws on the generator's device (CPU), then moves
            return torch.rand(*shape, generator=gen).to(dev)

        area = h * w * (self.crop_min_scale + (1 - self.crop_min_scale) * rand(b))
        log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * rand(b)
        ratio = torch.exp(log_ratio)
        cw = torch.sqrt(area * ratio).clamp(1, w)
        ch = torch.sqrt(area / ratio).clamp(1, h)
        x0 = (w - cw) * rand(b)
        y0 = (h - ch) * rand(b)
        boxes = torch.stack(
            [torch.arange(b, device=dev, dtype=x.dtype), x0, y0, x0 + cw, y0 + ch], dim=1
        )
        x = roi_align(
            x,
            boxes,
            output_size=(self.image_size, self.image_size),
            spatial_scale=1.0,
            sampling_ratio=2,
            aligned=True,
        )
        flip = rand(b) < 0.5
        x = torch.where(flip.view(b, 1, 1, 1), x.flip(-1), x)
        if not light:
            x = self._jitter(x, rand)
            gray = (rand(b) < 0.2).view(b, 1, 1, 1)
            x = torch.where(gray, _grayscale(x).expand_as(x), x)
        return (x.clamp(0, 1) - self.mean) / self.std

    @staticmethod
    def _jitter(x: torch.Tensor, rand) -> torch.Tensor:
        b = x.shape[0]
        apply = (rand(b) < 0.8).view(b, 1, 1, 1)
        bright = (0.6 + 0.8 * rand(b)).view(b, 1, 1, 1)
        contrast = (0.6 + 0.8 * rand(b)).view(b, 1, 1, 1)
        sat = (0.6 + 0.8 * rand(b)).view(b, 1, 1, 1)
        hue = (-0.1 + 0.2 * rand(b)) * (2 * math.pi)
        y = (x * bright).clamp(0, 1)
        mean = _grayscale(y).mean(dim=(1, 2, 3), keepdim=True)
        y = ((y - mean) * contrast + mean).clamp(0, 1)
        g = _grayscale(y)
        y = ((y - g) * sat + g).clamp(0, 1)
        y = _rotate_hue(y, hue).clamp(0, 1)
        return torch.where(apply, y, x)


def _grayscale(x: torch.Tensor) -> torch.Tensor:
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def _rotate_hue(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate hue by ``angle`` radians per image (a rotation of the YIQ chroma plane)."""
    m = _RGB2YIQ.to(x)
    minv = torch.linalg.inv(m)
    yiq = torch.einsum("ij,bjhw->bihw", m, x)
    c, s = torch.cos(angle).view(-1, 1, 1), torch.sin(angle).view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], c * i - s * q, s * i + c * q], dim=1)
    return torch.einsum("ij,bjhw->bihw", minv, yiq)


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of a module's ``state_dict`` (names, dtypes, shapes and bytes, in key order).

    Example:
        >>> weights_digest(nn.Linear(2, 2)) == weights_digest(nn.Linear(2, 2))
        False
    """
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class DenseQueueModule(L.LightningModule):
    """MoCo v2 on CIFAR-100 with a dense queue, then a linear probe; segments for replay.

    Args:
        layers: ResNet blocks per stage (``(2, 2, 2, 2)``: ResNet-18).
        width: channels of the first ResNet stage (64 for ResNet-18).
        proj_dim: embedding size (the queue's rows).
        queue_size: keys in the queue (MoCo's ``K``).
        momentum: key-encoder EMA coefficient (MoCo's ``m``).
        temperature: InfoNCE temperature.
        lr: SGD learning rate of the encoder (cosine over ``encoder_epochs``).
        weight_decay: encoder weight decay.
        encoder_epochs: contrastive epochs; epochs after them (to ``trainer.max_epochs``) train
            the linear probe.
        probe_lr: SGD learning rate of the probe (cosine over the probe epochs).
        num_classes: probe outputs.
        image_size: crop size fed to the encoder.
        crop_min_scale: smallest crop area fraction of the contrastive augmentation.
        recompute: ``"none"``, or a state-unaware baseline on the same segments:
            ``"torch_checkpoint"`` or ``"torch_sac"`` (use ``strategy="replay"`` for the
            state-aware methods).
        sac_ops: aten ops whose outputs ``torch_sac`` saves.
        segments: the segments (for the replay strategy and the baselines alike).

    Example:
        >>> m = DenseQueueModule(layers=(1, 1, 1, 1), width=8, queue_size=32, proj_dim=16)
        >>> m.criterion.queue.shape
        torch.Size([16, 32])
    """

    def __init__(
        self,
        layers: Sequence[int] = (2, 2, 2, 2),
        width: int = 64,
        proj_dim: int = 128,
        queue_size: int = 4096,
        momentum: float = 0.99,
        temperature: float = 0.1,
        lr: float = 0.06,
        weight_decay: float = 5e-4,
        encoder_epochs: int = 100,
        probe_lr: float = 0.5,
        num_classes: int = 100,
        image_size: int = 32,
        crop_min_scale: float = 0.2,
        recompute: str = "none",
        sac_ops: Sequence[str] = DEFAULT_SAC_OPS,
        segments: Sequence[str] = DEFAULT_SEGMENTS,
    ) -> None:
        super().__init__()
        if recompute not in RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute={recompute!r} is not known; use one of "
                f"{list(RECOMPUTE_METHODS)} (state-aware methods: "
                "Trainer(strategy='replay'))"
            )
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
        if encoder_epochs < 0:
            raise ValueError(f"encoder_epochs={encoder_epochs!r} must be >= 0")
        self.save_hyperparameters()
        self.encoder_q = MoCoEncoder(layers, width, proj_dim)
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad_(False)
        self.criterion = QueueInfoNCE(proj_dim, queue_size, temperature)
        feat = self.encoder_q.backbone.feature_dim
        self.probe = nn.Sequential(nn.BatchNorm1d(feat, affine=False), nn.Linear(feat, num_classes))
        self.augment = BatchAugment(image_size, crop_min_scale)
        self.val_top1 = MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro")
        self.test_top1 = MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro")
        self.recomputed = apply_torch_recompute(self, list(segments), recompute, sac_ops)
        self.test_result: dict[str, Any] | None = None

    # ------------------------------------------------------------------ replay integration
    def configure_replay_segments(self) -> list[str]:
        """Segments for ``strategy="replay"``: the ResNet stages and the queue-reading loss."""
        return list(self.hparams.segments)

    @property
    def phase(self) -> str:
        """``"encoder"`` for the contrastive epochs, then ``"probe"``."""
        if self._trainer is None:
            return "encoder"
        return "encoder" if self.current_epoch < self.hparams.encoder_epochs else "probe"

    @override
    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        if self.hparams.recompute != "none" and hasattr(strategy, "engine"):
            raise ValueError(
                f"DenseQueueModule(recompute={self.hparams.recompute!r}) wraps the segments in "
                "torch's checkpoint, and strategy='replay' replays them too; use one: "
                "recompute='none' with strategy='replay', or a plain strategy"
            )
        if stage == "fit":
            total = self.trainer.max_epochs
            if total is not None and total >= 0 and total <= self.hparams.encoder_epochs:
                rank_zero_warn(
                    f"trainer.max_epochs={total} leaves no epoch for the linear probe after "
                    f"encoder_epochs={self.hparams.encoder_epochs}; test top-1 will be at "
                    "chance. Set trainer.max_epochs = encoder_epochs + probe epochs."
                )

    # ------------------------------------------------------------------ training
    def _generator(self, seeds: torch.Tensor) -> torch.Generator:
        # One generator per batch, from the per-sample seeds the sampler drew: the batch's
        # augmentation depends only on which samples it holds.
        h = hashlib.sha256(seeds.detach().cpu().numpy().tobytes()).digest()
        return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))

    @torch.no_grad()
    def _momentum_update(self) -> None:
        q = [p.detach() for p in self.encoder_q.parameters()]
        k = list(self.encoder_k.parameters())
        m = self.hparams.momentum
        torch._foreach_mul_(k, m)
        torch._foreach_add_(k, q, alpha=1 - m)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels, seeds = batch
        gen = self._generator(seeds)
        if self.phase == "probe":
            return self._probe_step(images, labels, gen)
        x_q = self.augment(images, gen)
        x_k = self.augment(images, gen)
        q = self.encoder_q(x_q)
        with torch.no_grad():
            self._momentum_update()
            k = self.encoder_k(x_k)
        loss = self.criterion(q, k)
        if self.trainer.world_size > 1:  # every rank enqueues every rank's keys (MoCo's gather)
            k = self.all_gather(k).reshape(-1, k.shape[-1])
        self.criterion.enqueue(k)
        self.log("train/loss", loss, prog_bar=True, batch_size=images.shape[0])
        return loss

    def _probe_step(
        self, images: torch.Tensor, labels: torch.Tensor, gen: torch.Generator
    ) -> torch.Tensor:
        backbone = self.encoder_q.backbone
        backbone.eval()  # frozen: running statistics fixed, no replay
        with torch.no_grad():
            feats = backbone(self.augment(images, gen, light=True))
        logits = self.probe(feats)
        loss = F.cross_entropy(logits, labels)
        self.log("probe/loss", loss, prog_bar=True, batch_size=images.shape[0])
        return loss

    @override
    def on_train_epoch_start(self) -> None:
        if self.phase == "probe":
            self.encoder_q.eval()
            self.encoder_k.eval()

    # ------------------------------------------------------------------ evaluation
    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.probe(self.encoder_q.backbone(self.augment.normalize(images)))

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch[0], batch[1]
        self.val_top1(self._logits(images), labels)
        self.log("val/top1", self.val_top1, prog_bar=True, batch_size=images.shape[0])

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch[0], batch[1]
        self.test_top1(self._logits(images), labels)
        self.log("test/top1", self.test_top1, batch_size=images.shape[0])

    @override
    def on_test_epoch_end(self) -> None:
        # compute() before Lightning's epoch-end logging resets the metric
        self.test_result = {
            "top1": float(self.test_top1.compute()),
            "total": int(self.test_top1.tp.sum() + self.test_top1.fn.sum()),
        }

    # ------------------------------------------------------------------ optimization
    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        enc = [p for p in self.encoder_q.parameters() if p.requires_grad]
        opt = torch.optim.SGD(
            [
                {"params": enc, "lr": hp.lr, "weight_decay": hp.weight_decay},
                {"params": list(self.probe.parameters()), "lr": hp.probe_lr, "weight_decay": 0.0},
            ],
            momentum=0.9,
        )
        e_enc = max(int(hp.encoder_epochs), 1)
        total = self.trainer.max_epochs if self._trainer is not None else None
        e_probe = max((total or 0) - hp.encoder_epochs, 1)

        def encoder_lr(epoch: int) -> float:
            return 0.5 * (1 + math.cos(math.pi * min(epoch, e_enc) / e_enc))

        def probe_lr(epoch: int) -> float:
            e = epoch - hp.encoder_epochs
            return 0.0 if e < 0 else 0.5 * (1 + math.cos(math.pi * min(e, e_probe) / e_probe))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, [encoder_lr, probe_lr])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
