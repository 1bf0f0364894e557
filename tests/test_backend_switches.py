"""Backend switches made around the forward only (issue 33; the s14 adversary's F6).

``with sdpa_kernel(SDPBackend.MATH): loss = model(x)`` then ``loss.backward()`` outside it, or
the same with ``torch.backends.mkldnn.flags(enabled=False)``: plain PyTorch differentiates the
forward's kernels; a replay in backward ran under the default switches (the CPU flash kernel: a
replay error; oneDNN convolutions: gradients off in the last bits, silently). Every replay now
runs under the forward's switches (``core/mechanisms/backend_flags.py``): the segments'
replays, the replayed probe under a byte budget, and the derivative check's replay. Reference:
plain PyTorch, bit for bit, gradients every step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_replay.core.mechanisms import backend_flags
from tests.test_exactness import assert_exact

D = 8  # tests.test_exactness feeds (B, D) inputs


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 2, 3, D // 2).unbind(2)
        h = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return x + self.out(h.transpose(0, 1).reshape(x.shape))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv1d(1, 1, 3, padding=1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.c(x.unsqueeze(1)))).squeeze(1)


class Switched(nn.Module):
    """Blocks run under ``switch()`` in the root's forward; backward runs outside it."""

    def __init__(self, block: type, switch) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(3)])
        self.switch = switch

    def forward(self, x):
        with self.switch():
            for b in self.blocks:
                x = b(x)
        return x


SWITCHES = {
    "sdpa_math": (Attn, lambda: sdpa_kernel([SDPBackend.MATH])),
    "sdpa_math_priority": (
        Attn,
        lambda: sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True),
    ),
    "mkldnn_off": (Conv, lambda: torch.backends.mkldnn.flags(enabled=False)),
    "mkldnn_off_attention": (Attn, lambda: torch.backends.mkldnn.flags(enabled=False)),
}
SEGS = [f"blocks.{i}" for i in range(3)]


@pytest.mark.parametrize("budget", [None, "min"], ids=["no_budget", "min"])
@pytest.mark.parametrize("preservation", ["whole", "regions"])
@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_a_switch_around_the_forward_only_is_the_replays_switch(name, preservation, budget):
    block, switch = SWITCHES[name]
    kw = {} if budget is None else {"budget": budget}
    summary, records = assert_exact(
        lambda: Switched(block, switch), SEGS, preservation, steps=6, checks=(3, 4), **kw
    )
    bad = [(r.segment, r.check, r.outcome) for r in records if r.outcome not in ("match",)]
    assert [b for b in bad if b[2] in ("divergence", "rejection")] == [], bad
    checked = [r for r in records if r.check == "grad"]
    assert checked and all(r.outcome == "match" for r in checked), checked


def test_the_switches_are_put_back_after_a_replay():
    before = backend_flags.capture()
    model = Switched(Conv, lambda: torch.backends.mkldnn.flags(enabled=False))
    import lightning_replay as lr

    engine = lr.install(model, SEGS, preservation="whole")
    try:
        for _ in range(4):
            model(torch.randn(4, D)).pow(2).mean().backward()
            assert backend_flags.capture() == before
    finally:
        engine.uninstall()
    assert sum(s["replays"] for s in engine.summary().values()) >= 3


def test_entered_puts_back_only_what_it_set():
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        off = backend_flags.capture()
    on = backend_flags.capture()
    assert off != on
    with backend_flags.entered(off):
        assert not torch._C._get_mkldnn_enabled()
    assert backend_flags.capture() == on
    with pytest.raises(RuntimeError), backend_flags.entered(off):
        raise RuntimeError("a replay that fails")
    assert backend_flags.capture() == on
