"""Adversary, session 20: models built to break the ``"flops"`` selective policy.

Under ``selective="flops"`` a replayed segment keeps, of its candidate ops (products,
attention, convolutions), only those whose flops per output byte reach the segment's density
(its forward's flops over ``A(s)``); the segment's first frame keeps every candidate and prunes
at the forward's end, later frames decide as each op runs with the previous frame's density.
The flops of a call are memoized by op and argument shapes (``_FLOPS_SEEN``, global).

Classes here (tiny models, widths 8-64):

1. density that moves between steps: sequence length or batch changing per step (attention's
   score product scales with S^2, the projections with S: an op on the boundary is kept one
   step and recomputed the next; a spy on ``SelectiveFrame.settle`` checks it really flips),
   one block called at two resolutions per step, a block called 1-3 times per step;
2. kept set decided at op time against pruned after the forward: data-dependent branches,
   ``relu_`` on a product, ``.data`` writes into a kept product stashed for another segment;
3. state next to eager attention: batch norm between products, a MoCo queue, dropout from a
   private ``torch.Generator``, a counter buffer, a Python flag, ``random``/numpy draws, an EMA
   buffer written in the forward;
4. flop formulas at their edges: ``baddbmm``/``addmm`` with beta and alpha, grouped, strided,
   transposed, 1-d and 3-d convolutions, ``scaled_dot_product_attention`` with masks, causal,
   dropout, ``einsum``, matmul of 1-d/3-d/4-d operands, strided/expanded operands, empty
   batches, bf16 and float64, a product returned as a view;
5. every step checked (``request_check(grad=True, bytes=True)``), and the planner under
   ``budget=2**60`` and ``budget="min"`` with ``selective="flops"``;
6. a second backward through a retained graph, ``no_grad`` forwards, ``eval()`` switches, a
   segment with no products, one whose ``A(s)`` is 0, two engines with different policies
   alive at once (the memo is global), two models trained in two threads.

Referee: plain PyTorch from the same seed, inputs and per-step seeds: every step's gradients
and the final state (parameters, buffers, tensor attributes, generators) bit for bit, no
``ReplayError``, no divergence record on checked steps, no violation.

Found here, fixed in ``selective.py``: the memo (``_FLOPS_SEEN``) keyed a variable-length
flash/efficient attention call by its arguments' shapes, but torch's formula reads the
cumulative sequence offsets' values (the sum of squared lengths): lengths 8+8 after 8+4+4
(same shapes, same longest) got the first pack's 6144 flops instead of 8192; the offsets are now
part of the key. And under ``torch.compile(dynamic=True)`` the policy (torch's own selective
checkpoint with ``torch_sac_context_fn("flops", d)``) hashed symbolic sizes for the key:
``TypeError: unhashable type: non-nested SymInt`` (``"matmul"`` compiled); such a call now has
no flops (kept, as an op with no formula).

Found here, fixed in ``runtime.py`` (``settle_frame``): the density divided today's flops by
``A(s)`` measured at the probe's inputs, never rescaled: a batch 8x the probe's gave a density
8x the true one (71 against 8.9 flops per byte), a sequence 16x the probe's 30x (273 against
8.5), and every candidate of the segment was recomputed; a segment re-probed at larger inputs
took the other segments' old figures for new ones (256 against 16). ``A(s)`` is now scaled
with the step's input elements over those it was measured at (the contract's: recorded when it
is made), as the planner scales it; the ``S^2`` part of attention leaves it within 2x.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from lightning_replay.contract import SELECTIVE
from lightning_replay.selective import SelectiveFrame, op_flops

STEPS = 5
D = 16


# ============================================================ harness
def _state(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: v.detach().clone() for k, v in model.state_dict(keep_vars=False).items()
    }
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, torch.Generator):
                out[f"{name}.{k}(generator)"] = v.get_state()
            elif isinstance(v, torch.Tensor) and f"{name}.{k}" not in out:
                out[f"{name}.{k}(attr)"] = v.detach().clone()
            elif isinstance(v, (int, float, bool)) and not k.startswith("_"):
                out[f"{name}.{k}(py)"] = torch.tensor(float(v))
        for k, v in mod._buffers.items():
            if v is not None:
                out.setdefault(f"{name}.{k}" if name else k, v.detach().clone())
    return out


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    return sum(_loss(o) for o in out if isinstance(o, torch.Tensor))


@dataclass
class Case:
    build: Callable[[], nn.Module]
    x: Callable[[int], Any]  # step -> input
    segments: Any = "blocks.*"
    step: Callable | None = None  # (model, x, step) -> loss; default _loss(model(x))
    steps: int = STEPS
    settings: tuple = ("pinned", "checked", "budget", "min")
    dtype: torch.dtype | None = None
    extra: dict = field(default_factory=dict)
    true_divergence: bool = False  # a write no version sees: checks must find it


SETTINGS = {
    "pinned": {"preservation": "selective", "selective": "flops"},
    "checked": {"preservation": "selective", "selective": "flops"},
    "budget": {"budget": 2**60, "selective": "flops", "real_peak": False},
    "min": {"budget": "min", "selective": "flops", "real_peak": False},
    "matmul": {"preservation": "selective", "selective": "matmul"},
}


def _seed(s: int) -> None:
    torch.manual_seed(100 + s)
    random.seed(s)
    np.random.seed(s)


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = case.build()
    return model if case.dtype is None else model.to(case.dtype)


def _train(model: nn.Module, case: Case, steps: int, engine=None, check: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    grads = []
    for s in range(steps):
        _seed(s)
        if check and engine is not None and s >= 1:
            engine.request_check(grad=True, bytes=True)
        opt.zero_grad(set_to_none=True)
        x = case.x(s)
        loss = case.step(model, x, s) if case.step is not None else _loss(model(x))
        if loss is not None:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads, _state(model)


def _diff(ga, gb, sa, sb) -> list[str]:
    bad = []
    for s, (a, b) in enumerate(zip(ga, gb)):
        if a.keys() != b.keys():
            bad.append(f"step {s}: gradient names {sorted(set(a) ^ set(b))}")
            continue
        bad += [f"step {s}: grad {k}" for k in a if not torch.equal(a[k], b[k])]
    if sa.keys() != sb.keys():
        bad.append(f"state names {sorted(set(sa) ^ set(sb))}")
    bad += [f"state {k}" for k in sa if k in sb and not torch.equal(sa[k], sb[k])]
    return bad


_PLAIN: dict = {}


def _plain(name: str, case: Case, steps: int):
    if (name, steps) not in _PLAIN:
        g, st = _train(_build(case), case, steps)
        for s, gs in enumerate(g):  # the referee itself must stay finite (NaN != NaN)
            assert all(t.isfinite().all() for t in gs.values()), (name, s)
        _PLAIN[name, steps] = g, st
    return _PLAIN[name, steps]


def _records(engine) -> list[tuple]:
    return [
        (r.step, r.segment, r.check, r.outcome, json.loads(r.detail) if r.detail else {})
        for r in engine.records
    ]


def _run(name: str, case: Case, setting: str):
    model = _build(case)
    engine = lr.install(model, case.segments, **SETTINGS[setting], **case.extra)
    steps = case.steps
    if setting in ("budget", "min"):
        steps += engine.steps_to_first_plan
    g_ref, s_ref = _plain(name, case, steps)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads, state = _train(model, case, steps, engine, check=setting == "checked")
        summary = engine.summary()
        records = _records(engine)
        runtimes = dict(engine.runtimes)
    finally:
        engine.uninstall()
    bad = _diff(g_ref, grads, s_ref, state)
    assert not bad, f"{name}/{setting}: {bad[:8]}"
    div = [r for r in records if r[3] == "divergence"]
    assert not div or case.true_divergence, f"{name}/{setting}: divergences {div[:4]}"
    viol = {k: v["violations"] for k, v in summary.items() if v.get("violations")}
    assert not viol, f"{name}/{setting}: violations {viol} {records[:4]}"
    budget = [str(w.message) for w in caught if "budget" in str(w.message)]
    assert not budget, f"{name}/{setting}: {budget[:2]}"
    return summary, records, runtimes, engine


def _selective_replays(summary) -> int:
    return sum(s.get("replays", 0) for s in summary.values() if s.get("mode") in SELECTIVE)


# ============================================================ models
class EagerAttention(nn.Module):
    """Attention written out (``q @ k^T``, softmax, ``@ v``), any batch and length."""

    def __init__(self, d: int = D, heads: int = 2, norm: bool = False, mlp: int = 2):
        super().__init__()
        self.d, self.h = d, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)
        self.norm = nn.BatchNorm1d(d) if norm else None

    def attend(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        q, k, v = (t.reshape(b, s, self.h, self.d // self.h).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (self.d // self.h) ** 0.5
        att = torch.softmax(scores, dim=-1) @ v
        return att.transpose(1, 2).reshape(b, s, self.d)

    def forward(self, x):
        x = x + self.out(self.attend(x))
        if self.norm is not None:
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _seq(b: int, s: int, d: int = D, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, s, d, generator=torch.Generator().manual_seed(1000 + seed))


LENS = [4, 48, 8, 32, 64, 6, 40]
BATCHES = [1, 6, 2, 4, 3, 8, 2]


# ---- class 1: density that moves
class SharedTwoRes(nn.Module):
    """One attention block applied at full and half length in the same step."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([EagerAttention()])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        a = self.blocks[0](x)
        half = F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)
        b = self.blocks[0](half)
        return self.head(a).mean(1) + self.head(b).mean(1)


