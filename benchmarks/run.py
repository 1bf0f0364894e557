"""lightning_replay benchmarks: figures as ratios measured side by side in one run.

    python benchmarks/run.py --suite quick --json OUT.json     # make bench (< 10 min, 2 cores)
    python benchmarks/run.py --suite full --json OUT.json

Sections (keys of the JSON):

* ``overhead``: replay / ``torch.utils.checkpoint`` step time on a stateless model, same
  segments, interleaved pairs, medians; saved bytes of each.
* ``sparse_write``: the sparse-write workload at a **roomy** budget (halfway between the
  smallest budget ``eager_whole`` can meet and the peak of ``retain_all``) and a **tight** one
  (halfway between the smallest ``fixed_regions`` and the smallest ``eager_whole`` budget).
  Costs are measured once; every method plans from the same costs; each plan runs on its own
  copy of the model, the copies interleaved step by step. Peaks are measured (exact byte
  accounting on CPU, the allocator on CUDA), never predicted.
* ``dense_queue``: a MoCo-style dense queue: ``joint`` against ``whole`` on every segment.
* ``planner``: planning time for 16/64/256 segments and the optimality gap against exhaustive
  search.
* ``checks``: step time with derivative + byte checks every 50 steps over without.
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
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lightning_replay as lr  # noqa: E402
from lightning_replay.apps.sparse_write import SparseWriteModel, sparse_write_input  # noqa: E402
from lightning_replay.hazards import QueueModel  # noqa: E402
from lightning_replay.planner import (InfeasibleBudget, costs_to_dict,  # noqa: E402
                                      min_feasible_budget, plan)

SUITES = {
    "quick": {
        "overhead": dict(width=1024, blocks=6, batch=256, repeats=21),
        "sparse_write": dict(blocks=6, dim=128, hidden=1024, buffer_rows=32768, write_rows=16,
                             batch=256, rounds=21),
        "dense_queue": dict(rows=16384, dim=128, write_rows=128, batch=256, rounds=15),
        "checks": dict(steps=500, every=50),
    },
    "full": {
        "overhead": dict(width=2048, blocks=8, batch=512, repeats=21),
        "sparse_write": dict(blocks=12, dim=256, hidden=4096, buffer_rows=65536, write_rows=32,
                             batch=512, rounds=9),
        "dense_queue": dict(rows=65536, dim=128, write_rows=256, batch=512, rounds=9),
        "checks": dict(steps=1000, every=50),
    },
    # seconds, for the test that keeps this script working (figures meaningless)
    "smoke": {
        "overhead": dict(width=32, blocks=2, batch=8, repeats=3),
        "sparse_write": dict(blocks=3, dim=16, hidden=32, buffer_rows=256, write_rows=4,
                             batch=8, rounds=2),
        "dense_queue": dict(rows=64, dim=16, write_rows=4, batch=8, rounds=2),
        "checks": dict(steps=4, every=2),
    },
}
METHODS = ("joint", "eager_whole", "fixed_regions", "retain_all", "whole_all")


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _timed_step(model: torch.nn.Module, x: torch.Tensor, opt=None) -> float:
    dev = x.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _peak(engine: lr.ReplayEngine) -> int:
    """The step just run: the CUDA allocator's peak on GPU, exact accounting on CPU."""
    return int(engine.window_stats()["peak_bytes"])


# ------------------------------------------------------------------------------- sections
def bench_overhead(cfg: dict) -> dict:
    from overhead import run
    r = run(**cfg)
    return {"ratio": r["ratio"], "replay_saved_bytes": r["replay_saved_bytes"],
            "torch_saved_bytes": r["torch_saved_bytes"], "replay_step_s": r["replay_step_s"],
            "torch_step_s": r["torch_step_s"], "config": cfg}


def _measure_costs(make_model: Callable[[], torch.nn.Module], segments: list[str],
                   make_input: Callable[[int], torch.Tensor]) -> tuple[list, int]:
    """Probe + calibrate once; return (costs, base_memory)."""
    model = make_model()
    engine = lr.install(model, segments, budget="min", calibration_steps=5)
    step = 0
    while engine.plan is None:
        _timed_step(model, make_input(step))
        step += 1
    costs, base = engine.costs, engine.base_memory
    engine.uninstall()
    return costs, base


