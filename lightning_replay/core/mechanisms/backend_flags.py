"""Backend switches a forward ran under, re-entered by its replay.

Torch's checkpoint re-enters the forward's autocast for a recomputation, but not the process's
backend switches: the scaled-dot-product-attention backends (``sdpa_kernel``), the oneDNN
(mkldnn), cuDNN and NNPACK flags, TF32 and reduced-precision matmul settings, deterministic
algorithms. A step written ``with sdpa_kernel(SDPBackend.MATH): loss = model(x)`` then
``loss.backward()`` outside it replays its segments under the default switches: another kernel,
other saved tensors (a replay error) or other last bits (silently wrong gradients). Each
forward's switches are read (a few C getters) and a replay runs under them.

>>> import torch

from lightning_replay._compat import TorchDispatchMode, dispatch_modes_on
>>> before = capture()
>>> with torch.backends.mkldnn.flags(enabled=False):
...     inside = capture()
>>> with entered(inside):
...     torch._C._get_mkldnn_enabled()
False
>>> torch._C._get_mkldnn_enabled() == dict(zip(NAMES, before))["mkldnn"]
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_replay._compat import TorchDispatchMode, dispatch_modes_on

_C = torch._C


def _pair(get: str, set_: str) -> tuple[Callable[[], Any], Callable[[Any], Any]] | None:
    g, s = getattr(_C, get, None), getattr(_C, set_, None)
    if g is None or s is None:
        return None
    try:
        g()
    except Exception:  # a getter this build cannot answer (no such backend)
        return None
    return g, s


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _set_deterministic(v: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


_SWITCHES: dict[str, tuple[str, str]] = {
    # name: (getter, setter) in torch._C; those a build lacks are left out
    "sdp_flash": ("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    "sdp_mem_efficient": ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    "sdp_math": ("_get_math_sdp_enabled", "_set_sdp_use_math"),
    "sdp_cudnn": ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    "sdp_overrideable": ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
    "sdp_priority": ("_get_sdp_priority_order", "_set_sdp_priority_order"),
    "sdp_math_reduction": (
        "_get_math_sdp_allow_fp16_bf16_reduction",
        "_set_math_sdp_allow_fp16_bf16_reduction",
    ),
    "mkldnn": ("_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    "mkldnn_deterministic": ("_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    "nnpack": ("_get_nnpack_enabled", "_set_nnpack_enabled"),
    "cudnn": ("_get_cudnn_enabled", "_set_cudnn_enabled"),
    "cudnn_benchmark": ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    "cudnn_deterministic": ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    "cudnn_tf32": ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
    "cublas_tf32": ("_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    "float32_matmul_precision": ("_get_float32_matmul_precision", "_set_float32_matmul_precision"),
    "cpu_fp16_reduction": (
        "_get_cpu_allow_fp16_reduced_precision_reduction",
        "_set_cpu_allow_fp16_reduced_precision_reduction",
    ),
}

_GETTERS: list[Callable[[], Any]] = []
_SETTERS: list[Callable[[Any], Any]] = []
NAMES: list[str] = []
for _name, (_get, _set) in _SWITCHES.items():
    _found = _pair(_get, _set)
    if _found is not None:
        NAMES.append(_name)
        _GETTERS.append(_found[0])
        _SETTERS.append(_found[1])
NAMES.append("deterministic_algorithms")
_GETTERS.append(_deterministic)
_SETTERS.append(_set_deterministic)


def capture() -> tuple:
    """The switches now, in :data:`NAMES`' order."""
    return tuple(g() for g in _GETTERS)


@contextlib.contextmanager
def entered(switches: tuple | None) -> Iterator[None]:
    """Run under ``switches`` (from :func:`capture`; None: as they are), and put back those it
    changed. Setting only what differs keeps the common case (nothing switched) to the getters."""
    changed: list[tuple[int, Any]] = []
    try:
        if switches:
            for i, want in enumerate(switches):
                now = _GETTERS[i]()
                if now != want:
                    _SETTERS[i](want)
                    changed.append((i, now))
        yield
    finally:
        for i, was in reversed(changed):
            _SETTERS[i](was)


class _SamePath(TorchDispatchMode):
    """Runs every op as it is: its presence alone makes ATen's composite ops take the path
    they took under the forward's modes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def dispatching_as(at_forward: bool) -> Iterator[None]:
    """Around a replay whose forward ran under a Python dispatch mode (the capture of logged
    writes, a calibration step's sampled capture, a selective forward's cache): a pass-through
    mode where none is on now. ATen's composite ops branch on whether any is on (``ctc_loss``
    with tensor lengths saved two tensors more under one): the replay took another path than
    its forward, a false "took another path" error in backward, or a false divergence."""
    if at_forward and not dispatch_modes_on():
        with _SamePath():
            yield
    else:
        yield
