"""Adversary, session 15: host-device synchronizations of a steady unchecked step (issue 31) on
forwards that themselves read device values, and on loops nobody listed.

The referee is plain PyTorch on the same model, loop and batches, counted by the same counter
(``benchmarks/sync_counter.py``), with the engine's accelerator branches run on CPU
(:func:`tests.test_host_syncs.accelerator_paths`). The count must equal plain training's (where a
replayed segment reads device values itself, torch checkpoint's: see :data:`READS_AGAIN`), and it
must not be zero where the forward reads device values (the counter sees them). Where a segment's
own forward reads device values (``nonzero``, a boolean mask, ``.item()``, ``unique``), any
recomputation runs them again: torch checkpoint on the same blocks is counted too, and the engine
must never ask for more than torch checkpoint does.

Models: ``nonzero`` row gathering, boolean-mask indexing, ``masked_select``, ``unique`` and
``.item()`` steering a branch inside a segment; ``.item()`` clamping and a boolean mask in the
root's own forward outside every segment; loops: a batch size that changes every step,
train/eval switching with a no-grad validation batch between steps, bf16 autocast, SGD with
momentum.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from tests.test_host_syncs import accelerator_paths

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
from sync_counter import SyncCounter  # noqa: E402

sys.path.pop(0)

W, N = 32, 64


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class NonzeroBlk(Blk):
    """Gathers the rows whose first feature is positive (``nonzero``) and scatters them back."""

    def forward(self, x):
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        y = super().forward(x)
        return y.index_add(0, rows, y.index_select(0, rows) * 0.5)


class MaskBlk(Blk):
    """Boolean-mask indexing: the positive entries' mean, added back."""

    def forward(self, x):
        y = super().forward(x)
        return y + y[y > 0].mean()


class MaskedSelectBlk(Blk):
    def forward(self, x):
        y = super().forward(x)
        return y + torch.masked_select(y, y.abs() > 0.5).sum() * 1e-3


class UniqueBlk(Blk):
    """How many distinct rounded values the input has scales the output."""

    def forward(self, x):
        k = torch.unique((x * 2).round()).numel()
        return super().forward(x) * (1.0 + 1.0 / k)


class ItemBranchBlk(Blk):
    """``.item()`` steers a branch inside the segment."""

    def forward(self, x):
        y = super().forward(x)
        if y.abs().max().item() > 3.0:
            y = y.clamp(-3.0, 3.0)
        return y


