"""Adversary for issues 31 (memory held between steps, the budget from step one) and 32 (no
false divergences from kernels' own numerics), with model classes the issues did not list.

Memory (issue 31). Referees are the process's, never the engine's: the whole process's live
tensor bytes (a walk of the garbage collector) after a step under replay vs the same driver on a
twin model under ``torch.utils.checkpoint``, and weak references to every tensor alive after the
last step, which must be dead after ``uninstall()`` and dropping model, optimizer and batch,
with the cyclic collector off. Drivers: kwargs tensors and dict/tuple/dataclass outputs, a
re-probe after a guard change, derivative checks on every step, a step that raises inside a
segment, eval forwards between steps, ``engine.suspended()``, gradient accumulation, two
optimizers, a segment never called, a divergence, a segment with a big preserved state. Budget:
every step within 1.02 x a budget halfway between torch checkpoint's and plain training's
whole-process peaks, for shapes unlike the tested ones.

Numerics (issue 32). False alarms from kernels' own variation in forms the issue's tests do not
cover (noise only in some calls, float16, relative vs absolute noise, an integer aux output that
moves, a noisy custom op outside every segment), and the converse: real missed state whose
effect is small must still be caught.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from tests.helpers.budget_runner import run_arm
from tests.helpers.noisy_kernels import noisy_linear, ulp_noise
from tests.helpers.torch_memory import (
    StepReferee,
    process_tensor_bytes,
)

KiB = 2**10
MiB = 2**20

# =========================================================================== memory (issue 31)
W, N = 64, 512  # activations of one linear: 128 KiB, big enough to see, small enough to be fast


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    aux: torch.Tensor


class Blk(nn.Module):
    """Linear + GELU + linear, with optional kwargs tensor, structured outputs, a state."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)
        self.boom = False
        if kind == "stateful":
            self.register_buffer("mem", torch.zeros(8 * N, W))  # 1 MiB of preserved state
        if kind == "missed":
            self.register_buffer("table", torch.ones(W))

    def forward(self, x, mask=None, scale=None):
        if self.boom:
            raise RuntimeError("adversary: a segment that raises mid-step")
        h = self.b(torch.nn.functional.gelu(self.a(x)))
        if mask is not None:
            h = h * mask
        if scale is not None:
            h = h * scale["s"]
        if self.kind == "stateful":
            self.mem[: x.shape[0]].mul_(0.5).add_(h.detach())
            h = h + self.mem[: x.shape[0]].sum() * 1e-6
        if self.kind == "missed":
            h = h * self.table
        if self.kind == "tuple":
            return h, h.sum(-1)
        if self.kind == "dict":
            return {"h": h, "aux": h.mean(-1)}
        if self.kind == "dataclass":
            return Out(h, h.amax(-1))
        return h


class Net(nn.Module):
    def __init__(self, kind: str = "plain", n: int = 3, extra: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Blk(kind) for _ in range(n))
        self.kind = kind
        self.unused = Blk() if extra else None  # a segment never called
        self.head = nn.Linear(W, 1)

    def forward(self, x, mask=None):
        h = x
        for blk in self.blocks:
            kw = {}
            if self.kind in ("kwargs", "tuple", "dict", "dataclass"):
                kw = {"mask": mask, "scale": {"s": mask[:1]}}
            o = blk(h, **kw)
            if isinstance(o, tuple):
                o = o[0] + o[1].unsqueeze(-1) * 0.01
            elif isinstance(o, dict):
                o = o["h"] + o["aux"].unsqueeze(-1) * 0.01
            elif isinstance(o, Out):
                o = o.h + o.aux.unsqueeze(-1) * 0.01
            h = o
        return self.head(h)


def _segments(model: Net) -> list[str]:
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    return names + (["unused"] if model.unused is not None else [])


def _ckpt_twin(model: Net) -> None:
    for name in _segments(model):
        mod = model.get_submodule(name)
        fwd = mod.forward

        def wrapped(*a, _f=fwd, **k):
            if not torch.is_grad_enabled():
                return _f(*a, **k)
            return checkpoint(_f, *a, use_reentrant=False, **k)

        mod.forward = wrapped


def _batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    return torch.randn(N, W, generator=g), (torch.rand(N, W, generator=g) > 0.1).float()


