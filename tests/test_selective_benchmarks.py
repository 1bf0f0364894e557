"""benchmarks/gpu_suite.py's selective arms and sweep (issue 30), smoke-tested on CPU.

The figures of a smoke run only show that the script works (tiny sizes, a CPU stand-in for
the allocator); a device session measures them.
"""

from __future__ import annotations

import json
import os

from tests.test_benchmarks import BENCH, _run_without_wandb


def test_gpu_suite_smoke_runs_the_selective_arms_and_sweep(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run_without_wandb(
        os.path.join(BENCH, "gpu_suite.py"),
        "--smoke",
        "--models",
        "llama",
        "--arms",
        "plain,torch_checkpoint",
        "--selective",
        "llama",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert not r["failures"] and not r["skipped"], (r["failures"], r["skipped"])
    res = r["models"]["llama"]
    sel = res["selective"]
    assert sel["budget_bytes"] == int(1.3 * res["arms"]["torch_checkpoint"]["peak_bytes"])
    assert set(sel["arms"]) == {"torch_sac", "replay_selective"}
    for arm in sel["arms"].values():
        assert arm["step_time_s"] > 0 and arm["peak_bytes"] > 0
    rep = sel["arms"]["replay_selective"]
    assert rep["plan_at_budget"] is not None and rep["max_peak_over_budget"] > 0
    sweep = rep["sweep"]
    assert len(sweep) == 6
    assert [p["budget_bytes"] for p in sweep] == sorted(p["budget_bytes"] for p in sweep)
    for p in sweep:
        for arm in ("joint_selective", "joint"):
            assert p[arm]["feasible"], p  # from the lowest-memory plan's peak up
            assert p[arm]["step_time_s"] > 0 and p[arm]["peak_bytes"] > 0
    for key in ("replay_selective_vs_plain_time", "torch_sac_vs_plain_time"):
        assert sel["ratios"][key] > 0
    assert "joint with selective / plain" in proc.stdout
