"""Adversarial models against the memory promise: a budget bounds the process's real memory.

What is promised (README "Memory", issue 19), refereed here by ``torch.profiler``'s CPU
allocation events (:mod:`tests.helpers.torch_memory`, no code shared with the engine):

* the probe step's real peak is at most 1.1 x a plain step's (no budget);
* under ``budget="min"``, the plan's predicted peak is within 10 % of the real one;
* with a byte budget, every step's real peak -- the probe, calibration and planned steps -- is
  within it, or the engine says it cannot be (``InfeasibleBudget``, or a warning naming the
  figure): never a silent overrun;
* and training stays bit-identical to the same model without the engine.

A step's real peak is the bytes live when it begins (parameters, buffers, gradients, optimizer
state, every tensor the model's modules hold, the input) plus the highest running sum of the
allocations and frees of the whole step: ``zero_grad``, forward, loss, backward and the
optimizer step. The engine measures the first steps of each plan with a profiler of its own; the
referee, a profiler too, stays off on those (as ``test_engine_planning`` does).

Each model is built to break one assumption of the accounting. Where a promise does not hold,
the test stays as ``xfail(strict=True)`` with the figures measured, so the fix shows up as an
XPASS.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import lightning_replay as lr
from lightning_replay.budget import format_bytes
from lightning_replay.planner import InfeasibleBudget
from tests.helpers.torch_memory import (
    StepReferee,
    allocation_peak,
    net_peak,
    live_bytes,
    process_tensor_bytes,
)

STEPS_TO_PLAN = 1 + 2 * 3 + 1  # probe, two calibration phases (warm-up + 2 steps), the plan
SETTLE = 4  # planned steps the engine measures itself (the referee stays off on them)
REFEREED = 2  # planned steps the referee measures, after those
KIB = 1024
MIB = 1024 * KIB
#: what a referee's reading may exceed a budget by: the profiler misses a unit-sized free now
#: and then (tests/strategies/test_replay_fsdp.py saw 52,552 against 49,280 B), and plans the
#: engine fits to its own measurement land within bytes of the budget (-256 B, -2,304 B here)
SLACK = 4 * KIB


# --------------------------------------------------------------------------- the referee
def _tensors_held(obj: Any, out: list, seen: set) -> None:
    """Every tensor reachable from a module's attributes (containers included)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if obj.grad is not None:
            out.append(obj.grad)
    elif isinstance(obj, nn.Module):
        for k, v in vars(obj).items():
            if k in ("_forward_hooks", "_backward_hooks", "_forward_pre_hooks"):
                continue
            _tensors_held(v, out, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_held(v, out, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors_held(v, out, seen)


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer, x: Any) -> int:
    """Bytes live between steps for this model: parameters, gradients, buffers, plain tensor
    attributes and containers of tensors of every module, optimizer state, the input."""
    out: list = []
    seen: set = set()
    for m in model.modules():
        _tensors_held(m, out, seen)
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    out.extend(t for t in _leaves(x) if isinstance(t, torch.Tensor))
    return live_bytes(out)


def _leaves(x: Any) -> list:
    if isinstance(x, dict):
        return [v for xs in x.values() for v in _leaves(xs)]
    if isinstance(x, (list, tuple)):
        return [v for xs in x for v in _leaves(xs)]
    return [x]


# --------------------------------------------------------------------------- the models
@dataclass
class Case:
    """One adversarial model: how to build it, feed it, train it."""

    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int], Any]
    segments: Any
    loss: Callable[[Any], torch.Tensor] = lambda out: out.float().pow(2).mean()
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.SGD(
        m.parameters(), lr=0.01
    )
    micro_batches: int = 1
    track_optimizer: bool = True
    install_kwargs: dict = field(default_factory=dict)
    budget_kwargs: dict = field(default_factory=dict)  # install's, in the byte-budget test only
    #: collect reference cycles before each step. The engine leaves some every step (closures,
    #: cells, saved-tensor handles); the cyclic GC frees them whenever it happens to run, and
    #: that moved one plan's real peak by 1-2 MiB from step to step, and the engine's own
    #: accounting with it (see the ``attention_uncollected`` case). Collected, every figure
    #: repeats run after run; the cost is small with the module's objects frozen (fixture).
    collect: bool = True
    xfail: dict = field(default_factory=dict)  # promise -> reason (measured figures)


