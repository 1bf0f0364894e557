"""The HTML report of a study or of one training run, with matplotlib plots.

``write_report(RUN_DIR)`` reads what the runs left behind — ``results.json`` of a study, each
run's per-step telemetry and the SQLite records — and writes ``RUN_DIR/report.html`` with PNG
plots under ``RUN_DIR/plots/``:

* memory per step: each run's peak live tensor bytes, and under ``strategy="replay"`` the
  engine's accounted peak against the budget and the plan's prediction;
* step time per step, and the median per run;
* the plan per segment over time (probe, calibration, then the planned option);
* record outcomes (match / rejection / divergence) per run, and per check kind.

``RUN_DIR`` is a study's ``output_dir`` or a ``fit`` run's ``default_root_dir``. A fit run
needs nothing but :class:`~lightning_replay.ReplayCallback`: it writes the records
(``replay/records.sqlite``) and one telemetry row per step (``replay/telemetry.jsonl``). When
:class:`~lightning_replay.apps.telemetry.StepTelemetry` also ran, its rows (with the live tensor
peak) are used instead. Several fits appended to one directory are told apart by run id: the
report shows the latest, or the one ``run_id`` names, and lists the others.

It is long (over 600 lines once ruff-formatted) because it renders every plot and table of the
HTML report from the run's files.

Example:
    >>> import tempfile, json, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"run_id": "r1", "step": i, "step_time_ms": 10.0, "peak_bytes": 1000 + i}
    ...         for i in range(1, 4)]
    >>> (d / "replay").mkdir()
    >>> _ = (d / "replay" / "telemetry.jsonl").write_text("\\n".join(json.dumps(r) for r in rows))
    >>> path = write_report(d)
    >>> path.name, sorted(p.name for p in (d / "plots").iterdir())[:1]
    ('report.html', ['memory.png'])
"""

from __future__ import annotations

import base64
import html
import json
import os
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from lightning_replay.apps.study_config import METHOD_DESCRIPTIONS  # noqa: E402
from lightning_replay.apps.study_compare import format_top1  # noqa: E402
from lightning_replay.apps.telemetry import read_telemetry  # noqa: E402
from lightning_replay.core.base.budget import format_bytes  # noqa: E402
from lightning_replay.errors import ReplayError  # noqa: E402
from lightning_replay.core.base.records import (
    OUTCOMES,
    RECORDS_DIR,
    Record,
    find_records,  # noqa: E402
    query,
)
from lightning_replay.core.base.records import runs as record_runs  # noqa: E402

__all__ = ["write_report", "load_runs", "ReportError"]

_OPTION_COLOURS = {
    "probe": "#bbbbbb",
    "probing": "#bbbbbb",
    "retain": "#4c72b0",
    "recompute": "#55a868",
    "whole": "#dd8452",
    "regions": "#c44e52",
}
_OUTCOME_COLOURS = {"match": "#55a868", "rejection": "#dd8452", "divergence": "#c44e52"}


class ReportError(ReplayError, FileNotFoundError):
    """The directory holds nothing a report can be made from, or the run asked for is not
    there. A :class:`FileNotFoundError` too, as callers before the error tree caught it."""


def _records(db: Path, run_id: str | None = None) -> list[Record]:
    return query(db, run_id=run_id) if db.exists() else []


