"""What a user reads about memory and checks (issue 34): each memory figure is compared only with
its like (real peak with the budget, predicted with predicted), a saving below zero is said as
"more", skipped derivative checks are counted and said, and a CPU fit prints no profiler noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from lightning_replay.callbacks.replay import format_fit_summary, progress_bar_metrics

MiB = 2**20

_BASE = {
    "run_id": "r1",
    "steps": 10,
    "plan_version": 1,
    "planner": "joint",
    "budget": 12 * MiB,
    "segments": {"a": {"option": "recompute", "contract_version": 1, "replays": 9}},
    "real_peak_bytes": 8 * MiB,
    "real_peak_step": 4,
    "real_peak_source": "profiler",
    "predicted_peak_bytes": 9 * MiB,
    "retain_all_peak_bytes": 11 * MiB,
    "accounted_peak_bytes": 5 * MiB + MiB // 2,
    "replays": 9,
    "checked_steps": 1,
    "check_every_n_steps": 50,
    "matches": 2,
    "divergences": 0,
    "rejections": 0,
    "checks_skipped": 0,
    "records_path": None,
    "root_dir": ".",
}


def _memory_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "MiB" in ln or "peak" in ln]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"predicted_peak_bytes": 12 * MiB, "retain_all_peak_bytes": 10 * MiB},  # plan holds more
        {"real_peak_bytes": 70 * MiB, "retain_all_peak_bytes": 4 * MiB},  # the GPU case
        {"real_peak_bytes": None},
        {"budget": None},
    ],
)
def test_summary_compares_each_memory_figure_only_with_its_like(changes):
    s = format_fit_summary({**_BASE, **changes})
    lines = _memory_lines(s)
    real = [ln for ln in lines if "real peak" in ln]
    assert len(real) == 1
    # the real peak sits beside the budget only: never beside a predicted or accounted figure
    assert not re.search(r"predicted|retaining|accounted|saved|more", real[0]), real[0]
    predicted = [ln for ln in lines if "predicted peak" in ln]
    assert len(predicted) == 1 and "real" not in predicted[0]
    if "retaining" in predicted[0]:
        assert "retaining every segment (predicted)" in predicted[0]
    # the accountant's figure is not a user-facing memory term
    assert "5.50 MiB" not in s
    # no negative number anywhere: a plan holding more says "more"
    assert not re.search(r"-\s?\d", s), s
    if changes.get("predicted_peak_bytes", 0) > changes.get("retain_all_peak_bytes", 1 << 60):
        assert "2.00 MiB (20%) more" in predicted[0], predicted[0]


def test_progress_bar_is_in_mib_and_never_negative():
    assert progress_bar_metrics(8 * MiB, 12 * MiB, 10 * MiB) == {
        "replay/real_peak_MiB": 8.0,
        "replay/predicted_MiB": 12.0,
        "replay/more_MiB": 2.0,
    }
    bar = progress_bar_metrics(None, 3 * MiB, 10 * MiB)
    assert bar == {"replay/predicted_MiB": 3.0, "replay/saved_MiB": 7.0}
    assert all(v >= 0 and k.endswith("_MiB") for k, v in bar.items())


def test_skipped_checks_are_counted_and_said_with_the_reason():
    s = format_fit_summary(
        {**_BASE, "checks_skipped": 4, "checks_skipped_reason": "no room under the budget"}
    )
    assert "4 derivative checks skipped (no room under the budget)" in s


def test_a_roomy_budget_that_recomputes_nothing_is_said_with_how_to_set_one():
    s = format_fit_summary(
        {
            **_BASE,
            "budget": 125 * 2**30,
            "segments": {"a": {"option": "retain", "contract_version": 1, "replays": 0}},
            "predicted_peak_bytes": 11 * MiB,
            "lowest_plan_bytes": 7 * MiB,
        }
    )
    assert "nothing is recomputed" in s and 'budget="9MiB"' in s and 'budget="min"' in s, s
    assert "lowest-memory plan predicts 7.00 MiB" in s


_FIT = textwrap.dedent(
    """
    import lightning as L
    import lightning_replay
    from lightning_replay import ReplayCallback, ReplayStrategy
    from lightning_replay.demos.hazard_net import HazardNet, hazard_loader

    L.Trainer(
        accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir={root!r},
        strategy=ReplayStrategy(calibration_steps=1),
        callbacks=[ReplayCallback(check_every_n_steps=4)],
    ).fit(HazardNet(), hazard_loader(16))
    """
)


def test_a_cpu_fit_prints_no_profiler_or_allocator_lines(tmp_path):
    """The real-peak measurement runs torch's profiler, whose C++ side writes USDT lines and a
    CPUAllocator warning straight to file descriptor 2: none of it reaches the console."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "WANDB_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, "-c", _FIT.format(root=str(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "lightning_replay: 8 steps" in console  # the fit ran and its summary printed
    assert "real peak" in console and "not measured" not in console  # the profiler ran
    assert not re.search(r"USDT|CPUAllocator|profiler_st(art|op)", console), console[-3000:]
