"""The seven-method comparison on the dense-queue application.

Every method trains the same :class:`~lightning_replay.apps.dense_queue.DenseQueueModule` on the
same segments, data and seed, then scores the linear probe on the test split:

========================  ====================================================================
``none``                  no recomputation (the reference; exact by definition)
``torch_checkpoint``      ``torch.utils.checkpoint`` on the segments (state-unaware)
``torch_sac``             torch's selective activation checkpointing, saving matmuls
                          (state-unaware)
``whole``                 ``strategy="replay"``, every segment preserves changing state whole
                          (planner ``whole_all``)
``regions``               ``strategy="replay"``, every segment preserves only the overwritten
                          regions where it can (planner ``fixed_regions``)
``eager_whole``           ``strategy="replay"`` under a budget, greedy over retain/whole
``joint``                 ``strategy="replay"`` under the same budget, the optimal planner
========================  ====================================================================

The budget of ``eager_whole`` and ``joint`` comes from measured costs: a short run under
``strategy="replay"`` measures every segment's options (bytes exactly, time as medians), then
``budget = lo + budget_fraction * (hi - lo)`` with ``lo`` the larger of the two methods'
minimum feasible budgets and ``hi`` the minimum feasible budget of retaining everything — a
budget both methods can meet and that still forces recomputation.

The state-aware methods (``none``, ``whole``, ``regions``, ``eager_whole``, ``joint``) must
give byte-identical test scores and encoder weights within each seed; the result table says
whether they did, and how the state-unaware ones diverged (test top-1 difference, which
encoder tensors differ and by how much, batch-norm counters advanced by replays).

Outputs under ``output_dir``: ``results.md``, ``results.csv``, ``results.json``,
``report.html`` (with ``plots/``), ``records.sqlite`` (every run's records, by run id),
``wandb/`` (one run per method and seed; offline unless configured), and ``runs/<method>-seed<k>/``
(per-step ``telemetry.jsonl`` and the run's effective configuration).

The study is split by job: :mod:`~lightning_replay.apps.study_config` (methods, settings,
loading a config), :mod:`~lightning_replay.apps.study_run` (one run, the cost measurement),
:mod:`~lightning_replay.apps.study_compare` (runs against their reference, verdicts) and
:mod:`~lightning_replay.apps.study_output` (the result files); this module runs it and
re-exports their public names.

Example:
    >>> cfg = load_study_config(DEMO_CONFIG)
    >>> StudySettings.from_config(cfg).methods
    ['none', 'torch_checkpoint', 'torch_sac', 'whole', 'regions', 'eager_whole', 'joint']
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from lightning_replay.apps.study_compare import (
    StudyResult,
    add_steady_figures,
    compare_to_reference,
    describe_divergence,
    module_state,
    seed_summaries,
    steady_cutoff,
)
from lightning_replay.apps.study_config import (
    DEMO_CONFIG,
    METHOD_DESCRIPTIONS,
    METHODS,
    REPLAY_METHODS,
    STATE_AWARE,
    STATE_UNAWARE,
    StudySettings,
    load_study_config,
)
from lightning_replay.apps.study_output import (
    clean_outputs,
    format_markdown,
    format_top1,
    write_results,
)
from lightning_replay.apps.study_run import (
    finish_wandb,
    fit_run,
    measure_budget,
    own_env,
    quiet_lightning,
    result_row,
    test_run,
)
from lightning_replay.core.base.budget import format_bytes

__all__ = [
    "METHODS",
    "STATE_AWARE",
    "STATE_UNAWARE",
    "METHOD_DESCRIPTIONS",
    "DEMO_CONFIG",
    "StudySettings",
    "StudyResult",
    "load_study_config",
    "run_study",
    "measure_budget",
    "describe_divergence",
    "format_markdown",
    "format_top1",
]


def run_study(
    config: str | os.PathLike | Mapping[str, Any],
    *,
    progress: bool = True,
    quiet: bool = True,
    echo: Callable[[str], None] | None = None,
) -> StudyResult:
    """Run the comparison a study config describes and write its results.

    Args:
        config: a study config (see :func:`load_study_config`).
        progress: show a progress bar over the runs (on stderr).
        quiet: silence Lightning's per-trainer banners during the runs.
        echo: called with a line of text after each run (e.g. ``print``).

    Returns:
        The :class:`StudyResult`; its files are under ``settings.output_dir``.

    Raises:
        FileExistsError: ``output_dir`` holds an earlier study and ``overwrite`` is false.
    """
    from tqdm.auto import tqdm

    base = load_study_config(config)
    settings = StudySettings.from_config(base)
    out = Path(settings.output_dir)
    if (out / "results.json").exists() and not settings.overwrite:
        raise FileExistsError(
            f"{out} holds an earlier study (results.json); set "
            "study.overwrite: true or choose another study.output_dir"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / "study_config.yaml").exists():
        # never clean a directory the study did not make
        raise FileExistsError(
            f"study.output_dir={str(out)!r} is a non-empty directory that "
            "holds no study; choose a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    clean_outputs(out)  # an earlier (or interrupted) study here
    (out / "study_config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    records = out / "records.sqlite"
    wandb_mode = settings.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
    if wandb_mode == "dryrun":
        wandb_mode = "offline"
    group = f"study-{time.strftime('%Y%m%d-%H%M%S')}"
    budgeted = [m for m in settings.methods if m in REPLAY_METHODS and REPLAY_METHODS[m].budgeted]
    total = len(settings.methods) * len(settings.seeds) + (1 if budgeted else 0)
    t_start = time.perf_counter()
    bar = tqdm(
        total=total,
        desc="study",
        unit="run",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    budget: dict[str, Any] = {"bytes": None}
    raw: list[dict[str, Any]] = []
    telemetry: dict[tuple[str, int], list[dict[str, Any]]] = {}
    refs: dict[int, dict[str, Any]] = {}
    data_desc = ""
    try:
        with quiet_lightning(quiet):
            if budgeted:
                bar.set_postfix_str("measuring costs")
                budget = measure_budget(base, settings, out, settings.seeds[0])
                bar.update(1)
                if echo:
                    echo(
                        f"budget for eager_whole/joint: {format_bytes(budget['bytes'])} "
                        f"(min feasible: joint {format_bytes(budget['min_feasible']['joint'])}"
                        f", eager_whole {format_bytes(budget['min_feasible']['eager_whole'])}"
                        f", retain all {format_bytes(budget['min_feasible']['retain_all'])})"
                    )
            for seed in settings.seeds:
                for method in settings.methods:
                    bar.set_postfix_str(f"{method} seed {seed}")
                    run_dir = out / "runs" / f"{method}-seed{seed}"
                    with own_env():
                        run = fit_run(
                            base,
                            settings,
                            method,
                            seed,
                            run_dir,
                            records,
                            budget["bytes"],
                            wandb_mode,
                            group,
                        )
                        result = test_run(run, base)
                    data_desc = getattr(run.datamodule, "description", "") or data_desc
                    row = result_row(run, result, records, budget["bytes"])
                    state = module_state(run.model.encoder_q)
                    # the seed's first state-aware run is the reference of the others
                    if seed not in refs and method in STATE_AWARE:
                        refs[seed] = {"method": method, "state": state, "top1": row["top1"]}
                    if seed in refs:
                        compare_to_reference(row, state, refs[seed])
                    finish_wandb(run, row)
                    telemetry[(method, seed)] = list(run.telemetry.rows)
                    raw.append(row)
                    bar.update(1)
                    if echo:
                        echo(
                            f"{method:>16} seed {seed}: top-1 {format_top1(row['top1'])}  "
                            f"encoder {row['encoder_digest'][:12]}  "
                            f"{row.get('vs_reference', '')}  ({row['wall_s']:.1f} s)"
                        )
                    del run
    finally:
        bar.close()
    cutoff = steady_cutoff([t for (m, _), t in telemetry.items() if m in REPLAY_METHODS])
    for row in raw:
        add_steady_figures(row, telemetry[(row["method"], row["seed"])], cutoff)
    seeds = seed_summaries(raw, settings)
    result = StudyResult(
        settings,
        raw,
        seeds,
        {**budget, "steady_from_step": cutoff},
        out,
        time.perf_counter() - t_start,
        data_desc,
    )
    write_results(result)
    return result
