"""Where state is swapped back: one segment call's preserved entry state, and the replay context.

:class:`_Invocation` takes, at a segment's forward, everything its replay needs (the contract's
choices copied, whole snapshots or region-log marks, the slot objects, generator states, the
storages each state tensor had). :class:`_ReplayContext` wraps the replay: it checks versions,
swaps that state in, sandboxes the replay's own writes and swaps the live state back, undoing
exactly what it did also when the replay stops early or fails.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch.utils.checkpoint import CheckpointError

from lightning_replay._compat import (
    checkpoint_frame_recomputing,
    graph_task_keeps_graph,
    set_versions,
    top_saved_tensors_hooks,
)
from lightning_replay.core.base.contract import SELECTIVE, StateEntry
from lightning_replay.core.base.ports import ReplayHost, ReplaySegment
from lightning_replay.core.base.clock import clock
from lightning_replay.errors import ReplayError
from lightning_replay.core.mechanisms import param_cache
from lightning_replay.core.mechanisms.host_rng import fingerprints, moved
from lightning_replay.core.base.records import REPLAY
from lightning_replay.core.mechanisms.preservation import (
    CaptureMode,
    RegionLog,
    SharedWhole,
    SnapshotPool,
    WholeSnapshot,
    redo,
    undo,
)
from lightning_replay.core.mechanisms.slot_restore import (
    restore_generators,
    restore_slots,
    swap_generators,
    swap_outside,
    swap_slots,
)
from lightning_replay.core.mechanisms.slots import (
    MISSING,
    capture_generators,
    capture_outside,
    capture_slots,
    slot_generators,
)
from lightning_replay.core.base.state import (
    StateRef,
    digest,
    extent_bytes,
    storage_bytes,
    storage_key,
)


# Per segment runtime: the views and spare buffers its small whole snapshots reuse.
_POOLS: "weakref.WeakKeyDictionary[ReplaySegment, SnapshotPool]" = weakref.WeakKeyDictionary()


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

    __slots__ = (
        "rt",
        "version",
        "moded",
        "option",
        "step",
        "checked",
        "tensors",
        "prs",
        "versions",
        "whole",
        "shared",
        "shared_writes",
        "storages",
        "regions",
        "region_extents",
        "gens",
        "slots",
        "digests",
        "preserved_bytes",
        "replays",
        "done",
        "_token",
        "held",
        "t_prep",
        "t_unpack",
        "t_pending",
        "sandbox_keys",
        "subs",
        "tensor_attrs",
        "state_attrs",
        "grads",
        "backends",
        "kept",
        "outside",
        "replaying",
        "in_forward",
        "changing",
        "param_cache",
        "__weakref__",
    )

    def __init__(self, rt: "ReplaySegment", check_bytes: bool) -> None:
        eng = rt.engine
        c = rt.contract
        self.rt = rt
        self.version = c.version
        self.option = c.option
        self.step = eng.step
        self.held: list = []  # accountant keys this invocation holds until its replay
        self.t_prep = 0.0
        # while costs are measured: when checkpoint's backward work for this call began, and
        # the replay's seconds waiting for checkpoint's check after the replay context
        self.t_unpack: float | None = None
        self.t_pending: tuple[float, float] | None = None
        self.checked = check_bytes
        self.tensors: list[tuple[StateEntry, torch.Tensor]] = []
        self.prs: list[str] = []
        self.versions: list[int] = []
        self.whole: WholeSnapshot | None = None
        self.shared: list[tuple[SharedWhole, torch.Tensor]] = []  # whole copies of a window
        self.shared_writes: list[bool] | None = None  # the forward wrote each (see runtime)
        # (tensor, data pointer, storage, offset, shape, stride) at forward
        self.storages: list[tuple] = []
        self.regions: list[tuple[Any, int]] = []
        self.region_extents: list = []  # (each arm's extent, for its release)
        self.sandbox_keys: list = []
        self.subs: dict[int, torch.Tensor] = {}  # input leaf -> its bytes at forward
        #: input leaf -> its Python attributes at forward (``x.gain = ...``), which the replay
        #: reads: rebound or reset after the forward, or absent from a stand-in copy
        self.tensor_attrs: dict[int, dict] = {}
        self.state_attrs: list[tuple[torch.Tensor, dict]] = []  # ... of its modules' tensors
        self.grads: list = []  # (tensor, its .grad at forward) of those the forward read
        self.backends: tuple | None = None  # the kernel switches at forward (backend_flags)
        self.moded = False  # a Python dispatch mode was on as the forward ran (backend_flags)
        self.preserved_bytes = 0
        self.replays = 0
        self.done = False
        self.kept = False  # holds preserved bytes that the first replay releases
        self.replaying = False
        self.in_forward = False  # its forward runs (a backward inside it may replay it)
        self._token = {"done": False}
        log = eng.log
        capturing = eng._capturing
        whole: list[torch.Tensor] = []
        extents: list = []
        self.changing: list = []  # storages of the state whose bytes the window changes
        # torch's parametrization cache as the forward saw it (param_cache.py)
        self.param_cache: tuple | None = None  # (param_cache.Record)
        tensors, versions, storages, prs = self.tensors, self.versions, self.storages, self.prs
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            for entry, get, p, is_param, written, changes, ext in _entry_plan(rt):
                t = get()
                if t is None:
                    continue
                tensors.append((entry, t))
                prs.append(p)
                versions.append(t._version)
                if not is_param:
                    # its storage, so that a storage swapped in later (``.data = ...``,
                    # ``set_``: no write, no version bump) is swapped back for the replay;
                    # its data pointer, which tells at replay whether to look (see __enter__)
                    st = t.untyped_storage()
                    try:
                        ptr = t.data_ptr()
                    except RuntimeError:  # a wrapper tensor without data: compare storages
                        ptr = None
                    storages.append((t, ptr, st, t.storage_offset(), t.shape, t.stride()))
                    if changes:
                        self.changing.append(st)
                elif changes:
                    self.changing.append(t.untyped_storage())
                if p == "none":
                    continue
                if p in ("regions", "guard") and capturing:
                    key = storage_key(t)
                    if key is not None:
                        self.regions.append((key, log.arm(key, t, extent=ext)))
                        self.region_extents.append(ext)
                        if p == "regions" and written:
                            self.sandbox_keys.append(key)
                elif p in ("whole", "regions"):
                    if not is_param and not written:
                        self.shared.append((ext, t))  # read only: one copy per window
                    else:
                        whole.append(t)
                        extents.append(ext)
            if whole:
                pool = _POOLS.get(rt)
                if pool is None:
                    pool = _POOLS[rt] = SnapshotPool()
                snap = self.whole = WholeSnapshot(whole, pool, extents)
                self.preserved_bytes += snap.nbytes
                if eng.accountant is not None:
                    key = ("snapshot", id(snap))
                    eng.accountant.hold(key, snap.nbytes, rt.name)
                    self.held.append(key)
            if self.shared:
                self._share(eng, rt)
        finally:
            torch._C._set_grad_enabled(prev)
        self.kept = bool(whole or self.regions or self.shared)
        g = rt.guard
        if len(g.captures) != len(rt.modules):
            g.captures = [MISSING] * len(rt.modules)
        self.slots = capture_slots(rt.modules, g.take_tokens(), g.captures)
        self.outside = capture_outside(rt.outside) if rt.outside else None
        gens = slot_generators(self.slots)
        if rt.generators:
            ids = {id(getattr(g, "obj", g)) for g in gens}  # a HostRNG stands for its object
            gens += [g for _, g in rt.generators if id(getattr(g, "obj", g)) not in ids]
        if eng.host_watch.capture:  # host generators seen moving in some window (host_rng.py)
            objs = {id(getattr(g, "obj", g)) for g in gens}
            gens += [r for r in eng.host_watch.capture if id(r.obj) not in objs]
        self.gens = capture_generators(gens) if gens else []
        # the generators' states are held until the replay as the copies are (issue 31)
        self.preserved_bytes += sum(
            s.untyped_storage().nbytes() for _, s in self.gens if isinstance(s, torch.Tensor)
        )
        self.digests = [digest(state_view(e, t)) for e, t in self.tensors] if check_bytes else None
        eng._held_bytes += self.preserved_bytes

    def _share(self, eng: ReplayHost, rt: "ReplaySegment") -> None:
        """Each read-only whole-preserved tensor's copy: the window's, while it serves this
        tensor's bytes, else a new one the window's later calls can share."""
        step, window = _SHARED.get(eng, (None, None))
        if step != eng.step:
            window = {}
            _SHARED[eng] = (eng.step, window)
        mine: list[tuple[SharedWhole, torch.Tensor]] = []
        for ext, t in self.shared:
            key = (storage_key(t), ext)  # (two segments reading two parts: a copy each)
            if any((sw.key, sw.extent) == key for sw, _ in mine):
                continue  # two entries on one storage (a view and its base): one swap
            sw = window.get(key)
            if sw is None or not sw.serves(t):
                sw = window[key] = SharedWhole(t, ext)
                eng._held_bytes += sw.nbytes
                if eng.accountant is not None:
                    eng.accountant.hold(("shared", id(sw)), sw.nbytes, rt.name)
            sw.users += 1
            mine.append((sw, t))
        self.shared = mine

    def watch(self) -> None:
        """Once the call's preserved state is complete (the runtime's ``_prepare``): should
        this object die before :meth:`release` (its graph freed without a backward reaching
        it, a detached output, a graph kept for a second backward and then dropped), give
        back all the same what it holds: region-log arms, shared copies, held bytes."""
        if self.done or not (self.kept or self.held or self.preserved_bytes):
            return
        eng = self.rt.engine
        self._token["held"] = (eng.accountant, self.held, self.preserved_bytes)
        weakref.finalize(
            self,
            _dropped,
            eng.log,
            list(zip([k for k, _ in self.regions], self.region_extents)),
            eng,
            [sw for sw, _ in self.shared],
            self._token,
        )

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        self._token["done"] = True
        eng = self.rt.engine
        _free_shared(eng, [sw for sw, _ in self.shared])
        eng._held_bytes -= self.preserved_bytes
        for (key, _), ext in zip(self.regions, self.region_extents):
            eng.log.release(key, extent=ext)
        if self.whole is not None:
            self.whole.release()
        self.whole = None
        acct = eng.accountant
        if acct is not None:
            for key in self.held:
                acct.drop(key)
        self.held.clear()


def _entry_plan(rt: "ReplaySegment") -> list[tuple]:
    """Per bound state entry of ``rt``'s contract, what each forward reads of it: (entry,
    getter, preservation, is a parameter, written by the segment, changes in the window).
    Made once per contract and option (a re-probe binds a new list, a re-plan changes the
    option), so a steady forward does no attribute lookups on the entries."""
    c = rt.contract
    key = (rt.bound, c, c.option)
    cached = rt._entry_plan
    if cached is not None and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    plan = [
        (
            b.entry,
            _fast_get(b.get),
            b.entry.preservation,
            b.entry.kind == "parameter",
            b.entry.written_by_segment,
            b.entry.changes_in_window,
            tuple(b.entry.extent) if b.entry.extent is not None else None,
        )
        for b in rt.bound
    ]
    rt._entry_plan = (key, plan)
    return plan


def state_view(entry: StateEntry, t: torch.Tensor) -> torch.Tensor:
    """What of ``t`` its contract entry preserves and compares: the bytes of its extent (a
    view of a bigger storage, issue 31), or ``t`` itself."""
    return t if entry.extent is None else extent_bytes(t, entry.extent)


def _fast_get(get: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor | None]:
    """``get`` (a :meth:`StateRef.get`) with its kind resolved once: a read of the slot."""
    ref = getattr(get, "__self__", None)
    if not isinstance(ref, StateRef) or getattr(get, "__func__", None) is not StateRef.get:
        return get
    d, attr = ref.module.__dict__, ref.attr
    if ref.kind == "parameter":
        return lambda: d["_parameters"].get(attr)
    if ref.kind == "buffer":
        return lambda: d["_buffers"].get(attr)
    return get


#: per engine: (step, the window's shared whole copies by storage key)
_SHARED: "weakref.WeakKeyDictionary[Any, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def _free_shared(eng: ReplayHost, sws: list[SharedWhole]) -> None:
    for sw in sws:
        if sw.release():
            eng._held_bytes -= sw.nbytes
            if eng.accountant is not None:
                eng.accountant.drop(("shared", id(sw)))


def _dropped(
    log: RegionLog, keys: list, eng: ReplayHost, sws: list[SharedWhole], token: dict
) -> None:
    if not token["done"]:  # dropped without replay (graph freed, backward never called)
        token["done"] = True
        for key, ext in keys:
            log.release(key, extent=ext)
        _free_shared(eng, sws)
        held = token.get("held")
        if held is not None:  # (see _Invocation.watch)
            acct, keys_held, nbytes = held
            eng._held_bytes -= nbytes
            if acct is not None:
                for key in keys_held:
                    acct.drop(key)


class _ReplayContext:
    """Around a replay: check, swap entry state in, sandbox the replay's writes, swap back.

    ``__exit__`` undoes exactly the steps ``__enter__`` completed, also when the replay stops
    early (checkpoint's early stop raises through here) or fails.
    """

    __slots__ = (
        "inv",
        "_t0",
        "_versions",
        "_regions",
        "_gens",
        "_slots",
        "_sandbox",
        "_stage",
        "_resized",
        "_recompute",
        "_suspects",
        "_checked_after",
        "_user_hooks",
        "_pushed",
        "_paused",
        "_keep",
        "_cached",
    )

    def __init__(
        self, inv: _Invocation, recompute: bool = False, user_hooks: tuple | None = None
    ) -> None:
        self.inv = inv
        self._stage = 0
        self._paused = False
        self._keep = False
        self._checked_after = False
        # the user's saved-tensor hooks (pack, unpack) active at the forward (see __enter__)
        self._user_hooks = user_hooks
        self._pushed = None
        self._cached = None
        # checkpoint's recomputation (it checks saved tensors): None, else whether it stops
        # early (checkpoint reads that at the forward, when this context is made)
        self._recompute = _early_stop() if recompute else None

    def __enter__(self) -> None:
        inv = self.inv
        rt = inv.rt
        eng = rt.engine
        if inv.done and inv.kept:
            raise ReplayError(
                f"segment {rt.name!r} is being replayed again for the step {inv.step}, by a "
                "backward after one that freed its graph (retain_graph=False): its preserved "
                "state went with that graph. Pass retain_graph=True to the earlier backward "
                "(as plain PyTorch needs where the two share nodes), or use "
                f"preservation={{{rt.name!r}: 'retain'}}."
            )
        # A checkpoint's recomputation runs once per backward that reaches it: one that keeps
        # its graph (retain_graph, create_graph: a gradient penalty, R1, second-order MAML) can
        # be followed by another, which must replay from the same preserved state. It is then
        # kept, intact, until a backward that frees the graph has replayed, or the graph dies.
        # A backward run inside the segment's own forward (torch.autograd.grad of an energy)
        # makes checkpoint recompute it there: the step's own backward replays it once more.
        self._keep = self._recompute is not None and (inv.in_forward or graph_task_keeps_graph())
        # Nothing from here to the end of _undo is the window's write: where backward runs
        # inside a manual window, its capture mode is still on and must not log the swaps or
        # the replayed forward's writes (a later replay would expect their versions).
        eng.log.paused += 1
        self._paused = True
        try:
            self._enter(inv, rt, eng)
        except BaseException:
            self._undo(self._stage)
            raise

    def _enter(self, inv: _Invocation, rt: "ReplaySegment", eng: ReplayHost) -> None:
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        self._t0 = clock(eng._cuda)
        now = [t._version for _, t in inv.tensors]
        if inv.regions or now != inv.versions:  # else every version is as at forward
            self._check_versions()
        for sw, t in inv.shared:
            if sw.spoiled:
                rt._violation(
                    _entry_name(inv, t),
                    "was written by the replay of another segment that shares its whole "
                    "copy: the copy no longer holds the forward's bytes",
                    inv,
                )
        self._versions = now
        self._stage = 1
        _OPEN.stack.append(self)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._resized = resized = []
            for t, ptr, st, *meta in inv.storages:
                # The same data pointer: the same bytes (``st`` is alive, so no other storage
                # can be at its address). Else look at the storage itself.
                if (ptr is None or t.data_ptr() != ptr) and (
                    t.untyped_storage().data_ptr() != st.data_ptr()
                ):
                    resized.append(
                        (t, (t.untyped_storage(), t.storage_offset(), t.shape, t.stride()))
                    )
                    t.set_(st, *meta)
            if inv.whole is not None:
                inv.whole.swap_in(keep=self._keep)
            for i, (sw, t) in enumerate(inv.shared):
                sw.swap_in(t, writes=bool(inv.shared_writes and inv.shared_writes[i]))
            regions = [eng.log.since(key, mark) for key, mark in inv.regions] if inv.regions else ()
            if regions:
                rt.last_preserved_bytes = inv.preserved_bytes + sum(
                    e.nbytes for entries in regions for e in entries
                )
                for entries in reversed(regions):
                    undo(entries)
            self._regions = regions
        finally:
            torch._C._set_grad_enabled(grad)
        self._stage = 2
        # the objects each slot held at forward (rebound tensors, generators, plain values)
        self._slots = swap_slots(inv.slots)
        if inv.outside:
            self._slots += swap_outside(inv.outside)
        self._gens = swap_generators(inv.gens) if inv.gens else ()
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
        suspects = eng.host_watch.suspected(inv.step) if eng.host_watch.suspects else None
        self._suspects = (suspects, fingerprints(suspects)) if suspects else None
        inv.replaying = True
        eng._segment_depth += 1
        eng.last_replay = (rt, inv.step, inv.version)  # whose replay an error comes from
        self._checked_after = (
            _refusals_name_the_segment(inv) if self._recompute is not None else False
        )
        if self._user_hooks is not None and self._recompute is not None:
            self._pushed = _through_user_hooks(self._user_hooks)
            if self._pushed is not None:
                self._pushed.__enter__()
        # the parametrizations the forward computed under ``parametrize.cached()`` run again
        self._cached = param_cache.replay_enter(inv.param_cache)
        rt.replays += 1
        eng._replays_this_step += 1
        if eng.accountant is not None:
            act = eng.meter.activation_bytes.get(rt.name, rt.contract.activation_bytes)
            if inv.option in SELECTIVE:  # the kept outputs autograd saves are held already
                act = max(act - eng.meter.selective_saved_bytes.get(rt.name, 0), 0)
            # what this call gives back when its replay ends (before its backward's peak)
            eng._replay_started(
                act, inv.preserved_bytes + sum(e.held for es in self._regions for e in es)
            )

    def __exit__(self, exc_type, exc, tb) -> bool:
        inv = self.inv
        stage = self._stage
        departed = (
            self._recompute is not None and stage >= 4 and _departed(exc_type, self._recompute)
        )
        self._undo(stage)
        if departed:
            _replay_departed(inv, exc)
        return False

    def _undo(self, stage: int) -> None:
        inv = self.inv
        self._stage = 0
        if stage >= 4:
            param_cache.replay_exit(inv.param_cache, self._cached)
            self._cached = None
            if self._pushed is not None:
                self._pushed.__exit__(None, None, None)
                self._pushed = None
            inv.replaying = False
            inv.rt.engine._segment_depth -= 1
            if self._suspects is not None:
                _drew_uncaptured(inv, *self._suspects)
            if self._sandbox is not None:
                self._sandbox.__exit__(None, None, None)
                for entries in self._sandbox.log.logs.values():
                    undo(entries)
        if stage >= 3:
            if self._gens:
                restore_generators(self._gens)
            if self._slots:
                restore_slots(self._slots)
        if stage >= 2:
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                for entries in self._regions:
                    redo(entries)
                # Checkpoint's frame keeps this context until the segment's backward ends:
                # the entries' bytes (the live ones, swapped in by the redo) would be held
                # through it, past the log's release of them.
                self._regions = ()
                for sw, _ in reversed(inv.shared):
                    sw.swap_back()
                if inv.whole is not None:
                    inv.whole.swap_out()
                for t, live in reversed(self._resized):
                    t.set_(*live)
            finally:
                torch._C._set_grad_enabled(grad)
        if stage >= 1:
            tensors = [t for _, t in inv.tensors]
            if [t._version for t in tensors] != self._versions:
                _reset_versions(tensors, self._versions)
            if self in _OPEN.stack:
                _OPEN.stack.remove(self)
            if not self._keep:
                inv.release()
            # else kept for the next backward's replay, and given back when it releases, or
            # when the graph that can reach it dies: checkpoint's frame holds this context,
            # which holds ``inv`` (see _Invocation.watch)
            eng = inv.rt.engine
            if eng.measure_costs and stage >= 4 and (eng._sync or not eng._cuda):
                if eng._sync:
                    torch.cuda.synchronize(eng._cuda_device)
                now = clock(eng._cuda)
                seconds = now - self._t0
                if inv.t_unpack is not None:  # checkpoint's work from backward reaching it
                    seconds += max(self._t0 - inv.t_unpack, 0.0)
                    inv.t_unpack = None
                if self._checked_after:  # recorded when checkpoint's check has run
                    inv.t_pending = (seconds, now)
                else:
                    eng._record_replay_time(inv, seconds)
        if self._paused:
            self._paused = False
            self.inv.rt.engine.log.paused -= 1

    def _check_versions(self) -> None:
        inv = self.inv
        rt = inv.rt
        log = rt.engine.log
        marks = dict(inv.regions)
        # a replay run inside another's (a backward inside a segment's replay: its
        # autograd.grad): the enclosing replay's own writes are in progress, unlogged, and it
        # puts their bytes and versions back as it ends; its state reads as it began
        began: dict[int, int] = {}
        for ctx in _OPEN.stack:
            for (_, t), v in zip(ctx.inv.tensors, ctx._versions):
                began.setdefault(id(t), v)
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
            version = began.get(id(t), t._version)
            if version != expected:
                what = (
                    "was written outside the logged window"
                    if p in ("regions", "guard")
                    else "was modified in place between the segment's forward and its replay"
                )
                rt._violation(
                    entry.name,
                    f"{what} (version {v0} at forward, {version} at replay, expected {expected})",
                    inv,
                )


def user_saved_hooks(eng: ReplayHost) -> tuple | None:
    """The user's saved-tensor hooks (pack, unpack) active now, or None: the innermost ones,
    unless those are the engine's own memory accountant's (then the ones it was pushed over)."""
    top = top_saved_tensors_hooks()
    acct = getattr(eng, "_acct_hooks", None)
    if top is not None and acct is not None and top[0] is acct.pack_hook:
        return getattr(eng, "_hooks_below_accountant", None)
    return top


def _through_user_hooks(user: tuple) -> Any:
    """Hooks over checkpoint's recomputation hook that pass each tensor the replay saves
    through the user's own saved-tensor hooks first (``unpack(pack(t))``), or None.

    In plain training the user's hooks (a ``saved_tensors_hooks`` around the step: rounding
    to bf16, ``save_on_cpu``) transform what backward reads; a replay's tensors are saved by
    checkpoint's own hook, innermost, and would reach backward untransformed."""
    top = top_saved_tensors_hooks()  # checkpoint's recomputation hook
    if top is None:
        return None
    ck_pack, ck_unpack = top
    u_pack, u_unpack = user

    def pack(t: torch.Tensor) -> Any:
        return ck_pack(u_unpack(u_pack(t)))

    return torch.autograd.graph.saved_tensors_hooks(pack, ck_unpack)


