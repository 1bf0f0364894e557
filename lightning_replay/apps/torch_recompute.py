"""The state-unaware baselines: torch's own activation recomputation on the same segments.

* ``"torch_checkpoint"``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around
  each segment (activations dropped, the segment re-run in backward with whatever state is
  there then).
* ``"torch_sac"``: torch's selective activation checkpointing: the same, with
  ``context_fn=create_selective_checkpoint_contexts(ops)`` so the outputs of the listed ops
  (matrix multiplications by default) are saved and everything else is recomputed.

Both are applied the way the engine applies itself: the segment's class is swapped for a
subclass whose ``forward`` goes through checkpoint, so ``state_dict`` keys, ``repr`` and
parameters do not change and :func:`remove_torch_recompute` restores the model exactly.

Example:
    >>> import torch
    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> names = apply_torch_recompute(m, ["0"], "torch_sac")
    >>> m(torch.randn(2, 4)).sum().backward()
    >>> names, type(m[0]).__name__, recompute_method(m[0])
    (['0'], 'Linear', 'torch_sac')
    >>> remove_torch_recompute(m)
    >>> recompute_method(m[0]) is None
    True
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_replay.errors import ReplayConfigError
from lightning_replay.core.engine.segments import SegmentSpec, resolve_segments

__all__ = [
    "METHODS",
    "DEFAULT_SAC_OPS",
    "apply_torch_recompute",
    "remove_torch_recompute",
    "recompute_counts",
    "recompute_method",
    "sac_ops",
]

METHODS = ("none", "torch_checkpoint", "torch_sac")

#: aten ops whose outputs ``torch_sac`` saves by default: the matrix multiplications.
DEFAULT_SAC_OPS: tuple[str, ...] = ("mm", "addmm", "bmm", "baddbmm")

_ATTR = "_lightning_replay_torch_recompute"
_CLASSES: dict[type, type] = {}


def sac_ops(names: Iterable[str]) -> list[Any]:
    """aten overload packets for op names such as ``"mm"`` or ``"convolution"``.

    Raises:
        ReplayConfigError: a name that is not an aten op.
    """
    out = []
    for n in names:
        packet = getattr(torch.ops.aten, str(n), None)
        if packet is None or not hasattr(packet, "overloads"):
            raise ReplayConfigError(
                f"sac op {n!r} is not an aten operator; use names such as "
                f"{list(DEFAULT_SAC_OPS)} or 'convolution'"
            )
        out.append(packet)
    return out


@functools.lru_cache(maxsize=None)
def _policy(names: tuple[str, ...]):
    from torch.utils.checkpoint import CheckpointPolicy

    ops = frozenset(sac_ops(names))

    def policy(ctx, op, *args, **kwargs):
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed_class(cls: type) -> type:
    if cls in _CLASSES:
        return _CLASSES[cls]

    def forward(self, *args, **kwargs):
        spec = self.__dict__.get(_ATTR)
        if spec is None or not torch.is_grad_enabled():
            return cls.forward(self, *args, **kwargs)
        spec["forwards"] += 1

        def fn(*a, **k):  # the first call is the forward, every later one a recomputation
            spec["calls"] += 1
            return cls.forward(self, *a, **k)

        if spec["method"] == "torch_sac":
            ctx = functools.partial(create_selective_checkpoint_contexts, _policy(spec["ops"]))
            return checkpoint(fn, *args, use_reentrant=False, context_fn=ctx, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    new = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_lightning_replay_torch_base": cls,
        },
    )
    _CLASSES[cls] = new
    return new


def apply_torch_recompute(
    model: nn.Module,
    segments: SegmentSpec | Iterable[SegmentSpec],
    method: str,
    ops: Sequence[str] = DEFAULT_SAC_OPS,
) -> list[str]:
    """Wrap the given submodules of ``model`` in torch's activation recomputation.

    Args:
        model: the root module (segment names are relative to it).
        segments: as for :func:`lightning_replay.install` (names, globs, classes, callables).
        method: ``"none"`` (nothing), ``"torch_checkpoint"`` or ``"torch_sac"``.
        ops: for ``"torch_sac"``, the aten op names whose outputs are saved.

    Returns:
        The qualified names of the wrapped segments (empty for ``"none"``).

    Raises:
        ReplayConfigError: unknown method or op; a segment already wrapped.
        SegmentError: segments that select nothing (see :func:`resolve_segments`).
    """
    if method not in METHODS:
        raise ReplayConfigError(f"recompute={method!r} is not known; use one of {list(METHODS)}")
    if method == "none":
        return []
    names = tuple(str(o) for o in ops) if method == "torch_sac" else ()
    sac_ops(names)  # unknown op names fail here, not at the first backward
    resolved = resolve_segments(model, segments)
    for name, mod in resolved.items():
        if recompute_method(mod) is not None:
            raise ReplayConfigError(
                f"segment {name!r} is already wrapped with "
                f"{recompute_method(mod)!r}; call remove_torch_recompute first"
            )
    for mod in resolved.values():
        mod.__dict__[_ATTR] = {"method": method, "ops": names, "forwards": 0, "calls": 0}
        mod.__class__ = _checkpointed_class(type(mod))
    return list(resolved)


def remove_torch_recompute(model: nn.Module) -> None:
    """Undo :func:`apply_torch_recompute` on every submodule of ``model``."""
    for mod in model.modules():
        if mod.__dict__.pop(_ATTR, None) is not None:
            mod.__class__ = type(mod)._lightning_replay_torch_base


def recompute_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per wrapped segment: checkpointed ``forwards`` and ``replays`` (recomputations) so far.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> _ = apply_torch_recompute(m, ["0"], "torch_checkpoint")
        >>> m(torch.randn(3, 2)).sum().backward()
        >>> recompute_counts(m)
        {'0': {'forwards': 1, 'replays': 1}}
    """
    out = {}
    for name, mod in model.named_modules():
        spec = mod.__dict__.get(_ATTR)
        if spec is not None:
            out[name] = {"forwards": spec["forwards"], "replays": spec["calls"] - spec["forwards"]}
    return out


def recompute_method(module: nn.Module) -> str | None:
    """``"torch_checkpoint"``/``"torch_sac"`` for a wrapped module, else ``None``."""
    spec = module.__dict__.get(_ATTR)
    return None if spec is None else spec["method"]
