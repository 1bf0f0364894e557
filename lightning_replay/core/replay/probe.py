"""The probe of a segment and the contract it makes.

A probed forward runs retained (always exact) under the discovery mode; its window ends at the
first unpack of a saved tensor in backward, the moment checkpoint would have replayed it. The
probes of a segment make the next contract version: the current contract extended (union) by
what they saw, so contracts only grow. A mutable argument object that the segment changes (an
HF cache) is refused here, at the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import re
import random
import sys
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torch.utils.checkpoint import CheckpointError, checkpoint, set_checkpoint_early_stop

from lightning_replay._compat import (
    at_backward_end,
    top_saved_tensors_hooks,
    tree_flatten,
)
from lightning_replay.core.mechanisms import backend_flags, param_cache
from lightning_replay.core.mechanisms.accounting import Saved
from lightning_replay.core.mechanisms.arguments import (
    MAX_DEPTH,
    call_tensors,
    check_rebuild,
    flatten_call,
    forward_attributes,
    state_attributes,
    tensor_attributes,
    unflatten_call,
    with_attributes,
)
from lightning_replay.core.mechanisms.grad_reads import GradReads, forward_grads
from lightning_replay.core.base.ports import ProbedSegment, ProbeHost, RecordSink
from lightning_replay.core.base.contract import SELECTIVE, ReplayContract, StateEntry
from lightning_replay.core.mechanisms.discovery import (
    COPY_BELOW,
    DiscoveryMode,
    Observation,
    observe_window,
)
from lightning_replay.core.replay.probe_replay import _ProbeReplay
from lightning_replay.errors import ReplayConfigError, ReplayError
from lightning_replay.core.mechanisms.host_rng import (
    HostRNG,
    advanced,
    as_host_rng,
    host_rngs,
    is_host_rng,
    states,
)
from lightning_replay.core.replay.restore import _Bound, user_saved_hooks
from lightning_replay.core.mechanisms.module_globals import describe, globals_read, held_functions
from lightning_replay.core.mechanisms.guards import _attrs as _guard_attrs
from lightning_replay.core.mechanisms.guards import _contents as _guard_contents
from lightning_replay.core.mechanisms.guards import _reachable, is_flag
from lightning_replay.core.mechanisms.outside_reads import (
    PATCH_LOCK,
    HolderReads,
    OutsideReads,
    comparisons,
)
from lightning_replay.core.mechanisms.slots import (
    MISSING,
    MODULE_INTERNALS,
    SlotView,
    _at_forward,
    capture_generators,
    capture_slots,
    is_scalar,
    registered_modules,
    same_value,
    slot_generators,
    slot_tensors,
)
from lightning_replay.core.base.state import (
    same_generator,
    StateIndex,
    StateRef,
    digest_token,
    digests,
    find_generator_name,
    iter_named_state,
    storage_key,
    tensor_leaves,
    unique_generators,
)
from lightning_replay.core.base.state import unique_bytes as _unique_bytes


class _Probe:
    """One probed invocation, waiting for the moment its replay would have run."""

    def __init__(self, mode: DiscoveryMode, slots: list, leaf_keys: list, step: int):
        self.mode = mode
        self.slots = slots
        self.leaf_keys = leaf_keys  # storage key of each tensor leaf of the call's arguments
        self.activation_bytes = 0
        self.step = step
        self.live = 0  # saved-tensor handles autograd still holds (0: the graph is gone)
        self.observations: list[Observation] | None = None
        self.changed_attrs: list[str] = []
        self.created: list = []  # per module, the attributes its forward created
        #: fields of its modules its forward read as flags, as they were before it began
        #: (a bool, a string mode, an attribute absent): preconditions, whatever the window
        #: does to them after the segment ran (see SegmentProbe._read_flags)
        self.read_flags: set = set()
        self.replayed = False  # its forward kept no activations; its replay restores
        self.gens: list = []  # (generator, state) at its start (replayed probes)
        self.outside: list | None = None  # outside attributes read, as at forward (replayed)
        self.saved_tokens: list = []  # digest tokens of the tensors its forward saved (replayed)
        #: (replayed) those tensors, until its forward ends: an op that writes an argument
        #: autograd saved before the write (``rrelu_with_noise``'s noise) makes the token at
        #: pack time stale; such a forward's tokens are taken again at its end
        self.saved_live: list = []
        self.late_tokens = False  # ... as they were taken again (the replay's are, alike)
        self.saved_state: dict = {}  # storage key -> (alias, version) of saved state (replayed)
        #: while its forward runs: a backward inside it (``torch.autograd.grad`` of an energy,
        #: forces = -dE/dx) unpacks saved tensors, which is not the replay point; a replayed
        #: probe's handles hold their tensors until the forward ends, so that such a backward
        #: reads them instead of making checkpoint recompute the forward from inside itself
        self.running = False
        self.direct: list[_ProbeHandle] = []
        self.changed_inputs: list[int] = []  # argument leaves the window changes
        self.written_inputs: list[int] = []  # ... that the segment itself writes
        self.start_index: StateIndex | None = None  # the model's state names at its start
        self.host: list = []  # (HostRNG, state at its start) of those its forward drew from
        self.sparse_reads: list[str] = []  # the model's sparse tensors its forward read
        self.script_calls: list[str] = []  # TorchScript functions its forward called
        self.stateful_hooks: list[str] = []  # state of the user's pack hooks it changed
        self.replay_done = False  # (replayed) its replay has run: nothing more needs its data
        self.param_aliases: list[torch.Tensor] = []  # the parameters its forward ran with
        #: tensors whose ``.grad`` its forward read, with that gradient (see grad_reads)
        self.grad_reads: list = []

    def release(self) -> None:
        """Drop everything the probe holds for its window and its replay: the discovery mode's
        touches and first-touch copies, the observations, the slot objects, the aliases of
        saved state, the generator states and outside values. Called once its contract is
        made (for a replayed probe, once its replay has run too): from then on the contract
        holds what later steps need (names, shapes, versions), never the probe's tensors."""
        mode = self.mode
        mode.touched = {}
        mode.produced = {}
        mode.generators = {}
        mode.generator_states = {}
        self.observations = []
        self.slots = []
        self.saved_state = {}
        self.saved_tokens = []
        self.gens = []
        self.outside = None
        self.start_index = None
        self.host = []
        self.param_aliases = []
        self.grad_reads = []
        self.created = []


