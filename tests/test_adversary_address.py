"""Adversarial models: storage that is freed, resized, rebound or reallocated while the engine
still names it by its address.

The engine names state by ``storage_key`` = (device, data pointer). Any set or dict keyed by it
that lives across a point where a storage can be freed, resized, swapped (``.data =``,
``set_``, ``resize_``) or reallocated can name the wrong bytes, or give new bytes at a reused
address the old identity (CI's false ``(0, 'probe', 'divergence')`` under FSDP2's
reshard-after-forward, fixed in ``tests/test_regathered_parameters.py``). Each model here moves
storage between a segment's forward and its backward, or between steps, the way real training
code does: FSDP2's free and regather of gathered parameters, a queue grown with ``resize_``, a
buffer rebound (``self.buf = new``), ``p.data = new``, ``buf.set_(other)``, an optimizer that
puts a parameter on new storage every step, a new buffer landing where a dropped activation was.

Referee: plain PyTorch with the same seeds, bit for bit (every step's gradients and the final
state), and no record other than ``match`` (no false divergence, no false rejection), with
checks requested on every step. Under every engine setting: no budget (``auto``, ``whole``,
``regions``), ``budget="min"``, a budget every plan meets (the replayed probe) and a budget
halfway between the lowest plan's peak and retaining every block.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import lightning_replay as lr
from tests.helpers.compare import diff_state, grad_diffs, snapshot_state

D, B, H = 8, 256, 64
HUGE = 1 << 40
STEPS = 7


# --------------------------------------------------------------------------- blocks
class Block(nn.Module):
    """``x + out(tanh(lin(x + q)))``, ``H`` wide inside (its activations outweigh what a
    recomputed call keeps, so the lowest plan recomputes): ``lin`` saves ``x + q``, so a replay
    that reads another ``q`` differentiates another activation; ``q`` itself is never saved
    for backward (an add), so plain PyTorch lets the root move or rewrite it after the
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, H)
        self.out = nn.Linear(H, D)
        self.register_buffer("q", torch.randn(2, D))

    def forward(self, x):
        return x + self.out(torch.tanh(self.lin(x + self.q.mean(0))))


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, D)

    def after_block(self, i: int, blk: Block, y: torch.Tensor) -> None:
        """What the model does to block ``i``'s state after its forward, before backward."""

    def forward(self, x):
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            self.after_block(i, blk, x)
        return self.head(x)


SEGS = ("blocks.0", "blocks.1", "blocks.2")


