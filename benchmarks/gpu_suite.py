"""Issue 31's table on one GPU: replay against plain training and torch checkpoint, on four
real models, in one prepared run (under 5 minutes on one H200).

    python benchmarks/gpu_suite.py --json benchmarks/results/gpu-<date>.json
    python benchmarks/gpu_suite.py --smoke          # tiny sizes on CPU: a test of the script

Models (bf16 autocast, AdamW, every block a segment):

========== ============================================ ==================
name       model                                        batch
========== ============================================ ==================
gpt2       HF GPT-2, 12 layers x 768                    16 x 1024 tokens
llama      HF Llama, 16 layers x 2048, ~888 M params    4 x 2048 tokens
vit        timm ViT-B/16                                128 x 224 px
resnet50   torchvision ResNet-50 (16 bottlenecks)       128 x 224 px
========== ============================================ ==================

Arms, each on a model built afresh (seed 0), its memory freed before the next arm:

- ``plain``: no recomputation;
- ``torch_checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around the same blocks;
- ``replay``: ``lr.install(model, blocks)``, no budget;
- ``replay_budget``: ``lr.install(model, blocks, budget=B)`` with ``B`` halfway between the
  measured peaks of ``torch_checkpoint`` and ``plain``.

Per arm: the median step time over the steady steps (synchronized), the allocator's peak over
them (``torch.cuda.max_memory_allocated``), every step's peak from the first (probe and
calibration steps included) against the budget, the memory held between steps, and the
host-device synchronizations of one steady step, counted by a dispatch mode
(:mod:`sync_counter`; a steady unchecked step must have plain training's count).

Peaks: without replay the allocator's peak is reset before each step. Under replay it is reset
only when the arm's model is built: the engine resets it itself at the start of each step's
forward and reads the step before's peak then, so the suite must not reset it in between. A
step's reading is the peak since its forward began under replay, since the step began
otherwise; never less than the step's own. On CPU (``--smoke``) a stand-in replaces the allocator: the live tensor storages when the
step begins that the model and optimizer reach plus the profiler's net peak inside it (blind to
what the engine keeps elsewhere: the smoke test's figures only show the script works).

Selective recomputation (issue 30), for the models ``--selective`` names (the Llama by
default), after their arms, kept under ``"selective"`` in the model's results:

- ``torch_sac``: torch checkpoint with torch's selective checkpoint (torchtitan's op list:
  matrix products, attention, convolutions kept) on every block;
- ``replay_selective``: ``lr.install(model, blocks, budget=1.3 x torch_checkpoint's peak,
  selective="matmul")``: the joint plan with the selective option; its step time over plain
  training's is the issue's headline (goal <= 1.10; torch checkpoint 1.24). Then, on the same
  engine (calibrated once), the sweep: 6 budgets from the lowest-memory plan's predicted peak to
  plain training's peak, each planned with the selective options (``joint_selective``) and
  without them (``joint``, the same cost table less the selective options) and timed for the
  steady steps: step time, the allocator's peak, the plan.

An arm that fails prints ``FAILED <model>/<arm>: <error>`` and the run goes on; the JSON is
written after every arm, so a run cut short keeps what it measured. Nothing here imports
wandb (the device machine has none).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import lightning_replay as lr  # noqa: E402
from lightning_replay.verify import torch_checkpoint  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

ARMS = ("plain", "torch_checkpoint", "replay", "replay_budget")
#: issue 30's arms (see the module docstring), for the models ``--selective`` names
SELECTIVE_ARMS = ("torch_sac", "replay_selective")
SELECTIVE_POLICY = "matmul"
SELECTIVE_BUDGET = 1.3  # x torch checkpoint's peak: the headline budget
SWEEP_POINTS = 6
GiB = 1 << 30


# ---------------------------------------------------------------- models
@dataclasses.dataclass
class Spec:
    """One model of the table: how to build it, its batch, its loss and its blocks."""

    name: str
    what: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    segments: Callable[[nn.Module], list[str]]


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)

    return make


def _images(batch: int, size: int, classes: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 3, size, size, generator=g)
        return x.to(device), torch.randint(0, classes, (batch,), generator=g).to(device)

    return make


def _causal_lm(model: nn.Module, batch: tuple) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _classify(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def _numbered(prefix: str) -> Callable[[nn.Module], list[str]]:
    def names(model: nn.Module) -> list[str]:
        return [f"{prefix}.{i}" for i in range(len(model.get_submodule(prefix)))]

    return names


def _resnet_blocks(model: nn.Module) -> list[str]:
    return [f"layer{k}.{i}" for k in range(1, 5) for i in range(len(getattr(model, f"layer{k}")))]


def specs(smoke: bool) -> dict[str, Spec]:
    """The four models at the table's sizes, or tiny (``smoke``)."""

    def gpt2() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        if smoke:
            cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        else:
            cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
        cfg.use_cache = False
        return GPT2LMHeadModel(cfg)

    def llama() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        if smoke:
            cfg = LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=16,
            )
        else:  # 887.7 M parameters (tied embeddings)
            cfg = LlamaConfig(
                vocab_size=32000,
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=32,
                max_position_embeddings=2048,
                tie_word_embeddings=True,
            )
        cfg.use_cache = False
        return LlamaForCausalLM(cfg)

    def vit() -> nn.Module:
        from timm.models.vision_transformer import VisionTransformer

        if smoke:
            return VisionTransformer(
                img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10
            )
        return VisionTransformer(
            img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, num_classes=1000
        )

    def resnet50() -> nn.Module:
        import torchvision

        if smoke:  # its bottleneck blocks and batch norms, fewer and narrower
            from torchvision.models.resnet import Bottleneck, ResNet

            return ResNet(Bottleneck, [1, 2, 1, 1], num_classes=10, width_per_group=8)
        return torchvision.models.resnet50()

    if smoke:
        lm, llm, img = (2, 16, 96), (2, 16, 96), (2, 32)
    else:
        lm, llm, img = (16, 1024, 50257), (4, 2048, 32000), (128, 224)
    classes = 10 if smoke else 1000
    return {
        "gpt2": Spec(
            "gpt2",
            "HF GPT-2 12x768 (16, 1024)",
            gpt2,
            _tokens(*lm),
            _causal_lm,
            _numbered("transformer.h"),
        ),
        "llama": Spec(
            "llama",
            "HF Llama 16x2048 (4, 2048)",
            llama,
            _tokens(*llm),
            _causal_lm,
            _numbered("model.layers"),
        ),
        "vit": Spec(
            "vit",
            "timm ViT-B/16 (128, 224 px)",
            vit,
            _images(*img, classes),
            _classify,
            _numbered("blocks"),
        ),
        "resnet50": Spec(
            "resnet50",
            "torchvision ResNet-50 (128, 224 px)",
            resnet50,
            _images(*img, classes),
            _classify,
            _resnet_blocks,
        ),
    }