def _fit_run(root: Path, run_id: str | None) -> dict[str, Any]:
    """One fit run of ``root``: its telemetry and records, scoped to ``run_id`` (default: the
    latest run), plus ``runs`` (every run the directory holds)."""
    own = read_telemetry(root / RECORDS_DIR)  # ReplayCallback's rows, every fit, by run id
    step_tel = read_telemetry(root)  # StepTelemetry's rows (the last fit), if it ran
    try:
        db: Path | None = find_records(root)
    except FileNotFoundError:
        db = None
    records = _records(db) if db is not None else []
    known = [r["run_id"] for r in record_runs(records)]
    for t in own:
        if t.get("run_id") and t["run_id"] not in known:
            known.append(t["run_id"])
    if not own and not step_tel:
        raise ReportError(
            f"{root} holds neither a study (results.json) nor a run's telemetry "
            f"({RECORDS_DIR}/telemetry.jsonl, written by ReplayCallback); pass a "
            "study's output_dir or the default_root_dir of a fit run trained "
            "with ReplayCallback"
        )
    latest = (own[-1].get("run_id") if own else None) or (known[-1] if known else None)
    if run_id is not None and run_id not in known:
        raise ReportError(
            f"run {run_id!r} is not in {root}; its runs (oldest first): "
            f"{', '.join(known) or 'none recorded'}"
        )
    chosen = run_id or latest
    tel = [t for t in own if t.get("run_id") == chosen] if chosen else own
    # StepTelemetry rows have the live tensor peak: prefer them for the run they belong to
    # (they carry its run id; older files without one are the directory's latest fit)
    step_rows = [t for t in step_tel if t.get("run_id", latest) == chosen] if chosen else step_tel
    if step_rows:
        tel = step_rows
    return {
        "label": chosen or root.name,
        "method": root.name,
        "seed": None,
        "telemetry": tel,
        "run_id": chosen,
        "runs": known,
        "records": ([r for r in records if r.run_id == chosen] if chosen else records)
        if db is not None
        else None,
        "budget": next((t.get("budget") for t in tel if t.get("budget")), None),
    }


def load_runs(
    run_dir: str | os.PathLike, result: Mapping[str, Any] | None = None, run_id: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The runs a report shows: ``[{"label", "method", "seed", "telemetry", "records"}]``,
    plus the study result (``None`` for a single run).

    Args:
        run_dir: a study's ``output_dir`` or a fit run's ``default_root_dir``.
        result: the study result (read from ``results.json`` when omitted).
        run_id: for a fit run directory that several fits appended to, the run to show
            (default: the latest).

    Raises:
        ReportError: nothing to report, or ``run_id`` is not in the directory.
    """
    root = Path(run_dir)
    if result is None and (root / "results.json").exists():
        result = json.loads((root / "results.json").read_text())
    runs = []
    if result is not None:
        db = root / "records.sqlite"
        for row in result["rows"]:
            rdir = Path(row["run_dir"])
            if not rdir.is_absolute() and not rdir.exists():
                rdir = root / "runs" / rdir.name
            runs.append(
                {
                    "label": f"{row['method']} s{row['seed']}",
                    "method": row["method"],
                    "seed": row["seed"],
                    "telemetry": read_telemetry(rdir),
                    "records": _records(db, row["run_id"]) if row.get("run_id") else None,
                    "budget": row.get("budget_bytes"),
                }
            )
        return runs, dict(result)
    return [_fit_run(root, run_id)], None


def steady_rows(tel: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps with a plan in force: no segment probed, not derivative-checked (a checked
    step keeps graphs the plan replays). All rows when there are none such.

    Example:
        >>> rows = [{"step": 1, "plan_version": 0, "plan": {"b": "probe"}},
        ...         {"step": 2, "plan_version": 1, "plan": {"b": "whole"}, "checked": True},
        ...         {"step": 3, "plan_version": 1, "plan": {"b": "whole"}}]
        >>> [r["step"] for r in steady_rows(rows)]
        [3]
    """
    steady = [
        t
        for t in tel
        if (t.get("plan_version") or 0) >= 1
        and not t.get("checked")
        and "probe" not in (t.get("plan") or {}).values()
        and t.get("phase", "encoder") == "encoder"
    ]
    return steady or tel


# ------------------------------------------------------------------------------ plots
def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _first_seed(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    seeds = [r["seed"] for r in runs if r.get("seed") is not None]
    if not seeds:
        return runs, ""
    return [r for r in runs if r["seed"] == seeds[0]], f" (seed {seeds[0]})"


def _line_and_marks(ax: Any, tel: list[dict[str, Any]], key: str, label: str, **kw: Any) -> Any:
    """Unchecked steps as a line; checked steps (reference graph and replay side by side) as
    crosses in the same colour."""
    pts = [(t["step"], t[key] / 2**20) for t in tel if t.get(key) and not t.get("checked")]
    marks = [(t["step"], t[key] / 2**20) for t in tel if t.get(key) and t.get("checked")]
    if not pts and not marks:
        return None
    (line,) = ax.plot(*zip(*(pts or marks)), label=label, lw=1, **kw)
    if marks:
        ax.plot(*zip(*marks), "x", color=line.get_color(), ms=4)
    return line


def _plot_memory(runs: list[dict[str, Any]], path: Path) -> str:
    runs, which = _first_seed(runs)
    replay = [r for r in runs if any(t.get("accounted_peak_bytes") for t in r["telemetry"])]
    # a run with ReplayCallback alone measures the accounted peak only: one panel, not the
    # same line twice
    live = any(t.get("memory") in ("live", "cuda") for r in runs for t in r["telemetry"])
    ncols = (1 + bool(replay)) if live or not replay else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 4.4), squeeze=False)
    if live or not replay:
        ax = axes[0][0]
        for r in runs:
            _line_and_marks(ax, r["telemetry"], "peak_bytes", r["label"], marker=".", ms=3)
        ax.set(title=f"peak live tensor memory per step{which}", xlabel="step", ylabel="MiB")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    if replay:
        _plot_memory_terms(axes[0][-1], replay, which)
    return _save(fig, path)