# --------------------------------------------------------------------------- FSDP2-like
class _Regather:
    """FSDP2's reshard after forward on CPU: the block's parameters' storages are freed after
    its forward and refilled before its backward, elsewhere (a blocker of the same size takes
    the freed address first). With ``steal``: the blocker is the block's own new buffer, so a
    state tensor of the model now lives at the parameter's old address."""

    def __init__(self, blk: Block, steal: bool = False) -> None:
        self.blk, self.steal = blk, steal
        self.keep: list[torch.Tensor] = []

    def after_forward(self, mod, args, out):
        self.keep = []
        for p in (self.blk.lin.weight, self.blk.lin.bias):
            self.keep.append(p.detach().clone())
            p.untyped_storage().resize_(0)
        out.register_hook(self.before_backward)
        return out

    def before_backward(self, g):
        blockers = []
        for p, keep in zip((self.blk.lin.weight, self.blk.lin.bias), self.keep):
            st = p.untyped_storage()
            if st.nbytes() == 0:
                blockers.append(torch.empty_like(keep))  # lands where p was
                st.resize_(keep.numel() * keep.element_size())
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                    p.copy_(keep)
        if self.steal:  # the blockers stay: one as a buffer the block reads next step
            with torch.no_grad():
                blockers[0].copy_(self.blk.q.repeat(blockers[0].shape[0] // 2, 1))
            self.blk.q = blockers[0][:2]
        self.keep = []
        return g


def regather(steal: bool = False) -> Callable[[], nn.Module]:
    def make():
        m = Stack()
        for blk in m.blocks:
            blk.register_forward_hook(_Regather(blk, steal).after_forward)
        return m

    return make


# --------------------------------------------------------------------------- resize_
class QueueGrowsInWindow(Stack):
    """MoCo-style queue grown with ``resize_`` after each block's forward (the storage is
    reallocated; the old one freed), new rows written. The replay must read the old queue."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n = blk.q.shape[0]
            blk.q.resize_(n + 1, D)
            blk.q[n].copy_(y.detach().mean(0))


class QueueGrowsBetweenSteps(Stack):
    """The same queue grown after the optimizer step (outside the window)."""

    def grow(self):
        with torch.no_grad():
            for blk in self.blocks:
                n = blk.q.shape[0]
                blk.q.resize_(n + 1, D)
                blk.q[n].copy_(blk.out.bias.detach())


class QueueShrinksInWindow(Stack):
    """A queue cut back with ``resize_`` (storage kept, fewer rows visible) then refilled."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n = blk.q.shape[0]
            if n > 2:
                blk.q.resize_(n - 1, D)
            else:
                blk.q.resize_(n + 2, D)
                blk.q[n:].copy_(y.detach()[:2])


class QueueWrittenThenGrown(Stack):
    """A logged write (``mul_``) to the queue, then ``resize_`` moves it: the log's entries
    name the old address, whose bytes are gone."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            blk.q.mul_(0.5)
            n = blk.q.shape[0]
            blk.q.resize_(n + 1, D)
            blk.q[n].copy_(y.detach().mean(0))


class QueueGrownThenWritten(Stack):
    """``resize_`` first, then in-place writes to the new storage (an address nothing armed
    at the forward)."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n = blk.q.shape[0]
            blk.q.resize_(n + 1, D)
            blk.q[n].copy_(y.detach().mean(0))
            blk.q.mul_(0.5)


class TwoQueues(Block):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.randn(32, D)  # 1 KiB: a size the allocator hands out again
        self.register_buffer("r", torch.randn(2, D))

    def forward(self, x):
        return x + self.out(torch.tanh(self.lin(x + self.q.mean(0) * self.r.mean(0))))


LANDED = [0]  # how often the rebound buffer landed at the queue's old address


class GrowThenRebindIntoOldAddress(Stack):
    """The queue grows (its old bytes freed), then the block's second buffer is rebound to a
    tensor of the queue's old size, which the allocator may place at the queue's old address,
    and written in place there."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TwoQueues() for _ in range(3))

    def after_block(self, i, blk, y):
        with torch.no_grad():
            n, old = blk.q.shape[0], blk.q.data_ptr()
            blk.q.resize_(n + 1, D)
            blk.q[n].copy_(y.detach().mean(0))
            # the allocator's choice made certain where it can be: the first of a few fresh
            # tensors of the old size that lands at the queue's old address
            pool = [torch.empty(n, D) for _ in range(16)]
            fresh = next((a for a in pool if a.data_ptr() == old), pool[0])
            LANDED[0] += fresh.data_ptr() == old
            blk.r = fresh.copy_(blk.r.mean(0).expand(n, D))
            blk.r.mul_(0.9)


# --------------------------------------------------------------------------- rebinding
class RebindInWindow(Stack):
    """``blk.q = new`` after the forward; the old tensor is dropped (nothing in plain PyTorch
    saved it), so its address is free for the next allocation."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            blk.q = blk.q * 0.5 + y.detach()[:2]
            blk.q = blk.q + 1.0  # the first new one is freed: its address is reused


class DataRebindInWindow(Stack):
    """``q.data = new`` after the forward (the tensor object stays, its storage changes)."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            blk.q.data = blk.q.data * 0.5 + y.detach()[:2]


class SetInWindow(Stack):
    """``q.set_(other)`` after the forward: the buffer now reads another storage."""

    def after_block(self, i, blk, y):
        with torch.no_grad():
            blk.q.set_((blk.q * 0.5 + y.detach()[:2]).contiguous())


class ParamDataCloneInWindow(Stack):
    """``w.data = w.data.clone()`` after the forward (a dtype or layout round trip): same
    values, new storage, the old one freed for the activations that follow."""

    def after_block(self, i, blk, y):
        blk.lin.weight.data = blk.lin.weight.data.clone()


class ReadsS(Block):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(B, D))

    def forward(self, x):
        return x + self.out(torch.tanh(self.lin(x + self.q.mean(0) + self.s)))


class NewBufferEachStep(Stack):
    """After its forward each block gets a fresh buffer (``register_buffer`` again, same size
    as an activation) that it reads in the next step: it lands where a dropped activation or
    the previous buffer was."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReadsS() for _ in range(3))

    def after_block(self, i, blk, y):
        blk.register_buffer("s", y.detach() * 0.25)


# --------------------------------------------------------------------------- optimizers
class RebindingSGD(torch.optim.Optimizer):
    """SGD that puts every parameter on new storage each step (``p.data = p - lr * g``): the
    old storage is freed, and the next step's activations may land where a weight was."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = p.data - group["lr"] * p.grad
        return None


class SwappingLookahead(torch.optim.Optimizer):
    """Lookahead that keeps the slow weights as optimizer state and, every other step, swaps
    the parameter's storage with them (``p.data, slow = slow, p.data``): the address that was a
    weight becomes optimizer state and back."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.add_(p.grad, alpha=-group["lr"])
                st = self.state[p]
                if "slow" not in st:
                    st["slow"] = p.detach().clone()
                if self.t % 2 == 0:
                    slow = st["slow"]
                    slow.add_(p - slow, alpha=0.5)
                    st["slow"], p.data = p.data, slow.clone()
        return None


# --------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    model: Callable[[], nn.Module]
    opt: Callable = functools.partial(torch.optim.SGD, lr=0.05)
    between: Callable | None = None  # after the optimizer step


CASES = {
    "fsdp_regather": Case(regather()),
    "fsdp_regather_buffer_at_old_address": Case(regather(steal=True)),
    "queue_resize_grows_in_window": Case(QueueGrowsInWindow),
    "queue_resize_grows_between_steps": Case(QueueGrowsBetweenSteps, between=lambda m: m.grow()),
    "queue_resize_shrinks_in_window": Case(QueueShrinksInWindow),
    "queue_written_then_grown_in_window": Case(QueueWrittenThenGrown),
    "queue_grown_then_written_in_window": Case(QueueGrownThenWritten),
    "queue_grown_then_buffer_at_its_address": Case(GrowThenRebindIntoOldAddress),
    "buffer_rebound_in_window": Case(RebindInWindow),
    "buffer_data_rebound_in_window": Case(DataRebindInWindow),
    "buffer_set_in_window": Case(SetInWindow),
    "weight_data_clone_in_window": Case(ParamDataCloneInWindow),
    "new_buffer_each_step": Case(NewBufferEachStep),
    "optimizer_rebinds_params": Case(Stack, opt=RebindingSGD),
    "optimizer_swaps_param_storage": Case(Stack, opt=SwappingLookahead),
}

SETTINGS = {
    "auto": {},
    "whole": {"preservation": "whole"},
    "regions": {"preservation": "regions"},
    "min": {"budget": "min", "calibration_steps": 1},
    "huge": {"budget": HUGE, "calibration_steps": 1},
    # halfway between the lowest plan's accounted peak (135,488 bytes) and retaining every
    # block (256,448), measured on ``Stack`` at these sizes. In the accountant's terms: a real
    # peak counts every tensor the process holds, the other tests' included
    "half": {"budget": 196_000, "calibration_steps": 1, "real_peak": False},
}


def _x(step: int) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1000 + step))


