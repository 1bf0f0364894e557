"""Backward kernels that are not bitwise reproducible, as GPU atomics are not (issue 32).

Their noise is drawn from ``os.urandom``: a source outside the model and every generator a
replay restores, so no replay, and no second run, reproduces it.

* :func:`ulp_noise` moves each element by up to a few units in the last place;
* :func:`ulp_step` moves each element by exactly one, up or down;
* :func:`noisy_linear` makes ``x @ w.T`` as an autograd Function whose input and/or weight
  gradient passes through such a noise.

Example:
    >>> NoisyWeight = noisy_linear("NoisyWeight", "weight gradient moved", weight=ulp_noise)
    >>> x, w = torch.ones(2, 3, requires_grad=True), torch.ones(4, 3, requires_grad=True)
    >>> NoisyWeight.apply(x, w).sum().backward()
    >>> bool(((w.grad - 2).abs() <= 2 * torch.finfo(torch.float32).eps).all())
    True
"""

from __future__ import annotations

import os
from typing import Callable

import torch

Noise = Callable[[torch.Tensor], torch.Tensor]


def ulp_noise(t: torch.Tensor, ulps: int = 1) -> torch.Tensor:
    """``t`` with each element moved by up to ``ulps`` units in the last place, at random (for
    each ulp: up, down or not, from one ``os.urandom`` byte per element)."""
    r = torch.frombuffer(bytearray(os.urandom(t.numel())), dtype=torch.uint8).reshape(t.shape)
    out = t
    for k in range(ulps):
        up = torch.nextafter(out, torch.full_like(out, float("inf")))
        down = torch.nextafter(out, torch.full_like(out, float("-inf")))
        pick = (r >> (2 * k)) % 3
        out = torch.where(pick == 0, up, torch.where(pick == 1, down, out))
    return out


def ulp_step(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each element moved by exactly one unit in the last place, up or down at
    random: never equal to ``t``."""
    r = torch.frombuffer(bytearray(os.urandom(t.numel())), dtype=torch.uint8)
    step = torch.where(r.view(t.shape) % 2 == 0, float("inf"), float("-inf"))
    return torch.nextafter(t, step.to(t.dtype))


def noisy_linear(
    name: str, doc: str, weight: Noise | None = None, input: Noise | None = None
) -> type[torch.autograd.Function]:
    """An autograd Function ``name`` computing ``x @ w.T``, saving ``x`` and ``w``; its backward
    computes ``g @ w`` and ``g.T @ x`` and returns them through ``input`` and ``weight`` (each
    left exact where None)."""

    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, gw = g @ w, g.t() @ x
        return (gx if input is None else input(gx)), (gw if weight is None else weight(gw))

    attrs = {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), attrs)