class VarCalls(nn.Module):
    """A block called 1, 2 or 3 times per step (the step number in a Python counter)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([EagerAttention(), EagerAttention()])
        self.t = 0

    def forward(self, x):
        for _ in range(self.t % 3 + 1):
            x = self.blocks[0](x)
        self.t += 1
        return self.blocks[1](x)


# ---- class 2: kept set at op time against pruned, writes into products
class Branchy(nn.Module):
    """Data-dependent: the sign of the input's mean picks attention or a conv/MLP path."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.fc = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x):
        if x.mean() > 0:
            return self.att(x)
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(F.gelu(self.fc(h)))


class ReluInplace(nn.Module):
    """``relu_`` on a linear's output (a kept product written in place), then attention."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.att = EagerAttention()

    def forward(self, x):
        h = torch.relu_(self.fc(x))
        return self.att(h) + h


class Stasher(nn.Module):
    """Keeps its first product on the module (read by the next block); the root scales every
    stash through ``.data`` after the blocks (no version bump). Plain autograd never saves the
    product itself (``tanh`` saves its output): only a replay that kept it would read the
    scaled bytes; checked steps must see that (a true divergence) and train exactly."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.fc = nn.Linear(D, D)
        self.stash = None

    def forward(self, x, prev=None):
        h = self.fc(x)
        self.stash = h
        h = torch.tanh(h)
        if prev is not None:
            h = h + torch.tanh(prev)
        return self.att(h)


class StashNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Stasher(), Stasher()])

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x, self.blocks[0].stash)
        for b in self.blocks:
            b.stash.data.mul_(2.0)
        return x


class WriteProductAfter(nn.Module):
    """Returns a raw product (``bmm`` scores) that the root writes in place after the block."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        s = torch.bmm(h, x.transpose(1, 2))
        return s, h


class WriteProductNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([WriteProductAfter()])
        self.out = nn.Linear(D, D)

    def forward(self, x):
        s, h = self.blocks[0](x)
        with torch.no_grad():
            s.mul_(0.5)  # nothing saved s: plain autograd allows it
        return self.out(torch.softmax(s, -1) @ h)


# ---- class 3: state next to eager attention
class BNBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.bn = nn.BatchNorm1d(2 * D)
        self.att = EagerAttention(norm=True)

    def forward(self, x):
        h = self.fc1(x)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.att(x + self.fc2(h))


class Queue(nn.Module):
    """MoCo: a queue of keys read inside (scores against it), enqueued after the read."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.key = nn.Linear(D, D)
        self.register_buffer("queue", torch.randn(12, D))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.att(x)
        k = self.key(h)
        logits = k @ self.queue.clone().t()  # mm against the queue as it is now
        with torch.no_grad():
            new = k.detach().mean(1)
            i = int(self.ptr)
            for j in range(new.shape[0]):
                self.queue[(i + j) % 12] = new[j]
            self.ptr.fill_((i + new.shape[0]) % 12)
        return h + logits @ self.queue[:, :D] * 0.01


