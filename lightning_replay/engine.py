"""The replay engine: installs segments on a model and replays them exactly.

Life of a segment:

1. **probe** — its first training-mode forward with grad enabled runs retained (always exact)
   under :class:`~lightning_replay.discovery.DiscoveryMode`; when its backward starts, the
   window's effect on every touched storage is known and a :class:`ReplayContract` is made.
2. **steady** — the forward runs under non-reentrant ``torch.utils.checkpoint``: activations are
   dropped, the entry state the contract names is preserved (whole copies or region undo logs),
   and at replay :class:`_ReplayContext` swaps that state in, runs, and swaps it back.
3. **violation** — replay finds state changed that the contract did not cover: raise
   :class:`ContractViolation`, or record it, bump the contract version and probe again.
"""
from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import functools
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lightning_replay import planner as _planner
from lightning_replay.accounting import MemoryAccountant, Saved
from lightning_replay.budget import Budget, format_bytes
from lightning_replay.contract import OPTIONS, ReplayContract, StateEntry
from lightning_replay.costs import CostMeter, dispatch_overhead
from lightning_replay.discovery import DiscoveryMode, Observation, observe_window
from lightning_replay.errors import ContractViolation, ReplayConfigError, ReplayError
from lightning_replay.planner import InfeasibleBudget
from lightning_replay.preservation import CaptureMode, RegionLog, redo, undo
from lightning_replay.records import RecordStore
from lightning_replay.segments import SegmentSpec, resolve_segments
from lightning_replay.guards import Guard
from lightning_replay.memory import StepPeak, live_model_bytes, profiler_busy
from lightning_replay.slots import (MODULE_INTERNALS, OutsideReads, capture_generators,
                                    capture_outside, capture_slots, is_scalar,
                                    restore_generators, restore_slots, same_value,
                                    slot_generators, slot_tensors, swap_generators,
                                    swap_outside, swap_slots)
from lightning_replay.state import (StateIndex, StateRef, digest, find_generator_name,
                                    storage_bytes, storage_key, swap_, tensor_leaves,
                                    unique_generators)

PRESERVATIONS = ("auto", "whole", "regions", "retain")
#: The options a per-segment preservation pin leaves the planner (``auto``: all of them).
PIN_OPTIONS = {"retain": {"retain"}, "whole": {"whole", "recompute"},
               "regions": {"regions", "recompute"}}
_KEEP = object()
ON_VIOLATION = ("raise", "record")

# module -> its runtime. Weak, so a deepcopy or unpickled copy of a module is a plain module.
_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, SegmentRuntime]" = weakref.WeakKeyDictionary()
_REPLAY_CLASSES: dict[type, type] = {}


def _new_plain(cls: type, *args: Any) -> Any:
    """Unpickle/deep-copy target: a plain instance of the original class."""
    return cls.__new__(cls, *args)


