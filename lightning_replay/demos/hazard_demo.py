"""The hazard demo: what torch.utils.checkpoint does to each hazard, and what lightning_replay does.

Run with ``python -m lightning_replay.demos.hazard_demo``. For every model in
:data:`lightning_replay.demos.hazards.HAZARDS` it trains three copies for a few SGD steps — without
recomputation (the reference), with plain ``torch.utils.checkpoint`` on the same segments, and
with :func:`lightning_replay.install` — and compares gradients and final state bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS
from lightning_replay.tools.verify import (
    diff_state,
    grad_diffs,
    max_relative_error,
    snapshot_state,
    torch_checkpoint,
    train_steps,
)


def run_hazard(name: str, steps: int = 5, preservation: str = "auto") -> dict:
    """Compare reference, torch.utils.checkpoint and lightning_replay on one hazard."""
    h = HAZARDS[name]()
    ref = copy.deepcopy(h.model)
    g_ref, _ = train_steps(ref, h.make_input, steps)
    ref_state = snapshot_state(ref)

    naive = torch_checkpoint(copy.deepcopy(h.model), h.segments)
    try:
        g_naive, _ = train_steps(naive, h.make_input, steps)
        wrong = grad_diffs(g_ref, g_naive)
        state = diff_state(ref_state, snapshot_state(naive))
        if not wrong and not state:
            naive_says = "exact"
        else:
            n_total = sum(len(g) for g in g_ref)
            parts = []
            if wrong:
                parts.append(
                    f"{100 * len(wrong) / n_total:.0f}% grads wrong "
                    f"(max rel err {max_relative_error(g_ref, g_naive):.2g})"
                )
            if state:
                parts.append(
                    f"state differs: {', '.join(state[:2])}" + (" ..." if len(state) > 2 else "")
                )
            naive_says = "; ".join(parts)
    except RuntimeError as exc:
        naive_says = "raises: " + str(exc).split("\n")[0][:60]

    model = copy.deepcopy(h.model)
    engine = lr.install(model, h.segments, preservation=preservation)
    g_rep, _ = train_steps(model, h.make_input, steps)
    exact = not grad_diffs(g_ref, g_rep) and not diff_state(ref_state, snapshot_state(model))
    summary = engine.summary()
    engine.uninstall()
    options = sorted({s["mode"] for s in summary.values()})
    preserved = sum(s["preserved_bytes"] for s in summary.values())
    return {
        "hazard": name,
        "description": h.description,
        "torch_checkpoint": naive_says,
        "replay_exact": exact,
        "options": options,
        "preserved_bytes": preserved,
        "replays": sum(s["replays"] for s in summary.values()),
    }


def format_table(rows: list[dict]) -> str:
    head = ("hazard", "torch.utils.checkpoint", "lightning_replay")
    body = [
        (
            r["hazard"],
            r["torch_checkpoint"],
            f"{'exact' if r['replay_exact'] else 'NOT EXACT'} ({'/'.join(r['options'])}, "
            f"{r['preserved_bytes']} B preserved, {r['replays']} replays)",
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(3)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lightning_replay.demos.hazard_demo", description=__doc__
    )
    ap.add_argument("--steps", type=int, default=5, help="SGD steps per model (default 5)")
    ap.add_argument("--preservation", default="auto", choices=["auto", "whole", "regions"])
    ap.add_argument(
        "--hazard",
        action="append",
        choices=sorted(HAZARDS),
        help="only these hazards (repeatable); default: all",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = [run_hazard(n, args.steps, args.preservation) for n in (args.hazard or HAZARDS)]
    print(
        f"{args.steps} SGD steps per model, CPU, torch {torch.__version__}; "
        f"preservation={args.preservation!r}\n"
    )
    print(format_table(rows))
    bad = [r["hazard"] for r in rows if not r["replay_exact"]]
    if bad:
        print(f"\nNOT EXACT: {bad}")
        return 1
    print("\nlightning_replay: every hazard bit-identical to training without recomputation.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