def _train(case: Case, setting: dict | None, checked: bool = True):
    torch.manual_seed(0)
    model = case.model()
    eng = None
    if setting is not None:
        eng = lr.install(model, list(SEGS), on_violation="record", **setting)
    opt = case.opt(model.parameters())
    grads, error = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # divergences are read from records
        try:
            for step in range(STEPS):
                torch.manual_seed(100 + step)
                if eng is not None and checked:
                    eng.request_check()
                opt.zero_grad(set_to_none=True)
                (model(_x(step)) ** 2).mean().backward()
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
                opt.step()
                if case.between is not None:
                    case.between(model)
        except Exception as e:  # noqa: BLE001 (the test classifies it)
            error = e
    records = eng.records.read() if eng is not None else []
    summary = eng.summary() if eng is not None else {}
    if eng is not None and error is None:
        eng.uninstall()
    return grads, snapshot_state(model), records, error, summary


@functools.lru_cache(maxsize=None)
def _plain(name: str):
    grads, state, _, error, _ = _train(CASES[name], None)
    assert error is None, f"plain PyTorch fails on {name}: {error!r}"
    return grads, state


def _problems(name: str, setting: str, checked: bool = True) -> list[str]:
    grads, state = _plain(name)
    g, s, records, error, summary = _train(CASES[name], SETTINGS[setting], checked)
    out = []
    if error is not None:
        out.append(f"{type(error).__name__}: {str(error)[:300]}")
    bad = [
        (r.step, r.segment, r.check, r.outcome, r.detail[:160])
        for r in records
        if r.outcome != "match" and not (r.check == "guard" and "re-probe" in r.detail)
    ]
    # A storage that moved (``resize_``, ``.data =``, ``set_``) is a precondition that changed:
    # the designed answer is one re-probe of the segment (guards.py), then replays again
    guards = [r.segment for r in records if r.check == "guard"]
    if len(guards) > len(set(guards)):
        bad.append(("guard re-probes more than once per segment", sorted(guards)))
    if bad:
        out.append(f"non-match records: {bad[:4]} ({len(bad)} in all)")
    diffs = grad_diffs(grads, g)
    if diffs:
        out.append(f"gradients differ at {len(diffs)} (step, parameter): {diffs[:4]}")
    if error is None and diff_state(state, s):
        out.append(f"state differs: {diff_state(state, s)[:4]}")
    if error is None and not sum(v.get("replays", 0) for v in summary.values()):
        out.append(f"no segment replayed: { {k: v['status'] for k, v in summary.items()} }")
    return out


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_moved_storage_trains_as_plain(name, setting, checked):
    """Checked: a derivative and byte check every step (a wrong replay is a record, and the
    step trains on the forward's graph). Unchecked: what a user trains, the replays' own
    gradients (before the fix, a queue grown or cut by ``resize_`` after a block's forward
    was read new by the replayed probe under a budget: every gradient of 7 steps wrong, one
    probe divergence record; and a buffer rebound into a grown queue's old address took the
    queue's name in the contract: every gradient from step 3 wrong, no record at all)."""
    problems = _problems(name, setting, checked)
    assert not problems, "; ".join(problems)
