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


class SavedTensorModified(ReplayError, RuntimeError):
    """A tensor autograd saved for backward was modified in place before backward used it.

    Plain PyTorch refuses the same model ("modified by an inplace operation"); the saved-tensor
    hooks lightning_replay installs would otherwise hide the version check and let backward
    read the new bytes, i.e. compute wrong gradients silently.
    """

    def __init__(self, t, saved_version: int, where: str, state: str | None = None) -> None:
        self.saved_version = saved_version
        self.version = t._version
        self.where = where
        self.state = state
        what = f"state {state!r} ({{}})" if state else "a {}"
        super().__init__(
            what.format(f"{str(t.dtype).replace('torch.', '')} tensor of shape {tuple(t.shape)}")
            + " that "
            f"autograd saved for backward in {where} was modified in place before backward "
            f"used it (version {saved_version} when saved, {t._version} at backward). Plain "
            "PyTorch rejects this too ('modified by an inplace operation'): backward would "
            "read the new bytes and compute wrong gradients. Read a copy inside the forward "
            "(e.g. `buffer.clone()`, as MoCo does with its queue), or make the in-place write "
            "after backward."
        )


class ContractSchemaError(ReplayError, ValueError):
    """A serialized contract from an incompatible schema version or with missing fields."""


class RecordsError(ReplayError, OSError):
    """The records store cannot be opened, written or read."""