def _plot_memory_terms(ax: Any, replay: list[dict[str, Any]], which: str) -> None:
    """The replay runs' memory, one line per term with its name in the legend: the real peak
    (steps the engine measured), the plan's predicted peak, retaining every segment
    (predicted alike) and the budget; the accountant's own figure only where no real peak was
    measured (older telemetry). The y axis always reaches the budget."""
    many = len(replay) > 1
    top = 0.0
    for r in replay:
        tel = r["telemetry"]
        prefix = f"{r['label']}: " if many else ""
        real = sorted(
            {
                (t["real_peak_step"], t["real_peak_bytes"] / 2**20)
                for t in tel
                if t.get("real_peak_bytes") and t.get("real_peak_step") is not None
            }
        )
        if real:
            (line,) = ax.plot(*zip(*real), "o-", ms=4, lw=1, label=f"{prefix}real peak (measured)")
        else:
            line = _line_and_marks(
                ax, tel, "accounted_peak_bytes", f"{prefix}accounted peak (engine's figures)"
            )
        colour = line.get_color() if line is not None else None
        for key, style, width, name in (
            ("retain_all_peak_bytes", "-.", 1.0, "retaining every segment (predicted)"),
            ("predicted_peak_bytes", ":", 2.0, "predicted peak (plan)"),  # on top when equal
        ):
            pts = [(t["step"], t[key] / 2**20) for t in tel if t.get(key)]
            if pts:
                ax.plot(*zip(*pts), ls=style, lw=width, color=colour, label=f"{prefix}{name}")
                top = max(top, max(v for _, v in pts))
        if real:
            top = max(top, max(v for _, v in real))
        budgets = sorted({t.get("budget") or t.get("plan_budget") for t in tel} - {None})
        for b in budgets:
            lowest = not any(t.get("budget") for t in tel)
            ax.axhline(
                b / 2**20,
                color="black",
                ls="--",
                lw=1,
                label=f"{prefix}budget {format_bytes(b)}"
                + (" (lowest-memory plan)" if lowest else ""),
            )
            top = max(top, b / 2**20)
    if top:
        ax.set_ylim(0, top * 1.12)
    ax.set(title=f"memory of the replay runs{which}", xlabel="step", ylabel="MiB")
    if top and top < 1:  # under a MiB: KiB reads better than 0.09 MiB
        kib = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1024)
        step = next(k for k in kib if k >= top * 1024 / 6)
        ax.yaxis.set_major_locator(matplotlib.ticker.MultipleLocator(step / 1024))
        ax.yaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v * 1024:.0f}")
        )
        ax.set_ylabel("KiB")
    else:
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")


