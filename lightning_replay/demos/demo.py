"""``make demo``: the dense-queue study, all seven methods, two seeds, small sizes, on CPU.

A MoCo-style contrastive run (CIFAR-sized ResNet, momentum key encoder, a dense queue enqueued
every step, InfoNCE, then a linear probe) trained seven ways on the same segments: without
recomputation, with ``torch.utils.checkpoint``, with torch's selective activation
checkpointing, and with lightning_replay (``whole``, ``regions``, and the ``eager_whole`` and
``joint`` planners under a budget from measured costs). It prints the result table and where
the report, the records and the offline wandb runs are. The state-aware methods must give
byte-identical test top-1 and encoder weights within each seed; the exit status is 1 if not.

Data: the real CIFAR-100 if ``--data-dir`` holds it, else a synthetic CIFAR-100 written there
in CIFAR-100's own format (nothing is downloaded). The hazard table of earlier versions is
``python -m lightning_replay.demos.hazard_demo``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lightning_replay.apps.study import (
    DEMO_CONFIG,
    METHODS,
    format_markdown,
    load_study_config,
    run_study,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lightning_replay.demos.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--output-dir",
        default=None,
        help="where results, report, records and wandb runs go (default: runs/dense_queue_study)",
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        help="torchvision root holding cifar-100-python/ (default: runs/data; a "
        "synthetic copy is written there if it holds none)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: 0 1)")
    ap.add_argument(
        "--methods", nargs="+", choices=METHODS, default=None, help="methods (default: all seven)"
    )
    ap.add_argument(
        "--wandb-mode",
        choices=["offline", "online", "disabled"],
        default=None,
        help="wandb mode of the runs (default: $WANDB_MODE, else offline)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    cfg = load_study_config(DEMO_CONFIG)
    study = cfg["study"]
    if args.output_dir:
        study["output_dir"] = args.output_dir
    if args.data_dir:
        cfg["data"]["init_args"]["data_dir"] = args.data_dir
    if args.seeds:
        study["seeds"] = args.seeds
    if args.methods:
        study["methods"] = args.methods
    if args.wandb_mode:
        study["wandb_mode"] = args.wandb_mode
    os.environ.setdefault("WANDB_SILENT", "true")
    t0 = time.perf_counter()
    print(
        f"dense-queue study: {len(study['methods'])} methods x {len(study['seeds'])} seeds, "
        f"CPU, small sizes; outputs in {study['output_dir']}",
        flush=True,
    )
    result = run_study(cfg, progress=not args.no_progress)
    print()
    print(f"data: {result.data}")
    print(format_markdown(result))
    p = result.paths
    print(f"results:  {p['results_md']}  (also .csv, .json)")
    if "report" in p:
        print(f"report:   {p['report']}")
    print(f"records:  {p['records']}  (query: lightning-replay records {result.output_dir})")
    wandb_dirs = sorted(
        {os.path.dirname(r["wandb_dir"]) for r in result.rows if r.get("wandb_dir")}
    )
    if wandb_dirs:
        print(f"wandb:    {', '.join(wandb_dirs)}  (offline runs: `wandb sync <run dir>`)")
    else:
        print("wandb:    disabled")
    print(f"time:     {time.perf_counter() - t0:.0f} s")
    if not result.identical:
        print("\nFAILED: the state-aware methods are not byte-identical within a seed.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