def _run_plans(make_model, segments, make_input, plans: dict[str, Any], rounds: int,
               dev: torch.device) -> dict[str, dict]:
    """Run each plan on its own model copy, interleaved; median step time, measured peak.

    A copy without lightning_replay (every activation kept, nothing replayed) runs in the same
    rounds: its median step time plus a plan's predicted extra time is that plan's predicted
    step time.
    """
    plain = make_model()
    _timed_step(plain, make_input(0))
    runs = {"__plain__": {"model": plain, "engine": None, "times": [], "peak": 0}}
    for name, p in plans.items():
        model = make_model()
        engine = lr.install(model, segments, track_memory=dev.type == "cpu")
        _timed_step(model, make_input(0))  # the probe
        engine.set_options(p.choices)
        _timed_step(model, make_input(1))  # warm-up under the plan
        runs[name] = {"model": model, "engine": engine, "times": [], "peak": 0}
    names = list(runs)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            run = runs[name]
            run["times"].append(_timed_step(run["model"], make_input(2 + r)))
            if run["engine"] is not None:
                run["peak"] = max(run["peak"], _peak(run["engine"]))
    plain_time = statistics.median(runs.pop("__plain__")["times"])
    out = {}
    for name, run in runs.items():
        out[name] = {"step_time_s": statistics.median(run["times"]),
                     "step_times_s": run["times"], "peak_bytes": run["peak"],
                     "choices": plans[name].choices,
                     "predicted_peak_bytes": plans[name].peak_memory,
                     "plain_step_time_s": plain_time,
                     "predicted_step_time_s": plain_time + plans[name].extra_time}
        run["engine"].uninstall()
    return out