def _timed(tel: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Rows whose step time is comparable: steps without live memory tracking (its dispatch
    mode slows a step), unless every step was tracked. Returns the rows and whether tracked
    steps had to be used."""
    untracked = [t for t in tel if not t.get("memory_tracked")]
    return (untracked, False) if untracked else (tel, bool(tel))


def _plot_time(
    runs: list[dict[str, Any]], path: Path, medians: Mapping[str, float] | None = None
) -> str:
    """Step time per step, and the median per run: the study table's median (steady
    contrastive steps) when ``medians`` gives it, else the median of the steady steps."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    meds = []
    shown, which = _first_seed(runs)
    tracked_only = False
    for r in runs:
        rows, tracked = _timed(r["telemetry"])
        tracked_only |= tracked
        pts = [(t["step"], t["step_time_ms"]) for t in rows if t.get("step_time_ms")]
        if not pts:
            continue
        if r in shown:
            a.plot(*zip(*pts), label=r["label"], lw=0.8)
        if medians is not None and r["label"] in medians:
            meds.append((r["label"], medians[r["label"]]))
        else:
            steady = [
                t["step_time_ms"]
                for t in _timed(steady_rows(r["telemetry"]))[0]
                if t.get("step_time_ms")
            ]
            if steady:
                vals = sorted(steady)
                meds.append((r["label"], vals[len(vals) // 2]))
    note = (
        "every step (all were memory-tracked, which slows them)"
        if tracked_only
        else "steps with live memory tracking left out"
    )
    a.set(title=f"step time per step{which}: {note}", xlabel="step", ylabel="ms", yscale="log")
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=7, ncol=2)
    if meds:
        b.barh([m[0] for m in meds], [m[1] for m in meds], color="#4c72b0")
        b.invert_yaxis()
        b.tick_params(axis="y", labelsize=7)
    b.set(
        title="\n".join(
            textwrap.wrap(
                "median step time over the steady steps (plan in force, unchecked; as in the table)"
                if medians is not None
                else "median step time over the steady steps (plan in force, unchecked)",
                50,
            )
        ),
        xlabel="ms",
    )
    b.title.set_fontsize(9)
    return _save(fig, path)


def _plot_plans(runs: list[dict[str, Any]], path: Path) -> str | None:
    runs, which = _first_seed(runs)
    planned = [r for r in runs if any(t.get("plan") for t in r["telemetry"])]
    if not planned:
        return None
    nsegs = [len(next(t["plan"] for t in r["telemetry"] if t.get("plan"))) for r in planned]
    fig, axes = plt.subplots(
        len(planned), 1, figsize=(12, 0.8 + sum(0.6 + 0.3 * n for n in nsegs)), squeeze=False
    )
    options = list(_OPTION_COLOURS)
    for ax, r in zip(axes[:, 0], planned):
        # the probe epochs run the frozen encoder without replay: the contrastive steps only
        tel = [
            t for t in r["telemetry"] if t.get("plan") and t.get("phase", "encoder") == "encoder"
        ] or [t for t in r["telemetry"] if t.get("plan")]
        segs = list(tel[0]["plan"])
        for t in tel:
            for i, s in enumerate(segs):
                opt = t["plan"].get(s, "probe")
                ax.broken_barh(
                    [(t["step"] - 0.5, 1)],
                    (i - 0.4, 0.8),
                    facecolors=_OPTION_COLOURS.get(opt, "#000000"),
                )
        versions = [(t["step"], t.get("plan_version")) for t in tel]
        for (s0, v0), (s1, v1) in zip(versions, versions[1:]):
            if v1 != v0:
                ax.axvline(s1 - 0.5, color="black", lw=0.8, ls="--")
        ax.set_yticks(
            range(len(segs)), [s.replace("encoder_q.backbone.", "") for s in segs], fontsize=7
        )
        ax.set_title(
            f"{r['label']}: option per segment (dashed: new plan version)", fontsize=9, loc="left"
        )
        ax.set_xlim(tel[0]["step"] - 0.5, tel[-1]["step"] + 0.5)
    axes[-1][0].set_xlabel("step")
    fig.legend(
        handles=[Patch(color=_OPTION_COLOURS[o], label=o) for o in options if o != "probing"],
        loc="upper right",
        fontsize=7,
        ncol=5,
    )
    return _save(fig, path)


def _plot_records(runs: list[dict[str, Any]], path: Path) -> str | None:
    with_records = [r for r in runs if r.get("records") is not None]
    if not with_records:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.2))
    labels = [r["label"] for r in with_records] if len(with_records) > 1 else ["this run"]
    bottom = [0] * len(labels)
    width = 0.8 if len(labels) > 2 else 0.35  # one or two bars: not a wall of colour
    for o in OUTCOMES:
        vals = [sum(1 for x in r["records"] if x.is_check and x.outcome == o) for r in with_records]
        a.bar(labels, vals, width, bottom=bottom, label=o, color=_OUTCOME_COLOURS[o])
        bottom = [x + y for x, y in zip(bottom, vals)]
    _readable_bars(a, len(labels), max(bottom, default=0))
    a.set(title="checks by outcome (contract and plan events left out)", ylabel="records")
    a.tick_params(axis="x", labelrotation=45 if len(labels) > 3 else 0, labelsize=7)
    a.legend(fontsize=7)
    # an event's "match" means "came into force": grey, apart from the checks' outcomes
    kinds = Counter(
        (x.check, "event" if x.is_event and x.outcome == "match" else x.outcome)
        for r in with_records
        for x in r["records"]
    )
    checks = sorted({k for k, _ in kinds})
    bottom = [0] * len(checks)
    for o in ("event", *OUTCOMES):
        vals = [kinds.get((c, o), 0) for c in checks]
        if not any(vals) and o == "event":
            continue
        b.bar(
            checks,
            vals,
            0.8 if len(checks) > 2 else 0.35,
            bottom=bottom,
            color=_OUTCOME_COLOURS.get(o, "#999999"),
            label="event (came into force)" if o == "event" else o,
        )
        bottom = [x + y for x, y in zip(bottom, vals)]
    _readable_bars(b, len(checks), max(bottom, default=0))
    b.set(
        title="records by kind (contract, plan: events; the rest: checks)"
        if len(with_records) == 1
        else "records by kind (all runs)",
        ylabel="records",
    )
    b.legend(fontsize=7)
    return _save(fig, path)


