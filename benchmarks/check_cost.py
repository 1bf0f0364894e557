"""What one checked step costs, alone, on the real models of ``bench_real_models``.

Per model (quick sizes): the engine installed with sampled checks recorded, three warm steps,
then ``ROUNDS`` times three plain steps and one step with derivative + byte checks
(``request_check``). Prints the medians (milliseconds of this thread's CPU, one intra-op
thread), the checked step's extra in plain steps, and what one check in 50 steps then costs:
``1 + extra / 50``, the expected value of ``real_models.*.checks_ratio_every_50``.

    python benchmarks/check_cost.py [ROUNDS] [MODEL ...]
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
import warnings

import torch

import bench_real_models as brm
import lightning_replay as lr
from run import SUITES


def run(name: str, rounds: int = 8) -> dict:
    size = SUITES["quick"]["real_models"]["models"][name]
    torch.manual_seed(0)
    proto, pattern, make_batch, loss_fn = brm.BUILDERS[name](size)
    proto.train()
    model = copy.deepcopy(proto)
    engine = lr.install(model, brm._segments(proto, pattern), on_violation="record")
    clock = time.thread_time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(3):
            brm._step(model, loss_fn, make_batch(s), clock)
        plain, checked = [], []
        for r in range(rounds):
            for s in range(3):
                plain.append(brm._step(model, loss_fn, make_batch(4 * r + s), clock)[0])
            engine.request_check()
            checked.append(brm._step(model, loss_fn, make_batch(4 * r + 3), clock)[0])
    counts = engine.records.counts()
    engine.uninstall()
    p, c = statistics.median(plain), statistics.median(checked)
    return {
        "plain_ms": round(1e3 * p, 1),
        "checked_ms": round(1e3 * c, 1),
        "extra_steps": round((c - p) / p, 2),
        "every_50": round(1 + (c - p) / p / 50, 4),
        "records": counts,
    }


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    names = sys.argv[2:] or list(brm.BUILDERS)
    torch.set_num_threads(1)
    print(json.dumps({name: run(name, n) for name in names}))
