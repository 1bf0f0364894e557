"""The sparse-write map: where keeping only the overwritten rows pays off, and where whole
snapshots win.

The workload (:class:`MapModel`): ``blocks`` residual MLP blocks, each reading its own memory
bank densely (every row, through its mean) in the segment; after all blocks have run, the step
overwrites a few data-dependent rows of every bank (``index_copy_``). Replaying a block needs
its bank as the forward saw it: ``whole`` copies the bank at forward time, ``regions`` keeps the
overwritten rows at write time, ``retain`` keeps the block's activations. Unlike
:class:`lightning_replay.apps.sparse_write.SparseWriteModel`, whose attention saves activations
that grow with the bank, nothing this block saves for backward depends on the bank: the state
size and the activation bytes are two independent knobs, which is what a map needs.

Three axes, fixed before measuring (see :data:`GRID`):

* ``state_ratio``: bank bytes / the block's activation bytes;
* ``write_fraction``: rows overwritten per step / rows of the bank;
* ``budget_position``: where the budget lies between the lowest budget any method can meet (0)
  and ``retain_all``'s peak (1).

Costs are measured once per (state_ratio, write_fraction) pair, as ``install(budget=...)``
measures them, with the selective option offered (policy :data:`POLICY`); every method plans
from those costs at each budget; every distinct plan runs on its own copy of the model, all
copies and a plain model (no lightning_replay) stepping in the same rounds. A plan two methods
share is one run: their ratio is 1 by construction.

Two selective baselines: ``selective_all`` (every block its lowest-memory selective option,
state preserved as for a full replay) and ``torch_sac`` (``torch.utils.checkpoint`` with
torch's selective checkpoint under the same policy on every block: one configuration, in the
same rounds, feasible at a budget when its measured peak is within it). torch's is
state-unaware: its replay reads the bank as the step left it, so its gradients are wrong here
(``torch_sac_gradients_match_plain``, one step compared bit for bit with plain training).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench_common import device, measure_costs, median_se, paired_ratio, run_plans
from frontier import torch_sac
from lightning_replay.planner import InfeasibleBudget, costs_to_dict, min_feasible_budget, plan

#: The methods compared in every cell (``retain_all`` only fits at position 1, off the grid).
METHODS = ("joint", "eager_whole", "fixed_regions", "whole_all", "selective_all")
BASELINES = ("eager_whole", "fixed_regions", "whole_all", "selective_all")
#: the selective policy of the selective options and of torch's selective checkpoint
POLICY = "matmul"

#: The full grid, fixed before any measurement.
#:
#: * state_ratio 1/8 .. 4: at 1/8 a whole snapshot is a small fraction of what retaining keeps,
#:   so ``eager_whole`` reaches low budgets with it; at 1 a snapshot costs what retaining costs
#:   (the crossover); at 2 and 4 a whole snapshot costs more memory than keeping the activations,
#:   so ``eager_whole`` can only retain and only ``regions`` saves memory.
#: * write_fraction 1/1024 .. 1/8: 1/1024 is a memory bank or queue written a batch at a time
#:   (MoCo: 256 of 65536 rows); 1/64 a faster-moving bank; 1/8 approaches a dense write, where
#:   the regions kept grow toward a whole snapshot and capturing them costs more per step.
#: * budget_position 0.1 .. 0.9: evenly spaced interior points. At 0 only the lowest-memory plan
#:   fits and at 1 everything can be retained; both ends say nothing about choosing.
GRID = {
    "state_ratio": (1 / 8, 1 / 2, 1, 2, 4),
    "write_fraction": (1 / 1024, 1 / 64, 1 / 8),
    "budget_position": (0.1, 0.3, 0.5, 0.7, 0.9),
}
#: The quick suite's coarse subset: both ends and the middle of state_ratio, both ends of
#: write_fraction, three budget positions (18 cells).
QUICK_GRID = {
    "state_ratio": (1 / 8, 1, 4),
    "write_fraction": (1 / 1024, 1 / 8),
    "budget_position": (0.1, 0.5, 0.9),
}


class MapBlock(nn.Module):
    """A residual MLP conditioned on the mean of its memory bank.

    The mean reads every row; its backward needs none of them, so the bytes saved for backward
    are the MLP's alone, whatever the bank's size.
    """

    def __init__(self, dim: int, hidden: int, rows: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.register_buffer("memory", torch.randn(rows, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.memory.mean(0)
        return x + self.fc2(F.gelu(self.fc1(h)))


class MapModel(nn.Module):
    """``blocks`` :class:`MapBlock` s; after them, ``write_rows`` rows of every bank are overwritten.

    Example:
        >>> m = MapModel(blocks=2, dim=8, hidden=16, rows=64, write_rows=2)
        >>> m(torch.randn(4, 8)).shape
        torch.Size([4, 1])
    """

    def __init__(self, blocks: int, dim: int, hidden: int, rows: int, write_rows: int) -> None:
        super().__init__()
        if not 0 < write_rows <= rows:
            raise ValueError(f"write_rows={write_rows} must be in 1..rows={rows}")
        self.blocks = nn.ModuleList(MapBlock(dim, hidden, rows) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)
        self.write_rows = write_rows

    @property
    def segments(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        self._write(x.detach())
        return self.head(x)

    @torch.no_grad()
    def _write(self, h: torch.Tensor) -> None:
        # Rows chosen by the data (distinct indices, so the rows written are exactly write_rows).
        n = self.blocks[0].memory.shape[0]
        start = int((h[0, 0].abs() * 1e4).long()) % n
        idx = (torch.arange(self.write_rows, device=h.device) * 7919 + start) % n
        rows = F.normalize(
            h[: self.write_rows].repeat(-(-self.write_rows // len(h)), 1)[: self.write_rows], dim=1
        )
        for b in self.blocks:
            b.memory.index_copy_(0, idx, rows)


def activation_bytes(batch: int, dim: int, hidden: int) -> int:
    """What one block saves for backward (fp32): fc1's input, gelu's input and fc2's input."""
    return 4 * batch * (dim + 2 * hidden)