class _HostReads:
    """While a probe's forward runs: state read straight into host memory, where no dispatch
    mode sees it (``t.tolist()``, ``t.numpy()``, ``np.asarray(t)``), is watched like state the
    mode sees read (``.item()``, ``float(t)`` and ``int(t)`` dispatch
    ``aten::_local_scalar_dense``, which it does see). A tensor the segment made is ignored
    by the mode's own rule (produced storage)."""

    _NAMES = ("tolist", "numpy", "__array__")

    def __init__(self, mode: DiscoveryMode) -> None:
        self.mode = mode
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> "_HostReads":
        for name in self._NAMES:
            orig = torch.Tensor.__dict__.get(name, _MISSING)
            self._saved.append((name, orig))
            watched = self._watch(getattr(torch.Tensor, name), name != "tolist")
            setattr(torch.Tensor, name, watched)
        return self

    def _watch(self, fn: Callable, writable: bool) -> Callable:
        mode = self.mode

        def watched(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # (any thread's: a worker thread the forward starts reads for it; another
            # thread's reads only over-watch)
            if type(t) is torch.Tensor or isinstance(t, nn.Parameter):
                # (a host view that can be written: no log sees a write through it)
                mode.touch_all([t], copy=writable, host=True)
            return fn(t, *args, **kwargs)

        return watched

    def __exit__(self, *exc: Any) -> None:
        for name, orig in reversed(self._saved):
            if orig is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
        self._saved = []


class _ScriptCalls:
    """While a probe's forward runs: the TorchScript functions and methods it calls
    (``@torch.jit.script``/``torch.jit.trace`` functions, however reached: a global, an
    attribute, an argument). TorchScript's optimising executor compiles a function anew after
    a number of calls, and a replay adds calls: a replay may run another compiled graph than
    the forward did, with other last bits (measured 2.2e-7). Such a segment is kept retained
    (exact, no replay) instead."""

    def __init__(self) -> None:
        self.called: set[str] = set()
        self._saved: list[tuple[type, Any]] = []

    def __enter__(self) -> "_ScriptCalls":
        for cls in (torch._C.ScriptFunction, torch._C.ScriptMethod):
            orig = cls.__call__
            self._saved.append((cls, orig))
            cls.__call__ = self._watch(orig)
        return self

    def _watch(self, fn: Callable) -> Callable:
        called = self.called

        def watched(f: Any, *args: Any, **kwargs: Any) -> Any:
            # (with the optimising executor off, ``torch.jit.optimized_execution(False)``,
            # every call runs the same graph: a replay is exact)
            if torch._C._get_graph_executor_optimize():
                called.add(getattr(f, "qualified_name", None) or getattr(f, "name", "?"))
            return fn(f, *args, **kwargs)

        return watched

    def __exit__(self, *exc: Any) -> None:
        for cls, orig in reversed(self._saved):
            cls.__call__ = orig
        self._saved = []


def _hook_state(hooks: tuple | None) -> list[tuple[str, Any]]:
    """(label, token) of the Python state the user's saved-tensor hooks can rebind: the
    attributes of a bound method's object (or of a callable object) and a closure's cells,
    plain values by value and the rest by identity. A pack hook that rebinds its state while
    it packs (a running scale) packs a replay's tensors, in backward, with other state than
    the forward's. (Containers are compared by identity: a store that an offloading hook
    appends to is not state its packed values depend on.)"""
    out: list[tuple[str, Any]] = []
    for fn in hooks or ():
        f = getattr(fn, "__func__", fn)
        mod = getattr(f, "__module__", None) or ""
        if mod.startswith(("torch.", "lightning_replay")):
            continue  # (checkpoint's, the engine's own)
        owner = getattr(fn, "__self__", None)
        if owner is None and not isinstance(fn, types.FunctionType):
            owner = fn  # a callable object
        if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
            for k, v in list(vars(owner).items()):
                out.append((f"{type(owner).__name__}.{k}", _value_token(v)))
        code = getattr(f, "__code__", None)
        for name, cell in zip(
            code.co_freevars if code else (), getattr(f, "__closure__", None) or ()
        ):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            out.append((f"{getattr(f, '__qualname__', 'hook')}.{name}", _value_token(v)))
    return out


def _as_first(reads: list[tuple[Any, Any]], copies: dict[int, Any]) -> list[tuple]:
    """(owner, name, value as the forward starts) of each read, one copy per object
    (``copies``): a container two owners hold (a dict bound as the default of two hooks) is
    put back as one, shared as the forward shared it."""
    out = []
    for mod, name in reads:
        v = vars(mod).get(name, MISSING)
        if id(v) not in copies:
            copies[id(v)] = _at_forward(v)
        out.append((mod, name, copies[id(v)]))
    return out


def _value_token(v: Any) -> Any:
    if isinstance(v, (bool, int, float, complex, str, bytes, type(None))):
        return ("value", repr(v))
    return ("id", id(v))


class _SparseStateReads(TorchDispatchMode):
    """While a probe's forward runs: which of the model's sparse tensors (a sparse COO or CSR
    buffer or attribute) its ops read. A sparse tensor has no strided storage to snapshot or
    log, and an in-place op on one reallocates its values: the segment is kept retained
    (exact, no replay) instead."""

    def __init__(self, sparse: dict[int, str]) -> None:
        super().__init__()
        self.sparse = sparse
        self.read: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in list(args) + list(kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and id(t) in self.sparse:
                    self.read.add(self.sparse[id(t)])
        return func(*args, **kwargs)


def _sparse_state(model: nn.Module, own: list[nn.Module]) -> dict[int, str]:
    """The model's tensors with no strided storage (sparse layouts) outside the modules
    ``own``, by id: name. (A segment's own sparse buffers and attributes are copied with its
    slots at each forward and put back for the replay: slots.ModuleSlots.)"""
    mine = {id(m) for m in own}
    refs = [(ref, ref.get()) for ref in iter_named_state(model)]
    sparse = [(ref, t) for ref, t in refs if t is not None and t.layout != torch.strided]
    held = {id(t) for ref, t in sparse if id(ref.module) in mine}
    out: dict[int, str] = {}
    for ref, t in sparse:
        if id(t) not in held:
            out.setdefault(id(t), ref.name)
    return out


class _GlobalStateReads:
    """While a probe's forward runs: whether it read or set the state of Python's or numpy's
    global generator (``random.getstate``/``setstate``, ``np.random.get_state``/``set_state``:
    an RNG fork, drawing and then putting the state back, leaves it where it was).
    :attr:`read` holds the ids of the generator objects whose state was touched."""

    def __init__(self) -> None:
        self.read: set[int] = set()
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "_GlobalStateReads":
        targets = [(random, random._inst)]
        np = sys.modules.get("numpy")
        if np is not None:
            targets.append((np.random, np.random.mtrand._rand))
        for module, rng in targets:
            for name in ("getstate", "setstate", "get_state", "set_state"):
                fn = getattr(module, name, None)
                if fn is None or getattr(fn, "__self__", None) is not rng:
                    continue
                self._patched.append((module, name, fn))
                setattr(module, name, self._watch(fn, id(rng)))
        return self

    def _watch(self, fn: Callable, rng_id: int) -> Callable:
        def watched(*args: Any, **kwargs: Any) -> Any:
            self.read.add(rng_id)  # (any thread's, as the host reads above)
            return fn(*args, **kwargs)

        return watched

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched = []


class _ProbeHandle:
    """A saved tensor of a probed forward. Its first unpack is the moment checkpoint would
    replay the segment, so the probe's window ends there: writes made in backward before it
    (a gradient hook on the segment's output) belong to the window."""

    __slots__ = ("inner", "unpack_fn", "probe", "owner", "tensor")

    def __init__(
        self, inner: Any, unpack_fn: Callable, probe: _Probe, owner: "SegmentProbe"
    ) -> None:
        self.inner = inner
        self.unpack_fn = unpack_fn
        self.probe = probe
        self.owner = owner
        self.tensor: torch.Tensor | None = None  # held while the forward runs (replayed)
        probe.live += 1

    def unpack(self) -> torch.Tensor:
        if self.probe.running:  # a backward inside the segment's own forward
            if self.tensor is not None:
                return self.tensor
            return self.unpack_fn(self.inner)
        if self.probe.observations is None:
            self.owner._observe(self.probe)
        if not self.probe.replayed:
            return self.unpack_fn(self.inner)
        try:
            return self.unpack_fn(self.inner)
        except CheckpointError as exc:
            raise self.owner._replay_path_error(self.probe, exc) from exc

    def __del__(self) -> None:
        self.probe.live -= 1


_MISSING = object()


def _argument_objects(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The call's arguments that are objects with state of their own (not tensors, plain
    values, or lists/tuples/dicts of those): a mutable object such as an HF ``Cache``."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()
    ]
    out = []
    for name, v in named:
        leaves, _ = tree_flatten(v)
        if any(not (isinstance(x, torch.Tensor) or is_scalar(x) or callable(x)) for x in leaves):
            out.append((name, v))
    return out


def _live_parts(obj: Any) -> list:
    """The parts of an argument that reach a replay as they are (not rebuilt by
    :func:`~lightning_replay.arguments.unflatten_call`): the values :func:`flatten_call`
    does not walk into, less tensors and plain values."""
    flat, _ = flatten_call((obj,), {})
    return [x for x in flat if not (isinstance(x, torch.Tensor) or is_scalar(x))]


def _parts_token(parts: list) -> list:
    out: list = []
    for x in parts:
        _object_token(x, 0, out)
    return out


def _object_token(obj: Any, depth: int = 0, out: list | None = None) -> list:
    """What an argument object holds, by identity, version and shape (no bytes)."""
    out = [] if out is None else out
    if len(out) > 1024:
        return out
    if isinstance(obj, torch.Tensor):
        out.append(("t", id(obj), obj._version, tuple(obj.shape)))
    elif is_scalar(obj):
        out.append(("v", type(obj).__name__, repr(obj)))
    elif depth >= 4 or isinstance(obj, nn.Module) or callable(obj):
        out.append(("o", id(obj)))
    elif type(obj) in (list, tuple):
        out.append(("s", len(obj)))
        for x in obj:
            _object_token(x, depth + 1, out)
    elif isinstance(obj, dict):
        out.append(("m", tuple(map(repr, obj.keys()))))
        for x in obj.values():
            _object_token(x, depth + 1, out)
    else:
        d = getattr(obj, "__dict__", None)
        out.append(("o", id(obj), tuple(d) if d is not None else None))
        for x in (d or {}).values():
            _object_token(x, depth + 1, out)
    return out


def _holders(modules: list[nn.Module]) -> list[tuple[int, str, Any, dict]]:
    """The holder objects reachable from ``modules`` (as the guard reaches them), each as
    (module index, path, holder, its attributes now)."""
    out: dict[int, tuple[int, str, Any, dict]] = {}
    for i, path, o, *_ in _reachable(modules):
        if isinstance(o, (list, dict, set)):  # a container, or a module's slot dict
            continue
        obj = o.obj if type(o) is SlotView else o
        if id(obj) not in out:
            out[id(obj)] = (i, path, obj, {})
        out[id(obj)][3].update(_guard_attrs(o).items())
    return list(out.values())


def _read_flags(
    own: OutsideReads,
    slots: list,
    created: list,
    holders: list[tuple[int, str, Any, dict]] = (),
    holder_reads: dict[int, dict] | None = None,
) -> set:
    """The fields ``(i, "a", name)`` of a segment's modules that its forward read as flags: a
    bool, a string or enum mode, ``None`` or an attribute absent (``getattr(self, "on",
    False)``), read with the value it held before the forward began (not one the forward set
    first, and not one it created).

    A flag the step turns after the segment ran, inside the probe's window, is what the next
    forward reads, with a value no probe's forward saw: it stays a precondition of the
    contract, so that forward is re-probed. Other fields changed inside the window (a
    temperature annealed, a config's ``problem_type`` the loss sets and no block reads) are
    left to the replay, which puts the forward's values back."""
    index = {id(s.module): i for i, s in enumerate(slots)}
    out = set()
    for (m, name), (_, _, first) in zip(own.reads, own.first):
        if isinstance(name, tuple):  # a registered buffer: not a flag
            continue
        i = index.get(id(m))
        if i is not None and name not in created[i] and _same_flag(slots[i].attrs, name, first):
            out.add((i, "a", name))
    # a holder's attributes: those read, where its class could be traced (HolderReads);
    # else every flag of a holder reached through an attribute the forward read
    read = {(index.get(id(m)), name) for m, name in own.reads}
    for i, path, h, before in holders:
        traced = (holder_reads or {}).get(id(h))
        if traced is not None:
            out |= {(i, "a", f"{path}.{n}") for n, v in traced.items() if _same_flag(before, n, v)}
        elif (i, re.split(r"[.\[]", path, maxsplit=1)[0]) in read:
            out |= {(i, "a", f"{path}.{n}") for n, v in before.items() if is_flag(v)}
    return out


def _predicates(compared: list, model: nn.Module, first: dict) -> list[tuple]:
    """The comparisons a probe's forward logged (``slots.comparisons``), as
    ``Guard.add_predicates`` takes them: with each number's name in the model and its value
    before the forward (``first``: as first read, by (id of its dict, name))."""
    names = {id(m.__dict__): n for n, m in model.named_modules()}

    def label(d: dict, name: str) -> str:
        where = names.get(id(d))
        return f"{where}.{name}" if where else name

    out = []
    for (d, name, *expr), op, other, _, value, field in compared:  # (expr: arithmetic)
        before = first.get((id(d), name), value)
        if type(before) is bool or not isinstance(before, (int, float)):
            before = value  # (it held no number before the forward: set by it first)
        if field is not None:  # compared with another traced number: that one, as it is then
            field = (*field, label(*field))
        out.append((d, name, label(d, name), op, other, before, value, field, *expr))
    return out


def _same_flag(before: Any, name: str, first: Any) -> bool:
    """Whether ``name`` was read as a flag with the value it held before (``before``: the
    attributes then)."""
    was = before.get(name, MISSING)
    if first is MISSING or was is MISSING:
        return first is was
    if isinstance(first, (list, dict, set)) and isinstance(was, (list, dict, set)):
        # a container read whole (a dict of flags): which item is not traced; its contents
        # changed after the forward make the next forward a probe, once (guards._discrete)
        return _guard_contents(first) == _guard_contents(was)
    return is_flag(first) and type(was) is type(first) and was == first


def _outside_label(m: Any, k: Any, names: dict[int, str]) -> str:
    """An attribute read from outside a segment, by its name in the model (``k``: a name, or
    ``(where, name)`` for a registered buffer; ``names``: module names by id), or a
    module-level value's."""
    if id(m) in names:
        if isinstance(k, tuple):  # a buffer by its name; a submodule apart from a plain value
            k = f"{k[1]} (submodule)" if k[0] == "_modules" else k[1]
        return f"{names[id(m)]}.{k}" if names[id(m)] else k
    return describe(m, k)  # a module-level value (module_globals.py)


def _model_generator(model: nn.Module, gen: torch.Generator) -> torch.Generator:
    """The object a module of ``model`` holds for ``gen`` (an attribute, or an item of a list,
    tuple or dict attribute), else ``gen``."""
    for mod in model.modules():
        for v in vars(mod).values():
            items = (
                v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
            )
            for x in items:
                if isinstance(x, torch.Generator) and same_generator(x, gen):
                    return x
    return gen


def _mutable_argument_message(segment: str, argname: str, obj: Any) -> str:
    kind = type(obj).__name__
    if "cache" in kind.lower():
        fix = (
            "This is a key/value cache: turn caching off in training, e.g. "
            "model.config.use_cache = False or use_cache=False in the forward call, as "
            "transformers' own gradient checkpointing does."
        )
    else:
        fix = (
            "Keep that mutation outside the segment, pass the segment what it reads (tensors "
            "or plain values), or leave this segment out of `segments`."
        )
    return (
        f"segment {segment!r} changed its {argname} (a {kind} object) in its forward. A "
        "replay in backward runs the forward again: it would change the object a second "
        "time and read what the step left in it instead of what the forward saw, so this "
        f"segment cannot be replayed exactly. {fix}"
    )


def _contract_detail(c: ReplayContract) -> dict[str, Any]:
    return {
        "option": c.option,
        "changing": {s.name: s.preservation for s in c.changing},
        "generators": c.generators,
        "global_rng": c.uses_global_rng,
        "python_attrs": c.python_attrs,
        "input_aliases": c.input_aliases,
        "activation_bytes": c.activation_bytes,
        "preserved_bytes": c.preserved_bytes(),
    }


class SegmentProbe:
    """The probe and contract building of one segment, an object its runtime composes.

    It reaches the segment through ``seg`` (:class:`~lightning_replay.core.base.ports.ProbedSegment`:
    what it reads of the segment and the contract state it makes), the engine through ``host``
    (:class:`~lightning_replay.core.base.ports.ProbeHost`: the window it probes in), and records
    its contracts and rejections in ``records``. It keeps no state of its own beyond a warning
    given once.
    """

    def __init__(self, seg: ProbedSegment, host: ProbeHost, records: RecordSink) -> None:
        self.seg = seg
        self.host = host
        self.records = records
        self._warned_deep = False  # (the argument objects too deep to copy: warned once)

    # ---------------------------------------------------------------- probe
    def _probe_call(self, args: tuple, kwargs: dict) -> Any:
        """The probe: this forward runs retained (always exact) under the discovery mode."""
        return self._probe_forward(args, kwargs, replayed=False)

    def _probe_forward(
        self, args: tuple, kwargs: dict, replayed: bool, box: dict | None = None
    ) -> Any:
        """Run the probed forward; ``box`` (a replayed probe's) gets the probe as ``"probe"``.
        Nothing else keeps it past its contract: the segment's ``probes`` until then, the
        graph's saved-tensor handles and gradient hook while the graph lives."""
        eng = self.host
        self.seg.status = "probing"
        self.seg.guard.accept()  # this forward's preconditions are what the probe will cover
        # every tensor the call reaches, inside argument objects too (arguments.py)
        flat_call, call_spec = flatten_call(args, kwargs)
        if call_spec.objects:
            why = check_rebuild(flat_call, call_spec)
            if why is not None:
                self.seg.status = "probe"
                raise ReplayConfigError(
                    f"segment {self.seg.name!r} is called with an argument object its replay "
                    f"cannot rebuild as the forward saw it: {why}. Pass the segment its "
                    "tensors (or a dataclass, namedtuple, dict or list of them), or leave this "
                    "segment out of `segments`."
                )
        if call_spec.too_deep and not self._warned_deep:
            self._warned_deep = True
            warnings.warn(
                f"segment {self.seg.name!r} is called with tensors inside argument objects more "
                f"than {MAX_DEPTH} levels deep ({', '.join(call_spec.too_deep[:4])}): they "
                "reach its replay as the live objects, so a field rebound or a tensor written "
                "in place there after the forward would be read new. Pass the segment those "
                "tensors (or a shallower object).",
                RuntimeWarning,
                stacklevel=2,
            )
        leaves = [x for x in flat_call if isinstance(x, torch.Tensor)]
        leaf_keys = [storage_key(t) for t in leaves]
        input_keys = {k for k in leaf_keys if k}
        params = {k for k in (storage_key(p) for p in eng.model.parameters()) if k is not None}
        start_index = StateIndex(eng.model)  # who held each storage when it began
        # A replayed probe watches the arguments that are no model state (the window's
        # activations, kept alive by the call anyway) by their logged writes only ... except
        # those made outside autograd (a batch, a detached tensor), watched as state: the step
        # may write one in place before backward (``x.mul_(0.5)`` after the forward), where no
        # capture sees it, and its replay must read the forward's bytes (a small one's copy; a
        # big one's digest tells the comparison, discovery.COPY_BELOW)
        fresh = {storage_key(t) for t in leaves if t.grad_fn is None}
        uncopied = (
            {k for k in input_keys if not start_index.lookup(k) and k not in fresh}
            if replayed
            else ()
        )
        # State and arguments keep a digest of their first-touch bytes, not a copy, except
        # small ones in a replayed probe (discovery.COPY_BELOW): the old bytes of written regions
        # are in the region log
        mode = DiscoveryMode(
            eng.log,
            input_keys,
            params - input_keys,
            uncopied,
            copy_below=COPY_BELOW if replayed else 0,
        )
        slots = capture_slots(self.seg.modules)
        # State the dispatch mode may never see read (host reads such as .tolist(), reads
        # after a warm-up) is watched all the same: every buffer and tensor attribute.
        mode.touch_all([t for _, t in slot_tensors(slots)])
        # what of the argument objects reaches a replay live (the parts that hold no tensor:
        # a list a cache appends to, a counter object), by identity: a change the forward makes
        # there would be made again by the replay. Objects that hold tensors are rebuilt as
        # copies for the replay (a field rebound or added by the forward stays in the live
        # object), and their tensors are arguments (in-place writes are copied for the replay)
        objects = _argument_objects(args, kwargs)
        live_parts = [_live_parts(o) for _, o in objects]
        before = [_parts_token(parts) for parts in live_parts]
        probe = _Probe(mode, slots, leaf_keys, eng.step)
        probe.replayed = replayed
        # the parameters it ran with, as aliases (its replay's: functional_call may have swapped
        # them in). Not their keys: FSDP2 frees a gathered parameter after the forward and
        # gathers it again elsewhere, and the replay's own activations may land where it was
        if replayed:  # (not a lazy module's uninitialized one: it refuses an alias, and its
            # first forward gives it storage, the live parameter the replay compares then)
            probe.param_aliases = [
                p.detach() for p in eng.model.parameters() if not nn.parameter.is_lazy(p)
            ]
        if replayed:  # where the replay draws from (generators the mode meets are added)
            probe.gens = capture_generators(slot_generators(slots))
        probe.start_index = start_index
        saved: dict = {}
        where = f"segment {self.seg.name!r}"
        top = top_saved_tensors_hooks()
        outer_pack, outer_unpack = top if top is not None else (None, None)
        unpack_fn = outer_unpack if outer_unpack is not None else Saved.unpack

        # a lazy module's parameter has no storage yet: its first forward gives it one, and
        # what autograd saves of it then is a parameter's (its replay leaves parameters out)
        lazy = replayed and any(nn.parameter.is_lazy(p) for p in eng.model.parameters())

        def is_param(key: Any) -> bool:
            if key in params:
                return True
            return (
                lazy
                and key is not None
                and any(storage_key(p) == key for p in eng.model.parameters())
            )

        def pack(t: torch.Tensor) -> _ProbeHandle:
            key = storage_key(t)
            if key is not None:
                saved[key] = t.untyped_storage().nbytes()
            if replayed and not is_param(key):
                # what the replay must save again, byte for byte (a value that only the
                # gradient reads leaves the outputs alike), and the version it was saved at
                probe.saved_tokens.append(digest_token(t))
                probe.saved_live.append(t)
                if (
                    key is not None
                    and key not in probe.saved_state
                    and start_index.lookup(key, t.untyped_storage())
                ):
                    # model state autograd saved: an alias that shares its version counter
                    # (its storage lives on anyway), to refuse a backward plain PyTorch refuses
                    probe.saved_state[key] = (t.detach(), t._version)
            inner = outer_pack(t) if outer_pack is not None else Saved(t, where, eng.state_name)
            handle = _ProbeHandle(inner, unpack_fn, probe, self)
            if replayed:
                handle.tensor = t
                probe.direct.append(handle)
            return handle

        ids = {id(m) for m in self.seg.modules}
        mine = [m for m in eng.model.modules() if id(m) not in ids]
        # (and the modules other installed models register: one this model's segments hold
        # in a plain attribute is no holder, so its reads are traced like the model's own)
        others = registered_modules(ids | {id(m) for m in mine})
        outside = OutsideReads(mine + others)
        own = OutsideReads(self.seg.modules)  # which of its own attributes the forward reads
        holders = _holders(self.seg.modules)  # ... and of the holders it reaches
        held = HolderReads([h for _, _, h, _ in holders])
        hosts = host_rngs(self.seg.modules, self.seg.module_names)  # generators torch never sees
        passed = [as_host_rng(x) for x in tree_flatten((args, kwargs))[0] if is_host_rng(x)]
        host_before = states(hosts + passed)
        peeked = _GlobalStateReads()
        sparse = _sparse_state(eng.model, self.seg.modules)
        sparse_reads = _SparseStateReads(sparse) if sparse else contextlib.nullcontext()
        scripts = _ScriptCalls()
        grads = GradReads()  # .grad its forward reads (backward sets it before the replay)
        # module-level plain values the segment's code names, as before its forward
        copies: dict[int, Any] = {}  # (one copy per object: see slots.capture_outside)
        glob = _as_first(
            globals_read(self.seg.modules, held_functions(self.seg.modules), self.seg.name),
            copies,
        )
        # the user's own saved-tensor hooks, and the state they can rebind, as at its start
        hooks = (box or {}).get("user") if replayed else user_saved_hooks(eng)
        hook_state = _hook_state(hooks)
        eng._segment_depth += 1
        probe.running = True
        try:
            with (
                PATCH_LOCK,  # (one probe's patches at a time, across threads)
                torch.autograd.graph.saved_tensors_hooks(pack, _ProbeHandle.unpack),
                mode,
                outside,
                own,
                held,
                peeked,
                _HostReads(mode),
                sparse_reads,
                scripts,
                grads,
                comparisons() as compared,
            ):
                out = self.seg.orig_forward(*args, **kwargs)
        except BaseException:
            # An abandoned forward (the segment raised): autograd's nodes made before the raise
            # hold this probe through their saved-tensor handles, and the tensors it saved hold
            # those nodes (grad_fn). A cycle through C++ that the garbage collector cannot see:
            # the whole model, its optimizer state and the step's activations would live for
            # the rest of the process. The probe lets go of every tensor the forward made.
            probe.saved_live = []
            probe.saved_state = {}
            # ... and its region-log arms: no replay will undo from them, and an arm left
            # behind kept logging the storage's writes for the rest of the process
            mode.release()
            raise
        finally:
            eng._segment_depth -= 1
            probe.running = False
            for h in probe.direct:
                h.tensor = None
            probe.direct = []
        probe.grad_reads = grads.held()
        if compared:  # numbers read from module attributes that gated a branch
            first = {(id(d), n): v for d, n, v in own.first + outside.first}
            self.seg.guard.add_predicates(_predicates(compared, eng.model, first))
        # attributes the forward itself created (see _observe)
        probe.created = [s.module.__dict__.keys() - s.attrs.keys() for s in slots]
        probe.read_flags = _read_flags(own, slots, probe.created, holders, held.reads)
        # a generator whose state the forward read (and may have put back after drawing) is
        # drawn from as much as one that moved: its replay must start where the forward did
        moved = {id(r) for r in advanced(hosts + passed, host_before)}
        moved |= {id(r) for r in hosts if id(r.obj) in peeked.read}
        drawn = [(r, s) for r, s in zip(hosts + passed, host_before) if id(r) in moved]
        probe.host = [(r, s) for r, s in drawn if r not in passed]  # into the contract
        if replayed:  # with those passed in, which each call captures as its own
            probe.gens += drawn
        if outside.functions:  # methods and properties of modules outside it it called
            named = {(id(vars(m)), k) for m, k, _ in glob}
            glob += _as_first(
                [
                    (mod, name)
                    for mod, name in globals_read((), outside.functions, self.seg.name)
                    if (id(vars(mod)), name) not in named
                ],
                copies,
            )
        known = {(id(vars(m)), k) for m, k in self.seg.outside}  # a globals dict: one owner
        reads = outside.reads + [(mod, name) for mod, name, _ in glob]
        self.seg.outside += [(m, k) for m, k in reads if (id(vars(m)), k) not in known]
        first = outside.first + [(mod.__dict__, name, v) for mod, name, v in glob]
        if replayed and reads:  # values as first read, before the segment wrote
            probe.outside = first
        # the contract holds under the values read: the guard watches them from now on
        if reads:
            names = {id(m): n for n, m in eng.model.named_modules()}
            self.seg.guard.watch_outside(
                [(d, n, _outside_label(m, k, names), v) for (m, k), (d, n, v) in zip(reads, first)]
            )
        mode.finish_segment()
        for (argname, obj), parts, tok in zip(objects, live_parts, before):
            if _parts_token(parts) != tok:
                mode.release()
                self.seg.status = "probe"
                raise ReplayConfigError(_mutable_argument_message(self.seg.name, argname, obj))
        probe.activation_bytes = sum(
            n
            for k, n in saved.items()
            if k not in mode.touched and k not in input_keys and k not in mode.parameter_traffic
        )
        self.seg.input_saved_bytes = sum(n for k, n in saved.items() if k in input_keys)
        self.seg.input_bytes = _unique_bytes(leaves)
        if sparse and sparse_reads.read:
            probe.sparse_reads = sorted(sparse_reads.read)
        probe.script_calls = sorted(scripts.called)
        if hook_state:
            probe.stateful_hooks = [
                k for (k, v), (_, w) in zip(hook_state, _hook_state(hooks)) if v != w
            ]
        self.seg.probes.append(probe)
        if box is not None:
            box["probe"] = probe
        eng._pending_probes.add(self.seg)
        grads = [t for t in tensor_leaves(out) if t.requires_grad]
        if grads:
            torch.autograd.graph.register_multi_grad_hook(
                grads, lambda _g, p=probe: self._grad_arrived(p), mode="any"
            )
        return out

    def _replayed_probe_call(self, args: tuple, kwargs: dict) -> Any:
        """The probe when the step must not keep its activations (a memory budget is set).

        The forward is probed as in :meth:`_probe_call` but runs under checkpoint, so it keeps
        no activations. Its replay in backward, at the moment the window ends, puts back every
        storage the window changed (its first-touch bytes), the slot objects, the generators'
        states and the outside attributes it read, as the forward saw them; the global RNG is
        checkpoint's. The replay's outputs are then compared, byte for byte, with the
        forward's: a difference is recorded as a divergence and the segment's next probe runs
        retained (see :class:`_ProbeReplay`).
        """
        box: dict[str, Any] = {}
        eng = self.host
        # the call as the forward saw it: argument objects' fields rebound later are not read
        flat_call, call_spec = flatten_call(args, kwargs)
        attrs = tensor_attributes(flat_call)  # x.gain on an input: as the forward saw it
        held = state_attributes(self.seg.modules)  # ... and self.q.ptr on a buffer
        backends = backend_flags.capture()  # sdpa_kernel, mkldnn.flags around the forward
        # the user's saved-tensor hooks: applied to what the replay saves (runtime.py)
        user = user_saved_hooks(eng)

        # The arguments reach the replay through this closure, not as checkpoint's inputs:
        # checkpoint would save them and refuse one written in place since (a view of state
        # written after the segment, an input the segment writes itself). Their bytes as the
        # forward saw them are the probe's first-touch copies, put back for the replay.
        box["user"] = user

        def fn(*_device: Any) -> Any:
            replay = box.get("replay")
            if replay is None:
                cached = param_cache.forward_start()
                out = self._probe_forward(args, kwargs, replayed=True, box=box)
                # parametrizations computed here under ``parametrize.cached()`` run again
                box["param_cache"] = param_cache.forward_end(cached)
                box["digests"] = digests(tensor_leaves(out))
                probe = box["probe"]
                if probe.mode.writes_unreturned:
                    probe.saved_tokens = [digest_token(t) for t in probe.saved_live]
                    probe.late_tokens = True
                probe.saved_live = []
                return out
            top = top_saved_tensors_hooks()  # checkpoint's recomputation hooks
            pack_next, unpack_next = top if top is not None else (lambda t: t, lambda t: t)
            params = replay.params
            acct = eng.accountant

            def pack(t: torch.Tensor) -> Any:
                key = storage_key(t)
                if key not in params:
                    replay.saved_tokens.append(digest_token(t))
                    replay.saved.append(t)  # until compared (a kernel's own noise, see there)
                # all alive until backward reads them: keys are distinct. FSDP's gathered
                # parameters are the base's (refilled since the forward, maybe elsewhere)
                if key is not None and not (acct is not None and acct.elsewhere(t)):
                    replay.saved_bytes[key] = t.untyped_storage().nbytes()
                return pack_next(t if user is None else user[1](user[0](t)))

            eng._segment_depth += 1
            born = box.get("param_cache")
            taken = param_cache.replay_enter(born)
            try:
                # the call as at the forward: its containers' and objects' fields then
                a, kw = unflatten_call(flat_call, call_spec)
                with (
                    backend_flags.entered(backends),
                    forward_attributes(flat_call, attrs),
                    with_attributes(held),
                    forward_grads(box["probe"].grad_reads),
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack_next),
                    replay.producers,
                ):
                    out = self.seg.orig_forward(*a, **kw)
            finally:
                eng._segment_depth -= 1
                param_cache.replay_exit(born, taken)
            replay.compare(out)
            return out

        # Checkpoint preserves the RNG of the devices of its inputs: an empty tensor on the
        # accelerator the segment runs on names it (its arguments do not reach checkpoint).
        dev = next(
            (t.device for t in call_tensors(args, kwargs) if t.device.type != "cpu"),
            eng._cuda_device,
        )
        device = (torch.empty(0, device=dev),) if dev is not None else ()
        # The replay runs to the end (no early stop): its outputs are compared.
        with set_checkpoint_early_stop(False):
            return checkpoint(
                fn,
                *device,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=lambda: (contextlib.nullcontext(), _ProbeReplay(self.seg, box)),
            )

    def _replay_path_error(self, probe: _Probe, exc: Exception) -> ReplayError:
        """The replay of a replayed probe took another path than its forward (checkpoint saw
        a different number or kind of saved tensors): recorded as a divergence."""
        self.seg.divergences += 1
        self.seg.retained_probe = True
        self.records.append(
            step=probe.step,
            segment=self.seg.name,
            contract_version=self.seg.version,
            check="probe",
            outcome="divergence",
            detail={
                "what": "replayed probe: the replay took another path",
                "error": str(exc)[:300],
                "action": "next probe retained",
            },
        )
        return ReplayError(
            f"segment {self.seg.name!r}: the replay of its probe (step {probe.step}) took another "
            "path than its forward (torch.utils.checkpoint saw different saved tensors): the "
            "forward depends on something no probe can put back, such as a module-level "
            "setting, the clock or a file (random generators, torch's, Python's and numpy's, "
            "are put back). Keep such values on the model or pass them as arguments, or leave "
            f"this segment out of `segments`. Recorded as a divergence. ({exc})"
        )

    def _grad_arrived(self, probe: _Probe) -> None:
        # The replay point is the first unpack of a saved tensor (see _ProbeHandle); a segment
        # that saved nothing is concluded when this backward ends.
        if probe.observations is None:
            if probe.live == 0:
                self._observe(probe)
            else:
                at_backward_end(lambda: self._observe(probe))

    def _observe(self, probe: _Probe) -> None:
        if probe.observations is not None:
            return
        probe.observations = observe_window(probe.mode, self.host.log, keep_changed=probe.replayed)
        changed = []
        varying = []
        for i, s in enumerate(probe.slots):
            d = s.module.__dict__
            mname = self.seg.module_names.get(id(s.module), self.seg.name)
            for kind, saved, live in (
                ("p", s.params, d["_parameters"]),
                ("b", s.buffers, d["_buffers"]),
            ):
                varying += [
                    (i, kind, k) for k, v in saved.items() if live.get(k, _MISSING) is not v
                ]
            for k, v in s.attrs.items():
                if k in MODULE_INTERNALS or k == "training":
                    continue
                cur = d.get(k, _MISSING)
                if cur is v or (is_scalar(v) and same_value(cur, v)):
                    continue
                if is_scalar(v):
                    changed.append(f"{mname}.{k}")  # (the replay puts it back)
                if (i, "a", k) not in probe.read_flags:
                    # (a flag the forward read, turned after it ran, stays a precondition)
                    varying.append((i, "a", k))
            # created by the segment's own forward (a router's ``self.input_dtype = x.dtype``
            # before it reads it): the replay removes it, its forward sets it again. One the
            # step creates after the segment ran stays a precondition: the next forward may
            # read it, as no probe's forward did
            varying += [
                (i, "a", k)
                for k in probe.created[i] & d.keys()
                if k not in MODULE_INTERNALS and k != "training"
            ]
        probe.changed_attrs = changed
        # rebound or changed inside the window: the replay puts them back
        self.seg.guard.learn_varying(varying, keep=probe.read_flags)
        for ob in probe.observations:
            t = ob.touch
            if t.is_input and ob.changed:
                leaves = [i for i, k in enumerate(probe.leaf_keys) if k == t.key]
                probe.changed_inputs.extend(leaves)
                if t.annotated_write or t.changed_in_segment:
                    probe.written_inputs.extend(leaves)
        if all(p.observations is not None for p in self.seg.probes):
            self._make_contract()

    def finish_stale_probes(self) -> None:
        """Conclude probes whose graph is gone without a backward (no grad reached them).
        A probe whose graph is still alive (two forwards sharing one backward) waits."""
        for p in self.seg.probes:
            if p.live == 0:
                self._observe(p)

    def _make_contract(self) -> None:
        """The new contract version: the current contract extended (union) by the probes.

        Contracts only grow: a re-probe after a precondition changed or a check diverged adds
        what it saw, so a periodic writer converges after one period.
        """
        eng = self.host
        probes, self.seg.probes = self.seg.probes, []
        eng._pending_probes.discard(self.seg)
        index = StateIndex(eng.model)
        old = self.seg.contract
        merged: dict[str, StateEntry] = {}
        bound: dict[str, _Bound] = {}
        if old is not None:
            for b in self.seg.bound:
                e = dataclasses.replace(b.entry, aliases=list(b.entry.aliases))
                merged[e.name] = e
                bound[e.name] = _Bound(e, b.get)
        gens: dict[int, torch.Generator] = {
            id(g): g for _, g in self.seg.generators if not isinstance(g, HostRNG)
        }
        host: dict[int, HostRNG] = {
            id(g.obj): g for _, g in self.seg.generators if isinstance(g, HostRNG)
        }
        uses_rng = old.uses_global_rng if old is not None else False
        full_replay = old.full_replay if old is not None else False
        changed_attrs: set[str] = set(old.python_attrs) if old is not None else set()
        aliases: list[str] = list(old.input_aliases) if old is not None else []
        changed_inputs: set[int] = set(old.changed_inputs) if old is not None else set()
        written_inputs: set[int] = set(old.written_inputs) if old is not None else set()
        act = 0
        self.seg.state_keys = set()
        eng.meter.activation_bytes.pop(self.seg.name, None)  # the new probe's figure is current
        # the probes of one window are its calls: a retained segment keeps them all (issue 31)
        per_window: dict[int, tuple[int, int]] = {}
        for p in probes:
            act = max(act, p.activation_bytes)
            total, n = per_window.get(p.step, (0, 0))
            per_window[p.step] = (total + p.activation_bytes, n + 1)
            self.seg.state_keys.update(p.mode.touched)
            uses_rng |= p.mode.uses_global_rng
            full_replay |= p.mode.writes_unreturned
            if p.sparse_reads and not self.seg.demoted:
                self._keep_for_sparse(p)
            if p.script_calls and not self.seg.demoted:
                self._keep_for_script(p)
            if p.stateful_hooks and not self.seg.demoted:
                self._keep_for_hook(p)
            gens.update(p.mode.generators)
            host.update((id(r.obj), r) for r, _ in p.host)
            changed_attrs.update(p.changed_attrs)
            changed_inputs.update(p.changed_inputs)
            written_inputs.update(p.written_inputs)
            known = {id(r()) for r in self.seg.grad_reads}
            self.seg.grad_reads += [weakref.ref(t) for t, _ in p.grad_reads if id(t) not in known]
            for ob in p.observations or []:
                t = ob.touch
                refs = index.lookup(t.key)
                if not refs and t.is_input:
                    continue  # an argument of this call (see written_inputs), not state
                # who held the storage as the forward began comes first: a slot whose tensor
                # got a new storage in the window (resize_, set_, ``.data = ...``) is named by
                # it, and after ``resize_`` (the old bytes freed in place) another state tensor
                # may live at the old address now (a buffer rebound there)
                start = (
                    p.start_index.lookup(t.key, t.tensor.untyped_storage())
                    if p.start_index is not None
                    else []
                )
                refs = start or refs
                entry, b = self._entry_for(t, refs, eng)
                if entry.name in merged:
                    prev = merged[entry.name]
                    # (the bytes every probe saw read: issue 31)
                    ext = _merge_extent(prev, entry)
                    prev.shape, prev.extent = entry.shape, ext
                    prev.nbytes = entry.nbytes if ext is None else ext[1] - ext[0]
                    entry = prev
                else:
                    merged[entry.name] = entry
                bound[entry.name] = _Bound(entry, b.get)
                if ob.changed:
                    entry.regions_ok = (
                        ob.regions_ok
                        if not entry.changes_in_window
                        else entry.regions_ok and ob.regions_ok
                    )
                    entry.changes_in_window = True
                wrote = t.annotated_write or t.changed_in_segment
                entry.written_by_segment |= wrote
                entry.unannotated_write |= t.changed_in_segment and not t.annotated_write
                entry.region_bytes = max(entry.region_bytes, ob.region_bytes)
                if t.is_input and ob.changed and entry.name not in aliases:
                    aliases.append(entry.name)
        gen_names = []
        self.seg.generators = []
        for g in unique_generators(list(gens.values())):
            gname = find_generator_name(eng.model, g) or f"generator[{len(eng._external)}]"
            # the model's own object, not the dispatcher's fresh wrapper of it: the slots find
            # that one too, and a replay's entry state must hold the generator's state once
            # (5,056 bytes on CPU), not once per wrapper
            g = _model_generator(eng.model, g)
            if gname.startswith("generator["):
                eng._external.append(g)
            gen_names.append(gname)
            self.seg.generators.append((gname, g))
        for r in host.values():  # Python's or numpy's: the replay restores these too
            gen_names.append(r.name)
            self.seg.generators.append((r.name, r))
        self.seg.version += 1
        if old is not None:
            act = max(act, old.activation_bytes) if not probes else act
        if per_window:
            step, (total, n) = max(per_window.items(), key=lambda kv: kv[1])
            eng.meter.window_activation[self.seg.name] = (step, total, n)
        c = ReplayContract(
            segment=self.seg.name,
            version=self.seg.version,
            state=sorted(merged.values(), key=lambda e: e.name),
            generators=sorted(gen_names),
            uses_global_rng=uses_rng,
            python_attrs=sorted(changed_attrs),
            input_aliases=aliases,
            outside_attrs=self._outside_names(),
            changed_inputs=sorted(changed_inputs),
            written_inputs=sorted(written_inputs),
            activation_bytes=act,
            probed_at_step=probes[0].step if probes else 0,
            selective=eng.config.selective_policy is not None,
            full_replay=full_replay,
        )
        order = {e.name: i for i, e in enumerate(c.state)}
        self.seg.bound = sorted(bound.values(), key=lambda b: order[b.entry.name])
        for p in probes:  # the contract is made: the probes' tensors go now (issue 31)
            if not p.replayed or p.replay_done:
                p.release()  # (a replayed probe whose replay is to come: at its end)
        c.apply_option("retain" if self.seg.demoted else self._choose_option(c))
        self.seg.contract = c
        self.seg.contract_size = getattr(eng, "_window_size", 0)
        self.seg._derive()
        self.seg.status = "retain" if c.option == "retain" else "active"
        eng._contracts_changed()
        self.records.append(
            step=eng.step,
            segment=self.seg.name,
            contract_version=c.version,
            check="contract",
            outcome="match",
            detail=_contract_detail(c),
        )

    def _keep_retained(self, probe: _Probe, what: str, message: str) -> None:
        """The segment keeps its activations from now on (exact) for a reason no option can
        serve: a rejection record (``what``, action retain) and one warning (``message``)."""
        self.seg.demoted = True
        self.records.append(
            step=probe.step,
            segment=self.seg.name,
            contract_version=self.seg.version + 1,
            check="probe",
            outcome="rejection",
            detail={"what": what, "action": "retain"},
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _keep_for_sparse(self, probe: _Probe) -> None:
        """The probe's forward read sparse model state, which no option can preserve: the
        segment keeps its activations from now on (exact), recorded and warned once."""
        names = ", ".join(probe.sparse_reads)
        self._keep_retained(
            probe,
            f"reads sparse state {names}",
            f"segment {self.seg.name!r} reads sparse model state ({names}): a sparse tensor has no "
            "strided storage to preserve, and an in-place op on it reallocates its values, so "
            "the segment keeps its activations (retain, exact) instead of replaying. Keep the "
            "sparse tensor dense, or pass it to the segment as an argument, to replay it.",
        )

    def _keep_for_script(self, probe: _Probe) -> None:
        """The probe's forward called TorchScript functions, whose optimising executor may
        run a replay through another compiled graph than the forward (the replay adds calls):
        the segment keeps its activations from now on (exact), recorded and warned once."""
        names = ", ".join(probe.script_calls[:4])
        self._keep_retained(
            probe,
            f"calls TorchScript {names}",
            f"segment {self.seg.name!r} calls TorchScript ({names}): TorchScript's optimising "
            "executor compiles a function anew after a number of calls, and a replay adds "
            "calls, so a replay may compute other last bits than the forward did. The segment "
            "keeps its activations (retain, exact) instead of replaying. Call the eager Python "
            "function inside segments (script it for deployment afterwards) to replay it.",
        )

    def _user_hooks_have_state(self) -> bool:
        """Whether the user's saved-tensor hooks active now hold Python state they could
        rebind while packing (see :func:`_hook_state`)."""
        return bool(_hook_state(user_saved_hooks(self.host)))

    def _keep_for_hook(self, probe: _Probe) -> None:
        """The user's pack hook rebound its own state while the probe's forward packed (a
        running scale): a replay packs its tensors in backward, with the state left by every
        later pack, so its values would differ. The segment keeps its activations from now on
        (exact: the hook packs them in forward, as in plain training), recorded and warned."""
        names = ", ".join(probe.stateful_hooks[:4])
        self._keep_retained(
            probe,
            f"saved-tensor hook changes its state {names}",
            f"segment {self.seg.name!r}: the saved-tensor hook around it changed its own state "
            f"while packing ({names}): a replay packs its tensors in backward, after every "
            "other pack, so a hook whose packed values depend on that state would pack them "
            "differently. The segment keeps its activations (retain, exact) instead of "
            "replaying. Make the pack hook pure (no state its result depends on) to replay.",
        )

    def _outside_names(self) -> list[str]:
        names = {id(m): n for n, m in self.host.model.named_modules()}
        return sorted(_outside_label(m, k, names) for m, k in self.seg.outside)

    def _entry_for(self, touch, refs: list[StateRef], eng: ProbeHost):
        t = touch.tensor
        nbytes = t.untyped_storage().nbytes()
        span = touch.span
        extent = None
        if span is not None and 0 <= span[0] < span[1] <= nbytes and span[1] - span[0] < nbytes:
            extent = [int(span[0]), int(span[1])]
            nbytes = extent[1] - extent[0]
        if refs:
            ref = refs[0]
            live = ref.get()
            shape = list(live.shape) if live is not None else list(t.shape)
            entry = StateEntry(
                ref.name,
                ref.kind,
                shape,
                str(t.dtype).replace("torch.", ""),
                str(t.device),
                nbytes,
                aliases=[r.name for r in refs[1:]],
                extent=extent,
            )
            return entry, _Bound(entry, ref.get)
        for i, x in enumerate(eng._external):  # the same outside tensor seen again
            if x is t or (isinstance(x, torch.Tensor) and storage_key(x) == touch.key):
                name = f"external[{i}]"
                break
        else:
            name = f"external[{len(eng._external)}]"
            eng._external.append(t)
        entry = StateEntry(
            name,
            "external",
            list(t.shape),
            str(t.dtype).replace("torch.", ""),
            str(t.device),
            nbytes,
            extent=extent,
        )
        return entry, _Bound(entry, lambda t=t: t)

    def _choose_option(self, c: ReplayContract) -> str:
        if self.seg.planned_option is not None and self.seg.planned_option in c.available_options():
            return self.seg.planned_option
        p = self.seg.preservation
        if p == "retain":
            return "retain"
        if p == "selective":  # its cheapest preservation by memory, as auto's below
            opts = [o for o in c.available_options() if o in SELECTIVE]
            return min(opts, key=lambda o: (c.preserved_bytes(o), o != "selective_whole"))
        if c.stateless:
            return "recompute"
        if p in ("whole", "regions"):
            return p
        # auto: the cheapest correct option by memory; whole wins ties (no capture work).
        opts = [o for o in c.available_options() if o != "retain" and o not in SELECTIVE]
        return min(opts, key=lambda o: (c.preserved_bytes(o), o != "whole"))

    def set_option(self, option: str) -> None:
        """Apply a planned option to the current contract (and to future re-probes)."""
        self.seg.planned_option = option
        if self.seg.contract is not None:
            self.seg.contract.apply_option(
                "retain"
                if self.seg.demoted
                else option
                if option in self.seg.contract.available_options()
                else self._choose_option(self.seg.contract)
            )
            self.seg._derive()
            if self.seg.status in ("active", "retain"):
                self.seg.status = "retain" if self.seg.contract.option == "retain" else "active"
            self.host._contracts_changed()


def _merge_extent(prev: StateEntry, new: StateEntry) -> list[int] | None:
    """The extent of a state entry seen by two probes: what either read (None: the whole
    storage, as either saw it)."""
    if prev.extent is None or new.extent is None:
        return None
    return [min(prev.extent[0], new.extent[0]), max(prev.extent[1], new.extent[1])]
