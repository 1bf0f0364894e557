"""Selective recomputation: which ops of a replayed segment keep their outputs.

A ``selective`` option replays a segment as the other replayed options do (its entry state
swapped in, its generators restored, its own writes sandboxed) but does not recompute every
op: the outputs of the ops a policy marks expensive are kept from the forward and handed to
the replay, and only the rest runs again. The mechanism is torch's own selective checkpoint
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): a dispatch mode around the
forward caches the chosen ops' outputs, one around the replay returns them in place of the ops.
This module holds only the policies and that pair of modes; the runtime composes them with the
contract's replay context (:mod:`lightning_replay.restore`), and the cost meter charges the
kept outputs as the option's memory.

Policies (:data:`POLICIES`):

* ``"matmul"`` (torchtitan's "op" policy): keep the outputs of matrix products (``mm``,
  ``addmm``, ``bmm``, ``baddbmm``, ``linear``), attention kernels (scaled dot product: math
  kernels for the CPU, flash, efficient and cuDNN ones) and convolutions.
* ``"every_other_matmul"`` (torchtitan's option): the same, but of the matrix products only
  the 1st, 3rd, 5th, ... of a forward; attention and convolutions always.

Unlike torch's selective checkpoint with the same list, no policy here keeps the output of an
op that draws random numbers (an attention kernel with ``dropout_p > 0``): a kept op is not
run again at replay, so the replay's random ops after it would draw from a generator that is
no longer where the forward's were, and differ silently.

Example:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> lin = torch.nn.Linear(4, 4)
    >>> frame = SelectiveFrame("matmul")
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = checkpoint(lambda t: torch.tanh(lin(t)), x, use_reentrant=False,
    ...                context_fn=frame.contexts, **checkpoint_kwargs())
    >>> [tuple(t.shape) for t in frame.kept_tensors()]  # addmm's output kept, tanh recomputed
    [(2, 4)]
    >>> y.sum().backward()
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "POLICIES",
    "SAVED_OPS",
    "SelectiveFrame",
    "checkpoint_kwargs",
    "make_policy",
    "torch_sac_context_fn",
    "torch_sac_op_list",
]

#: The policies a ``selective`` option can run under.
POLICIES: tuple[str, ...] = ("matmul", "every_other_matmul")

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The overloads of the aten ops ``names`` that this torch build has."""
    out = set()
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if not op._schema.is_mutable:  # an in-place or out= variant returns its input
                out.add(op)
    return frozenset(out)


_MATMUL = _ops("mm", "addmm", "bmm", "baddbmm", "linear", "_addmm_activation")
_ATTENTION = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_CONV = _ops("convolution", "_convolution", "convolution_overrideable", "mkldnn_convolution")

#: The ops whose outputs the ``matmul`` policy keeps (torchtitan's list).
SAVED_OPS: frozenset = _MATMUL | _ATTENTION | _CONV


def _draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws from a random generator: an op tagged as seeded
    that is not an attention kernel called with ``dropout_p == 0``."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else a.default_value)
            return bool(p)
    return True