def _cell_shape(cfg: dict, state_ratio: float, write_fraction: float) -> tuple[int, int]:
    act = activation_bytes(cfg["batch"], cfg["dim"], cfg["hidden"])
    rows = max(8, round(state_ratio * act / (4 * cfg["dim"])))
    # index_copy_ with distinct indices needs write_rows <= rows; 1/1024 of a small bank is 1 row
    return rows, max(1, min(rows, round(rows * write_fraction)))


def run_pair(
    cfg: dict, state_ratio: float, write_fraction: float, positions: tuple[float, ...]
) -> tuple[list[dict], dict]:
    """Every cell of one (state_ratio, write_fraction) pair: costs once, all plans side by side."""
    dev = device()
    rows, write_rows = _cell_shape(cfg, state_ratio, write_fraction)
    torch.manual_seed(0)
    proto = MapModel(cfg["blocks"], cfg["dim"], cfg["hidden"], rows, write_rows).to(dev)
    make_model = lambda: copy.deepcopy(proto)  # noqa: E731
    make_input = lambda s: torch.randn(  # noqa: E731
        cfg["batch"], cfg["dim"], generator=torch.Generator().manual_seed(s)
    ).to(dev)
    costs, base = measure_costs(
        make_model,
        proto.segments,
        make_input,
        calibration_steps=cfg.get("calibration_steps", 5),
        selective=POLICY,
    )
    mins = {m: min_feasible_budget(costs, base, m) for m in (*METHODS, "retain_all")}
    lo, hi = min(mins[m] for m in METHODS), mins["retain_all"]

    plans: dict[str, Any] = {}  # distinct plans by id
    cells: list[dict] = []
    for pos in positions:
        budget = int(lo + pos * (hi - lo))
        methods: dict[str, dict] = {}
        for m in METHODS:
            try:
                p = plan(costs, budget=budget, base_memory=base, method=m)
            except InfeasibleBudget as exc:
                methods[m] = {"feasible": False, "min_feasible_bytes": exc.min_feasible}
                continue
            pid = "|".join(f"{k}={v}" for k, v in p.choices.items())
            plans.setdefault(pid, p)
            methods[m] = {
                "feasible": True,
                "plan_id": pid,
                "choices": p.choices,
                "predicted_peak_bytes": p.peak_memory,
            }
        cells.append(
            {
                "state_ratio": state_ratio,
                "write_fraction": write_fraction,
                "budget_position": pos,
                "budget_bytes": budget,
                "buffer_rows": rows,
                "write_rows": write_rows,
                "methods": methods,
            }
        )

    ids = {pid: f"p{i}" for i, pid in enumerate(plans)}
    # Option times are extra seconds over ``retain``: the reference a plan's predicted step time
    # adds to is the engine with every segment retained (what the engine costs with nothing
    # replayed: guards, accounting, hooks; the same for every plan, so no plan choice depends on
    # it). It runs in the same rounds, beside the plain model (no lightning_replay).
    ref = plan(costs, budget=hi, base_memory=base, method="retain_all")
    measured = run_plans(
        make_model,
        proto.segments,
        make_input,
        {**{ids[pid]: p for pid, p in plans.items()}, "retain_all": ref},
        cfg["rounds"],
        dev,
        clock=_clock(dev),
        copies=cfg.get("copies", 1),
        others={"torch_sac": lambda: torch_sac(make_model(), proto.segments, POLICY)},
    )
    retained = measured.pop("retain_all")
    sac = measured.pop("torch_sac")
    sac_exact = _gradients_match_plain(make_model, proto.segments, make_input(0))
    for cell in cells:
        ms = cell["methods"]
        for m, d in ms.items():
            if not d["feasible"]:
                continue
            r = measured[ids[d["plan_id"]]]
            predicted = retained["step_time_s"] + plans[d["plan_id"]].extra_time
            d.update(
                step_time_s=r["step_time_s"],
                step_times_s=r["step_times_s"],
                predicted_step_time_s=predicted,
                peak_bytes=r["peak_bytes"],
                vs_plain=paired_ratio(r["step_times_s"], r["plain_step_times_s"]),
                within_budget=r["peak_bytes"] <= cell["budget_bytes"],
                step_time_error=(predicted - r["step_time_s"]) / r["step_time_s"],
                # the noise in that error: the bootstrap standard errors of the two measured
                # medians it is made of (this plan's, and retain_all's that the prediction adds
                # to), relative to the step
                step_time_error_se=math.hypot(
                    median_se(r["step_times_s"]), median_se(retained["step_times_s"])
                )
                / r["step_time_s"],
            )
        cell["plain_step_time_s"] = retained["plain_step_time_s"]
        cell["retain_all_step_time_s"] = retained["step_time_s"]
        cell["joint_vs_eager_whole"] = _joint_vs(ms, "eager_whole")
        feasible = [b for b in BASELINES if ms[b]["feasible"]]
        best = min(feasible, key=lambda b: ms[b]["step_time_s"]) if feasible else None
        cell["best_baseline"] = best
        cell["joint_vs_best_baseline"] = _joint_vs(ms, best) if best else None
        fits = sac["peak_bytes"] <= cell["budget_bytes"]
        cell["torch_sac"] = {
            "feasible": fits,
            "step_time_s": sac["step_time_s"] if fits else None,
            "peak_bytes": sac["peak_bytes"],
            "gradients_match_plain": sac_exact,
        }
        # (reported, not a target: torch's selective checkpoint is silently wrong here)
        cell["joint_vs_torch_sac"] = (
            paired_ratio(ms["joint"]["step_times_s"], sac["step_times_s"])
            if fits and ms["joint"]["feasible"]
            else None
        )
        # what the measured costs predict for the same pair (the cost model's own view)
        cell["predicted_joint_vs_eager_whole"] = (
            ms["joint"]["predicted_step_time_s"] / ms["eager_whole"]["predicted_step_time_s"]
            if ms["joint"]["feasible"] and ms["eager_whole"]["feasible"]
            else None
        )
    act = costs[0].activation_bytes
    pair = {
        "state_ratio": state_ratio,
        "write_fraction": write_fraction,
        "buffer_rows": rows,
        "write_rows": write_rows,
        "activation_bytes": act,
        "measured_state_ratio": rows * cfg["dim"] * 4 / act if act else None,
        "base_bytes": base,
        "min_feasible_bytes": mins,
        "costs": costs_to_dict(costs),
        "distinct_plans": len(plans),
        "torch_sac_peak_bytes": sac["peak_bytes"],
        "torch_sac_step_time_s": sac["step_time_s"],
        "torch_sac_gradients_match_plain": sac_exact,
        "plain_step_time_s": retained["plain_step_time_s"],
        "retain_all_step_time_s": retained["step_time_s"],
        # the engine's fixed cost per step (nothing replayed) over the plain model
        "retain_all_vs_plain": paired_ratio(
            retained["step_times_s"], retained["plain_step_times_s"]
        ),
    }
    return cells, pair


