"""lightning_replay benchmarks: figures as ratios measured side by side in one run.

    python benchmarks/run.py --suite quick --json OUT.json     # make bench (< 10 min, 2 cores)
    python benchmarks/run.py --suite full --json OUT.json

Sections (keys of the JSON):

* ``overhead``: replay / ``torch.utils.checkpoint`` step time on a stateless model, same
  segments, interleaved pairs, medians; saved bytes of each.
* ``sparse_write_map``: the sparse-write map (``sparse_map.py``): per cell of a grid of state
  size / activation bytes, rows written / state and budget position, for ``joint``,
  ``eager_whole``, ``fixed_regions`` and ``whole_all``: feasibility, measured and predicted step
  time, measured and predicted peak. Costs are measured once per (state, writes) pair; every
  distinct plan runs on its own model copy, interleaved round by round with a plain model and an
  all-retained one. ``joint_worst_vs_best_baseline`` and ``cells_joint_vs_eager_whole_le_0_82``
  summarize it.
* ``real_models``: GPT-2, a timm ViT and ResNet-18 (``bench_real_models.py``): replay over
  ``torch.utils.checkpoint`` on the same blocks, with a second torch checkpoint arm as the
  run's noise control; saved bytes of each, checks every 50 steps.
* ``dense_queue``: a MoCo-style dense queue: ``joint`` against ``whole`` on every segment.
* ``planner``: planning time for 16/64/256 segments and the optimality gap against exhaustive
  search.
* ``checks``: step time with derivative + byte checks every 50 steps over without.
* ``frontier``: HF GPT-2 and a small HF Llama (``frontier.py``): budgets from the lowest-memory
  plan's peak to plain training's, in 6 steps; at each, the step time and measured peak of the
  joint plan with the selective option, without it, and torch checkpoint + torch's selective
  checkpoint (same policy) on every block, side by side with a second torch arm as the noise
  control. ``frontier.worst_vs_best_other``: the largest, over points, of joint with selective
  over the faster feasible other arm. The plot goes to ``results/frontier-latest.png``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lightning_replay as lr  # noqa: E402
import sparse_map  # noqa: E402
from bench_common import device, measure_costs, paired_ratio, run_plans, timed_step  # noqa: E402
from lightning_replay.demos.hazards import QueueModel  # noqa: E402
from lightning_replay.planner import min_feasible_budget, plan  # noqa: E402

SUITES = {
    "quick": {
        "overhead": dict(width=1024, blocks=6, batch=64, repeats=36),  # 3 copies x 6 orders x 2
        # 18 cells (sparse_map.QUICK_GRID); about two minutes on 2 cores
        "sparse_write_map": dict(
            blocks=6,
            dim=128,
            hidden=2048,
            batch=256,
            # 30 rounds, three model copies per plan in turn (bench_common.run_plans): at 15
            # rounds one error's own noise was 3-4 % of the step, beside a 6 % target
            rounds=30,
            copies=3,
            calibration_steps=7,
            grid=sparse_map.QUICK_GRID,
        ),
        "real_models": dict(
            # A step's time on this machine varies by 5-10 % from step to step (one model alone,
            # thread CPU time), so one per-round ratio does by about 10 %: the median of 90
            # rounds is within about +-1.5 % (see each model's torch_vs_torch). 90 rounds of
            # three arms: about 110 s for the three models. 90 = 6 orders x 3 copies x 5.
            rounds=90,
            copies=3,
            check_blocks=2,
            every=50,
            models={
                "gpt2": dict(layers=4, width=128, seq=64, batch=8),
                "vit": dict(layers=4, width=128, image=64, batch=16),
                "resnet18": dict(image=64, batch=8),
            },
        ),
        "dense_queue": dict(rows=16384, dim=128, write_rows=128, batch=256, rounds=15),
        "checks": dict(steps=500, every=50),
        "frontier": dict(
            points=6,
            rounds=48,  # 3 copies per arm
            copies=3,
            # a selective option's forward cost is a difference of two forward medians, each
            # over the phase's steps that time the forward alone (about half): at 5 steps that
            # is 2-3 forwards a side, and its noise (measured 2.0-5.6 ms on four identical Llama
            # blocks) is the size of the cost itself
            calibration_steps=9,
            png=os.path.join(HERE, "results", "frontier-latest.png"),
            # at width 128 x 64 tokens the dispatch modes of a selective replay cost more than
            # the products it keeps (every selective arm slower than a full replay on CPU)
            models={
                "gpt2": dict(layers=4, width=256, seq=128, batch=4),
                "llama": dict(layers=4, width=256, seq=128, batch=4),
            },
        ),
    },
    "full": {
        "overhead": dict(width=2048, blocks=8, batch=128, repeats=36),
        # the whole grid: 75 cells, 15 cost measurements (about 10 times the quick map)
        "sparse_write_map": dict(
            blocks=8,
            dim=128,
            hidden=2048,
            batch=256,
            rounds=21,
            copies=3,
            calibration_steps=9,
            grid=sparse_map.GRID,
        ),
        "real_models": dict(
            rounds=54,  # 3 copies x 6 orders x 3
            copies=3,
            check_blocks=6,
            every=50,
            models={
                "gpt2": dict(layers=6, width=256, seq=128, batch=8),
                "vit": dict(layers=6, width=192, image=96, batch=16),
                "resnet18": dict(image=96, batch=16),
            },
        ),
        "dense_queue": dict(rows=65536, dim=128, write_rows=256, batch=512, rounds=9),
        "checks": dict(steps=1000, every=50),
        "frontier": dict(
            points=6,
            rounds=36,
            copies=2,
            calibration_steps=5,
            png=os.path.join(HERE, "results", "frontier-full-latest.png"),
            models={
                "gpt2": dict(layers=6, width=256, seq=128, batch=8),
                "llama": dict(layers=6, width=256, seq=128, batch=8),
            },
        ),
    },
    # seconds, for the test that keeps this script working (figures meaningless)
    "smoke": {
        "overhead": dict(width=32, blocks=2, batch=8, repeats=3, copies=2),
        "sparse_write_map": dict(
            # four blocks of 20 KiB of activations: replaying one frees well above the 5 KiB of
            # CPU RNG state a replayed call holds, so the baselines can plan below retain_all
            blocks=4,
            dim=16,
            hidden=32,
            batch=64,
            rounds=2,
            copies=2,
            calibration_steps=1,
            grid={
                "state_ratio": (1 / 2, 4),
                "write_fraction": (1 / 8,),
                "budget_position": (0.1, 0.9),
            },
        ),
        "real_models": dict(
            rounds=2,
            copies=2,
            check_blocks=1,
            every=2,
            models={
                "gpt2": dict(layers=1, width=16, seq=8, batch=2),
                "vit": dict(layers=1, width=16, image=16, batch=2),
                "resnet18": dict(image=16, batch=2),
            },
        ),
        "dense_queue": dict(rows=64, dim=16, write_rows=4, batch=8, rounds=2),
        "checks": dict(steps=4, every=2),
        "frontier": dict(
            points=3,
            rounds=2,
            copies=1,
            calibration_steps=1,
            png=None,  # the test draws it into its own folder
            models={
                "gpt2": dict(layers=2, width=16, seq=8, batch=2),
                "llama": dict(layers=2, width=16, seq=8, batch=2),
            },
        ),
    },
}


def _ratio(methods: dict, a: str, b: str, key: str = "step_time_s") -> float | None:
    """``a`` over ``b``: measured, the median of the per-round ratios (both ran in the same
    round, side by side, so slow phases of a shared machine cancel); predicted, one ratio."""
    if methods.get(a, {}).get("feasible") and methods.get(b, {}).get("feasible"):
        if key == "step_time_s":
            return paired_ratio(methods[a]["step_times_s"], methods[b]["step_times_s"])
        return methods[a][key] / methods[b][key]
    return None


# ------------------------------------------------------------------------------- sections
def bench_overhead(cfg: dict) -> dict:
    from overhead import run

    r = run(**cfg)
    return {
        "ratio": r["ratio"],
        "replay_saved_bytes": r["replay_saved_bytes"],
        "torch_saved_bytes": r["torch_saved_bytes"],
        "torch_vs_torch": r["torch_vs_torch"],
        "replay_step_s": r["replay_step_s"],
        "torch_step_s": r["torch_step_s"],
        "config": cfg,
    }


def bench_sparse_write_map(cfg: dict) -> dict:
    import sparse_map

    cfg = dict(cfg)
    grid = cfg.pop("grid")
    return sparse_map.run(cfg, grid)


def bench_real_models(cfg: dict) -> dict:
    import bench_real_models

    return bench_real_models.run(cfg)


def bench_dense_queue(cfg: dict) -> dict:
    """MoCo-style dense queue (rows read by every block, a few enqueued after): joint at the
    budget of whole-on-every-segment against whole."""
    dev = device()
    cfg = dict(cfg)
    rounds, batch = cfg.pop("rounds"), cfg.pop("batch")
    torch.manual_seed(0)
    proto = QueueModel(**cfg).to(dev)
    make_model = lambda: copy.deepcopy(proto)
    make_input = lambda s: torch.randn(
        batch, cfg["dim"], generator=torch.Generator().manual_seed(s)
    ).to(dev)
    segments = ["blocks.0", "blocks.1"]
    costs, base = measure_costs(make_model, segments, make_input)
    whole = plan(costs, budget=10**18, base_memory=base, method="whole_all")
    joint = plan(costs, budget=whole.peak_memory, base_memory=base, method="joint")
    joint_min = plan(costs, budget=min_feasible_budget(costs, base, "joint"), base_memory=base)
    measured = run_plans(
        make_model,
        segments,
        make_input,
        {"whole": whole, "joint": joint, "joint_min": joint_min},
        rounds,
        dev,
    )
    return {
        "config": {**cfg, "batch": batch, "rounds": rounds},
        "runs": measured,
        "joint_vs_whole_time": _ratio(
            {k: {"feasible": True, **v} for k, v in measured.items()}, "joint", "whole"
        ),
        "joint_vs_whole_memory": measured["joint_min"]["peak_bytes"]
        / measured["whole"]["peak_bytes"],
    }


def bench_planner() -> dict:
    from planner_bench import run

    return run(seed=0)


def bench_checks(cfg: dict) -> dict:
    """Step time with derivative + byte checks every ``every`` steps over the same without.

    Two copies of the model train side by side, step by step; the steps fall into blocks of
    ``every`` steps, each with one checked step. The figure is the median over blocks of the
    block's total time with checks over its total without (slow phases of a shared machine hit
    both sides of a block alike); the ratio of the run totals is reported beside it.
    """
    dev = device()
    torch.manual_seed(0)
    proto = QueueModel(rows=4096, dim=64, write_rows=64).to(dev)
    models = {k: copy.deepcopy(proto) for k in ("checked", "plain")}
    engines = {k: lr.install(m, "blocks.*") for k, m in models.items()}
    x = torch.randn(256, 64, device=dev)
    every = cfg["every"]
    for k in models:  # probe and warm up outside the measured blocks
        for _ in range(2):
            timed_step(models[k], x)
    blocks = []
    for _ in range(cfg["steps"] // every):
        block = {k: 0.0 for k in models}
        for step in range(every):
            for k in ("checked", "plain") if step % 2 else ("plain", "checked"):
                if k == "checked" and step == every // 2:
                    engines[k].request_check()
                block[k] += timed_step(models[k], x)
        blocks.append(block)
    records = engines["checked"].records.counts()
    ratios = [b["checked"] / b["plain"] for b in blocks]
    return {
        "overhead_ratio_every_50": statistics.median(ratios),
        "block_ratios": ratios,
        "total_ratio": sum(b["checked"] for b in blocks) / sum(b["plain"] for b in blocks),
        "steps": len(blocks) * every,
        "every": every,
        "records": records,
    }


# ------------------------------------------------------------------------------- driver
def bench_frontier(cfg: dict) -> dict:
    import frontier

    r = frontier.run(cfg)
    if cfg.get("png"):
        r["png"] = frontier.plot(r, cfg["png"])
    return r


def run_suite(suite: str, only: list[str] | None = None) -> dict:
    cfg = SUITES[suite]
    sections = {
        "overhead": lambda: bench_overhead(cfg["overhead"]),
        "sparse_write_map": lambda: bench_sparse_write_map(cfg["sparse_write_map"]),
        "real_models": lambda: bench_real_models(cfg["real_models"]),
        "dense_queue": lambda: bench_dense_queue(cfg["dense_queue"]),
        "planner": bench_planner,
        "checks": lambda: bench_checks(cfg["checks"]),
        "frontier": lambda: bench_frontier(cfg["frontier"]),
    }
    dev = device()
    out: dict[str, Any] = {
        "suite": suite,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0)
        if dev.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "malloc": _malloc_setting(),
        "seconds": {},
        # other work on the machine (1-minute load average) when the run began and ended
        "load_average": {"start": os.getloadavg()[0]},
    }
    for name, fn in sections.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        out[name] = fn()
        out["seconds"][name] = round(time.perf_counter() - t0, 1)
    out["load_average"]["end"] = os.getloadavg()[0]
    return out


def targets(r: dict) -> list[tuple[str, Any, str, bool]]:
    """(name, value, target, met) for every target the README reports."""
    rows = []

    def add(name, value, target, ok):
        rows.append((name, value, target, bool(ok) if value is not None else False))

    if "overhead" in r:
        o = r["overhead"]
        add(
            "overhead.ratio",
            round(o["ratio"], 3),
            "<= 1.03 and equal saved bytes",
            o["ratio"] <= 1.03 and o["replay_saved_bytes"] == o["torch_saved_bytes"],
        )
        add(
            "overhead.torch_vs_torch",
            round(o["torch_vs_torch"], 3),
            "(report: the same ratio between two torch checkpoint arms, this run's noise)",
            True,
        )
    if "sparse_write_map" in r:
        m = r["sparse_write_map"]
        v = m["joint_worst_vs_best_baseline"]
        add(
            "sparse_write_map.joint_worst_vs_best_baseline",
            v and round(v, 3),
            "<= 1.02 in every cell",
            v is not None and v <= 1.02,
        )
        feasible = [d for c in m["cells"] for d in c["methods"].values() if d["feasible"]]
        over = sum(not d["within_budget"] for d in feasible)
        add("sparse_write_map: feasible plans over budget", over, "0", over == 0)
        v = m["step_time_error_max"]
        add(
            "sparse_write_map.step_time_error_max",
            v and round(v, 3),
            "<= 0.06 (predicted vs measured)",
            v is not None and v <= 0.06,
        )
        v = m["step_time_error_median"]
        add("sparse_write_map.step_time_error_median", v and round(v, 3), "(report)", v is not None)
        v = m.get("step_time_error_se_median")
        add(
            "sparse_write_map.step_time_error_se_median",
            v and round(v, 3),
            "(report: the noise in one error, bootstrap standard error of the medians)",
            v is not None,
        )
        add(
            "sparse_write_map.cells_joint_vs_eager_whole_le_0_82",
            len(m["cells_joint_vs_eager_whole_le_0_82"]),
            f"(report, of {len(m['cells'])})",
            True,
        )
    if "real_models" in r:
        for name, d in r["real_models"].items():
            v = d["ratio_vs_torch_checkpoint"]
            add(
                f"real_models.{name}.ratio_vs_torch_checkpoint",
                round(v, 3),
                "<= 1.03 and equal saved bytes",
                v <= 1.03 and d["replay_saved_bytes"] == d["torch_saved_bytes"],
            )
            v = d["torch_vs_torch"]
            add(
                f"real_models.{name}.torch_vs_torch",
                round(v, 3),
                "(report: the same ratio between two torch checkpoint arms, this run's noise)",
                True,
            )
            v = d["checks_ratio_every_50"]
            add(f"real_models.{name}.checks_ratio_every_50", round(v, 3), "<= 1.03", v <= 1.03)
    if "planner" in r:
        p = r["planner"]
        add("planner.ms_256", round(p["ms_256"], 1), "<= 1000", p["ms_256"] <= 1000)
        add(
            "planner.optimality_gap_max",
            p["optimality_gap_max"],
            "= 0",
            p["optimality_gap_max"] == 0,
        )
    if "checks" in r:
        v = r["checks"]["overhead_ratio_every_50"]
        add("checks.overhead_ratio_every_50", round(v, 3), "<= 1.03", v <= 1.03)
    if "frontier" in r:
        f = r["frontier"]
        v = f["worst_vs_best_other"]
        add(
            "frontier.worst_vs_best_other",
            v and round(v, 3),
            "<= 1.01 (joint+selective / faster other arm)",
            v is not None and v <= 1.01,
        )
        add("frontier.points_le_0_95", f["points_le_0_95"], ">= 2", f["points_le_0_95"] >= 2)
        over = sum(
            1
            for n, m in f.items()
            if isinstance(m, dict) and "points" in m
            for p in m["points"]
            for a in ("joint_selective", "joint")
            if p[a]["feasible"] and not p[a]["within_budget"]
        )
        add("frontier: plans over budget (measured peak)", over, "0", over == 0)
        for n, m in f.items():
            if isinstance(m, dict) and "torch_vs_torch" in m:
                add(
                    f"frontier.{n}.torch_vs_torch",
                    round(m["torch_vs_torch"], 3),
                    "(report: two torch SAC arms, this run's noise)",
                    True,
                )
    if "dense_queue" in r:
        d = r["dense_queue"]
        add(
            "dense_queue.joint_vs_whole_memory",
            round(d["joint_vs_whole_memory"], 3),
            "< 1 (report)",
            d["joint_vs_whole_memory"] < 1,
        )
        add(
            "dense_queue.joint_vs_whole_time",
            round(d["joint_vs_whole_time"], 3),
            "<= 1 (report)",
            d["joint_vs_whole_time"] <= 1.0,
        )
    return rows


# glibc returns every large tensor to the OS on free and page-faults (and zeroes) it in again on
# the next allocation: on CPU that is a quarter of this workload's step time, and it lands on
# whichever allocation comes next, so it blurs per-option timings. Keeping freed memory in the
# process (what PyTorch's CPU tuning guide gets from jemalloc/tcmalloc, and what the CUDA caching
# allocator does on GPU) removes it. Applied by re-executing once; --system-malloc opts out.
RECYCLING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 34),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 29),
}


def _malloc_setting() -> str:
    if all(os.environ.get(k) == v for k, v in RECYCLING_MALLOC.items()):
        return (
            "glibc, freed memory kept in the process ("
            + ", ".join(f"{k}={v}" for k, v in RECYCLING_MALLOC.items())
            + ")"
        )
    return "system default"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", action="append", help="run only this section (repeatable)")
    ap.add_argument(
        "--system-malloc",
        action="store_true",
        help="CPU: keep glibc's defaults (large frees go back to the OS)",
    )
    a = ap.parse_args(argv)
    if (
        argv is None
        and not a.system_malloc
        and not torch.cuda.is_available()
        and sys.platform.startswith("linux")
        and any(os.environ.get(k) != v for k, v in RECYCLING_MALLOC.items())
    ):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **RECYCLING_MALLOC})
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 16)))
    r = run_suite(a.suite, a.only)
    r["targets"] = [dict(zip(("name", "value", "target", "met"), t)) for t in targets(r)]
    print(f"\n{'target':<52} {'value':>12}  {'wanted':<34} met")
    for t in r["targets"]:
        print(
            f"{t['name']:<52} {str(t['value']):>12}  {t['target']:<34} "
            f"{'yes' if t['met'] else 'NO'}"
        )
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
