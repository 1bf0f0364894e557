"""Exception types. The type says what kind of problem; the message says where and what to do."""
from __future__ import annotations


class ReplayError(Exception):
    """Base class for every error raised by lightning_replay."""


class ReplayConfigError(ReplayError, ValueError):
    """A bad argument: the message names the argument, the bad value and what is accepted."""


class SegmentError(ReplayConfigError):
    """A segment specification that does not resolve to valid, non-nested submodules."""


class ContractViolation(ReplayError, RuntimeError):
    """Replay found state changed that the segment's replay contract does not cover.

    Attributes:
        segment: qualified name of the segment.
        state: stable name of the state that changed.
        detail: what was seen.
    """

    def __init__(self, segment: str, state: str, detail: str, contract_version: int) -> None:
        self.segment = segment
        self.state = state
        self.detail = detail
        self.contract_version = contract_version
        super().__init__(
            f"segment {segment!r} (contract v{contract_version}): state {state!r} {detail}. "
            "Its replay would not see what its forward saw. Keep the state constant between the "
            "forward and backward, or install with on_violation='record' so the segment is "
            "re-probed and the contract extended."
        )


class ContractSchemaError(ReplayError, ValueError):
    """A serialized contract from an incompatible schema version or with missing fields."""


class RecordsError(ReplayError, OSError):
    """The records store cannot be opened, written or read."""