class PrivateDropout(nn.Module):
    """Dropout mask from a private generator between products; SDPA with dropout too."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)
        self.fc = nn.Linear(D, D)
        self.att = EagerAttention()

    def forward(self, x):
        h = self.fc(x)
        mask = (torch.rand(h.shape, generator=self.gen) > 0.3).to(h.dtype)
        h = h * mask / 0.7
        q = h.reshape(h.shape[0], h.shape[1], 2, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
        return self.att(h + a.transpose(1, 2).reshape(h.shape))


class Counter(nn.Module):
    """A counter buffer bumped in the forward scales the scores; a Python flag flips a path."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.fc = nn.Linear(D, D)
        self.register_buffer("n", torch.zeros(()))
        self.flag = False

    def forward(self, x):
        self.n += 1
        self.flag = not self.flag
        h = self.fc(x) * (1.0 + 0.1 * self.n)
        if self.flag:
            h = h @ self.fc.weight.t()
        return self.att(h)


class HostRandom(nn.Module):
    """``random`` and numpy draws steer a scale and a head count."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        s = random.random()
        k = int(np.random.randint(1, 3))
        h = self.fc(x) * s
        for _ in range(k):
            h = self.att(h)
        return h


class EMA(nn.Module):
    """An EMA of the projection's weight updated in the forward, used as a second product."""

    def __init__(self):
        super().__init__()
        self.att = EagerAttention()
        self.fc = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D, D))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.fc.weight, alpha=0.1)
        h = self.fc(x) + F.linear(x, self.ema)
        return self.att(h)


# ---- class 4: formula edges
class AddmmBeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
        self.b = nn.Parameter(torch.randn(D) * 0.1)
        self.w2 = nn.Parameter(torch.randn(D, 2 * D) * 0.2)

    def forward(self, x):  # x: (B, S, D)
        b, s, _ = x.shape
        flat = x.reshape(b * s, D)
        h = torch.addmm(self.b, flat, self.w, beta=0.5, alpha=2.0)
        h = torch.tanh(h)
        h3 = h.reshape(b, s, D)
        sc = torch.baddbmm(torch.zeros(b, s, s), h3, h3.transpose(1, 2), beta=0.0, alpha=0.25)
        sc = torch.baddbmm(sc, h3, x.transpose(1, 2), beta=0.5, alpha=1.5)
        out = torch.softmax(sc, -1) @ h3
        return out + (h3 @ self.w2)[..., :D]


class Convs(nn.Module):
    """Grouped strided conv2d, transposed conv2d, conv1d, conv3d: shapes change per step."""

    def __init__(self):
        super().__init__()
        self.c2 = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
        self.t2 = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
        self.c1 = nn.Conv1d(4, 4, 5, padding=2, dilation=1)
        self.c3 = nn.Conv3d(1, 2, 3, padding=1, stride=(1, 2, 2))

    def forward(self, x):  # (B, 4, H, W)
        h = self.t2(F.gelu(self.c2(x)))
        b, c, hh, ww = h.shape
        h1 = self.c1(h.reshape(b, c, hh * ww)).reshape(b, c, hh, ww)
        h3 = self.c3(h1.unsqueeze(1)).mean(1)
        return x + h1 + F.interpolate(h3, size=(hh, ww))