def _readable_bars(ax: Any, n: int, tallest: float) -> None:
    """Whole-number counts; room above the tallest bar for the legend; one or two bars kept
    narrow instead of filling the panel."""
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylim(0, max(tallest, 1) * 1.35)
    if n <= 2:
        ax.set_xlim(-1.5, n + 0.5)


# ------------------------------------------------------------------------------ html
def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("method", "method"),
        ("seed", "seed"),
        ("test top-1", "top1"),
        ("encoder digest", "encoder_digest"),
        ("peak, live tensors", "peak_bytes"),
        ("peak, accounted", "accounted_peak_bytes"),
        ("budget", "budget_bytes"),
        ("median step (steady)", "median_step_ms"),
        ("replays", "replays"),
        ("checks m/r/d", "records"),
        ("vs reference", "vs_reference"),
    ]
    out = ["<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c, _ in cols) + "</tr>"]
    for r in rows:
        cells = []
        for _, k in cols:
            v = r.get(k)
            if k == "top1":
                v = format_top1(v)
            elif k == "encoder_digest":
                v = f"<code>{html.escape(str(v)[:16])}</code>"
                cells.append(f"<td>{v}</td>")
                continue
            elif k in ("peak_bytes", "accounted_peak_bytes", "budget_bytes"):
                v = format_bytes(v) if v is not None else ("" if k == "budget_bytes" else "n/a")
            elif k == "median_step_ms":
                v = f"{v:.1f} ms" if v is not None else "n/a"
            elif k == "records":
                v = "n/a" if v is None else " / ".join(str(v.get(o, 0)) for o in OUTCOMES)
            elif k == "vs_reference" and r.get("reference") == r.get("method"):
                v = "reference"
            cells.append(f"<td>{html.escape('' if v is None else str(v))}</td>")
        cls = "aware" if r.get("kind") == "state-aware" else "unaware"
        out.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


_CSS = """body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}
tr.unaware{background:#fff3f0}tr.aware{background:#f3fff3}img{max-width:100%;margin:1em 0}
code{font-size:12px}.ok{color:#1a7f37;font-weight:bold}.bad{color:#c00;font-weight:bold}"""


def _fit_headline(run: Mapping[str, Any]) -> list[str]:
    """The fit-run summary: steps, the steady peak (not the probe step's) against retaining
    every segment, step time, checks, and the other runs in the directory."""
    tel = run["telemetry"]
    steady = steady_rows(tel)
    peaks = [t["peak_bytes"] for t in steady if t.get("peak_bytes")]
    retain = next(
        (t["retain_all_peak_bytes"] for t in reversed(tel) if t.get("retain_all_peak_bytes")), None
    )
    times = sorted(t["step_time_ms"] for t in _timed(steady)[0] if t.get("step_time_ms"))
    live = any(t.get("memory") in ("live", "cuda") for t in tel)
    out = [
        f"<p>Run <code>{html.escape(str(run.get('run_id')))}</code>: {len(tel)} steps, "
        f"{len(steady)} with the plan in force (the probe, calibration and checked steps "
        "are the others)."
    ]
    # a real peak is the last step measured: count those measured on a steady step
    windows = {t.get("window") for t in steady}
    real = [
        t["real_peak_bytes"]
        for t in steady
        if t.get("real_peak_bytes") and t.get("real_peak_step") in windows
    ]
    predicted = next(
        (t["predicted_peak_bytes"] for t in reversed(tel) if t.get("predicted_peak_bytes")), None
    )
    budget = next((t.get("budget") or t.get("plan_budget") for t in reversed(tel)), None)
    if real:
        out.append(
            f" Real peak over those steps {format_bytes(max(real))}"
            + (f" (budget {format_bytes(budget)})" if budget else "")
            + "."
        )
    elif peaks:
        what = "live tensors" if live else "the engine's accounting, not the process's"
        out.append(f" Peak memory over those steps {format_bytes(max(peaks))} ({what}).")
    if predicted and retain:
        saved = retain - predicted
        out.append(
            f" Predicted peak {format_bytes(predicted)} vs {format_bytes(retain)} retaining "
            f"every segment (predicted): {format_bytes(abs(saved))} "
            f"({abs(saved) / retain:.0%}) {'saved' if saved >= 0 else 'more'}."
        )
    if times:
        out.append(f" Median step time {times[len(times) // 2]:.1f} ms.")
    recs = run.get("records")
    if recs is not None:
        checks = [r for r in recs if r.is_check]
        n = Counter(r.outcome for r in checks)
        out.append(
            f" Checks on {len({r.step for r in checks if r.check in ('grad', 'bytes')})}"
            f" steps: {n['match']} matched, {n['divergence']} diverged, "
            f"{n['rejection']} rejections."
        )
    parts = ["".join(out) + "</p>"]
    others = [r for r in run.get("runs", []) if r != run.get("run_id")]
    if others:
        parts.append(
            f"<p>This directory holds {len(others)} other run(s): "
            f"{', '.join(f'<code>{html.escape(r)}</code>' for r in others)}. Show one "
            "with <code>lightning-replay report DIR --run RUN_ID</code>.</p>"
        )
    return parts


def _methods(study: Mapping[str, Any]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in study["rows"]))
    return (
        "<h2>Methods</h2><dl>"
        + "".join(
            f"<dt><code>{html.escape(m)}</code></dt><dd>{html.escape(METHOD_DESCRIPTIONS.get(m, ''))}"
            "</dd>"
            for m in methods
        )
        + "</dl>"
    )


