"""Real models: lightning_replay against ``torch.utils.checkpoint`` on the same blocks, and the
cost of sampled checks.

GPT-2 (HF transformers), a ViT (timm) and ResNet-18 (torchvision), built from small configs in
code (no downloads). Per model:

* ``ratio_vs_torch_checkpoint``: step time of the model under ``lr.install`` (every block a
  segment; the per-forward guards always run) over the same model with the same blocks wrapped
  in ``torch.utils.checkpoint(use_reentrant=False)``; median of per-round ratios, the two
  stepping alternately.
* ``replay_saved_bytes`` / ``torch_saved_bytes``: bytes autograd holds for backward, counted by
  an outer saved-tensor hook in one step (the same count for both). What the engine keeps
  besides, to replay exactly (snapshots of state the segments write, e.g. batch-norm running
  statistics, which torch's checkpoint updates twice instead), is ``replay_preserved_bytes``.
* ``checks_ratio_every_50``: two engine copies train side by side; one runs derivative + byte
  checks on one step in every 50. Median over the 50-step blocks of (block time with checks) /
  (block time without).

On CPU the steps run on one intra-op thread, timed by this thread's CPU time (the machine may be
shared; see ``sparse_map._clock``).
"""

from __future__ import annotations

import copy
import fnmatch
import os
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from bench_common import device, paired_ratio
from lightning_replay.verify import torch_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _gpt2(size: dict) -> tuple[nn.Module, str, Callable, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=size["layers"],
        n_embd=size["width"],
        n_head=4,
        vocab_size=1000,
        n_positions=size["seq"],
        use_cache=False,
    )  # dropout 0.1 (GPT-2's default)
    model = GPT2LMHeadModel(cfg)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, 1000, (size["batch"], size["seq"]), generator=g),)

    return model, "transformer.h.*", batch, lambda m, b: m(input_ids=b[0], labels=b[0]).loss


def _vit(size: dict) -> tuple[nn.Module, str, Callable, Callable]:
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=size["image"],
        patch_size=8,
        embed_dim=size["width"],
        depth=size["layers"],
        num_heads=4,
        num_classes=10,
        drop_path_rate=0.1,
    )
    return model, "blocks.*", _images(size), _classify


def _resnet18(size: dict) -> tuple[nn.Module, str, Callable, Callable]:
    import torchvision

    return torchvision.models.resnet18(num_classes=10), "layer*.*", _images(size), _classify