def _replay_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward goes through the segment runtime.

    It keeps the name of ``cls`` (reprs and state_dict keys don't change) and pickles and
    deep-copies as ``cls``, so copies of an installed model are plain models.
    """
    if cls in _REPLAY_CLASSES:
        return _REPLAY_CLASSES[cls]

    def forward(self, *args, **kwargs):
        rt = _RUNTIMES.get(self)
        if rt is None:
            return cls.forward(self, *args, **kwargs)
        return rt(args, kwargs)

    new = type(cls.__name__, (cls,), {"forward": forward,
                                      "__reduce_ex__": _plain_reduce(cls, lambda: new),
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__,
                                      "_lightning_replay_base": cls})
    _REPLAY_CLASSES[cls] = new
    return new


_ROOTS: "weakref.WeakKeyDictionary[nn.Module, ReplayEngine]" = weakref.WeakKeyDictionary()
_ROOT_CLASSES: dict[type, type] = {}


def _root_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward is one engine window (``install(window="root")``).

    Like :func:`_replay_class`, it keeps the name of ``cls`` and copies as ``cls``.
    """
    if cls in _ROOT_CLASSES:
        return _ROOT_CLASSES[cls]

    def forward(self, *args, **kwargs):
        eng = _ROOTS.get(self)
        if eng is None:
            return cls.forward(self, *args, **kwargs)
        eng._explicit_windows += 1
        eng.begin_window(continuation=not torch.is_grad_enabled())
        out = None
        try:
            out = cls.forward(self, *args, **kwargs)
            return out
        finally:
            eng.end_forward(out)

    new = type(cls.__name__, (cls,), {"forward": forward,
                                      "__reduce_ex__": _plain_reduce(cls, lambda: new),
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__,
                                      "_lightning_replay_base": cls})
    _ROOT_CLASSES[cls] = new
    return new


def _plain_reduce(cls: type, swapped: Callable[[], type]) -> Callable:
    def __reduce_ex__(self, protocol):
        rv = cls.__reduce_ex__(self, protocol)
        if isinstance(rv, tuple) and rv and rv[0] is copyreg.__newobj__ and \
                rv[1][0] is swapped():
            rv = (_new_plain, (cls,) + tuple(rv[1][1:])) + tuple(rv[2:])
        return rv
    return __reduce_ex__


def _rank_count() -> int:
    """Processes in the default group (1 without one). The CPU real-peak measurement runs only
    in a single process: each rank would measure its own base, and torch's profiler is not
    safe in forked ranks."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


@dataclasses.dataclass
class _Bound:
    """A contract state entry bound to the live model."""

    entry: StateEntry
    get: Callable[[], torch.Tensor | None]


class _Invocation:
    """Everything one segment call needs at its replay, fixed at its forward.

    It copies what it uses of the contract (each state's preservation, the sandboxed storages,
    the version), so that a re-plan or a re-probe between this forward and its replay changes
    nothing for it.
    """

    __slots__ = ("rt", "version", "option", "step", "checked", "tensors", "prs", "versions",
                 "whole", "metas", "storages", "regions", "gens", "slots", "digests", "preserved_bytes", "replays",
                 "done", "_token", "held", "t_prep", "sandbox_keys", "subs", "kept", "outside",
                 "replaying", "__weakref__")

    def __init__(self, rt: "SegmentRuntime", check_bytes: bool) -> None:
        eng = rt.engine
        c = rt.contract
        self.rt = rt
        self.version = c.version
        self.option = c.option
        self.step = eng.step
        self.held: list = []  # accountant keys this invocation holds until its replay
        self.t_prep = 0.0
        self.checked = check_bytes
        self.tensors: list[tuple[StateEntry, torch.Tensor]] = []
        self.prs: list[str] = []
        self.versions: list[int] = []
        self.whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.metas: list[tuple] = []  # each whole snapshot's offset, shape and stride
        self.storages: list[tuple] = []  # (tensor, storage, offset, shape, stride) at forward
        self.regions: list[tuple[Any, int]] = []
        self.sandbox_keys: list = []
        self.subs: dict[int, torch.Tensor] = {}  # input leaf -> its bytes at forward
        self.preserved_bytes = 0
        self.replays = 0
        self.done = False
        self.kept = False  # holds preserved bytes that the first replay releases
        self.replaying = False
        log = eng.log
        capturing = eng._capturing
        with torch.no_grad():
            for b in rt.bound:
                t = b.get()
                if t is None:
                    continue
                p = b.entry.preservation
                self.tensors.append((b.entry, t))
                self.prs.append(p)
                self.versions.append(t._version)
                if b.entry.kind != "parameter":
                    # its storage, so that a storage swapped in later (``.data = ...``,
                    # ``set_``: no write, no version bump) is swapped back for the replay
                    self.storages.append((t, t.untyped_storage(), t.storage_offset(),
                                          t.shape, t.stride()))
                if p in ("regions", "guard") and capturing:
                    key = storage_key(t)
                    if key is not None:
                        self.regions.append((key, log.arm(key, t)))
                        if p == "regions" and b.entry.written_by_segment:
                            self.sandbox_keys.append(key)
                elif p in ("whole", "regions"):
                    snap = storage_bytes(t).clone()
                    self.whole.append((t, snap))
                    self.metas.append((t.storage_offset(), t.shape, t.stride()))
                    self.preserved_bytes += snap.numel()
                    if eng.accountant is not None:
                        key = ("snapshot", id(snap))
                        eng.accountant.hold(key, snap.numel(), rt.name)
                        self.held.append(key)
        self.kept = bool(self.whole or self.regions)
        self._token = {"done": False}
        if self.regions:
            # Dropped without replay (graph freed, backward never called): disarm anyway.
            weakref.finalize(self, _release_keys, log, [k for k, _ in self.regions], self._token)
        self.slots = capture_slots(rt.modules)
        self.outside = capture_outside(rt.outside) if rt.outside else None
        gens = slot_generators(self.slots)
        ids = {id(g) for g in gens}
        gens += [g for _, g in rt.generators if id(g) not in ids]
        self.gens = capture_generators(gens)
        self.digests = ([digest(t) for _, t in self.tensors] if check_bytes else None)
        eng._held_bytes += self.preserved_bytes

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        self._token["done"] = True
        eng = self.rt.engine
        eng._held_bytes -= self.preserved_bytes
        for key, _ in self.regions:
            eng.log.release(key)
        self.whole = []
        acct = eng.accountant
        if acct is not None:
            for key in self.held:
                acct.drop(key)
        self.held = []


def _release_keys(log: RegionLog, keys: list, token: dict) -> None:
    if not token["done"]:
        token["done"] = True
        for key in keys:
            log.release(key)


class _ReplayContext:
    """Around a replay: check, swap entry state in, sandbox the replay's writes, swap back.

    ``__exit__`` undoes exactly the steps ``__enter__`` completed, also when the replay stops
    early (checkpoint's early stop raises through here) or fails.
    """

    __slots__ = ("inv", "_t0", "_versions", "_regions", "_gens", "_slots", "_sandbox",
                 "_stage", "_resized")

    def __init__(self, inv: _Invocation) -> None:
        self.inv = inv
        self._stage = 0

    def __enter__(self) -> None:
        inv = self.inv
        rt = inv.rt
        eng = rt.engine
        if inv.done and inv.kept:
            raise ReplayError(
                f"segment {rt.name!r} is being replayed a second time for the step {inv.step} "
                "(backward with retain_graph=True?). Its preserved state is gone after the first "
                "replay. Use preservation='retain' for segments whose graph is reused.")
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        self._t0 = time.perf_counter()
        self._check_versions()
        self._versions = [t._version for _, t in inv.tensors]
        self._stage = 1
        with torch.no_grad():
            self._resized = []
            for t, st, *meta in inv.storages:
                if t.untyped_storage().data_ptr() != st.data_ptr():
                    self._resized.append((t, (t.untyped_storage(), t.storage_offset(),
                                              t.shape, t.stride())))
                    t.set_(st, *meta)
            for (t, snap), meta in zip(inv.whole, inv.metas):
                if t.untyped_storage().nbytes() == snap.numel() and \
                        (t.storage_offset(), t.shape, t.stride()) == meta:
                    swap_(storage_bytes(t), snap)
                else:  # resized (resize_, set_) since forward: point it at the old bytes
                    self._resized.append((t, (t.untyped_storage(), t.storage_offset(),
                                              t.shape, t.stride())))
                    t.set_(snap.untyped_storage(), *meta)
            regions = [eng.log.since(key, mark) for key, mark in inv.regions]
            if regions:
                rt.last_preserved_bytes = inv.preserved_bytes + sum(
                    e.nbytes for entries in regions for e in entries)
            for entries in reversed(regions):
                undo(entries)
            self._regions = regions
        self._stage = 2
        # the objects each slot held at forward (rebound tensors, generators, plain values)
        self._slots = swap_slots(inv.slots)
        if inv.outside:
            self._slots += swap_outside(inv.outside)
        self._gens = swap_generators(inv.gens)
        self._stage = 3
        if inv.digests is not None:
            rt._check_state_digests(inv)
        self._sandbox = None
        if inv.sandbox_keys:
            # The replay's own writes to region-preserved state are logged and undone after it.
            log = RegionLog()
            for key in inv.sandbox_keys:
                log.arm(key)
            mode = CaptureMode(log)
            mode.__enter__()
            self._sandbox = mode
        self._stage = 4
        inv.replaying = True
        eng._segment_depth += 1
        rt.replays += 1
        eng._replays_this_step += 1
        if eng.accountant is not None:
            eng._replay_started(eng.meter.activation_bytes.get(rt.name,
                                                               rt.contract.activation_bytes))

    def __exit__(self, *exc) -> bool:
        inv = self.inv
        stage = self._stage
        self._stage = 0
        if stage >= 4:
            inv.replaying = False
            inv.rt.engine._segment_depth -= 1
            if self._sandbox is not None:
                self._sandbox.__exit__(None, None, None)
                for entries in self._sandbox.log.logs.values():
                    undo(entries)
        if stage >= 3:
            restore_generators(self._gens)
            restore_slots(self._slots)
        if stage >= 2:
            with torch.no_grad():
                for entries in self._regions:
                    redo(entries)
                resized = {id(t) for t, _ in self._resized}
                _restore_live([(t, snap) for t, snap in inv.whole if id(t) not in resized])
                for t, live in reversed(self._resized):
                    t.set_(*live)
        if stage >= 1:
            _reset_versions([t for _, t in inv.tensors], self._versions)
            inv.release()
            eng = inv.rt.engine
            if eng.measure_costs and stage >= 4 and (eng._sync or not eng._cuda):
                if eng._sync:
                    torch.cuda.synchronize(eng._cuda_device)
                eng._record_replay_time(inv, time.perf_counter() - self._t0)
        return False

    def _check_versions(self) -> None:
        inv = self.inv
        rt = inv.rt
        log = rt.engine.log
        marks = dict(inv.regions)
        for (entry, t), p, v0 in zip(inv.tensors, inv.prs, inv.versions):
            if p == "whole":
                continue
            if p in ("regions", "guard"):
                key = storage_key(t)
                if key not in marks:
                    continue  # no capture in that window: snapshotted whole, or not armed
                expected = log.expected_version(key, t, marks[key], v0)
                if expected is None:
                    continue
            else:
                expected = v0
            if t._version != expected:
                what = ("was written outside the logged window" if p in ("regions", "guard")
                        else "was modified in place between the segment's forward and its replay")
                rt._violation(entry.name, f"{what} (version {v0} at forward, {t._version} at "
                                          f"replay, expected {expected})", inv)

def _restore_live(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # After the swap in, each snapshot holds the live bytes and is dropped after the replay:
    # one copy back (not a second three-pass swap) restores them.
    with torch.no_grad():
        for t, snap in pairs:
            storage_bytes(t).copy_(snap)


def _reset_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    # The replay's own in-place ops bumped versions of live state that is byte-for-byte back
    # as it was; resetting keeps autograd's saved-tensor checks and our own checks truthful.
    if tensors:
        torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


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
        self.changed_inputs: list[int] = []  # argument leaves the window changes
        self.written_inputs: list[int] = []  # ... that the segment itself writes
        self.start_index: StateIndex | None = None  # the model's state names at its start


class _ProbeHandle:
    """A saved tensor of a probed forward. Its first unpack is the moment checkpoint would
    replay the segment, so the probe's window ends there: writes made in backward before it
    (a gradient hook on the segment's output) belong to the window."""

    __slots__ = ("inner", "unpack_fn", "probe", "rt")

    def __init__(self, inner: Any, unpack_fn: Callable, probe: _Probe,
                 rt: "SegmentRuntime") -> None:
        self.inner = inner
        self.unpack_fn = unpack_fn
        self.probe = probe
        self.rt = rt
        probe.live += 1

    def unpack(self) -> torch.Tensor:
        if self.probe.observations is None:
            self.rt._observe(self.probe)
        return self.unpack_fn(self.inner)

    def __del__(self) -> None:
        self.probe.live -= 1


class SegmentRuntime:
    """Per-segment state: its contract, mode and counters. Called in place of its forward."""

    def __init__(self, engine: "ReplayEngine", name: str, module: nn.Module,
                 preservation: str) -> None:
        self.engine = engine
        self.name = name
        self.module = module
        self.orig_class = type(module)
        self.orig_forward = functools.partial(self.orig_class.forward, module)
        self.modules = list(module.modules())
        self.module_names = {id(m): (f"{name}.{n}" if n else name)
                             for n, m in module.named_modules()}
        self.guard = Guard(self.modules)
        self.outside: list[tuple[nn.Module, str]] = []  # plain attributes read from outside
        self.preservation = preservation
        self.contract: ReplayContract | None = None
        self.status = "probe"  # probe | probing | active | retain
        self.demoted = False  # retained for good after a second divergence
        self.version = 0
        self.bound: list[_Bound] = []
        self.generators: list[tuple[str, torch.Generator]] = []
        self.probes: list[_Probe] = []
        self.forwards = 0
        self.replays = 0
        self.violations = 0
        self.checks = 0
        self.divergences = 0
        self.reprobes = 0
        self.reactions = 0
        self.last_preserved_bytes = 0
        self.order = -1
        self.planned_option: str | None = None
        self.input_bytes = 0
        self.input_saved_bytes = 0
        self.state_keys: set = set()  # storages the probe saw as state (not activations)

    # ---------------------------------------------------------------- dispatch
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        if not (self.module.training and torch.is_grad_enabled()) or eng._suspended \
                or eng._segment_depth:
            # A segment called inside another segment's forward or replay is part of it: the
            # outer segment's contract covers its state and the outer replay re-runs it.
            return self.orig_forward(*args, **kwargs)
        self.forwards += 1
        if self.order < 0:
            self.order = eng._next_order()
        if self.status in ("active", "retain") and not self.demoted:
            changed = self.guard.changed()
            if changed:
                self._reprobe(changed)
        if eng._window_depth and eng.accountant is None and self.status == "active" and \
                not eng._check_grad:
            return self._replay_call(args, kwargs)  # the steady-state fast path
        with eng._implicit_window(), eng._tagged(self.name):
            if self.status in ("probe", "probing"):
                return self._probe_call(args, kwargs)
            option = self.contract.option if self.contract else "retain"
            if option == "retain" or self.status == "retain":
                if eng._check_grad and eng.measure_costs and self.contract is not None:
                    return self._measured_call(args, kwargs)
                return self._plain_call(args, kwargs)
            if eng._check_grad and self.name in eng._checked and \
                    not self.contract.written_inputs:
                return self._checked_call(args, kwargs)
            return self._replay_call(args, kwargs)

    def _plain_call(self, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        eng._segment_depth += 1
        try:
            return self.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1

    def _reprobe(self, changed: list) -> None:
        """A precondition of the contract changed: probe this forward and extend the contract."""
        names = [self._field_name(k) for k in changed]
        self.status = "probe"
        self.reprobes += 1
        eng = self.engine
        eng.records.append(step=eng.step + (0 if eng._window_depth else 1), segment=self.name,
                           contract_version=self.contract.version if self.contract else 0,
                           check="guard", outcome="rejection",
                           detail={"changed": names[:16], "action": "re-probe"})
        eng._contracts_changed()

    def _field_name(self, key: Any) -> str:
        if not isinstance(key, tuple):
            return str(key)
        mod = self.module_names.get(id(self.modules[key[0]]), self.name)
        return f"{mod}.{key[1] if len(key) == 2 else key[2]}"

    # ---------------------------------------------------------------- probe
    def _probe_call(self, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        self.status = "probing"
        self.guard.accept()  # this forward's preconditions are what the probe will cover
        leaves = tensor_leaves((args, kwargs))
        leaf_keys = [storage_key(t) for t in leaves]
        input_keys = {k for k in leaf_keys if k}
        params = {k for k in (storage_key(p) for p in eng.model.parameters()) if k is not None}
        mode = DiscoveryMode(eng.log, input_keys, params - input_keys)
        slots = capture_slots(self.modules)
        # State the dispatch mode may never see read (host reads such as .tolist(), reads
        # after a warm-up) is watched all the same: every buffer and tensor attribute.
        mode.touch_all([t for _, t in slot_tensors(slots)])
        objects = _argument_objects(args, kwargs)
        before = [_object_token(o) for _, o in objects]
        probe = _Probe(mode, slots, leaf_keys, eng.step)
        probe.start_index = StateIndex(eng.model)  # who held each storage when it began
        saved: dict = {}
        where = f"segment {self.name!r}"
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (None, None)
        unpack_fn = outer_unpack if outer_unpack is not None else Saved.unpack

        def pack(t: torch.Tensor) -> _ProbeHandle:
            key = storage_key(t)
            if key is not None:
                saved[key] = t.untyped_storage().nbytes()
            inner = outer_pack(t) if outer_pack is not None else Saved(t, where, eng.state_name)
            return _ProbeHandle(inner, unpack_fn, probe, self)

        ids = {id(m) for m in self.modules}
        outside = OutsideReads([m for m in eng.model.modules() if id(m) not in ids])
        eng._segment_depth += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _ProbeHandle.unpack), mode, \
                    outside:
                out = self.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1
        known = {(id(m), k) for m, k in self.outside}
        self.outside += [(m, k) for m, k in outside.reads if (id(m), k) not in known]
        mode.finish_segment()
        for (argname, obj), tok in zip(objects, before):
            if _object_token(obj) != tok:
                mode.release()
                self.status = "probe"
                raise ReplayConfigError(_mutable_argument_message(self.name, argname, obj))
        probe.activation_bytes = sum(n for k, n in saved.items()
                                     if k not in mode.touched and k not in input_keys
                                     and k not in mode.parameter_traffic)
        self.input_saved_bytes = sum(n for k, n in saved.items() if k in input_keys)
        self.input_bytes = _unique_bytes(leaves)
        self.probes.append(probe)
        eng._pending_probes.add(self)
        grads = [t for t in tensor_leaves(out) if t.requires_grad]
        if grads:
            torch.autograd.graph.register_multi_grad_hook(
                grads, lambda _g, p=probe: self._grad_arrived(p), mode="any")
        return out

    def _grad_arrived(self, probe: _Probe) -> None:
        # The replay point is the first unpack of a saved tensor (see _ProbeHandle); a segment
        # that saved nothing is concluded when this backward ends.
        if probe.observations is None:
            if probe.live == 0:
                self._observe(probe)
            else:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._observe(probe))

    def _observe(self, probe: _Probe) -> None:
        if probe.observations is not None:
            return
        probe.observations = observe_window(probe.mode, self.engine.log)
        changed = []
        varying = []
        for i, s in enumerate(probe.slots):
            d = s.module.__dict__
            mname = self.module_names.get(id(s.module), self.name)
            for kind, saved, live in (("p", s.params, d["_parameters"]),
                                      ("b", s.buffers, d["_buffers"])):
                varying += [(i, kind, k) for k, v in saved.items()
                            if live.get(k, _MISSING) is not v]
            for k, v in s.attrs.items():
                if k in MODULE_INTERNALS or k == "training":
                    continue
                cur = d.get(k, _MISSING)
                if cur is v or (is_scalar(v) and same_value(cur, v)):
                    continue
                varying.append((i, "a", k))
                if is_scalar(v):
                    changed.append(f"{mname}.{k}")
        probe.changed_attrs = changed
        # rebound or changed inside the window: the replay puts them back
        self.guard.learn_varying(varying)
        for ob in probe.observations:
            t = ob.touch
            if t.is_input and ob.changed:
                leaves = [i for i, k in enumerate(probe.leaf_keys) if k == t.key]
                probe.changed_inputs.extend(leaves)
                if t.annotated_write or t.changed_in_segment:
                    probe.written_inputs.extend(leaves)
        if all(p.observations is not None for p in self.probes):
            self._make_contract()

    def finish_stale_probes(self) -> None:
        """Conclude probes whose graph is gone without a backward (no grad reached them).
        A probe whose graph is still alive (two forwards sharing one backward) waits."""
        for p in self.probes:
            if p.live == 0:
                self._observe(p)

    def _make_contract(self) -> None:
        """The new contract version: the current contract extended (union) by the probes.

        Contracts only grow: a re-probe after a precondition changed or a check diverged adds
        what it saw, so a periodic writer converges after one period.
        """
        eng = self.engine
        probes, self.probes = self.probes, []
        eng._pending_probes.discard(self)
        index = StateIndex(eng.model)
        old = self.contract
        merged: dict[str, StateEntry] = {}
        bound: dict[str, _Bound] = {}
        if old is not None:
            for b in self.bound:
                e = dataclasses.replace(b.entry, aliases=list(b.entry.aliases))
                merged[e.name] = e
                bound[e.name] = _Bound(e, b.get)
        gens: dict[int, torch.Generator] = {id(g): g for _, g in self.generators}
        uses_rng = old.uses_global_rng if old is not None else False
        changed_attrs: set[str] = set(old.python_attrs) if old is not None else set()
        aliases: list[str] = list(old.input_aliases) if old is not None else []
        changed_inputs: set[int] = set(old.changed_inputs) if old is not None else set()
        written_inputs: set[int] = set(old.written_inputs) if old is not None else set()
        act = 0
        self.state_keys = set()
        eng.meter.activation_bytes.pop(self.name, None)  # the new probe's figure is current
        for p in probes:
            act = max(act, p.activation_bytes)
            self.state_keys.update(p.mode.touched)
            uses_rng |= p.mode.uses_global_rng
            gens.update(p.mode.generators)
            changed_attrs.update(p.changed_attrs)
            changed_inputs.update(p.changed_inputs)
            written_inputs.update(p.written_inputs)
            for ob in p.observations or []:
                t = ob.touch
                refs = index.lookup(t.key)
                if not refs and t.is_input:
                    continue  # an argument of this call (see written_inputs), not state
                if not refs and p.start_index is not None:
                    # a slot whose tensor got a new storage in the window (resize_, set_,
                    # ``.data = ...``): the entry follows the slot, not the dead storage
                    refs = p.start_index.lookup(t.key)
                entry, b = self._entry_for(t, refs, eng)
                if entry.name in merged:
                    prev = merged[entry.name]
                    prev.shape, prev.nbytes = entry.shape, entry.nbytes
                    entry = prev
                else:
                    merged[entry.name] = entry
                bound[entry.name] = _Bound(entry, b.get)
                if ob.changed:
                    entry.regions_ok = ob.regions_ok if not entry.changes_in_window \
                        else entry.regions_ok and ob.regions_ok
                    entry.changes_in_window = True
                wrote = t.annotated_write or t.changed_in_segment
                entry.written_by_segment |= wrote
                entry.unannotated_write |= t.changed_in_segment and not t.annotated_write
                entry.region_bytes = max(entry.region_bytes, ob.region_bytes)
                if t.is_input and ob.changed and entry.name not in aliases:
                    aliases.append(entry.name)
        gen_names = []
        self.generators = []
        for g in unique_generators(list(gens.values())):
            gname = find_generator_name(eng.model, g) or f"generator[{len(eng._external)}]"
            if gname.startswith("generator["):
                eng._external.append(g)
            gen_names.append(gname)
            self.generators.append((gname, g))
        self.version += 1
        if old is not None:
            act = max(act, old.activation_bytes) if not probes else act
        c = ReplayContract(segment=self.name, version=self.version,
                           state=sorted(merged.values(), key=lambda e: e.name),
                           generators=sorted(gen_names), uses_global_rng=uses_rng,
                           python_attrs=sorted(changed_attrs), input_aliases=aliases,
                           outside_attrs=self._outside_names(),
                           changed_inputs=sorted(changed_inputs),
                           written_inputs=sorted(written_inputs),
                           activation_bytes=act,
                           probed_at_step=probes[0].step if probes else 0)
        order = {e.name: i for i, e in enumerate(c.state)}
        self.bound = sorted(bound.values(), key=lambda b: order[b.entry.name])
        c.apply_option("retain" if self.demoted else self._choose_option(c))
        self.contract = c
        self._derive()
        self.status = "retain" if c.option == "retain" else "active"
        eng._contracts_changed()
        eng.records.append(step=eng.step, segment=self.name, contract_version=c.version,
                           check="contract", outcome="match", detail=_contract_detail(c))

    def _outside_names(self) -> list[str]:
        names = {id(m): n for n, m in self.engine.model.named_modules()}
        out = []
        for m, k in self.outside:
            if id(m) in names:
                k = k[1] if isinstance(k, tuple) else k
                out.append(f"{names[id(m)]}.{k}" if names[id(m)] else k)
        return sorted(out)

    def _entry_for(self, touch, refs: list[StateRef], eng: "ReplayEngine"):
        t = touch.tensor
        nbytes = t.untyped_storage().nbytes()
        if refs:
            ref = refs[0]
            live = ref.get()
            shape = list(live.shape) if live is not None else list(t.shape)
            entry = StateEntry(ref.name, ref.kind, shape, str(t.dtype).replace("torch.", ""),
                               str(t.device), nbytes, aliases=[r.name for r in refs[1:]])
            return entry, _Bound(entry, ref.get)
        for i, x in enumerate(eng._external):  # the same outside tensor seen again
            if x is t or (isinstance(x, torch.Tensor) and storage_key(x) == touch.key):
                name = f"external[{i}]"
                break
        else:
            name = f"external[{len(eng._external)}]"
            eng._external.append(t)
        entry = StateEntry(name, "external", list(t.shape), str(t.dtype).replace("torch.", ""),
                           str(t.device), nbytes)
        return entry, _Bound(entry, lambda t=t: t)

    def _choose_option(self, c: ReplayContract) -> str:
        if self.planned_option is not None and self.planned_option in c.available_options():
            return self.planned_option
        p = self.preservation
        if p == "retain":
            return "retain"
        if c.stateless:
            return "recompute"
        if p in ("whole", "regions"):
            return p
        # auto: the cheapest correct option by memory; whole wins ties (no capture work).
        opts = [o for o in c.available_options() if o != "retain"]
        return min(opts, key=lambda o: (c.preserved_bytes(o), o != "whole"))

    def _derive(self) -> None:
        """Cached lookups the per-step path uses."""
        c = self.contract
        self.last_preserved_bytes = c.preserved_bytes() if c else 0

    def set_option(self, option: str) -> None:
        """Apply a planned option to the current contract (and to future re-probes)."""
        self.planned_option = option
        if self.contract is not None:
            self.contract.apply_option(
                "retain" if self.demoted else
                option if option in self.contract.available_options()
                else self._choose_option(self.contract))
            self._derive()
            if self.status in ("active", "retain"):
                self.status = "retain" if self.contract.option == "retain" else "active"
            self.engine._contracts_changed()

    # ---------------------------------------------------------------- steady state
    def _prepare(self, args: tuple, kwargs: dict, check_bytes: bool):
        """Take the invocation's entry state; returns it with the call's flattened arguments
        as checkpoint gets them and their tree spec."""
        eng = self.engine
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        t0 = time.perf_counter()
        inv = _Invocation(self, check_bytes)
        flat, spec = tree_flatten((args, kwargs))
        written = self.contract.changed_inputs
        changing = {k for k in (storage_key(t) for (e, t) in inv.tensors
                                if e.changes_in_window) if k is not None}
        if written or changing:
            # An argument whose bytes the window changes (the segment writes it in place, the
            # step writes it after the segment, or it is a view of changing state) reaches
            # checkpoint as a copy of its forward bytes, which the replay computes from; the
            # forward itself runs on the live tensor, so its in-place writes are seen as in
            # plain PyTorch.
            j = -1
            with torch.no_grad():
                for i, x in enumerate(flat):
                    if not isinstance(x, torch.Tensor):
                        continue
                    j += 1
                    if j in written or (changing and storage_key(x) in changing):
                        snap = x.detach().clone()
                        inv.subs[i] = (x, snap)
                        inv.preserved_bytes += snap.untyped_storage().nbytes()
                        eng._held_bytes += snap.untyped_storage().nbytes()
            inv.kept = inv.kept or bool(inv.subs)
        call = [inv.subs[i][1] if i in inv.subs else x for i, x in enumerate(flat)]
        acct = eng.accountant
        if acct is not None or eng.measure_costs:
            leaves = [x for x in call if isinstance(x, torch.Tensor)]
            if eng.measure_costs:
                eng.meter.input_bytes[self.name] = _unique_bytes(leaves)
            if acct is not None:
                for t in leaves:
                    key = acct.hold_tensor(t, self.name)
                    if key is not None:
                        inv.held.append(key)
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        inv.t_prep = time.perf_counter() - t0
        return inv, call, spec

    def _replay_call(self, args: tuple, kwargs: dict) -> Any:
        inv, call, spec = self._prepare(args, kwargs, self.engine._check_bytes)
        eng = self.engine
        forward = self.orig_forward

        def fn(*flat: Any) -> Any:
            if inv.subs:
                flat = list(flat)
                for i, (live, _) in inv.subs.items():
                    if inv.replaying:  # a fresh copy of the forward bytes (writable)
                        x = flat[i].detach()
                        flat[i] = (x.requires_grad_() if live.requires_grad else x).clone()
                    else:
                        flat[i] = live
            a, kw = tree_unflatten(list(flat), spec)
            if inv.replaying:
                return forward(*a, **kw)
            eng._segment_depth += 1
            try:
                return forward(*a, **kw)
            finally:
                eng._segment_depth -= 1

        # The global RNG is always preserved (torch's default): a segment may draw from it
        # only later (a dropout warming up from p=0, or put in train mode after the probe).
        return checkpoint(fn, *call, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), _ReplayContext(inv)))

    def _measured_call(self, args: tuple, kwargs: dict) -> Any:
        """A forward that keeps its graph (checked or retained on a checked step), measuring
        what it saves: A(s) at today's shapes (the probe's figure goes stale when shapes
        change)."""
        eng = self.engine
        saved: dict = {}
        exclude = self.state_keys | {storage_key(t) for t in tensor_leaves((args, kwargs))}
        eng._segment_depth += 1
        try:
            with _saving_counted(saved, exclude, f"segment {self.name!r}", eng.state_name):
                out = self.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1
        if eng.measure_costs:
            eng.meter.activation_bytes[self.name] = sum(saved.values())
        return out

    def _checked_call(self, args: tuple, kwargs: dict) -> Any:
        """Derivative check: run the segment with its graph, replay it beside it at backward.

        The forward runs ordinarily on detached inputs (the *reference* graph) and its outputs
        reach the model through :class:`_CheckedSegment`, whose backward takes the reference
        gradients from that graph, replays the segment under its contract, compares, and hands
        the reference gradients on: training always uses the reference, and a checked step costs
        one replay forward and backward more than a plain one.
        """
        eng = self.engine
        inv, call, spec = self._prepare(args, kwargs, eng._check_bytes)
        rng = _rng_states(eng._cuda_device)
        autocast = _autocast_state()
        # the reference forward starts from detached leaves with the forward's bytes (a copy
        # where the window changes an argument); gradients reach the live arguments
        in_req, leaves, ref_flat = [], [], list(call)
        for i, x in enumerate(call):
            live = inv.subs[i][0] if i in inv.subs else x
            if isinstance(live, torch.Tensor) and live.requires_grad:
                leaf = x.detach().requires_grad_()
                in_req.append(live)
                leaves.append(leaf)
                ref_flat[i] = leaf
        args2, kwargs2 = tree_unflatten(ref_flat, spec)
        out = self._measured_call(args2, kwargs2)  # the reference forward keeps its graph
        outs = _grad_outputs(out)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not outs:
            inv.release()
            return out
        box = _CheckBox(self, inv, args2, kwargs2, leaves, params,
                        outs, rng, autocast,
                        [digest(t) for t in tensor_leaves(out)] if eng._check_bytes else None)
        bridged = _CheckedSegment.apply(box, *in_req, *params)
        by_id = {id(o): b for o, b in zip(outs, bridged)}
        return tree_map(lambda x: by_id.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    def _compare_grads(self, box: "_CheckBox", grads: list[torch.Tensor]
                       ) -> list[torch.Tensor | None]:
        """Reference and replayed gradients of one checked call; returns the reference."""
        eng = self.engine
        inv = box.inv
        grads = [torch.zeros_like(o) if g is None else g for o, g in zip(box.outs, grads)]
        with torch.enable_grad():
            ref = torch.autograd.grad(box.outs, box.inputs + box.params, grads,
                                      allow_unused=True)
            box.outs = []  # the reference graph is freed
            in2 = [a.detach().requires_grad_() for a in box.inputs]
            swap = {id(a): b for a, b in zip(box.inputs, in2)}
            args2, kwargs2 = tree_map(lambda x: swap.get(id(x), x)
                                      if isinstance(x, torch.Tensor) else x,
                                      (box.args, box.kwargs))
            # A checked replay leaks nothing into the model, whatever the contract missed:
            # every buffer and tensor attribute of the segment is put back byte for byte
            # (slots, generators and the global RNG are put back by the replay context and
            # fork_rng). Backward runs outside the forward's autocast: re-enter it, as
            # checkpoint does for its own recomputation.
            sandbox = _BytesSandbox([t for _, t in slot_tensors(capture_slots(self.modules))])
            try:
                with _ReplayContext(inv), _forked_rng(box.rng), contextlib.ExitStack() as ac:
                    for dev, enabled, dtype in box.autocast:
                        ac.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
                    out2 = self.orig_forward(*args2, **kwargs2)
            finally:
                sandbox.restore()
            outs2 = _grad_outputs(out2)
            if len(outs2) == len(grads) and all(a.shape == b.shape
                                                for a, b in zip(outs2, grads)):
                rep = torch.autograd.grad(outs2, in2 + box.params, grads, allow_unused=True)
            else:
                rep = None
        names = [f"input[{i}]" for i in range(len(box.inputs))] + \
            [f"{self.name}.{n}" for n, p in self.module.named_parameters() if p.requires_grad]
        bad = []
        if rep is None:
            bad.append(f"outputs: the replay produced {len(outs2)} differentiable outputs "
                       f"{[tuple(t.shape) for t in outs2]}, the forward "
                       f"{[tuple(g.shape) for g in grads]}")
        tolerated = []
        tol = (GRAD_RTOL, GRAD_ATOL)
        if rep is not None:
            for n, a, b in zip(names, ref, rep):
                if (a is None) != (b is None):
                    bad.append(f"{n}: missing")
                elif a is not None and not _bitwise_equal(a, b):
                    diff = f"max abs diff {float((a.double() - b.double()).abs().max()):.3g}"
                    rtol, atol = grad_tolerance(a.dtype)
                    if _nondeterministic(a) and torch.allclose(a, b, rtol=rtol, atol=atol):
                        tolerated.append(f"{n}: {diff}")
                        tol = max(tol, (rtol, atol))
                    else:
                        bad.append(f"{n}: {diff}")
        self.checks += 1
        c = self.contract
        if bad:
            self.divergences += 1
        detail = {"compared": len(names), "differ": bad[:16]}
        if tolerated:
            detail["within_tolerance"] = {"rtol": tol[0], "atol": tol[1],
                                          "tensors": tolerated[:16]}
        eng.records.append(step=inv.step, segment=self.name, contract_version=inv.version,
                           check="grad", outcome="divergence" if bad else "match",
                           detail=detail)
        diverged = bool(bad)
        if box.out_digests is not None:
            d2 = [digest(t) for t in tensor_leaves(out2)]
            same = d2 == box.out_digests
            if not same:
                self.divergences += 1
                diverged = True
            eng.records.append(step=inv.step, segment=self.name, contract_version=inv.version,
                               check="bytes", outcome="match" if same else "divergence",
                               detail={"what": "replayed outputs", "outputs": len(d2)})
        if diverged:
            self._diverged(inv)
        return list(ref)

    def _diverged(self, inv: _Invocation) -> None:
        """A check saw a replay differ. The step itself trained on the reference (derivative
        check) or the contract state was found wrong (byte check); from now on: the first time,
        re-probe the segment and extend its contract; the second time, retain it for good
        (exact by construction)."""
        if self.demoted:
            return
        eng = self.engine
        self.reactions += 1
        if self.reactions == 1:
            action = "re-probe"
            if self.status in ("active", "retain"):
                self.status = "probe"
        else:
            action = "retain"
            self.demoted = True
            self.planned_option = "retain"
            if self.contract is not None:
                self.contract.apply_option("retain")
                self._derive()
            if self.status in ("active", "retain"):
                self.status = "retain"
        eng.records.append(step=inv.step, segment=self.name, contract_version=inv.version,
                           check="reaction", outcome="rejection",
                           detail={"action": action, "divergences": self.divergences})
        eng._contracts_changed()

    def _check_state_digests(self, inv: _Invocation) -> None:
        eng = self.engine
        now = [digest(t) for _, t in inv.tensors]
        bad = [e.name for (e, _), a, b in zip(inv.tensors, inv.digests, now) if a != b]
        self.checks += 1
        if bad:
            self.divergences += 1
        eng.records.append(step=inv.step, segment=self.name,
                           contract_version=inv.version, check="bytes",
                           outcome="divergence" if bad else "match",
                           detail={"what": "contract state at replay", "compared": len(now),
                                   "differ": bad[:16]})
        if bad:
            self._diverged(inv)

    def _violation(self, state: str, detail: str, inv: _Invocation) -> None:
        eng = self.engine
        self.violations += 1
        eng.records.append(step=inv.step, segment=self.name, contract_version=inv.version,
                           check="version", outcome="rejection",
                           detail={"state": state, "seen": detail,
                                   "action": eng.on_violation})
        if eng.on_violation == "raise":
            inv.release()
            raise ContractViolation(self.name, state, detail, inv.version)
        warnings.warn(str(ContractViolation(self.name, state, detail, inv.version)) +
                      " Recorded; this replay used the live value, and the segment runs "
                      "retained until it is probed again.", RuntimeWarning, stacklevel=2)
        # Probe again next time; the re-probe extends the contract (next version).
        if self.status in ("active", "retain"):
            self.status = "probe"
        eng._contracts_changed()

    # ---------------------------------------------------------------- reporting
    def summary(self) -> dict[str, Any]:
        c = self.contract
        return {
            "mode": (c.option if c is not None and self.status in ("active", "retain")
                     else self.status),
            "status": self.status,
            "forwards": self.forwards,
            "replays": self.replays,
            "contract_version": c.version if c else 0,
            "violations": self.violations,
            "checks": self.checks,
            "divergences": self.divergences,
            "activation_bytes": c.activation_bytes if c else 0,
            "preserved_bytes": self.last_preserved_bytes,
            "changing_state": [s.name for s in c.changing] if c else [],
            "options": c.available_options() if c else [],
        }


# Derivative checks compare bit for bit, except on a device whose kernels may be
# nondeterministic (CUDA without torch.use_deterministic_algorithms(True)): there two runs of
# the same backward can differ in the last bits (atomic adds), so gradients within this
# tolerance are a match, recorded with their differences.
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-8
#: (rtol, atol) per gradient dtype: a few units in the last place of each (one bf16 ulp is
#: 7.8e-3 relative, so float32's rtol would call every last-bit difference a divergence).
GRAD_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-14), torch.float32: (GRAD_RTOL, GRAD_ATOL),
    torch.float16: (4e-3, 1e-5), torch.bfloat16: (3.2e-2, 1e-5)}


