"""The study's results, formatted and written: ``results.md`` (the table and the verdicts),
``results.csv``, ``results.json`` and ``report.html``.

Example:
    >>> format_top1(0.25)
    '25.00 %'
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

from lightning_replay.apps.study_compare import StudyResult, format_top1
from lightning_replay.apps.study_config import METHOD_DESCRIPTIONS
from lightning_replay.core.base.budget import format_bytes
from lightning_replay.core.base.records import OUTCOMES

__all__ = ["format_top1", "format_markdown", "write_results", "clean_outputs"]


def _fmt_records(rec: dict[str, int] | None) -> str:
    if rec is None:
        return "n/a"
    return " / ".join(str(rec.get(o, 0)) for o in OUTCOMES)


def format_markdown(result: StudyResult) -> str:
    """The result table (one row per method and seed) and the per-seed verdicts, in Markdown."""
    lines = [
        "| method | seed | test top-1 | encoder digest | peak, live tensors | "
        "peak, accounted (vs budget) | median step (steady) | replays | "
        "checks (match / rejection / divergence) | vs reference |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result.rows:
        peak = format_bytes(r["peak_bytes"]) if r.get("peak_bytes") is not None else "n/a"
        acc = r.get("accounted_peak_bytes")
        accounted = format_bytes(acc) if acc and r.get("budget_bytes") else "-"
        lines.append(
            f"| {r['method']} | {r['seed']} | {format_top1(r['top1'])} | "
            f"`{r['encoder_digest'][:16]}` | "
            f"{peak} | {accounted} | {r['median_step_ms']:.1f} ms | {r['replays']} | "
            f"{_fmt_records(r.get('records'))} | "
            f"{'reference' if r.get('reference') == r['method'] else r.get('vs_reference', '')}"
            " |"
        )
    lines.append("")
    for seed, s in result.seeds.items():
        if len(s["state_aware"]) == 1:
            lines.append(
                f"- seed {seed}: {s['state_aware'][0]} is the only state-aware method "
                "run: nothing to compare it with."
            )
        elif s["state_aware_identical"]:
            lines.append(
                f"- seed {seed}: state-aware methods {', '.join(s['state_aware'])} give "
                f"**byte-identical** test top-1 ({format_top1(s['top1'])}) and "
                "encoder weights "
                f"(`{s['encoder_digest'][:16]}`)."
            )
        else:
            lines.append(
                f"- seed {seed}: state-aware methods are **NOT identical**: "
                f"{', '.join(s['not_identical'])} differ from {s['reference']}."
            )
        for m, how in s["state_unaware"].items():
            lines.append(f"- seed {seed}: {m} (state-unaware): {how}.")
    b = result.budget
    if b.get("bytes") is not None:
        mf = b["min_feasible"]
        how = "given" if b["explicit"] else f"fraction {b['fraction']}"
        lines.append(
            f"- budget of eager_whole and joint: {format_bytes(b['bytes'])}, in the engine's "
            "accounted terms (saved tensors, snapshots, parameters and gradients): compare it "
            "with the accounted column, not the live-tensor one, which also holds optimizer "
            f"state, the batch and temporaries ({how}; minimum feasible "
            f"budgets from measured costs: joint {format_bytes(mf['joint'])}, eager_whole "
            f"{format_bytes(mf['eager_whole'])}, retain all {format_bytes(mf['retain_all'])})."
        )
        held = []
        for m in ("eager_whole", "joint"):
            peaks = [
                r["accounted_peak_bytes"]
                for r in result.rows
                if r["method"] == m and r.get("accounted_peak_bytes")
            ]
            if peaks:
                held.append(f"{m} {format_bytes(max(peaks))}")
        if held:
            lines.append(
                f"- the engine's accounted peak (the quantity the budget bounds) over "
                f"the steady steps, largest over seeds: {', '.join(held)}; the live "
                "tensor peak in the table also counts what the engine does not "
                "(optimizer state, the batch and its augmentations, temporaries)."
            )
    skipped = {}
    for r in result.rows:
        if r.get("checks_skipped"):
            skipped[r["method"]] = max(skipped.get(r["method"], 0), r["checks_skipped"])
    if skipped:
        lines.append(
            "- derivative checks skipped under the budget (keeping even one segment's graph "
            "would exceed it; byte checks still ran on those steps), most in one run: "
            + ", ".join(f"{m} {n}" for m, n in skipped.items())
            + "."
        )
    cutoff = b.get("steady_from_step", 1)
    when = (
        f"from step {cutoff}, when every replay run's plan is in force; checked steps excluded"
        if cutoff > 1
        else "all of them"
    )
    lines.append(
        f"- peak memory and median step time over the contrastive steps ({when}); "
        "peak memory is the largest live tensor bytes of a "
        "step (on CPU tracked every "
        f"{result.settings.memory_every_n_steps} steps, whose times are left out of "
        "the median; the CUDA allocator's peak on GPU)."
    )
    lines.append("")
    lines.append("Methods:")
    for m in result.settings.methods:
        lines.append(f"- `{m}`: {METHOD_DESCRIPTIONS.get(m, '')}")
    return "\n".join(lines) + "\n"


_CSV_COLUMNS = (
    "method",
    "seed",
    "kind",
    "top1",
    "test_images",
    "encoder_digest",
    "peak_bytes",
    "accounted_peak_bytes",
    "median_step_ms",
    "replays",
    "records_match",
    "records_rejection",
    "records_divergence",
    "budget_bytes",
    "same_top1",
    "same_weights",
    "vs_reference",
    "wall_s",
    "run_id",
    "run_dir",
)


def write_results(result: StudyResult) -> None:
    """Write the result files into ``result.output_dir`` and set ``result.paths``."""
    out = result.output_dir
    (out / "results.md").write_text(format_markdown(result))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in result.rows:
        rec = r.get("records") or {}
        w.writerow(
            {
                **r,
                "top1": repr(r["top1"]),
                **{f"records_{o}": rec.get(o, "") if r.get("records") else "" for o in OUTCOMES},
            }
        )
    (out / "results.csv").write_text(buf.getvalue())
    result.paths = {
        "results_md": str(out / "results.md"),
        "results_csv": str(out / "results.csv"),
        "results_json": str(out / "results.json"),
        "records": str(out / "records.sqlite"),
        "wandb": str(out / "wandb"),
        "runs": str(out / "runs"),
    }
    if result.settings.report:
        # imported here: the report imports matplotlib, which results alone do not need
        from lightning_replay.apps.report import write_report

        result.paths["report"] = str(write_report(out, result=result.to_dict()))
    (out / "results.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))


def clean_outputs(out: Path) -> None:
    """Remove what an earlier (or interrupted) study wrote into ``out``."""
    for name in (
        "results.md",
        "results.csv",
        "results.json",
        "report.html",
        "study_config.yaml",
        "records.sqlite",
        "records.sqlite-wal",
        "records.sqlite-shm",
    ):
        (out / name).unlink(missing_ok=True)
    for name in ("runs", "wandb", "plots", "measure"):
        shutil.rmtree(out / name, ignore_errors=True)
