"""The versioned replay contract: what a segment's replay must see as its forward saw it.

A contract is made by the probe (see :mod:`lightning_replay.discovery`) and names every piece of
state by a stable name (``"encoder.blocks.0.bn.running_mean"``, ``"queue"``, ``"external[0]"``).
It is plain data: ``to_dict()`` is JSON-safe and ``from_dict()`` refuses other schema versions.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lightning_replay.errors import ContractSchemaError

SCHEMA_VERSION = 2

OPTIONS = (
    "retain",
    "recompute",
    "whole",
    "regions",
    "selective",
    "selective_whole",
    "selective_regions",
)
"""Segment options. ``retain``: keep activations; ``recompute``: replay, nothing to preserve;
``whole``: snapshot each changing state tensor at forward; ``regions``: keep only the regions
overwritten in the window (falls back to ``whole`` for state whose writes can't be localized).
``selective``, ``selective_whole``, ``selective_regions``: the same three replays, but the
outputs of the ops a policy keeps (matrix products, attention, convolutions: see
:mod:`lightning_replay.selective`) come from the forward instead of running again."""

#: Each selective option and the replayed option whose preservation it shares.
SELECTIVE = {"selective": "recompute", "selective_whole": "whole", "selective_regions": "regions"}


def base_option(option: str) -> str:
    """The option whose preservation ``option`` uses (itself, but for the selective ones).

    Example:
        >>> base_option("selective_regions"), base_option("whole")
        ('regions', 'whole')
    """
    return SELECTIVE.get(option, option)


@dataclasses.dataclass
class StateEntry:
    """One piece of tensor state a segment reads or writes.

    Attributes:
        name: stable qualified name (first of its aliases in module order).
        kind: ``parameter``, ``buffer``, ``attribute`` (plain tensor attribute) or ``external``.
        aliases: other names of the same storage (tensors shared between modules).
        changes_in_window: the probe saw its bytes change between the segment's forward and its
            replay, so replay needs it preserved.
        written_by_segment: the segment itself writes it (replay must not leak that write).
        unannotated_write: written without a schema write annotation or version bump (eager CPU
            batch norm); only byte comparison sees it, so it is always preserved whole.
        regions_ok: every change in the window was an annotated write whose region was logged.
        region_bytes: bytes the region log held for it in the probe window.
        extent: ``[start, end)``, the bytes of its storage the segment reads and writes, where
            that is less than the whole storage (a buffer that is a view of a bigger one: only
            these bytes are preserved, restored and compared); None: the whole storage.
            ``nbytes`` is the extent's size.
        preservation: under the contract's option, ``whole`` or ``regions`` for state that
            changes in the window; for state the probe saw unchanged, ``guard`` (buffers and
            attributes: writes in the window are logged all the same, so a writer that starts
            after the probe is undone for the replay and then learned) or ``none``.
    """

    name: str
    kind: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    aliases: list[str] = dataclasses.field(default_factory=list)
    changes_in_window: bool = False
    written_by_segment: bool = False
    unannotated_write: bool = False
    regions_ok: bool = False
    region_bytes: int = 0
    preservation: str = "none"
    extent: list[int] | None = None


def _preservation(s: StateEntry, option: str) -> str:
    """How ``s`` is preserved for a replay under ``option`` (see :attr:`StateEntry.preservation`)."""
    option = base_option(option)
    if not s.changes_in_window:
        return "guard" if option != "retain" and s.kind != "parameter" else "none"
    if option in ("retain", "recompute"):
        return "none"
    if option == "regions" and s.regions_ok and not s.unannotated_write:
        return "regions"
    return "whole"


@dataclasses.dataclass
class ReplayContract:
    """What replay of one segment must restore, at one version.

    Example:
        >>> c = ReplayContract(segment="blocks.0", version=1)
        >>> ReplayContract.from_dict(c.to_dict()) == c
        True
    """

    segment: str
    version: int = 1
    option: str = "recompute"
    state: list[StateEntry] = dataclasses.field(default_factory=list)
    generators: list[str] = dataclasses.field(default_factory=list)
    uses_global_rng: bool = False
    python_attrs: list[str] = dataclasses.field(default_factory=list)
    input_aliases: list[str] = dataclasses.field(default_factory=list)
    outside_attrs: list[str] = dataclasses.field(default_factory=list)
    changed_inputs: list[int] = dataclasses.field(default_factory=list)
    written_inputs: list[int] = dataclasses.field(default_factory=list)
    activation_bytes: int = 0
    probed_at_step: int = 0
    selective: bool = False
    #: the replay must run to the segment's end (no checkpoint early stop): its forward has an
    #: op that writes an argument autograd saved before the write (``F.rrelu``'s noise)
    full_replay: bool = False
    schema: int = SCHEMA_VERSION

    # ---- derived views ----
    @property
    def changing(self) -> list[StateEntry]:
        """State that must be preserved for replay to be exact."""
        return [s for s in self.state if s.changes_in_window]

    @property
    def stateless(self) -> bool:
        """Nothing to preserve (generator states and Python attributes cost nothing to keep)."""
        return not self.changing

    def available_options(self) -> list[str]:
        """Options that honour this contract (the selective ones where ``selective`` is set:
        the engine offers them when it was given a selective policy)."""
        if self.stateless:
            opts = ["retain", "recompute"]
        else:
            opts = ["retain", "whole"]
            if any(s.regions_ok and not s.unannotated_write for s in self.changing):
                opts.append("regions")
        if self.selective:
            opts += [o for o, base in SELECTIVE.items() if base in opts]
        return opts

    def preserved_bytes(self, option: str | None = None) -> int:
        """Bytes this contract holds from forward to replay under ``option`` (probe estimate)."""
        option = base_option(option or self.option)
        if option in ("retain", "recompute"):
            return 0
        total = 0
        for s in self.changing:
            if option == "regions" and s.regions_ok and not s.unannotated_write:
                total += min(s.region_bytes, s.nbytes)
            else:
                total += s.nbytes
        return total

    def apply_option(self, option: str) -> None:
        """Set ``option`` and each state entry's preservation accordingly."""
        if option not in OPTIONS:
            raise ValueError(f"option must be one of {OPTIONS}, got {option!r}")
        self.option = option
        for s in self.state:
            s.preservation = _preservation(s, option)

    def needs_capture(self, option: str) -> bool:
        """Whether running under ``option`` turns on the capture mode, which logs writes over
        the whole forward: to keep regions, or to guard state the probe saw unchanged."""
        return any(_preservation(s, option) in ("regions", "guard") for s in self.state)

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReplayContract":
        """Rebuild a contract; raises :class:`ContractSchemaError` on another schema version."""
        if not isinstance(data, dict):
            raise ContractSchemaError(
                f"a replay contract must be a dict from ReplayContract.to_dict(), got "
                f"{type(data).__name__}"
            )
        schema = data.get("schema")
        if schema != SCHEMA_VERSION:
            raise ContractSchemaError(
                f"replay contract for segment {data.get('segment')!r} has schema {schema!r}; this "
                f"lightning_replay reads schema {SCHEMA_VERSION}. Re-probe the model (a fresh "
                "install makes new contracts) instead of loading contracts from another version."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = {"segment"} - set(data)
        unknown = set(data) - fields
        if missing or unknown:
            raise ContractSchemaError(
                f"replay contract dict is malformed: missing {sorted(missing)}, unknown "
                f"{sorted(unknown)}"
            )
        kwargs = dict(data)
        try:
            kwargs["state"] = [StateEntry(**s) for s in data.get("state", [])]
        except TypeError as exc:
            raise ContractSchemaError(f"replay contract state entry is malformed: {exc}") from exc
        return cls(**kwargs)
