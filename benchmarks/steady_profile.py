"""Where a steady replay step spends its time beyond torch checkpoint's, on one real model.

Two measurements, both on the quick sizes of ``bench_real_models`` (one intra-op thread, this
thread's CPU time):

* ``functions``: the engine's own steady-path functions, timed in place (the guard, the forward's
  capture, the replay context, the whole snapshot's copies, the window's begin and end), in
  microseconds per call and milliseconds per step. In place, not in a loop: between two calls a
  block's convolutions evict the caches, and the same code costs 3-5x what a micro-benchmark
  of it shows.
* ``variants``: paired steps against torch checkpoint, for the engine as it is (``full``) and
  with each segment's call replaced by a bare ``checkpoint(forward)`` (``direct``: the same
  installation, class swaps and windows, no per-call bookkeeping). Measurement only: ``direct``
  is not exact (batch norm's statistics are updated twice, as under torch checkpoint).

    python benchmarks/steady_profile.py resnet18 30
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

import bench_real_models as brm
import lightning_replay as lr
from lightning_replay import engine, guards, preservation, restore, runtime
from lightning_replay.verify import torch_checkpoint

SIZES = {
    "gpt2": dict(layers=4, width=128, seq=64, batch=8),
    "vit": dict(layers=4, width=128, image=64, batch=16),
    "resnet18": dict(image=64, batch=8),
}

#: (owner, attribute): the steady path's functions, outermost first
FUNCTIONS = [
    (guards.Guard, "changed"),
    (runtime.SegmentRuntime, "_prepare"),
    (restore._Invocation, "__init__"),
    (restore._ReplayContext, "__enter__"),
    (restore._ReplayContext, "__exit__"),
    (preservation.WholeSnapshot, "__init__"),
    (preservation.WholeSnapshot, "swap_in"),
    (preservation.WholeSnapshot, "swap_out"),
    (restore, "swap_slots"),
    (engine.ReplayEngine, "begin_window"),
    (engine.ReplayEngine, "end_forward"),
]
_CLOCK = time.thread_time


def _build(name: str):
    torch.manual_seed(0)
    proto, pattern, make_batch, loss_fn = brm.BUILDERS[name](SIZES[name])
    proto.train()
    names = brm._segments(proto, pattern)
    return proto, names, make_batch, loss_fn


def functions(name: str, steps: int) -> dict:
    """CPU time inside each steady-path function, per call and per step."""
    acc: dict[str, list] = {}
    originals = []

    def timed(owner, attr):
        f = getattr(owner, attr)
        label = f"{getattr(owner, '__name__', owner).rsplit('.', 1)[-1]}.{attr}"
        acc[label] = [0.0, 0]

        def wrapper(*a, **k):
            t = _CLOCK()
            try:
                return f(*a, **k)
            finally:
                acc[label][0] += _CLOCK() - t
                acc[label][1] += 1

        originals.append((owner, attr, f))
        setattr(owner, attr, wrapper)

    proto, names, make_batch, loss_fn = _build(name)
    model = copy.deepcopy(proto)
    eng = lr.install(model, names)
    for s in range(3):
        brm._step(model, loss_fn, make_batch(s), _CLOCK)
    for owner, attr in FUNCTIONS:
        timed(owner, attr)
    try:
        total = sum(brm._step(model, loss_fn, make_batch(3 + s), _CLOCK)[0] for s in range(steps))
    finally:
        for owner, attr, f in reversed(originals):
            setattr(owner, attr, f)
        eng.uninstall()
    return {
        "step_ms": round(1e3 * total / steps, 2),
        "segments": len(names),
        "us_per_call": {k: round(1e6 * t / n, 1) for k, (t, n) in acc.items() if n},
        "ms_per_step": {k: round(1e3 * t / steps, 3) for k, (t, n) in acc.items() if n},
    }


def variant(name: str, steps: int, which: str) -> dict:
    """Paired steps of the replay model (``full`` or ``direct``) against torch checkpoint."""
    proto, names, make_batch, loss_fn = _build(name)
    naive = torch_checkpoint(copy.deepcopy(proto), names)
    model = copy.deepcopy(proto)
    eng = lr.install(model, names)
    for s in range(3):
        brm._step(model, loss_fn, make_batch(s), _CLOCK)
        brm._step(naive, loss_fn, make_batch(s), _CLOCK)
    call = runtime.SegmentRuntime.__call__

    def direct(self, args, kwargs):
        if self.status != "active":
            return call(self, args, kwargs)
        return checkpoint(self.orig_forward, *args, use_reentrant=False, **kwargs)

    if which == "direct":
        runtime.SegmentRuntime.__call__ = direct
    extra, base = [], []
    try:
        for s in range(steps):
            pair = [(model, []), (naive, [])]
            for m, out in pair if s % 2 else pair[::-1]:
                out.append(brm._step(m, loss_fn, make_batch(3 + s), _CLOCK)[0])
            extra.append(pair[0][1][0] - pair[1][1][0])
            base.append(pair[1][1][0])
    finally:
        runtime.SegmentRuntime.__call__ = call
        eng.uninstall()
    return {
        "torch_ms": round(1e3 * statistics.median(base), 2),
        "extra_ms": round(1e3 * statistics.median(extra), 3),
        "ratio": round(statistics.median((b + e) / b for b, e in zip(base, extra)), 4),
    }


if __name__ == "__main__":
    model_name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    torch.set_num_threads(1)
    print(
        json.dumps(
            {
                "model": model_name,
                "functions": functions(model_name, n),
                "variants": {v: variant(model_name, n, v) for v in ("full", "direct")},
            }
        )
    )