# ---------------------------------------------------------------- measuring
class Meter:
    """Peaks and the memory held between steps: the CUDA allocator's, or a CPU stand-in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.holders: tuple = ()  # (model, optimizer) on CPU: what the stand-in walks

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def fresh(self) -> None:
        """Free what the arm before left and start the allocator's peak afresh."""
        if self.cuda:
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        """Bytes held now: the allocator's on CUDA; on CPU the tensors the model and its
        optimizer reach (parameters, buffers, gradients, tensor attributes, optimizer state;
        a smoke test's figure, blind to what the engine keeps elsewhere)."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        from lightning_replay.memory import live_model_bytes

        if not self.holders:
            return 0
        model, opt = self.holders
        return live_model_bytes(model, [opt])

    @contextlib.contextmanager
    def step_peak(self, out: dict) -> Any:
        """``out["peak"]``: the step's peak (see the module docstring)."""
        if self.cuda:
            yield
            torch.cuda.synchronize(self.device)
            out["peak"] = int(torch.cuda.max_memory_allocated(self.device))
            return
        from lightning_replay.memory import net_peak

        base = self.allocated()
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        prof.__enter__()
        try:
            yield
        finally:
            prof.__exit__(None, None, None)
        out["peak"] = base + net_peak(prof)


def train_step(model: nn.Module, opt: Any, spec: Spec, batch: tuple, device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = spec.loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def torch_sac(model: nn.Module, names: list[str], policy: str = SELECTIVE_POLICY) -> None:
    """torch checkpoint with torch's own selective checkpoint under ``policy`` on the blocks."""
    from torch.utils.checkpoint import checkpoint

    from lightning_replay.selective import checkpoint_kwargs, torch_sac_context_fn

    extra = {"context_fn": torch_sac_context_fn(policy), **checkpoint_kwargs()}
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward

        def wrapped(*args: Any, _fwd: Callable = fwd, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(_fwd, *args, use_reentrant=False, **extra, **kwargs)

        mod.forward = wrapped


def _without_selective(costs: list) -> list:
    from lightning_replay.planner import SegmentCost

    return [
        SegmentCost(
            c.name,
            c.activation_bytes,
            {o: opt for o, opt in c.options.items() if not o.startswith("selective")},
        )
        for c in costs
    ]


def selective_sweep(engine: Any, step: Callable[[], dict], steady: int, high: int) -> list[dict]:
    """On an engine calibrated with the selective options: per budget from the lowest-memory
    plan's predicted peak to ``high`` (plain training's peak), the joint plan with and without
    the selective options, each timed for ``steady`` steps after its first."""
    from lightning_replay.planner import InfeasibleBudget, min_feasible_budget, plan

    costs, base = list(engine.costs), engine.real_base_memory
    low = min_feasible_budget(costs, base)
    high = max(high, low)
    budgets = [int(low + (high - low) * i / (SWEEP_POINTS - 1)) for i in range(SWEEP_POINTS)]
    tables = {"joint_selective": costs, "joint": _without_selective(costs)}
    points = []
    for b in budgets:
        point: dict[str, Any] = {"budget_bytes": b}
        for arm, table in tables.items():
            try:
                p = plan(table, b, base)
            except InfeasibleBudget:
                point[arm] = {"feasible": False}
                continue
            engine.set_options(p.choices)
            step()  # the plan's first step
            timed = [step() for _ in range(steady)]
            point[arm] = {
                "feasible": True,
                "choices": p.choices,
                "predicted_peak_bytes": p.peak_memory,
                "step_time_s": statistics.median(r["time_s"] for r in timed),
                "peak_bytes": max(r["peak"] for r in timed),
            }
        points.append(point)
    return points


def run_arm(
    spec: Spec,
    arm: str,
    device: torch.device,
    meter: Meter,
    steady: int,
    budget: int | None = None,
    max_steps: int = 40,
    sweep_high: int | None = None,
) -> dict:
    """One arm on a model built afresh: warm-up (the probe and, under a budget, calibration
    until the first plan), ``steady`` timed steps, one more counted for syncs."""
    meter.fresh()
    start_bytes = meter.allocated()
    torch.manual_seed(0)
    model = spec.build().to(device)
    model.train()
    names = spec.segments(model)
    engine = None
    if arm == "torch_checkpoint":
        torch_checkpoint(model, names)
    elif arm == "replay":
        engine = lr.install(model, names)
    elif arm == "replay_budget":
        engine = lr.install(model, names, budget=budget)
    elif arm == "torch_sac":
        torch_sac(model, names)
    elif arm == "replay_selective":
        engine = lr.install(model, names, budget=budget, selective=SELECTIVE_POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    meter.holders = (model, opt)
    batch = spec.batch(device)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "segments": len(names),
        "budget_bytes": budget,
    }
    steps: list[dict] = []
    caught: list[str] = []
    t_arm = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")

            def step() -> dict:
                rec: dict[str, Any] = {"step": len(steps)}
                meter.sync()
                if engine is None and meter.cuda:  # (an engine resets it at each forward)
                    torch.cuda.reset_peak_memory_stats(device)
                with meter.step_peak(rec):
                    t0 = time.perf_counter()
                    train_step(model, opt, spec, batch, device)
                    meter.sync()
                    rec["time_s"] = time.perf_counter() - t0
                rec["held_after_bytes"] = meter.allocated()
                if engine is not None:
                    rec["plan"] = engine.plan_version
                steps.append(rec)
                return rec

            # warm-up: two steps (the probe and one steady); under a budget, until a plan runs
            step()
            step()
            while engine is not None and budget is not None and engine.plan is None:
                if len(steps) >= max_steps - steady:
                    raise RuntimeError(f"no plan after {len(steps)} steps")
                step()
            if engine is not None and budget is not None:
                step()  # the plan's first step
            timed = [step() for _ in range(steady)]
            meter.sync()
            with SyncCounter(device) as syncs:
                train_step(model, opt, spec, batch, device)
            meter.sync()
            if engine is not None and sweep_high is not None:
                out["plan_at_budget"] = engine.plan.choices if engine.plan else None
                out["sweep"] = selective_sweep(engine, step, steady, sweep_high)
            caught = [f"{w.category.__name__}: {w.message}" for w in seen]
    finally:
        out["steps"] = steps
        out["warnings"] = sorted(set(caught))[:20]
        out["arm_seconds"] = round(time.perf_counter() - t_arm, 1)
    out["step_time_s"] = statistics.median(r["time_s"] for r in timed)
    out["peak_bytes"] = max(r["peak"] for r in timed)
    out["held_between_steps_bytes"] = timed[-1]["held_after_bytes"] - start_bytes
    out["syncs_per_step"] = syncs.count
    out["syncs_by_kind"] = dict(syncs.by_kind)
    if budget is not None:
        over = [(r["step"], r["peak"] / budget) for r in steps if r["peak"] > budget]
        out["steps_over_budget"] = [{"step": s, "peak_over_budget": round(x, 4)} for s, x in over]
        out["max_peak_over_budget"] = max(r["peak"] for r in steps) / budget
    if engine is not None and "sweep" not in out:
        out["plan"] = engine.plan.choices if engine.plan is not None else None
        out["predicted_peak_bytes"] = engine.plan.peak_memory if engine.plan else None
        out["preserved_bytes"] = engine.window_stats()["preserved_bytes"]
        outcomes: dict[str, int] = {}
        for r in engine.records.read():
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        out["records"] = outcomes
        engine.uninstall()
    meter.holders = ()
    model = opt = engine = batch = None  # (the arm's memory is freed below)
    meter.fresh()
    out["left_after_arm_bytes"] = meter.allocated() - start_bytes
    return out


# ---------------------------------------------------------------- the run
def _fmt(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"


def _ratios(res: dict) -> dict:
    a = res.get("arms", {})
    ck, rp = a.get("torch_checkpoint", {}), a.get("replay", {})
    out = {}
    if "peak_bytes" in ck and "peak_bytes" in rp:
        out["replay_vs_torch_checkpoint_peak"] = rp["peak_bytes"] / ck["peak_bytes"]
        out["replay_vs_torch_checkpoint_time"] = rp["step_time_s"] / ck["step_time_s"]
    pl = a.get("plain", {})
    if "syncs_per_step" in pl:
        out["syncs_equal_plain"] = {
            arm: a[arm]["syncs_per_step"] == pl["syncs_per_step"]
            for arm in ARMS
            if "syncs_per_step" in a.get(arm, {})
        }
    return out


def table(results: dict) -> str:
    """The issue's table from the results (GiB; ratios replay / torch checkpoint)."""
    rows = [
        "| model (batch, sequence) | plain | torch checkpoint | replay | replay budget "
        "(budget) | replay / torch ckpt, peak | replay / torch ckpt, time | syncs plain / "
        "ckpt / replay / budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results["models"].items():
        a = res.get("arms", {})
        peak = {arm: a.get(arm, {}).get("peak_bytes") for arm in ARMS}
        r = res.get("ratios", {})
        bud = a.get("replay_budget", {}).get("budget_bytes")
        syncs = " / ".join(str(a.get(arm, {}).get("syncs_per_step", "-")) for arm in ARMS)
        pr, tr = r.get("replay_vs_torch_checkpoint_peak"), r.get("replay_vs_torch_checkpoint_time")
        rows.append(
            f"| {res['what']} | {_fmt(peak['plain'])} | {_fmt(peak['torch_checkpoint'])} | "
            f"{_fmt(peak['replay'])} | {_fmt(peak['replay_budget'])} ({_fmt(bud)}) | "
            f"{'-' if pr is None else f'{pr:.3f}'} | {'-' if tr is None else f'{tr:.3f}'} | "
            f"{syncs} |"
        )
    return "\n".join(rows)


def _past_limit(results: dict, name: str, arm: str, t_run: float, limit: float) -> bool:
    """Whether the run is past its time limit before ``name``'s ``arm`` (then recorded as
    skipped)."""
    elapsed = time.perf_counter() - t_run
    if elapsed > limit:
        results["skipped"].append(f"{name}/{arm}: time limit ({elapsed:.0f} s)")
        print(f"SKIPPED {name}/{arm}: past the time limit", flush=True)
    return elapsed > limit


def _recorded_arm(
    results: dict,
    into: dict,
    name: str,
    spec: Spec,
    arm: str,
    device: torch.device,
    steady: int,
    budget: int | None,
    **kwargs: Any,
) -> dict | None:
    """:func:`run_arm` for ``name``'s ``arm``, its result put in ``into[arm]``; or, where it
    raised, its error and traceback there (and in ``results["failures"]``), its memory freed,
    and None: a report records a failing arm and goes on."""
    try:
        r = run_arm(spec, arm, device, Meter(device), steady, budget, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a report: record, free and go on
        msg = f"{type(exc).__name__}: {exc}"
        into[arm] = {"error": msg, "traceback": traceback.format_exc().splitlines()[-12:]}
        results["failures"].append(f"{name}/{arm}: {msg}")
        print(f"FAILED {name}/{arm}: {msg}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    into[arm] = r
    return r


def _selective_arms(
    name: str,
    spec: Spec,
    res: dict,
    results: dict,
    device: torch.device,
    steady: int,
    t_run: float,
    limit: float,
) -> None:
    """Issue 30's arms on one model (see the module docstring), into ``res["selective"]``."""
    a = res["arms"]
    sel = res["selective"] = {"policy": SELECTIVE_POLICY, "arms": {}}
    need = [arm for arm in ("plain", "torch_checkpoint") if "peak_bytes" not in a.get(arm, {})]
    if need:
        results["skipped"].append(f"{name}/selective: needs {need}")
        print(f"SKIPPED {name}/selective: no {need} peak", flush=True)
        return
    budget = int(SELECTIVE_BUDGET * a["torch_checkpoint"]["peak_bytes"])
    for arm in SELECTIVE_ARMS:
        if _past_limit(results, name, arm, t_run, limit):
            continue
        r = _recorded_arm(
            results,
            sel["arms"],
            name,
            spec,
            arm,
            device,
            steady,
            budget if arm == "replay_selective" else None,
            sweep_high=a["plain"]["peak_bytes"] if arm == "replay_selective" else None,
        )
        if r is None:
            continue
        print(
            f"{name}/{arm}: {r['step_time_s'] * 1e3:.1f} ms/step, peak {_fmt(r['peak_bytes'])} "
            f"GiB ({r['arm_seconds']} s)",
            flush=True,
        )
    plain_t = a["plain"]["step_time_s"]
    ratios = {"torch_checkpoint_vs_plain_time": a["torch_checkpoint"]["step_time_s"] / plain_t}
    for arm in SELECTIVE_ARMS:
        if "step_time_s" in sel["arms"].get(arm, {}):
            ratios[f"{arm}_vs_plain_time"] = sel["arms"][arm]["step_time_s"] / plain_t
    sweep = sel["arms"].get("replay_selective", {}).get("sweep", [])
    worst = []
    for p in sweep:
        js, j = p.get("joint_selective", {}), p.get("joint", {})
        if js.get("feasible") and j.get("feasible"):
            p["joint_selective_vs_joint_time"] = js["step_time_s"] / j["step_time_s"]
            worst.append(p["joint_selective_vs_joint_time"])
    if worst:
        ratios["sweep_worst_joint_selective_vs_joint_time"] = max(worst)
    sel["budget_bytes"] = budget
    sel["ratios"] = ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU test of the script)")
    ap.add_argument("--models", default="gpt2,llama,vit,resnet50")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steady", type=int, default=None, help="timed steps per arm (8; smoke 1)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/gpu-<date>.json")
    ap.add_argument(
        "--time-limit", type=float, default=290.0, help="seconds: no arm starts after this"
    )
    ap.add_argument(
        "--selective",
        default="llama",
        help="models that also run the selective arms and sweep (issue 30); '' for none",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    steady = args.steady or (1 if args.smoke else 8)
    date = time.strftime("%Y-%m-%d")
    path = args.json or os.path.join(
        HERE, "results", f"gpu-{'smoke-' if args.smoke else ''}{date}.json"
    )
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    results: dict[str, Any] = {
        "date": date,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "steady_steps": steady,
        "peak_source": (
            "torch.cuda.max_memory_allocated"
            if device.type == "cuda"
            else "cpu stand-in: model and optimizer tensors at the step's start + profiler net peak"
        ),
        "models": {},
        "failures": [],
        "skipped": [],
    }
    for lib in ("transformers", "timm", "torchvision"):
        with contextlib.suppress(Exception):
            results[lib] = __import__(lib).__version__
    t_run = time.perf_counter()
    all_specs = specs(args.smoke)
    arms = [a for a in args.arms.split(",") if a]
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in all_specs] + [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown models or arms {unknown}; models {list(all_specs)}, arms {ARMS}")

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - t_run, 1)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    for name in models:
        spec = all_specs[name]
        res = results["models"][name] = {"what": spec.what, "arms": {}}
        for arm in arms:
            if _past_limit(results, name, arm, t_run, args.time_limit):
                continue
            budget = None
            if arm == "replay_budget":
                a = res["arms"]
                if "peak_bytes" not in a.get("plain", {}) or "peak_bytes" not in a.get(
                    "torch_checkpoint", {}
                ):
                    results["skipped"].append(f"{name}/{arm}: needs plain and torch_checkpoint")
                    print(f"SKIPPED {name}/{arm}: no plain or torch_checkpoint peak", flush=True)
                    continue
                budget = (a["plain"]["peak_bytes"] + a["torch_checkpoint"]["peak_bytes"]) // 2
            r = _recorded_arm(results, res["arms"], name, spec, arm, device, steady, budget)
            if r is not None:
                print(
                    f"{name}/{arm}: {r['step_time_s'] * 1e3:.1f} ms/step, peak "
                    f"{_fmt(r['peak_bytes'])} GiB, held {_fmt(r['held_between_steps_bytes'])} "
                    f"GiB, syncs {r['syncs_per_step']}"
                    + (
                        f", max step peak / budget {r['max_peak_over_budget']:.3f}"
                        if "max_peak_over_budget" in r
                        else ""
                    )
                    + f" ({r['arm_seconds']} s)",
                    flush=True,
                )
            res["ratios"] = _ratios(res)
            save()
        if name in [m for m in args.selective.split(",") if m]:
            _selective_arms(name, spec, res, results, device, steady, t_run, args.time_limit)
            save()
    save()
    print(table(results), flush=True)
    for name, res in results["models"].items():
        r = res.get("ratios", {})
        if "replay_vs_torch_checkpoint_peak" in r:
            print(
                f"{name}: replay / torch checkpoint: peak "
                f"{r['replay_vs_torch_checkpoint_peak']:.3f}, time "
                f"{r['replay_vs_torch_checkpoint_time']:.3f}",
                flush=True,
            )
    for name, res in results["models"].items():
        r = res.get("selective", {}).get("ratios", {})
        if "replay_selective_vs_plain_time" in r:
            print(
                f"{name}: at {SELECTIVE_BUDGET} x torch checkpoint's peak, joint with selective "
                f"/ plain: time {r['replay_selective_vs_plain_time']:.3f} (torch checkpoint "
                f"{r.get('torch_checkpoint_vs_plain_time', float('nan')):.3f}, torch SAC "
                f"{r.get('torch_sac_vs_plain_time', float('nan')):.3f})",
                flush=True,
            )
    if results["failures"]:
        print("FAILURES:\n  " + "\n  ".join(results["failures"]), flush=True)
    print(f"wrote {path} ({results['seconds']} s)", flush=True)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
