"""A segment given model state as an argument, written in the window (issue 31).

A root that passes one of its buffers (or a view of it) to a segment, which writes it in place,
used to make the engine copy the whole argument at every call, whatever the segment's option:
the lowest plan held the whole buffer where the same buffer held as the segment's own state
keeps only the regions written. Now an argument on a storage the contract puts back in place
for the replay (whole, or the logged regions) is read live at the replay, and checkpoint keeps
an empty stand-in for it.

Every model here trains under the engine and in plain PyTorch from one seed, and the gradients
and buffers must be equal bit for bit at every step. The memory test reads the bytes the engine
holds between a steady forward and its backward.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr

W, N = 16, 64
ROWS = 4 * N
STEPS = 5


class Block(nn.Module):
    """Writes rows ``rows`` of its ``state`` argument (if given) with a moving average of its
    activations, through a slice (``index`` = None) or ``index_copy_`` at ``index``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)

    def forward(self, x, state=None, rows=slice(0, N)):
        h = self.b(torch.tanh(self.a(x)))
        if isinstance(state, Carrier):
            state = state.state
        if state is not None:
            view = state[rows]
            view.mul_(0.9).add_(h.detach(), alpha=0.1)
            h = h + view.mean() * 1e-3 + state.sum() * 1e-6
        return h


@dataclasses.dataclass
class Carrier:
    """An argument object holding the buffer (a batch-like dataclass)."""

    state: torch.Tensor


class Root(nn.Module):
    """Four blocks; the root holds a buffer and hands it (or a view) to block 1, per
    ``how``; after the blocks, the root may write the buffer too (``after``)."""

    def __init__(self, how: str, after: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(W, 1)
        self.register_buffer("state", torch.zeros(ROWS, W))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.how = how
        self.after = after

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i != 1:
                x = block(x)
            elif self.how == "whole":
                x = block(x, self.state)
            elif self.how == "view":  # a view of the rows [N, 3N): the block writes [N, 2N)
                x = block(x, self.state[N : 3 * N])
            elif self.how == "kwarg":
                x = block(x, state=self.state, rows=slice(2 * N, 3 * N))
            elif self.how == "object":  # inside an argument object
                x = block(x, Carrier(self.state))
            elif self.how == "twice":  # the same buffer to two blocks, each its own rows
                x = block(x, self.state)
        if self.how == "twice":
            x = self.blocks[3](x, self.state, rows=slice(3 * N, 4 * N))
        if self.after:  # the root enqueues after the segments (a queue written later)
            rows = (self.ptr + torch.arange(N)) % ROWS
            self.state.index_copy_(0, rows, x.detach()[:N].repeat(1, 1))
            self.ptr.add_(N).remainder_(ROWS)
        return self.head(x)


class BnBlock(Block):
    """Normalizes with running statistics it is given: batch norm writes them with no write
    annotation (an argument preserved whole)."""

    def forward(self, x, mean, var):
        h = self.b(torch.tanh(self.a(x)))
        return F.batch_norm(h, mean, var, training=True, momentum=0.1)


class BnArgs(nn.Module):
    """The root's running statistics handed to a segment that normalizes with them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), BnBlock(), Block()])
        self.head = nn.Linear(W, 1)
        self.register_buffer("mean", torch.zeros(W))
        self.register_buffer("var", torch.ones(W))

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x), self.mean, self.var)
        return self.head(self.blocks[2](x))


MODELS = {
    "whole": lambda: Root("whole"),
    "view": lambda: Root("view"),
    "kwarg": lambda: Root("kwarg"),
    "twice": lambda: Root("twice"),
    "written_after": lambda: Root("whole", after=True),
    "view_written_after": lambda: Root("view", after=True),
    "object": lambda: Root("object"),
    "batch_norm_stats": BnArgs,
}


def _train(make, names, engine_kw: dict | None, steps: int = STEPS, twice: bool = False):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = lr.install(model, names, **engine_kw) if engine_kw is not None else None
    grads, held = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            x = torch.randn(N, W, generator=torch.Generator().manual_seed(s))
            out = model(x)
            if engine is not None:
                held.append(engine.preserved_bytes)
            loss = out.pow(2).mean()
            if twice:  # a backward that keeps its graph, then another: two replays
                loss.backward(retain_graph=True)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    if engine is not None:
        engine.uninstall()
    return grads, bufs, held


def _names(model: str) -> list[str]:
    return [f"blocks.{i}" for i in range(3 if model == "batch_norm_stats" else 4)]


@pytest.mark.parametrize("engine_kw", ["min", "regions", "whole", "none"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_state_passed_as_argument_is_exact(model, engine_kw):
    names = _names(model)
    kw = {
        "min": {"budget": "min"},
        "regions": {"preservation": {"blocks.1": "regions"}},
        "whole": {"preservation": {"blocks.1": "whole"}},
        "none": {},
    }[engine_kw]
    want, want_bufs, _ = _train(MODELS[model], names, None)
    got, got_bufs, _ = _train(MODELS[model], names, kw)
    for s, (a, b) in enumerate(zip(want, got)):
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, f"{model}/{engine_kw}: step {s}: gradients of {bad} differ from plain"
    for k, v in want_bufs.items():
        assert torch.equal(v, got_bufs[k]), f"{model}/{engine_kw}: buffer {k} differs"


@pytest.mark.parametrize("model", ["whole", "view", "kwarg"])
def test_a_state_argument_preserved_by_regions_holds_the_regions_not_a_copy(model):
    """Between the forward and the backward of a steady step, a segment under ``regions``
    that writes ``N`` rows of the root's ``4 N``-row buffer (its argument) holds the rows
    written, not the argument: before, a whole copy of the argument too (16 KiB here; the
    rows are 4 KiB)."""
    _, _, held = _train(
        MODELS[model], _names(model), {"preservation": {"blocks.1": "regions"}}, steps=4
    )
    row_bytes = N * W * 4
    assert held[-1] <= row_bytes + 1024, (model, held)


@pytest.mark.parametrize("engine_kw", ["regions", "whole"])
@pytest.mark.parametrize("model", ["whole", "view", "batch_norm_stats"])
def test_two_backward_passes_replay_a_state_argument_twice(model, engine_kw):
    """The graph kept for a second backward: the live argument is put back for each replay."""
    names = _names(model)
    kw = {"preservation": {"blocks.1": engine_kw}}
    want, want_bufs, _ = _train(MODELS[model], names, None, steps=3, twice=True)
    got, got_bufs, _ = _train(MODELS[model], names, kw, steps=3, twice=True)
    for s, (a, b) in enumerate(zip(want, got)):
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, f"{model}/{engine_kw}: step {s}: gradients of {bad} differ from plain"
    for k, v in want_bufs.items():
        assert torch.equal(v, got_bufs[k]), f"{model}/{engine_kw}: buffer {k} differs"
