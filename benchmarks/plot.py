"""Plot the sparse-write map of a benchmark JSON from benchmarks/run.py as heatmaps.

Top row: ``joint`` / ``eager_whole`` measured step time (median of per-round ratios), one panel
per budget position, state size / activation bytes down, rows written / state across. Below 1
(blue) selective preservation pays off; 1 means both chose the same plan (whole snapshots are as
good as it gets there); a framed value is <= 0.82, the published point; grey cells are those
``eager_whole`` cannot meet at all (``joint``'s ratio to the best feasible baseline is written
instead, in italics). Bottom row: ``joint`` / the best feasible baseline (the optimality check:
above 1.02 the measured costs misled the planner).

    python benchmarks/plot.py benchmarks/results/quick-latest.json benchmarks/results/quick-latest.png
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402


def _frac(x: float) -> str:
    return str(Fraction(x).limit_denominator(4096))


def plot(result: dict, out: str) -> None:
    m = result["sparse_write_map"]
    states, writes, positions = (
        m["grid"][k] for k in ("state_ratio", "write_fraction", "budget_position")
    )
    cells = {(c["state_ratio"], c["write_fraction"], c["budget_position"]): c for c in m["cells"]}
    norm = TwoSlopeNorm(vmin=0.6, vcenter=1.0, vmax=1.2)
    fig, axes = plt.subplots(
        2, len(positions), figsize=(2.6 * len(positions) + 1.5, 6.4), squeeze=False
    )
    rows = (
        ("joint_vs_eager_whole", "joint / eager_whole"),
        ("joint_vs_best_baseline", "joint / best feasible baseline"),
    )
    for r, (key, title) in enumerate(rows):
        for j, pos in enumerate(positions):
            ax = axes[r][j]
            grid = np.full((len(states), len(writes)), np.nan)
            for a, s in enumerate(states):
                for b, w in enumerate(writes):
                    c = cells.get((s, w, pos))
                    if c is None:
                        continue
                    v = c[key]
                    if v is not None:
                        grid[a, b] = v
                    if key == "joint_vs_eager_whole" and v is None:
                        ax.add_patch(Rectangle((b - 0.5, a - 0.5), 1, 1, color="0.8"))
                        alt = c["joint_vs_best_baseline"]
                        text = (
                            f"EW ✗\n{alt:.2f}"
                            if alt is not None
                            else "EW ✗"
                            if c["methods"]["joint"]["feasible"]
                            else "all ✗"
                        )
                        ax.text(b, a, text, ha="center", va="center", fontsize=7, style="italic")
                    elif v is None:
                        ax.text(
                            b,
                            a,
                            "joint only" if c["methods"]["joint"]["feasible"] else "all ✗",
                            ha="center",
                            va="center",
                            fontsize=7,
                            style="italic",
                        )
                    else:
                        ax.text(
                            b,
                            a,
                            f"{v:.2f}",
                            ha="center",
                            va="center",
                            fontsize=8,
                            weight="bold" if v <= 0.82 or v > 1.02 else "normal",
                        )
                        if key == "joint_vs_eager_whole" and v <= 0.82:
                            ax.add_patch(
                                Rectangle(
                                    (b - 0.45, a - 0.45), 0.9, 0.9, fill=False, lw=1.5, ec="k"
                                )
                            )
            im = ax.imshow(grid, cmap="RdBu_r", norm=norm, origin="lower", aspect="auto")
            ax.set_xticks(range(len(writes)), [_frac(w) for w in writes], fontsize=8)
            ax.set_yticks(range(len(states)), [_frac(s) for s in states], fontsize=8)
            ax.set_title(f"{title}\nbudget position {pos}", fontsize=8)
            if j == 0:
                ax.set_ylabel("state / activation bytes")
            if r == 1:
                ax.set_xlabel("rows written / state")
    fig.subplots_adjust(hspace=0.45)
    fig.colorbar(im, ax=axes, shrink=0.8, label="measured step-time ratio (paired)")
    fig.suptitle(
        f"sparse-write map ({len(m['cells'])} cells) — {result['device']}, "
        f"{result['date']}, 1-min load average at start "
        f"{result.get('load_average', {}).get('start', float('nan')):.1f}",
        fontsize=9,
    )
    fig.savefig(out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
