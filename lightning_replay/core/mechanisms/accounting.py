"""Exact byte accounting of what a step holds for backward, on any device.

CPU has no allocator counter, so the engine counts the bytes the cost model talks about, each
storage once: tensors autograd saves outside replayed segments (a saved-tensors hook whose
packed handle gives its bytes back when autograd frees it), checkpoint inputs and preserved
snapshots and region logs held by the engine, and, while a segment replays, the activations it
re-materializes (its probe-measured ``A(s)``, until the next replay or the end of backward).
Each replayed call also holds what ``torch.utils.checkpoint`` keeps for it with
``preserve_rng_state=True`` (the engine always preserves the global RNG): the CPU generator's
state, 5,056 bytes, and the state of each accelerator device its tensors are on, all host
tensors (:func:`checkpoint_rng_bytes`). On a CPU model that is real memory a recomputed segment
holds that a retained one does not, so the costs charge it and the accountant holds it per call.
Parameters and buffers are static and belong to the base. So do storages the caller counts
elsewhere (:attr:`MemoryAccountant.counted_elsewhere`): under FSDP2 a segment saves the
*gathered* parameters it multiplies by, whose memory FSDP allocates and frees on its own schedule
whatever the plan does; the strategy counts them in the base, and the probe's activation bytes
leave them out too, so the plan's costs and the accountant's figures agree.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Iterable

import torch

from lightning_replay._compat import top_saved_tensors_hooks
from lightning_replay.errors import SavedTensorModified
from lightning_replay.core.base.state import storage_key


_HOST_RNG_BYTES: dict[str, int] = {}  # generator state bytes per device type (fixed sizes)


def checkpoint_rng_bytes(tensors: Iterable[torch.Tensor], memory: torch.device | str) -> int:
    """Bytes of ``memory`` (the device whose memory the budget is about) that one call of
    ``torch.utils.checkpoint(..., preserve_rng_state=True)`` on ``tensors`` holds until its
    backward: its saved generator states.

    Checkpoint keeps ``torch.get_rng_state()`` (the CPU generator's state, 5,056 bytes for
    torch's Mersenne Twister) and, for each accelerator device one of ``tensors`` is on when
    that device's runtime is initialized, that device's ``get_rng_state()``. All of them are
    CPU tensors: they count against a budget of host memory (a CPU model) and not against an
    accelerator's (where they cost nothing on the device).

    Example:
        >>> checkpoint_rng_bytes([torch.zeros(2)], "cpu") == torch.get_rng_state().nbytes
        True
        >>> checkpoint_rng_bytes([torch.zeros(2)], "cuda")  # host bytes, not the GPU's
        0
    """
    if torch.device(memory).type != "cpu":
        return 0
    total = _host_rng_bytes("cpu")
    for kind, index in {(t.device.type, t.device.index) for t in tensors} - {("cpu", None)}:
        module = getattr(torch, kind, None)
        if kind == "meta" or not getattr(module, "_initialized", False):
            continue  # checkpoint does not initialize a device's runtime to read its state
        total += _host_rng_bytes(kind, index)
    return total


def _host_rng_bytes(kind: str, index: int | None = None) -> int:
    nbytes = _HOST_RNG_BYTES.get(kind)
    if nbytes is None:
        state = (
            torch.get_rng_state() if kind == "cpu" else getattr(torch, kind).get_rng_state(index)
        )
        nbytes = _HOST_RNG_BYTES[kind] = state.nbytes
    return nbytes


class MemoryAccountant:
    """Live and peak bytes, counted per storage (a storage held twice counts once)."""

    def __init__(self) -> None:
        #: the storages of the model's parameters and buffers as the window began, by storage
        #: object (see :meth:`set_static`)
        self.static: weakref.WeakSet = weakref.WeakSet()
        self._live: dict[Hashable, list] = {}
        self.by_tag: dict[str, int] = {}
        self.tag = "base"  # who is running: "base" or a segment name
        self.current = 0
        self.peak = 0
        self.replay_bytes = 0
        #: the step's phase: "start" (forward, loss, backward until the first replay), then
        #: one per segment's replay (see :meth:`begin_phase`)
        self.phase = "start"
        #: per phase, the peak of what the plan's formula charges per moment: everything but
        #: the bytes saved outside segments (the formula holds those all step, in its base)
        self.phase_peaks: dict[str, int] = {"start": 0}
        self.extra: Any = None  # callable returning bytes held elsewhere (the region log)
        self.namer: Any = None  # tensor -> the model's name for it (for error messages)
        #: ``None`` or a callable ``tensor -> bool``: saved tensors whose storage is counted
        #: in the base by someone else (FSDP's gathered parameters), held here as nothing.
        self.counted_elsewhere: Callable[[torch.Tensor], bool] | None = None

    def reset_peak(self) -> None:
        self.peak = self.current + self.replay_bytes + (self.extra() if self.extra else 0)
        self.phase = "start"
        self.phase_peaks = {"start": self.peak - self.by_tag.get("base", 0)}

    def begin_phase(self, label: str) -> None:
        """A new phase of the step begins (a segment's replay): its peak is kept apart."""
        self.phase = label
        now = self.current + self.replay_bytes + (self.extra() if self.extra else 0)
        now -= self.by_tag.get("base", 0)
        self.phase_peaks[label] = max(self.phase_peaks.get(label, now), now)

    def hold(self, key: Hashable, nbytes: int, tag: str | None = None) -> None:
        entry = self._live.get(key)
        if entry is None:
            tag = tag or self.tag
            self._live[key] = [1, nbytes, tag]
            self.current += nbytes
            self.by_tag[tag] = self.by_tag.get(tag, 0) + nbytes
            self.touch()
        else:
            entry[0] += 1

    def drop(self, key: Hashable) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]
            self.by_tag[entry[2]] -= entry[1]

    def elsewhere(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is counted in the base by someone else (FSDP's gathered
        parameters). A measurement of a segment's activation bytes leaves these out too: they
        are identified by storage object, not by address, since FSDP frees and refills them
        between a forward and its replay (the refilled storage may lie at another address)."""
        return self.counted_elsewhere is not None and self.counted_elsewhere(t)

    def set_static(self, tensors: Iterable[torch.Tensor]) -> None:
        """The model's parameters and buffers, held all step in the base: saved, they count
        nothing. By storage object, not address: FSDP2 frees a gathered parameter after the
        forward and refills it elsewhere (it stays static), and an activation that lands at
        its old address is the step's, counted (weak: a buffer rebound in the window is not
        kept alive)."""
        self.static = weakref.WeakSet()
        for t in tensors:
            if storage_key(t) is not None:
                self.static.add(t.untyped_storage())

    def hold_tensor(self, t: torch.Tensor, tag: str | None = None) -> Hashable | None:
        key = storage_key(t)
        if key is None or t.untyped_storage() in self.static:
            return None
        if self.elsewhere(t):
            return None
        self.hold(key, t.untyped_storage().nbytes(), tag)
        return key

    def set_replay(self, nbytes: int) -> None:
        """A segment replays: its re-materialized activations replace the previous ones."""
        self.replay_bytes = nbytes
        self.touch()

    def touch(self) -> None:
        now = self.current + self.replay_bytes + (self.extra() if self.extra else 0)
        if now > self.peak:
            self.peak = now
        now -= self.by_tag.get("base", 0)
        if now > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = now

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that count every tensor autograd saves while they are active."""
        acct = self
        # the user's own hooks these are pushed over (a bf16 rounding, save_on_cpu): what
        # backward reads is still what they make of each tensor, as in plain training
        below = top_saved_tensors_hooks()

        def pack(t: torch.Tensor) -> Any:
            if below is None:
                return _Held(t, acct)
            # the user's pack runs now, in the forward's order, as in plain training (a pack
            # hook with state, a running scale, packs each tensor with the state it had then);
            # what it returns is what is held
            p = below[0](t)
            return (_Held(p, acct) if isinstance(p, torch.Tensor) else p,)

        def unpack(h: Any) -> torch.Tensor:
            if below is None:
                return h.unpack()
            p = h[0]
            return below[1](p.unpack() if isinstance(p, _Held) else p)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class Saved:
    """A saved tensor's handle that keeps autograd's version check.

    Autograd skips its own "modified by an inplace operation" check for tensors packed by
    saved-tensor hooks; without this one, hooks would turn that error into wrong gradients.
    """

    __slots__ = ("t", "version", "where", "namer")

    def __init__(self, t: torch.Tensor, where: str, namer: Any = None) -> None:
        # Detached (same storage, same version counter): a saved output held with its grad_fn
        # would make a reference cycle through the graph's node, which only running that node
        # breaks; a node a backward never reaches (``backward(inputs=head_params)``) would
        # then keep its graph alive for good. Autograd re-attaches the graph at unpack.
        self.t = t.detach()
        self.version = t._version
        self.where = where
        self.namer = namer  # tensor -> the model's name for it, or None

    def unpack(self) -> torch.Tensor:
        if self.t._version != self.version:
            state = self.namer(self.t) if self.namer is not None else None
            raise SavedTensorModified(self.t, self.version, self._where(), state)
        return self.t

    def _where(self) -> str:
        return self.where


class _Held(Saved):
    """A saved tensor's handle: holds its bytes in the accountant until autograd frees it."""

    __slots__ = ("acct", "key")

    def __init__(self, t: torch.Tensor, acct: MemoryAccountant) -> None:
        super().__init__(t, acct.tag, acct.namer)  # formatted only for an error
        self.acct = acct
        self.key = acct.hold_tensor(t)

    def _where(self) -> str:
        return "the model outside segments" if self.where == "base" else f"segment {self.where!r}"

    def __del__(self) -> None:
        if self.key is not None:
            self.acct.drop(self.key)
