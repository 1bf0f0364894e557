"""Plot a benchmark JSON from benchmarks/run.py: step time and measured peak per method.

Filled markers: median measured step time, with a bar from the 25th to the 75th percentile of
the rounds; hollow markers: the step time the measured costs predict for the same plan.

    python benchmarks/plot.py benchmarks/results/quick-latest.json benchmarks/results/quick-latest.png
"""
from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ("joint", "eager_whole", "fixed_regions", "retain_all", "whole_all")


def plot(result: dict, out: str) -> None:
    sw = result["sparse_write"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, level in zip(axes, ("roomy", "tight")):
        data = sw[level]["methods"]
        budget = sw[level]["budget_bytes"] / 2**20
        for i, m in enumerate(METHODS):
            d = data.get(m, {})
            if not d.get("feasible"):
                ax.scatter([], [], label=f"{m} (infeasible)", marker="x")
                continue
            x, y = d["peak_bytes"] / 2**20, d["step_time_s"] * 1e3
            color = f"C{i}"
            times = d.get("step_times_s")
            if times and len(times) >= 4:
                q1, _, q3 = statistics.quantiles([t * 1e3 for t in times], n=4)
                ax.errorbar(x, y, yerr=[[y - q1], [q3 - y]], color=color, capsize=3, lw=1)
            ax.scatter(x, y, s=60, label=m, color=color)
            if "predicted_step_time_s" in d:
                ax.scatter(x, d["predicted_step_time_s"] * 1e3, s=60, facecolors="none",
                           edgecolors=color)
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.axvline(budget, color="red", linestyle="--", label="budget")
        ax.set_title(f"sparse-write, {level} budget ({budget:.0f} MiB)")
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("step time (ms): median, IQR; hollow = predicted")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['device']} — {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
