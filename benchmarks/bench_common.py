"""Measurement helpers shared by the benchmark sections: one timed step, costs measured once,
plans run side by side.

Every figure the benchmarks report is either a median over rounds or the median of per-round
ratios: in one round every model steps once, in a rotating order, so a slow phase of a shared
machine hits all of them alike.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from typing import Any, Callable

import torch

import lightning_replay as lr
from lightning_replay.verify import torch_checkpoint


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def timed_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    opt=None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """One forward + backward (+ optimizer step), synchronized on CUDA; seconds of ``clock``."""
    dev = x.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


def measure_costs(
    make_model: Callable[[], torch.nn.Module],
    segments: list[str],
    make_input: Callable[[int], torch.Tensor],
    calibration_steps: int = 5,
    selective: str | None = None,
) -> tuple[list, int]:
    """Probe + calibrate once, as ``install(budget=...)`` does; return (costs, base memory).

    The budget is one no run reaches, so every option is timed: under ``budget="min"``
    calibration times only each segment's lowest option, and the others (``whole`` where
    ``regions`` holds less, the selective options) would be missing from the table.
    ``selective``: a selective policy, to offer (and time) the selective options too."""
    model = make_model()
    engine = lr.install(
        model, segments, budget=2**60, calibration_steps=calibration_steps, selective=selective
    )
    step = 0
    while engine.plan is None:
        timed_step(model, make_input(step))
        step += 1
    costs, base = engine.costs, engine.base_memory
    engine.uninstall()
    return costs, base


def run_plans(
    make_model,
    segments,
    make_input,
    plans: dict[str, Any],
    rounds: int,
    dev: torch.device,
    clock: Callable[[], float] = time.perf_counter,
    copies: int = 1,
    others: dict[str, Callable[[], torch.nn.Module]] | None = None,
) -> dict[str, dict]:
    """Run each plan on its own model copies, interleaved; median step time, measured peak.

    ``others``: more arms without lightning_replay (a baseline that wraps the model itself),
    each built by its callable, stepping in the same rounds; their entry has the times and
    ``peak_bytes`` (the largest in-step peak a :class:`~lightning_replay.memory.StepPeak`
    measured over one step per copy, after the rounds, plus the bytes the model's parameters
    and buffers hold: this arm's own, whatever else the process holds).

    A model without lightning_replay (every activation kept, nothing replayed) runs in the same
    rounds: its median step time plus a plan's predicted extra time is that plan's predicted
    step time, and ``plain_step_times_s`` lets a caller pair any plan with it round by round.
    Each of them runs on ``copies`` model copies, copy ``r % copies`` in round ``r``: two copies
    of one model can differ by several percent in step time for as long as they live (where
    their tensors sit), which one copy per plan would measure as the plan's. The order of the
    runs in a round rotates, each copy in every position. Peaks are the engine's (exact byte
    accounting on CPU, the CUDA allocator on GPU), the largest over the rounds and copies.
    """
    runs: dict[str, dict] = {}
    plain = [make_model() for _ in range(copies)]
    for m in plain:
        timed_step(m, make_input(0))
    runs["__plain__"] = {"models": plain, "engines": [None] * copies, "times": [], "peak": 0}
    for name, make in (others or {}).items():
        models = [make() for _ in range(copies)]
        for m in models:
            timed_step(m, make_input(0))
        runs[name] = {"models": models, "engines": [None] * copies, "times": [], "peak": 0}
    for name, p in plans.items():
        models, engines = [], []
        for _ in range(copies):
            model = make_model()
            engine = lr.install(model, segments, track_memory=dev.type == "cpu")
            timed_step(model, make_input(0))  # the probe
            engine.set_options(p.choices)
            timed_step(model, make_input(1))  # warm-up under the plan
            models.append(model)
            engines.append(engine)
        runs[name] = {"models": models, "engines": engines, "times": [], "peak": 0}
    names = list(runs)
    for r in range(rounds):
        k = (r // copies) % len(names)
        c = r % copies
        for name in names[k:] + names[:k]:
            run = runs[name]
            run["times"].append(timed_step(run["models"][c], make_input(2 + r), clock=clock))
            engine = run["engines"][c]
            if engine is not None:
                run["peak"] = max(run["peak"], int(engine.window_stats()["peak_bytes"]))
    plain_times = runs.pop("__plain__")["times"]
    plain_time = statistics.median(plain_times)
    out = {}
    for name in others or {}:
        run = runs.pop(name)
        out[name] = {
            "step_time_s": statistics.median(run["times"]),
            "step_times_s": run["times"],
            "peak_bytes": max(_own_step_peak(m, make_input(0), dev) for m in run["models"]),
            "plain_step_time_s": plain_time,
            "plain_step_times_s": plain_times,
        }
    for name, run in runs.items():
        out[name] = {
            "step_time_s": statistics.median(run["times"]),
            "step_times_s": run["times"],
            "peak_bytes": run["peak"],
            "choices": plans[name].choices,
            "predicted_peak_bytes": plans[name].peak_memory,
            "plain_step_time_s": plain_time,
            "plain_step_times_s": plain_times,
            "predicted_step_time_s": plain_time + plans[name].extra_time,
        }
        for engine in run["engines"]:
            engine.uninstall()
    return out


def _own_step_peak(model: torch.nn.Module, x: torch.Tensor, dev: torch.device) -> int:
    """One step's in-step peak (StepPeak's, less what was live when it began) plus the bytes
    of the model's parameters and buffers: the model's own peak, whatever else is alive."""
    from lightning_replay.memory import StepPeak

    meter = StepPeak(model, dev)
    meter.start()  # (CUDA: the allocator's peak over the step; CPU: the live bytes + in-step)
    began = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else meter.base
    try:
        model(x).float().pow(2).mean().backward()
    finally:
        peak = meter.stop()
    model.zero_grad(set_to_none=True)
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]
    }
    return int(peak - began) + sum(held.values())


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios a/b (both stepped in the same round)."""
    return statistics.median(x / y for x, y in zip(a, b))


