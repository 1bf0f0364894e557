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
from typing import TYPE_CHECKING, Any

import torch

from lightning_replay._compat import graph_task_keeps_graph, set_versions
from lightning_replay.errors import ReplayError, SavedTensorModified
from lightning_replay.preservation import redo, undo
from lightning_replay.slots import (
    MISSING,
    restore_generators,
    restore_slots,
    swap_generators,
    swap_slots,
)
from lightning_replay.state import (
    digests,
    resolve_tokens,
    storage_bytes,
    storage_identity,
    storage_key,
    swap_,
    tensor_leaves,
)

if TYPE_CHECKING:  # annotations only: these modules import this one
    from lightning_replay.probe import _Probe
    from lightning_replay.runtime import SegmentRuntime


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

    def __init__(self, rt: "SegmentRuntime", box: dict[str, Any]) -> None:
        self.rt = rt
        self.box = box
        self.saved_tokens: list = []
        self.saved_bytes: dict = {}  # storage key -> bytes of what the replay saved
        self.params: set = set()
        self.keep = False

    def __enter__(self) -> None:
        probe: _Probe = self.box["probe"]
        rt = self.rt
        if probe.observations is None:
            rt._observe(probe)  # the window ends here if no saved tensor was unpacked first
        self.params = {
            k for k in (storage_key(p) for p in rt.engine.model.parameters()) if k is not None
        }
        self.saved_tokens = []
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
        with torch.no_grad():
            for ob in probe.observations:
                t = ob.touch
                if ob.entries:  # a parameter written in the window: its logged writes undone
                    undo(ob.entries)
                    self.undone.append(ob.entries)
                    continue
                src = t.source() if t.source is not None else None
                if src is not None and storage_identity(src) != storage_identity(t.tensor):
                    # the object the forward read now has another storage: point it back
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
                    continue  # resized since: the output comparison says if it mattered
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
        """The replay's outputs against the forward's digests."""
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
        ours, theirs = resolve_tokens(self.saved_tokens), resolve_tokens(probe.saved_tokens)
        saved_differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        if len(ours) != len(theirs):
            saved_differ.append(min(len(ours), len(theirs)))
        detail = {
            "what": "replayed probe: outputs and saved tensors of the replay against the forward's",
            "outputs": len(expected),
            "saved_tensors": len(theirs),
        }
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
        message = (
            f"segment {rt.name!r}: the replay of its probe (step {probe.step}) did not "
            f"reproduce the forward's outputs {differ[:16]} (or the tensors it saved "
            f"for backward {saved_differ[:16]}): that step's gradients "
            "through it differ from plain PyTorch's. Something the probe could not "
            "restore changed between its forward and backward (a parameter written in "
            "the window, a storage resized or swapped); recorded as a divergence. Its "
            "next probe runs retained."
        )
        if eng.on_violation == "raise":
            raise ReplayError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

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
        probe.activation_bytes = act
        c = self.rt.contract
        if c is not None and c.probed_at_step == probe.step and act > c.activation_bytes:
            c.activation_bytes = act
        self.rt.engine.meter.activation_bytes.pop(self.rt.name, None)

    def __exit__(self, *exc) -> bool:
        self.box.pop("replay", None)
        restore_generators(self.gens)
        _set_all(reversed(self.outside))
        restore_slots(self.slots)
        with torch.no_grad():
            for t, snap, _ in self.swapped:
                storage_bytes(t).copy_(snap)  # the live bytes the swap left in the copy
            for entries in reversed(self.undone):
                redo(entries)
            for src, live, _ in reversed(self.repointed):
                src.set_(*live)
        set_versions([src for src, _, _ in self.repointed], [v for _, _, v in self.repointed])
        set_versions([t for t, _, _ in self.swapped], [v for _, _, v in self.swapped])
        probe = self.box.get("probe") if not self.keep else None
        for ob in (probe.observations or []) if probe is not None else []:
            if ob.touch.snapshot is not None and ob.touch.snapshot.numel():
                ob.touch.snapshot = ob.touch.snapshot.new_empty(0)
        self.swapped = []
        self.undone = []
        self.repointed = []
        return False


def _set_all(items: Any) -> None:
    """Set each ``(dict, name, value)``; ``MISSING`` removes the name."""
    for d, name, v in items:
        if v is MISSING:
            d.pop(name, None)
        else:
            d[name] = v