def _noop_hook(module, args, out):
    return None


#: everything one run can combine: dict outputs of kwargs-taking segments, a segment never
#: called, two optimizers, accumulation, checks on every step, a raise mid-step, a suspended
#: step, eval forwards between steps, a re-probe after a hook is added
SINK = (
    "reprobe_after_hook",
    "exception",
    "eval_between",
    "suspended",
    "accumulation",
    "two_optimizers",
)


def _features(case: str) -> tuple[str, ...]:
    if case == "checked_exception":
        return ("checked", "exception")
    return SINK if case == "kitchen_sink" else (case,)


def _drive(case: str, model: Net, engine, opts: list, s: int) -> None:
    """One training step of ``case`` (engine is None for the torch-checkpoint twin)."""
    x, m = _batch(s)
    if "reprobe_after_hook" in _features(case) and s == 3:
        model.blocks[1].register_forward_hook(_noop_hook)  # a guard change: a re-probe
    if "checked" in _features(case) and engine is not None:
        engine.request_check()
    if "exception" in _features(case) and s == 2:
        model.blocks[1].boom = True
        try:
            model(x, m).pow(2).mean().backward()
        except RuntimeError:
            pass
        model.blocks[1].boom = False
    if "eval_between" in _features(case) and s >= 1:
        model.eval()
        with torch.no_grad():
            model(x, m)
        model(x, m).sum()  # a grad-enabled forward whose graph is dropped, no backward
        model.train()
    if "suspended" in _features(case) and s == 2 and engine is not None:
        with engine.suspended():
            model(x, m).pow(2).mean().backward()
    micro = 3 if "accumulation" in _features(case) else 1
    for k in range(micro):
        xs, ms = (x[k::micro], m[k::micro]) if micro > 1 else (x, m)
        out = model(xs, ms)
        if "missed" in _features(case) and s >= 1:
            for blk in model.blocks:
                blk.table.data.mul_(1.5)  # missed state: a divergence, then a re-probe
        out.pow(2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


MEM_CASES = {
    "kwargs": ("kwargs", {}),
    "tuple_out": ("tuple", {}),
    "dict_out": ("dict", {}),
    "dataclass_out": ("dataclass", {}),
    "reprobe_after_hook": ("plain", {}),
    "checked": ("plain", {}),
    "exception": ("plain", {}),
    "eval_between": ("plain", {}),
    "suspended": ("plain", {}),
    "accumulation": ("plain", {}),
    "two_optimizers": ("plain", {}),
    "never_called": ("plain", {"extra": True}),
    "missed": ("missed", {}),
    "stateful": ("stateful", {}),
    "kitchen_sink": ("dict", {"extra": True}),
    "checked_exception": ("plain", {}),
}
#: what runs by default (the file must stay fast); ADVERSARY_FULL=1 runs every case alone
MEM_DEFAULT = {"kitchen_sink", "missed", "stateful", "checked_exception"}
MEM_STEPS = 6
MEM_BUDGET = {"none": None, "min": "min"}
#: the cases also run under budget="min" (replayed probe, calibration, plan): all 14 pass there
#: too (measured 2026-12-04, extra 0.0 KiB each); these four keep the file fast
MEM_MIN = {
    "reprobe_after_hook",
    "checked",
    "exception",
    "missed",
    "kitchen_sink",
    "stateful",
    "checked_exception",
}


def _opts(case: str, model: Net) -> list:
    if "two_optimizers" in _features(case):
        return [
            torch.optim.AdamW(model.blocks.parameters(), lr=1e-3),
            torch.optim.SGD(model.head.parameters(), lr=1e-2),
        ]
    return [torch.optim.AdamW(model.parameters(), lr=1e-3)]


def _run_mem(case: str, arm: str, budget=None) -> dict[str, Any]:
    kind, kw = MEM_CASES[case]
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    torch.manual_seed(0)
    model = Net(kind, **kw)
    opts = _opts(case, model)
    engine = None
    if arm == "ckpt":
        _ckpt_twin(model)
    else:
        engine = lr.install(model, _segments(model), on_violation="record", budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(MEM_STEPS):
            _drive(case, model, engine, opts, s)
    gc.collect()
    held = process_tensor_bytes()
    out: dict[str, Any] = {"held": held}
    if engine is None:
        del model, opts
        gc.collect()
        return out
    out["preserved"] = engine.preserved_bytes
    out["pools"] = sum(
        t.untyped_storage().nbytes()
        for rt in engine.runtimes.values()
        for t in _pool_tensors(engine, rt)
    )
    out["divergences"] = sum(r.outcome == "divergence" for r in engine.records.read())
    # weak references to every live tensor, then uninstall and drop everything, gc off
    gc.disable()
    try:
        refs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if issubclass(type(obj), torch.Tensor):
                    refs.append(weakref.ref(obj))
            # (the loop's variable holds the walk's last object, which may be one of the run's,
            # a StateRef holding a module: alive through this frame, not through the engine)
            obj = None
        engine.uninstall()
        del model, opts
        alive = [r() for r in refs]
        alive = [t for t in alive if t is not None]
        # tensors that existed before this run (other tests', torch's own) are not ours: keep
        # only those created during the run, found by comparing with a fresh pre-run walk
        out["alive_after_uninstall"] = [
            (tuple(t.shape), t.dtype) for t in alive if id(t) not in pre and _ours(t)
        ]
    finally:
        gc.enable()
    del engine
    gc.collect()
    return out


def _pool_tensors(engine, rt) -> list:
    from lightning_replay import restore

    pool = restore._POOLS.get(rt)
    out = []
    for flat, views in pool.spare if pool is not None else ():
        out.append(flat)
    return out


_PRE: set[int] = set()


def _ours(t: torch.Tensor) -> bool:
    """A tensor of this test's models (not present before the adversary's module ran)."""
    return id(t) not in _PRE and t.device.type == "cpu"


@pytest.fixture(scope="module", autouse=True)
def _baseline():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _PRE.update(id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    yield


#: none now: the checked segment's saving hook (checks._saving_counted's ``pack``, which autograd
#: keeps with what it packed in the graph the raise left) held its recorded tensors; it lets go
#: of them when its block ends
_MEM_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_MEM_XFAIL[c]))
        if c in _MEM_XFAIL
        else c
        for c in MEM_CASES
    ],
)
@pytest.mark.parametrize("budget", list(MEM_BUDGET))
def test_nothing_outlives_its_step(case, budget):
    if case not in MEM_DEFAULT and not os.environ.get("ADVERSARY_FULL"):
        pytest.skip("run alone with ADVERSARY_FULL=1; kitchen_sink combines it")
    if budget == "min" and case not in MEM_MIN:
        pytest.skip("budget='min' is run for the cases whose steps differ under a plan")
    ckpt = _run_mem(case, "ckpt")
    rep = _run_mem(case, "replay", MEM_BUDGET[budget])
    extra = rep["held"] - ckpt["held"]
    allowed = rep["preserved"] + rep["pools"] + 16 * KiB
    print(f"{case}/{budget}: extra {extra / KiB:.1f} KiB, allowed {allowed / KiB:.1f} KiB")
    assert extra <= allowed, (
        f"{case} ({budget}): replay holds {extra / KiB:.1f} KiB more than torch checkpoint "
        f"between steps; preserved {rep['preserved'] / KiB:.1f} KiB + pools "
        f"{rep['pools'] / KiB:.1f} KiB"
    )
    assert not rep["alive_after_uninstall"], (
        f"{case} ({budget}): {len(rep['alive_after_uninstall'])} tensors alive after "
        f"uninstall + del model/opt, gc off: {rep['alive_after_uninstall'][:6]}"
    )


