"""The memory / time frontier with the selective option, against torch's selective checkpoint.

For HF GPT-2 and a small HF Llama (built from configs, nothing downloaded), every block a
segment. Costs are measured once, as ``install(budget=...)`` measures them, with the selective
option offered (``selective=POLICY``: ``"flops"`` by default, else ``cfg["policy"]``). Budgets
are swept in 6 steps from the lowest-memory plan's peak to plain training's (every activation
kept); at each budget three arms:

* ``joint_selective``: the joint plan over retain / recompute / selective (x preservation);
* ``joint``: the joint plan without the selective options;
* ``torch_sac``: ``torch.utils.checkpoint`` with torch's selective checkpoint under the same
  policy on every block, state-unaware: one configuration, feasible at a budget when its
  measured peak is within it ("the same or lower peak"). Under ``"flops"`` each block's policy
  gets the density (flops per byte of activations) the engine measured for it, so both keep
  the same ops.

Every distinct plan, the torch arm and a second torch arm built alike (the run's noise
control: ``torch_vs_torch``) step side by side (:func:`bench_common.arms_side_by_side`, two
copies per arm, the order cycling). Step time is the median over rounds (this thread's CPU time
on a CPU with one intra-op thread). Peaks are measured for every arm by one referee,
:class:`lightning_replay.memory.StepPeak` (the profiler's allocation events over a step plus
what the model holds), on one step after the timed rounds.

Per model: ``points[]``, each with ``budget_bytes`` and per arm ``feasible``, ``step_s``,
``peak_bytes`` (and the plan's ``choices``); per point ``selective_vs_best_other``: joint
with selective over the faster feasible other arm (``best_other``, by median step time), the
median of per-round ratios as the noise arm is measured (``..._medians``: the ratio of the two
medians). ``worst_vs_best_other``: the largest of those over both models. ``plot(result,
path)`` draws the frontier.

    python benchmarks/frontier.py [--json OUT.json] [--png OUT.png]
"""

from __future__ import annotations

import gc
import io
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import lightning_replay as lr  # noqa: E402
from bench_common import arms_side_by_side, device, paired_ratio  # noqa: E402
from lightning_replay.memory import StepPeak  # noqa: E402
from lightning_replay.planner import (  # noqa: E402
    InfeasibleBudget,
    SegmentCost,
    min_feasible_budget,
    plan,
    predicted_peak,
)
from lightning_replay.selective import checkpoint_kwargs, torch_sac_context_fn  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ARMS = ("joint_selective", "joint", "torch_sac")
#: the policy of every selective arm, both ours and torch's (``cfg["policy"]`` overrides it):
#: ``"flops"`` keeps the products whose output saves more compute per byte than retaining the
#: block; ``"matmul"`` (torchtitan's) keeps them all, an eager attention's score matrix too
POLICY = "flops"


def _gpt2(size: dict) -> tuple[nn.Module, list[str]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=size["layers"],
        n_embd=size["width"],
        n_head=4,
        vocab_size=size.get("vocab", 1000),
        n_positions=size["seq"],
        use_cache=False,
    )  # dropout 0.1 (GPT-2's default)
    return GPT2LMHeadModel(cfg), [f"transformer.h.{i}" for i in range(size["layers"])]


def _llama(size: dict) -> tuple[nn.Module, list[str]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=size["layers"],
        hidden_size=size["width"],
        intermediate_size=size["width"] * 8 // 3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=size.get("vocab", 1000),
        max_position_embeddings=size["seq"],
        use_cache=False,
    )
    return LlamaForCausalLM(cfg), [f"model.layers.{i}" for i in range(size["layers"])]


BUILDERS = {"gpt2": _gpt2, "llama": _llama}


def _batches(size: dict) -> Callable[[int], torch.Tensor]:
    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, size.get("vocab", 1000), (size["batch"], size["seq"]), generator=g)

    return batch


def _step(model: nn.Module, ids: torch.Tensor, clock: Callable[[], float]) -> float:
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


