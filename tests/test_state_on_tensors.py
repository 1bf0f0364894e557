"""State a replay must see as the forward did, that lives on tensors or comes from kernels.

Each model trains 5 steps plain and installed (auto, whole, regions, ``budget="min"``) and
must give bit-equal gradients every step, with segments that really replay:

* kernels that write an argument autograd saved before the write (``F.rrelu``'s noise):
  checkpoint's early stop ends the replay before the kernel writes it (plain
  ``torch.utils.checkpoint`` gets these gradients wrong);
* Python attributes on argument tensors and on the tensors the modules hold, changed after
  the forward;
* a ``.grad`` the forward reads, which backward sets or accumulates before the replay;
* stateless submodules rebuilt and hooks registered anew every step (they must not keep the
  segments in probing for good); a stateful submodule rebuilt each step stays exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr

D, B, STEPS = 8, 6, 5
MODES = {
    "auto": {"preservation": "auto"},
    "whole": {"preservation": "whole"},
    "regions": {"preservation": "regions"},
    "min": {"budget": "min"},
}


def _x(s: int) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(900 + s))


class Blocks(nn.Module):
    """``blocks`` then a head; ``before``/``after`` run in the root's forward."""

    def __init__(self, make, n: int = 2, before=None, after=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(make() for _ in range(n))
        self.head = nn.Linear(D, D)
        self.before, self.after, self.t = before, after, 0

    def forward(self, x):
        self.t += 1
        if self.before is not None:
            self.before(self, x)
        h = x
        for b in self.blocks:
            h = b(h)
        if self.after is not None:
            with torch.no_grad():
                self.after(self, h)
        return self.head(h)


# ------------------------------------------------------------------ kernels writing saved args
class RReLUModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(D, D), nn.RReLU(0.05, 0.4), nn.Linear(D, D)

    def forward(self, x):
        return x + self.b(self.act(self.a(x)))  # the noise is saved mid-block


class RReLULast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        return F.rrelu(self.a(x), 0.1, 0.3, training=True) * 2  # the noise saved last


# ------------------------------------------------------------------ attributes on tensors
class ScaleByInputAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        s = getattr(x, "scale", None)
        return torch.tanh(self.a(x * (s if s is not None else 1.0))) + x


def _tag_input(m, x):
    x.scale = 0.5 + 0.1 * m.t  # on the root's input, read by the first block


class TaggedInputNet(Blocks):
    """Both blocks' inputs carry ``scale``; after the forward the root deletes it from one
    and changes it on the other."""

    def forward(self, x):
        self.t += 1
        x = x.clone()
        x.scale = 0.5 + 0.1 * self.t
        h = self.blocks[0](x)
        h.scale = 2.0 - 0.1 * self.t
        out = self.blocks[1](h)
        del x.scale
        h.scale = 9.0
        return self.head(out)


class TempOnBuffer(nn.Module):
    """A temperature as a Python attribute of a buffer (``self.centre.temp``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.register_buffer("centre", torch.zeros(D))
        self.centre.temp = 1.0

    def forward(self, x):
        return x + torch.softmax(self.a(x) / self.centre.temp, -1) - self.centre


def _cool(m, h):
    for b in m.blocks:
        b.centre.temp = b.centre.temp * 0.7
        b.centre.mul_(0.5).add_(h.mean(0), alpha=0.5)


class GateOnWeight(nn.Module):
    """A flag attribute on a weight (``self.a.weight.use_gate``) that the root flips."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.g = nn.Linear(D, D), nn.Linear(D, D)
        self.a.weight.use_gate = False

    def forward(self, x):
        h = self.a(x)
        if self.a.weight.use_gate:
            h = h * torch.sigmoid(self.g(x))
        return x + torch.tanh(h)


def _flip_gate(m, h):
    for b in m.blocks:
        b.a.weight.use_gate = not b.a.weight.use_gate


# ------------------------------------------------------------------ .grad read in the forward
class ReadsHeadGrad(nn.Module):
    """Scales by the head weight's gradient norm when one exists: under accumulation the
    second micro-batch's forward reads the first's gradient, and its backward accumulates
    into that same tensor, in place, before this segment replays."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.owner: list = []

    def forward(self, x):
        g = self.owner[0].head.weight.grad if self.owner else None
        k = 1.0 if g is None else 1.0 / (1.0 + g.norm())
        return x + torch.tanh(self.a(x)) * k


def _reads_head_grad():
    net = Blocks(ReadsHeadGrad)
    for b in net.blocks:
        b.owner.append(net)
    return net


# ------------------------------------------------------------------ rebuilt each step
class WithAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act = nn.Linear(D, D), nn.Sequential(nn.GELU(), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.act(self.a(x))


def _rebuild_act(m, x):
    for b in m.blocks:
        b.act = nn.Sequential(nn.GELU(), nn.Dropout(0.05 * (m.t % 3)))


def _pre_hook_each_step(m, x):
    for h in getattr(m, "_handles", []):
        h.remove()
    m._handles = [
        b.register_forward_pre_hook(lambda mod, args: None, with_kwargs=False) for b in m.blocks
    ]


def _rebuild_stateful(m, x):
    torch.manual_seed(77 + m.t)
    for b in m.blocks:
        b.act = nn.Linear(D, D)  # new parameters each step (not trained: not in the optimizer)


# ------------------------------------------------------------------ kernel switches
class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(1, 4, 3, padding=1)
        self.c2 = nn.Conv1d(4, 1, 3, padding=1)

    def forward(self, x):
        return x + self.c2(torch.tanh(self.c1(x.unsqueeze(1)))).squeeze(1)


class SwitchedNet(Blocks):
    """The blocks run inside a kernel-selection context the backward runs outside of."""

    def __init__(self, make, context) -> None:
        super().__init__(make)
        self.context = context

    def forward(self, x):
        with self.context():
            h = x
            for b in self.blocks:
                h = b(h)
        return self.head(h)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, x.shape[0], 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + a.transpose(1, 2).reshape(x.shape)


def _mkldnn_off():
    return torch.backends.mkldnn.flags(enabled=False)


def _sdpa_math():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _loss(model, x) -> None:
    (model(x) ** 2).mean().backward()


def _accumulate(model, x) -> None:
    for part in x.chunk(2):
        (model(part) ** 2).mean().backward()


CASES = {
    "rrelu_module_mid_block": (lambda: Blocks(RReLUModule), _loss),
    "rrelu_saved_last": (lambda: Blocks(RReLULast), _loss),
    "attribute_on_inputs_deleted_and_changed_after": (
        lambda: TaggedInputNet(ScaleByInputAttr),
        _loss,
    ),
    "attribute_on_root_input_changed_before_backward": (
        lambda: Blocks(ScaleByInputAttr, n=1, before=_tag_input),
        _loss,
    ),
    "attribute_on_a_buffer_annealed_after": (lambda: Blocks(TempOnBuffer, after=_cool), _loss),
    "flag_attribute_on_a_weight_flipped_after": (
        lambda: Blocks(GateOnWeight, after=_flip_gate),
        _loss,
    ),
    "head_grad_read_under_accumulation": (_reads_head_grad, _accumulate),
    "convs_under_mkldnn_off": (lambda: SwitchedNet(ConvBlock, _mkldnn_off), _loss),
    "causal_attention_under_sdpa_math": (lambda: SwitchedNet(SelfAttention, _sdpa_math), _loss),
    "stateless_submodule_rebuilt_each_step": (
        lambda: Blocks(WithAct, before=_rebuild_act),
        _loss,
    ),
    "pre_hook_registered_each_step": (lambda: Blocks(WithAct, before=_pre_hook_each_step), _loss),
}


def _train(model, step_fn, steps: int = STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for s in range(steps):
        torch.manual_seed(100 + s)
        opt.zero_grad(set_to_none=True)
        step_fn(model, _x(s))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def _build(name):
    torch.manual_seed(0)
    return CASES[name][0]()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_exact_and_replays(name, mode):
    make_step = CASES[name][1]
    ref = _train(_build(name), make_step)
    model = _build(name)
    engine = lr.install(model, "blocks.*", **MODES[mode])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _train(model, make_step)
        replays = sum(v.get("replays", 0) for v in engine.summary().values() if isinstance(v, dict))
    finally:
        engine.uninstall()
    bad = [
        f"step {s + 1}: {k}"
        for s, (a, b) in enumerate(zip(ref, got))
        for k in a
        if k not in b or not torch.equal(a[k], b[k])
    ]
    assert not bad, f"{name} [{mode}]: {len(bad)} gradients differ: {bad[:6]}"
    assert replays > 0, f"{name} [{mode}]: no segment replayed"


def test_a_stateful_submodule_rebuilt_each_step_stays_exact_and_is_named():
    """A new submodule with parameters each step is new state: re-probed (retained) at every
    forward, exact; after 8 in a row each segment is named in one warning and one record."""
    steps = 10
    ref = _train(_build_stateful(), _loss, steps)
    model = _build_stateful()
    engine = lr.install(model, "blocks.*")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _train(model, _loss, steps)
        records = [r for r in engine.records.read() if "re-probed at every forward" in r.detail]
    finally:
        engine.uninstall()
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    named = [str(w.message) for w in caught if "in a row" in str(w.message)]
    assert len(named) == 2, named
    assert all("'blocks." in m and "act" in m for m in named), named
    assert sorted(r.segment for r in records) == ["blocks.0", "blocks.1"]


def _build_stateful():
    torch.manual_seed(0)
    return Blocks(WithAct, before=_rebuild_stateful)


@pytest.mark.parametrize(
    "name",
    [
        "rrelu_saved_last",
        "attribute_on_inputs_deleted_and_changed_after",
        "attribute_on_a_buffer_annealed_after",
        "head_grad_read_under_accumulation",
    ],
)
def test_derivative_checks_see_what_the_forward_saw(name):
    """Every step after the probe derivative-checked: the check's own replay sees the forward's
    attributes and gradients too, so every grad record is a match (no false divergence)."""
    step_fn = CASES[name][1]
    ref = _train(_build(name), step_fn)
    model = _build(name)
    engine = lr.install(model, "blocks.*")
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        got = []
        for s in range(STEPS):
            if s:
                engine.request_check()
            torch.manual_seed(100 + s)
            opt.zero_grad(set_to_none=True)
            step_fn(model, _x(s))
            got.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
        checks = [r for r in engine.records.read() if r.check == "grad"]
    finally:
        engine.uninstall()
    for a, b in zip(ref, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert checks, f"{name}: no derivative check ran"
    bad = [(r.step, r.segment, r.detail[:300]) for r in checks if r.outcome != "match"]
    assert not bad, bad
