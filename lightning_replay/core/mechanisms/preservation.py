"""Preserving state between a segment's forward and its replay, and swapping it in and out.

Two ways to keep what the forward saw:

* ``whole``: a copy of the state's storage taken at the segment's forward. All of one call's
  copies live in one flat buffer per device (:class:`WholeSnapshot`): a segment with many small
  state tensors (three batch-norm statistics per norm layer) costs one allocation and a few
  batched copies per forward and replay, not three small ops per tensor.
* ``regions``: an undo log. While the window runs, a dispatch mode sees every write to an armed
  storage and saves the old bytes of exactly the region written (a slice view, or the rows of an
  ``index_copy_`` / ``index_put_`` / ``scatter_``) before the write happens.

Swapping is in place and self-inverse: undoing the log in reverse order exchanges old and new
bytes, replaying the same swaps in forward order puts the live bytes back, and the log is intact
again afterwards. Every write here goes through ``.data`` or a raw byte view, so no version
counter moves.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_replay._compat import TorchDispatchMode, op_arguments
from lightning_replay.core.base import state as _state
from lightning_replay.core.base.clock import clock
from lightning_replay.core.base.state import (
    _SWAP_CHUNK,
    Extent,
    StorageKey,
    byte_span,
    digest,
    extent_bytes,
    storage_key,
    swap_,
)

_aten = torch.ops.aten
_WRITE_ARGS: dict[Any, tuple[tuple[int, str], ...]] = {}


def write_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an aten op writes, per its schema (cached)."""
    cached = _WRITE_ARGS.get(func)
    if cached is None:
        cached = tuple(
            (i, a.name)
            for i, a in enumerate(op_arguments(func))
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITE_ARGS[func] = cached
    return cached


def _unannotated_writes() -> dict[Any, tuple[tuple[int, str], ...]]:
    out = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        for overload in ("default", "out"):
            op = getattr(getattr(_aten, name, None), overload, None)
            if op is not None:
                out[op] = tuple(
                    (i, a.name)
                    for i, a in enumerate(op_arguments(op))
                    if a.name in ("running_mean", "running_var")
                )
    return out


#: ops that write arguments their schema does not mark as written, and which ones: batch norm
#: in training writes ``running_mean`` and ``running_var`` (no version bump either). The
#: capture logs them as writes: a probe under a byte budget keeps only a digest of big state,
#: and a batch norm the window runs outside the segments (after them, in the root's forward or
#: ``training_step``) must leave the old bytes of statistics a segment read
UNANNOTATED_WRITES = _unannotated_writes()


def arg_value(func: Any, args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    if pos < len(args):
        return args[pos]
    if name in kwargs:
        return kwargs[name]
    default = op_arguments(func)[pos].default_value
    return default


_INDEX_OPS = {
    _aten.index_copy_.default,
    _aten.index_add_.default,
    _aten.index_fill_.int_Scalar,
    _aten.index_fill_.int_Tensor,
}
_SCATTER_OPS = {
    _aten.scatter_.src,
    _aten.scatter_.value,
    _aten.scatter_.reduce,
    _aten.scatter_.value_reduce,
    _aten.scatter_add_.default,
    _aten.scatter_reduce_.two,
}


def _writes_whole_view(func: Any) -> bool:
    """Whether ``func`` writes its target view whole (no index argument picks the elements)."""
    return not (
        func in _INDEX_OPS
        or func in _SCATTER_OPS
        or func is _aten.index_put_.default
        or func is _aten._index_put_impl_.default
    )


class RegionEntry:
    """Old bytes of one written region, restorable by :meth:`swap`."""

    __slots__ = ("target", "kind", "dim", "index", "saved", "nbytes", "digest")

    def __init__(self, func: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> None:
        self.target = target.detach()
        self.dim = None
        self.index: Any = None
        with torch.no_grad():
            if func in _INDEX_OPS or func in _SCATTER_OPS:
                self.kind = "index" if func in _INDEX_OPS else "scatter"
                self.dim = int(args[1])
                self.index = args[2].detach()
                if self.kind == "index":
                    self.saved = self.target.index_select(self.dim, self.index)
                else:
                    self.saved = self.target.gather(self.dim, self.index)
            elif func is _aten.index_put_.default or func is _aten._index_put_impl_.default:
                self.kind = "index_put"
                self.index = [None if i is None else i.detach() for i in args[1]]
                self.saved = _aten.index.Tensor(self.target, self.index)
            else:
                self.kind = "view"
                self.saved = self.target.clone()
        self.nbytes = self.saved.numel() * self.saved.element_size()
        self.digest: int | None = None

    @property
    def held(self) -> int:
        """Bytes this entry holds (0 once :meth:`drop_bytes` let them go)."""
        return self.nbytes if self.saved is not None else 0

    def drop_bytes(self) -> None:
        """Keep only the old bytes' digest: for a storage whose every reader holds a copy from
        before the write (a probe's first-touch copy), which rebuilds them (:meth:`rebuild`)."""
        self.digest = digest(self.saved)
        self.saved = None

    def rebuild(self, before: torch.Tensor) -> bool:
        """Take the old bytes from ``before``, a flat uint8 copy of the whole storage made
        before the write; False (nothing taken) where they are not what the write replaced
        (the region was written unlogged in between)."""
        t = self.target
        with torch.no_grad():
            try:
                whole = torch.as_strided(
                    before.view(t.dtype), t.shape, t.stride(), t.storage_offset()
                )
            except RuntimeError:  # the copy does not cover the region (a storage resized)
                return False
            if self.kind == "view":
                saved = whole.clone()
            elif self.kind == "index":
                saved = whole.index_select(self.dim, self.index)
            elif self.kind == "scatter":
                saved = whole.gather(self.dim, self.index)
            else:
                saved = _aten.index.Tensor(whole, self.index)
        if digest(saved) != self.digest:
            return False
        self.saved = saved
        return True

    def swap(self) -> None:
        """Exchange the region's current bytes with the saved ones."""
        with torch.no_grad():
            raw = self.target.data
            if self.kind == "view":
                cur = raw.clone()
                raw.copy_(self.saved)
            elif self.kind == "index":
                cur = raw.index_select(self.dim, self.index)
                raw.index_copy_(self.dim, self.index, self.saved)
            elif self.kind == "scatter":
                cur = raw.gather(self.dim, self.index)
                raw.scatter_(self.dim, self.index, self.saved)
            else:
                cur = _aten.index.Tensor(raw, self.index)
                _aten.index_put_.default(raw, self.index, self.saved, False)
            self.saved = cur


class RegionLog:
    """Per-storage undo logs of the writes seen while storages are armed.

    A storage is armed once per pending reader (an invocation that will replay and needs it);
    its log is dropped when the last reader releases it, so the log never outlives its use.
    """

    def __init__(self) -> None:
        self.logs: dict[StorageKey, list[RegionEntry]] = {}
        self.armed: dict[StorageKey, int] = {}
        # The tensor whose version counter stands for each armed storage, and its version
        # right after the last logged write: ``.data`` writes, ``detach_`` and fused ops bump
        # it by zero, one or several per write, so the count of writes says nothing.
        self.owners: dict[StorageKey, torch.Tensor] = {}
        self.after: dict[StorageKey, int] = {}
        self.broken: set[StorageKey] = set()
        #: per storage, the log position of its latest arm: no reader undoes back to a point
        #: after it (see :meth:`repeats`)
        self.top: dict[StorageKey, int] = {}
        #: per storage, how many of its arms hold a copy of it from before their mark
        self.copied: dict[StorageKey, int] = {}
        #: per storage, the extent each arm reads (None: the whole storage) and their hull: a
        #: write outside the hull is no reader's (issue 31: a segment's buffer that is a view
        #: of a bigger root buffer the root writes whole), a write partly inside it keeps the
        #: old bytes of the part inside only
        self.extents: dict[StorageKey, dict[Extent | None, int]] = {}
        self.hulls: dict[StorageKey, Extent | None] = {}
        #: per storage, the log length when a write outside its hull was last left out
        self.skipped: dict[StorageKey, int] = {}
        self.nbytes = 0
        # > 0 while a replay runs: its writes (the swaps in and out, the replayed forward's
        # own, undone by its sandbox) are not the window's, even where backward runs inside a
        # manual window with the capture mode still on
        self.paused = 0

    def arm(
        self,
        key: StorageKey,
        owner: torch.Tensor | None = None,
        copied: bool = False,
        extent: Extent | None = None,
    ) -> int:
        """Start (or keep) logging writes to ``key``; returns the position to undo back to.
        ``copied``: this reader holds a copy of the storage from now (a probe's first touch),
        so while every reader does, entries keep only a digest of the old bytes. ``extent``:
        the bytes of the storage this reader reads (None: all of them); release with it."""
        self.armed[key] = self.armed.get(key, 0) + 1
        self._add_extent(key, extent)
        if copied:
            self.copied[key] = self.copied.get(key, 0) + 1
        if owner is not None and key not in self.owners:
            self.owners[key] = owner
            self.after[key] = owner._version
        mark = self.top[key] = len(self.logs.setdefault(key, []))
        return mark

    def repeats(self, key: StorageKey, target: torch.Tensor) -> bool:
        """Whether a write to ``target`` needs no entry: the storage's last entry, logged since
        its latest arm, saved the very same elements (an in-place chain on one view: ``mul_``
        then ``add_``). Every reader undoes back to a mark at or before that entry, which puts
        all of those elements back by itself, and :func:`redo` still ends at the live bytes,
        so a second copy of the region would only hold memory."""
        logs = self.logs.get(key)
        if not logs or len(logs) - 1 < self.top.get(key, 0):
            return False
        last = logs[-1]
        t = last.target
        return (
            last.kind == "view"
            and t.dtype == target.dtype
            and t.storage_offset() == target.storage_offset()
            and t.shape == target.shape
            and t.stride() == target.stride()
        )

    def expected_version(
        self, key: StorageKey, t: torch.Tensor, mark: int, at_forward: int
    ) -> int | None:
        """The version ``t`` must have if every write since ``mark`` was logged (None: the
        log cannot tell, ``t`` is not the tensor whose counter it followed)."""
        if key in self.broken:
            return -1  # a write between two logged ones was not logged
        if len(self.logs.get(key, ())) <= mark and self.skipped.get(key, -1) < mark:
            return at_forward
        if self.owners.get(key) is not t:
            return None
        return self.after.get(key, at_forward)

    def _add_extent(self, key: StorageKey, extent: Extent | None) -> None:
        ext = self.extents.setdefault(key, {})
        extent = None if extent is None else (int(extent[0]), int(extent[1]))
        ext[extent] = ext.get(extent, 0) + 1
        self._rehull(key)

    def _drop_extent(self, key: StorageKey, extent: Extent | None) -> None:
        ext = self.extents.get(key)
        if not ext:
            return
        extent = None if extent is None else (int(extent[0]), int(extent[1]))
        if extent not in ext:
            return  # (not known: the hull stays as wide as it is)
        ext[extent] -= 1
        if not ext[extent]:
            del ext[extent]
        self._rehull(key)

    def _rehull(self, key: StorageKey) -> None:
        ext = self.extents.get(key)
        if not ext or None in ext:
            self.hulls[key] = None
        else:
            self.hulls[key] = (min(e[0] for e in ext), max(e[1] for e in ext))

    def narrow(self, key: StorageKey, old: Extent | None, new: Extent | None) -> None:
        """One reader of ``key`` now reads ``new`` instead of ``old`` (a probe, once its
        segment's forward has shown which bytes it touched)."""
        if key in self.armed:
            self._add_extent(key, new)
            self._drop_extent(key, old)

    def clip(self, key: StorageKey, t: torch.Tensor, whole_view: bool) -> torch.Tensor | None:
        """What a write to ``t`` (on armed storage ``key``) must log: ``t``, the part of it
        inside the readers' hull (a dense ``t`` written whole, as a flat byte view), or None
        where it writes no byte any reader reads."""
        h = self.hulls.get(key)
        if h is None:
            return t
        span = byte_span(t)
        if span is None or span[1] <= h[0] or span[0] >= h[1]:
            self.skipped[key] = len(self.logs.get(key, ()))
            return None
        if (span[0] >= h[0] and span[1] <= h[1]) or not whole_view:
            return t
        if not _dense(t):
            return t  # (its bytes are not all of its span: kept whole)
        lo, hi = max(span[0], h[0]), min(span[1], h[1])
        return extent_bytes(t, (lo, hi))

    def release(self, key: StorageKey, copied: bool = False, extent: Extent | None = None) -> None:
        if copied and self.copied.get(key, 0) > 0:
            self.copied[key] -= 1
        n = self.armed.get(key, 0) - 1
        if n > 0:
            self.armed[key] = n
            self._drop_extent(key, extent)
            return
        self.armed.pop(key, None)
        self.extents.pop(key, None)
        self.hulls.pop(key, None)
        self.skipped.pop(key, None)
        self.owners.pop(key, None)
        self.after.pop(key, None)
        self.top.pop(key, None)
        self.copied.pop(key, None)
        self.broken.discard(key)
        for e in self.logs.pop(key, ()):
            self.nbytes -= e.held

    def record(self, key: StorageKey, entry: RegionEntry) -> None:
        logs = self.logs[key]
        if len(logs) <= self.top.get(key, 0) and self.copied.get(key, 0) >= self.armed[key]:
            # the first write since the latest arm, and every reader holds a copy from before
            # it: the old bytes are that copy's (a later write's may be an earlier one's result)
            entry.drop_bytes()
        logs.append(entry)
        self.nbytes += entry.held

    def since(self, key: StorageKey, mark: int) -> list[RegionEntry]:
        return self.logs.get(key, [])[mark:]

    def clear(self) -> None:
        self.logs.clear()
        self.armed.clear()
        self.owners.clear()
        self.after.clear()
        self.top.clear()
        self.copied.clear()
        self.broken.clear()
        self.extents.clear()
        self.hulls.clear()
        self.skipped.clear()
        self.nbytes = 0


class CaptureMode(TorchDispatchMode):
    """Logs the old bytes of every write to an armed storage, before the write runs.

    It also counts the ops it saw and the seconds spent saving each storage's regions, so the
    cost of ``regions`` is measured rather than assumed.
    """

    def __init__(self, log: RegionLog):
        super().__init__()
        self.log = log
        self._written: list[StorageKey] | None = None
        self.ops = 0
        self.entry_time: dict[StorageKey, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        log = self.log
        if self._written is not None:
            self._settle()
        armed = log.armed
        written = None
        if armed and not log.paused:
            writes = write_args(func)
            if func in UNANNOTATED_WRITES and arg_value(func, args, kwargs, 5, "training"):
                writes = writes + UNANNOTATED_WRITES[func]
            for pos, name in writes:
                v = arg_value(func, args, kwargs, pos, name)
                # a Tensor(a!)[] argument (the _foreach_ ops) writes each of its tensors
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if not isinstance(t, torch.Tensor):
                        continue
                    key = storage_key(t)
                    if key in armed:
                        t0 = clock(t.is_cuda)
                        owner = log.owners.get(key)
                        if owner is not None and owner._version != log.after.get(key):
                            log.broken.add(key)
                        whole_view = _writes_whole_view(func)
                        target = log.clip(key, t, whole_view)
                        if target is not None and not (whole_view and log.repeats(key, target)):
                            log.record(
                                key,
                                RegionEntry(func, args, kwargs, target)
                                if target is t
                                else RegionEntry(_aten.copy_.default, (), {}, target),
                            )
                        self.entry_time[key] = self.entry_time.get(key, 0.0) + clock(t.is_cuda) - t0
                        written = [key] if written is None else written + [key]
        self._written = written
        return func(*args, **kwargs)

    def _settle(self) -> None:
        # The version bump of an in-place op happens above this mode, after it returns: read
        # the owners' versions at the next op (or when the mode exits).
        log = self.log
        for key in self._written:
            owner = log.owners.get(key)
            if owner is not None:
                log.after[key] = owner._version
        self._written = None

    def __exit__(self, *exc) -> None:
        if self._written is not None:
            self._settle()
        return super().__exit__(*exc)


#: The storage an idle capture mode arms (see :func:`idle_capture_mode`): never written.
_UNRELATED = torch.zeros(1)


def idle_capture_mode() -> CaptureMode:
    """A capture mode that looks at every write as an armed one does and logs nothing: its
    own log has one storage armed that nothing writes. What timing the mode's cost runs."""
    log = RegionLog()
    log.arm(storage_key(_UNRELATED), _UNRELATED)
    return CaptureMode(log)


def undo(entries: list[RegionEntry]) -> None:
    """Undo logged writes (newest first); calling :func:`redo` on the same list reverts it."""
    for e in reversed(entries):
        e.swap()


def redo(entries: list[RegionEntry]) -> None:
    for e in entries:
        e.swap()


_storage_of = torch.Tensor.untyped_storage

_POOL_LIMIT = 1 << 16  # bytes: snapshots up to this size reuse their buffers (SnapshotPool)


class SnapshotPool:
    """What one segment's whole snapshots can reuse from call to call, while they are small.

    The flat byte views of the live storages (valid while each tensor has the same storage of
    the same size), and up to two spare buffers of the same layout: the snapshot and the swap's
    temporary of the last replay, recycled when it ended, while another of the segment's
    snapshots still waits for its replay (``out``: the pooled snapshots taken and not yet
    released). A steady segment's snapshot is one batched copy at forward and three at replay.
    When the last one is released the spares go: a pool holds no buffer between steps (issue
    31: the process holds what torch checkpoint holds plus the preserved state; two idle
    spares per segment were 1.16 MiB beyond it on torchvision's ResNet-152, 50 segments).
    """

    __slots__ = ("key", "views", "sizes", "spare", "fits", "extents", "out")

    def __init__(self) -> None:
        #: per tensor, its storage's identity (the ``StorageImpl``: ``_cdata``) and size when
        #: the views were made; the views keep those storages alive, so no other storage can
        #: have the same identity while they exist
        self.key: tuple | None = None
        self.views: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.spare: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.fits = False  # at most _POOL_LIMIT bytes, one device: reused
        self.extents: list = []
        self.out = 0  # pooled snapshots taken and not yet released (WholeSnapshot.release)

    def current(self, tensors: list[torch.Tensor], extents: list | None = None) -> bool:
        """Whether ``tensors`` are on the storages, of the sizes, that the views were made of
        (then each view is its tensor's whole storage, or the same extent of it: same storage
        object, same bytes)."""
        return (
            tuple([(st._cdata, st.nbytes()) for st in map(_storage_of, tensors)]) == self.key
            and list(extents or [None] * len(tensors)) == self.extents
        )

    def buffer(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.spare:
            return self.spare.pop()
        flat = torch.empty(sum(self.sizes), dtype=torch.uint8, device=self.views[0].device)
        return flat, list(flat.split(self.sizes))


class WholeSnapshot:
    """Whole copies of the storages of some tensors, taken at once, swapped in and out as one.

    The copies are the bytes of each tensor's entire storage (``storage_bytes``), whatever its
    dtype, strides or offset, concatenated into one flat ``uint8`` buffer per device; each
    tensor's copy is a view of it. :meth:`swap_in` exchanges the live bytes with the copies (the
    copies then hold the live bytes), :meth:`swap_out` copies the live bytes back. A tensor
    whose storage changed size or whose view changed since the snapshot (``resize_``,
    ``set_``) is pointed at a private copy of its old bytes for the replay instead, and
    re-pointed at its live storage afterwards.

    The swap goes through a temporary of at most ``_SWAP_CHUNK`` bytes, like :func:`swap_`:
    small copies are swapped in batches (one ``cat`` of the live bytes and two batched copies
    per batch), a copy larger than that alone, in chunks. With a :class:`SnapshotPool` (one per
    segment), a snapshot of at most ``_POOL_LIMIT`` bytes on one device reuses the pool's views
    and buffers instead.
    """

    __slots__ = (
        "tensors",
        "metas",
        "extents",
        "stores",
        "views",
        "snaps",
        "buffers",
        "nbytes",
        "_batches",
        "_moved",
        "_pool",
        "_spent",
        "_open",
    )

    def __init__(
        self,
        tensors: list[torch.Tensor],
        pool: SnapshotPool | None = None,
        extents: list[Extent | None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.metas = [(t.storage_offset(), t.shape, t.stride()) for t in tensors]
        # the bytes of each storage to keep: an extent (a view of a bigger storage, issue 31)
        # or the whole storage; and each storage's size, which tells a resize at replay
        self.extents = extents = extents or [None] * len(tensors)
        self.stores = [_storage_of(t).nbytes() for t in tensors]
        self._batches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._moved: list[tuple[torch.Tensor, tuple]] = []
        self._pool = None
        self._spent: tuple | None = None
        self._open = False  # counted in its pool's ``out`` until released
        if pool is not None:
            if not pool.current(tensors, extents):
                pool.key = tuple([(st._cdata, st.nbytes()) for st in map(_storage_of, tensors)])
                pool.extents = list(extents)
                pool.spare = []
                pool.views = [extent_bytes(t, e) for t, e in zip(tensors, extents)]
                pool.sizes = [v.numel() for v in pool.views]
                pool.fits = (
                    sum(pool.sizes) <= _POOL_LIMIT and len({v.device for v in pool.views}) == 1
                )
            if pool.fits:
                self._pool = pool
                self._open = True
                pool.out += 1
                self.views = pool.views
                buf = pool.buffer()
                self.buffers = [buf]
                self.snaps = buf[1]
                self.nbytes = buf[0].numel()
                with torch.no_grad():
                    torch._foreach_copy_(self.snaps, self.views)
                return
            pool.key, pool.views, pool.spare = None, [], []  # too large: keep nothing
        # flat byte views of the live storages, reused at replay while the storage is the same
        views = self.views = [extent_bytes(t, e) for t, e in zip(tensors, extents)]
        sizes = [v.numel() for v in views]
        snaps: list[torch.Tensor] = [None] * len(views)  # type: ignore[list-item]
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(views):
            by_device.setdefault(v.device, []).append(i)
        self.buffers = []
        with torch.no_grad():
            for idx in by_device.values():
                flat = torch.cat([views[i] for i in idx])
                self.buffers.append((flat, None))
                for i, snap in zip(idx, flat.split([sizes[i] for i in idx])):
                    snaps[i] = snap
        self.snaps = snaps
        self.nbytes = sum(sizes)

    def swap_in(self, keep: bool = False) -> None:
        """Put the snapshot's bytes into the live storages; the snapshot keeps the live ones,
        or, with ``keep`` (another replay may follow: a backward that keeps its graph), the
        forward's bytes stay in it and the live ones wait in a temporary."""
        if keep:
            self._swap_kept()
            return
        pool = self._pool
        if (
            pool is not None
            and pool.views is self.views
            and pool.current(self.tensors, self.extents)
            and [(t.storage_offset(), t.shape, t.stride()) for t in self.tensors] == self.metas
        ):
            # every tensor on the storage (same storage object, same size) and view it had at
            # forward: the pool's views are the live storages
            with torch.no_grad():
                self._swap_pooled(pool)
            return
        pairs = []
        moved = self._moved
        same = True  # every tensor on the storage it had at forward, unchanged
        with torch.no_grad():
            for t, view, snap, meta, ext, size in zip(
                self.tensors, self.views, self.snaps, self.metas, self.extents, self.stores
            ):
                st = t.untyped_storage()
                if st.nbytes() == size and (t.storage_offset(), t.shape, t.stride()) == meta:
                    if view.untyped_storage()._cdata != st._cdata:
                        view = extent_bytes(t, ext)  # a storage swapped in (same size)
                        same = False
                    pairs.append((view, snap))
                else:  # resized (resize_, set_) since forward: point it at the old bytes
                    moved.append((t, (st, t.storage_offset(), t.shape, t.stride())))
                    t.set_(_old_storage(snap, ext, size), *meta)
                    same = False
            if same and pool is not None and pool.views is self.views:
                self._swap_pooled(pool)
                return
            batch: tuple[list, list] = ([], [])
            room = _SWAP_CHUNK
            for live, snap in pairs:
                n = snap.numel()
                if n > room and batch[0]:
                    self._swap_batch(*batch)
                    batch, room = ([], []), _SWAP_CHUNK
                if n > _SWAP_CHUNK:
                    swap_(live, snap)
                    self._batches.append(([live], [snap]))
                    continue
                batch[0].append(live)
                batch[1].append(snap)
                room -= n
            if batch[0]:
                self._swap_batch(*batch)

    def _swap_kept(self) -> None:
        # the live bytes into temporaries, the snapshot copied in: swap_out copies them back
        # and the snapshot still holds the forward's bytes for the next replay
        moved = self._moved
        with torch.no_grad():
            for t, view, snap, meta, ext, size in zip(
                self.tensors, self.views, self.snaps, self.metas, self.extents, self.stores
            ):
                st = t.untyped_storage()
                if st.nbytes() == size and (t.storage_offset(), t.shape, t.stride()) == meta:
                    if view.untyped_storage()._cdata != st._cdata:
                        view = extent_bytes(t, ext)
                    tmp = view.clone()
                    view.copy_(snap)
                    self._batches.append(([view], [tmp]))
                else:
                    moved.append((t, (st, t.storage_offset(), t.shape, t.stride())))
                    t.set_(_old_storage(snap, ext, size), *meta)
        self._spent = "kept"

    def _swap_pooled(self, pool: SnapshotPool) -> None:
        # the live bytes into a spare buffer, the snapshot into the live storages
        spare = pool.buffer()
        torch._foreach_copy_(spare[1], self.views)
        torch._foreach_copy_(self.views, self.snaps)
        self._spent = self.buffers[0]
        self.buffers = [spare]
        self.snaps = spare[1]
        self._batches.append((self.views, self.snaps))

    def _swap_batch(self, live: list[torch.Tensor], snaps: list[torch.Tensor]) -> None:
        tmp = torch.cat(live)
        torch._foreach_copy_(live, snaps)
        torch._foreach_copy_(snaps, tmp.split([s.numel() for s in snaps]))
        self._batches.append((live, snaps))

    def swap_out(self) -> None:
        """Put the live bytes back (after :meth:`swap_in`); the snapshot is spent."""
        with torch.no_grad():
            # newest batch first: were two copies of one storage swapped in different batches,
            # the first one holds the live bytes
            for live, snaps in reversed(self._batches):
                torch._foreach_copy_(live, snaps)
            for t, live_meta in reversed(self._moved):
                t.set_(*live_meta)
        self._batches = []
        self._moved = []
        pool = self._pool
        if self._spent == "kept":  # the snapshot is intact (see _swap_kept)
            self._spent = None
            return
        if self._spent is not None and pool is not None and pool.views is self.views:
            pool.spare = [self._spent, self.buffers[0]]  # both spent: the next call's buffers
        self._spent = None

    def release(self) -> None:
        """The snapshot will not be replayed again (its invocation is released): the last of
        its pool's snapshots to go takes the pool's spare buffers with it."""
        if self._open:
            self._open = False
            pool = self._pool
            pool.out -= 1
            if pool.out <= 0:
                pool.out = 0
                pool.spare = []


class SharedWhole:
    """One whole copy of a storage, for every call of a window that reads it at one version.

    Two segments that read a queue the step writes after both (and neither writes it) would
    each keep a whole copy of it; they read the same bytes, so one copy serves both. It is
    taken by the first call and shared while the storage holds the bytes it had then
    (:meth:`serves`).
    :meth:`swap_in` exchanges the live bytes with the copy and :meth:`swap_back` exchanges them
    again, so the copy still holds the forward's bytes for the next replay (a replay that wrote
    the storage all the same leaves it :attr:`spoiled`). A tensor whose storage changed size or
    view since is pointed at the copy itself for its replay.
    """

    __slots__ = (
        "key",
        "meta",
        "view",
        "snap",
        "nbytes",
        "version",
        "users",
        "spoiled",
        "_live",
        "extent",
        "size",
    )

    def __init__(self, t: torch.Tensor, extent: Extent | None = None) -> None:
        self.key = storage_key(t)
        self.meta = (t.storage_offset(), t.shape, t.stride())
        self.extent = extent  # (the bytes of the storage it keeps: all, or a view's, issue 31)
        self.size = t.untyped_storage().nbytes()
        self.view = extent_bytes(t, extent)
        with torch.no_grad():
            self.snap: torch.Tensor | None = self.view.clone()
        self.nbytes = self.snap.numel()
        self.version = t._version
        self.users = 0  # calls that will replay from it
        self.spoiled = False
        self._live: tuple | None = None

    def serves(self, t: torch.Tensor) -> bool:
        """Whether ``t`` reads, now, the bytes this copy was taken of: the same storage at the
        same version, and the same bytes, compared (a write through ``.data`` between two
        calls bumps no version). The comparison reads what a copy would, without allocating;
        on an accelerator it would wait for the device, so there every call takes its own.

        The same storage by identity, not by address alone: a storage that ``resize_`` grew
        since (a memory bank) leaves its old address to the next storage made there (another
        segment's buffer rebound to a tensor of the old size), and :attr:`view` still reads
        the first one's bytes, so the comparison of bytes would not tell them apart either.
        The view keeps its storage alive, so no other storage can have its ``_cdata``."""
        return (
            self.snap is not None
            and not self.spoiled
            and _state.host_reads_free(self.snap)
            and t._version == self.version
            and storage_key(t) == self.key
            and t.untyped_storage()._cdata == self.view.untyped_storage()._cdata
            and t.untyped_storage().nbytes() == self.size
            and torch.equal(self.view, self.snap)
        )

    def swap_in(self, t: torch.Tensor, writes: bool = False) -> None:
        """The copy's bytes into ``t``'s storage for a replay. ``writes``: the call's forward
        wrote the storage, so its replay will: the copy is then copied in, not exchanged,
        and the live bytes wait in a temporary (a whole copy, for this replay only)."""
        snap = self.snap
        st = t.untyped_storage()
        with torch.no_grad():
            if st.nbytes() == self.size and (t.storage_offset(), t.shape, t.stride()) == self.meta:
                view = self.view if self.view.untyped_storage()._cdata == st._cdata else None
                view = extent_bytes(t, self.extent) if view is None else view
                if writes:
                    self._live = ("copied", view, view.clone(), t._version)
                    view.copy_(snap)
                    return
                swap_(view, snap)
                self._live = ("swapped", view, t, t._version)
            else:  # resized or re-viewed since: read the copy (its own, if it writes)
                live = (st, t.storage_offset(), t.shape, t.stride())
                if self.extent is not None:
                    src = _old_storage(snap, self.extent, self.size)
                else:
                    src = (snap.clone() if writes else snap).untyped_storage()
                t.set_(src, *self.meta)
                self._live = ("moved", t, live, t._version if not writes else None)

    def swap_back(self) -> None:
        live, self._live = self._live, None
        if live is None:
            return
        kind, a, b, version = live
        with torch.no_grad():
            if kind == "copied":
                a.copy_(b)
            elif kind == "swapped":
                if b._version != version:  # the replay wrote it: the copy gets those bytes
                    self.spoiled = True
                swap_(a, self.snap)
            else:
                if version is not None and a._version != version:
                    self.spoiled = True
                a.set_(*b)

    def release(self) -> bool:
        """One call replayed (or was dropped); True when it was the last, and the copy is freed."""
        self.users -= 1
        if self.users > 0:
            return False
        self.snap = None
        self.view = None
        return True


def _old_storage(snap: torch.Tensor, extent: Extent | None, size: int) -> Any:
    """A storage of ``size`` bytes holding the copy ``snap`` of the extent's bytes (the
    whole storage where ``extent`` is None): what a tensor resized since its forward is
    pointed at for its replay. Bytes outside the extent are none the segment reads."""
    if extent is None or snap.numel() == size:
        return snap.clone().untyped_storage()
    old = torch.zeros(size, dtype=torch.uint8, device=snap.device)
    old[extent[0] : extent[1]].copy_(snap)
    return old.untyped_storage()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its byte span exactly, once each (contiguous in some
    order of its dimensions: a slice of rows, a transpose), so a byte range of the span is
    a range of its elements."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True
