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
    assert r["overhead"]["replay_saved_bytes"] > 0 and r["overhead"]["torch_saved_bytes"] > 0


def test_overhead_saves_the_same_bytes_as_torch_checkpoint(smoke):
    """On a stateless model the forward holds for backward exactly what torch checkpoint's
    does: measured by the allocator (the bytes the forward allocates and still holds when
    backward begins), not by a saved-tensor hook, which sees other tensors under each method
    (12,196 B each on the smoke sizes; by hook 1,184 against 3,232)."""
    _, r, _ = smoke
    assert r["overhead"]["replay_saved_bytes"] == r["overhead"]["torch_saved_bytes"] > 0


@pytest.mark.xfail(
    strict=False,
    reason="benchmarks/bench_real_models.py still counts saved bytes with a saved-tensor hook, "
    "which a replayed segment's inputs no longer pass through since issue 33 (user hooks apply "
    "to replays): gpt2 on the smoke sizes 131,652 B for replay against 132,676 for torch "
    "checkpoint; benchmarks/overhead.py measures by the allocator instead "
    "(_held_for_backward) and agrees exactly",
)
def test_real_models_save_the_same_bytes_as_torch_checkpoint(smoke):
    _, r, _ = smoke
    for name in ("gpt2", "vit", "resnet18"):
        d = r["real_models"][name]
        assert d["replay_saved_bytes"] == d["torch_saved_bytes"] > 0, name


def test_the_smoke_suite_figures_hold(smoke):
    _, r, _ = smoke
    m = r["sparse_write_map"]
    assert len(m["cells"]) == 4
    for c in m["cells"]:
        assert {"state_ratio", "write_fraction", "budget_position", "budget_bytes"} <= set(c)
        assert set(c["methods"]) == {
            "joint",
            "eager_whole",
            "fixed_regions",
            "whole_all",
            "selective_all",
        }
        # joint is optimal over every option: feasible wherever any baseline is
        assert c["methods"]["joint"]["feasible"]
        for d in c["methods"].values():
            if d["feasible"]:
                assert d["step_time_s"] > 0 and d["predicted_step_time_s"] > 0
                assert 0 < d["peak_bytes"] <= c["budget_bytes"]
                assert d["predicted_peak_bytes"] <= c["budget_bytes"]
    # a whole snapshot four times the activations never fits below retain_all's peak
    big = [c for c in m["cells"] if c["state_ratio"] == 4]
    assert big and not any(c["methods"]["eager_whole"]["feasible"] for c in big)
    assert m["joint_worst_vs_best_baseline"] > 0
    assert isinstance(m["cells_joint_vs_eager_whole_le_0_82"], list)
    for name in ("gpt2", "vit", "resnet18"):
        d = r["real_models"][name]
        assert d["ratio_vs_torch_checkpoint"] > 0 and d["torch_vs_torch"] > 0
        assert d["copies"] == 2 and d["modes"]
        assert d["replay_saved_bytes"] > 0 and d["torch_saved_bytes"] > 0
        assert d["checks_ratio_every_50"] > 0
        assert d["check_records"]["match"] > 0 and d["check_records"]["divergence"] == 0
    # batch norm's running statistics are written in every ResNet block: kept to replay exactly
    assert r["real_models"]["resnet18"]["replay_preserved_bytes"] > 0
    assert 0 < r["dense_queue"]["joint_vs_whole_memory"] < 1
    assert r["dense_queue"]["joint_vs_whole_time"] > 0
    for k in ("ms_16", "ms_64", "ms_256"):
        assert r["planner"][k] > 0
    assert r["planner"]["optimality_gap_max"] == 0
    assert r["checks"]["overhead_ratio_every_50"] > 0
    assert r["checks"]["records"]["match"] > 0 and r["checks"]["records"]["divergence"] == 0
    assert {t["name"] for t in r["targets"]} >= {
        "overhead.ratio",
        "planner.ms_256",
        "checks.overhead_ratio_every_50",
        "sparse_write_map.joint_worst_vs_best_baseline",
        "real_models.gpt2.ratio_vs_torch_checkpoint",
    }


def test_map_workload_decouples_state_from_activations():
    """The map's knob is honest: the bytes a block saves for backward do not grow with its bank,
    and the step overwrites exactly write_rows rows of every bank."""
    import torch

    sys.path.insert(0, BENCH)
    try:
        from sparse_map import MapModel, activation_bytes
    finally:
        sys.path.remove(BENCH)

    def saved(rows):
        torch.manual_seed(0)
        m = MapModel(blocks=1, dim=8, hidden=16, rows=rows, write_rows=3)
        before = m.blocks[0].memory.clone()
        nbytes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: nbytes.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            m.blocks[0](torch.randn(4, 8))
        m(torch.randn(4, 8))
        changed = (m.blocks[0].memory != before).any(dim=1).sum().item()
        return sum(nbytes), changed

    small, changed_small = saved(64)
    large, changed_large = saved(4096)
    assert small == large <= activation_bytes(4, 8, 16) + 4 * 8 * 16 * 2
    assert changed_small == changed_large == 3


