"""Gradients a segment's forward reads: ``.grad`` is state the replay must see as it was.

A forward may read a tensor's ``.grad`` (an adaptive block steered by a parameter's last
gradient, a ``None`` check after ``zero_grad``). Backward sets or accumulates that gradient
before the segment replays, so a replay that reads it live takes another branch or another
value. No dispatch mode sees the read (it is no aten op); a ``TorchFunctionMode`` does
(``Tensor.grad.__get__``). A probe watches its forward with :class:`GradReads`; each later
forward takes :func:`capture_grads` of the tensors read, and the replay runs inside
:func:`forward_grads`, which puts the forward's gradients (or their absence) in place and the
live ones back after it.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> with GradReads() as reads:
    ...     _ = p.grad is None
    >>> [t is p for t in reads.tensors()]
    [True]
    >>> held = capture_grads(reads.tensors())  # at a forward: no gradient yet
    >>> p.grad = torch.full((2,), 3.0)  # backward sets it
    >>> with forward_grads(held):
    ...     p.grad is None
    True
    >>> p.grad.tolist()
    [3.0, 3.0]
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_GRAD = torch._C.TensorBase.__dict__["grad"]


class GradReads(TorchFunctionMode):
    """Records the tensors whose ``.grad`` a forward reads (each once, in order), with the
    gradient as first read (``None``, or a copy): what a replay of that forward must see."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__self__", None) is _GRAD and args:
            t = args[0]
            if isinstance(t, torch.Tensor) and t.is_leaf and id(t) not in self.read:
                g = out.detach().clone() if isinstance(out, torch.Tensor) else None
                self.read[id(t)] = (t, g)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for t, _ in self.read.values()]

    def held(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return list(self.read.values())


def capture_grads(tensors: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each live tensor of ``tensors`` (tensors or weak references to them) with its gradient
    now: ``None``, or a copy (backward accumulates into the live one in place)."""
    out = []
    for t in tensors:
        if isinstance(t, weakref.ref):
            t = t()
        if t is None:
            continue
        g = t.grad
        out.append((t, None if g is None else g.detach().clone()))
    return out


@contextlib.contextmanager
def forward_grads(held: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Iterator[None]:
    """While it is open, each tensor of ``held`` has the gradient it had at the forward; the
    live gradients come back when it closes (the replay's reads only: backward accumulates
    into the live ones after)."""
    live = []
    try:
        for t, g in held:
            live.append((t, t.grad))
            t.grad = g
        yield
    finally:
        for t, g in reversed(live):
            t.grad = g
