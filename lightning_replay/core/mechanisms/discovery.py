"""The probe: watch one segment forward and its window, and say what replay must restore.

During the segment's probe forward (which runs retained, so it is always exact) a dispatch mode
sees every aten op. A tensor argument whose storage was not produced inside the segment is
state; its bytes are copied, or digested, at first touch (before the op runs). Arguments the
schema marks as written are writes, and from that moment the window's region log is armed for
that storage.
``generator=`` arguments name private generators; seeded ops without one use the global RNG.

When the segment's backward starts (its replay time, had it been replayed), every touched
storage is compared byte for byte with its first-touch copy (or digest): that finds what changed in the
window, including writes that bump no version counter and carry no schema annotation (eager
CPU batch norm). Undoing the logged regions on the live bytes tells whether ``regions`` alone
explains each change.

Most touched state keeps no copy (issue 31: a whole copy of each big buffer, held from first
touch to the segment's backward, put the probe step over a byte budget that planned steps
hold). It keeps a digest of its first-touch bytes instead, and its storage's region log keeps
the old bytes of each region written: changed is a digest that differs, and ``regions`` explains
the change when undoing the log gives the first-touch digest back (a replayed probe's replay
undoes the same log). A copy is still taken where a write can come unlogged: before an op that
writes its arguments without a schema annotation (:data:`UNANNOTATED_WRITERS`, eager batch
norm's running statistics; the copy is the first-touch bytes, rebuilt by undoing the log), before
a host view that can be written (``.numpy()``), and, in a replayed probe, of storages up to
:data:`COPY_BELOW` bytes (a write after the window's forward, where no capture runs, is then
put back for its replay).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Collection

import torch

from lightning_replay._compat import TorchDispatchMode, op_arguments, tree_leaves
from lightning_replay.core.mechanisms.preservation import RegionLog, redo, undo, write_args
from lightning_replay.core.base.state import (
    Extent,
    StorageKey,
    byte_span,
    digest,
    hull,
    same_generator,
    storage_bytes,
    storage_identity,
    storage_key,
)

_SEEDED = torch.Tag.nondeterministic_seeded
_aten = torch.ops.aten

#: a replayed probe still copies the storages it touches up to this size at first touch (state,
#: and arguments made outside autograd: a batch): a write after the window's forward (between
#: the step's forward and its backward, where no capture runs) is then put back for its replay,
#: at a small cost. A bigger storage keeps a digest: such a write to it is caught by the
#: replay's comparison (a recorded divergence, a ``ReplayError`` under
#: ``on_violation="raise"``), not put back. Issue 31: a copy of a big buffer, held from first
#: touch to the segment's backward, put the probe step over the byte budget planned steps hold
COPY_BELOW = 64 * 1024

#: ops that write tensor arguments their schema does not mark as written (batch norm in
#: training writes ``running_mean`` and ``running_var``; no version counter moves): a probe
#: copies a state storage before such an op touches it, as no log sees the write
UNANNOTATED_WRITERS = frozenset(
    op
    for name, overloads in (
        ("native_batch_norm", ("default", "out")),
        ("cudnn_batch_norm", ("default", "out")),
        ("miopen_batch_norm", ("default", "out")),
    )
    for op in (getattr(getattr(_aten, name, None), o, None) for o in overloads)
    if op is not None
)


@dataclasses.dataclass
class Touch:
    """One storage the segment touched that it did not produce."""

    key: StorageKey
    tensor: torch.Tensor  # the first tensor seen on this storage (for external state)
    #: storage bytes at first touch (None: parameters, uncopied arguments, or digested)
    snapshot: torch.Tensor | None
    mark: int  # region-log position at first touch
    #: the digest of its bytes at first touch, where no copy was taken (see the module's
    #: docstring); None once a copy is taken after all (:meth:`DiscoveryMode.copy_now`)
    first_digest: int | None = None
    first_nbytes: int = 0  # (and its storage's size then)
    #: its log was armed as copied (entries keep only a digest of the old bytes)
    arm_copied: bool = False
    read: bool = False
    annotated_write: bool = False
    changed_in_segment: bool = False
    is_input: bool = False
    #: the tensor object the op was given (not a parameter): if it is pointed at another
    #: storage later (``.data =``, ``set_``), a replayed probe points it back for its replay
    source: Any = None
    #: the bytes of the storage the segment's ops reached (the hull of every tensor on it
    #: they were given), None: all of it. Issue 31: a buffer that is a view of a bigger one
    #: is preserved and compared by its own bytes, not its base's
    span: Extent | None = None
    #: the extent its region-log arm reads: the whole storage while the forward runs, its
    #: span once the forward has returned (:meth:`DiscoveryMode.finish_segment`)
    arm_extent: Extent | None = None
    #: the digest of its span's bytes at first touch (a digested storage, once its forward
    #: has returned); None: compared whole
    span_digest: int | None = None
    #: the region-log length when its storage left ``key`` (reallocated in place by a growing
    #: ``resize_``): the writes logged at that address since are another storage's
    log_end: int | None = None

    def entries(self, log: RegionLog) -> list:
        """The writes logged to its storage since its first touch."""
        entries = log.since(self.key, self.mark)
        return entries if self.log_end is None else entries[: max(0, self.log_end - self.mark)]


class DiscoveryMode(TorchDispatchMode):
    """Records reads, writes and generators of one segment invocation."""

    def __init__(
        self,
        log: RegionLog,
        input_keys: set[StorageKey],
        params: Collection[StorageKey] = frozenset(),
        uncopied: Collection[StorageKey] = frozenset(),
        copy_below: int = 0,
    ) -> None:
        super().__init__()
        self.log = log
        self.input_keys = input_keys
        #: storages up to this many bytes are copied at first touch, bigger ones keep a digest
        #: (a replayed probe's: :data:`COPY_BELOW`); 0: none (a retained probe puts nothing
        #: back, a digest is all it compares)
        self.copy_below = copy_below
        self._busy = 0  # > 0 while it digests or copies (their host reads are its own)
        #: storages compared by their logged writes, as parameters are, not copied (a
        #: replayed probe's arguments that are no model state: its activations)
        self.uncopied = uncopied
        # Parameters are not copied: a probe that copied every parameter it reads would peak
        # above a plain step. The optimizer writes them between steps, not inside the window;
        # a write inside it is annotated and logged, and that is what they are compared by
        # (not their version counters: Lightning may swap parameters with their counters).
        self.params = params
        #: storages the segment's ops made, each with a weak reference to its storage: an
        #: address is the segment's own only while that storage lives (a freed output's
        #: address may be given to state next, see :meth:`_made_here`)
        self.produced: dict[StorageKey, weakref.ref] = {}
        self.touched: dict[StorageKey, Touch] = {}
        #: storages of FSDP-managed parameters the segment read: parameter traffic, not state
        #: (each with a weak reference to its storage: FSDP frees it after the forward, and
        #: state sized later in the forward may get its address, see :meth:`_traffic`)
        self.parameter_traffic: dict[StorageKey, weakref.ref] = {}
        self.generators: dict[int, torch.Generator] = {}
        #: each generator's state when the segment first used it (a replayed probe's replay
        #: draws from there again)
        self.generator_states: dict[int, torch.Tensor] = {}
        self.uses_global_rng = False
        #: an op wrote an argument it does not return (``rrelu_with_noise``'s ``noise``):
        #: autograd saved it before the kernel wrote it, so checkpoint's early stop, which ends
        #: the replay at the last saved tensor's pack, would leave it unwritten (see
        #: :func:`writes_unreturned`)
        self.writes_unreturned = False
        #: the forward read a tensor's value on the host (``.item()``, ``int()``,
        #: ``.tolist()``): a view's offsets may then come from state, and another step's
        #: view reach other bytes, so every storage is compared and preserved whole
        self.host_read = False

    def _touch(self, t: torch.Tensor) -> Touch | None:
        key = storage_key(t)
        if key is None or self._made_here(key, t):
            return None
        # the bytes the op is given: a view the model holds (a buffer that is a view of a
        # bigger one, issue 31); a view the forward makes itself (``base[p : p + k]``) is
        # made from its base, whose bytes the op that makes it is given (its offset may
        # be another next step)
        span = byte_span(t)
        touch = self._touched_at(key, t)
        if touch is not None:
            if touch.span is not None:
                touch.span = hull(touch.span, span or touch.span)
        else:
            if self._traffic(key, t):
                return None
            if _fsdp_managed(t):
                # FSDP gathers the parameter before the forward and, after resharding, again
                # before the backward (its storage freed and refilled with the same bytes):
                # parameter traffic that FSDP keeps consistent, not state to preserve.
                self.parameter_traffic[key] = weakref.ref(t.untyped_storage())
                return None
            snap = first = None
            is_input = key in self.input_keys
            if key not in self.params and key not in self.uncopied:
                self._busy += 1
                try:
                    with torch.no_grad():
                        if t.untyped_storage().nbytes() <= self.copy_below:
                            snap = storage_bytes(t).clone()
                        else:
                            first = digest(storage_bytes(t))
                finally:
                    self._busy -= 1
            touch = Touch(
                key,
                t.detach(),
                snap,
                self.log.arm(key, copied=snap is not None),
                first_digest=first,
                first_nbytes=t.untyped_storage().nbytes(),
                arm_copied=snap is not None,
                is_input=is_input,
                source=weakref.ref(t),
                span=span or (0, 0),
            )
            self.touched[key] = touch
        return touch

    def _touched_at(self, key: StorageKey, t: torch.Tensor) -> Touch | None:
        """The touch of ``t``'s storage. A touch found at its address may be of another
        storage: one a growing ``resize_`` reallocated in place (an observer's ``scale`` sized
        to its channels) leaves its old address to the allocator, and the next storage made
        (the next observer's ``min_val``) may get it. That touch is kept apart then, under a key
        no address has, and ``t``'s storage is touched anew."""
        touch = self.touched.get(key)
        if touch is None or touch.tensor.untyped_storage() is t.untyped_storage():
            return touch
        touch.log_end = len(self.log.logs.get(key, ()))
        self.touched[(f"{key[0]}:moved", id(touch))] = self.touched.pop(key)
        return None

    def copy_now(self, touch: Touch) -> None:
        """Take a digested storage's first-touch copy now, before a write no log sees: its
        live bytes with the writes logged since first touch undone (then redone)."""
        if touch.first_digest is None:
            return
        entries = touch.entries(self.log)
        self.log.paused += 1  # (these swaps are no write of the window's)
        try:
            with torch.no_grad():
                undo(entries)
                try:
                    touch.snapshot = storage_bytes(touch.tensor).clone()
                finally:
                    redo(entries)
        finally:
            self.log.paused -= 1
        touch.first_digest = None
        touch.span = None  # (a write no log sees can reach any byte)

    def touch_all(
        self, tensors: list[torch.Tensor], copy: bool = False, host: bool = False
    ) -> None:
        """Watch state the segment may read without an op the mode sees (``.tolist()`` and
        other host reads, or reads that start after a warm-up). ``copy``: a host view that
        can be written (``.numpy()``) was handed out: no log sees a write through it."""
        if self._busy:  # (a digest's own host read: no read of the segment's)
            return
        self.host_read |= host
        for t in tensors:
            touch = self._touch(t)
            if copy and touch is not None:
                self.copy_now(touch)

    def release(self) -> None:
        """Disarm the region log for a probe that will never be observed."""
        for touch in self.touched.values():
            self.log.release(touch.key, copied=touch.arm_copied, extent=touch.arm_extent)
        self.touched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = {name for _, name in write_args(func)}
        if func is _aten._local_scalar_dense.default and not self._busy:
            self.host_read = True
        empty: list[torch.Tensor] = []  # written state with no bytes yet (see below)
        for i, a in enumerate(op_arguments(func)):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if a.name == "generator" and v is not None:
                if id(v) not in self.generators:
                    self.generators[id(v)] = v
                    if not _is_default_generator(v):  # checkpoint restores those itself
                        self.generator_states[id(v)] = v.get_state()
            for t in _tensors(v):
                if a.name in written and storage_key(t) is None and _plain_strided(t):
                    # (with an alias made now: its shape is the one the forward gave the op)
                    empty.append((t, t.detach()))
                touch = self._touch(t)
                if touch is not None:
                    if func in UNANNOTATED_WRITERS:
                        self.copy_now(touch)
                    if a.name in written:
                        touch.annotated_write = True
                    else:
                        touch.read = True
        if written and writes_unreturned(func):
            self.writes_unreturned = True
        if (
            _SEEDED in func.tags
            and kwargs.get("generator") is None
            and not any(isinstance(a, torch.Generator) for a in args)
        ):
            self.uses_global_rng = True
        out = func(*args, **kwargs)
        for t, before in empty:
            # An empty tensor the op resized and wrote (a per-channel observer's min_val and
            # max_val at their first forward: ``fused_moving_avg_obs_fake_quant``): it had no
            # storage to watch before the op, it has state's bytes now. Its first-touch copy is
            # the nothing it held, so the window sees it changed. Its alias keeps the shape
            # the op was given: a replay points the tensor back at that shape, with no bytes
            # (a replayed kernel that finds state already sized for it reads it as other state).
            key = storage_key(t)
            if key is not None and self._touched_at(key, t) is None and not self._made_here(key, t):
                self.touched[key] = Touch(
                    key,
                    before,
                    torch.empty(0, dtype=torch.uint8, device=t.device),
                    self.log.arm(key, copied=True),
                    arm_copied=True,
                    annotated_write=True,
                    source=weakref.ref(t),
                    span=None,
                )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key is not None and self._touched_at(key, t) is None:
                    self.produced[key] = weakref.ref(t.untyped_storage())
        return out

    def _traffic(self, key: StorageKey, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is an FSDP-managed parameter's the segment read. By its
        storage, not its address alone: FSDP frees a gathered parameter once its unit's forward
        is done (the storage object stays, for the regather), and state the segment sizes after
        that (an observer's ``min_val``, a queue grown by ``resize_``) may get the address."""
        ref = self.parameter_traffic.get(key)
        if ref is None:
            return False
        if ref() is t.untyped_storage():
            return True
        del self.parameter_traffic[key]  # (its storage is gone or moved: the address is free)
        return False

    def _made_here(self, key: StorageKey, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one the segment's ops made. Its address alone does not
        say: an output freed within the forward leaves its address to the allocator, and state
        allocated later (an observer's empty ``min_val`` sized by its first op, a queue grown
        by ``resize_``) may get it. Taken for the segment's own, that state went unwatched and
        its replay saw the forward's writes: a per-channel fake-quantize crashed in its replay,
        or computed other scales (wrong gradients), whenever the allocator reused an address."""
        ref = self.produced.get(key)
        if ref is None:
            return False
        if ref() is t.untyped_storage():
            return True
        del self.produced[key]  # (that output's storage is gone: its address is another's now)
        return False

    def finish_segment(self) -> None:
        """Called when the segment's forward returns: which state did it change itself?"""
        with torch.no_grad():
            for touch in self.touched.values():
                if touch.first_digest is not None:
                    live = storage_bytes(touch.tensor)
                    touch.changed_in_segment = (
                        live.numel() != touch.first_nbytes or digest(live) != touch.first_digest
                    )
                elif touch.snapshot is None:
                    touch.changed_in_segment = touch.annotated_write
                else:
                    touch.changed_in_segment = not torch.equal(
                        storage_bytes(touch.tensor), touch.snapshot
                    )
                self._narrow(touch)

    def _narrow(self, touch: Touch) -> None:
        """From the forward's end, the touch's arm reads only its span: the window's writes
        outside it are no concern of this segment's (issue 31). A digested storage gets its
        span's first-touch digest now (its live bytes with the forward's logged writes
        undone); where those do not give the first-touch bytes back (a write no log saw), it
        stays compared whole."""
        span = touch.span
        if span is None or self.host_read or touch.key in self.params or touch.key in self.uncopied:
            touch.span = None
            return
        live = storage_bytes(touch.tensor)
        if (
            span[1] > live.numel()
            or live.numel() != touch.first_nbytes
            or (span[0] == 0 and span[1] == live.numel())
        ):
            touch.span = None  # (all of it: logged and compared as it was)
            return
        if touch.first_digest is not None:
            entries = touch.entries(self.log)
            if not touch.changed_in_segment:
                touch.span_digest = digest(live[span[0] : span[1]])
            elif entries and all(e.saved is not None for e in entries):
                self.log.paused += 1
                try:
                    undo(entries)
                    try:
                        if digest(live) == touch.first_digest:
                            touch.span_digest = digest(live[span[0] : span[1]])
                    finally:
                        redo(entries)
                finally:
                    self.log.paused -= 1
            if touch.span_digest is None:
                touch.span = None
                return
        self.log.narrow(touch.key, touch.arm_extent, span)
        touch.arm_extent = span


_UNRETURNED: dict[Any, bool] = {}


def writes_unreturned(func: Any) -> bool:
    """Whether an aten op writes an argument (per its schema) that no return aliases: a noise
    or workspace buffer it fills (``rrelu_with_noise``'s ``noise``). Autograd saves such an
    argument before the kernel writes it; torch's checkpoint with early stop ends its
    recomputation at the pack of the last saved tensor, before the kernel runs, and the
    backward then reads an unwritten buffer (plain ``torch.utils.checkpoint`` gets
    ``F.rrelu(training=True)``'s gradients wrong so). Cached per op.

    Example:
        >>> writes_unreturned(torch.ops.aten.rrelu_with_noise.default)
        True
        >>> writes_unreturned(torch.ops.aten.add_.Tensor)
        False
    """
    out = _UNRETURNED.get(func)
    if out is None:
        returned: set[str] = set()
        for r in func._schema.returns:
            if r.alias_info is not None:
                returned |= set(r.alias_info.before_set)
        out = any(
            a.alias_info is not None
            and a.alias_info.is_write
            and not set(a.alias_info.before_set) & returned
            for a in op_arguments(func)
        )
        _UNRETURNED[func] = out
    return out


def _is_default_generator(g: torch.Generator) -> bool:
    """Whether ``g`` drives the CPU default generator or its device's default generator."""
    if g.device.type == "cpu":
        return same_generator(g, torch.default_generator)
    if g.device.type == "cuda" and torch.cuda.is_initialized():
        index = g.device.index if g.device.index is not None else torch.cuda.current_device()
        return same_generator(g, torch.cuda.default_generators[index])
    return False


_FSDP_PARAMETERS: dict[int, Any] = {}  # id -> weakref of each FSDP2 unsharded parameter


def _fsdp_managed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter FSDP2 (``fully_shard``) shards and gathers.

    Its sharded form is a DTensor; its gathered form is a plain ``nn.Parameter`` that FSDP
    keeps per parameter and refills at each all-gather. FSDP2 has no public registry of those:
    they are found through its states (private, hence the torch pin), only for parameters.
    """
    if not isinstance(t, torch.nn.Parameter):
        return _is_dtensor(t)
    ref = _FSDP_PARAMETERS.get(id(t))
    if ref is not None and ref() is t:
        return True
    if _is_dtensor(t):
        return True
    _FSDP_PARAMETERS.clear()
    for param in _fsdp_unsharded_parameters():
        _FSDP_PARAMETERS[id(param)] = weakref.ref(param)
    ref = _FSDP_PARAMETERS.get(id(t))
    return ref is not None and ref() is t


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _fsdp_unsharded_parameters() -> list[torch.Tensor]:
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    out = []
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None:
                out.append(param)
    return out


def _plain_strided(t: torch.Tensor) -> bool:
    return (
        t.layout == torch.strided
        and not t.is_meta
        and type(t) in (torch.Tensor, torch.nn.Parameter)
    )


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


@dataclasses.dataclass
class Observation:
    """What the window did to one touched storage, seen at the segment's backward."""

    touch: Touch
    changed: bool
    regions_ok: bool
    region_bytes: int
    #: a parameter's logged writes in the window, kept for a replayed probe's replay (it
    #: undoes them, as parameters are not copied), or those of a digested storage whose
    #: change they explain
    entries: list | None = None
    #: a digested storage changed in a way its log does not explain: no bytes to put back
    #: (a replayed probe's replay reads it as it is now; its comparison says if that mattered)
    unrestorable: bool = False
    #: a digested storage's digest at the window's end (a replayed probe's): its replay must
    #: leave these bytes (see probe_replay._check_unlogged_writes)
    after: int | None = None


def observe_window(
    mode: DiscoveryMode, log: RegionLog, keep_changed: bool = False
) -> list[Observation]:
    """Compare every touched storage with its first-touch bytes, then release the log arms.

    The first-touch copies go, except (``keep_changed``) those of storages the window changed:
    a replayed probe's replay puts those back.
    """
    out = []
    with torch.no_grad():
        for touch in mode.touched.values():
            key = touch.key  # (the dict's key differs for a storage that left its address)
            entries = touch.entries(log)
            if touch.first_digest is not None:
                out.append(_observe_digested(touch, entries, keep_changed))
                log.release(key, extent=touch.arm_extent)
                continue
            if touch.snapshot is None:
                # a parameter (or an uncopied argument): its writes in the window are annotated
                # and logged (the optimizer writes it between steps); a version counter is no
                # help here, as parameters may be swapped (swap_tensors) with their counters
                # between forward and backward. Pointed at other bytes (``.data =``) is a change
                # too: the replay must read the old bytes.
                src = touch.source() if touch.source is not None else None
                moved = src is not None and storage_identity(src) != storage_identity(touch.tensor)
                changed = bool(entries) or touch.annotated_write or moved
                # every change logged, region by region (an optimizer's step inside a manual
                # window): undoing the log restores it, as for a copied storage
                logged = bool(entries) and not moved and not touch.is_input
                out.append(
                    Observation(
                        touch,
                        changed,
                        logged,
                        sum(e.nbytes for e in entries),
                        entries if keep_changed and entries else None,
                    )
                )
                log.release(key, extent=touch.arm_extent)
                continue
            live = storage_bytes(touch.tensor)
            span = touch.span if live.numel() == touch.snapshot.numel() else None
            lo, hi = span if span is not None else (0, live.numel())
            # A write the probe saw is a write, whatever its bytes (a zero point recomputed
            # to the same value, an embedding row renormalized only later): the segment
            # writes it, or the window does.
            changed = (
                live.numel() != touch.snapshot.numel()
                or bool(entries)
                or touch.annotated_write
                or not torch.equal(live[lo:hi], touch.snapshot[lo:hi])
            )
            regions_ok = False
            if changed and entries and live.numel() == touch.snapshot.numel():
                # entries that kept only a digest (the log's copied arms) take their old bytes
                # from the first-touch copy, for this comparison only
                light = [e for e in entries if e.saved is None]
                if all(e.rebuild(touch.snapshot) for e in light):
                    undo(entries)
                    regions_ok = torch.equal(live[lo:hi], touch.snapshot[lo:hi])
                    redo(entries)
                for e in light:
                    e.saved = None
            out.append(Observation(touch, changed, regions_ok, sum(e.nbytes for e in entries)))
            log.release(key, copied=touch.arm_copied, extent=touch.arm_extent)
            if not (keep_changed and changed):
                touch.snapshot = touch.snapshot.new_empty(0)  # the probe's copies go now
    return out


def _observe_digested(touch: Touch, entries: list, keep_changed: bool) -> Observation:
    """A storage the probe kept only a digest of: changed if its digest differs (or a write was
    seen); ``regions`` explains the change if undoing its log gives the first-touch digest back.
    The entries hold the old bytes (its arm was not a copied one): a replayed probe's replay
    undoes them (``keep_changed``)."""
    t = touch.tensor
    src = touch.source() if touch.source is not None else None
    moved = src is not None and storage_identity(src) != storage_identity(t)
    live = storage_bytes(t)
    resized = live.numel() != touch.first_nbytes
    span = touch.span if touch.span_digest is not None and not resized else None
    # (compared by its span's bytes where the forward's end told them: issue 31)
    part, first = (
        (live, touch.first_digest)
        if span is None
        else (
            live[span[0] : span[1]],
            touch.span_digest,
        )
    )
    now = (
        digest(live) if keep_changed or not (resized or entries or touch.annotated_write) else None
    )
    if span is not None and now is not None:
        mine = digest(part)
    else:
        mine = now
    changed = resized or bool(entries) or touch.annotated_write or mine != first
    regions_ok = False
    if changed and not (moved or resized) and all(e.saved is not None for e in entries):
        undo(entries)
        try:
            regions_ok = digest(part) == first
        finally:
            redo(entries)
    return Observation(
        touch,
        changed,
        regions_ok,
        sum(e.nbytes for e in entries),
        entries if keep_changed and changed and regions_ok and entries else None,
        unrestorable=changed and not regions_ok,
        after=now if keep_changed else None,
    )