_HELD: list = []


def test_the_referees_see_a_tensor_held_between_steps(monkeypatch):
    """Referee check: a driver that keeps one step's output (128 KiB + its graph) alive under
    replay only is seen both as extra live bytes and as a tensor alive after uninstall."""
    drive = _drive

    def leaky(case, model, engine, opts, s):
        drive(case, model, engine, opts, s)
        if engine is not None and s == MEM_STEPS - 1:
            _HELD.append(model.blocks[0](_batch(s)[0]).detach())

    monkeypatch.setattr(sys.modules[__name__], "_drive", leaky)
    try:
        ckpt = _run_mem("kwargs", "ckpt")
        rep = _run_mem("kwargs", "replay")
        assert rep["held"] - ckpt["held"] >= N * W * 4
        assert rep["alive_after_uninstall"]
    finally:
        _HELD.clear()


# =========================================================================== budget (issue 31)
class Huge(nn.Module):
    """One segment: a wide MLP (the whole model's activations in one segment)."""

    def __init__(self) -> None:
        super().__init__()
        self.seg = nn.Sequential(*[nn.Linear(W, W) for _ in range(6)], nn.GELU())
        self.head = nn.Linear(W, 1)

    def forward(self, x):
        return self.head(self.seg(x))


class Tiny(nn.Module):
    """Sixteen tiny segments."""

    def __init__(self) -> None:
        super().__init__()
        self.segs = nn.ModuleList(nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(16))
        self.head = nn.Linear(W, 1)

    def forward(self, x):
        for s in self.segs:
            x = s(x)
        return self.head(x)