def test_plot_writes_a_png(smoke, tmp_path):
    from plot import plot

    _, r, _ = smoke
    out = tmp_path / "p.png"
    plot(r, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steady_profile_times_every_steady_function(monkeypatch):
    """benchmarks/steady_profile.py wraps the engine's steady-path functions by name: each one
    it names still exists and is called on a steady ResNet block step, and the wrappers are
    gone afterwards."""
    sys.path.insert(0, BENCH)
    try:
        import steady_profile as sp
    finally:
        sys.path.remove(BENCH)
    monkeypatch.setitem(sp.SIZES, "resnet18", dict(image=32, batch=2))
    before = [getattr(owner, attr) for owner, attr in sp.FUNCTIONS]
    out = sp.functions("resnet18", 1)
    assert [getattr(owner, attr) for owner, attr in sp.FUNCTIONS] == before
    assert len(out["us_per_call"]) == len(sp.FUNCTIONS)  # each one ran
    assert sp.variant("resnet18", 2, "direct")["torch_ms"] > 0


def test_arms_side_by_side_steps_every_copy_in_every_order():
    """The real-model and overhead ratios rest on this schedule: every arm steps once a round,
    on its copies in turn, and over 18 rounds each copy of each arm takes every position."""
    sys.path.insert(0, BENCH)
    from bench_common import arms_side_by_side

    arms = [
        [("a", c) for c in range(3)],
        [("b", c) for c in range(3)],
        [("c", c) for c in range(3)],
    ]
    seen = []
    times = arms_side_by_side(arms, lambda m, r: seen.append((r, m)) or float(r), 36)
    assert [len(t) for t in times] == [36, 36, 36]
    assert times[0] == [float(r) for r in range(36)]  # in round order, whatever the arm order
    positions = {}
    for i, (r, (arm, copy)) in enumerate(seen):
        assert copy == r % 3
        positions.setdefault((arm, copy), set()).add(i % 3)
    assert all(p == {0, 1, 2} for p in positions.values()) and len(positions) == 9


def test_arms_side_by_side_schedules_a_dozen_arms():
    """The frontier times every distinct plan as an arm (13 with GPT-2's quick sweep): its
    schedule must not enumerate the arms' orders (13! of them: the run held 23 GB and was
    killed) and must still put each arm at every position."""
    sys.path.insert(0, BENCH)
    from bench_common import arms_side_by_side

    n, copies = 13, 2
    arms = [[(a, c) for c in range(copies)] for a in range(n)]
    seen = []
    times = arms_side_by_side(arms, lambda m, r: seen.append(m) or float(r), 2 * n * copies)
    assert [len(t) for t in times] == [2 * n * copies] * n
    positions: dict = {}
    for i, (arm, _) in enumerate(seen):
        positions.setdefault(arm, set()).add(i % n)
    assert all(p == set(range(n)) for p in positions.values())


def test_median_se_measures_the_spread_of_a_median():
    sys.path.insert(0, BENCH)
    from bench_common import median_se

    assert median_se([0.1] * 15) == 0.0
    narrow = median_se([1.0 + 0.01 * (i % 5) for i in range(40)])
    wide = median_se([1.0 + 0.1 * (i % 5) for i in range(40)])
    assert 0 < narrow < wide


def _run_without_wandb(script: str, *args: str, timeout: int = 900):
    """Run a benchmark script in a fresh interpreter where ``import wandb`` fails, as on the
    device machine (which has no wandb)."""
    import subprocess

    shim = (
        "import runpy, sys; sys.modules['wandb'] = None; "
        f"sys.argv = [{script!r}] + sys.argv[1:]; "
        f"runpy.run_path({script!r}, run_name='__main__')"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(BENCH, os.pardir))
    return subprocess.run(
        [sys.executable, "-c", shim, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=os.path.join(BENCH, os.pardir),
    )


def test_gpu_suite_smoke_writes_every_arm_without_wandb(tmp_path):
    """benchmarks/gpu_suite.py --smoke on CPU: every model and arm measured, every step's peak
    against the budget kept from the first step, syncs counted, the JSON written; nothing on
    its import path needs wandb."""
    out = tmp_path / "gpu.json"
    proc = _run_without_wandb(
        # (the selective arms and sweep: tests/test_selective_benchmarks.py)
        os.path.join(BENCH, "gpu_suite.py"),
        "--smoke",
        "--selective",
        "",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["models"]) == {"gpt2", "llama", "vit", "resnet50"}
    assert not r["failures"] and not r["skipped"]
    for name, res in r["models"].items():
        arms = res["arms"]
        assert set(arms) == {"plain", "torch_checkpoint", "replay", "replay_budget"}, name
        for arm, a in arms.items():
            assert a["peak_bytes"] > 0 and a["step_time_s"] > 0, (name, arm)
            assert a["syncs_per_step"] > 0 and a["steps"][0]["step"] == 0
        b = arms["replay_budget"]
        assert (
            b["budget_bytes"]
            == (arms["plain"]["peak_bytes"] + arms["torch_checkpoint"]["peak_bytes"]) // 2
        )
        assert all("peak" in s for s in b["steps"]) and b["max_peak_over_budget"] > 0
        assert res["ratios"]["replay_vs_torch_checkpoint_peak"] > 0
        # a steady unchecked step asks for plain training's host reads (CPU count)
        assert all(res["ratios"]["syncs_equal_plain"].values()), (name, res["ratios"])
    assert "replay / torch checkpoint" in proc.stdout


def test_gpu_check_smoke_runs_every_check_on_cpu(tmp_path):
    """benchmarks/gpu_check.py --smoke on CPU: every check runs and passes (CUDA-only figures
    are None), the JSON holds each one."""
    out = tmp_path / "check.json"
    proc = _run_without_wandb(
        os.path.join(BENCH, "gpu_check.py"), "--smoke", "--device", "cpu", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for name in (
        "exact_dropout_checked",
        "budgeted_probe",
        "bf16_autocast_checked",
        "budget_vs_allocator",
        "syncs_per_step",
    ):
        assert r[name]["pass"] is True, (name, r[name])
    counts = r["syncs_per_step"]["dispatch_count"]
    assert counts["plain"] == counts["replay"] == counts["replay_min"] > 0


def test_frontier_writes_every_documented_key(smoke, tmp_path):
    """benchmarks/frontier.py (the quick suite's ``frontier`` section): budgets from the
    lowest-memory plan's peak to plain training's, three arms each, measured peaks, the plot."""
    sys.path.insert(0, BENCH)
    try:
        import frontier
    finally:
        sys.path.remove(BENCH)
    bench, r, _ = smoke
    f = r["frontier"]
    assert f["worst_vs_best_other"] > 0 and isinstance(f["points_le_0_95"], int)
    for name in ("gpt2", "llama"):
        m = f[name]
        assert len(m["points"]) == bench.SUITES["smoke"]["frontier"]["points"]
        assert m["torch_vs_torch"] > 0
        budgets = [p["budget_bytes"] for p in m["points"]]
        assert budgets == sorted(budgets)
        assert budgets[0] == m["lowest_plan_peak_bytes"]
        assert budgets[-1] == m["plain_predicted_peak_bytes"]
        for p in m["points"]:
            for arm in frontier.ARMS:
                assert {"feasible", "step_s", "peak_bytes"} <= set(p[arm])
            # joint with the selective option is optimal over a superset: feasible wherever
            # joint is, and feasible at every budget of the sweep
            assert p["joint_selective"]["feasible"]
            for arm in ("joint_selective", "joint"):
                if p[arm]["feasible"]:
                    assert p[arm]["step_s"] > 0
                    assert p[arm]["predicted_peak_bytes"] <= p["budget_bytes"]
                    # the budget is a whole-process promise: each plan's peak, measured with
                    # only its own model alive, is within it
                    assert p[arm]["within_budget"] and p[arm]["peak_bytes"] <= p["budget_bytes"]
            # the ratio pairs joint with selective with the faster other arm round by round:
            # against its own plan (joint picked the same choices) it is exactly 1
            if p["selective_vs_best_other"] is not None:
                assert p["best_other"] in ("joint", "torch_sac")
                assert p["selective_vs_best_other"] > 0
                assert p["selective_vs_best_other_medians"] > 0
                same = p["joint"]["feasible"] and (
                    p["joint"]["choices"] == p["joint_selective"]["choices"]
                )
                if same and p["best_other"] == "joint":
                    assert p["selective_vs_best_other"] == 1.0
        assert m["plans_over_budget"] == 0
        # the selective option is offered and measured for every segment (costs are measured
        # with every option timed, not only those the lowest plan picks)
        assert len(m["segment_options"]) == m["segments"]
        for opts in m["segment_options"].values():
            assert {"retain", "recompute", "selective"} <= set(opts)
            assert opts["selective"]["memory_bytes"] > opts["recompute"]["memory_bytes"]
            assert opts["selective"]["time_s"] > 0
    assert f["plans_over_budget"] == 0
    out = tmp_path / "frontier.png"
    frontier.plot(f, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sparse_map_has_the_selective_baselines(smoke):
    """The map's selective baselines: ``selective_all`` as a planning method beside the others,
    and torch's selective checkpoint (same policy) in the same rounds, with its own peak and
    its gradients against plain training (wrong here: its replay reads the bank as the step
    left it)."""
    _, r, _ = smoke
    m = r["sparse_write_map"]
    for pair in m["pairs"]:
        assert pair["torch_sac_peak_bytes"] > 0 and pair["torch_sac_step_time_s"] > 0
        assert pair["torch_sac_gradients_match_plain"] is False
        for c in pair["costs"]["segments"]:
            assert any(o.startswith("selective") for o in c["options"])
    for c in m["cells"]:
        assert "selective_all" in c["methods"]
        d = c["methods"]["selective_all"]
        if d["feasible"]:
            assert all(o.startswith("selective") for o in d["choices"].values())
        assert {"feasible", "step_time_s", "peak_bytes"} <= set(c["torch_sac"])
        assert c["torch_sac"]["gradients_match_plain"] is False
