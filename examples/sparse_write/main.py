"""Train the sparse-write workload with lightning_replay under a budget (framework-free API).

python examples/sparse_write/main.py --budget 200MiB --planner joint --steps 12
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import lightning_replay as lr
from lightning_replay.apps.sparse_write import SparseWriteModel, sparse_write_input


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--buffer-rows", type=int, default=8192)
    ap.add_argument("--write-rows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget", default=None, help="bytes or '200MiB'; default: lowest memory")
    ap.add_argument("--planner", default="joint")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = SparseWriteModel(a.blocks, a.dim, a.hidden, a.buffer_rows, a.write_rows)
    engine = lr.install(model, model.segments, budget=a.budget or "min", planner=a.planner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(sparse_write_input(step, a.batch, a.dim)).pow(2).mean().backward()
        opt.step()
        stats = engine.window_stats()  # the step just trained
        print(
            f"step {step:3d}  {1e3 * (time.perf_counter() - t0):7.1f} ms  "
            f"peak {lr.format_bytes(stats['peak_bytes'] or 0):>10}  plan v{stats['plan_version']}"
        )
    print(
        json.dumps(
            {"plan": engine.plan.to_dict() if engine.plan else None, "summary": engine.summary()},
            indent=1,
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
