"""A budget written any accepted way becomes the right number of bytes; anything else is refused
with a message that quotes it and shows what would have worked."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_replay.budget import Budget, device_memory, format_bytes, parse_budget

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (47244640256, 47244640256),
        ("1024", 1024),
        ("  1024  ", 1024),
        ("7B", 7),
        ("100KB", 100_000),
        ("5MB", 5_000_000),
        ("1.5GB", 1_500_000_000),
        ("2TB", 2 * 10**12),
        ("3KiB", 3 * KiB),
        ("512MiB", 512 * MiB),
        ("44GiB", 44 * GiB),
        ("2 GiB", 2 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5TiB", TiB // 2),
        ("44gib", 44 * GiB),
        ("44GIB", 44 * GiB),
        ("1.5gb", 1_500_000_000),
        (".5KiB", 512),
        ("+2GiB", 2 * GiB),
        ("0.3GiB", math.floor(0.3 * GiB)),  # 322122547.2 bytes: rounded down, still held
        (4e9, 4_000_000_000),  # a float above 1 that is a whole number of bytes
        (2.0, 2),
    ],
)
def test_accepted_forms(value: object, expected: int) -> None:
    assert parse_budget(value) == expected
    assert isinstance(parse_budget(value), int)


@given(st.integers(1, 2**60))
def test_any_positive_int_is_bytes(n: int) -> None:
    assert parse_budget(n) == n
    assert parse_budget(str(n)) == n


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        0,
        -1,
        0.0,
        -0.5,
        math.nan,
        math.inf,
        -math.inf,
        1.5,  # above 1: bytes, and not whole
        2.5e3 + 0.25,
        "",
        "   ",
        "abc",
        "GiB",
        "1.5.2GiB",
        "10 XB",
        "10 GiBs",
        "1e9",
        "-1GiB",
        "-5",
        "0",
        "0GiB",
        "0.0001KB",  # 0.1 byte
        "1.5",  # a fraction of a byte
        "0.5B",
        "1 0GiB",
        "nan",
        "inf",
    ],
)
def test_rejected_forms_name_budget_quote_the_value_and_list_the_forms(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_budget(value)
    text = str(info.value)
    assert f"budget={value!r}" in text
    assert "GiB" in text and "fraction" in text  # the accepted forms are listed
    assert "'min'" in text  # ... "min" among them


@pytest.mark.parametrize("value", ["min", "MIN", " min "])
def test_min_is_the_lowest_memory_plan_as_in_install(value: str) -> None:
    """``parse_budget("min")`` says what ``install(budget="min")`` does: no bytes to name."""
    assert parse_budget(value) is None
    assert Budget.parse(value).resolve("cpu") is None


@pytest.mark.parametrize("value", [None, [1], b"1GiB", {"GiB": 1}])
def test_wrong_types_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match="budget="):
        parse_budget(value)


def test_fraction_needs_a_device() -> None:
    with pytest.raises(ValueError) as info:
        parse_budget(0.9)
    text = str(info.value)
    assert "budget=0.9" in text and "needs a device" in text and "bytes" in text


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_fraction_of_cpu_is_a_fraction_of_physical_memory(device: object) -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_memory(device) == physical
    assert parse_budget(0.5, device=device) == physical // 2
    assert parse_budget(1.0, device=device) == physical


def test_fraction_of_a_device_without_known_memory_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budget=0\.5: device 'meta' has no known total memory"):
        parse_budget(0.5, device="meta")


def test_fraction_without_cuda_available_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        parse_budget(0.5, device="cuda")


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A CUDA device with 80 GiB, so the fraction path runs on CPU-only CI."""
    asked: list[object] = []

    def properties(device: object) -> SimpleNamespace:
        asked.append(device)
        return SimpleNamespace(total_memory=80 * GiB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    return asked


@pytest.mark.parametrize(
    ("fraction", "device", "expected"),
    [
        (0.5, "cuda", 40 * GiB),
        (1.0, "cuda:0", 80 * GiB),
        (0.9, torch.device("cuda", 1), math.floor(0.9 * 80 * GiB)),
        (0.25, 0, 20 * GiB),
    ],
)
def test_fraction_of_a_cuda_device(
    fake_gpu: list[object], fraction: float, device: object, expected: int
) -> None:
    assert parse_budget(fraction, device=device) == expected
    assert torch.device(fake_gpu[-1]).type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fraction_of_the_real_device() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    assert parse_budget(1.0, device="cuda") == total
    assert 0 < parse_budget(0.5, device=0) <= total // 2 + 1


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (512 * MiB, "512.00 MiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (44 * GiB, "44.00 GiB"),
        (2 * TiB, "2.00 TiB"),
        (MiB - 1, "1.00 MiB"),  # 1023.999 KiB rounds up: the next unit reads better
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_refuses_non_ints() -> None:
    with pytest.raises(TypeError):
        format_bytes(1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- Budget: one grammar
@pytest.mark.parametrize(
    ("value", "budget"),
    [
        (None, Budget()),
        ("min", Budget(min=True)),
        (" MIN ", Budget(min=True)),
        ("2GiB", Budget(bytes=2 * GiB)),
        (4096, Budget(bytes=4096)),
        (4e9, Budget(bytes=4_000_000_000)),
        (0.25, Budget(fraction=0.25)),
        (1.0, Budget(fraction=1.0)),
        (1, Budget(bytes=1)),  # an int is bytes, never a fraction
    ],
)
def test_budget_parses_every_form_once(value: object, budget: Budget) -> None:
    assert Budget.parse(value) == budget
    assert Budget.parse(budget) is budget


@pytest.mark.parametrize("value", ["lots", -5, 0, 0.0, True, "minimum", 1.5])
def test_budget_rejects_what_parse_budget_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="budget="):
        Budget.parse(value)


def test_budget_resolves_against_the_device() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Budget.parse(0.5).resolve("cpu") == physical // 2
    assert Budget.parse("1KiB").resolve("cpu") == 1024
    assert Budget.parse("min").resolve("cpu") is None
    assert Budget.parse(None).resolve("cpu") is None
    assert Budget.parse(None).is_none and not Budget.parse("min").is_none


def test_budget_fraction_resolves_on_a_cuda_device(fake_gpu: list[object]) -> None:
    assert Budget.parse(0.5).resolve("cuda:0") == 40 * GiB


# ---------------------------------------------------------------------- through install()
def test_install_resolves_a_fraction_against_the_models_device() -> None:
    """Issue 11, bug 1: install(budget=0.5) used to fail on every device."""
    import lightning_replay as lr
    from lightning_replay.planner import min_feasible_budget

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine = lr.install(model, ["0", "1"], budget=0.5)
    assert engine.budget == physical // 2
    for _ in range(7):  # probe, calibration, plan
        model(torch.randn(4, 8)).sum().backward()
    assert engine.plan is not None and engine.plan.budget == physical // 2
    engine.replan(budget=0.25)
    assert engine.budget == engine.plan.budget == physical // 4
    engine.replan(budget="min")
    assert engine.budget is None
    assert engine.plan.peak_memory == min_feasible_budget(
        engine.costs, engine.real_base_memory, **engine.phase_peak_args
    )
    engine.uninstall()
    with pytest.raises(
        lr.ReplayConfigError, match=r"budget=0\.5: device 'meta' has no known total memory"
    ):
        lr.install(torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta")), ["0"], budget=0.5)