def _drew_uncaptured(inv: _Invocation, rngs: list, before: list) -> None:
    """The replay drew from a global host generator its forward's state of which was not
    kept (the forward was the first to draw from it after every probe): it drew other values
    than the forward did. A divergence of this step, recorded and warned; every call captures
    the generator from the next step on."""
    drew = [r.name for r in moved(rngs, before)]
    if not drew:
        return
    rt = inv.rt
    rt.divergences += 1
    rt.engine.records.append(
        step=inv.step,
        segment=rt.name,
        contract_version=inv.version,
        check=REPLAY,
        outcome="divergence",
        detail={
            "seen": f"the replay drew from {', '.join(drew)}, first drawn after the probe",
            "action": "captured at every call from the next step on",
        },
    )
    warnings.warn(
        f"segment {rt.name!r}: its replay for step {inv.step} drew from {', '.join(drew)}, "
        "which its forward was the first to draw from since its probe: that step's gradients "
        "used other draws. Every replay runs from the forward's state from the next step on. "
        "Recorded as a divergence.",
        RuntimeWarning,
        stacklevel=2,
    )


def _entry_name(inv: _Invocation, t: torch.Tensor) -> str:
    return next((e.name for e, x in inv.tensors if x is t), "state")


def _early_stop() -> bool:
    early = _checkpoint_module._enable_checkpoint_early_stop
    return early is None or bool(early)


