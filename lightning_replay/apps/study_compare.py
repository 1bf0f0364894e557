"""The study's comparisons: each run against its seed's reference, steady-state figures, and
the per-seed verdicts, gathered in :class:`StudyResult`.

Example:
    >>> a = {"w": torch.ones(2), "bn.num_batches_tracked": torch.tensor(4)}
    >>> divergence_text(describe_divergence(a, a), 0.0)
    'identical'
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from lightning_replay.apps.study_config import StudySettings

__all__ = [
    "format_top1",
    "StudyResult",
    "describe_divergence",
    "divergence_text",
    "module_state",
    "compare_to_reference",
    "seed_summaries",
    "steady_cutoff",
    "add_steady_figures",
]


def format_top1(value: float | None) -> str:
    """Test top-1 for people: ``0.0860000029206276`` -> ``'8.60 %'`` (results.json keeps the
    exact float, which the byte-identity verdicts compare).

    Example:
        >>> format_top1(0.0860000029206276)
        '8.60 %'
    """
    return "n/a" if value is None else f"{100 * value:.2f} %"


@dataclasses.dataclass
class StudyResult:
    """What :func:`~lightning_replay.apps.study.run_study` measured; ``to_dict()`` is what
    ``results.json`` holds."""

    settings: StudySettings
    rows: list[dict[str, Any]]
    seeds: dict[int, dict[str, Any]]
    budget: dict[str, Any]
    output_dir: Path
    wall_s: float
    data: str = ""
    paths: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def identical(self) -> bool:
        """Every seed's state-aware methods gave byte-identical scores and weights."""
        return all(s["state_aware_identical"] for s in self.seeds.values())

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (``results.json``)."""
        return {
            "settings": dataclasses.asdict(self.settings),
            "rows": self.rows,
            "seeds": {str(k): v for k, v in self.seeds.items()},
            "budget": self.budget,
            "identical": self.identical,
            "wall_s": self.wall_s,
            "data": self.data,
            "paths": self.paths,
        }


# ------------------------------------------------------------------------------ one run vs ref
def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``module``'s state dict, to compare runs with."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def describe_divergence(
    ref: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """How two encoder states differ: counts, the largest relative difference of a floating
    tensor, and how batch-norm counters (``num_batches_tracked``) compare.

    Example:
        >>> a = {"w": torch.ones(3), "bn.num_batches_tracked": torch.tensor(4)}
        >>> b = {"w": torch.tensor([1.0, 1.0, 1.5]), "bn.num_batches_tracked": torch.tensor(8)}
        >>> d = describe_divergence(a, b)
        >>> d["differ"], d["bn_counter_ratio"]
        (2, 2.0)
    """
    differ, worst, worst_name, ratios = 0, 0.0, None, []
    for k, a in ref.items():
        b = other.get(k)
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            differ += 1
            continue
        if torch.equal(a, b):
            continue
        differ += 1
        if k.endswith("num_batches_tracked"):
            if int(a) != 0:
                ratios.append(int(b) / int(a))
            continue
        if a.is_floating_point():
            den = float(a.double().norm())
            rel = float((a.double() - b.double()).norm()) / den if den > 0 else math.inf
            if rel > worst:
                worst, worst_name = rel, k
    return {
        "differ": differ,
        "tensors": len(ref),
        "max_rel_diff": worst,
        "max_rel_diff_tensor": worst_name,
        "bn_counter_ratio": (statistics.median(ratios) if ratios else None),
    }


def divergence_text(d: dict[str, Any], top1_delta: float) -> str:
    """One line for people: how a run differs from its reference (``"identical"`` if not)."""
    if d["differ"] == 0 and top1_delta == 0:
        return "identical"
    parts = [f"top-1 {top1_delta:+.4f}", f"{d['differ']}/{d['tensors']} encoder tensors differ"]
    if d["max_rel_diff_tensor"]:
        parts.append(f"max rel. diff {d['max_rel_diff']:.2e} ({d['max_rel_diff_tensor']})")
    if d["bn_counter_ratio"] not in (None, 1.0):
        parts.append(
            f"BN counters x{d['bn_counter_ratio']:.2f} (statistics updated again on every replay)"
        )
    return "; ".join(parts)


def compare_to_reference(
    row: dict[str, Any], state: Mapping[str, torch.Tensor], ref: Mapping[str, Any]
) -> None:
    """Set a result row's comparison with its seed's reference run: ``ref`` holds that run's
    ``method``, encoder ``state`` (:func:`module_state`) and ``top1``."""
    d = describe_divergence(ref["state"], state)
    row["reference"] = ref["method"]
    row["same_top1"] = row["top1"] == ref["top1"]
    row["same_weights"] = d["differ"] == 0
    row["divergence"] = d
    row["vs_reference"] = divergence_text(d, row["top1"] - ref["top1"])


# ------------------------------------------------------------------------------ steady steps
def steady_cutoff(runs: Sequence[Sequence[dict[str, Any]]]) -> int:
    """First step at which every replay run (its telemetry rows) had its plan in force (1 if
    none is replayed)."""
    firsts = []
    for tel in runs:
        first = next((r["step"] for r in tel if (r.get("plan_version") or 0) >= 1), None)
        if first is not None:
            firsts.append(first)
    return max(firsts, default=1)


def _steady(rows: Sequence[dict[str, Any]], cutoff: int) -> list[dict[str, Any]]:
    enc = [r for r in rows if r.get("phase", "encoder") == "encoder"]
    steady = [r for r in enc if r["step"] >= cutoff and not r.get("checked")]
    return steady or enc


def add_steady_figures(
    row: dict[str, Any], telemetry: Sequence[dict[str, Any]], cutoff: int
) -> None:
    """Set a result row's peak memory and median step time over its run's steady contrastive
    steps (from ``cutoff``, checked steps excluded; steps with memory tracking are left out of
    the median, they are slower)."""
    steady = _steady(telemetry, cutoff)
    peaks = [r["peak_bytes"] for r in steady if r.get("peak_bytes") is not None]
    row["peak_bytes"] = max(peaks) if peaks else None
    acc = [r["accounted_peak_bytes"] for r in steady if r.get("accounted_peak_bytes")]
    row["accounted_peak_bytes"] = max(acc) if acc else None
    timed = [r for r in steady if not r.get("memory_tracked")] or steady
    row["median_step_ms"] = statistics.median(r["step_time_ms"] for r in timed)
    row["steady_steps"] = len(steady)


# ------------------------------------------------------------------------------ verdicts
def seed_summaries(rows: list[dict[str, Any]], settings: StudySettings) -> dict[int, Any]:
    """Per seed: whether its state-aware methods were byte-identical, and how the
    state-unaware ones diverged."""
    out = {}
    for seed in settings.seeds:
        mine = [r for r in rows if r["seed"] == seed]
        aware = [r for r in mine if r["kind"] == "state-aware"]
        identical = all(r.get("same_top1") and r.get("same_weights") for r in aware)
        out[seed] = {
            "reference": aware[0]["method"] if aware else None,
            "state_aware": [r["method"] for r in aware],
            "state_aware_identical": identical,
            "top1": aware[0]["top1"] if aware else None,
            "encoder_digest": aware[0]["encoder_digest"] if aware else None,
            "not_identical": [
                r["method"] for r in aware if not (r.get("same_top1") and r.get("same_weights"))
            ],
            "state_unaware": {
                r["method"]: r.get("vs_reference") for r in mine if r["kind"] == "state-unaware"
            },
        }
    return out