class Net(nn.Module):
    def __init__(self, blocks, root_reads: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(W, 1)
        self.root_reads = root_reads

    def forward(self, x):
        h = x
        for i, b in enumerate(self.blocks):
            h = b(h)
            if self.root_reads and i == 1:  # the root's own host reads, between segments
                if h.abs().max().item() > 2.0:
                    h = h / 2
                h = h + h[h < 0].sum() * 1e-3
        return self.head(h)


def _x(step: int, sizes=(N,)) -> torch.Tensor:
    n = sizes[step % len(sizes)]
    return torch.randn(n, W, generator=torch.Generator().manual_seed(step))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _step(model, opt, x, autocast: bool = False):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _validate(model, step):
    model.eval()
    with torch.no_grad():
        model(_x(1000 + step))
    model.train()


#: name -> (blocks builder, root_reads, loop options)
MODELS: dict[str, tuple] = {
    "nonzero_in_a_segment": (lambda: [Blk(), NonzeroBlk(), Blk()], False, {}),
    "bool_mask_in_a_segment": (lambda: [Blk(), MaskBlk(), Blk()], False, {}),
    "masked_select_in_a_segment": (lambda: [MaskedSelectBlk(), Blk(), Blk()], False, {}),
    "unique_in_a_segment": (lambda: [Blk(), Blk(), UniqueBlk()], False, {}),
    "item_branch_in_a_segment": (lambda: [ItemBranchBlk(), Blk(), Blk()], False, {}),
    "item_and_mask_in_the_root": (lambda: [Blk(), Blk(), Blk()], True, {}),
    "batch_size_changes_every_step": (
        lambda: [Blk(), Blk(), Blk()],
        True,
        {"sizes": (N, N // 2, 2 * N)},
    ),
    "validation_between_steps": (lambda: [Blk(), MaskBlk(), Blk()], True, {"validate": True}),
    "autocast_bf16": (lambda: [Blk(), NonzeroBlk(), Blk()], True, {"autocast": True}),
    "sgd_momentum": (lambda: [Blk(), Blk(), ItemBranchBlk()], True, {"opt": _sgd}),
}
NAMES = ["blocks.0", "blocks.1", "blocks.2"]
STEPS = 12  # the last is counted (after the probe, and under a budget calibration and plan)


def _count(name: str, arm: str, budget=None) -> tuple[int, dict, int]:
    """Train ``STEPS`` steps under ``arm`` (plain, checkpoint or replay); count the last.
    Returns the count, its kinds and (replay) whether a plan ran before it."""
    blocks, root_reads, opts = MODELS[name]
    torch.manual_seed(0)
    model = Net(blocks(), root_reads)
    opt = opts.get("opt", _adamw)(model)
    engine = None
    if arm == "checkpoint":
        for n in NAMES:
            m = model.get_submodule(n)
            m.forward = functools.partial(
                lambda f, *a: checkpoint(f, *a, use_reentrant=False), m.forward
            )
    with warnings.catch_warnings(), accelerator_paths():
        warnings.simplefilter("ignore")
        if arm == "replay":
            engine = lr.install(model, NAMES, budget=budget, calibration_steps=1)
        for s in range(STEPS):
            x = _x(s, opts.get("sizes", (N,)))
            last = s == STEPS - 1
            with SyncCounter() if last else contextlib.nullcontext() as c:
                _step(model, opt, x, opts.get("autocast", False))
            if opts.get("validate") and not last:
                _validate(model, s)
        planned = engine is not None and engine.plan is not None
        if engine is not None:
            engine.uninstall()
    return c.count, dict(c.by_kind), planned


@functools.cache
def _plain(name: str) -> tuple[int, dict, int]:
    return _count(name, "plain")


@functools.cache
def _ckpt(name: str) -> tuple[int, dict, int]:
    return _count(name, "checkpoint")


#: (name, budget): a replayed segment's own forward reads device values (nonzero, unique, a
#: branch on .item()), and its replay reads them again, as torch checkpoint's recomputation
#: does: measured 16 host reads under replay and checkpoint against 15 in plain training (19
#: against 18 under bf16 autocast). The engine adds none; the claim there is "equal to torch
#: checkpoint on the same blocks" (docs/memory.md, host-device synchronizations).
READS_AGAIN: set[tuple[str, str | None]] = {
    ("nonzero_in_a_segment", None),
    ("nonzero_in_a_segment", "min"),
    ("unique_in_a_segment", None),
    ("item_branch_in_a_segment", None),
    ("item_branch_in_a_segment", "min"),
    ("autocast_bf16", None),
    ("autocast_bf16", "min"),
}


@pytest.mark.parametrize(
    ("name", "budget"),
    [pytest.param(n, b, id=f"{n}-{b or 'none'}") for n in MODELS for b in (None, "min")],
)
def test_steady_step_syncs_as_plain_training(name, budget):
    plain, plain_kinds, _ = _plain(name)
    ckpt, ckpt_kinds, _ = _ckpt(name)
    replay, kinds, planned = _count(name, "replay", budget)
    assert plain > 0  # every model here reads device values: the counter sees them
    assert budget is None or planned
    msg = (
        f"{name}/{budget}: replay {replay} {kinds}, plain {plain} {plain_kinds}, torch "
        f"checkpoint {ckpt} {ckpt_kinds}"
    )
    assert replay <= ckpt, msg  # never more than a recomputation itself asks for
    if (name, budget) in READS_AGAIN:  # the replay's own reads: checkpoint's, one per read
        assert replay == ckpt > plain, msg
    else:
        assert replay == plain, msg
