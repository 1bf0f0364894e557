"""Real models: lightning_replay against ``torch.utils.checkpoint`` on the same blocks, and the
cost of sampled checks.

GPT-2 (HF transformers), a ViT (timm) and ResNet-18 (torchvision), built from small configs in
code (no downloads). Per model:

* ``ratio_vs_torch_checkpoint``: step time of the model under ``lr.install`` (every block a
  segment; the per-forward guards always run) over the same model with the same blocks wrapped
  in ``torch.utils.checkpoint(use_reentrant=False)``; median of per-round ratios, the arms
  stepping in turn, each on three copies of the model (see :func:`side_by_side`).
* ``torch_vs_torch``: the same ratio between two arms that both run torch checkpoint: the
  noise of this run, measured alongside.
* ``replay_saved_bytes`` / ``torch_saved_bytes``: bytes autograd holds for backward, counted by
  an outer saved-tensor hook in one step (the same count for both). What the engine keeps
  besides, to replay exactly (snapshots of state the segments write, e.g. batch-norm running
  statistics, which torch's checkpoint updates twice instead), is ``replay_preserved_bytes``.
* ``checks_ratio_every_50``: two engine copies train side by side; one runs derivative + byte
  checks on one step in every 50, the two taking turns from block to block. Median over the
  50-step blocks of (block time with checks) / (block time without).

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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from bench_common import arms_side_by_side, device, paired_ratio, torch_and_replay_arms

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
        # what the forward saves, held until backward: a replay's tensors pass through these
        # hooks too (the user's hooks apply to replays as to plain training), in backward,
        # where they live only until their use
        if torch._C._current_graph_task_id() == -1:
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


def _checks(proto, names, loss_fn, batch, clock, blocks: int, every: int) -> dict:
    """Two engine copies train side by side; in each block of ``every`` steps one of them runs
    checks on one step. They swap roles from block to block, so what sets two copies' step times
    apart (see :func:`side_by_side`) cancels over an even number of blocks."""
    models = [copy.deepcopy(proto) for _ in range(2)]
    engines = [lr.install(m, names, on_violation="record") for m in models]
    for m in models:  # probe and warm up outside the measured blocks
        for s in range(2):
            _step(m, loss_fn, batch(s), clock)
    ratios = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in range(blocks):
            checked = b % 2
            total = [0.0, 0.0]
            for step in range(every):
                for k in (0, 1) if step % 2 else (1, 0):
                    if k == checked and step == every // 2:
                        engines[k].request_check()
                    total[k] += _step(models[k], loss_fn, batch(step), clock)[0]
            ratios.append(total[checked] / total[1 - checked])
    counts = engines[0].records.counts()
    for k, v in engines[1].records.counts().items():
        counts[k] = counts.get(k, 0) + v
    for e in engines:
        e.uninstall()
    return {
        "checks_ratio_every_50": statistics.median(ratios),
        "checks_block_ratios": ratios,
        "checks_every": every,
        "check_records": counts,
    }


def side_by_side(models: dict[str, dict], rounds: int, copies: int = 3, warmup: int = 3) -> dict:
    """Step times of each model under torch checkpoint (twice: the ``torch`` arm and a
    ``control`` arm, built alike) and under lightning_replay (``replay``), ``copies`` copies per
    arm, stepped in turn (:func:`bench_common.arms_side_by_side`). Per model:

    * ``ratio_vs_torch_checkpoint``: median over rounds of replay / the mean of the two torch
      arms;
    * ``torch_vs_torch``: median over rounds of control / torch, the same measurement between
      two arms that do the same work: how far from 1 this run's noise alone puts a ratio;
    * medians of the step times, and of replay's extra over the torch arms (seconds of this
      thread's CPU on CPU);
    * saved bytes of one step, counted alike for torch checkpoint and replay, and the bytes
      the engine preserves besides (see the module docstring).
    """
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    out = {}
    for name, size in models.items():
        torch.manual_seed(0)
        proto, pattern, make_batch, loss_fn = BUILDERS[name](size)
        proto.to(dev).train()
        names = _segments(proto, pattern)
        batch = lambda s, mb=make_batch: tuple(t.to(dev) for t in mb(s))  # noqa: E731
        arms, engines = torch_and_replay_arms(
            proto, names, copies, lambda m, s: _step(m, loss_fn, batch(s), clock), warmup
        )
        t_torch, t_control, t_replay = arms_side_by_side(
            arms, lambda m, r: _step(m, loss_fn, batch(warmup + r), clock)[0], rounds
        )
        reference = [(a + b) / 2 for a, b in zip(t_torch, t_control)]
        _, torch_bytes = _step(arms[0][0], loss_fn, batch(0), clock)
        _, replay_bytes = _step(arms[2][0], loss_fn, batch(0), clock)
        out[name] = {
            "segments": len(names),
            "size": size,
            "rounds": rounds,
            "copies": copies,
            "modes": sorted({s["mode"] for s in engines[0].summary().values()}),
            "ratio_vs_torch_checkpoint": paired_ratio(t_replay, reference),
            "torch_vs_torch": paired_ratio(t_control, t_torch),
            "replay_step_s": statistics.median(t_replay),
            "torch_step_s": statistics.median(reference),
            "extra_s": statistics.median(a - b for a, b in zip(t_replay, reference)),
            "replay_saved_bytes": replay_bytes,
            "torch_saved_bytes": torch_bytes,
            "replay_preserved_bytes": int(engines[0].window_stats()["preserved_bytes"]),
        }
        for e in engines:
            e.uninstall()
        del arms, engines
    return out


def run(cfg: dict) -> dict:
    """Every model in ``cfg["models"]`` (name -> size): ``rounds`` rounds side by side with
    ``copies`` copies per arm (:func:`side_by_side`), then ``check_blocks`` blocks of ``every``
    steps with and without sampled checks."""
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        out = side_by_side(cfg["models"], cfg["rounds"], cfg.get("copies", 3))
        for name, size in cfg["models"].items():
            torch.manual_seed(0)
            proto, pattern, make_batch, loss_fn = BUILDERS[name](size)
            proto.to(dev).train()
            batch = lambda s, mb=make_batch: tuple(t.to(dev) for t in mb(s))  # noqa: E731
            names = _segments(proto, pattern)
            every = cfg.get("every", 50)
            out[name].update(
                _checks(proto, names, loss_fn, batch, clock, cfg["check_blocks"], every)
            )
        return out
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
    copies = SUITES[suite]["real_models"].get("copies", 3)
    print(json.dumps(side_by_side(SUITES[suite]["real_models"]["models"], rounds, copies)))