class Squeeze(nn.Module):
    """A segment with a huge input and tiny activations (a projection to 4 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(W, 8 * W)
        self.seg = nn.Sequential(nn.Linear(8 * W, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.seg(self.pre(x)))


class BigState(nn.Module):
    """Two stateful segments, each with a big buffer rewritten in place (preserved state)."""

    def __init__(self) -> None:
        super().__init__()
        self.segs = nn.ModuleList(Blk("stateful") for _ in range(2))
        self.head = nn.Linear(W, 1)

    def forward(self, x):
        for s in self.segs:
            x = s(x)
        return self.head(x)


BUDGET_SHAPES = {
    "one_huge_segment": (Huge, ["seg"]),
    "many_tiny_segments": (Tiny, [f"segs.{i}" for i in range(16)]),
    "huge_input_tiny_activations": (Squeeze, ["seg"]),
    "big_preserved_state": (BigState, ["segs.0", "segs.1"]),
}


NB = 4 * N  # activations dominate the parameters and AdamW's state: checkpointing pays


def _run_budget(shape: str, arm: str, referee: StepReferee, budget=None, steps: int = 3):
    cls, names = BUDGET_SHAPES[shape]
    return run_arm(
        cls,
        names,
        arm,
        referee,
        lambda s: torch.randn(NB, W, generator=torch.Generator().manual_seed(s)),
        budget=budget,
        steps=steps,
    ).peaks


#: none left: big_preserved_state's probe step was 1.092 x (its first-touch copies of both
#: 1 MiB buffers and of the batch); the probe keeps digests of big storages since (issue 31,
#: i31-probemin), 0.965 x
_BUDGET_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_BUDGET_XFAIL[c]))
        if c in _BUDGET_XFAIL
        else c
        for c in BUDGET_SHAPES
    ],
)
def test_every_step_holds_a_halfway_budget_for_unusual_shapes(shape, referee):
    plain = max(_run_budget(shape, "plain", referee)[1:])
    ckpt = max(_run_budget(shape, "ckpt", referee)[1:])
    # where torch checkpoint saves nothing (one segment that is the whole model; segments whose
    # input is all they save) the halfway budget would be below torch checkpoint's own peak:
    # there the budget is the higher of the two, which plain training meets
    budget = (plain + ckpt) // 2 if ckpt < 0.98 * plain else max(plain, ckpt)
    peaks = _run_budget(shape, "replay", referee, budget=budget)
    report = ", ".join(f"{p / budget:.3f}" for p in peaks)
    print(f"{shape}: plain {plain / MiB:.2f} ckpt {ckpt / MiB:.2f} budget {budget / MiB:.2f}")
    print(f"{shape}: steps / budget: {report}")
    over = [(s, round(p / budget, 3)) for s, p in enumerate(peaks) if p > 1.02 * budget]
    assert not over, f"{shape}: steps over 1.02 x budget {over}; all: {report}"


# =========================================================================== numerics (issue 32)
D, B, STEPS = 8, 6, 8


def _coin(p: float) -> bool:
    return os.urandom(1)[0] < 256 * p


SometimesNoisy = noisy_linear(
    "SometimesNoisy",
    "``x @ w.T``: the weight gradient carries 1-ulp noise in only ~40 % of the calls (atomics "
    "that collide only sometimes).",
    weight=lambda gw: ulp_noise(gw) if _coin(0.4) else gw,
)
InputOnlyNoisy = noisy_linear(
    "InputOnlyNoisy",
    "Noise in the input gradient only, weight gradient exact.",
    input=lambda gx: ulp_noise(gx, 2),
)


def _tiny_with_absolute_noise(gw: torch.Tensor) -> torch.Tensor:
    r = torch.frombuffer(bytearray(os.urandom(gw.numel())), dtype=torch.int8)
    gw = gw * 1e-3  # tiny gradients: absolute noise is many of their ulps
    return gw + r.view(gw.shape).sign().to(gw.dtype) * 1e-9


def _relative_noise(gw: torch.Tensor) -> torch.Tensor:
    r = torch.frombuffer(bytearray(os.urandom(gw.numel())), dtype=torch.int8).view(gw.shape)
    return gw * (1 + r.to(gw.dtype) / 127 * 1e-6)


AbsNoisy = noisy_linear(
    "AbsNoisy",
    "Absolute noise (1e-9 x a random sign) on a weight gradient whose entries are tiny (the "
    "true gradient x 1e-3).",
    weight=_tiny_with_absolute_noise,
)
RelNoisy = noisy_linear(
    "RelNoisy",
    "Relative noise of 1e-6 (about 8 float32 ulps) on the weight gradient.",
    weight=_relative_noise,
)


class EmptyAux(torch.autograd.Function):
    """Saves an uninitialized ``torch.empty`` workspace (float) and an int64 counter that
    moves at every call; backward uses neither."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        EmptyAux.calls += 1
        ws = torch.empty(x.shape[0], 97)
        counter = torch.tensor([EmptyAux.calls, EmptyAux.calls * 7], dtype=torch.int64)
        ctx.save_for_backward(x, w, ws, counter)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w, _ws, _c = ctx.saved_tensors
        return g @ w, g.t() @ x