def grad_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The (rtol, atol) at which two gradients of ``dtype`` from a nondeterministic device
    are a match.

    Example:
        >>> grad_tolerance(torch.bfloat16)[0] > grad_tolerance(torch.float32)[0]
        True
    """
    return GRAD_TOLERANCE.get(dtype, (GRAD_RTOL, GRAD_ATOL))


class _BytesSandbox:
    """Bytes and versions of some tensors, put back by :meth:`restore`."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        seen: set = set()
        self.items = []
        with torch.no_grad():
            for t in tensors:
                key = storage_key(t)
                if key is None or key in seen:
                    continue
                seen.add(key)
                self.items.append((t, storage_bytes(t).clone(), t._version))

    def restore(self) -> None:
        with torch.no_grad():
            for t, snap, _ in self.items:
                live = storage_bytes(t)
                if live.numel() == snap.numel():
                    live.copy_(snap)
        _reset_versions([t for t, _, _ in self.items], [v for _, _, v in self.items])


def _rng_states(device: torch.device | None) -> tuple:
    """The global CPU RNG state and, on CUDA, that of the model's device only."""
    cuda = torch.cuda.get_rng_state(device) if device is not None else None
    return torch.get_rng_state(), cuda, device


@contextlib.contextmanager
def _forked_rng(states: tuple) -> Iterator[None]:
    cpu, cuda, device = states
    with torch.random.fork_rng(devices=[device] if device is not None else [],
                               device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: a NaN where the reference has the same NaN is equal (a model that blew up
    is not a divergence of the replay)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _nondeterministic(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and not torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def _saving_counted(saved: dict, exclude: set, where: str, namer: Callable) -> Iterator[None]:
    """Count the storages autograd saves inside the block (each once, ``exclude`` left out)
    into ``saved``, handing each tensor on to the saved-tensor hooks already active (the
    memory accountant's) or, without any, to a version-checked :class:`Saved` handle."""
    # torch-private, but what torch.utils.checkpoint itself uses to find the active hooks
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = top if top is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key is not None and key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return outer_pack(t) if outer_pack is not None else Saved(t, where, namer)

    unpack = outer_unpack if outer_unpack is not None else Saved.unpack
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    """The differentiable tensors of a segment's output, each once, in order."""
    seen: set[int] = set()
    outs = []
    for t in tensor_leaves(out):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            outs.append(t)
    return outs


@dataclasses.dataclass(slots=True)
class _CheckBox:
    """What the backward of one checked call needs; ``outs`` is emptied when it has run."""

    rt: SegmentRuntime
    inv: _Invocation
    args: tuple  # the call's arguments, differentiable tensors replaced by ``inputs``
    kwargs: dict
    inputs: list[torch.Tensor]  # detached leaves the reference graph starts from
    params: list[torch.Tensor]
    outs: list[torch.Tensor]  # the reference outputs (their graph)
    rng: tuple  # global RNG states at forward (see _rng_states)
    autocast: list
    out_digests: list[int] | None


class _CheckedSegment(torch.autograd.Function):
    """Joins a checked call's reference graph to the model's graph.

    Inputs: the segment's differentiable inputs and parameters (so that autograd, DDP's hooks
    and gradient accumulation see them as usual); outputs: the reference outputs, detached.
    """

    @staticmethod
    def forward(ctx, box: _CheckBox, *inputs_and_params: torch.Tensor):
        ctx.box = box
        return tuple(o.detach() for o in box.outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        box = ctx.box
        ctx.box = None
        if box is None or not box.outs:
            raise ReplayError(
                "a derivative-checked segment's backward ran a second time (backward with "
                "retain_graph=True?). Checked steps free their reference graph after the first "
                "backward; use preservation='retain' for segments whose graph is reused.")
        ref = box.rt._compare_grads(box, list(grads))
        return (None, *ref)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """Autocast settings of the current forward, per device type that has autocast."""
    out = []
    for dev in ("cpu", "cuda"):
        if torch.amp.is_autocast_available(dev):
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return out


def _model_cuda_device(model: nn.Module) -> torch.device | None:
    """The CUDA device the model's parameters live on (the first, if several)."""
    devs = {p.device for p in model.parameters() if p.is_cuda}
    return min(devs, key=lambda d: d.index or 0) if devs else None


def _first_param_is_cuda(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.is_cuda


_MISSING = object()


def _argument_objects(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The call's arguments that are objects with state of their own (not tensors, plain
    values, or lists/tuples/dicts of those): a mutable object such as an HF ``Cache``."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + \
        [(f"argument {k!r}", v) for k, v in kwargs.items()]
    out = []
    for name, v in named:
        leaves, _ = tree_flatten(v)
        if any(not (isinstance(x, torch.Tensor) or is_scalar(x) or callable(x))
               for x in leaves):
            out.append((name, v))
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


def _mutable_argument_message(segment: str, argname: str, obj: Any) -> str:
    kind = type(obj).__name__
    if "cache" in kind.lower():
        fix = ("This is a key/value cache: turn caching off in training, e.g. "
               "model.config.use_cache = False or use_cache=False in the forward call, as "
               "transformers' own gradient checkpointing does.")
    else:
        fix = ("Keep that mutation outside the segment, pass the segment what it reads (tensors "
               "or plain values), or leave this segment out of `segments`.")
    return (f"segment {segment!r} changed its {argname} (a {kind} object) in its forward. A "
            "replay in backward runs the forward again: it would change the object a second "
            "time and read what the step left in it instead of what the forward saw, so this "
            f"segment cannot be replayed exactly. {fix}")


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _contract_detail(c: ReplayContract) -> dict[str, Any]:
    return {"option": c.option,
            "changing": {s.name: s.preservation for s in c.changing},
            "generators": c.generators, "global_rng": c.uses_global_rng,
            "python_attrs": c.python_attrs, "input_aliases": c.input_aliases,
            "activation_bytes": c.activation_bytes,
            "preserved_bytes": c.preserved_bytes()}


class ReplayEngine:
    """State-aware replay for the segments of one model. Made by :func:`install`."""

    def __init__(self, model: nn.Module, segments: Mapping[str, nn.Module],
                 preservation: str | Mapping[str, str], on_violation: str,
                 records: RecordStore, window: str, budget: int | None = None,
                 planner: str = "joint", track_memory: bool = False, base_memory: int = 0,
                 calibration_steps: int = 2, plan_min: bool = False,
                 real_peak: bool = False) -> None:
        self.model = model
        self.on_violation = on_violation
        self.records = records
        self.log = RegionLog()
        self.step = 0
        self.budget = budget
        self.planner = planner
        self.extra_base_memory = base_memory
        self.calibration_steps = calibration_steps
        self.real_peak = real_peak
        self.plan: _planner.Plan | None = None
        self.plan_version = 0
        self.plan_transform: Callable[[_planner.Plan], _planner.Plan] | None = None
        self.meter = CostMeter()
        self.measure_costs = budget is not None or plan_min
        self.accountant: MemoryAccountant | None = None
        self._acct_hooks: Any = None
        self._calibration: list[str] = []
        self._warmup = False
        self._last_peak = 0
        self._base_saved = 0
        self._last_capture: tuple[int, dict, int] = (0, {}, 0)
        # On CUDA, times are only taken while calibrating (synchronized), and peaks come from
        # the allocator.
        self._cuda = _first_param_is_cuda(model)
        self._sync = False
        if track_memory or self.measure_costs:
            self.track_memory(True)
        self._external: list[Any] = []
        self._pending_probes: set[SegmentRuntime] = set()
        self._held_bytes = 0
        self._replays_this_step = 0
        self._truth: StepPeak | None = None  # measuring a step's real peak (CPU)
        self._truth_pending = False
        self._truth_peak: int | None = None
        self._truth_hook: Any = None
        self._truth_rounds = 0
        self._optimizers: list[Any] = []
        self._residual = 0  # bytes a measured step held beyond the accountant's figures
        self.last_real_peak: tuple[int, int] | None = None  # (step, bytes) last measured
        self._window_depth = 0
        self._explicit_windows = 0  # root or manual windows opened so far
        self._segment_depth = 0  # > 0 inside a segment's forward or replay
        self._cuda_device: torch.device | None = None
        self._capture: CaptureMode | None = None
        self._capturing = False
        self._needs_capture = True
        self._check_grad = False
        self._checked: frozenset = frozenset()  # segments derivative-checked this window
        self._check_cursor = 0
        self.checks_skipped = 0  # checked windows whose derivative check did not fit the budget
        self._check_bytes = False
        self._check_next: tuple[bool, bool] | None = None
        self._replays_last_step = 0
        self._preserved_last_step = 0
        self._last_step = 0
        self._last_cuda_peak = 0
        self._suspended = False
        self._order = 0
        self._hooks: list = []
        self.runtimes: dict[str, SegmentRuntime] = {}
        for name, mod in segments.items():
            p = preservation.get(name, "auto") if isinstance(preservation, Mapping) \
                else preservation
            rt = SegmentRuntime(self, name, mod, p)
            self.runtimes[name] = rt
        for name, rt in self.runtimes.items():
            _RUNTIMES[rt.module] = rt
            rt.module.__class__ = _replay_class(rt.orig_class)
            become = getattr(rt.module, "cls_to_become", None)
            if isinstance(rt.module, LazyModuleMixin) and become is not None:
                # A lazy module turns into ``cls_to_become`` at its first forward: into the
                # replaying subclass of it, so it keeps replaying afterwards.
                rt.module.cls_to_become = _replay_class(become)
        self._root_class: type | None = None
        if window == "root":
            # The root's forward opens the window through a class swap, not hooks: a copy
            # (deepcopy, pickle) of the model is then a plain model, with no engine attached.
            self._root_class = type(model)
            _ROOTS[model] = self
            model.__class__ = _root_class(self._root_class)
        self.installed = True

    # ---------------------------------------------------------------- public
    @property
    def contracts(self) -> dict[str, ReplayContract]:
        """Current contract of each probed segment."""
        return {n: rt.contract for n, rt in self.runtimes.items() if rt.contract is not None}

    @property
    def segments(self) -> list[str]:
        """Segment names in forward execution order (module order until first run)."""
        return sorted(self.runtimes, key=lambda n: (self.runtimes[n].order < 0,
                                                    self.runtimes[n].order))

    @property
    def preserved_bytes(self) -> int:
        """Bytes held right now for pending replays (whole copies plus region logs)."""
        return self._held_bytes + self.log.nbytes

    @property
    def costs(self) -> list[_planner.SegmentCost] | None:
        """Measured costs per segment and option (None before any segment is probed)."""
        costs = self.meter.costs(self)
        return costs or None

    @property
    def base_memory(self) -> int:
        """Bytes outside the segments in the accountant's terms: parameters, buffers and
        their gradients, tensors saved for backward outside segments (measured), plus
        ``base_memory`` given to install. Plans use :attr:`real_base_memory`."""
        return self._static_bytes() + self._base_saved

    @property
    def unaccounted_bytes(self) -> int:
        """What a measured step held beyond all of the accountant's figures (0 until one is
        measured)."""
        return self._residual

    @property
    def real_base_memory(self) -> int:
        """:attr:`base_memory` plus what a measured step held beyond the accountant's figures
        (backward temporaries, optimizer state; see :mod:`lightning_replay.memory`): the base
        plans are made with, so that their predicted peak bounds the real one."""
        return self.base_memory + self._residual

    def _static_bytes(self) -> int:
        """Parameters, buffers, gradients and the caller's extra base: held all step."""
        static: dict = {}
        grads: dict = {}
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            local = getattr(t, "_local_tensor", t)  # an FSDP2 shard: this rank's bytes
            key = storage_key(local)
            if key is not None:
                static[key] = local.untyped_storage().nbytes()
                if t.requires_grad:
                    grads[key] = static[key]
        return sum(static.values()) + sum(grads.values()) + self.extra_base_memory

    def state_name(self, t: torch.Tensor) -> str | None:
        """The model's name for the storage of ``t`` (a parameter, buffer or attribute)."""
        key = storage_key(t)
        refs = StateIndex(self.model).lookup(key) if key is not None else []
        return refs[0].name if refs else None

    def track_memory(self, enabled: bool = True) -> None:
        """Turn exact byte accounting on (every step pays a saved-tensor hook) or off."""
        if enabled and self.accountant is None:
            self.accountant = MemoryAccountant()
            self.accountant.namer = self.state_name
            self.accountant.extra = lambda: self.log.nbytes
        elif not enabled:
            self.accountant = None

    def step_stats(self) -> dict[str, Any]:
        """The last *closed* window: accounted peak bytes (base included), replays, preserved
        bytes, plan version. A window closes when the next one begins, so after a step's
        backward this is still the step before; :meth:`window_stats` is the step in hand.
        ``peak_bytes`` is None when memory tracking is off."""
        return {"step": self._last_step,
                "peak_bytes": (self._last_cuda_peak if self._cuda else
                               self._static_bytes() + self._last_peak
                               if self.accountant is not None else None),
                "replays": self._replays_last_step,
                "preserved_bytes": self._preserved_last_step,
                "plan_version": self.plan_version}

    def window_stats(self) -> dict[str, Any]:
        """The current window: the step in progress, or, once its backward has run (after
        ``loss.backward()``, in ``on_train_batch_end``), the step just trained.

        Keys as :meth:`step_stats`, plus ``checked`` (the segments derivative-checked in this
        window), ``accounted_peak_bytes``: the accountant's peak in the planner's terms
        (parameters, buffers, gradients, the extra base, and everything saved, snapshotted or
        re-materialized so far), and, side by side, ``predicted_peak_bytes`` (the plan's
        prediction of the real peak, None before a plan) and ``real_peak_bytes`` /
        ``real_peak_step``: the last real peak measured, by the CUDA allocator or, on CPU, by
        profiler memory events on the first step of each plan (a step's real peak is known
        once its optimizer step has run, so on CPU it lags). ``peak_bytes`` is the CUDA
        allocator's peak since the window began on GPU, and the accounted peak on CPU; the
        accounted figures are None when memory tracking is off. Nothing here synchronizes the
        device.
        """
        acct = self.accountant
        accounted = self._static_bytes() + acct.peak if acct is not None else None
        peak = accounted
        real = self.last_real_peak
        if self._cuda:
            # the caching allocator's counters are host-side: no synchronization needed
            peak = int(torch.cuda.max_memory_allocated(self._cuda_device))
            real = (self.step, peak)
        return {"step": self.step, "peak_bytes": peak, "accounted_peak_bytes": accounted,
                "predicted_peak_bytes": self.plan.peak_memory if self.plan else None,
                "real_peak_bytes": real[1] if real else None,
                "real_peak_step": real[0] if real else None,
                "checked": sorted(self._checked) if self._check_grad else [],
                "replays": self._replays_this_step,
                "preserved_bytes": sum(rt.last_preserved_bytes for rt in self.runtimes.values()),
                "plan_version": self.plan_version}

    def replan(self, budget: int | str | None | object = _KEEP, method: str | None = None
               ) -> _planner.Plan:
        """Plan again from the measured costs (optionally with a new budget or method).

        A segment pinned with ``preservation={name: option}`` is planned only with that option
        (``"whole"``/``"regions"`` also allow ``recompute`` where the segment is stateless);
        ``"auto"`` leaves it to the planner.

        Args:
            budget: new budget (bytes, a string such as ``"2GiB"``, or a fraction of the
                model's device); ``"min"`` or ``None`` plans the lowest-memory correct plan;
                omitted keeps the current budget.
            method: new planner method; omitted keeps the current one.

        Raises:
            InfeasibleBudget: the budget is below what the method can reach (with the
                preservation pins, which the error names); the error says the smallest
                feasible budget.
            ReplayConfigError: no costs measured yet (no segment probed), or a pin that none
                of the segment's measured options honours.
        """
        if budget is not _KEEP:
            self.budget = _check_budget(budget, self.model)[1]
        if method is not None:
            self.planner = _check_planner(method)
        costs = self.costs
        if not costs:
            raise ReplayConfigError("replan() needs measured costs: run at least one training "
                                    "step so every segment is probed")
        measured = {c.name for c in costs}
        allowed = {name: PIN_OPTIONS[rt.preservation] for name, rt in self.runtimes.items()
                   if rt.preservation in PIN_OPTIONS and name in measured}
        base = self.real_base_memory
        budget_bytes = self.budget
        try:
            if budget_bytes is None:  # the lowest-memory correct plan
                budget_bytes = _planner.min_feasible_budget(costs, base, self.planner,
                                                            allowed=allowed)
            p = _planner.plan(costs, budget=budget_bytes, base_memory=base,
                              method=self.planner, allowed=allowed)
        except _planner.InfeasibleBudget as exc:
            if exc.pins or not allowed:
                raise
            # A pinned segment is never calibrated in the options its pin excludes, so the
            # planner saw no restriction; the pins are still part of why nothing fits.
            raise _planner.InfeasibleBudget(
                exc.budget, exc.min_feasible, exc.method, exc.joint_min_feasible,
                pins={n: tuple(sorted(o)) for n, o in allowed.items()}) from None
        except ValueError as exc:  # a pin that no measured option honours
            pins = {name: self.runtimes[name].preservation for name in allowed}
            raise ReplayConfigError(f"preservation={pins}: {exc}") from None
        if self.plan_transform is not None:
            p = self.plan_transform(p)
        self._apply_plan(p)
        return p

    def _apply_plan(self, p: _planner.Plan) -> None:
        if self.plan is not None and p.choices == self.plan.choices:
            self.plan = p  # same choices: no new plan version, no re-plan record
            return
        self.set_options(p.choices)
        self.plan = p
        if self.measure_costs and self.real_peak and not self._cuda and self._truth_rounds < 3:
            self._truth_pending = True  # measure the real peak of the plan's first step
        self.plan_version += 1
        self.records.append(step=self.step, segment="*", contract_version=self.plan_version,
                            check="plan", outcome="match",
                            detail={"plan_version": self.plan_version, **p.to_dict()})

    def state_dict(self) -> dict[str, Any]:
        """Resumable engine state: step, plan, contract versions, counters, record run id."""
        return {"step": self.step, "plan_version": self.plan_version,
                "plan": self.plan.to_dict() if self.plan else None,
                "budget": self.budget, "planner": self.planner,
                "run_id": self.records.run_id,
                "segments": {n: {"version": rt.version, "forwards": rt.forwards,
                                 "replays": rt.replays, "violations": rt.violations,
                                 "checks": rt.checks, "divergences": rt.divergences,
                                 "planned_option": rt.planned_option}
                             for n, rt in self.runtimes.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: contracts are re-probed on the next step and get
        the next version; the plan is re-applied once they exist."""
        self.step = int(state["step"])
        self.plan_version = int(state["plan_version"])
        self.budget = state.get("budget", self.budget)
        self.planner = state.get("planner", self.planner)
        self.plan = _planner.Plan.from_dict(state["plan"]) if state.get("plan") else None
        for n, d in state.get("segments", {}).items():
            rt = self.runtimes.get(n)
            if rt is None:
                continue
            rt.version = int(d["version"])
            rt.forwards, rt.replays = int(d["forwards"]), int(d["replays"])
            rt.violations, rt.checks = int(d["violations"]), int(d["checks"])
            rt.divergences = int(d["divergences"])
            rt.planned_option = d.get("planned_option")
        if self.plan is not None:
            self.measure_costs = False

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per segment: mode, replays, contract version, violations, bytes."""
        return {n: self.runtimes[n].summary() for n in self.segments}

    def request_check(self, grad: bool = True, bytes: bool = True,
                      segments: Iterable[str] | None = None) -> None:
        """Check the replays of the next window (derivative and/or byte-level).

        A derivative check keeps the segment's graph from forward to backward. ``segments``
        names the segments to derivative-check; by default every replayed segment, or, under a
        budget, as many as the plan's headroom allows without the step exceeding the budget
        (by the measured costs), in rotation so that every segment is checked in turn. Byte
        checks are cheap and cover every replay.
        """
        if segments is not None:
            segments = list(segments)
            unknown = [n for n in segments if n not in self.runtimes]
            if unknown:
                raise ReplayConfigError(
                    f"request_check(segments=...): {unknown} are not installed segments; "
                    f"installed: {self.segments}")
        self._check_next = (bool(grad), bool(bytes), segments)

    def set_options(self, choices: Mapping[str, str]) -> None:
        """Apply a plan: one option per segment (``retain``/``recompute``/``whole``/``regions``)."""
        for name, opt in choices.items():
            if name not in self.runtimes:
                raise ReplayConfigError(f"plan names segment {name!r}, which is not installed; "
                                        f"installed: {sorted(self.runtimes)}")
            if opt not in OPTIONS:
                raise ReplayConfigError(f"plan gives segment {name!r} option {opt!r}; "
                                        f"options are {OPTIONS}")
            self.runtimes[name].set_option(opt)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Mark a window's forward part by hand (the Lightning strategy wraps training_step)."""
        self._explicit_windows += 1
        self.begin_window()
        try:
            yield
        finally:
            self.end_forward()

    def begin_window(self, continuation: bool = False) -> None:
        """Open a window (a training step's forward part), or, with ``continuation``, reopen
        the current one: a no-grad forward of the root inside the step (a momentum encoder
        that enqueues) or a segment called after the root's forward belongs to the step whose
        backward is still to come, so its writes must be logged like the rest of the window."""
        self._window_depth += 1
        if self._window_depth > 1:
            return
        if continuation and self.step > 0:
            if self._needs_capture or self.log.armed:
                self._capture = CaptureMode(self.log)
                self._capture.__enter__()
                self._capturing = True
            return
        for rt in list(self._pending_probes):
            rt.finish_stale_probes()
        self._replays_last_step = self._replays_this_step
        self._last_step = self.step
        self._preserved_last_step = sum(rt.last_preserved_bytes for rt in self.runtimes.values())
        self._settle_real_peak()
        self._maybe_plan()
        if self._truth_pending and self.accountant is not None:
            self._truth_pending = False
            self._truth_rounds += 1
            if not profiler_busy() and _rank_count() == 1:
                self._start_truth()
        self.step += 1
        self._replays_this_step = 0
        chk, self._check_next = self._check_next, None
        self._check_grad, self._check_bytes = chk[:2] if chk else (False, False)
        self._checked = self._select_checked(chk[2]) if self._check_grad else frozenset()
        self._cuda = _first_param_is_cuda(self.model)
        self._cuda_device = _model_cuda_device(self.model) if self._cuda else None
        self._sync = self._cuda and bool(self._calibration)
        acct = self.accountant
        if self._cuda:  # each window's allocator peak is its own
            dev = self._cuda_device
            self._last_cuda_peak = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if acct is not None:
            self._last_peak = acct.peak
            acct.static = {storage_key(t) for t in
                           list(self.model.parameters()) + list(self.model.buffers())}
            acct.reset_peak()
            self._acct_hooks = acct.saved_tensors_hooks()
            self._acct_hooks.__enter__()
        # pending invocations armed under an earlier plan still need their writes logged
        if self._needs_capture or self.log.armed:
            self._capture = CaptureMode(self.log)
            self._capture.__enter__()
            self._capturing = True

    def end_forward(self, outputs: Any = None) -> None:
        """Close the window's forward part (``outputs``: the step's outputs, unused today)."""
        if self._window_depth == 0:
            return
        self._window_depth -= 1
        if self._window_depth > 0:
            return
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            n_regions = sum(1 for rt in self.runtimes.values() if rt.contract is not None
                            and rt.contract.option == "regions")
            self._last_capture = (self._capture.ops, self._capture.entry_time, n_regions)
            self._capture = None
        self._capturing = False
        if self._acct_hooks is not None:
            self._acct_hooks.__exit__(None, None, None)
            self._acct_hooks = None
            if self.measure_costs:
                self._base_saved = max(self._base_saved, self.accountant.by_tag.get("base", 0))

    def uninstall(self) -> None:
        """Put the model back exactly as it was before :func:`install`."""
        if not self.installed:
            return
        while self._window_depth:
            self.end_forward()
        if self._truth is not None:
            self._stop_truth(self._truth)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._root_class is not None:
            if _ROOTS.get(self.model) is self:
                del _ROOTS[self.model]
            self.model.__class__ = self._root_class
            self._root_class = None
        for rt in self.runtimes.values():
            if _RUNTIMES.get(rt.module) is rt:
                del _RUNTIMES[rt.module]
            base = getattr(type(rt.module), "_lightning_replay_base", None)
            rt.module.__class__ = base if base is not None else rt.orig_class
            become = getattr(rt.module, "cls_to_become", None)
            if become is not None and getattr(become, "_lightning_replay_base", None):
                if "cls_to_become" in rt.module.__dict__:
                    del rt.module.__dict__["cls_to_become"]
        self.log.clear()
        self.installed = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run segments as plain modules (no probe, no replay) inside this block."""
        prev, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = prev

    # ---------------------------------------------------------------- internal
    def _settle_real_peak(self) -> None:
        """After a measured step (CPU) or any planned step (CUDA): fold what the step held
        beyond the accountant's figures into the base, and re-plan if the plan no longer
        fits the budget."""
        acct = self.accountant
        if acct is None or self.plan is None or not self.real_peak:
            return
        accounted = self._static_bytes() + acct.peak
        if self._truth is not None:
            self._stop_truth(self._truth)
        if self._truth_peak is not None:
            real, self._truth_peak = self._truth_peak, None
        elif self._cuda and self._cuda_device is not None and self._last_step:
            real = int(torch.cuda.max_memory_allocated(self._cuda_device))
        else:
            return
        self.last_real_peak = (self._last_step, real)
        residual = max(0, real - accounted)
        if residual <= self._residual:
            return
        grown, self._residual = residual - self._residual, residual
        if self.budget is not None and self.plan.peak_memory + grown > self.budget:
            try:
                self.replan()  # the plan no longer fits once the real figure is known
            except InfeasibleBudget as exc:
                self._residual_warning(exc)
        else:  # it still fits: only its prediction changes
            self.plan = dataclasses.replace(self.plan, peak_memory=self.plan.peak_memory + grown,
                                            base_memory=self.plan.base_memory + grown)

    def _start_truth(self) -> None:
        truth = StepPeak(self.model)
        try:
            truth.start()
        except RuntimeError as exc:  # another profiler got there first: measure nothing
            warnings.warn(f"the real peak of step {self.step} was not measured ({exc}); the "
                          "plan's predictions leave out what the accountant does not count",
                          RuntimeWarning, stacklevel=3)
            self._truth_rounds = 3
            return
        self._truth = truth
        # Stop right after the step's optimizer step (its temporaries and state included),
        # so the profiler does not span the caller's code between steps; else when the next
        # window begins. Not from inside backward: autograd restores the thread's profiler
        # state after its callbacks.
        self._truth_hook = register_optimizer_step_post_hook(
            lambda *_: self._stop_truth(truth))

    def _stop_truth(self, truth: StepPeak) -> None:
        if self._truth is truth:
            self._truth = None
            if self._truth_hook is not None:
                self._truth_hook.remove()
                self._truth_hook = None
            self._truth_peak = truth.stop() + self._optimizer_bytes()

    def track_optimizer(self, *optimizers: Any) -> None:
        """Count these optimizers' state in the base memory the plan is made with."""
        self._optimizers = list(optimizers)

    @property
    def tracked_optimizers(self) -> list[Any]:
        return list(self._optimizers)

    def _optimizer_bytes(self) -> int:
        return live_model_bytes(nn.Module(), self._optimizers) if self._optimizers else 0

    def _residual_warning(self, exc: Exception) -> None:
        warnings.warn(
            f"the budget ({format_bytes(self.budget)}) cannot hold the measured step: it held "
            f"{format_bytes(self._residual)} outside what the engine accounts (backward "
            f"temporaries, optimizer state), and no plan fits with that ({exc}). Raise the "
            "budget; the current plan stays.", RuntimeWarning, stacklevel=3)

    def _maybe_plan(self) -> None:
        """Between windows: calibrate each option for a few steps, then plan."""
        if not self.measure_costs or self._pending_probes or any(
                rt.contract is None or rt.status == "probe" for rt in self.runtimes.values()):
            return
        if self.plan is None and not self._calibration:
            phases = ["replay"]
            if any("regions" in rt.contract.available_options()
                   for rt in self.runtimes.values()):
                phases.append("regions")
            # each phase starts with a warm-up step whose timings are not kept
            self._calibration = [ph for ph in phases
                                 for ph in [ph + ":warmup"] + [ph] * self.calibration_steps]
            self._calibration.append("plan")
        self._warmup = False
        if not self._calibration:
            return
        phase = self._calibration.pop(0)
        if phase == "plan":
            self.replan()
            return
        phase, _, warm = phase.partition(":")
        self._warmup = bool(warm)
        for rt in self.runtimes.values():
            # a pinned segment is calibrated only in the options its pin allows
            opts = [o for o in rt.contract.available_options()
                    if o in PIN_OPTIONS.get(rt.preservation, OPTIONS)]
            if phase == "replay":
                for o in ("recompute", "whole"):
                    if o in opts:
                        rt.set_option(o)
                        break
            elif "regions" in opts:
                rt.set_option("regions")
        for rt in self.runtimes.values():
            rt.planned_option = None  # calibration is not a plan

    def _select_checked(self, requested: list[str] | None) -> frozenset:
        """The segments to derivative-check this window (see :meth:`request_check`)."""
        if requested is not None:
            return frozenset(requested)
        if self.plan is None or not self.budget:
            return frozenset(self.segments)
        choices = self.plan.choices
        # segments the plan covers with an option they still have (a segment first probed
        # after the plan, or re-probed since, is left out until the next plan)
        by_name = {c.name: c for c in self.costs or []
                   if c.name in choices and choices[c.name] in c.options}
        candidates = [n for n in self.segments if n in by_name and choices[n] != "retain"]
        if not candidates:
            return frozenset()
        k = self._check_cursor % len(candidates)
        order = candidates[k:] + candidates[:k]
        grads = {n: 2 * _unique_bytes([p for p in self.runtimes[n].module.parameters()
                                       if p.requires_grad]) for n in candidates}
        chosen: list[str] = []
        last = -1
        for i, n in enumerate(order):
            if self._checked_peak(by_name, chosen + [n], grads) <= self.budget:
                chosen.append(n)
                last = i
        if not chosen:
            self.checks_skipped += 1
            if self.checks_skipped == 1:
                warnings.warn(
                    f"derivative check skipped at step {self.step}: keeping any one replayed "
                    f"segment's graph would exceed the budget ({format_bytes(self.budget)}) "
                    "by the measured costs. Raise the budget to check under it, or name "
                    "segments with request_check(segments=...).", RuntimeWarning, stacklevel=3)
            return frozenset()
        self._check_cursor = k + last + 1
        return frozenset(chosen)

    def _checked_peak(self, by_name: Mapping[str, _planner.SegmentCost],
                      checked: list[str], grads: Mapping[str, int] | None = None) -> int:
        """Predicted peak of the plan with ``checked`` segments also keeping their graphs
        (their activations, inputs and preserved state, and ``grads``: two sets of their
        parameter gradients for the comparison, computed here when not given)."""
        costs = []
        for c in by_name.values():
            o = self.plan.choices[c.name]
            if c.name in checked:
                opt = c.options[o]
                g = grads[c.name] if grads is not None else 2 * _unique_bytes(
                    [p for p in self.runtimes[c.name].module.parameters() if p.requires_grad])
                keep = c.options["retain"].memory + opt.memory + g
                c = _planner.SegmentCost(c.name, c.activation_bytes,
                                         {o: _planner.Option(memory=keep, time=opt.time)})
            costs.append(c)
        return _planner.predicted_peak(costs, {n: self.plan.choices[n] for n in by_name},
                                       self.real_base_memory)

    def _record_replay_time(self, inv: _Invocation, seconds: float) -> None:
        if self._warmup and inv.step == self.step:
            return
        total = inv.t_prep + seconds
        if inv.option == "regions":
            ops, entry_time, n = self._last_capture
            total += ops * dispatch_overhead() / max(n, 1)
            total += sum(entry_time.get(k, 0.0) for k, _ in inv.regions)
            self.meter.region_bytes[inv.rt.name] = max(
                self.meter.region_bytes.get(inv.rt.name, 0) if inv.step > 0 else 0,
                inv.rt.last_preserved_bytes - inv.preserved_bytes)
        self.meter.add_time(inv.rt.name, inv.option, total)

    def _replay_started(self, activation_bytes: int) -> None:
        acct = self.accountant
        if acct.replay_bytes == 0:
            # the re-materialized activations are gone when this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: acct.set_replay(0))
        acct.set_replay(activation_bytes)

    @contextlib.contextmanager
    def _tagged(self, name: str) -> Iterator[None]:
        acct = self.accountant
        if acct is None:
            yield
            return
        prev, acct.tag = acct.tag, name
        try:
            yield
        finally:
            acct.tag = prev

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    @contextlib.contextmanager
    def _implicit_window(self) -> Iterator[None]:
        # A segment called outside any window: after a root (or manual) window it belongs to
        # that step (a consistency term computed after the forward); otherwise (a user calling
        # model.block(x) as the step) it gets a window of its own call.
        if self._window_depth:
            yield
            return
        self.begin_window(continuation=self._explicit_windows > 0)
        try:
            yield
        finally:
            self.end_forward()

    def _contracts_changed(self) -> None:
        self._needs_capture = bool(self._pending_probes) or any(
            rt.status in ("probe", "probing") or (rt.contract is not None and any(
                s.preservation in ("regions", "guard") for s in rt.contract.state))
            for rt in self.runtimes.values())


def _normalize_preservation(preservation: Any, names: Iterable[str]) -> str | dict[str, str]:
    names = list(names)
    if isinstance(preservation, str):
        if preservation not in PRESERVATIONS:
            raise ReplayConfigError(
                f"preservation={preservation!r} is not known; use one of {PRESERVATIONS} or a "
                "dict from segment name to one of them")
        return preservation
    if isinstance(preservation, Mapping):
        out = {}
        for k, v in preservation.items():
            if k not in names:
                raise ReplayConfigError(
                    f"preservation names segment {k!r}, which is not among the installed "
                    f"segments {names}")
            if v not in PRESERVATIONS:
                raise ReplayConfigError(
                    f"preservation[{k!r}]={v!r} is not known; use one of {PRESERVATIONS}")
            out[k] = v
        return out
    raise ReplayConfigError(f"preservation must be a string or a dict, got "
                            f"{type(preservation).__name__} {preservation!r}")


def _check_budget(budget: Any, model: nn.Module) -> tuple[Budget, int | None]:
    """Parse ``budget`` in the one budget grammar and resolve it against ``model``'s device
    (its first parameter or buffer; CPU without either). Bytes are ``None`` for ``"min"``
    and for no budget."""
    try:
        parsed = Budget.parse(budget)
        device = next((t.device for t in model.parameters()),
                      next((t.device for t in model.buffers()), torch.device("cpu")))
        return parsed, parsed.resolve(device)
    except ValueError as exc:
        raise ReplayConfigError(str(exc)) from None


def _check_planner(planner: Any) -> str:
    if planner not in _planner.METHODS:
        raise ReplayConfigError(f"planner={planner!r} is not known; use one of "
                                f"{list(_planner.METHODS)}")
    return planner


def install(model: nn.Module, segments: SegmentSpec | Iterable[SegmentSpec], *,
            preservation: str | Mapping[str, str] = "auto", on_violation: str = "raise",
            records: RecordStore | str | None = None, window: str = "root",
            budget: int | str | None = None, planner: str = "joint",
            track_memory: bool = False, base_memory: int = 0,
            calibration_steps: int = 2, real_peak: bool = False) -> ReplayEngine:
    """Make the given submodules of ``model`` replay exactly under activation recomputation.

    Args:
        model: the root module; the window is its forward plus backward.
        segments: submodule names, glob patterns, module classes, or a callable
            ``(name, module) -> bool`` (see :func:`~lightning_replay.segments.resolve_segments`).
        preservation: ``"auto"`` (cheapest correct option by memory), ``"whole"``, ``"regions"``,
            ``"retain"``, or a dict from segment name to one of these.
        on_violation: ``"raise"`` raises :class:`ContractViolation`; ``"record"`` warns, records,
            and re-probes the segment.
        records: ``None`` (in memory), a SQLite path, or a :class:`RecordStore`.
        window: ``"root"`` (the window starts with each forward of ``model``) or ``"manual"``
            (the caller wraps each step in :meth:`ReplayEngine.window`).
        budget: peak-memory budget (bytes, ``"2GiB"``, or a fraction of CUDA memory), or
            ``"min"`` for the lowest-memory correct plan. With a budget, the steps after the
            probe calibrate each option (``calibration_steps`` each), then ``planner`` chooses
            one option per segment from the measured costs; ``engine.plan`` is the plan and
            ``engine.replan()`` makes a new one. ``None``: no planning (``preservation``
            decides).
        planner: ``"joint"`` (optimal), ``"eager_whole"``, ``"fixed_regions"``,
            ``"retain_all"`` or ``"whole_all"``.
        track_memory: count saved-tensor and snapshot bytes exactly every step (on whenever a
            budget is set); ``engine.window_stats()["peak_bytes"]`` reports the step's peak.
        base_memory: bytes outside the engine's view (optimizer state) added to the base.
        calibration_steps: steps per option measured before planning.
        real_peak: plan for the process's real memory, not only the accountant's figures: the
            first step of each plan is measured (the CUDA allocator; on CPU torch.profiler's
            memory events, single process only) and what it held beyond the accountant
            (backward temporaries, optimizer state via ``engine.track_optimizer``) joins the
            base (:attr:`ReplayEngine.real_base_memory`), so the plan's predicted peak bounds
            the real one. Off by default in this release.

    Returns:
        The :class:`ReplayEngine`; ``engine.uninstall()`` restores the model.

    Example:
        >>> import torch, lightning_replay as lr
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
        ...                             torch.nn.Linear(4, 1))
        >>> engine = lr.install(model, segments=["0", "1"])
        >>> for _ in range(2):
        ...     model(torch.randn(8, 4)).sum().backward()
        >>> engine.summary()["1"]["replays"]
        1
        >>> engine.uninstall()
    """
    if not isinstance(model, nn.Module):
        raise ReplayConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for mod in model.modules():
        if mod in _RUNTIMES:
            raise ReplayConfigError(
                f"model already has lightning_replay installed (segment "
                f"{_RUNTIMES[mod].name!r}); call engine.uninstall() before installing again")
    if on_violation not in ON_VIOLATION:
        raise ReplayConfigError(f"on_violation={on_violation!r} is not known; use one of "
                                f"{ON_VIOLATION}")
    if window not in ("root", "manual"):
        raise ReplayConfigError(f"window={window!r} is not known; use 'root' or 'manual'")
    resolved = resolve_segments(model, segments)
    pres = _normalize_preservation(preservation, resolved)
    parsed_budget, budget_bytes = _check_budget(budget, model)
    _check_planner(planner)
    if isinstance(base_memory, bool) or not isinstance(base_memory, int) or base_memory < 0:
        raise ReplayConfigError(f"base_memory={base_memory!r} must be a non-negative int (bytes)")
    if isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int) or \
            calibration_steps < 1:
        raise ReplayConfigError(f"calibration_steps={calibration_steps!r} must be an int >= 1")
    if records is None or isinstance(records, (str, bytes)) or hasattr(records, "__fspath__"):
        store = RecordStore(records, rank=_rank())
    elif isinstance(records, RecordStore):
        store = records
    else:
        raise ReplayConfigError(f"records must be None, a path or a RecordStore, got "
                                f"{type(records).__name__}")
    return ReplayEngine(model, resolved, pres, on_violation, store, window, budget=budget_bytes,
                        planner=planner, track_memory=track_memory, base_memory=base_memory,
                        calibration_steps=calibration_steps, plan_min=parsed_budget.min,
                        real_peak=bool(real_peak))