def torch_sac(
    model: nn.Module,
    names: list[str],
    policy: str | None = None,
    densities: dict[str, float | None] | None = None,
) -> nn.Module:
    """Wrap the named blocks in ``torch.utils.checkpoint`` with torch's selective checkpoint
    under ``policy`` (state-unaware: the baseline); ``densities``: per block, the flops per
    byte of activations a ``"flops"`` policy compares each op with."""
    policy = POLICY if policy is None else policy
    extra = checkpoint_kwargs()
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward
        context_fn = torch_sac_context_fn(policy, (densities or {}).get(name))

        def wrapped(*args, _fwd=fwd, _context_fn=context_fn, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(
                _fwd,
                *args,
                use_reentrant=False,
                context_fn=_context_fn,
                **extra,
                **kwargs,
            )

        mod.forward = wrapped
    return model


#: the cost-measuring run's budget: more bytes than any run holds, so every option is timed
#: (under ``budget="min"`` calibration times only each segment's lowest option: the selective
#: options, which hold more than a full recompute, would never enter the table)
_UNBOUNDED = 2**60


def _load(proto_bytes: io.BytesIO) -> nn.Module:
    """A fresh copy of the prototype, which lives only as bytes: no other model is alive."""
    proto_bytes.seek(0)
    return torch.load(proto_bytes, weights_only=False)


def _measure_costs(proto_bytes, names, batch, clock, calibration_steps: int):
    """Install and calibrate one copy with nothing else of the benchmark alive (the prototype
    is bytes), so the engine's whole-process base is this model's own: what a user's process
    training it would hold. Every option is timed (an unreachable byte budget)."""
    gc.collect()
    model = _load(proto_bytes)
    engine = lr.install(
        model, names, budget=_UNBOUNDED, selective=POLICY, calibration_steps=calibration_steps
    )
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while engine.plan is None:
            _step(model, batch(step), clock)
            step += 1
        # the plan's first step is measured (every segment retained, under no budget): each
        # forward's transient under ``retain`` is then measured too, as the calibration
        # steps measured the replayed options' (phase_peak_args' forward_transient)
        for _ in range(2):
            _step(model, batch(step), clock)
            step += 1
    costs, base = list(engine.costs), engine.real_base_memory
    # the forward end's, each segment forward's, each replay's and the optimizer's measured phases
    phases = engine.phase_peak_args
    # per block, the density its selective frames measured (policy "flops": torch's arm gets it)
    densities = {n: engine.runtimes[n].sac_density for n in names}
    engine.uninstall()
    del model, engine
    gc.collect()
    return costs, base, phases, densities


def segment_options(costs: list[SegmentCost]) -> dict[str, dict[str, dict]]:
    """Each segment's measured options: bytes held, bytes its replay re-materializes, and
    seconds added per step (what the planner weighs)."""
    return {
        c.name: {
            o: {
                "memory_bytes": opt.memory,
                "replay_bytes": c.activation_bytes if opt.replay is None else opt.replay,
                "time_s": opt.time,
            }
            for o, opt in c.options.items()
        }
        for c in costs
    }


def _without_selective(costs: list[SegmentCost]) -> list[SegmentCost]:
    return [
        SegmentCost(
            c.name,
            c.activation_bytes,
            {o: opt for o, opt in c.options.items() if not o.startswith("selective")},
        )
        for c in costs
    ]


def _peak(model: nn.Module, ids: torch.Tensor, dev: torch.device) -> int:
    meter = StepPeak(model, dev)
    meter.start()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        peak = meter.stop()
    model.zero_grad(set_to_none=True)
    return int(peak)


def _alone_peak(proto_bytes, names, batch, dev, clock, choices, densities=None) -> int:
    """One arm's whole-process peak with nothing else of the benchmark alive: ``choices`` a
    plan (lightning_replay with it in force), ``None`` torch SAC, ``"plain"`` plain training."""
    gc.collect()
    m = _load(proto_bytes)
    engine = None
    if choices == "plain":
        pass
    elif choices is None:
        torch_sac(m, names, densities=densities)
    else:
        engine = lr.install(m, names, selective=POLICY, track_memory=dev.type == "cpu")
        _step(m, batch(0), clock)  # the probe
        engine.set_options(choices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(2):
            _step(m, batch(1 + s), clock)
        peak = _peak(m, batch(0), dev)
    if engine is not None:
        engine.uninstall()
    del m, engine
    gc.collect()
    return peak


def frontier(
    name: str, size: dict, points: int, rounds: int, copies: int, calibration_steps: int
) -> dict:
    dev = device()
    clock = time.thread_time if dev.type == "cpu" else time.perf_counter
    torch.manual_seed(0)
    proto, names = BUILDERS[name](size)
    proto.to(dev).train()
    # The prototype lives as bytes: every engine's budget is whole-process, so a model left
    # alive beside the one being calibrated would be counted in its base (measured: +10.7 MiB
    # on the predicted GPT-2 peaks at the quick size, one model's parameters less slack)
    proto_bytes = io.BytesIO()
    torch.save(proto, proto_bytes)
    del proto
    make = _batches(size)
    batch = lambda s: make(s).to(dev)  # noqa: E731
    costs, base, phases, densities = _measure_costs(
        proto_bytes, names, batch, clock, calibration_steps
    )
    options = segment_options(costs)
    for seg, opts in options.items():
        print(
            f"[frontier] {name} {seg}: "
            + ", ".join(
                f"{o} {v['memory_bytes'] / 2**20:.2f} MiB held, replay "
                f"{v['replay_bytes'] / 2**20:.2f} MiB, {v['time_s'] * 1e3:.1f} ms"
                for o, v in opts.items()
            ),
            file=sys.stderr,
            flush=True,
        )
    plain_costs = _without_selective(costs)
    low = min_feasible_budget(costs, base, **phases)
    retain = {c.name: "retain" for c in costs}
    high = predicted_peak(costs, retain, base, **phases)  # plain training: every activation kept
    budgets = [int(low + (high - low) * i / (points - 1)) for i in range(points)]
    plans: dict[str, dict] = {}  # arm key -> plan
    rows = []
    for b in budgets:
        row: dict[str, Any] = {"budget_bytes": b}
        for arm, table in (("joint_selective", costs), ("joint", plain_costs)):
            try:
                p = plan(table, b, base, **phases)
            except InfeasibleBudget:
                row[arm] = {"feasible": False, "step_s": None, "peak_bytes": None}
                continue
            key = repr(sorted(p.choices.items()))
            plans.setdefault(key, p)
            row[arm] = {
                "feasible": True,
                "key": key,
                "choices": p.choices,
                "predicted_peak_bytes": p.peak_memory,
            }
        rows.append(row)
    # the arms: each distinct plan, torch SAC, and torch SAC again (the noise control). The
    # plans are frozen (set_options, no budget: nothing re-plans), so the arms can now live
    # side by side for the timing without changing any choice
    keys = list(plans)
    arms: list[list[nn.Module]] = []
    engines = []
    for key in keys:
        copies_ = []
        for _ in range(copies):
            m = _load(proto_bytes)
            engine = lr.install(m, names, selective=POLICY, track_memory=dev.type == "cpu")
            _step(m, batch(0), clock)  # the probe
            engine.set_options(plans[key].choices)
            _step(m, batch(1), clock)
            copies_.append(m)
            engines.append(engine)
        arms.append(copies_)
    for _ in range(2):
        arms.append(
            [torch_sac(_load(proto_bytes), names, densities=densities) for _ in range(copies)]
        )
        for m in arms[-1]:
            for s in range(2):
                _step(m, batch(s), clock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = arms_side_by_side(arms, lambda m, r: _step(m, batch(2 + r), clock), rounds)
    # Peaks are whole-process (StepPeak walks every live tensor): each arm is measured alone,
    # the other arms and the prototype gone (kept as bytes), as a user's process would run it
    for e in engines:
        e.uninstall()
    # (the loops' last copies too: three GPT-2 models, 39 MiB, were counted in every peak)
    engines = arms = copies_ = m = engine = None
    peaks = [_alone_peak(proto_bytes, names, batch, dev, clock, plans[key].choices) for key in keys]
    peaks.append(_alone_peak(proto_bytes, names, batch, dev, clock, None, densities))
    peaks.append(peaks[-1])
    plain_peak = _alone_peak(proto_bytes, names, batch, dev, clock, "plain")
    step_s = [statistics.median(t) for t in times]
    by_key = {k: (step_s[i], peaks[i], times[i]) for i, k in enumerate(keys)}
    sac_step, sac_peak, sac_times = step_s[-2], peaks[-2], times[-2]
    worst = None
    for row in rows:
        for arm in ("joint_selective", "joint"):
            d = row[arm]
            if d["feasible"]:
                s, pk, _ = by_key[d["key"]]
                d.update(step_s=s, peak_bytes=pk, within_budget=pk <= row["budget_bytes"])
        row["torch_sac"] = {
            "feasible": sac_peak <= row["budget_bytes"],
            "step_s": sac_step if sac_peak <= row["budget_bytes"] else None,
            "peak_bytes": sac_peak,
        }
        # the faster feasible other arm (by its median), and joint with selective over it as
        # the median of the per-round ratios (both stepped in the same round: a slow phase of
        # the machine hits both), as the noise arm's ``torch_vs_torch`` is measured
        others = [
            (row[a]["step_s"], a, times[keys.index(row[a]["key"])] if a == "joint" else sac_times)
            for a in ("joint", "torch_sac")
            if row[a]["feasible"]
        ]
        sel = row["joint_selective"]
        if sel["feasible"] and others:
            best_s, best_arm, best_times = min(others, key=lambda o: o[0])
            mine = times[keys.index(sel["key"])]
            row["best_other"] = best_arm
            row["selective_vs_best_other"] = paired_ratio(mine, best_times)
            row["selective_vs_best_other_medians"] = sel["step_s"] / best_s
            worst = max(worst or 0.0, row["selective_vs_best_other"])
        else:
            row["best_other"] = None
            row["selective_vs_best_other"] = None
            row["selective_vs_best_other_medians"] = None
    for row in rows:
        for arm in ("joint_selective", "joint"):
            row[arm].pop("key", None)
    return {
        "size": size,
        "segments": len(names),
        "rounds": rounds,
        "copies": copies,
        "policy": POLICY,
        "densities": densities,
        "base_bytes": base,
        "phases": phases,
        "segment_options": options,
        "lowest_plan_peak_bytes": low,
        "plain_predicted_peak_bytes": high,
        "plain_peak_bytes": plain_peak,
        "torch_sac_peak_bytes": sac_peak,
        "torch_vs_torch": paired_ratio(times[-1], sac_times),
        "points": rows,
        "worst_vs_best_other": worst,
        "distinct_plans": len(keys),
        "plans_over_budget": sum(
            1
            for row in rows
            for a in ("joint_selective", "joint")
            if row[a]["feasible"] and not row[a]["within_budget"]
        ),
    }


def run(cfg: dict) -> dict:
    """Both models (``cfg["models"]``: name -> size), ``points`` budgets each."""
    global POLICY
    dev = device()
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    policy, POLICY = POLICY, cfg.get("policy", POLICY)
    try:
        out: dict[str, Any] = {}
        for name, size in cfg["models"].items():
            out[name] = frontier(
                name,
                size,
                cfg.get("points", 6),
                cfg["rounds"],
                cfg.get("copies", 2),
                cfg.get("calibration_steps", 3),
            )
        ratios = [out[n]["worst_vs_best_other"] for n in cfg["models"]]
        out["worst_vs_best_other"] = (
            max(r for r in ratios if r is not None) if any(r is not None for r in ratios) else None
        )
        out["plans_over_budget"] = sum(out[n]["plans_over_budget"] for n in cfg["models"])
        out["points_le_0_95"] = sum(
            1
            for n in cfg["models"]
            for p in out[n]["points"]
            if p["selective_vs_best_other"] is not None and p["selective_vs_best_other"] <= 0.95
        )
        out["policy"] = POLICY
        return out
    finally:
        POLICY = policy
        torch.set_num_threads(threads)


def plot(result: dict, path: str) -> str:
    """The frontier of each model: step time against budget, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [n for n in result if isinstance(result[n], dict) and "points" in result[n]]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    style = {"joint_selective": "o-", "joint": "s--", "torch_sac": "^:"}
    for ax, name in zip(axes[0], models):
        pts = result[name]["points"]
        for arm in ARMS:
            xs = [p["budget_bytes"] / 2**20 for p in pts if p[arm]["feasible"]]
            ys = [p[arm]["step_s"] * 1e3 for p in pts if p[arm]["feasible"]]
            ax.plot(xs, ys, style[arm], label=arm)
        ax.set_title(f"{name}: step time under a memory budget")
        ax.set_xlabel("budget (MiB, whole step)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import argparse
    import json

    from run import SUITES

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", default="quick")
    ap.add_argument("--json")
    ap.add_argument("--png")
    a = ap.parse_args()
    r = run(SUITES[a.suite]["frontier"])
    if a.png:
        plot(r, a.png)
    text = json.dumps(r, indent=2, default=str)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