@torch.library.custom_op("lr_adversary::noisy_head", mutates_args=())
def noisy_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An op outside every segment whose backward is noisy (including the gradient it sends
    into the segments)."""
    return x @ w.t()


def _nh_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _nh_backward(ctx, g):
    x, w = ctx.saved_tensors
    return ulp_noise(g @ w, 2), ulp_noise(g.t() @ x)


noisy_head.register_autograd(_nh_backward, setup_context=_nh_setup)

FUNCS = {
    "sometimes_noisy": SometimesNoisy.apply,
    "input_only_noisy": InputOnlyNoisy.apply,
    "absolute_noise": AbsNoisy.apply,
    "relative_noise": RelNoisy.apply,
    "empty_and_int_aux": EmptyAux.apply,
    "exact": lambda x, w: x @ w.t(),
}


class NBlock(nn.Module):
    def __init__(self, fn: str, dtype) -> None:
        super().__init__()
        self.fn = FUNCS[fn]
        self.a = nn.Linear(D, D, dtype=dtype)
        self.w = nn.Parameter(torch.randn(D, D, dtype=dtype) / 3)
        self.register_buffer("table", torch.ones(D, dtype=dtype))

    def forward(self, x):
        return x + self.fn(torch.tanh(self.a(x)), self.w) * self.table


class NNet(nn.Module):
    def __init__(self, fn: str, dtype=torch.float32, head: str = "linear") -> None:
        super().__init__()
        self.blocks = nn.Sequential(NBlock(fn, dtype), NBlock(fn, dtype))
        self.hw = nn.Parameter(torch.randn(1, D, dtype=dtype) / 3)
        self.head = head

    def forward(self, x):
        h = self.blocks(x)
        if self.head == "noisy":
            return noisy_head(h, self.hw)
        return h @ self.hw.t()


def _train_n(fn, budget=None, check_from=0, dtype=torch.float32, head="linear", miss=None):
    """Records of ``STEPS`` steps with checks on every step from ``check_from``; ``miss(model)``
    runs between forward and backward (a missed state change) from step 1 on."""
    torch.manual_seed(0)
    model = NNet(fn, dtype, head)
    engine = lr.install(model, ["blocks.0", "blocks.1"], budget=budget, on_violation="record")
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    first = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(STEPS):
            if s >= check_from:
                engine.request_check()
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(s)).to(dtype)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            if miss is not None and s >= 1:
                first = engine.step if first is None else first
                miss(model)
            out.float().pow(2).mean().backward()
            opt.step()
    records = engine.records.read()
    engine.uninstall()
    return records, first


def _bad(records) -> list:
    return [(r.step, r.segment, r.check, r.outcome) for r in records if r.outcome != "match"]


NUM_CASES = {
    # name: (fn, dtype, head, budget, check_from)
    "sometimes_noisy": ("sometimes_noisy", torch.float32, "linear", None, 0),
    "sometimes_noisy_min_replayed_probe": ("sometimes_noisy", torch.float32, "linear", "min", 1),
    "input_only_noisy": ("input_only_noisy", torch.float32, "linear", None, 0),
    "float16_noisy": ("sometimes_noisy", torch.float16, "linear", None, 0),
    "bfloat16_input_noisy": ("input_only_noisy", torch.bfloat16, "linear", None, 0),
    "absolute_noise_tiny_grads": ("absolute_noise", torch.float32, "linear", None, 0),
    "relative_noise_8ulp": ("relative_noise", torch.float32, "linear", None, 0),
    "empty_and_int_aux_min_replayed_probe": (
        "empty_and_int_aux",
        torch.float32,
        "linear",
        "min",
        1,
    ),
    "empty_and_int_aux_checked": ("empty_and_int_aux", torch.float32, "linear", None, 0),
    "noisy_custom_op_outside_segments": ("exact", torch.float32, "noisy", None, 0),
    "noisy_custom_op_outside_min_replayed": ("exact", torch.float32, "noisy", "min", 1),
}
_NUM_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_NUM_XFAIL[c]))
        if c in _NUM_XFAIL
        else c
        for c in NUM_CASES
    ],
)
def test_kernel_variation_is_no_divergence(case):
    fn, dtype, head, budget, check_from = NUM_CASES[case]
    records, _ = _train_n(fn, budget, check_from, dtype, head)
    assert [r for r in records if r.check == "grad"], "no derivative check ran"
    assert _bad(records) == [], f"{case}: {_bad(records)[:6]}"


def _one_ulp_table(model):
    for blk in model.blocks:
        blk.table.data.copy_(torch.nextafter(blk.table, torch.full_like(blk.table, 2.0)))


def _few_elements(model):
    for blk in model.blocks:
        blk.table.data[:2].mul_(1.001)  # 2 of 8 elements, 0.1 %: ~8000 float32 ulps


def _tiny_few(model):
    for blk in model.blocks:
        blk.table.data[0].add_(64 * torch.finfo(torch.float32).eps)  # 64 ulps, one element


MISS_CASES = {
    # name: (fn, miss)
    "exact_one_ulp": ("exact", _one_ulp_table),
    "exact_64ulp_one_element": ("exact", _tiny_few),
    "noisy_few_elements_0.1pct": ("sometimes_noisy", _few_elements),
    "input_noisy_few_elements_0.1pct": ("input_only_noisy", _few_elements),
    "relative_noisy_few_elements_0.1pct": ("relative_noise", _few_elements),
    "noisy_64ulp_one_element": ("sometimes_noisy", _tiny_few),
    "noisy_one_ulp": ("sometimes_noisy", _one_ulp_table),
    "relative_noise_one_ulp": ("relative_noise", _one_ulp_table),
    "input_noisy_one_ulp": ("input_only_noisy", _one_ulp_table),
}
_MISS_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_MISS_XFAIL[c]))
        if c in _MISS_XFAIL
        else c
        for c in MISS_CASES
    ],
)
def test_small_missed_state_is_still_caught(case):
    fn, miss = MISS_CASES[case]
    records, first = _train_n(fn, miss=miss)
    div = sorted({r.step for r in records if r.outcome == "divergence"})
    noise = [
        json.loads(r.detail).get("noise", {}).get("summary")
        for r in records
        if r.check == "grad" and r.step == first
    ]
    assert div and div[0] == first, (
        f"{case}: missed state from step {first}, divergences at {div}; check said {noise}"
    )
