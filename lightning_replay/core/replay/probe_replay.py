"""The replayed probe's replay: a probe that kept no activations, replayed exactly.

Under a byte budget a probed forward runs under checkpoint (see
:meth:`~lightning_replay.probe.SegmentProbe._replayed_probe_call`). Its replay, at the moment the
window ends, must see what the forward saw although no contract exists yet: everything the
probe watched is put back here, and the replay is compared with the forward (outputs and the
tensors saved for backward). This is the probe's counterpart of
:mod:`~lightning_replay.restore`, where contracted replays swap their state back.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_replay._compat import graph_task_keeps_graph, set_versions
from lightning_replay.errors import ReplayError, SavedTensorModified
from lightning_replay.core.mechanisms.kernel_noise import ProducerLog
from lightning_replay.core.base.ports import ReplaySegment
from lightning_replay.core.mechanisms.preservation import redo, undo
from lightning_replay.core.mechanisms.slot_restore import (
    restore_generators,
    restore_slots,
    swap_generators,
    swap_slots,
)
from lightning_replay.core.mechanisms.slots import MISSING
from lightning_replay.core.base.state import (
    digest,
    digest_token,
    digests,
    resolve_tokens,
    storage_bytes,
    storage_identity,
    storage_key,
    swap_,
    tensor_leaves,
)

#: a probe (:class:`~lightning_replay.probe._Probe`: its forward's observations, slots and
#: saved tensors); the probe module imports this one, so it is not named here
_Probe = Any


def _layout(t: torch.Tensor) -> tuple:
    """Which elements of its storage ``t`` reads: offset, shape and strides."""
    return t.storage_offset(), tuple(t.shape), t.stride()


class _ProbeReplay:
    """Around a replayed probe's replay: the window's changes swapped out, the forward's state
    swapped in, the replay's outputs compared with the forward's, and the live state put back.

    What is put back is everything the probe saw: every storage it touched that the window
    changed (its first-touch bytes; parameters and arguments that are no model state are not
    copied, their logged writes are undone instead), tensors pointed at other storage since
    (``.data =``) pointed back, the slot objects and plain values, every generator's state as
    the forward first drew from it and the outside attributes it read. Writes the replay makes
    are undone with the swap. What no probe can see (a module-level value) is caught by the
    comparison of outputs and saved tensors.
    """

    def __init__(self, rt: "ReplaySegment", box: dict[str, Any]) -> None:
        self.rt = rt
        self.box = box
        self.saved_tokens: list = []
        self.saved: list[torch.Tensor] = []  # what the replay saved (tokens' order), until compared
        self.saved_bytes: dict = {}  # storage key -> bytes of what the replay saved
        self.params: set = set()
        self.versions: list = []  # (touched object, its version at the replay's start)
        self.keep = False
        #: the replay's ops: which of its saved values no kernel reproduces (or no tensor went into)
        self.producers = ProducerLog()

    def __enter__(self) -> None:
        probe: _Probe = self.box["probe"]
        rt = self.rt
        if probe.observations is None:
            rt._observe(probe)  # the window ends here if no saved tensor was unpacked first
        # the parameters now, and those the forward ran with (``functional_call`` swaps other
        # tensors in for one call: the slots put back are those): neither is compared. Their
        # storages where they are now: one FSDP2 freed and gathered again has moved, and its
        # old address may hold one of this replay's own activations
        live = [*rt.engine.model.parameters(), *probe.param_aliases]
        self.params = {k for k in map(storage_key, live) if k is not None}
        self.saved_tokens = []
        self.saved = []
        self.producers.clear()
        self.saved_bytes = {}
        for alias, v0 in probe.saved_state.values():
            if alias._version > v0:
                # autograd saved it and it was written in place since: plain PyTorch refuses
                # the backward, and so does the retained probe
                raise SavedTensorModified(
                    alias, v0, f"segment {rt.name!r}", rt.engine.state_name(alias)
                )
        self.swapped = []
        self.undone = []
        self.repointed = []
        # a backward that keeps its graph (create_graph: a gradient penalty) may be followed by
        # another that replays again: the first-touch copies then stay intact for it
        self.keep = graph_task_keeps_graph()
        # every touched object's version counter as the window left it (the objects the
        # forward was given: a touch's own alias, made under the dispatch mode, counts apart).
        # The replay's writes are undone with the swap, and its version bumps too: a later
        # reader armed on the same state (a segment sharing it) checks the window's count
        self.versions = []
        with torch.no_grad():
            for ob in probe.observations:
                t = ob.touch
                src = t.source() if t.source is not None else None
                if src is not None:
                    self.versions.append((src, src._version))
                if ob.entries:  # a parameter written in the window: its logged writes undone
                    # (state the segment writes: the replay writes those regions again, and the
                    # redo would leave the replay's bytes in the entries, where a later reader
                    # of the same log (a segment sharing the storage, still armed) or the
                    # replay after a backward that keeps its graph undoes them. The old bytes
                    # are kept apart until the redo)
                    olds = None
                    writes = t.annotated_write or t.changed_in_segment
                    if self.keep or (writes and t.key in rt.engine.log.armed):
                        olds = [
                            e.saved.clone() if e.saved is not None else None for e in ob.entries
                        ]
                    undo(ob.entries)
                    self.undone.append((ob.entries, olds))
                    continue
                src = t.source() if t.source is not None else None
                if src is not None and (
                    storage_identity(src) != storage_identity(t.tensor)
                    or _layout(src) != _layout(t.tensor)
                ):
                    # the object the forward read now has another storage, or another view of
                    # it (a queue cut or regrown by ``resize_`` within its storage): point it back
                    self.repointed.append(
                        (
                            src,
                            (src.untyped_storage(), src.storage_offset(), src.shape, src.stride()),
                            src._version,
                        )
                    )
                    src.set_(
                        t.tensor.untyped_storage(),
                        t.tensor.storage_offset(),
                        t.tensor.shape,
                        t.tensor.stride(),
                    )
                if not ob.changed or t.snapshot is None or not t.snapshot.numel():
                    continue
                live = storage_bytes(t.tensor)
                if live.numel() != t.snapshot.numel():
                    # resized since (a queue grown by ``resize_`` reallocates its storage in
                    # place: the tensor the forward read and its alias now both reach the new
                    # bytes): pointed at the first-touch copy, as the forward laid it out
                    src = t.source() if t.source is not None else None
                    if src is not None:
                        snap = t.snapshot.clone() if self.keep else t.snapshot
                        self.repointed.append(
                            (
                                src,
                                (
                                    src.untyped_storage(),
                                    src.storage_offset(),
                                    src.shape,
                                    src.stride(),
                                ),
                                src._version,
                            )
                        )
                        src.set_(
                            snap.untyped_storage(),
                            t.tensor.storage_offset(),
                            t.tensor.shape,
                            t.tensor.stride(),
                        )
                    continue
                if self.keep:
                    self.swapped.append((t.tensor, live.clone(), t.tensor._version))
                    live.copy_(t.snapshot)
                    continue
                self.swapped.append((t.tensor, t.snapshot, t.tensor._version))
                swap_(live, t.snapshot)
        self.slots = swap_slots(probe.slots)
        # every outside attribute it read, as first read; all put back after (the replay's own
        # writes to them must not leak, even where they equal the value at forward)
        self.outside = [(d, name, d.get(name, MISSING)) for d, name, _ in probe.outside or ()]
        _set_all(probe.outside or ())
        gens = list(probe.gens)
        known = {id(g) for g, _ in gens}
        gens += [
            (g, probe.mode.generator_states[i])
            for i, g in probe.mode.generators.items()
            if i not in known and i in probe.mode.generator_states
        ]
        self.gens = swap_generators(gens)
        self.box["replay"] = self
        rt.replays += 1
        rt.engine._replays_this_step += 1

    def compare(self, out: Any) -> None:
        """The replay's outputs against the forward's digests, and the tensors it saved for
        backward against the forward's (elements, never storage beyond a view).

        A saved tensor that differs while every output matches bit for bit is either a value
        only the gradient reads (a gradient scale drawn outside the probe's sight: a
        divergence) or a value the kernel does not reproduce by itself (an attention kernel's
        RNG seed when it drew nothing, an unwritten workspace): :class:`ProducerLog` tells them
        apart, and the latter are recorded with the match, not as a divergence.
        """
        try:
            self._compare(out)
        finally:
            self.saved = []
            self.producers.clear()

    def _compare(self, out: Any) -> None:
        rt = self.rt
        eng = rt.engine
        self._measure_activations()
        mine = digests(tensor_leaves(out))
        expected = self.box["digests"]
        differ = [i for i, (a, b) in enumerate(zip(mine, expected)) if a != b]
        if len(mine) != len(expected):
            differ.append(min(len(mine), len(expected)))
        probe = self.box["probe"]
        # the tensors saved for backward too: a value only the gradient reads (a gradient
        # scale) leaves the outputs alike
        if probe.late_tokens:  # taken at the forward's end, not at pack (see _Probe.saved_live)
            self.saved_tokens = [digest_token(t) for t in self.saved]
        ours, theirs = resolve_tokens(self.saved_tokens), resolve_tokens(probe.saved_tokens)
        saved_differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        count_differs = len(ours) != len(theirs)
        if count_differs:
            saved_differ.append(min(len(ours), len(theirs)))
        detail: dict[str, Any] = {
            "what": "replayed probe: outputs and saved tensors of the replay against the forward's",
            "outputs": len(expected),
            "saved_tensors": len(theirs),
        }
        unreproduced: list[str] = []
        rerun = False  # some were told by running their op again (not by an RNG output's name)
        if saved_differ and not differ and not count_differs:
            # the outputs are the forward's, bit for bit: is each differing saved value one its
            # kernel does not reproduce by itself?
            evidence = []
            for i in saved_differ:
                why = self.producers.unreproduced(self.saved[i]) if i < len(self.saved) else None
                if why is None:
                    evidence.append(i)
                else:
                    unreproduced.append(f"saved tensor {i} ({_meta(self.saved[i])}): {why}")
                    rerun = rerun or not why.startswith("an RNG output")
            saved_differ = evidence
        if unreproduced:
            detail["unreproduced_saved_tensors"] = unreproduced[:16]
            detail["note"] = (
                "auxiliary values saved for backward that the kernel does not reproduce by "
                "itself (not evidence of state); the outputs and every other saved tensor match"
            )
            if rerun:
                # whether the backward reads such a value (a workspace it never reads, or a
                # draw from a generator no probe sees) is for a derivative check to say: it
                # differentiates the forward's saved tensors and the replay's, and knows the
                # kernels' noise. The segment's next step is checked.
                _check_next_step(eng, rt.name)
                detail["follow_up"] = "derivative check on the next step"
        if saved_differ:
            detail["differing_saved_tensors"] = saved_differ[:16]
            differ = differ or [f"saved tensor {saved_differ[0]}"]
        if not differ:
            eng.records.append(
                step=probe.step,
                segment=rt.name,
                contract_version=rt.version,
                check="probe",
                outcome="match",
                detail=detail,
            )
            return
        detail["differing_outputs"] = differ[:16]
        detail["action"] = "next probe retained"
        # state the probe kept only a digest of (a big storage, under a byte budget) that
        # changed with no logged write: written after the window's forward, where no capture
        # runs (discovery.COPY_BELOW)
        unlogged = [
            eng.state_name(ob.touch.tensor) or f"a tensor {_meta(ob.touch.tensor)}"
            for ob in probe.observations or []
            if getattr(ob, "unrestorable", False)
        ]
        if unlogged:
            detail["unlogged_writes"] = unlogged[:16]
        eng.records.append(
            step=probe.step,
            segment=rt.name,
            contract_version=rt.version,
            check="probe",
            outcome="divergence",
            detail=detail,
        )
        rt.divergences += 1
        rt.retained_probe = True
        if rt.status in ("active", "retain"):
            rt.status = "probe"
        eng._contracts_changed()
        if differ and not str(differ[0]).startswith("saved tensor"):
            what = (
                f"did not reproduce the forward's outputs {differ[:16]} (or the tensors it "
                f"saved for backward {saved_differ[:16]})"
            )
        else:
            shown = [
                f"{i} ({_meta(self.saved[i])})" if i < len(self.saved) else str(i)
                for i in saved_differ[:4]
            ]
            what = (
                "reproduced its outputs bit for bit but not the tensors it saved for backward "
                f"{shown}, and no kernel's own run-to-run variation explains them: a value "
                "only the gradient reads differs"
            )
        message = (
            f"segment {rt.name!r}: the replay of its probe (step {probe.step}) {what}: that "
            "step's gradients through it differ from plain PyTorch's. Something the probe "
            "could not restore changed between its forward and backward (a parameter written "
            "in the window, a storage resized or swapped, a value drawn outside the model); "
            "recorded as a divergence. Its next probe runs retained."
        )
        if unlogged:
            message += (
                f" {', '.join(unlogged[:4])} changed with no logged write (after the "
                "window's forward ended, where no capture runs, or by an op whose schema "
                "declares no write), and under a byte budget the probe keeps a digest, not a "
                "copy, of such big state: write it inside the window (in training_step, or "
                "inside `with engine.window():` around the step's forward and that write), "
                "declare the op's write (Tensor(a!)), or train without a byte budget for the "
                "probe step."
            )
        if eng.on_violation == "raise":
            raise ReplayError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _measure_activations(self) -> None:
        """The segment's activation bytes, from what its replay saved. The forward under
        checkpoint freed each saved tensor at once, so its storages' addresses were reused and
        could not be told apart; the replay's are all alive until backward reads them."""
        probe = self.box["probe"]
        mode = probe.mode
        inputs = {k for k in probe.leaf_keys if k is not None}
        act = sum(
            n
            for k, n in self.saved_bytes.items()
            if k not in mode.touched and k not in inputs and k not in mode.parameter_traffic
        )
        before, probe.activation_bytes = probe.activation_bytes, act
        c = self.rt.contract
        meter = self.rt.engine.meter
        if c is not None and c.probed_at_step == probe.step and act > c.activation_bytes:
            c.activation_bytes = act
        # this call's share of its window's bytes (the contract summed the forward's figures,
        # which a checkpointed forward undercounts): a segment called k times keeps k calls'
        step, total, n = meter.window_activation.get(self.rt.name, (-1, 0, 0))
        if step == probe.step and act > before:
            meter.window_activation[self.rt.name] = (step, total + act - before, n)
        meter.activation_bytes.pop(self.rt.name, None)

    def __exit__(self, *exc) -> bool:
        self.box.pop("replay", None)
        restore_generators(self.gens)
        _set_all(reversed(self.outside))
        restore_slots(self.slots)
        with torch.no_grad():
            for t, snap, _ in self.swapped:
                storage_bytes(t).copy_(snap)  # the live bytes the swap left in the copy
            for entries, olds in reversed(self.undone):
                redo(entries)
                for e, saved in zip(entries, olds or ()):
                    e.saved = saved
            for src, live, _ in reversed(self.repointed):
                src.set_(*live)
        set_versions([src for src, _, _ in self.repointed], [v for _, _, v in self.repointed])
        set_versions([t for t, _, _ in self.swapped], [v for _, _, v in self.swapped])
        moved = [(t, v) for t, v in self.versions if t._version != v]
        set_versions([t for t, _ in moved], [v for _, v in moved])
        if exc[0] is None:
            self._check_unlogged_writes()
        # kept whole for the replay a backward that keeps its graph is followed by (see keep)
        probe = self.box.get("probe") if not self.keep else None
        self.swapped = []
        self.undone = []
        self.repointed = []
        self.versions = []
        self.slots = []
        self.gens = []
        self.outside = []
        self.saved_tokens = []
        self.saved_bytes = {}
        if probe is not None:
            # its replay was the last use of what it saw: dropped now if its contract is made
            # (else when it is, see SegmentProbe._make_contract)
            probe.replay_done = True
            if probe.observations is not None and not any(p is probe for p in self.rt.probes):
                probe.release()
            else:  # its first-touch copies go now all the same
                for ob in probe.observations or []:
                    if ob.touch.snapshot is not None and ob.touch.snapshot.numel():
                        ob.touch.snapshot = ob.touch.snapshot.new_empty(0)
        return False

    def _check_unlogged_writes(self) -> None:
        """State the probe kept only a digest of (discovery.COPY_BELOW) must hold the window's
        bytes again once the replay is swapped out. A write the replay made that no log saw
        (an op writing without a schema annotation that the probe does not know) cannot be
        undone without a copy: it is recorded as a divergence, never left silent."""
        probe = self.box["probe"]
        rt = self.rt
        eng = rt.engine
        with torch.no_grad():
            leaked = [
                ob
                for ob in probe.observations or []
                if ob.after is not None and digest(storage_bytes(ob.touch.tensor)) != ob.after
            ]
        if not leaked:
            return
        names = [
            eng.state_name(ob.touch.tensor) or f"a tensor {_meta(ob.touch.tensor)}" for ob in leaked
        ]
        eng.records.append(
            step=probe.step,
            segment=rt.name,
            contract_version=rt.version,
            check="probe",
            outcome="divergence",
            detail={
                "what": "replayed probe: its replay wrote state no log saw",
                "state": names[:16],
                "action": "next probe retained",
            },
        )
        rt.divergences += 1
        rt.retained_probe = True
        eng._contracts_changed()
        message = (
            f"segment {rt.name!r}: the replay of its probe (step {probe.step}) wrote "
            f"{', '.join(names[:4])} with an op that no capture logs (a write its schema does "
            "not declare), and under a byte budget the probe keeps a digest, not a copy, of "
            "such big state: the replay's write stays, so that state has been written twice "
            "this step. Recorded as a divergence; its next probe runs retained. Declare the "
            "write in the op's schema (Tensor(a!)), or keep the op outside segments."
        )
        if eng.on_violation == "raise":
            raise ReplayError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_next_step(eng: Any, segment: str) -> None:
    """Ask for a derivative check of ``segment`` in the engine's next window (besides
    whatever was asked already)."""
    grad, byte, segments = eng._check_next or (True, False, [])
    if grad and segments is None:
        return  # every segment is checked already
    eng._check_next = (True, byte, sorted({*(segments or []), segment}))


def _meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _set_all(items: Any) -> None:
    """Set each ``(dict, name, value)``; ``MISSING`` removes the name."""
    for d, name, v in items:
        if v is MISSING:
            d.pop(name, None)
        else:
            d[name] = v
