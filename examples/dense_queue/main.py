"""Train the dense-queue (MoCo-style) application once, the way the study does, and compare.

    python examples/dense_queue/main.py                       # replay (joint) vs no recomputation
    python examples/dense_queue/main.py --method torch_checkpoint --epochs 2
    python examples/dense_queue/main.py --method regions --data-dir /path/with/cifar-100-python

Trains `DenseQueueModule` (CIFAR ResNet, momentum key encoder, a dense queue of keys enqueued
every step, InfoNCE, then a linear probe) with the chosen method and with no recomputation,
same seed, and prints both test top-1 scores and encoder digests: identical for the state-aware
methods (whole, regions, eager_whole, joint), different for torch_checkpoint and torch_sac.
For the full seven-method comparison use `python -m lightning_replay.demos.demo` or
`lightning-replay study --config configs/dense_queue_cpu.yaml`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from lightning_replay.apps.study import (
    DEMO_CONFIG,
    METHODS,
    format_markdown,
    load_study_config,
    run_study,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--method", choices=[m for m in METHODS if m != "none"], default="joint")
    ap.add_argument("--epochs", type=int, default=2, help="contrastive epochs (default 2)")
    ap.add_argument("--probe-epochs", type=int, default=1, help="linear-probe epochs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=16, help="ResNet width (default 16)")
    ap.add_argument(
        "--data-dir",
        default="runs/data",
        help="holds cifar-100-python/ (real or synthetic; synthetic is written if absent)",
    )
    ap.add_argument("--output-dir", default=None, help="default: a temporary directory")
    args = ap.parse_args(argv)

    cfg = load_study_config(DEMO_CONFIG)
    cfg["model"]["init_args"].update(encoder_epochs=args.epochs, width=args.width)
    cfg["trainer"]["max_epochs"] = args.epochs + args.probe_epochs
    cfg["data"]["init_args"]["data_dir"] = args.data_dir
    out = args.output_dir or tempfile.mkdtemp(prefix="dense_queue_")
    cfg["study"].update(
        methods=["none", args.method],
        seeds=[args.seed],
        output_dir=out,
        wandb_mode=os.environ.get("WANDB_MODE", "disabled"),
    )
    result = run_study(cfg)
    print(format_markdown(result))
    print(f"outputs: {out}")
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