def _departed(exc_type: type | None, early_stop: bool) -> bool:
    """Whether checkpoint's recomputation of a segment left its forward's path.

    Under early stop (torch's default) a recomputation that saves as many tensors as the
    forward did ends with checkpoint's stop signal raised through the replay context; one that
    ends normally saved fewer, and checkpoint refuses it right after (without early stop that
    refusal comes after the context, see :func:`replay_error_from`). One that saves more is
    refused inside, with a CheckpointError."""
    if exc_type is None:
        return early_stop
    return issubclass(exc_type, CheckpointError)


def _replay_departed(inv: _Invocation, exc: BaseException | None) -> None:
    """Record the departed replay as a divergence, then raise it as a ReplayError that names
    the segment, instead of checkpoint's error from deep inside backward."""
    raise departed_error(inv.rt, inv.step, inv.version, exc) from exc


def _refusals_name_the_segment(inv: _Invocation) -> bool:
    """Checkpoint refuses some departed recomputations only after this context has exited
    (the same number of saved tensors with other shapes or dtypes; fewer, with its early stop
    off): make that refusal the segment's ReplayError, with its record, wherever backward was
    called from (a bare ``loss.backward()`` under ``install()`` too).

    While costs are measured, the replay's time is recorded once that check has passed, with
    checkpoint's work between the replay context's end and it (``inv.t_pending``). Returns
    whether the check is wrapped (else the context records the time itself)."""
    frame = checkpoint_frame_recomputing()
    if frame is None or "check_recomputed_tensors_match" in vars(frame):
        return False
    check = type(frame).check_recomputed_tensors_match
    ref = weakref.ref(frame)  # the frame holds this function: no cycle to outlive backward
    rt, step, version = inv.rt, inv.step, inv.version

    def checked(gid: Any) -> None:
        try:
            check(ref(), gid)
        except CheckpointError as exc:
            raise departed_error(rt, step, version, exc) from exc
        if inv.t_pending is not None:
            seconds, exited = inv.t_pending
            inv.t_pending = None
            eng = rt.engine
            if eng._sync:
                torch.cuda.synchronize(eng._cuda_device)
            eng._record_replay_time(inv, seconds + max(clock(eng._cuda) - exited, 0.0))

    frame.check_recomputed_tensors_match = checked
    return True


