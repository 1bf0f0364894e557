"""How far apart two copies of one model under one plan run, beside the difference a plan makes.

One (state, writes) pair of the sparse-write map (``sparse_map.MapModel``, quick sizes), four
fixed plans (every block with a region log; one block retained, the last or the first; every
block retained), each on ``COPIES`` model copies, all stepped round by round
(``bench_common.run_plans``, one copy each). Prints each copy's median step time and its
bootstrap standard error, in milliseconds of this thread's CPU time (one intra-op thread).

    python benchmarks/copy_spread.py [ROUNDS] [STATE_RATIO] [WRITE_FRACTION] [COPIES]
"""

from __future__ import annotations

import copy
import json
import sys
import time
import types

import torch

import sparse_map
from bench_common import device, median_se, run_plans
from run import SUITES


def run(rounds: int, state_ratio: float, write_fraction: float, copies: int) -> dict:
    cfg = dict(SUITES["quick"]["sparse_write_map"])
    rows, write_rows = sparse_map._cell_shape(cfg, state_ratio, write_fraction)
    torch.manual_seed(0)
    proto = sparse_map.MapModel(cfg["blocks"], cfg["dim"], cfg["hidden"], rows, write_rows)
    segs = proto.segments
    last = len(segs) - 1
    layouts = {
        "all_regions": lambda i: "regions",
        "retain_last": lambda i: "retain" if i == last else "regions",
        "retain_first": lambda i: "retain" if i == 0 else "regions",
        "retain_all": lambda i: "retain",
    }
    plans = {
        f"{name}#{c}": types.SimpleNamespace(
            choices={s: pick(i) for i, s in enumerate(segs)}, peak_memory=0, extra_time=0.0
        )
        for c in range(copies)
        for name, pick in layouts.items()
    }
    out = run_plans(
        lambda: copy.deepcopy(proto),
        segs,
        lambda s: torch.randn(cfg["batch"], cfg["dim"], generator=torch.Generator().manual_seed(s)),
        plans,
        rounds,
        device(),
        clock=time.thread_time,
    )
    return {
        k: {
            "step_ms": round(v["step_time_s"] * 1e3, 1),
            "se_ms": round(median_se(v["step_times_s"]) * 1e3, 1),
        }
        for k, v in out.items()
    }


if __name__ == "__main__":
    a = sys.argv[1:]
    torch.set_num_threads(1)
    print(
        json.dumps(
            run(
                int(a[0]) if a else 24,
                float(a[1]) if len(a) > 1 else 4.0,
                float(a[2]) if len(a) > 2 else 0.125,
                int(a[3]) if len(a) > 3 else 2,
            )
        )
    )