def make_policy(name: str) -> Callable[..., CheckpointPolicy]:
    """A fresh policy function for one checkpointed call (it may count ops, so one per call).

    Args:
        name: one of :data:`POLICIES`.

    Raises:
        ValueError: on an unknown name.

    Example:
        >>> p = make_policy("every_other_matmul")
        >>> mm = torch.ops.aten.mm.default
        >>> [p(None, mm).name for _ in range(3)]
        ['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    """
    if name not in POLICIES:
        raise ValueError(f"selective policy {name!r} is not known; use one of {list(POLICIES)}")
    every_other = name == "every_other_matmul"
    seen = [0]

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func not in SAVED_OPS or _draws_random(func, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if every_other and func in _MATMUL:
            seen[0] += 1
            if seen[0] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _sac_kwarg() -> dict[str, Any]:
    # torch >= 2.14 warns when a saved-tensor hook is active around a selective region unless
    # told what to do with the kept outputs; the engine charges them itself (legacy: the hooks
    # are bypassed). Older torch has no such argument and bypasses them anyway.
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        return {"respect_saved_tensors_hooks": False}
    return {}


_CHECKPOINT_KWARGS = _sac_kwarg()


def checkpoint_kwargs() -> dict[str, Any]:
    """Extra keyword arguments for ``torch.utils.checkpoint.checkpoint`` with a selective
    ``context_fn`` on this torch (empty where it takes none)."""
    return dict(_CHECKPOINT_KWARGS)


class SelectiveFrame:
    """The pair of dispatch modes of one selective call, and the outputs it keeps.

    Made once per checkpointed call: its forward mode (entered around the call's forward, or
    returned by :meth:`contexts` as a ``context_fn``) caches the outputs the policy keeps, its
    recompute mode hands them to the replay. Owns nothing past the call: the cache is
    emptied as the replay consumes it, and the frame goes with the checkpoint that holds it.

    Args:
        policy: one of :data:`POLICIES`.
    """

    __slots__ = ("forward", "recompute", "saved")

    def __init__(self, policy: str) -> None:
        self.saved: set | None = None  # storages autograd saved in the forward, if watched
        self.forward, self.recompute = create_selective_checkpoint_contexts(make_policy(policy))
        if _CHECKPOINT_KWARGS:  # entered by the caller, not by checkpoint: say it here
            self.forward.respect_saved_tensors_hooks = False

    def contexts(self) -> tuple[Any, Any]:
        """``context_fn`` for a checkpoint call with nothing else around the replay."""
        return self.forward, self.recompute

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors the forward kept for the replay (each storage once)."""
        out: list[torch.Tensor] = []
        seen: set = set()
        for entries in self.forward.storage.values():
            for entry in entries.values():
                for leaf in torch.utils._pytree.tree_leaves(entry):
                    t = getattr(leaf, "val", None)
                    if not isinstance(t, torch.Tensor):
                        continue
                    key = (str(t.device), t.untyped_storage().data_ptr())
                    if key not in seen:
                        seen.add(key)
                        out.append(t)
        return out

    def kept_bytes(self) -> int:
        """Bytes of :meth:`kept_tensors`."""
        return sum(t.untyped_storage().nbytes() for t in self.kept_tensors())

    def watch_saved(self) -> Any:
        """A context for the forward that notes the storage of every tensor autograd saves,
        handing each on to the saved-tensor hooks around it (checkpoint's): with it,
        :meth:`kept_saved_bytes` tells which kept outputs the backward itself needs."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        saved = self.saved = set()

        def pack(t: torch.Tensor) -> Any:
            saved.add((str(t.device), t.untyped_storage().data_ptr()))
            return outer[0](t) if outer is not None else t

        def unpack(x: Any) -> Any:
            return outer[1](x) if outer is not None else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def kept_saved_bytes(self) -> int:
        """Bytes of the kept outputs that autograd also saved for backward (0 unless the
        forward ran under :meth:`watch_saved`): what a replay does not re-materialize. Other
        kept outputs (a product whose consumer saves nothing) are held, not saved."""
        if not self.saved:
            return 0
        return sum(
            t.untyped_storage().nbytes()
            for t in self.kept_tensors()
            if (str(t.device), t.untyped_storage().data_ptr()) in self.saved
        )


def torch_sac_op_list(policy: str = "matmul") -> list:
    """The op list torch's own selective checkpoint takes for ``policy``'s kept ops (the
    ``matmul`` list; torch's list form cannot count, so ``every_other_matmul`` has none)."""
    if policy != "matmul":
        raise ValueError("torch's op-list form of selective checkpoint has no counting policy")
    return sorted(SAVED_OPS, key=str)


def torch_sac_context_fn(policy: str = "matmul") -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for plain ``torch.utils.checkpoint`` with torch's selective checkpoint
    under ``policy`` (the state-unaware baseline: nothing is preserved or restored beyond
    torch's global RNG)."""
    make_policy(policy)  # validates the name

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(make_policy(policy))

    return context_fn
