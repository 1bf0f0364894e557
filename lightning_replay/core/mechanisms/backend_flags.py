"""The backend switches a forward ran under, re-entered for its replay.

A forward may run inside a context that picks kernels: ``sdpa_kernel([SDPBackend.MATH])``,
``torch.backends.mkldnn.flags(enabled=False)``, ``torch.backends.cudnn.flags(...)``. Backward
runs outside it, and so would the replay: another kernel (CPU flash attention instead of the
math one saves other tensors, a ReplayError; mkldnn convolutions instead of the native ones
sum in another order, gradients wrong in their last bits, silently). Checkpoint re-enters the
forward's autocast itself, not these. :func:`backend_flags` reads them at a forward (a few C
calls); :func:`forward_backends` sets them for the replay and puts the live ones back.

Example:
    >>> import torch
    >>> flags = backend_flags()
    >>> with torch.backends.mkldnn.flags(enabled=not torch._C._get_mkldnn_enabled()):
    ...     with forward_backends(flags):
    ...         torch._C._get_mkldnn_enabled() == flags[0]
    True
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_PAIRS = (
    ("_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    ("_get_cudnn_enabled", "_set_cudnn_enabled"),
    ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    ("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    ("_get_math_sdp_enabled", "_set_sdp_use_math"),
    ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
)
#: (getter, setter) of each switch this torch has
_FLAGS = tuple(
    (getattr(torch._C, g), getattr(torch._C, s))
    for g, s in _PAIRS
    if hasattr(torch._C, g) and hasattr(torch._C, s)
)


def backend_flags() -> tuple:
    """The kernel-selection switches now (mkldnn, cuDNN, the SDPA backends)."""
    return tuple(g() for g, _ in _FLAGS)


@contextlib.contextmanager
def forward_backends(flags: tuple | None) -> Iterator[None]:
    """While it is open, the switches are as in ``flags`` (from :func:`backend_flags`); the
    live ones come back when it closes. Nothing is set where they already agree."""
    now = backend_flags()
    if flags is None or flags == now:
        yield
        return
    for (_, set_), v in zip(_FLAGS, flags):
        set_(v)
    try:
        yield
    finally:
        for (_, set_), v in zip(_FLAGS, now):
            set_(v)
