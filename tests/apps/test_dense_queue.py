"""The dense-queue application's parts: queue, augmentation, sampler, baselines, telemetry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_replay.apps.dense_queue import (
    BatchAugment,
    CifarResNet,
    DenseQueueDataModule,
    DenseQueueModule,
    QueueInfoNCE,
    _SeededSampler,
    weights_digest,
)
from lightning_replay.apps.telemetry import LiveBytes
from lightning_replay.apps.torch_recompute import (
    apply_torch_recompute,
    recompute_counts,
    remove_torch_recompute,
)
from lightning_replay.errors import ReplayConfigError

from .conftest import TINY_DATA, TINY_MODEL


def test_queue_enqueue_writes_oldest_columns_and_wraps():
    crit = QueueInfoNCE(dim=4, queue_size=6, temperature=0.5)
    keys = [F.normalize(torch.randn(4, 4), dim=1) for _ in range(2)]
    crit.enqueue(keys[0])
    assert torch.equal(crit.queue[:, :4], keys[0].t()) and int(crit.queue_ptr) == 4
    crit.enqueue(keys[1])  # 2 columns at the end, 2 wrapped to the front
    assert torch.equal(crit.queue[:, 4:], keys[1][:2].t())
    assert torch.equal(crit.queue[:, :2], keys[1][2:].t()) and int(crit.queue_ptr) == 2


def test_infonce_reads_the_whole_queue():
    crit = QueueInfoNCE(dim=8, queue_size=16, temperature=0.2)
    q = F.normalize(torch.randn(4, 8), dim=1).requires_grad_()
    k = F.normalize(torch.randn(4, 8), dim=1)
    before = crit(q, k)
    crit.queue[:, 15] = -crit.queue[:, 15]  # any column changes the loss
    assert not torch.equal(before, crit(q, k))


def test_augmentation_is_a_function_of_the_generator():
    aug = BatchAugment(image_size=32)
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    a = aug(images, torch.Generator().manual_seed(1))
    b = aug(images, torch.Generator().manual_seed(1))
    c = aug(images, torch.Generator().manual_seed(2))
    assert a.shape == (5, 3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    light = aug(images, torch.Generator().manual_seed(1), light=True)
    assert light.shape == a.shape and torch.isfinite(light).all()
    plain = aug.normalize(images)  # evaluation: no crop, just normalization
    assert torch.allclose(plain * aug.std + aug.mean, images.float() / 255, atol=1e-6)


def test_sampler_is_deterministic_per_epoch_and_shards_disjointly():
    idx = list(range(10, 40))
    s = _SeededSampler(idx, seed=7)
    s.set_epoch(3)
    first = list(s)
    s.set_epoch(3)
    assert list(s) == first
    s.set_epoch(4)
    assert list(s) != first
    assert sorted(i for i, _ in first) == idx
    shards = []
    for rank in range(4):
        r = _SeededSampler(idx, seed=7, num_replicas=4, rank=rank)
        r.set_epoch(3)
        shards.append(list(r))
        assert len(shards[-1]) == len(r) == 7
    flat = [p for sh in shards for p in sh]
    assert len(set(flat)) == 28 and set(flat) <= set(first)


def test_resnet_stages_and_segments():
    net = CifarResNet(layers=(2, 1, 1, 1), width=8)
    assert len(net.layer1) == 2 and net.feature_dim == 64
    model = DenseQueueModule(**TINY_MODEL)
    assert model.configure_replay_segments() == ["encoder_q.backbone.layer*", "criterion"]
    # the key encoder starts as an exact, frozen copy
    assert weights_digest(model.encoder_q) == weights_digest(model.encoder_k)
    assert not any(p.requires_grad for p in model.encoder_k.parameters())
    with pytest.raises(ValueError, match="recompute='fast'"):
        DenseQueueModule(recompute="fast")


@pytest.mark.parametrize("method", ["torch_checkpoint", "torch_sac"])
def test_torch_baselines_keep_state_dict_and_drop_activations(method):
    torch.manual_seed(0)
    model = DenseQueueModule(**TINY_MODEL)
    keys = list(model.state_dict())
    wrapped = DenseQueueModule(**TINY_MODEL, recompute=method)
    assert list(wrapped.state_dict()) == keys
    assert wrapped.recomputed == [f"encoder_q.backbone.layer{i}" for i in range(1, 5)] + [
        "criterion"
    ]
    x = torch.randn(4, 3, 32, 32)
    wrapped.encoder_q(x).sum().backward()
    counts = recompute_counts(wrapped)
    assert all(
        c == {"forwards": 1, "replays": 1} for n, c in counts.items() if n.startswith("encoder_q")
    )
    remove_torch_recompute(wrapped)
    assert recompute_counts(wrapped) == {}
    with pytest.raises(ReplayConfigError, match="not an aten operator"):
        apply_torch_recompute(copy.deepcopy(model), ["criterion"], "torch_sac", ops=["matmul_x"])


def test_torch_checkpoint_replays_against_the_mutated_queue():
    """The hazard the study is about, in isolation: plain checkpoint on the loss segment gives
    gradients from the queue as it is after the enqueue."""
    torch.manual_seed(0)
    crit = QueueInfoNCE(dim=8, queue_size=32, temperature=0.2)
    ref = copy.deepcopy(crit)
    wrapper = torch.nn.Module()
    wrapper.criterion = crit
    apply_torch_recompute(wrapper, ["criterion"], "torch_checkpoint")
    q0 = F.normalize(torch.randn(8, 8), dim=1)
    k = F.normalize(torch.randn(8, 8), dim=1)
    grads = []
    for mod in (ref, crit):
        q = q0.clone().requires_grad_()
        loss = mod(q, k)
        mod.enqueue(k)  # after the segment, before backward
        loss.backward()
        grads.append(q.grad)
    assert not torch.equal(grads[0], grads[1])


def test_live_bytes_counts_creation_and_frees():
    resident = torch.zeros(256)  # 1 KiB
    with LiveBytes() as live:
        live.add_resident([resident])
        a = torch.ones(1024)  # +4 KiB
        b = a * 2  # +4 KiB
        del b  # -4 KiB
        c = a.view(32, 32)  # a view: no new storage
        d = a + 1  # +4 KiB
    assert live.peak == 1024 + 4096 + 4096
    assert live.current == 1024 + 4096 + 4096
    del c, d


def test_live_bytes_leaves_nothing_behind():
    """Tracking many steps must not accumulate finalizers on long-lived storages (a slow leak
    that made long runs stall in garbage collection)."""
    import weakref

    params = [torch.zeros(64) for _ in range(50)]
    before = len(weakref.finalize._registry)
    for _ in range(20):
        with LiveBytes() as live:
            live.add_resident(params)
            _ = [p + 1 for p in params]
    assert len(weakref.finalize._registry) == before


def test_datamodule_splits(tiny_data):
    dm = DenseQueueDataModule(
        data_dir=str(tiny_data), batch_size=32, val_size=40, test_size=50, **TINY_DATA
    )
    dm.prepare_data()
    dm.setup("fit")
    assert "synthetic CIFAR-100" in dm.description
    assert len(dm.train_indices) == 360 and len(dm.val_set) == 40 and len(dm.test_set) == 50
    images, labels, seeds = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (32, 3, 32, 32)
    assert labels.shape == (32,) and seeds.dtype == torch.int64
    with pytest.raises(ValueError, match="source="):
        DenseQueueDataModule(source="imagenet")
    other = DenseQueueDataModule(data_dir=str(tiny_data), synthetic_train_per_class=5)
    with pytest.raises(ValueError, match="overwrite"):  # never a silently different dataset
        other.prepare_data()
