"""benchmarks/run.py keeps working and writes every key the README and the plot read.

The figures of the smoke suite are meaningless (tiny sizes); the benchmark itself is run with
``make bench``. This only guards the script."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    sys.path.insert(0, BENCH)
    try:
        import run as bench
        out = tmp_path_factory.mktemp("bench") / "smoke.json"
        assert bench.main(["--suite", "smoke", "--json", str(out)]) == 0
        yield bench, json.loads(out.read_text()), out
    finally:
        sys.path.remove(BENCH)


def test_json_has_every_documented_key(smoke):
    _, r, _ = smoke
    assert r["overhead"]["ratio"] > 0
    assert r["overhead"]["replay_saved_bytes"] == r["overhead"]["torch_saved_bytes"]
    sw = r["sparse_write"]
    for level in ("roomy", "tight"):
        assert sw[level]["budget_bytes"] > 0
        methods = sw[level]["methods"]
        assert set(methods) == {"joint", "eager_whole", "fixed_regions", "retain_all",
                                "whole_all"}
        for m in methods.values():
            assert "feasible" in m
            if m["feasible"]:
                assert m["step_time_s"] > 0 and m["peak_bytes"] > 0
                assert m["predicted_peak_bytes"] > 0 and m["within_budget"]
    assert not sw["tight"]["methods"]["eager_whole"]["feasible"]
    assert sw["tight"]["methods"]["joint"]["feasible"]
    for k in ("joint_vs_eager_whole_roomy", "joint_vs_fixed_regions_tight"):
        assert sw["ratios"][k] > 0
    assert 0 < r["dense_queue"]["joint_vs_whole_memory"] < 1
    assert r["dense_queue"]["joint_vs_whole_time"] > 0
    for k in ("ms_16", "ms_64", "ms_256"):
        assert r["planner"][k] > 0
    assert r["planner"]["optimality_gap_max"] == 0
    assert r["checks"]["overhead_ratio_every_50"] > 0
    assert r["checks"]["records"]["match"] > 0 and r["checks"]["records"]["divergence"] == 0
    assert {t["name"] for t in r["targets"]} >= {"overhead.ratio", "planner.ms_256",
                                                 "checks.overhead_ratio_every_50"}


def test_plot_writes_a_png(smoke, tmp_path):
    from plot import plot
    _, r, _ = smoke
    out = tmp_path / "p.png"
    plot(r, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