def _images(size: dict) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def batch(step: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return (
            torch.randn(size["batch"], 3, size["image"], size["image"], generator=g),
            torch.randint(0, 10, (size["batch"],), generator=g),
        )

    return batch


def _classify(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


BUILDERS = {"gpt2": _gpt2, "vit": _vit, "resnet18": _resnet18}


def _segments(model: nn.Module, pattern: str) -> list[str]:
    return [
        n
        for n, _ in model.named_modules()
        if n and fnmatch.fnmatchcase(n, pattern) and "." not in n[len(pattern.rstrip("*")) :]
    ]


def _step(model: nn.Module, loss_fn, batch, clock=time.perf_counter) -> tuple[float, int]:
    """One forward + backward: (seconds of ``clock``, bytes autograd saved outside segments)."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dev = batch[0].device
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0, sum(saved.values())


def run_model(name: str, size: dict, rounds: int, check_blocks: int, every: int = 50) -> dict:
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    torch.manual_seed(0)
    proto, pattern, make_batch, loss_fn = BUILDERS[name](size)
    proto.to(dev).train()
    names = _segments(proto, pattern)
    batch = lambda s: tuple(t.to(dev) for t in make_batch(s))  # noqa: E731

    naive = torch_checkpoint(copy.deepcopy(proto), names)
    replay = copy.deepcopy(proto)
    engine = lr.install(replay, names)
    for s in range(3):  # the first replay step is the probe
        _step(naive, loss_fn, batch(s), clock)
        _step(replay, loss_fn, batch(s), clock)
    t_naive, t_replay = [], []
    for r in range(rounds):
        order = [(naive, t_naive), (replay, t_replay)]
        for model, times in order if r % 2 else order[::-1]:
            times.append(_step(model, loss_fn, batch(3 + r), clock)[0])
    _, torch_bytes = _step(naive, loss_fn, batch(0), clock)
    _, replay_bytes = _step(replay, loss_fn, batch(0), clock)
    preserved = int(engine.window_stats()["preserved_bytes"])
    modes = sorted({s["mode"] for s in engine.summary().values()})
    out: dict[str, Any] = {
        "segments": len(names),
        "size": size,
        "rounds": rounds,
        "ratio_vs_torch_checkpoint": paired_ratio(t_replay, t_naive),
        "replay_step_s": statistics.median(t_replay),
        "torch_step_s": statistics.median(t_naive),
        "replay_saved_bytes": replay_bytes,
        "torch_saved_bytes": torch_bytes,
        "replay_preserved_bytes": preserved,
        "modes": modes,
    }
    engine.uninstall()
    out.update(_checks(proto, names, loss_fn, batch, clock, check_blocks, every))
    return out


def _checks(proto, names, loss_fn, batch, clock, blocks: int, every: int) -> dict:
    models = {k: copy.deepcopy(proto) for k in ("checked", "plain")}
    engines = {k: lr.install(m, names, on_violation="record") for k, m in models.items()}
    for k in models:  # probe and warm up outside the measured blocks
        for s in range(2):
            _step(models[k], loss_fn, batch(s), clock)
    ratios = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(blocks):
            total = {k: 0.0 for k in models}
            for step in range(every):
                for k in ("checked", "plain") if step % 2 else ("plain", "checked"):
                    if k == "checked" and step == every // 2:
                        engines[k].request_check()
                    total[k] += _step(models[k], loss_fn, batch(step), clock)[0]
            ratios.append(total["checked"] / total["plain"])
    counts = engines["checked"].records.counts()
    for e in engines.values():
        e.uninstall()
    return {
        "checks_ratio_every_50": statistics.median(ratios),
        "checks_block_ratios": ratios,
        "checks_every": every,
        "check_records": counts,
    }


def side_by_side(models: dict[str, dict], rounds: int, warmup: int = 3) -> dict:
    """``ratio_vs_torch_checkpoint`` of several models in one process, their rounds
    interleaved (in each round every model steps once under torch checkpoint and once under
    lightning_replay, the order alternating), so a slow phase of a shared machine hits every
    model and both arms alike. Per model: the median of per-round ratios, the medians of both
    step times and of the per-round differences (seconds of this thread's CPU on CPU)."""
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    arms = {}
    for name, size in models.items():
        torch.manual_seed(0)
        proto, pattern, make_batch, loss_fn = BUILDERS[name](size)
        proto.to(dev).train()
        names = _segments(proto, pattern)
        batch = lambda s, mb=make_batch: tuple(t.to(dev) for t in mb(s))  # noqa: E731
        naive = torch_checkpoint(copy.deepcopy(proto), names)
        replay = copy.deepcopy(proto)
        engine = lr.install(replay, names)
        for s in range(warmup):  # the first replay step is the probe
            _step(naive, loss_fn, batch(s), clock)
            _step(replay, loss_fn, batch(s), clock)
        arms[name] = (naive, replay, engine, loss_fn, batch, [], [], len(names))
    for r in range(rounds):
        for naive, replay, _, loss_fn, batch, t_naive, t_replay, _ in arms.values():
            order = [(naive, t_naive), (replay, t_replay)]
            for model, times in order if r % 2 else order[::-1]:
                times.append(_step(model, loss_fn, batch(warmup + r), clock)[0])
    out = {}
    for name, (_, _, engine, _, _, t_naive, t_replay, n) in arms.items():
        modes = sorted({s["mode"] for s in engine.summary().values()})
        engine.uninstall()
        out[name] = {
            "segments": n,
            "size": models[name],
            "rounds": rounds,
            "modes": modes,
            "ratio_vs_torch_checkpoint": paired_ratio(t_replay, t_naive),
            "replay_step_s": statistics.median(t_replay),
            "torch_step_s": statistics.median(t_naive),
            "extra_s": statistics.median(a - b for a, b in zip(t_replay, t_naive)),
        }
    return out


def run(cfg: dict) -> dict:
    """Every model in ``cfg["models"]`` (name -> size), ``rounds`` pairs, ``check_blocks``
    blocks of ``every`` steps."""
    threads = torch.get_num_threads()
    if device().type == "cpu":
        torch.set_num_threads(1)
    try:
        return {
            name: run_model(name, size, cfg["rounds"], cfg["check_blocks"], cfg.get("every", 50))
            for name, size in cfg["models"].items()
        }
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    # python benchmarks/bench_real_models.py [ROUNDS] [SUITE]: the three models side by side,
    # ratios only (no checks part), one JSON line; run under benchmarks/run.py's malloc
    # settings (see RECYCLING_MALLOC there) for figures comparable with the suite's.
    import json
    import sys

    from run import SUITES

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    suite = sys.argv[2] if len(sys.argv) > 2 else "quick"
    if device().type == "cpu":
        torch.set_num_threads(1)
    print(json.dumps(side_by_side(SUITES[suite]["real_models"]["models"], rounds)))
