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
* ``"flops"``: of the same ops, only those whose output saves at least as much compute per byte
  kept as retaining the whole segment does: an op's flops (torch's formulas,
  :data:`torch.utils.flop_counter.flop_registry`) per byte of its output, against the
  segment forward's flops per byte of activations it saves (``A(s)``). A selective option is
  then a better use of memory than retaining the segment, op by op. An attention kernel's score
  product (``q @ k^T``: its output grows with the square of the sequence, its cost with the
  head width) is the op it usually drops; the projections it keeps. The segment's flops are
  counted by the frames themselves: a segment's first frame keeps every candidate and prunes
  at the forward's end (:meth:`SelectiveFrame.settle`); later ones decide as each op runs. An
  op with no formula is kept, as under ``"matmul"``.

Random draws. A kept op is not run again at replay, so the replay's random ops after it would
draw from a generator that is no longer where the forward's were, and differ silently: torch's
own selective checkpoint with the same list does that to an attention kernel with
``dropout_p > 0``. Here a kept op that draws (from its device's default generator) keeps that
generator's state after the draw too, and the replay sets it where the op stands in: every
random op after it draws what the forward drew. Torch's policies (:func:`make_policy`, the
baseline arm) recompute such ops instead. And under every policy a dropout mask drawn in place
(``bernoulli_``: the decomposed dropout of the CPU, and of any code that draws a mask) is kept,
one byte per element, with its generator's state (where the mask is at least as large as the
state: the CPU's is 5,056 bytes, CUDA's 16): the replay copies it into its own mask
instead of drawing it (on the CPU, drawing is a quarter of a GPT-2 block's pointwise work). A
replay so ends with each generator where a full replay leaves it (checkpoint's
``preserve_rng_state`` forks them around it). A draw from any other generator (a module's own)
is not kept: it runs again, as in a full replay.

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

import contextlib
import inspect
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightning_replay.core.base.state import digests

try:  # torch's flop formulas, per op packet (the ``flops`` policy)
    from torch.utils.flop_counter import flop_registry as _FLOP_FORMULAS
except ImportError:  # pragma: no cover - older torch: every candidate is kept
    _FLOP_FORMULAS = {}

try:  # the ops neither mode caches nor counts (torch's own list)
    from torch.utils.checkpoint import SAC_IGNORED_OPS as _IGNORED
except ImportError:  # pragma: no cover - older torch
    _IGNORED = frozenset()
try:  # the cache's key of a call (an op; a compiled region has one per region)
    from torch.utils.checkpoint import _sac_storage_key
except ImportError:  # pragma: no cover - older torch keys by op

    def _sac_storage_key(func: Any, args: tuple) -> Any:
        return func


__all__ = [
    "POLICIES",
    "SAVED_OPS",
    "KeptEvent",
    "SelectiveFrame",
    "checkpoint_kwargs",
    "make_policy",
    "torch_sac_context_fn",
    "torch_sac_op_list",
]

#: The policies a ``selective`` option can run under.
POLICIES: tuple[str, ...] = ("matmul", "every_other_matmul", "flops")

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


#: per op: (tagged as seeded, position of its ``dropout_p`` argument or None, its default).
#: Reading ``func.tags`` and ``func._schema`` builds Python objects on every access (about
#: 0.2 ms a call under a profiler, on every kept-op candidate of every forward): once per op.
_RANDOM_INFO: dict[Any, tuple[bool, int | None, Any]] = {}


def _random_info(func: Any) -> tuple[bool, int | None, Any]:
    info = _RANDOM_INFO.get(func)
    if info is None:
        info = (False, None, None)
        if torch.Tag.nondeterministic_seeded in func.tags:
            info = (True, None, None)
            for i, a in enumerate(func._schema.arguments):
                if a.name == "dropout_p":
                    info = (True, i, a.default_value)
                    break
        _RANDOM_INFO[func] = info
    return info


def _draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws from a random generator: an op tagged as seeded
    that is not an attention kernel called with ``dropout_p == 0``."""
    seeded, i, default = _random_info(func)
    if not seeded:
        return False
    if i is None:
        return True
    return bool(kwargs.get("dropout_p", args[i] if i < len(args) else default))


#: the in-place draws whose results a frame keeps (a dropout's mask: only 0 and 1, kept as bool)
_MASK_DRAWS = frozenset(
    getattr(_aten.bernoulli_, o) for o in _aten.bernoulli_.overloads() if o in ("float", "Tensor")
)


def _draw_generator(func: Any, args: tuple, kwargs: dict, out: Any) -> torch.Generator | None:
    """The generator this call of ``func`` drew from, where it is its output's device's
    default one (the one checkpoint's ``preserve_rng_state`` forks around a replay); ``None``
    for an explicit other generator, another device kind, or an output not known."""
    leaf = next(
        (t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None
    )
    if leaf is None:
        return None
    dev = leaf.device
    if dev.type == "cpu":
        default = torch.default_generator
    elif dev.type == "cuda":
        default = torch.cuda.default_generators[
            dev.index if dev.index is not None else torch.cuda.current_device()
        ]
    else:
        return None
    given = kwargs.get("generator")
    if given is not None and given is not default:
        return None
    return default


_OFFSET_DTYPES = (torch.int32, torch.int64)


def _shape_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dtype in _OFFSET_DTYPES and x.dim() == 1:
            # a variable-length attention's cumulative sequence offsets: torch's formula
            # reads their values (the sum of squared lengths), not only their shape
            try:
                return (tuple(x.shape), x.dtype, tuple(x.tolist()))
            except Exception:  # values not known (a fake tensor under torch.compile)
                raise TypeError("offsets without values") from None
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_shape_key(v) for v in x)
    return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)


#: (op, its arguments' shapes and values) -> flops. A formula walks its arguments with
#: torch's pytree (about 0.3 ms a call, six calls a transformer block a step): the shapes of a
#: segment's products rarely change, so each is computed once.
_FLOPS_SEEN: dict = {}


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """The flops of one call by torch's formula for its op, or ``None`` (no formula, the
    output is not known: torch before 2.9 calls a policy before the op runs, or the sizes are
    symbolic: torch.compile with dynamic shapes)."""
    formula = _FLOP_FORMULAS.get(func._overloadpacket)
    if formula is None or out is None:
        return None
    try:
        key = (func, _shape_key(args), _shape_key(tuple(sorted(kwargs.items()))))
        flops = _FLOPS_SEEN.get(key, -1)
    except TypeError:  # symbolic sizes (torch.compile, dynamic shapes): no number to compare
        return None
    if flops != -1:
        return flops
    try:
        flops = int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments
        flops = None
    if len(_FLOPS_SEEN) > 4096:  # shapes that keep changing: keep the table small
        _FLOPS_SEEN.clear()
    _FLOPS_SEEN[key] = flops
    return flops


#: op -> the positions and keyword names of the arguments it writes (``None``: it writes none)
_WRITES: dict = {}


def _written_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """Where ``func`` writes its arguments (an in-place op, an ``out=`` variant), by its
    schema's alias annotations (``Tensor(a!)``); ``None`` for an op that writes none."""
    try:
        return _WRITES[func]
    except KeyError:
        pass
    schema = getattr(func, "_schema", None)
    spots = None
    if schema is not None and schema.is_mutable:
        args = schema.arguments
        written = [
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(args)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        spots = (
            tuple(i for i, _, kw in written if not kw),
            tuple(n for _, n, _ in written),
        )
    _WRITES[func] = spots
    return spots


#: per op: whether it returns an alias of an input that its schema does not call a view
#: (``_unsafe_view``, ``unsafe_chunk``, ``unsafe_split``: torch names them so): an alias with
#: a version counter of its own.
_UNSAFE_ALIAS: dict = {}


#: replays in progress (any segment's, any option's). A segment's forward may start another
#: segment's replay (``torch.autograd.grad`` of its output, an input-gradient feature): the
#: ops that replay issues pass through the forward's mode beneath it, but are not the
#: forward's own (at the segment's own replay they may run differently or not at all: the
#: other segment's kept outputs are gone by then). A frame counts and keeps only its own.
#: Per thread: two models trained in two threads replay side by side (a shared count made one
#: thread's replay pass the other's ops through uncounted: kept outputs handed to the wrong
#: calls). A replay run inside another, or inside a forward (``autograd.grad`` there), runs
#: on the thread that started it (CPU), or on the autograd engine's device thread with the
#: forward's modes carried over (CUDA), where its own count is the one the modes read.


class _Replays(threading.local):
    n = 0


_REPLAYS = _Replays()


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Around any segment's replay: ops in it are not those of a forward or replay the replay
    runs inside (see :data:`_REPLAYS`)."""
    _REPLAYS.n += 1
    try:
        yield
    finally:
        _REPLAYS.n -= 1


def _unsafe_alias(func: Any) -> bool:
    try:
        return _UNSAFE_ALIAS[func]
    except KeyError:
        pass
    schema = getattr(func, "_schema", None)
    out = (
        schema is not None
        and "unsafe" in schema.name
        and all(r.alias_info is None for r in schema.returns)
    )
    _UNSAFE_ALIAS[func] = out
    return out


def _counted_alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter, also inside a dispatch mode
    (beneath autograd a plain ``detach`` makes a counter of its own: a write through ``t``
    would not show). As torch's selective checkpoint detaches what it caches."""
    guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
    if guard is None:  # pragma: no cover - older torch
        return t.detach()
    with guard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _storages(x: Any) -> list[tuple[str, int]]:
    """Where the tensors in ``x`` (a tensor, or a list of them) keep their bytes (a tensor
    without a storage of its own to ask, a wrapper subclass's, is left out)."""
    out = []
    for t in x if isinstance(x, (list, tuple)) else [x]:
        if isinstance(t, torch.Tensor):
            where = _where(t)
            if where is not None:
                out.append(where)
    return out


def _out_bytes(out: Any) -> int:
    """Bytes of an op's strided outputs (a sparse one has no storage to ask: not counted)."""
    return sum(
        t.untyped_storage().nbytes() if t._base is None else t.nbytes
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.layout == torch.strided
    )


def _where(t: torch.Tensor) -> tuple[str, int] | None:
    """Where ``t`` keeps its bytes, or ``None`` for a tensor with no storage of its own to ask
    (a sparse tensor, a wrapper subclass: DTensor, TwoTensor, a float8 or NF4 wrapper)."""
    if t.layout != torch.strided or is_traceable_wrapper_subclass(t):
        return None
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _keepable(out: Any) -> bool:
    """Whether an op's output can be kept: tensors with a storage of their own only. A sparse
    or other layout has no storage to charge, watch or digest, nor has a wrapper subclass
    (its bytes are its inner tensors': a write through an alias of one moves no counter the
    frame could watch): the op runs again at the replay."""
    return all(
        _where(t) is not None
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor)
    )


def make_policy(
    name: str, density: float | None = None, *, draws: bool = False
) -> Callable[..., CheckpointPolicy]:
    """A fresh policy function for one checkpointed call (it may count ops, so one per call).

    Args:
        name: one of :data:`POLICIES`.
        density: under ``"flops"``, the segment's flops per byte of activations: a candidate
            op whose flops per output byte are below it is recomputed. ``None``: every
            candidate is kept (as under ``"matmul"``).
        draws: keep candidates that draw random numbers (an attention kernel with dropout) as
            any other: only for a caller that sets the generator after the kept op at the
            replay (:class:`SelectiveFrame`); torch's own modes cannot, so by default they are
            recomputed.

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
    by_flops = name == "flops" and density is not None
    seen = [0]

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func not in SAVED_OPS or (not draws and _draws_random(func, args, kwargs)):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if every_other and func in _MATMUL:
            seen[0] += 1
            if seen[0] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if by_flops:
            out = getattr(ctx, "op_output", None)
            flops = op_flops(func, args, kwargs, out)
            if flops is not None and flops < density * _out_bytes(out):
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


class KeptEvent:
    """What a selective replay found wrong with one kept output, and did instead of using it
    (it ran the op again, on the replay's own inputs, as a full replay does).

    Attributes:
        kind: ``"written"`` (written in place after its op, version counter moved: the
            segment or the step writes into the product, a ``relu_`` after a linear);
            ``"bytes"`` (its bytes changed since its op without a version bump: a ``.data``
            write; seen only where the frame verifies, on checked steps); ``"arguments"`` (the
            replay called the op with other tensor shapes than the forward did); ``"unmatched"``
            (the replay called it more often than the forward: its ops ran in another order).
        op: the op (``"aten.addmm.default"``).
        call: which call of that op in the forward (from 0).
        seen: what was seen, for a record.
    """

    __slots__ = ("call", "kind", "op", "seen")

    def __init__(self, kind: str, op: str, call: int, seen: str) -> None:
        self.kind, self.op, self.call, self.seen = kind, op, call, seen

    def __repr__(self) -> str:
        return f"KeptEvent({self.kind!r}, {self.op} #{self.call}: {self.seen})"

    def describe(self) -> str:
        """One line for a record: ``"kept output of aten.addmm.default #0: ..."``."""
        return f"kept output of {self.op} #{self.call}: {self.seen}"


def _signature(args: tuple) -> tuple:
    """What a kept call is matched on besides its op and its count: the grad mode, and per
    tensor argument its shape, dtype and device, whether it requires grad, and the parameter
    it is or views. A call the replay makes where the forward made another of the same op and
    shapes (a hook's sampled ``F.linear`` under ``no_grad`` on the layer's own weight, a cached
    helper's product run on a cache miss only) then differs: matched on shapes alone, every
    later call of the op got the kept output of the one before it (wrong gradients)."""
    out: list = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            base = a._base if a._base is not None else a
            owner = id(base) if isinstance(base, torch.nn.Parameter) else None
            out.append((tuple(a.shape), a.dtype, a.device, a.requires_grad, owner))
    return tuple(out)


def _shown(sig: tuple) -> str:
    """A signature as the user reads it (no object identities)."""
    grad, *tensors = sig
    parts = [
        f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        + (" requiring grad" if rg else "")
        + (" (a parameter)" if owner is not None else "")
        for shape, dtype, _, rg, owner in tensors
    ]
    return "(" + ", ".join(parts) + ")" + ("" if grad else " under no_grad")


def _wrapped(x: Any) -> bool:
    """A cache entry's leaf (torch's ``_VersionWrapper``: the value and its version)."""
    return hasattr(x, "get_val") and hasattr(x, "val")


def _leaves(entry: Any) -> list:
    """The wrapped tensors of a cache entry (none once consumed, or for torch's marker of a
    call it recomputes)."""
    if _wrapped(entry):  # an op with one output (most): no tree to walk
        return [entry] if isinstance(entry.val, torch.Tensor) else []
    if not isinstance(entry, (tuple, list, dict)):  # a marker, or None
        return []
    return [
        leaf
        for leaf in torch.utils._pytree.tree_leaves(entry)
        if _wrapped(leaf) and isinstance(leaf.val, torch.Tensor)
    ]


class _KeptReplay(TorchDispatchMode):
    """The replay's mode of a :class:`SelectiveFrame`: a call the forward kept gets the kept
    output, once its checks pass; every other op runs. Unlike torch's own, a kept output that
    is stale (see :class:`KeptEvent`) is not used and does not raise: the op runs again, as in
    a full replay, and the frame notes why."""

    def __init__(self, frame: "SelectiveFrame") -> None:
        super().__init__()
        self.frame = frame
        self.counter: dict = defaultdict(int)
        self.depth = 0  # replays in progress as this one runs (its own included)
        #: a kept call did not match: the replay's calls may be shifted against the forward's
        #: (one call more or fewer of an op), so no later kept output is used in this replay
        self.shifted = False

    def __enter__(self) -> Any:
        self.counter.clear()  # a second replay (retain_graph) counts from the start again
        self.shifted = False
        if self.frame._returned:
            self.frame.outputs_written()
        entered = super().__enter__()
        _REPLAYS.n += 1
        self.depth = _REPLAYS.n
        return entered

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _REPLAYS.n -= 1
            # The replay is the kept outputs' only reader. One that stopped early (checkpoint
            # stops once backward has what it saves) never reached the ops after that point:
            # their kept outputs would live as long as the frame, past this segment's backward
            # (measured: 3.5 MiB over four Llama blocks at the peak). A later replay of the
            # same call (retain_graph) runs those ops again, as it does the consumed ones.
            self.frame.release()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = {} if kwargs is None else kwargs
        if _REPLAYS.n > self.depth:  # another segment's replay, run inside this one
            return func(*args, **kwargs)
        frame = self.frame
        # Most ops of a replay are ones the forward kept no call of: they run, uncounted (this
        # mode sits on every op of the replay: its cost per op is the option's overhead over
        # torch's own selective checkpoint). Only the keys of kept ops are counted, here and in
        # the forward's policy, which is all the kept-call matching below needs.
        if func not in frame._kept_ops or func in _IGNORED:
            if func in frame._drawn_ops:
                return self._mask(func, args, kwargs)
            return func(*args, **kwargs)
        key = _sac_storage_key(func, args)
        idx = self.counter[key]
        self.counter[key] += 1
        kept = frame._kept.get((key, idx))
        if kept is None:  # recomputed by the policy (or a call the forward never made)
            if frame._calls.get(key, 0) <= idx:
                frame._note("unmatched", func, idx, "the forward made fewer calls of this op")
                self.shifted = True
            return func(*args, **kwargs)
        slot, sig = kept
        if self.shifted:  # (what it holds goes with the frame as the replay ends)
            return func(*args, **kwargs)
        store = frame.forward.storage.get(key)
        entry = store[slot] if store is not None else None
        leaves = _leaves(entry)
        if not leaves:  # consumed by an earlier replay of this call
            return func(*args, **kwargs)
        # consumed: the kept tensors go as the replay uses them (as in torch's own mode)
        store[slot] = None
        why = None
        now = _signature(args)
        if now != sig:
            why = ("arguments", f"called with {_shown(now)}, at the forward with {_shown(sig)}")
            self.shifted = True  # (the calls after it may be shifted too: none kept is used)
        elif any(w.version is not None and w.val._version != w.version for w in leaves):
            why = ("written", "written in place after its op (its version counter moved)")
        elif frame.verify and (key, idx) in frame._digests:
            if digests([w.val for w in leaves]) != frame._digests[(key, idx)]:
                why = ("bytes", "its bytes changed since its op, without a version bump")
        if why is not None:
            frame._note(why[0], func, idx, why[1])
            return func(*args, **kwargs)
        post = frame._post.get((key, idx))
        if post is not None:  # a kept op that drew: the generator goes where the forward's was
            post[0].set_state(post[1])
        return torch.utils._pytree.tree_map(lambda x: x.val if _wrapped(x) else x, entry)

    def _mask(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A mask drawn in place: the forward's copied into the replay's own, and the
        generator set to where the forward's draw left it."""
        frame = self.frame
        key = _sac_storage_key(func, args)
        idx = self.counter[key]
        self.counter[key] += 1
        kept = frame._drawn.pop((key, idx), None)
        if kept is None:  # not kept (another generator), or a call the forward never made
            return func(*args, **kwargs)
        mask, gen, state, sig = kept
        now = _signature(args)
        if now != sig:
            seen = f"called with {_shown(now)}, at the forward with {_shown(sig)}"
            frame._note("arguments", func, idx, seen)
            return func(*args, **kwargs)
        args[0].copy_(mask)
        gen.set_state(state)
        return args[0]


class SelectiveFrame:
    """The pair of dispatch modes of one selective call, and the outputs it keeps.

    Made once per checkpointed call: its forward mode (entered around the call's forward, or
    returned by :meth:`contexts` as a ``context_fn``) caches the outputs the policy keeps, its
    recompute mode hands them to the replay. Owns nothing past the call: the cache is
    emptied as the replay consumes it, and the frame goes with the checkpoint that holds it.

    The replay's mode checks each kept output before it stands in for its op: the op's tensor
    arguments must have the forward's shapes, the output must not have been written in place
    since (its version counter), and, where ``verify`` is set, its bytes must be those the op
    produced (a digest taken as the op ran: catches writes that bump no version). A kept output
    that fails is not used; the op runs again and :attr:`events` says why.

    Args:
        policy: one of :data:`POLICIES`.
        verify: digest each kept output as its op runs, and compare at the replay (checked
            steps: it costs a hash of every kept output).
        skip: ``(op name, call)`` pairs never to keep (calls found written in place before:
            keeping them costs memory for nothing).
        density: under ``"flops"``, the segment's flops per byte of activations, as an
            earlier frame's :meth:`settle` measured it; ``None``: keep every candidate, and
            let :meth:`settle` prune at the forward's end.
    """

    __slots__ = (
        "_calls",
        "_dense",
        "_digests",
        "_kept_at",
        "_returned",
        "_draw_calls",
        "_drawn",
        "_drawn_ops",
        "_kept",
        "_kept_ops",
        "_post",
        "density",
        "events",
        "flops",
        "forward",
        "saved",
        "verify",
        "__weakref__",
    )

    def __init__(
        self,
        policy: str,
        *,
        verify: bool = False,
        skip: Any = frozenset(),
        density: float | None = None,
    ) -> None:
        self.saved: set | None = None  # storages autograd saved in the forward, if watched
        depth = _REPLAYS.n  # replays in progress as the forward begins (made just before it)
        self.verify = verify
        self.events: list[KeptEvent] = []
        self._kept: dict = {}  # (key, call) -> (position among the op's kept calls, arguments)
        self._kept_at: dict = {}  # (device, storage) -> the kept calls whose output it holds
        self._returned: list = []  # aliases of kept bytes: (alias, version, storage)
        self._kept_ops: dict = defaultdict(int)  # key -> calls kept
        self._calls: dict = defaultdict(int)  # key -> calls seen in the forward (kept ops')
        self._digests: dict = {}
        self._post: dict = {}  # (key, call) of a kept op that drew -> (generator, state after)
        self._drawn: dict = {}  # (key, call) of a mask drawn -> (mask, generator, state, args)
        self._drawn_ops: set = set()  # keys of the masks drawn
        self._draw_calls: dict = defaultdict(int)  # key -> masks drawn in the forward
        counting = policy == "flops"
        #: the forward's flops by torch's formulas (``None`` unless the policy is ``"flops"``)
        self.flops: int | None = 0 if counting else None
        self.density = density
        self._dense: dict = {}  # (key, call) -> flops per output byte, of kept calls
        inner = make_policy("matmul" if counting else policy, draws=True)
        save = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        recompute = CheckpointPolicy.PREFER_RECOMPUTE

        # The forward's mode holds this function and the frame holds the mode: the function
        # reaches the frame weakly, so that a frame whose graph is dropped before backward goes
        # with it, kept outputs included (a cycle would leave them to the cyclic collector).
        frame = weakref.ref(self)

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            self = frame()
            if self is None:  # (the forward's mode outlived its frame: nothing is kept)
                return recompute
            if _REPLAYS.n > depth:  # another segment's replay, run inside this forward
                return recompute
            if self._kept_at:
                spots = _written_arguments(func)
                if spots is not None:  # (after the op ran: it wrote)
                    self._written(func, spots, args, kwargs)
                elif _unsafe_alias(func):
                    self._watch_aliases(getattr(ctx, "op_output", None))
            if func not in SAVED_OPS:  # no policy keeps it: not counted (see _KeptReplay)
                if func in _MASK_DRAWS:
                    self._keep_mask(func, args, kwargs, getattr(ctx, "op_output", None))
                return recompute
            key = _sac_storage_key(func, args)
            idx = self._calls[key]
            self._calls[key] += 1
            out = getattr(ctx, "op_output", None)
            flops = op_flops(func, args, kwargs, out) if counting else None
            if flops is not None:
                self.flops += flops
            p = inner(ctx, func, *args, **kwargs)
            if p not in save:
                return p
            if torch.is_inference_mode_enabled() or not _keepable(out):
                # an inference tensor has no version counter to check at the replay, a sparse
                # output no storage: the op runs again (counted above, as the replay counts it)
                return recompute
            if skip and (str(func), idx) in skip:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if flops is not None:
                dense = flops / max(_out_bytes(out), 1)
                if density is not None and dense < density:
                    return recompute
                self._dense[(key, idx)] = dense
            if _draws_random(func, args, kwargs):  # (an attention kernel with dropout)
                gen = _draw_generator(func, args, kwargs, out)
                if gen is None:
                    return recompute
                self._post[(key, idx)] = (gen, gen.get_state())
            # where torch's forward mode stores this call's output: by torch's own count of
            # the op's calls (every call its mode saw: another segment's replay inside this
            # forward included, which this frame does not count), or by position among the
            # kept ones where torch appends to a list (older torch)
            counter = getattr(self.forward, "func_counter", None)
            slot = self._kept_ops[key] if counter is None else counter[key] - 1
            self._kept[(key, idx)] = (slot, _signature(args))
            self._kept_ops[key] += 1
            if out is not None:
                for where in _storages(torch.utils._pytree.tree_leaves(out)):
                    self._kept_at.setdefault(where, []).append((key, idx, str(func)))
            if verify and out is not None:
                self._digests[(key, idx)] = digests(
                    [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                )
            return p

        self.forward, _ = create_selective_checkpoint_contexts(policy_fn)
        if _CHECKPOINT_KWARGS:  # entered by the caller, not by checkpoint: say it here
            self.forward.respect_saved_tensors_hooks = False

    @property
    def recompute(self) -> _KeptReplay:
        """The replay's mode: a new one for each replay (it holds the frame; the frame does not
        hold it, so no cycle keeps the kept outputs past the graph that holds the frame)."""
        return _KeptReplay(self)

    def settle(self, activation_bytes: int) -> float | None:
        """After the forward, under ``"flops"``: the segment's flops per byte of activations
        (``activation_bytes``, its ``A(s)``), for the segment's next frames. A frame that ran
        without a density drops, now, the kept outputs whose flops per byte fall below it.
        ``None`` under other policies, or when the forward counted no flops."""
        if not self.flops or activation_bytes <= 0:
            return None
        density = self.flops / activation_bytes
        if self.density is None:
            for (key, idx), dense in self._dense.items():
                if dense >= density:
                    continue
                store = self.forward.storage.get(key)
                if store is not None:  # the replay runs the op (an emptied entry)
                    store[self._kept[(key, idx)][0]] = None
                self._digests.pop((key, idx), None)
                self._post.pop((key, idx), None)
                for calls in self._kept_at.values():
                    calls[:] = [c for c in calls if (c[0], c[1]) != (key, idx)]
            if self._returned:  # (an output whose kept calls all went holds nothing kept)
                self._returned = [r for r in self._returned if self._kept_at.get(r[2])]
        return density

    def _written(self, func: Any, spots: tuple, args: tuple, kwargs: dict) -> None:
        """In the forward, after an op that writes some of its arguments: a kept output whose
        bytes it wrote is not kept (the replay runs its op again, and later frames keep no
        such call: a ``"written"`` event). Its version counter need not move: ``matmul`` of a
        3-d input returns its product through ``_unsafe_view`` and GRU cells split theirs
        with ``unsafe_chunk``, aliases with counters of their own, so a ``mul_`` through one
        changes the kept bytes with no version bump (the replay, handed those bytes, ran the
        write a second time: wrong gradients, nothing recorded)."""
        positions, names = spots
        hit: list = []
        for i in positions:
            if i < len(args):
                hit += _storages(args[i])
        for n in names:
            if n in kwargs:
                hit += _storages(kwargs[n])
        for where in hit:
            self._drop_written(where, f"written in place in the forward by {func}")

    def _drop_written(self, where: tuple[str, int], seen: str) -> None:
        """The kept outputs whose bytes are in storage ``where`` were written: not kept (the
        replay runs their ops again), each a ``"written"`` event."""
        for op, idx in self._drop(where):
            self.events.append(KeptEvent("written", op, idx, seen))

    def _drop(self, where: tuple[str, int]) -> list[tuple[str, int]]:
        """Keep nothing in storage ``where`` (the replay runs those ops again). Returns the
        calls no longer kept, as (op, call)."""
        dropped = []
        self._returned = [r for r in self._returned if r[2] != where]  # (nothing kept there)
        for key, idx, op in self._kept_at.pop(where, ()):
            kept = self._kept.pop((key, idx), None)
            if kept is None:
                continue
            store = self.forward.storage.get(key)
            if store is not None:  # the replay runs the op (an emptied entry)
                store[kept[0]] = None
            self._digests.pop((key, idx), None)
            self._post.pop((key, idx), None)
            self._dense.pop((key, idx), None)
            dropped.append((op, idx))
        return dropped

    def watch_outputs(self, out: Any) -> None:
        """At the forward's end: a kept output whose bytes the segment returns (the output
        itself, a view or an alias of it, in any container the pytree walks) is not kept. The
        caller holds it and may write it by ways no counter the frame holds sees (its own
        ``unsafe_split`` of it, ``set_`` onto its storage, ``.data``): the replay runs its op
        again, as a full replay does. It costs no recompute where nothing in the segment
        reads the product (checkpoint stops before the last op), and no memory: the caller
        holds those bytes anyway, and they are no longer held past the caller's use."""
        if not self._kept_at or out is None:
            return
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for where in _storages(t):
                    if where in self._kept_at:
                        self._drop(where)

    def _watch_aliases(self, out: Any) -> None:
        """In the forward, after an op that returns an alias its schema does not call a view:
        one that shares a kept output's bytes (``matmul`` of a 3-d input returns its ``mm``
        product through ``_unsafe_view``; GRU cells split theirs with ``unsafe_chunk``) has a
        version counter of its own. Wherever it goes (kept as an attribute, appended to a list,
        returned in an object the pytree does not walk), a write through it moves that
        counter: each is held as a detached alias (its counter, no graph, no bytes of its own)
        and read when the replay begins (:meth:`outputs_written`). (Returned where the pytree
        walks, the kept output is not kept at all: :meth:`watch_outputs`.)"""
        if out is None:
            return
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for where in _storages(t):
                    if where in self._kept_at:
                        self._returned.append((_counted_alias(t), t._version, where))

    def outputs_written(self) -> None:
        """At the replay's start: an alias :meth:`_watch_aliases` held was written since the
        forward (its version moved): the kept outputs in its storage are not used. The
        aliases go now (a kept output the replay consumes is freed as it is used, as
        before)."""
        returned, self._returned = self._returned, []
        for alias, version, where in returned:
            if alias._version != version:
                self._drop_written(where, "written in place through an alias the segment made")

    def _keep_mask(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """In the forward, after a mask was drawn in place: its values (only 0 and 1: one
        byte each) and its generator's state after the draw, for the replay."""
        key = _sac_storage_key(func, args)
        idx = self._draw_calls[key]
        self._draw_calls[key] += 1
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        gen = _draw_generator(func, args, kwargs, out) if target is not None else None
        if gen is None:
            return
        state = gen.get_state()
        if target.numel() < state.numel():
            # a mask smaller than the generator's state (the CPU's: 5,056 bytes) costs more
            # kept than it saves: drawn again at the replay, from where the kept ones before it
            # left the generator (measured: 200 masks of 4 x 16 kept 1 MB of states for 12.8 KB)
            return
        self._drawn[(key, idx)] = (target.to(torch.bool, copy=True), gen, state, _signature(args))
        self._drawn_ops.add(key)

    def release(self) -> None:
        """Drop what the forward kept (after the replay, or after a measurement)."""
        self.forward.storage.clear()
        self._returned.clear()
        self._drawn.clear()
        self._post.clear()

    def _note(self, kind: str, func: Any, call: int, seen: str) -> None:
        self.events.append(KeptEvent(kind, str(func), call, seen))

    def contexts(self) -> tuple[Any, Any]:
        """``context_fn`` for a checkpoint call with nothing else around the replay."""
        return self.forward, self.recompute

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors the forward kept for the replay (each storage once)."""
        out: list[torch.Tensor] = []
        seen: set = set()
        storage = self.forward.storage
        for (key, _), (slot, _) in self._kept.items():  # torch marks every other call too
            store = storage.get(key)
            if store is None:
                continue
            try:
                entry = store[slot]
            except (IndexError, KeyError):
                continue
            for leaf in _leaves(entry):
                t = leaf.val
                where = _where(t)  # (every kept output has one: see _keepable)
                if where is not None and where not in seen:
                    seen.add(where)
                    out.append(t)
        for mask, _, state, _ in self._drawn.values():  # masks drawn, their generators' states
            out += [mask, state]
        out += [state for _, state in self._post.values()]
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
            saved.update(_storages(t))  # (a sparse tensor has none: no kept output is one)
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
            t.untyped_storage().nbytes() for t in self.kept_tensors() if _where(t) in self.saved
        )


def torch_sac_op_list(policy: str = "matmul") -> list:
    """The op list torch's own selective checkpoint takes for ``policy``'s kept ops (the
    ``matmul`` list; torch's list form cannot count, so ``every_other_matmul`` has none)."""
    if policy != "matmul":
        raise ValueError("torch's op-list form of selective checkpoint has no counting policy")
    return sorted(SAVED_OPS, key=str)


def torch_sac_context_fn(
    policy: str = "matmul", density: float | None = None
) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for plain ``torch.utils.checkpoint`` with torch's selective checkpoint
    under ``policy`` (the state-unaware baseline: nothing is preserved or restored beyond
    torch's global RNG). ``density``: under ``"flops"``, the segment's flops per byte of
    activations (see :func:`make_policy`; torch's modes cannot prune after the forward)."""
    make_policy(policy)  # validates the name

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(make_policy(policy, density))

    return context_fn
