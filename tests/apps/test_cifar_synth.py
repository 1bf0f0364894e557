"""The synthetic CIFAR-100: CIFAR-100's on-disk format, read by torchvision's own code."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torchvision
from torchvision.datasets import CIFAR100

from lightning_replay.apps import cifar_synth
from lightning_replay.apps.cifar_synth import (
    DatasetNotFound,
    SyntheticCIFAR100,
    has_real_cifar100,
    has_synthetic_cifar100,
    open_cifar100,
    write_synthetic_cifar100,
)


def test_files_have_cifar100_layout(tiny_data):
    folder = tiny_data / "cifar-100-python"
    for name in ("train", "test", "meta"):
        assert (folder / name).is_file()
    with open(folder / "train", "rb") as f:
        train = pickle.load(f, encoding="latin1")
    assert set(train) == {"filenames", "batch_label", "fine_labels", "coarse_labels", "data"}
    assert train["data"].dtype == np.uint8 and train["data"].shape == (400, 3072)
    assert sorted(set(train["fine_labels"])) == list(range(100))
    assert all(c == f // 5 for f, c in zip(train["fine_labels"], train["coarse_labels"]))
    with open(folder / "meta", "rb") as f:
        meta = pickle.load(f, encoding="latin1")
    assert len(meta["fine_label_names"]) == 100 and len(meta["coarse_label_names"]) == 20


def test_unmodified_torchvision_cifar100_reads_it(tiny_data, monkeypatch):
    """torchvision.datasets.CIFAR100 itself parses the files; only its md5 check (against the
    real CIFAR-100's checksums) has to be bypassed for data that is not the real dataset."""
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR100(tiny_data, train=True, download=False)  # the integrity check does run
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    real_class = CIFAR100(tiny_data, train=True, download=False)
    monkeypatch.undo()
    ours = open_cifar100(tiny_data, train=True)
    assert type(ours) is SyntheticCIFAR100 and isinstance(ours, CIFAR100)
    # SyntheticCIFAR100 replaces the expected checksums and nothing else
    assert [k for k, v in vars(SyntheticCIFAR100).items() if callable(v)] == ["__init__"]
    assert np.array_equal(real_class.data, ours.data)
    assert real_class.targets == ours.targets and real_class.classes == ours.classes
    assert ours.data.shape == (400, 32, 32, 3)
    img, label = ours[0]
    assert img.size == (32, 32) and label == ours.targets[0]
    test = open_cifar100(tiny_data, train=False)
    assert len(test) == 200


def test_corruption_is_detected(tmp_path):
    write_synthetic_cifar100(tmp_path, train_per_class=1, test_per_class=1)
    path = tmp_path / "cifar-100-python" / "test"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not has_synthetic_cifar100(tmp_path)
    with pytest.raises(RuntimeError, match="corrupted"):
        SyntheticCIFAR100(tmp_path, train=False)


def test_deterministic_idempotent_and_guarded(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_synthetic_cifar100(a, 2, 1, seed=3)
    write_synthetic_cifar100(b, 2, 1, seed=3)
    for name in ("train", "test", "meta"):
        assert (a / "cifar-100-python" / name).read_bytes() == (
            b / "cifar-100-python" / name
        ).read_bytes()
    mtime = (a / "cifar-100-python" / "train").stat().st_mtime_ns
    write_synthetic_cifar100(a, 2, 1, seed=3)  # same parameters: kept
    assert (a / "cifar-100-python" / "train").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="overwrite"):
        write_synthetic_cifar100(a, 3, 1, seed=3)
    write_synthetic_cifar100(a, 3, 1, seed=3, overwrite=True)
    assert len(open_cifar100(a)) == 300
    with pytest.raises(ValueError, match="train_per_class"):
        write_synthetic_cifar100(tmp_path / "c", 0, 1)


def test_missing_data_says_what_to_do(tmp_path):
    assert not has_real_cifar100(tmp_path)
    with pytest.raises(DatasetNotFound, match="cifar_synth"):
        open_cifar100(tmp_path)
    write_synthetic_cifar100(tmp_path, 1, 1)
    with pytest.raises(DatasetNotFound, match="real CIFAR-100"):
        open_cifar100(tmp_path, source="cifar100")


def test_classes_are_learnable_from_pixels(tiny_data):
    """Class-dependent structure: nearest class mean on raw pixels is far above chance (1 %)."""
    train, test = open_cifar100(tiny_data, True), open_cifar100(tiny_data, False)
    x = train.data.reshape(len(train), -1).astype(np.float64)
    y = np.array(train.targets)
    means = np.stack([x[y == c].mean(0) for c in range(100)])
    xt = test.data.reshape(len(test), -1).astype(np.float64)
    pred = np.argmin(((xt[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    acc = float((pred == np.array(test.targets)).mean())
    assert acc > 0.10, acc


def test_command_line(tmp_path, capsys):
    assert cifar_synth.main([str(tmp_path), "--train-per-class", "1", "--test-per-class", "1"]) == 0
    assert "100 train" in capsys.readouterr().out
    assert has_synthetic_cifar100(tmp_path)
    assert cifar_synth.main([str(tmp_path), "--train-per-class", "2"]) == 2
    assert "overwrite" in capsys.readouterr().err