def replay_error_from(eng: ReplayHost, exc: BaseException) -> ReplayError | None:
    """A ``CheckpointError`` that reached the step's backward call, as the error of the
    segment whose replay it refused (its divergence record written), or None when it is not
    one of ours. The replay context converts the errors it sees; these are the ones it cannot
    (refused by checkpoint after the replay context has exited: the same number of saved
    tensors with other shapes or dtypes, or fewer with checkpoint's early stop turned off)."""
    last = eng.last_replay
    if (
        last is None
        or not isinstance(exc, CheckpointError)
        or not any(w in str(exc) for w in ("metadata", "number of tensors", "more tensors"))
    ):
        return None
    rt, step, version = last
    return departed_error(rt, step, version, exc)


def departed_error(
    rt: "ReplaySegment", step: int, version: int, exc: BaseException | None
) -> ReplayError:
    """The error for a replay of ``rt`` (forward of ``step``, contract ``version``) that left
    its forward's path, after its divergence record. ``exc``: checkpoint's error, if any."""
    eng = rt.engine
    rt.divergences += 1
    seen = (
        "it saved fewer tensors for backward than its forward did"
        if exc is None
        else str(exc).splitlines()[0].replace("torch.utils.checkpoint: ", "")
    )
    eng.records.append(
        step=step,
        segment=rt.name,
        contract_version=version,
        check=REPLAY,
        outcome="divergence",
        detail={"seen": seen, "action": "raise"},
    )
    return ReplayError(
        f"segment {rt.name!r} (contract v{version}): its replay in backward took another "
        f"path than its forward of step {step} ({seen}), so this step's gradients cannot be "
        "computed from it. Its forward depends on something its contract does not restore: a "
        "value read from outside the model (held in a closure, an environment variable, the "
        "clock, a file), a random draw from a generator nobody passes to the segment, or a "
        "parameter's requires_grad switched between the forward and its backward (freeze "
        "layers between steps, not inside one). Make that value an attribute of the model, a "
        "module-level value its code names, or an argument of the segment, or keep this "
        "segment's "
        f"activations (preservation={{{rt.name!r}: 'retain'}}). Recorded as a divergence."
    )


class _Open(threading.local):
    def __init__(self) -> None:
        self.stack: list[_ReplayContext] = []


#: the replay contexts entered and not yet ended on this thread, outermost first (see
#: _check_versions; a replay nested in another runs on the thread of the one around it)
_OPEN = _Open()


def _reset_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    # The replay's own in-place ops bumped versions of live state that is byte-for-byte back
    # as it was; resetting keeps autograd's saved-tensor checks and our own checks truthful.
    if tensors:
        set_versions(tensors, versions)


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