def bench_sparse_write(cfg: dict) -> dict:
    dev = _device()
    cfg = dict(cfg)
    rounds, batch = cfg.pop("rounds"), cfg.pop("batch")
    torch.manual_seed(0)
    proto = SparseWriteModel(**cfg).to(dev)
    make_model = lambda: copy.deepcopy(proto)
    make_input = lambda s: sparse_write_input(s, batch, cfg["dim"]).to(dev)
    segments = proto.segments
    costs, base = _measure_costs(make_model, segments, make_input)
    mins = {m: min_feasible_budget(costs, base, m) for m in METHODS}
    budgets = {"roomy": (mins["eager_whole"] + mins["retain_all"]) // 2,
               "tight": (mins["fixed_regions"] + mins["eager_whole"]) // 2}
    result: dict[str, Any] = {"config": {**cfg, "batch": batch, "rounds": rounds},
                              "min_feasible_bytes": mins, "base_bytes": base,
                              "costs": costs_to_dict(costs)}
    for level, budget in budgets.items():
        plans, methods = {}, {}
        for m in METHODS:
            try:
                plans[m] = plan(costs, budget=budget, base_memory=base, method=m)
            except InfeasibleBudget as exc:
                methods[m] = {"feasible": False, "min_feasible_bytes": exc.min_feasible}
        measured = _run_plans(make_model, segments, make_input, plans, rounds, dev)
        for m, r in measured.items():
            methods[m] = {"feasible": True, **r,
                          "within_budget": r["peak_bytes"] <= budget,
                          "prediction_error": (r["peak_bytes"] - r["predicted_peak_bytes"])
                          / r["predicted_peak_bytes"]}
        result[level] = {"budget_bytes": budget, "methods": methods}
    roomy, tight = result["roomy"]["methods"], result["tight"]["methods"]
    result["ratios"] = {
        "joint_vs_eager_whole_roomy": _ratio(roomy, "joint", "eager_whole"),
        "joint_vs_fixed_regions_tight": _ratio(tight, "joint", "fixed_regions"),
        # what the measured costs predict for the same pairs (the cost model's view)
        "predicted_joint_vs_eager_whole_roomy": _ratio(roomy, "joint", "eager_whole",
                                                       "predicted_step_time_s"),
        "predicted_joint_vs_fixed_regions_tight": _ratio(tight, "joint", "fixed_regions",
                                                         "predicted_step_time_s"),
        # the floor any plan can reach on this workload: keep everything / replay everything
        "retain_all_vs_whole_all_predicted": (
            roomy["whole_all"]["plain_step_time_s"] / roomy["whole_all"]["predicted_step_time_s"]
            if roomy.get("whole_all", {}).get("feasible") else None),
    }
    return result


def _ratio(methods: dict, a: str, b: str, key: str = "step_time_s") -> float | None:
    """``a`` over ``b``: measured, the median of the per-round ratios (both ran in the same
    round, side by side, so slow phases of a shared machine cancel); predicted, one ratio."""
    if methods.get(a, {}).get("feasible") and methods.get(b, {}).get("feasible"):
        if key == "step_time_s":
            return statistics.median(x / y for x, y in zip(methods[a]["step_times_s"],
                                                          methods[b]["step_times_s"]))
        return methods[a][key] / methods[b][key]
    return None


def bench_dense_queue(cfg: dict) -> dict:
    """MoCo-style dense queue (rows read by every block, a few enqueued after): joint at the
    budget of whole-on-every-segment against whole."""
    dev = _device()
    cfg = dict(cfg)
    rounds, batch = cfg.pop("rounds"), cfg.pop("batch")
    torch.manual_seed(0)
    proto = QueueModel(**cfg).to(dev)
    make_model = lambda: copy.deepcopy(proto)
    make_input = lambda s: torch.randn(batch, cfg["dim"], generator=torch.Generator()
                                       .manual_seed(s)).to(dev)
    segments = ["blocks.0", "blocks.1"]
    costs, base = _measure_costs(make_model, segments, make_input)
    whole = plan(costs, budget=10**18, base_memory=base, method="whole_all")
    joint = plan(costs, budget=whole.peak_memory, base_memory=base, method="joint")
    joint_min = plan(costs, budget=min_feasible_budget(costs, base, "joint"), base_memory=base)
    measured = _run_plans(make_model, segments, make_input,
                          {"whole": whole, "joint": joint, "joint_min": joint_min}, rounds, dev)
    return {"config": {**cfg, "batch": batch, "rounds": rounds}, "runs": measured,
            "joint_vs_whole_time": _ratio({k: {"feasible": True, **v}
                                           for k, v in measured.items()}, "joint", "whole"),
            "joint_vs_whole_memory": measured["joint_min"]["peak_bytes"]
            / measured["whole"]["peak_bytes"]}


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
    dev = _device()
    torch.manual_seed(0)
    proto = QueueModel(rows=4096, dim=64, write_rows=64).to(dev)
    models = {k: copy.deepcopy(proto) for k in ("checked", "plain")}
    engines = {k: lr.install(m, "blocks.*") for k, m in models.items()}
    x = torch.randn(256, 64, device=dev)
    every = cfg["every"]
    for k in models:  # probe and warm up outside the measured blocks
        for _ in range(2):
            _timed_step(models[k], x)
    blocks = []
    for _ in range(cfg["steps"] // every):
        block = {k: 0.0 for k in models}
        for step in range(every):
            for k in (("checked", "plain") if step % 2 else ("plain", "checked")):
                if k == "checked" and step == every // 2:
                    engines[k].request_check()
                block[k] += _timed_step(models[k], x)
        blocks.append(block)
    records = engines["checked"].records.counts()
    ratios = [b["checked"] / b["plain"] for b in blocks]
    return {"overhead_ratio_every_50": statistics.median(ratios),
            "block_ratios": ratios,
            "total_ratio": sum(b["checked"] for b in blocks) / sum(b["plain"] for b in blocks),
            "steps": len(blocks) * every, "every": every, "records": records}


# ------------------------------------------------------------------------------- driver
def run_suite(suite: str, only: list[str] | None = None) -> dict:
    cfg = SUITES[suite]
    sections = {
        "overhead": lambda: bench_overhead(cfg["overhead"]),
        "sparse_write": lambda: bench_sparse_write(cfg["sparse_write"]),
        "dense_queue": lambda: bench_dense_queue(cfg["dense_queue"]),
        "planner": bench_planner,
        "checks": lambda: bench_checks(cfg["checks"]),
    }
    dev = _device()
    out: dict[str, Any] = {
        "suite": suite,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "malloc": _malloc_setting(), "seconds": {},
    }
    for name, fn in sections.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        out[name] = fn()
        out["seconds"][name] = round(time.perf_counter() - t0, 1)
    return out


def targets(r: dict) -> list[tuple[str, Any, str, bool]]:
    """(name, value, target, met) for every target the README reports."""
    rows = []

    def add(name, value, target, ok):
        rows.append((name, value, target, bool(ok) if value is not None else False))
    if "overhead" in r:
        o = r["overhead"]
        add("overhead.ratio", round(o["ratio"], 3), "<= 1.03 and equal saved bytes",
            o["ratio"] <= 1.03 and o["replay_saved_bytes"] == o["torch_saved_bytes"])
    if "sparse_write" in r:
        s = r["sparse_write"]
        v = s["ratios"]["joint_vs_eager_whole_roomy"]
        add("sparse_write.ratios.joint_vs_eager_whole_roomy", v and round(v, 3), "<= 0.80",
            v is not None and v <= 0.80)
        v = s["ratios"]["joint_vs_fixed_regions_tight"]
        add("sparse_write.ratios.joint_vs_fixed_regions_tight", v and round(v, 3),
            "<= 0.95, eager_whole infeasible", v is not None and v <= 0.95
            and not s["tight"]["methods"]["eager_whole"]["feasible"])
        for key in ("predicted_joint_vs_eager_whole_roomy",
                    "predicted_joint_vs_fixed_regions_tight", "retain_all_vs_whole_all_predicted"):
            v = s["ratios"].get(key)
            add(f"sparse_write.ratios.{key}", v and round(v, 3), "(report)", v is not None)
        worst = max((abs(m["prediction_error"]) for lvl in ("roomy", "tight")
                     for m in s[lvl]["methods"].values() if m.get("feasible")), default=None)
        within = all(m["within_budget"] for lvl in ("roomy", "tight")
                     for m in s[lvl]["methods"].values() if m.get("feasible"))
        add("sparse_write peaks: within budget, |error| <= 10%", worst and round(worst, 4),
            "all within budget, <= 0.10", within and worst is not None and worst <= 0.10)
    if "planner" in r:
        p = r["planner"]
        add("planner.ms_256", round(p["ms_256"], 1), "<= 1000", p["ms_256"] <= 1000)
        add("planner.optimality_gap_max", p["optimality_gap_max"], "= 0",
            p["optimality_gap_max"] == 0)
    if "checks" in r:
        v = r["checks"]["overhead_ratio_every_50"]
        add("checks.overhead_ratio_every_50", round(v, 3), "<= 1.03", v <= 1.03)
    if "dense_queue" in r:
        d = r["dense_queue"]
        add("dense_queue.joint_vs_whole_memory", round(d["joint_vs_whole_memory"], 3),
            "< 1 (report)", d["joint_vs_whole_memory"] < 1)
        add("dense_queue.joint_vs_whole_time", round(d["joint_vs_whole_time"], 3),
            "<= 1 (report)", d["joint_vs_whole_time"] <= 1.0)
    return rows


# glibc returns every large tensor to the OS on free and page-faults (and zeroes) it in again on
# the next allocation: on CPU that is a quarter of this workload's step time, and it lands on
# whichever allocation comes next, so it blurs per-option timings. Keeping freed memory in the
# process (what PyTorch's CPU tuning guide gets from jemalloc/tcmalloc, and what the CUDA caching
# allocator does on GPU) removes it. Applied by re-executing once; --system-malloc opts out.
RECYCLING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
                    "MALLOC_TOP_PAD_": str(1 << 29)}


def _malloc_setting() -> str:
    if all(os.environ.get(k) == v for k, v in RECYCLING_MALLOC.items()):
        return "glibc, freed memory kept in the process (" + ", ".join(
            f"{k}={v}" for k, v in RECYCLING_MALLOC.items()) + ")"
    return "system default"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", action="append", help="run only this section (repeatable)")
    ap.add_argument("--system-malloc", action="store_true",
                    help="CPU: keep glibc's defaults (large frees go back to the OS)")
    a = ap.parse_args(argv)
    if (argv is None and not a.system_malloc and not torch.cuda.is_available()
            and sys.platform.startswith("linux")
            and any(os.environ.get(k) != v for k, v in RECYCLING_MALLOC.items())):
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **RECYCLING_MALLOC})
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 16)))
    r = run_suite(a.suite, a.only)
    r["targets"] = [dict(zip(("name", "value", "target", "met"), t)) for t in targets(r)]
    print(f"\n{'target':<52} {'value':>12}  {'wanted':<34} met")
    for t in r["targets"]:
        print(f"{t['name']:<52} {str(t['value']):>12}  {t['target']:<34} "
              f"{'yes' if t['met'] else 'NO'}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
