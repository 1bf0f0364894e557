"""Memory budgets: turn what a user writes into a number of bytes, and bytes back into text.

A budget reaches the planner as an ``int`` of bytes. Users write it as ``44 * 2**30``,
``"44GiB"``, ``"1.5GB"``, as a fraction of the device's memory such as ``0.9`` (the CUDA
device's total memory, or the machine's physical memory on CPU), or as ``"min"`` for the
lowest-memory correct plan. :class:`Budget` is that grammar as one value, shared by
:func:`~lightning_replay.install`, ``ReplayStrategy`` and ``engine.replan``;
:func:`parse_budget` turns the byte and fraction forms into bytes. Everything else is rejected
with an error that quotes the bad value, so a typo in a config file never becomes a silent,
wrong budget.

Example:
    >>> parse_budget("512MiB")
    536870912
    >>> format_bytes(parse_budget("1.5GiB"))
    '1.50 GiB'
    >>> Budget.parse("min").resolve("cpu") is None  # no bytes: plan for the lowest memory
    True
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # torch is only needed for fractions of a device; keep the import lazy
    import torch

__all__ = ["Budget", "parse_budget", "device_memory", "format_bytes", "ACCEPTED_FORMS"]

#: Multipliers for the units :func:`parse_budget` understands (keys are lower case).
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

#: One line that every rejection repeats, so the user sees what would have worked.
ACCEPTED_FORMS = (
    "a positive int of bytes (e.g. 47244640256); a string with a number and an optional unit "
    "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive "
    "(e.g. '44GiB', '1.5GB', '2 GiB', '1024'); or a float in (0, 1] meaning that fraction of the "
    "device's memory: a CUDA device's total memory, or physical memory on CPU (e.g. 0.9); or "
    "'min' for the lowest-memory correct plan"
)

# An optional sign is matched so that "-1GiB" is reported as "not positive" rather than as
# "malformed", which would hide the real mistake.
_BUDGET_RE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

_DeviceLike = Union["torch.device", str, int, None]


def _reject(value: object, why: str) -> ValueError:
    return ValueError(
        f"budget={value!r} is not a valid memory budget: {why}. Accepted: {ACCEPTED_FORMS}."
    )


def parse_budget(value: int | float | str, device: _DeviceLike = None) -> int | None:
    """Convert a user-written memory budget to a positive number of bytes (``None`` for
    ``"min"``: no number of bytes, the planner finds the lowest-memory correct plan).

    Args:
        value: The budget. An ``int`` is bytes. A ``str`` is a number with an optional unit:
            ``B``, ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000) or ``KiB``, ``MiB``,
            ``GiB``, ``TiB`` (powers of 1024), case-insensitive, spaces allowed (``"2 GiB"``).
            A fractional count with a unit larger than a byte is rounded down to whole bytes
            (a budget rounded down is still held); a fractional count of plain bytes is
            rejected. A ``float`` in ``(0, 1]`` is that fraction of ``device``'s memory (see
            :func:`device_memory`); a ``float`` above 1 must be a whole number of bytes.
            ``"min"`` is the lowest-memory correct plan, as in ``install(budget="min")``.
        device: The device a fractional budget refers to (``torch.device``, ``"cuda:0"``,
            ``"cpu"`` or a CUDA index). Ignored for byte budgets.

    Returns:
        The budget in bytes, always ``> 0``; ``None`` for ``"min"``.

    Raises:
        ValueError: If the value is a bool, zero, negative, NaN or infinite, a non-whole float
            above 1, a malformed string or an unknown unit, or a fraction without a device (or
            of a device whose memory is unknown).
            The message quotes the value and lists the accepted forms.
        TypeError: If the value is not an int, float or str.

    Example:
        >>> parse_budget(1024)
        1024
        >>> parse_budget("44GiB")
        47244640256
        >>> parse_budget("1.5 GB")
        1500000000
        >>> parse_budget("min") is None  # the lowest-memory plan: no bytes to name
        True
        >>> parse_budget(0.5, device="cpu") == device_memory("cpu") // 2
        True
        >>> parse_budget(0.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: budget=0.5 is a fraction of device memory, which needs a device ...
    """
    # bool is an int subclass; True would otherwise be accepted as a 1-byte budget.
    if isinstance(value, bool):
        raise _reject(value, "a bool is not a number of bytes")
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise _reject(value, "it must be positive")
        return int(value)
    if isinstance(value, numbers.Real):
        return _parse_float(float(value), device)
    if isinstance(value, str):
        if value.strip().lower() == "min":
            return None
        return _parse_string(value)
    raise TypeError(
        f"budget={value!r} has type {type(value).__name__}, which is not a memory budget. "
        f"Accepted: {ACCEPTED_FORMS}."
    )


def _parse_float(value: float, device: _DeviceLike) -> int:
    if math.isnan(value) or math.isinf(value):
        raise _reject(value, "it must be finite")
    if value <= 0:
        raise _reject(value, "it must be positive")
    if value > 1:
        # A float such as 4e9 is a byte count that happens to be written as a float.
        if not value.is_integer():
            raise _reject(value, "a float above 1 is a number of bytes and must be whole")
        return int(value)
    return _fraction_of_device(value, device)


def _fraction_of_device(fraction: float, device: _DeviceLike) -> int:
    if device is None:
        raise ValueError(
            f"budget={fraction!r} is a fraction of device memory, which needs a device to "
            "resolve against (install() and ReplayStrategy use the model's device). Pass the "
            f"budget in bytes instead, e.g. '40GiB'. Accepted: {ACCEPTED_FORMS}."
        )
    try:
        total = device_memory(device)
    except ValueError as exc:
        raise ValueError(
            f"budget={fraction!r}: {exc} Pass the budget in bytes instead, e.g. "
            f"'40GiB'. Accepted: {ACCEPTED_FORMS}."
        ) from None
    # Exact rational arithmetic so 0.5 of an even total is exactly half, never one byte off.
    budget = math.floor(Fraction(fraction) * total)
    if budget <= 0:
        raise _reject(fraction, f"it is less than one byte of the device's {total} bytes")
    return budget


def device_memory(device: _DeviceLike) -> int:
    """The memory a fractional budget is a fraction of, in bytes.

    Args:
        device: ``"cpu"``, a CUDA device (``torch.device``, ``"cuda:1"``) or a CUDA index.

    Returns:
        A CUDA device's total memory, or on CPU the machine's physical memory (all of it,
        not what is free now: a budget is a fixed promise, not a snapshot of the machine).

    Raises:
        ValueError: On another device type, CUDA not available, or a platform that does not
            report its physical memory.

    Example:
        >>> device_memory("cpu") > 0
        True
    """
    import torch

    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such key
            raise ValueError("this platform does not report its physical memory.") from None
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r} has no known total memory (CPU and CUDA do).")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}, but CUDA is not available on this machine.")
    return int(torch.cuda.get_device_properties(dev).total_memory)


@dataclass(frozen=True)
class Budget:
    """A memory budget as written, validated once: bytes, a fraction of the device, ``"min"``
    or no budget. The one budget grammar of ``install()``, ``ReplayStrategy`` and
    ``engine.replan()``.

    Build it with :meth:`parse`; turn it into bytes for a device with :meth:`resolve`.

    Attributes:
        bytes: The budget in bytes, when written as bytes.
        fraction: The fraction in ``(0, 1]`` of the device's memory, when written as one.
        min: ``True`` for ``"min"``: the lowest-memory correct plan.

    Example:
        >>> Budget.parse("2GiB")
        Budget('2.00 GiB')
        >>> Budget.parse(0.25).resolve("cpu") == device_memory("cpu") // 4
        True
        >>> Budget.parse(None), Budget.parse("min")
        (Budget(None), Budget('min'))
    """

    bytes: int | None = None
    fraction: float | None = None
    min: bool = False

    @classmethod
    def parse(cls, value: "Budget | int | float | str | None") -> "Budget":
        """Validate a user-written budget (no device needed yet).

        Raises:
            ValueError, TypeError: as :func:`parse_budget`, quoting the value.
        """
        if isinstance(value, Budget):
            return value
        if value is None:
            return cls()
        if isinstance(value, str) and value.strip().lower() == "min":
            return cls(min=True)
        if (
            isinstance(value, numbers.Real)
            and not isinstance(value, (bool, numbers.Integral))
            and 0 < float(value) <= 1
        ):
            return cls(fraction=float(value))
        return cls(bytes=parse_budget(value))

    @property
    def is_none(self) -> bool:
        """No budget was given."""
        return self.bytes is None and self.fraction is None and not self.min

    def resolve(self, device: _DeviceLike) -> int | None:
        """Bytes for ``device`` (fractions resolve against :func:`device_memory`); ``None``
        for ``"min"`` and for no budget."""
        if self.fraction is not None:
            return _fraction_of_device(self.fraction, device)
        return self.bytes

    def __repr__(self) -> str:
        return f"Budget({str(self)!r})" if not self.is_none else "Budget(None)"

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        if self.fraction is not None:
            return f"{self.fraction:g} of device memory"
        return "min" if self.min else "none"


def _parse_string(value: str) -> int:
    match = _BUDGET_RE.match(value)
    if match is None:
        raise _reject(value, "expected a number followed by an optional unit")
    sign, number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise _reject(value, f"unknown unit {unit!r}")
    if sign == "-":
        raise _reject(value, "it must be positive")
    exact = Fraction(number) * multiplier
    if multiplier == 1 and exact.denominator != 1:
        raise _reject(value, "a count of bytes must be whole")
    budget = math.floor(exact)
    if budget <= 0:
        raise _reject(value, "it must be at least one byte")
    return budget


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """Format a byte count for people, in binary units with two decimals.

    Args:
        n: A number of bytes (may be negative, for differences).

    Returns:
        ``"512 B"`` below 1 KiB, otherwise the largest binary unit that keeps the value at
        least 1, e.g. ``"1.50 GiB"``.

    Example:
        >>> format_bytes(512)
        '512 B'
        >>> format_bytes(3 * 2**29)
        '1.50 GiB'
        >>> format_bytes(-2048)
        '-2.00 KiB'
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"format_bytes expects an int number of bytes, got {n!r}")
    n = int(n)
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    if magnitude < 1024:
        return f"{sign}{magnitude} B"
    value = float(magnitude)
    for unit in _BINARY_UNITS:
        value /= 1024
        # Move up a unit only while the next one would still be >= 1 (and 1023.995 KiB would
        # print as "1024.00 KiB", so round before deciding).
        if round(value, 2) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")  # the loop always returns at the last unit