def _g(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


N, D = 512, 128


class SoftmaxBlock(nn.Module):
    """Softmax over long rows: backward needs the output, its gradient and a same-sized
    temporary per block, none of them saved tensors."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.up = nn.Linear(D, width, bias=False)
        self.down = nn.Linear(width, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.softmax(self.up(x), dim=-1))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], head: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _x(step: int) -> torch.Tensor:
    return torch.randn(N, D, generator=_g(step))


def softmax_stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack([SoftmaxBlock() for _ in range(2)])


class OuterGrad(torch.autograd.Function):
    """``y = tanh(x) * w`` whose backward builds an (N, D, D) outer product before reducing
    it: a backward temporary 128x (32 MiB) the saved input."""

    @staticmethod
    def forward(ctx, x, w):  # noqa: ANN001
        ctx.save_for_backward(x, w)
        return torch.tanh(x) * w

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        x, w = ctx.saved_tensors
        t = torch.tanh(x)
        outer = g[:, :, None] * t[:, None, :]  # (N, D, D): 32 MiB
        gw = torch.diagonal(outer, dim1=1, dim2=2).sum(0)
        return g * w * (1 - t * t), gw


class OuterBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OuterGrad.apply(self.fc(x), self.w)


def outer_grad_stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack([OuterBlock() for _ in range(3)])


class Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def mlp_stack(hidden: int = 1024, n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return Stack([Mlp(hidden) for _ in range(n)])


def uneven_stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack([Mlp(h) for h in (32, 4096, 64, 1024, 16)])


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=1e-3)


class QueueReader(nn.Module):
    """Attends over a queue given as its input: activations scale with the queue's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, queue: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.q(x) @ queue.t() / math.sqrt(D), dim=-1)
        return x + att @ queue


class GrowingQueue(nn.Module):
    """A queue rebuilt larger with ``torch.cat`` after every forward (never written in place):
    the state, and the activations that read it, grow every step."""

    def __init__(self, rows: int = 512, grow: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.grow = grow
        self.register_buffer("queue", torch.randn(rows, D))
        self.blocks = nn.ModuleList(QueueReader() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, self.queue)
        self.queue = torch.cat([self.queue, x.detach()[: self.grow]])
        return self.head(x)


class GrowingMemory(nn.Module):
    """A memory bank held as a plain attribute (no buffer), grown by ``torch.cat`` every step
    and read by every segment through its owner (no argument): an attention over the bank,
    whose activations grow with it, and a segment that does not read it."""

    def __init__(self, rows: int = 256, grow: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.grow = grow
        self.bank = torch.randn(rows, D)
        self.blocks = nn.ModuleList([BankReader(self), nn.Linear(D, D), BankReader(self)])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        self.bank = torch.cat([self.bank, x.detach()[: self.grow]])
        return self.head(x)


class BankReader(nn.Module):
    def __init__(self, owner: GrowingMemory) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self._owner = [owner]  # (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bank = self._owner[0].bank
        att = torch.softmax(self.q(x) @ bank.t() / math.sqrt(D), dim=-1)
        return x + torch.tanh(att @ bank)


class CachingStack(Stack):
    """Keeps a detached copy of every step's features in a plain dict (a feature cache, a
    replay buffer): 256 KiB more held by the model after each step, in no parameter or
    buffer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__([Mlp(1024) for _ in range(3)])
        self.cache: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        self.cache[len(self.cache)] = x.detach().clone()
        return self.head(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 1024)
        self.down = nn.Linear(1024, D)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) * torch.sigmoid(gate)


class AliasedInputs(nn.Module):
    """Segments whose two inputs are the same tensor, a view of each other, and a buffer the
    step then writes in place (so a replay needs the buffer as the forward saw it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(N, D))
        self.blocks = nn.ModuleList(Gated() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x, x)
        x = self.blocks[1](x, x.flip(0)[torch.arange(N - 1, -1, -1)])  # a copy equal to x
        x = self.blocks[2](x, self.table)
        with torch.no_grad():
            self.table.mul_(0.5).add_(x.detach(), alpha=0.5)
        return self.head(x)


class DictOut(Stack):
    """Returns a dict holding a tuple; the loss reads every part."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__([Mlp(1024) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> dict:
        feats = []
        for b in self.blocks:
            x = b(x)
            feats.append(x)
        return {"y": self.head(x), "aux": (feats[0].mean(), feats[1])}


def _dict_loss(out: dict) -> torch.Tensor:
    return out["y"].pow(2).mean() + out["aux"][0] ** 2 + out["aux"][1].pow(2).mean()


class InplaceAfter(Stack):
    """An in-place activation on each segment's output, outside the segment."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__([Mlp(1024) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = F.leaky_relu(b(x), 0.1, inplace=True)
        return self.head(x)


def tied_stack() -> nn.Module:
    """Parameters shared between segments: block 2 reuses block 0's weights (tied), and one
    module is called twice as two steps of the stack."""
    torch.manual_seed(0)
    a, b = Mlp(1024), Mlp(1024)
    c = Mlp(1024)
    c.up.weight = a.up.weight
    c.down.weight = a.down.weight
    m = Stack([a, b, c])
    m.blocks.append(b)  # the same module (one segment) twice in a step
    return m


class Attention(nn.Module):
    """Single-head self-attention: activations grow with the square of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return x + self.out(att @ v)


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _varlen(step: int) -> torch.Tensor:
    """Sequences of 64 tokens while the engine probes, calibrates and measures its plan, 4x
    longer afterwards: activations per token are as before, tokens are 4x more."""
    t = 64 if step < STEPS_TO_PLAN + 2 else 256
    return torch.randn(8, t, D, generator=_g(step))


def _fixed_len(step: int) -> torch.Tensor:
    return torch.randn(8, 256, D, generator=_g(step))


def token_mlp_stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack([Mlp(512) for _ in range(3)])


class Teacher(nn.Module):
    """A student stack and a frozen teacher block run under ``torch.no_grad``, both
    segments."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = Mlp(2048)
        self.teacher.requires_grad_(False)
        self.blocks = nn.ModuleList(Mlp(1024) for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) + (x - target).pow(2).mean()


class DropMlp(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.down(F.dropout(F.gelu(self.up(x)), 0.2)), 0.1)


def dropout_stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack([DropMlp(1024) for _ in range(3)])


def big_param_stack() -> nn.Module:
    """Parameters as large as the activations of a micro-batch: the second micro-batch's
    gradient accumulation adds a parameter-sized temporary the first one does not have."""
    torch.manual_seed(0)
    return Stack([Mlp(2048) for _ in range(3)])


def _half_x(step: int) -> torch.Tensor:
    return torch.randn(N // 2, D, generator=_g(step))


CASES = [
    Case(
        "softmax_long_rows",
        softmax_stack,
        _x,
        "blocks.*",
    ),
    Case(
        "custom_backward_temporary",
        outer_grad_stack,
        _x,
        "blocks.*",
    ),
    Case(
        "adam_lazy_state",
        lambda: mlp_stack(1024),
        _x,
        "blocks.*",
        optimizer=_adam,
    ),
    Case(
        "uneven_blocks",
        uneven_stack,
        _x,
        "blocks.*",
    ),
    Case(
        "growing_queue_cat",
        GrowingQueue,
        _x,
        "blocks.*",
        # the engine charged the queue's own growth only (its bytes in the base) and measured
        # the real peak at doubling gaps: predicted 19.01 MiB for a real 27.26 at step 12.
        # The peak grows 14 x the state (an attention over the queue): replan.StateGrowth
    ),
    Case("growing_memory_attribute", GrowingMemory, _x, "blocks.*"),
    Case(
        "growing_cache_dict",
        CachingStack,
        _x,
        "blocks.*",
        # the measured real peak counts tensors modules hold in dicts (memory.live_model_bytes)
    ),
    # At 2b83bb0 two plans tied at a predicted 16.03 MiB under this budget, measured time
    # picked one, and (retain, recompute, retain) really peaked at 16.53 MiB: an overrun in 3
    # runs of 4. Since the residual is taken against the plan's prediction, both are priced.
    Case("aliased_inputs", AliasedInputs, _x, "blocks.*"),
    Case("dict_tuple_output", DictOut, _x, "blocks.*", loss=_dict_loss),
    Case("inplace_after_segment", InplaceAfter, _x, "blocks.*"),
    Case(
        "tied_and_repeated",
        tied_stack,
        _x,
        ["blocks.0", "blocks.1", "blocks.2"],
    ),
    # attention with reference cycles left to the cyclic GC (every other case collects them
    # before each step): collected, the same model predicts 12.57 MiB for a real 13.57 MiB
    Case(
        "attention_uncollected",
        Seq,
        _fixed_len,
        "blocks.*",
        collect=False,
    ),
    Case("fixed_seq_len", token_mlp_stack, _fixed_len, "blocks.*"),
    Case(
        "variable_seq_len",
        token_mlp_stack,
        _varlen,
        "blocks.*",
        # plans are made for the largest input seen: costs measured at 64 tokens are scaled
        # with the input before the first 256-token step runs (engine.size_scale)
    ),
    Case(
        "variable_seq_len_replan_on_shapes",
        token_mlp_stack,
        _varlen,
        "blocks.*",
        install_kwargs={"replan_on": ("shapes",), "replan_cooldown_steps": 1},
    ),
    Case(
        "grad_accumulation",
        big_param_stack,
        _half_x,
        "blocks.*",
        micro_batches=2,
        # was a strict xfail (steps 2-3 and 9-10 held 27.68 MiB against 26.70, 1.037 x): the
        # referee's profiler blinded the engine's measurements, whose base missed the
        # gradients of the micro-batch before (held in C++ only); see WindowReferee
    ),
    Case(
        "no_grad_teacher",
        Teacher,
        _x,
        ["teacher", "blocks.0", "blocks.1"],
    ),
    Case("dropout", dropout_stack, _x, "blocks.*"),
    Case(
        "adam_untracked",
        lambda: mlp_stack(1024),
        _x,
        "blocks.*",
        optimizer=_adam,
        track_optimizer=False,
    ),
]


# --------------------------------------------------------------------------- the harness
def _step_fn(case: Case, model: nn.Module, opt: torch.optim.Optimizer, xs: list) -> Callable:
    def step() -> None:
        for x in xs:
            case.loss(model(x)).div(len(xs)).backward()
        opt.step()

    return step


def train(
    case: Case,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    referee: bool | StepReferee = False,
    engine: Any = None,
) -> list[int]:
    """Train ``steps`` (global step numbers: inputs and the RNG follow them); with
    ``referee``, return each step's real peak. A :class:`StepReferee` (with the ``engine``)
    leaves a step the engine measures with its own profiler to the engine's figure, instead
    of running a profiler of its own over it, which would blind the engine's measurement
    (one profiler per process): :attr:`LAST_WHO` says who measured each."""
    peaks = []
    LAST_WHO.clear()
    for s in steps:
        xs = [case.make_input(s * case.micro_batches + i) for i in range(case.micro_batches)]
        torch.manual_seed(100 + s)  # dropout draws the same masks with and without the engine
        if case.collect:
            gc.collect()  # see Case.collect
        opt.zero_grad(set_to_none=True)
        step = _step_fn(case, model, opt, xs)
        if isinstance(referee, StepReferee):
            peak, who = referee(step, engine)
            peaks.append(peak)
            LAST_WHO.append(who)
        elif referee:
            # the base is the process's (every live storage: the engine's too), not rebuilt
            live = process_tensor_bytes()
            peaks.append(live + allocation_peak(step))
        else:
            step()
    return peaks


#: who measured each step of the last ``train`` with a StepReferee: "referee" or "engine"
#: (the engine measured a window of it; "engine+referee": the engine one, the referee the rest)
LAST_WHO: list[str] = []


class WindowReferee(StepReferee):
    """:class:`StepReferee` for a step of several windows (gradient accumulation: each
    micro-batch's forward opens a window of its own). The engine measures one window at a
    time (from its start to the next window's, or to the optimizer step): the referee stays
    off while the engine's profiler runs, and measures the rest of the step itself from the
    first module call of each window the engine does not measure to the next window (the
    root's call) or the step's end (the live storages then + its profiler's net peak). The
    step's peak is the highest of the engine's window figures and the referee's."""

    def _hook(self, module: object, args: object) -> None:
        st = self._state
        if st is None:
            return
        engine = st["e"]
        if engine is not None and module is engine.model and st["prof"] is not None:
            # the root opens the next window: its measurement ends, so that the engine can
            # measure that window if it is due to (one profiler per process)
            self._stop(st)
        if st["prof"] is not None:
            return
        if engine is not None and engine.step == st["window"]:
            return  # no new window since the last look
        if engine is not None:
            st["window"] = engine.step
            last = engine.last_real_peak  # a window the engine measured, settled as this began
            if last is not None and last[0] >= st["first"]:
                st["figures"].append(last[1])
        if bool(torch.autograd.profiler._is_profiler_enabled):
            st["engine"] = True  # the engine measures this window
            return
        st["base"] = process_tensor_bytes()
        st["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        st["prof"].__enter__()

    def __call__(self, fn: Callable[[], object], engine: object = None) -> tuple[int, str]:
        step = getattr(engine, "step", None)
        st = self._state = {
            "prof": None,
            "engine": False,
            "e": engine,
            "step": step,
            "window": step,
            "first": (step or 0) + 1,  # the engine's number of the step's first window
            "figures": [],
            "mine": False,  # the referee measured part of the step
        }
        try:
            fn()
        finally:
            self._state = None
        if st["engine"] and getattr(engine, "_truth_peak", None) is not None:
            st["figures"].append(int(engine._truth_peak))  # the last window's, at opt.step
        if st["prof"] is not None:
            self._stop(st)
        if not st["figures"]:
            raise AssertionError("another profiler ran through the step: nothing measured")
        who = "referee" if not st["engine"] else "engine" if not st["mine"] else "both"
        return max(st["figures"]), who

    @staticmethod
    def _stop(st: dict) -> None:
        prof, st["prof"] = st["prof"], None
        prof.__exit__(None, None, None)
        st["figures"].append(st["base"] + (net_peak(prof) or 0))
        st["mine"] = True


_INSTALLED: list = []  # engines of the test in progress, uninstalled when it ends


@pytest.fixture(autouse=True)
def _nothing_outlives_its_test():
    """The referee counts every live storage of the process: an engine (and its model) of an
    earlier test would count in this one's steps. Each test's engines are uninstalled at its
    end, and its garbage collected."""
    yield
    while _INSTALLED:
        _INSTALLED.pop().uninstall()
    gc.collect()


def _install(case: Case, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any):
    e = lr.install(model, case.segments, **{**case.install_kwargs, **kw})
    _INSTALLED.append(e)
    if case.track_optimizer:
        e.track_optimizer(opt)
    return e


@dataclass
class Figures:
    plain: int  # a plain step's real peak (planned steps' numbers, steady state)
    plain_probe: int  # the plain model's first step (the probe's step number)
    predicted: int  # the min plan's predicted peak
    real: int  # the min plan's real peak
    exact: list  # names whose values differ from the plain model's after training
    measured: bool  # the engine measured the min plan's real peak itself
    unaccounted: int  # the engine's unaccounted_bytes under the min plan


_FIGURES: dict[str, Figures] = {}

TOTAL = STEPS_TO_PLAN + SETTLE + REFEREED
LATE = range(STEPS_TO_PLAN + SETTLE, TOTAL)


def figures(case: Case) -> Figures:
    """Plain and ``budget="min"`` runs of ``case`` side by side (computed once per case)."""
    if case.name in _FIGURES:
        return _FIGURES[case.name]
    from lightning_replay.verify import diff_state, snapshot_state

    # the referee counts every live storage of the process: nothing of one run may outlive it
    # (the base model is rebuilt, each run's model and engine go before the next measures)
    plain = case.build()
    popt = case.optimizer(plain)
    plain_probe = train(case, plain, popt, range(1), referee=True)[0]
    train(case, plain, popt, range(1, LATE.start))
    plain_late = train(case, plain, popt, LATE, referee=True)

    plain_state, plain_opt = snapshot_state(plain), copy.deepcopy(popt.state_dict())
    del plain, popt
    gc.collect()
    model = case.build()
    opt = case.optimizer(model)
    e = _install(case, model, opt, budget="min")
    train(case, model, opt, range(LATE.start))
    real = train(case, model, opt, LATE, referee=True)
    predicted = e.window_stats()["predicted_peak_bytes"]
    measured, unaccounted = e.last_real_peak is not None, e.unaccounted_bytes
    e.uninstall()
    _INSTALLED.remove(e)
    exact = diff_state(plain_state, snapshot_state(model))
    exact += [f"optimizer {k}" for k in _opt_diff(plain_opt, opt.state_dict())]
    del plain_state, plain_opt, model, opt, e
    gc.collect()
    f = Figures(max(plain_late), plain_probe, predicted, max(real), exact, measured, unaccounted)
    _FIGURES[case.name] = f
    return f


def _opt_diff(a: dict, b: dict) -> list:
    """Optimizer state entries that differ between two ``state_dict()``s."""
    sa, sb = a["state"], b["state"]
    bad = []
    for k in sa.keys() | sb.keys():
        for n in sa.get(k, {}).keys() | sb.get(k, {}).keys():
            va, vb = sa.get(k, {}).get(n), sb.get(k, {}).get(n)
            if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
                continue
            if not torch.equal(va, vb):
                bad.append((k, n))
    return bad


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _marks(case: Case, promise: str) -> list:
    """``xfail`` for a promise ``case`` breaks; ``promise?`` keys break it in some runs only
    (the plan is chosen by measured time), which no strict mark can hold."""
    if promise in case.xfail:
        return [pytest.mark.xfail(strict=True, reason=case.xfail[promise])]
    if promise + "?" in case.xfail:
        return [pytest.mark.xfail(strict=False, reason=case.xfail[promise + "?"])]
    return []


def _params(promise: str) -> list:
    return [pytest.param(c, id=c.name, marks=_marks(c, promise)) for c in CASES]


# --------------------------------------------------------------------------- the promises
@pytest.mark.parametrize("case", _params("exact"))
def test_training_is_bit_identical_to_plain(case: Case) -> None:
    f = figures(case)
    assert f.exact == [], f"{case.name}: differs from the plain model: {f.exact}"


@pytest.mark.parametrize("case", _params("predicted"))
def test_min_plan_predicts_its_real_peak_within_10_percent(case: Case) -> None:
    f = figures(case)
    assert f.predicted is not None, f"{case.name}: no plan after {LATE.start} steps"
    assert f.measured, f"{case.name}: the plan was never measured"
    print(
        f"{case.name}: plain {_mib(f.plain)} min plan predicted {_mib(f.predicted)} "
        f"real {_mib(f.real)} ratio {f.predicted / f.real:.3f}"
    )
    assert abs(f.predicted - f.real) <= 0.10 * f.real, (
        f"{case.name}: predicted {_mib(f.predicted)}, real {_mib(f.real)} (plain {_mib(f.plain)})"
    )


@pytest.mark.parametrize("case", _params("probe"))
def test_probe_step_peaks_within_10_percent_of_a_plain_step(case: Case) -> None:
    f = figures(case)
    model = case.build()
    opt = case.optimizer(model)
    _install(case, model, opt)
    probe = train(case, model, opt, range(1), referee=True)[0]
    print(
        f"{case.name}: probe {_mib(probe)} plain {_mib(f.plain_probe)} "
        f"ratio {probe / f.plain_probe:.3f}"
    )
    assert probe <= 1.1 * f.plain_probe, (
        f"{case.name}: probe step {_mib(probe)}, plain step {_mib(f.plain_probe)}"
    )


def _named(seen: list, budget: int) -> list[str]:
    """The warnings that name the budget's figure (as the engine writes bytes): an overrun the
    engine says it could not avoid is not silent."""
    figure = format_bytes(budget)
    return [
        str(w.message)
        for w in seen
        if issubclass(w.category, RuntimeWarning) and figure in str(w.message)
    ]


def _engine_figure(e: Any, figures: dict) -> None:
    """Keep the engine's own measurement of a step the referee left to it."""
    if e.last_real_peak is not None:
        step, nbytes = e.last_real_peak
        figures[step] = nbytes


def _excused(seen: list, budget: int, at: int, engine_steps: range) -> list[str]:
    """Warnings that excuse one step's overrun, judged on its own: one naming the budget's
    figure that says the budget cannot hold (the lowest plan runs instead), issued at or before
    the step (``at``: the index of ``seen`` after the step), or one that names this very step
    (the engine's ``step N held ...``, issued when it measured it: ``engine_steps``, the
    engine's numbers for the step's windows). A warning about another step, or one that only
    names the budget (a skipped check), excuses nothing."""
    out = []
    figure = format_bytes(budget)
    for i, w in enumerate(seen):
        msg = str(w.message)
        if not issubclass(w.category, RuntimeWarning) or figure not in msg:
            continue
        if "cannot hold" in msg and i < at:
            out.append(msg)
        elif any(f"step {n} held" in msg for n in engine_steps):
            out.append(msg)
    return out


@pytest.mark.parametrize("case", _params("budget"))
def test_every_step_holds_a_budget_a_plain_step_does_not(case: Case) -> None:
    """The budget sits halfway between the min plan's real peak and a plain step's. Every step
    is judged on its own: the probe and calibration steps and the planned steps after the
    engine's own measurements are refereed (the process's live storages at the step's start +
    the profiler's net peak); the steps the engine measures with its own profiler (the first
    steps of each plan) are judged by the engine's figure, the same measure. A step over the
    budget is excused only by a warning about that step, or one, before it, saying the budget
    cannot hold."""
    f = figures(case)
    budget = (f.real + f.plain) // 2
    model = case.build()
    opt = case.optimizer(model)
    steps: list = []  # (step, peak, who, index of `seen` after it, the engine's step numbers)
    # The referee's profiler starts at a step's first module call, once the engine's window
    # is open: a step the engine measures itself (a calibration warm-up, a plan's first step)
    # is judged by the engine's figure. A profiler of the referee's own over the whole step
    # blinded those measurements (one profiler per process): the first plan was then made
    # without them (grad_accumulation: retain everywhere, predicted 24.55 MiB, held 27.68
    # against 26.70; with them, the same first plan holds 23.68).
    ref = WindowReferee()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            e = _install(case, model, opt, budget=budget, **case.budget_kwargs)

            def run(s: int, referee: bool) -> None:
                first = e.step
                peaks = train(
                    case, model, opt, range(s, s + 1), referee=ref if referee else False, engine=e
                )
                if referee:
                    # the engine numbers a window by its count once begun (step_stats)
                    windows = range(first + 1, e.step + 1)
                    steps.append((s, peaks[0], LAST_WHO[0], len(seen), windows))

            run(0, True)
            first_plan = e.steps_to_first_plan  # known once the segments are probed
            for s in range(1, first_plan - 1):
                run(s, True)
            by_engine: dict = {}  # the engine's step number -> (bytes, len(seen) before it)
            before: dict = {}
            for s in range(first_plan - 1, first_plan - 1 + SETTLE + 1):
                before[e.step + 1] = len(seen)
                run(s, False)
                _engine_figure(e, by_engine)  # the step before, settled as this one began
            start = first_plan + SETTLE
            for s in range(start, start + REFEREED):
                run(s, True)
                _engine_figure(e, by_engine)
        except InfeasibleBudget as exc:
            pytest.fail(
                f"{case.name}: InfeasibleBudget at {_mib(budget)}, between the min "
                f"plan's real {_mib(f.real)} and plain {_mib(f.plain)}: {exc}"
            )
        finally:
            ref.close()
    for n, nbytes in sorted(by_engine.items()):
        if n in before:  # a step the referee left to the engine
            steps.append((n, nbytes, "engine", before[n], range(n, n + 1)))
    over = []
    for s, nbytes, who, at, engine_steps in steps:
        if nbytes > budget + SLACK and not _excused(seen, budget, at, engine_steps):
            over.append((s, who, _mib(nbytes), f"{nbytes / budget:.3f} x"))
    report = (
        f"{case.name}: budget {_mib(budget)}; steps {[(s, w, _mib(b)) for s, b, w, *_ in steps]}"
        f"; plain {_mib(f.plain)}, min plan's real {_mib(f.real)}"
    )
    print(report, f"silent overruns: {over}")
    assert not over, f"silent overruns {over}: {report}"


# --------------------------------------------------------------------------- growth
GROWING = [c for c in CASES if c.name.startswith("growing_")]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=_marks(c, "growth")) for c in GROWING]
)
def test_state_that_grows_past_the_budget_is_not_a_silent_overrun(case: Case) -> None:
    """State that grows every step (a queue rebuilt larger, a cache filling up) outgrows any
    plan made from the first steps. A budget 10 % above a planned step's real peak is held,
    or the engine says when the step no longer fits it."""
    model = case.build()
    opt = case.optimizer(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        e = _install(case, model, opt, budget="min")
        train(case, model, opt, range(LATE.start))
        (now,) = train(case, model, opt, range(LATE.start, LATE.start + 1), referee=True)
        budget = int(1.1 * now)
        e.replan(budget=budget)
        start = LATE.start + 1
        train(case, model, opt, range(start, start + SETTLE))  # the engine measures these
        start += SETTLE
        later = []
        for s in range(start, start + 6, 2):
            train(case, model, opt, range(s, s + 1))
            later += train(case, model, opt, range(s + 1, s + 2), referee=True)
    said = _named(seen, budget)
    report = (
        f"{case.name}: budget {_mib(budget)} (1.1 x {_mib(now)}), later steps "
        f"{[_mib(p) for p in later]}, predicted {_mib(e.plan.peak_memory)}"
    )
    print(report, said)
    assert max(later) <= budget + SLACK or said, f"silent overrun: {report}"


# --------------------------------------------------------------------------- impossible budgets
def test_a_budget_below_the_parameters_is_refused_before_a_step_overruns_it() -> None:
    """A budget smaller than the parameters and their gradients cannot be met by any plan:
    the engine says so (InfeasibleBudget naming the figure) rather than train over it."""
    case = CASES[0]
    model = case.build()
    opt = case.optimizer(model)
    params = live_bytes(list(model.parameters()))
    budget = params  # the gradients alone need as much again
    steps = []
    with pytest.raises(InfeasibleBudget) as err:
        _install(case, model, opt, budget=budget)
        for s in range(STEPS_TO_PLAN):
            steps += train(case, model, opt, range(s, s + 1), referee=True)
    assert err.value.min_feasible > budget and str(err.value.min_feasible) in str(err.value)
    print(
        f"refused after {len(steps)} steps over the budget {_mib(budget)}: "
        f"{[_mib(p) for p in steps]}"
    )
    assert all(p <= budget for p in steps), (
        f"{len(steps)} steps trained over an impossible budget ({_mib(budget)}) before it was "
        f"refused: {[_mib(p) for p in steps]}"
    )


def test_a_budget_only_the_accountant_meets_is_refused_or_warned() -> None:
    """A budget above the plan's accounted peak but below the real peak of the lowest-memory
    plan (the backward temporaries the accountant does not count make up the difference)."""
    case = CASES[0]  # softmax over long rows: large backward temporaries
    f = figures(case)
    accounted_min = f.predicted - f.unaccounted  # the min plan before the real figure
    budget = (accounted_min + f.real) // 2
    assert accounted_min < budget < f.real, (accounted_min, budget, f.real)
    model = case.build()
    opt = case.optimizer(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _install(case, model, opt, budget=budget)
            train(case, model, opt, range(LATE.start))
            late = train(case, model, opt, LATE, referee=True)
        except InfeasibleBudget as exc:
            assert str(exc.min_feasible) in str(exc)
            return
    said = _named(seen, budget)
    print(f"budget {_mib(budget)} late {[_mib(p) for p in late]} said {said}")
    assert max(late) <= budget + SLACK or said, (
        f"silent overrun: budget {_mib(budget)}, planned steps {[_mib(p) for p in late]}"
    )


# --------------------------------------------------------------------------- Lightning
def _events_peak(prof: Any) -> int:
    """:func:`allocation_peak`'s sum, for a profiler started and stopped by hooks."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    for _, n in events:
        running += n
        peak = max(peak, running)
    return peak


def _lightning_classes():
    import lightning as L

    class Referee(L.Callback):
        """Real peak of chosen training steps: batch start to batch end (Lightning's
        zero_grad, training_step, backward and optimizer step all run between them)."""

        def __init__(self, steps: Any) -> None:
            self.steps, self.peaks, self._prof, self._live = steps, [], None, 0
            self.by_engine: dict = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                _engine_figure(engine, self.by_engine)
            gc.collect()  # as train() does
            step = trainer.global_step
            if step in self.steps if isinstance(self.steps, range) else self.steps(engine, step):
                self._live = process_tensor_bytes()  # the process's, the engine's too
                self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self._prof.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.peaks.append(self._live + _events_peak(self._prof))
                self._prof = None

    class LitStack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp_stack(1024)

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Referee, LitStack


def _lit_run(tmp_path, strategy: Any, steps: range, total: int):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers.lit_hazards import trainer

    Referee, LitStack = _lightning_classes()
    L.seed_everything(3)
    model = LitStack()
    data = TensorDataset(torch.cat([_x(s) for s in range(total)]))
    referee = Referee(steps)
    t = trainer(tmp_path, strategy=strategy, max_steps=total, callbacks=[referee])
    t.fit(model, DataLoader(data, batch_size=N))
    return model, t, referee


_LIT: dict = {}


def _lit_figures(tmp_path) -> dict:
    """Plain ``Trainer()`` and ``ReplayStrategy(budget="min")`` runs, once per module."""
    if not _LIT:
        from lightning_replay import ReplayStrategy
        from tests.helpers.lit_hazards import differing, state

        (tmp_path / "plain").mkdir(), (tmp_path / "replay").mkdir()
        steps = range(LATE.stop - 4, LATE.stop)  # after the engine's measured steps (5, 6)
        plain, _, ref = _lit_run(tmp_path / "plain", "auto", steps, LATE.stop)
        # every block replays (no ties between plans of equal predicted peak, which measured
        # time would break differently from run to run, with real peaks 18.8-20.3 MiB)
        pinned = ReplayStrategy(budget="min", preservation="whole")
        model, t, mine = _lit_run(tmp_path / "replay", pinned, steps, LATE.stop)
        e = t.strategy.engine
        _LIT.update(
            differing=differing(state(plain), state(model)),
            plain=max(ref.peaks),
            real=max(mine.peaks),
            predicted=e.window_stats()["predicted_peak_bytes"],
            measured=e.last_real_peak,
        )
    return _LIT


@pytest.mark.xfail(
    strict=False,
    reason="predicted 21.07 MiB, real 19.06 MiB (1.105) in two runs at ee93c37; at 2b83bb0 "
    "the same plan's real peak varied 18.8-21.6 MiB from run to run under Lightning",
)
def test_lightning_min_plan_with_adam_is_exact_and_predicts_its_real_peak(tmp_path) -> None:
    """``Trainer(strategy=ReplayStrategy(budget="min", preservation="whole"))`` with Adam
    (the strategy tracks its state; every stateless block replays): the weights equal plain ``Trainer()``'s, and the plan's predicted peak is within
    10 % of the real peak of its steps (the referee: a callback profiling from batch start to
    batch end, where Lightning's zero_grad, step, backward and optimizer step all run)."""
    f = _lit_figures(tmp_path)
    assert f["differing"] == []
    assert f["measured"] is not None and f["predicted"] is not None
    predicted, real = f["predicted"], f["real"]
    print(
        f"lightning adam: plain {_mib(f['plain'])} predicted {_mib(predicted)} "
        f"real {_mib(real)} ratio {predicted / real:.3f}"
    )
    assert abs(predicted - real) <= 0.10 * real, (
        f"predicted {_mib(predicted)}, real {_mib(real)} (plain {_mib(f['plain'])})"
    )


def test_lightning_budget_holds_on_every_step(tmp_path) -> None:
    """A budget halfway between the min plan's real peak and a plain step's, under
    ``ReplayStrategy``: the probe and calibration steps and the planned steps after the
    engine's own measurements are refereed; the steps the engine measures are judged by its
    own figures."""
    from lightning_replay import ReplayStrategy

    f = _lit_figures(tmp_path)
    budget = (f["real"] + f["plain"]) // 2

    def refereed(engine: Any, step: int) -> bool:
        first_plan = engine.steps_to_first_plan
        return (engine.plan is None and step < first_plan - 1) or step >= first_plan + SETTLE

    (tmp_path / "budget").mkdir()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, t, ref = _lit_run(
            tmp_path / "budget", ReplayStrategy(budget=budget), refereed, LATE.stop
        )
    by_engine = sorted(ref.by_engine.items())
    report = (
        f"lightning adam: budget {_mib(budget)}, refereed {[_mib(p) for p in ref.peaks]}, "
        f"engine-measured {[(s, _mib(b)) for s, b in by_engine]}"
    )
    print(report)
    assert len(ref.peaks) >= 4
    worst = max(ref.peaks + [b for _, b in by_engine])
    assert worst <= budget + SLACK or _named(seen, budget), f"silent overrun: {report}"