def write_report(
    run_dir: str | os.PathLike, result: Mapping[str, Any] | None = None, run_id: str | None = None
) -> Path:
    """Write ``report.html`` and ``plots/*.png`` into ``run_dir``; return the HTML's path.

    Args:
        run_dir: a study's ``output_dir`` or a fit run's ``default_root_dir``.
        result: the study result (read from ``results.json`` when omitted).
        run_id: the fit run to show when several appended to ``run_dir`` (default: latest).

    Raises:
        ReportError: ``run_dir`` holds no study results and no run telemetry, or not
            ``run_id``.
    """
    root = Path(run_dir)
    runs, study = load_runs(root, result, run_id=run_id)
    plots = root / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    medians = (
        {
            f"{r['method']} s{r['seed']}": r["median_step_ms"]
            for r in study["rows"]
            if r.get("median_step_ms") is not None
        }
        if study is not None
        else None
    )
    images = [
        ("Memory per step", _plot_memory(runs, plots / "memory.png")),
        ("Step time", _plot_time(runs, plots / "step_time.png", medians)),
        ("Plan per segment over time", _plot_plans(runs, plots / "plans.png")),
        ("Record outcomes", _plot_records(runs, plots / "records.png")),
    ]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>lightning_replay "
        f"report: {html.escape(root.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>lightning_replay report: {html.escape(root.name)}</h1>",
    ]
    if study is not None:
        ok = study.get("identical")
        parts.append(
            f"<p>Data: {html.escape(str(study.get('data', '')))}. "
            f"Wall time {study.get('wall_s', 0):.0f} s.</p>"
        )
        parts.append(
            f"<p class='{'ok' if ok else 'bad'}'>State-aware methods byte-identical "
            f"within every seed: {'yes' if ok else 'NO'}</p>"
        )
        parts.append(_table(study["rows"]))
        parts.append(
            "<p>Peak, live tensors: the largest bytes of live tensors in a steady "
            "step (on CPU, sampled steps tracked by a dispatch mode; the CUDA "
            "allocator on GPU); it also counts what the engine does not plan "
            "(optimizer state, the batch, temporaries), so it can sit above the "
            "budget. Peak, accounted: the engine's exact accounting of what the "
            "planner costs (parameters, gradients, saved activations, snapshots): "
            "the quantity the budget bounds. Median step: the steady contrastive "
            "steps (plan in force, unchecked, not memory-tracked); the bars below "
            "show the same figure. Checks m/r/d: matched / rejected / diverged "
            "checks (contract and plan events are not counted).</p>"
        )
        parts.append("<ul>")
        for seed, s in study["seeds"].items():
            verdict = (
                "byte-identical test top-1 and encoder weights"
                if s["state_aware_identical"]
                else f"NOT identical: {', '.join(s['not_identical'])}"
            )
            parts.append(
                f"<li>seed {html.escape(str(seed))}: {', '.join(s['state_aware'])}: {verdict}</li>"
            )
            for m, how in s["state_unaware"].items():
                parts.append(
                    f"<li>seed {html.escape(str(seed))}: {html.escape(m)}: "
                    f"{html.escape(str(how))}</li>"
                )
        b = study.get("budget") or {}
        if b.get("bytes"):
            mf = b["min_feasible"]
            parts.append(
                f"<li>budget of eager_whole and joint: {format_bytes(b['bytes'])} "
                f"(minimum feasible: joint {format_bytes(mf['joint'])}, eager_whole "
                f"{format_bytes(mf['eager_whole'])}, retain all "
                f"{format_bytes(mf['retain_all'])})</li>"
            )
        parts.append("</ul>")
        parts.append(_methods(study))
    else:
        parts.extend(_fit_headline(runs[0]))
    for title, name in images:
        if name is None:
            continue
        # embedded, so the page shows its plots wherever it is opened or sent; the PNG files
        # stay in plots/ beside it
        data = base64.b64encode((plots / name).read_bytes()).decode("ascii")
        parts.append(
            f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{data}' "
            f"data-file='plots/{name}' alt='{html.escape(title)}'>"
        )
    parts.append("</body></html>")
    out = root / "report.html"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
