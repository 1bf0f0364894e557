"""What a plan's costs say recomputing frees, against what the allocator really frees (CPU).

One process, no FSDP: an MLP-block model under ``lr.install``, run all retained and under the
lowest-memory plan; per run, the allocations still live when backward begins (profiler
allocation events with their Python stacks, paired by address), grouped by where they were
made. Prints the plan's claimed saving, the real one, and the allocations only the recomputed
run holds (``torch.utils.checkpoint``'s saved RNG state, 5,056 B per recomputed call, is one).

    python benchmarks/fsdp_held_at_backward.py [--dim 64] [--batch 64]

Under FSDP the same comparison is ``tests/strategies/test_replay_fsdp.py::
test_the_plan_frees_real_memory_on_every_rank`` (two gloo ranks).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning_replay as lr  # noqa: E402

MARK = "bench::backward_begins"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def live_at_backward(prof: profile) -> dict[int, tuple[int, str]]:
    """Address -> (bytes, where) of the CPU allocations made before ``MARK`` and not freed."""
    allocs, marks = [], []

    def walk(e, where: str) -> None:
        if e.name == MARK:
            marks.append(e.start_time_ns)
        kind, fields = e.typed
        if kind == torch._C._profiler._EventType.Allocation and fields.device.type == "cpu":
            allocs.append((e.start_time_ns, fields.ptr, fields.alloc_size, where))
        for c in e.children:
            walk(c, e.name if not e.name.startswith("<built-in") else where)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "")
    live: dict[int, tuple[int, str]] = {}
    for t, ptr, size, where in sorted(allocs, key=lambda a: a[0]):
        if t >= min(marks):
            break
        if size > 0:
            live[ptr] = (size, where)
        else:
            live.pop(ptr, None)
    return live


def run(dim: int, batch: int, steps: int = 8, **install) -> tuple[dict, lr.ReplayEngine]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim) for _ in range(3)], nn.Linear(dim, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = lr.install(model, ["0", "1", "2"], calibration_steps=1, budget="min", **install)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(batch, dim, generator=gen)
        opt.zero_grad(set_to_none=True)
        last = step == steps - 1
        with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=last
        ) as prof:
            loss = (model(x) ** 2).mean()
            with torch.profiler.record_function(MARK):
                pass
            loss.backward()
        opt.step()
    return live_at_backward(prof), engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    torch.set_num_threads(1)
    retained, _ = run(a.dim, a.batch, planner="retain_all")
    planned, engine = run(a.dim, a.batch)
    choices = engine.plan.choices
    claimed = sum(
        c.options["retain"].memory - c.options[choices[c.name]].memory for c in engine.costs
    )
    held = {k: sum(n for n, _ in run_.values()) for k, run_ in (("r", retained), ("p", planned))}
    print(f"plan {choices}")
    print(f"live at backward: all retained {held['r']} B, planned {held['p']} B")
    print(f"freed: the plan's costs say {claimed} B, the allocator shows {held['r'] - held['p']} B")
    only = collections.Counter()
    for n, where in planned.values():
        only[(n, where)] += 1
    for n, where in retained.values():
        if only[(n, where)]:
            only[(n, where)] -= 1
    print("held only by the planned run (bytes x count, made in):")
    for (n, where), k in sorted(only.items(), key=lambda kv: -kv[0][0] * kv[1]):
        if k:
            print(f"  {n:>8} x {k}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