def median_se(xs: list[float], draws: int = 400, seed: int = 0) -> float:
    """Bootstrap standard error of the median of ``xs``: how far this run's noise alone moves
    a measured median (``draws`` resamples, a fixed seed so a result file can be recomputed)."""
    if len(xs) < 2:
        return 0.0
    rng = random.Random(seed)
    meds = [statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws)]
    return statistics.stdev(meds)


def arms_side_by_side(
    arms: list[list[Any]], step: Callable[[Any, int], float], rounds: int
) -> list[list[float]]:
    """Seconds of ``step(model, round)`` per arm and round: every arm steps once a round, on
    its copy ``(round % copies)``, the arms in an order that cycles through the rotations of
    their order, forward and backward (each copy in every order; for three arms these are all
    six orders). Several copies per arm, because two copies of one model differ in where their
    tensors sit, which can move a step's time by a percent or two for as long as they live; the
    order cycles so a slow phase of a shared machine hits every arm alike, and each arm steps
    at every position (all permutations of a dozen arms would be 479 million orders)."""
    copies = len(arms[0])
    n = len(arms)
    times: list[list[float]] = [[] for _ in arms]
    for r in range(rounds):
        k = (r // copies) % (2 * n)
        order = [(i + k // 2) % n for i in range(n)]
        for a in reversed(order) if k % 2 else order:
            times[a].append(step(arms[a][r % copies], r))
    return times


def torch_and_replay_arms(
    proto: torch.nn.Module,
    names: list[str],
    copies: int,
    step: Callable[[Any, int], Any],
    warmup: int = 3,
) -> tuple[list[list[Any]], list[Any]]:
    """The three arms :func:`arms_side_by_side` steps for a replay-vs-checkpoint ratio with its
    noise control: ``copies`` deep copies of ``proto`` under torch checkpoint, as many more
    (the control, built alike), and as many under ``lr.install``; each copy stepped ``warmup``
    times by ``step(model, i)`` (the first replay step is the probe). Returns (arms, the
    replay copies' engines)."""
    arms = [[torch_checkpoint(copy.deepcopy(proto), names) for _ in range(copies)] for _ in "ab"]
    arms.append([copy.deepcopy(proto) for _ in range(copies)])
    engines = [lr.install(m, names) for m in arms[2]]
    for i in range(warmup):
        for arm in arms:
            for model in arm:
                step(model, i)
    return arms, engines