class SDPAVariants(nn.Module):
    """Fused attention with no mask, a boolean mask, a float mask, causal, and a per-step
    choice among them (a Python attribute)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)
        self.t = 0

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, 2, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        kind = self.t % 4
        self.t += 1
        if kind == 0:
            a = F.scaled_dot_product_attention(q, k, v)
        elif kind == 1:
            m = torch.ones(s, s, dtype=torch.bool).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        elif kind == 2:
            m = torch.randn(b, 1, s, s) * 0.1
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return x + self.o(a.transpose(1, 2).reshape(b, s, D))


class EinsumMatmuls(nn.Module):
    """einsum, 1-d @ 2-d, 3-d @ 2-d, 4-d @ 4-d, a non-contiguous operand and an expanded one."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
        self.v = nn.Parameter(torch.randn(D) * 0.2)

    def forward(self, x):  # (B, S, D)
        b, s, _ = x.shape
        h = torch.einsum("bsd,de->bse", x, self.w)
        h = torch.tanh(h)
        sc = torch.einsum("bsd,btd->bst", h, x)
        g = self.v @ self.w  # 1-d @ 2-d
        h4 = h.reshape(b, s, 2, D // 2).permute(0, 2, 1, 3)
        a4 = h4 @ h4.transpose(-1, -2)  # 4-d @ 4-d
        wt = self.w.t()[:, : D // 2]  # a strided operand
        nc = x.transpose(0, 1) @ wt  # non-contiguous input
        ex = torch.bmm(h, self.w.expand(b, D, D))  # expanded weight
        out = torch.softmax(sc, -1) @ h + ex * g
        return out + a4.mean((1, 3)).unsqueeze(-1) + nc.transpose(0, 1).repeat(1, 1, 2)


class ViewOut(nn.Module):
    """A product returned as a view of itself (transposed, sliced), and its split outputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)

    def forward(self, x):
        h = self.fc(x)
        a, b = h.split(D, -1)
        sc = torch.bmm(a, b.transpose(1, 2))
        return sc.transpose(1, 2)[:, :, :], a


class ViewOutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ViewOut()])
        self.o = nn.Linear(D, D)

    def forward(self, x):
        sc, a = self.blocks[0](x)
        return self.o(torch.softmax(sc, -1) @ a)


# ---- class 6
class NoProducts(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return torch.tanh(h * self.scale) + x


class FrozenProduct(nn.Module):
    """A product with a frozen weight on an input: nothing in the segment is an activation the
    backward saves beyond its input (``A(s)`` about 0)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.2, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.w) + x


class FrozenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.ModuleList([FrozenProduct(), EagerAttention()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](self.pre(x)))


class EvalSwitch(nn.Module):
    """BN attention blocks put in eval mode every third step (and back)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([EagerAttention(norm=True), EagerAttention(norm=True)])
        self.t = 0

    def forward(self, x):
        self.blocks.train(self.t % 3 != 2)
        self.t += 1
        for b in self.blocks:
            x = b(x)
        return x


def _nograd_step(model, x, s):
    with torch.no_grad():  # a no_grad forward of the segments first (validation)
        model(x[:1])
    return _loss(model(x))


def _double_backward_step(model, x, s):
    loss = _loss(model(x))
    loss.backward(retain_graph=True)
    return loss * 0.5


def _seq_step(b, lens=None):
    lens = lens or LENS
    return lambda s: _seq(b, lens[s % len(lens)], seed=s)


def _batch_step(s: int) -> torch.Tensor:
    return _seq(BATCHES[s % len(BATCHES)], 16, seed=s)


def _empty_batch(s: int) -> torch.Tensor:
    return _seq(0 if s in (2, 4) else 3, 8, seed=s)


def _img(s: int) -> torch.Tensor:
    h = [8, 12, 6, 10, 8, 4, 16][s % 7]
    return torch.randn(2, 4, h, h + 2, generator=torch.Generator().manual_seed(s))


CASES: dict[str, Case] = {
    # class 1
    "seq_len": Case(lambda: Net(EagerAttention), _seq_step(2)),
    "seq_len_mlp8": Case(lambda: Net(lambda: EagerAttention(mlp=8, heads=4)), _seq_step(2)),
    "batch": Case(lambda: Net(EagerAttention), _batch_step),
    "two_res": Case(SharedTwoRes, _seq_step(2, [8, 32, 16, 64, 8, 24, 40])),
    "var_calls": Case(VarCalls, _seq_step(2, [8, 24, 8, 32, 16, 8, 24])),
    # class 2
    "branchy": Case(lambda: Net(Branchy), lambda s: _seq(2, 8 + 4 * s, seed=s) - (s % 2)),
    "relu_inplace": Case(lambda: Net(ReluInplace), _seq_step(2)),
    "stash_data": Case(StashNet, _seq_step(2), settings=("checked",), true_divergence=True),
    "write_product": Case(WriteProductNet, _seq_step(2)),
    # class 3
    "bn_between": Case(lambda: Net(BNBetween), _seq_step(3)),
    "queue": Case(lambda: Net(Queue), _seq_step(2)),
    "private_dropout": Case(lambda: Net(PrivateDropout), _seq_step(2)),
    "counter_flag": Case(lambda: Net(Counter), _seq_step(2)),
    "host_random": Case(lambda: Net(HostRandom), _seq_step(2)),
    "ema": Case(lambda: Net(EMA), _seq_step(2)),
    # class 4
    "addmm_beta": Case(lambda: Net(AddmmBeta), _seq_step(2)),
    "convs": Case(lambda: Net(Convs), _img),
    "sdpa": Case(lambda: Net(SDPAVariants), _seq_step(2)),
    "einsum": Case(lambda: Net(EinsumMatmuls), _seq_step(2)),
    "empty_batch": Case(
        lambda: Net(EagerAttention), _empty_batch, settings=("pinned", "checked", "budget")
    ),
    "bf16": Case(
        lambda: Net(EagerAttention), lambda s: _seq_step(2)(s).bfloat16(), dtype=torch.bfloat16
    ),
    "float64": Case(
        lambda: Net(EagerAttention), lambda s: _seq_step(2)(s).double(), dtype=torch.float64
    ),
    "view_out": Case(ViewOutNet, _seq_step(2)),
    # class 6
    "no_products": Case(lambda: Net(NoProducts), _seq_step(2)),
    "frozen": Case(FrozenNet, _seq_step(2)),
    "eval_switch": Case(EvalSwitch, _seq_step(2)),
    "no_grad_fwd": Case(lambda: Net(EagerAttention), _seq_step(2), step=_nograd_step),
    "retain_graph": Case(lambda: Net(EagerAttention), _seq_step(2), step=_double_backward_step),
}

XFAIL: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(
    ("name", "setting"),
    [
        pytest.param(
            n,
            s,
            id=f"{n}-{s}",
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL[n, s])] if (n, s) in XFAIL else [],
        )
        for n, c in CASES.items()
        for s in c.settings
    ],
)
def test_flops_exact_against_plain_pytorch(name, setting):
    case = CASES[name]
    summary, records, _, _ = _run(name, case, setting)
    if setting in ("pinned", "checked"):
        assert all(s["mode"] in SELECTIVE for s in summary.values()), summary
        if name not in ("no_products",):
            assert _selective_replays(summary) > 0 or setting == "checked", summary
    if setting == "checked":
        assert sum(s["checks"] for s in summary.values()) > 0, summary


# ============================================================ the density and the memo
def _densities(name: str, steps: int = 6) -> list[tuple[tuple, float]]:
    """(input shape, density) of each selective forward of ``blocks.0``, pinned to flops."""
    case = CASES[name]
    model = _build(case)
    engine = lr.install(model, case.segments, preservation="selective", selective="flops")
    out = []
    try:
        for s in range(steps):
            x = case.x(s)
            _loss(model(x)).backward()
            d = engine.runtimes["blocks.0"].sac_density
            if d is not None:
                out.append((tuple(x.shape), d))
    finally:
        engine.uninstall()
    return out


def test_the_density_follows_the_steps_inputs():
    """A(s) is measured once (the probe's inputs), the frame's flops at every step: the
    density must not scale with the input. Measured before the fix: a batch 8x the probe's
    gave a density 8x the true one (71 against 8.9 flops per byte), a sequence 16x the
    probe's 30x (273 against 8.5): every product of the segment was recomputed."""
    batch = [d for _, d in _densities("batch")]
    assert len(batch) >= 4 and max(batch) == pytest.approx(min(batch), rel=1e-6), batch
    seq = _densities("seq_len")  # A(s) has an S^2 part (the softmax): within 2x
    ds = [d for _, d in seq]
    assert len(ds) >= 4 and max(ds) / min(ds) < 2.0, seq


def test_the_kept_set_flips_with_the_sequence(monkeypatch):
    """The value product (``softmax @ v``: ``S/2`` flops per byte at 4 bytes) is on the
    boundary: kept at long sequences, recomputed at short ones, decided at op time with the
    previous step's density; the referee run above trains this model exactly."""
    kept: list[list[tuple]] = []  # per frame: the 3-d (batched) products it kept
    orig = SelectiveFrame.settle

    def spy(self, act):
        d = orig(self, act)
        kept.append([tuple(t.shape) for t in self.kept_tensors() if t.dim() == 3])
        return d

    monkeypatch.setattr(SelectiveFrame, "settle", spy)
    _densities("seq_len")
    assert any(kept) and not all(kept), kept  # (before the density fix: none ever kept)


def test_the_memo_reads_varlen_offsets():
    """A variable-length flash attention call: torch's formula reads the offsets' values.
    Measured before the fix: lengths 8+8 after 8+4+4 (same shapes, same longest) were given
    the first pack's 6144 flops instead of 8192."""
    op = torch.ops.aten._flash_attention_forward.default
    formula = torch.utils.flop_counter.flop_registry[op._overloadpacket]
    q = torch.randn(16, 2, 8)
    for cu in ([0, 8, 12, 16], [0, 8, 16, 16], [0, 4, 8, 16], [0, 8, 12, 16]):
        c = torch.tensor(cu, dtype=torch.int32)
        args = (q, q, q, c, c, 8, 8, 0.0, False, False)
        assert op_flops(op, args, {}, (q,)) == formula(*args, out_val=(q,)), cu


def test_the_flops_policy_under_compile_with_dynamic_shapes():
    """torch's own selective checkpoint with the flops policy (``torch_sac_context_fn``, as
    benchmarks/frontier.py uses it) inside ``torch.compile(dynamic=True)``: the policy sees
    symbolic sizes. Measured before the fix: ``TypeError: unhashable type: non-nested SymInt``
    from the memo's key (BackendCompilerFailed); ``"matmul"`` compiled. Such calls are kept."""
    from torch.utils.checkpoint import checkpoint

    from lightning_replay.selective import checkpoint_kwargs, torch_sac_context_fn

    torch.manual_seed(0)
    blk = EagerAttention()
    ref = copy.deepcopy(blk)
    ctx = torch_sac_context_fn("flops", 5.0)

    def f(x):
        return checkpoint(blk, x, use_reentrant=False, context_fn=ctx, **checkpoint_kwargs())

    cf = torch.compile(f, backend="aot_eager", dynamic=True)
    torch._dynamo.reset()
    try:
        for s in (8, 12):
            x = _seq(2, s, seed=s)
            cf(x).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
        for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)  # compiled: not bit for bit
    finally:
        torch._dynamo.reset()


# ============================================================ engines side by side
def test_engines_with_different_policies_interleaved():
    """Three engines alive at once, steps interleaved: flops and matmul on the same block
    class (the same op shapes: the global memo serves both), flops at other shapes."""
    cases = [
        ("seq_len", SETTINGS["pinned"]),
        ("seq_len", SETTINGS["matmul"]),
        ("batch", SETTINGS["pinned"]),
    ]
    runs = []
    for name, kw in cases:
        model = _build(CASES[name])
        engine = lr.install(model, "blocks.*", **kw)
        runs.append((name, model, engine, torch.optim.SGD(model.parameters(), lr=0.01), []))
    try:
        for s in range(STEPS):
            for name, model, _, opt, grads in runs:
                opt.zero_grad(set_to_none=True)
                _loss(model(CASES[name].x(s))).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
    finally:
        for _, _, engine, _, _ in runs:
            engine.uninstall()
    for name, model, engine, _, grads in runs:
        ref = _build(CASES[name])
        opt = torch.optim.SGD(ref.parameters(), lr=0.01)
        for s in range(STEPS):
            opt.zero_grad(set_to_none=True)
            _loss(ref(CASES[name].x(s))).backward()
            for n, p in ref.named_parameters():
                assert torch.equal(p.grad, grads[s][n]), (name, s, n)
            opt.step()
        assert _selective_replays(engine.summary()) > 0


@pytest.mark.parametrize("policy", ["flops", "matmul"])
def test_two_models_trained_in_two_threads(policy):
    """Two models, one engine each, trained in two threads at once (the memo is global):
    exact, no error. Not asserted: that both replay. ``segments_running()`` is process-wide,
    so a segment called while the other thread's segment runs takes itself for a nested one
    and runs plain (measured: 1 of 4 replays, or none and a "run only without autograd"
    warning; the same under ``"matmul"``): timing-dependent, exact, memory not saved."""
    results: dict = {}
    errors: list = []
    names = ("seq_len", "batch")
    models = [_build(CASES[n]) for n in names]  # built here: the global seed is shared

    def work(i: int) -> None:
        try:
            name, model = names[i], models[i]
            engine = lr.install(model, "blocks.*", preservation="selective", selective=policy)
            grads = []
            for s in range(STEPS):
                model.zero_grad(set_to_none=True)
                _loss(model(CASES[name].x(s))).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            results[name] = grads, engine.summary()
            engine.uninstall()
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, (grads, summary) in results.items():
        ref = _build(CASES[name])
        for s in range(STEPS):
            ref.zero_grad(set_to_none=True)
            _loss(ref(CASES[name].x(s))).backward()
            for n, p in ref.named_parameters():
                assert torch.equal(p.grad, grads[s][n]), (name, s, n)
        assert all(v["violations"] == 0 for v in summary.values()), summary