def _gradients_match_plain(make_model, segments: list[str], x: torch.Tensor) -> bool:
    """One step of torch's selective checkpoint against plain training, bit for bit."""
    plain, sac = make_model(), torch_sac(make_model(), segments, POLICY)
    grads = []
    for m in (plain, sac):
        m(x).float().pow(2).mean().backward()
        grads.append([p.grad for p in m.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def _joint_vs(methods: dict, other: str) -> float | None:
    j, o = methods["joint"], methods[other]
    if not (j["feasible"] and o["feasible"]):
        return None
    if j["plan_id"] == o["plan_id"]:
        return 1.0  # the same plan: one run, the same computation
    return paired_ratio(j["step_times_s"], o["step_times_s"])


def _clock(dev: torch.device):
    # On a CPU shared with other work, wall time counts the other processes' time slices, at
    # random; the CPU time of this thread counts this step's work only. It holds the whole step
    # with one intra-op thread (CPU autograd runs backward on the calling thread). On CUDA the
    # step is synchronized and timed by the wall clock.
    return time.thread_time if dev.type == "cpu" else time.perf_counter


def run(cfg: dict, grid: dict) -> dict:
    """The map over ``grid`` with the workload sized by ``cfg`` (blocks, dim, hidden, batch,
    rounds, calibration_steps). On CPU it runs on one intra-op thread (see :func:`_clock`)."""
    cells, pairs = [], []
    threads = torch.get_num_threads()
    if device().type == "cpu":
        torch.set_num_threads(1)
    try:
        for s in grid["state_ratio"]:
            for w in grid["write_fraction"]:
                c, p = run_pair(cfg, s, w, tuple(grid["budget_position"]))
                cells += c
                pairs.append(p)
    finally:
        torch.set_num_threads(threads)
    joint_vs_best = [
        c["joint_vs_best_baseline"] for c in cells if c["joint_vs_best_baseline"] is not None
    ]
    feasible = [m for c in cells for m in c["methods"].values() if m["feasible"]]
    return {
        "config": cfg,
        "clock": "thread CPU time, 1 intra-op thread"
        if device().type == "cpu"
        else "wall, synchronized",
        "grid": {k: list(v) for k, v in grid.items()},
        "pairs": pairs,
        "cells": cells,
        "joint_worst_vs_best_baseline": max(joint_vs_best, default=None),
        "cells_joint_vs_eager_whole_le_0_82": [
            {
                k: c[k]
                for k in (
                    "state_ratio",
                    "write_fraction",
                    "budget_position",
                    "joint_vs_eager_whole",
                )
            }
            for c in cells
            if c["joint_vs_eager_whole"] is not None and c["joint_vs_eager_whole"] <= 0.82
        ],
        "cells_eager_whole_infeasible": sum(
            not c["methods"]["eager_whole"]["feasible"] for c in cells
        ),
        "peaks_within_budget": all(m["within_budget"] for m in feasible),
        "peak_error_max": max(
            (
                abs(m["peak_bytes"] - m["predicted_peak_bytes"]) / m["predicted_peak_bytes"]
                for m in feasible
            ),
            default=None,
        ),
        "step_time_error_max": max((abs(m["step_time_error"]) for m in feasible), default=None),
        "step_time_error_median": statistics.median(abs(m["step_time_error"]) for m in feasible)
        if feasible
        else None,
        "step_time_error_se_median": statistics.median(m["step_time_error_se"] for m in feasible)
        if feasible
        else None,
        "retain_all_vs_plain_median": statistics.median(p["retain_all_vs_plain"] for p in pairs),
    }
