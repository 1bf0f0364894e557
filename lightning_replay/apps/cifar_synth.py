"""CIFAR-100 on disk: the real dataset when a directory holds it, else a synthetic one in its format.

The synthetic dataset is written in CIFAR-100's own on-disk layout — the python pickle files
``train``, ``test`` and ``meta`` under ``cifar-100-python/`` with the same keys, dtypes and
shapes (``data``: ``uint8 [N, 3072]`` in R, G, B planes; ``fine_labels``; ``coarse_labels``;
``filenames``; ``batch_label``; ``meta``: ``fine_label_names``, ``coarse_label_names``) — and
is read back by torchvision's own :class:`torchvision.datasets.CIFAR100` code. The one
difference: torchvision checks each file against the md5 of the *real* CIFAR-100, which no
other bytes can match. The generator therefore also writes ``SYNTHETIC.json`` (its parameters
and the md5 of every file it wrote) and :class:`SyntheticCIFAR100` is ``CIFAR100`` with only
those checksums replaced: the integrity check still runs, and parsing, the HWC conversion,
label loading and ``__getitem__`` are torchvision's unchanged.

Images carry class-dependent structure so that a linear probe on learned features scores far
above chance (1 % for 100 classes): each of the 20 coarse classes has a two-colour palette,
each of its 5 fine classes an oriented grating at its own frequency and a blob layout; every
image draws a random phase, shift, contrast, brightness and pixel noise.

Example:
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> _ = write_synthetic_cifar100(root, train_per_class=2, test_per_class=1)
    >>> ds = open_cifar100(root, train=True)
    >>> len(ds), ds.data.shape, type(ds).__name__
    (200, (200, 32, 32, 3), 'SyntheticCIFAR100')
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lightning_replay.core.engine.config import check_count
from torchvision.datasets import CIFAR100
from torchvision.datasets.utils import check_integrity

__all__ = [
    "CIFAR100_FOLDER",
    "MANIFEST",
    "SyntheticCIFAR100",
    "DatasetNotFound",
    "has_real_cifar100",
    "has_synthetic_cifar100",
    "write_synthetic_cifar100",
    "open_cifar100",
    "main",
]

CIFAR100_FOLDER = CIFAR100.base_folder  # "cifar-100-python"
MANIFEST = "SYNTHETIC.json"
FORMAT_VERSION = 1
NUM_FINE, NUM_COARSE = 100, 20
SIZE = 32
_CHUNK = 2000  # images rendered at once


class DatasetNotFound(FileNotFoundError):
    """Neither the real CIFAR-100 nor a synthetic copy is where the caller looked."""


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def has_real_cifar100(root: str | os.PathLike) -> bool:
    """True when ``root/cifar-100-python`` holds the real CIFAR-100 (torchvision's md5 check)."""
    folder = Path(root) / CIFAR100_FOLDER
    return all(
        check_integrity(str(folder / name), md5)
        for name, md5 in CIFAR100.train_list + CIFAR100.test_list
    ) and check_integrity(str(folder / CIFAR100.meta["filename"]), CIFAR100.meta["md5"])


def _read_manifest(root: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(root) / CIFAR100_FOLDER / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def has_synthetic_cifar100(root: str | os.PathLike) -> bool:
    """True when ``root`` holds a complete synthetic CIFAR-100 whose files match its manifest."""
    man = _read_manifest(root)
    if man is None:
        return False
    folder = Path(root) / CIFAR100_FOLDER
    return all(check_integrity(str(folder / n), md5) for n, md5 in man["md5"].items())


class SyntheticCIFAR100(CIFAR100):
    """torchvision's ``CIFAR100`` reading a synthetic copy: only the expected md5s differ.

    The checksums come from ``SYNTHETIC.json``, written with the data by
    :func:`write_synthetic_cifar100`; torchvision's integrity check still runs against them.
    Never downloads.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> _ = write_synthetic_cifar100(root, train_per_class=1, test_per_class=1)
        >>> img, label = SyntheticCIFAR100(root, train=False)[0]
        >>> img.size, 0 <= label < 100
        ((32, 32), True)
    """

    def __init__(
        self,
        root: str | os.PathLike,
        train: bool = True,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
    ) -> None:
        man = _read_manifest(root)
        if man is None:
            raise DatasetNotFound(
                f"no synthetic CIFAR-100 under {os.fspath(root)!r} (missing "
                f"{CIFAR100_FOLDER}/{MANIFEST}); write one with "
                "`python -m lightning_replay.apps.cifar_synth ROOT`"
            )
        md5 = man["md5"]
        # instance attributes shadow the class lists torchvision's code reads
        self.train_list = [["train", md5["train"]]]
        self.test_list = [["test", md5["test"]]]
        self.meta = dict(CIFAR100.meta, md5=md5["meta"])
        self.synthetic = man
        super().__init__(
            root,
            train=train,
            transform=transform,
            target_transform=target_transform,
            download=False,
        )


# ------------------------------------------------------------------------------------ writing
def _class_specs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-class generative parameters (deterministic in the generator's seed)."""
    palettes = rng.uniform(0.05, 0.95, size=(NUM_COARSE, 2, 3))
    # keep the two colours of each palette apart so the grating shows
    palettes[:, 1] = np.where(
        np.abs(palettes[:, 1] - palettes[:, 0]) < 0.3, 1.0 - palettes[:, 0], palettes[:, 1]
    )
    orient = (np.arange(NUM_FINE) % 5) * (np.pi / 5) + rng.uniform(0, np.pi / 10, NUM_FINE)
    freq = 1.5 + 1.0 * ((np.arange(NUM_FINE) // 5) % 4) + rng.uniform(0, 0.5, NUM_FINE)
    blobs = rng.uniform(0, 1, size=(NUM_FINE, 4, 4)) > 0.5
    blob_colour = rng.uniform(0.0, 1.0, size=(NUM_FINE, 3))
    return {
        "palettes": palettes,
        "orient": orient,
        "freq": freq,
        "blobs": blobs,
        "blob_colour": blob_colour,
    }


def _render(
    labels: np.ndarray, specs: dict[str, np.ndarray], rng: np.random.Generator
) -> np.ndarray:
    """``uint8 [N, 3072]`` images (channel planes R, G, B, each row-major 32x32)."""
    n = len(labels)
    coarse = labels // 5
    yy, xx = np.meshgrid(np.arange(SIZE) / SIZE, np.arange(SIZE) / SIZE, indexing="ij")
    theta = specs["orient"][labels][:, None, None]
    freq = specs["freq"][labels][:, None, None]
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1, 1))
    wave = 0.5 + 0.5 * np.sin(
        2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) + phase
    )  # [n, 32, 32]
    blobs = specs["blobs"][labels].astype(np.float64)  # [n, 4, 4]
    blobs = np.repeat(np.repeat(blobs, SIZE // 4, axis=1), SIZE // 4, axis=2)
    shift = rng.integers(-4, 5, size=(n, 2))
    for i in range(n):  # a random translation of the blob layout (wrapping)
        blobs[i] = np.roll(blobs[i], tuple(shift[i]), axis=(0, 1))
    pal = specs["palettes"][coarse] + rng.uniform(-0.15, 0.15, size=(n, 2, 3))  # [n, 2, 3]
    swap = rng.uniform(size=n) < 0.5  # either palette colour may be the grating's peak
    pal[swap] = pal[swap][:, ::-1]
    img = pal[:, 0, :, None, None] * (1 - wave[:, None]) + pal[:, 1, :, None, None] * wave[:, None]
    bc = specs["blob_colour"][labels][:, :, None, None]
    img = img * (1 - 0.35 * blobs[:, None]) + 0.35 * blobs[:, None] * bc
    contrast = rng.uniform(0.4, 1.2, size=(n, 1, 1, 1))
    bright = rng.uniform(-0.15, 0.15, size=(n, 1, 1, 1))
    img = (img - 0.5) * contrast + 0.5 + bright
    img = img + rng.normal(0, 0.15, size=img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8).reshape(n, 3 * SIZE * SIZE)


def _fine_names() -> list[str]:
    return [f"class_{i:03d}" for i in range(NUM_FINE)]


def _coarse_names() -> list[str]:
    return [f"superclass_{i:02d}" for i in range(NUM_COARSE)]


def _split(name: str, per_class: int, specs: dict, rng: np.random.Generator) -> dict[str, Any]:
    labels = np.repeat(np.arange(NUM_FINE), per_class)
    labels = labels[rng.permutation(len(labels))]
    from tqdm.auto import tqdm

    chunks = []  # fixed-size chunks: the bytes do not depend on whether a bar is shown
    with tqdm(
        total=len(labels),
        desc=f"synthetic CIFAR-100 {name}",
        unit="img",
        disable=len(labels) < 10_000,
        file=sys.stderr,
    ) as bar:
        for start in range(0, len(labels), _CHUNK):
            chunks.append(_render(labels[start : start + _CHUNK], specs, rng))
            bar.update(len(chunks[-1]))
    data = np.concatenate(chunks)
    return {
        "filenames": [f"synthetic_{name}_{i:06d}.png" for i in range(len(labels))],
        "batch_label": f"synthetic {name} batch 1 of 1",
        "fine_labels": labels.tolist(),
        "coarse_labels": (labels // 5).tolist(),
        "data": data,
    }


def write_synthetic_cifar100(
    root: str | os.PathLike,
    train_per_class: int = 500,
    test_per_class: int = 100,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic CIFAR-100 in CIFAR-100's on-disk format under ``root``.

    Idempotent: a copy with the same parameters whose files match their checksums is kept.

    Args:
        root: the directory that gets ``cifar-100-python/`` (as torchvision's ``root``).
        train_per_class: training images per fine class (the real dataset has 500).
        test_per_class: test images per fine class (the real dataset has 100).
        seed: generator seed; the same arguments always give the same bytes.
        overwrite: replace an existing synthetic copy with other parameters.

    Returns:
        The ``cifar-100-python`` folder.

    Raises:
        ValueError: on a non-positive count, or when ``root`` holds the real CIFAR-100 or a
            synthetic copy with other parameters and ``overwrite`` is false.
    """
    for what, v in (("train_per_class", train_per_class), ("test_per_class", test_per_class)):
        check_count("write_synthetic_cifar100", what, v)
    folder = Path(root) / CIFAR100_FOLDER
    params = {
        "format_version": FORMAT_VERSION,
        "train_per_class": train_per_class,
        "test_per_class": test_per_class,
        "seed": seed,
    }
    man = _read_manifest(root)
    if man is not None and man.get("params") == params and has_synthetic_cifar100(root):
        return folder
    if has_real_cifar100(root):
        raise ValueError(
            f"{os.fspath(root)!r} holds the real CIFAR-100; write the synthetic "
            "copy to another directory"
        )
    if man is not None and man.get("params") != params and not overwrite:
        raise ValueError(
            f"{folder} holds a synthetic CIFAR-100 made with {man.get('params')}, "
            f"not {params}; pass overwrite=True or use another directory"
        )
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    specs = _class_specs(rng)
    md5 = {}
    for name, per in (("train", train_per_class), ("test", test_per_class)):
        split = _split(name, per, specs, np.random.default_rng([seed, 1 if name == "train" else 2]))
        _dump(folder / name, split)
        md5[name] = _md5(folder / name)
    _dump(
        folder / "meta", {"fine_label_names": _fine_names(), "coarse_label_names": _coarse_names()}
    )
    md5["meta"] = _md5(folder / "meta")
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "params": params,
                "md5": md5,
                "note": "synthetic CIFAR-100-shaped data written by "
                "lightning_replay.apps.cifar_synth; not CIFAR-100",
            },
            indent=2,
        )
    )
    os.replace(tmp, folder / MANIFEST)
    return folder


def _dump(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # CIFAR's own files are protocol-2 pickles
    os.replace(tmp, path)


def open_cifar100(
    root: str | os.PathLike,
    train: bool = True,
    transform: Callable | None = None,
    download: bool = False,
    source: str = "auto",
) -> CIFAR100:
    """The CIFAR-100 split under ``root``: real if present, else a synthetic copy.

    Args:
        root: torchvision's ``root`` (the directory holding ``cifar-100-python``).
        train: the training split, else the test split.
        transform: applied to each PIL image.
        download: fetch the real dataset when it is missing (needs network; never implied).
        source: ``"auto"`` (real if present, else synthetic), ``"cifar100"`` (real only) or
            ``"synthetic"`` (synthetic only).

    Raises:
        DatasetNotFound: the requested data is not under ``root``; the message says how to get it.
    """
    if source not in ("auto", "cifar100", "synthetic"):
        raise ValueError(f"source={source!r} must be 'auto', 'cifar100' or 'synthetic'")
    if source in ("auto", "cifar100") and (has_real_cifar100(root) or download):
        return CIFAR100(root, train=train, transform=transform, download=download)
    if source in ("auto", "synthetic") and has_synthetic_cifar100(root):
        return SyntheticCIFAR100(root, train=train, transform=transform)
    want = {
        "auto": "CIFAR-100 (real or synthetic)",
        "cifar100": "the real CIFAR-100",
        "synthetic": "a synthetic CIFAR-100",
    }[source]
    raise DatasetNotFound(
        f"{want} not found under {os.fspath(root)!r}. Put the real dataset's "
        f"{CIFAR100_FOLDER}/ there, pass download=True on a machine with network, or write a "
        "synthetic copy: `python -m lightning_replay.apps.cifar_synth ROOT`"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lightning_replay.apps.cifar_synth",
        description="Write a synthetic CIFAR-100 in CIFAR-100's on-disk format (python pickle "
        "batches train/test/meta under cifar-100-python/), readable by "
        "torchvision.datasets.CIFAR100's code.",
    )
    ap.add_argument("root", help="directory to write cifar-100-python/ into")
    ap.add_argument(
        "--train-per-class",
        type=int,
        default=500,
        help="training images per class (default 500, as CIFAR-100)",
    )
    ap.add_argument(
        "--test-per-class",
        type=int,
        default=100,
        help="test images per class (default 100, as CIFAR-100)",
    )
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a synthetic copy made with other parameters",
    )
    args = ap.parse_args(argv)
    try:
        folder = write_synthetic_cifar100(
            args.root, args.train_per_class, args.test_per_class, args.seed, args.overwrite
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {folder} ({NUM_FINE * args.train_per_class} train, "
        f"{NUM_FINE * args.test_per_class} test images)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
