"""ReplayCallback: telemetry through the trainer's loggers, checks, divergences, re-plans,
records, and resume."""

from __future__ import annotations

import csv
import gc
import logging
import os
import re
import sqlite3

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_replay import ReplayCallback, ReplayConfigError, ReplayStrategy, format_bytes
from lightning_replay.planner import min_feasible_budget, predicted_peak
from lightning_replay.records import COLUMNS

from tests.helpers.lit_hazards import (
    DIM,
    HazardNet,
    OutsideStateNet,
    ViolationNet,
    differing,
    loader,
    state,
    trainer,
)

#: A batch at which replaying a HazardNet block frees memory: its activations (8-20 KiB) well
#: above the 5,056 bytes of CPU RNG state checkpoint keeps per replayed call. At the default
#: batch of 8 (1-3 KiB) the lowest-memory plan retains every block.
WIDE = 64

METRICS = (
    "replay/peak_memory_bytes",
    "replay/step_time_ms",
    "replay/replays",
    "replay/preserved_bytes",
    "replay/matches",
    "replay/rejections",
    "replay/divergences",
    "replay/plan_version",
    "replay/checks_skipped",
)


def _records(path, where: str = "1"):
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute(f"SELECT * FROM records WHERE {where} ORDER BY seq")]


class _At(L.Callback):
    """Runs ``fn(trainer)`` at the end of the given global steps (before ReplayCallback)."""

    def __init__(self, steps, fn) -> None:
        self.steps, self.fn = set(steps), fn

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            self.fn(trainer)


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"check_every_n_steps": 0}, r"check_every_n_steps=0\) must be a positive int or None"),
        ({"check_every_n_steps": -3}, "check_every_n_steps=-3"),
        ({"check_every_n_steps": 2.5}, "check_every_n_steps=2.5"),
        ({"check_every_n_steps": True}, "check_every_n_steps=True"),
        ({"checks": ("grad", "hash")}, r"checks=...\) has unknown entries \['hash'\]; allowed"),
        ({"checks": ()}, r"checks=\(\)\) is empty"),
        ({"replan_on": ("memory", "weather")}, r"unknown entries \['weather'\]"),
        ({"log_records": "yes"}, "log_records='yes'"),
        ({"memory_headroom": 1.5}, "memory_headroom=1.5"),
        ({"replan_cooldown_steps": 0}, "replan_cooldown_steps=0"),
        ({"shape_patience": None}, "shape_patience=None"),
        ({"progress_bar": 1}, "progress_bar=1"),
        ({"summary": "no"}, "summary='no'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ReplayConfigError, match=match):
        ReplayCallback(**kwargs)


def test_unwritable_records_path_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ReplayConfigError, match="cannot be created"):
        ReplayCallback(records_path=blocker / "replay" / "records.sqlite")
    with pytest.raises(ReplayConfigError, match="is a directory"):
        ReplayCallback(records_path=tmp_path)
    cb = ReplayCallback(
        records_path=tmp_path / "new" / "dir" / "records.sqlite", checks="grad", replan_on=()
    )
    assert cb.checks == ("grad",) and cb.replan_on == ()
    assert not (tmp_path / "new").exists()  # validating creates nothing


def test_needs_the_replay_strategy(tmp_path):
    t = trainer(tmp_path, callbacks=[ReplayCallback()], max_steps=1)
    with pytest.raises(ReplayConfigError, match="needs Trainer\\(strategy='replay'\\)"):
        t.fit(HazardNet(), loader(1))


# ---------------------------------------------------------------------- telemetry and records
def test_metrics_reach_the_trainer_loggers_and_records_the_default_file(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    cb = ReplayCallback(check_every_n_steps=3)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=9,
        callbacks=[cb],
        logger=logger,
        log_every_n_steps=1,
    )
    t.fit(HazardNet(), loader(16, batch=WIDE))

    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for name in METRICS:
        assert any(r.get(name) not in (None, "") for r in rows), name
    last = {k: float(v) for k, v in rows[-1].items() if k in METRICS and v}
    engine = t.strategy.engine
    assert last["replay/plan_version"] == engine.plan_version == 1
    assert last["replay/step_time_ms"] > 0
    assert last["replay/peak_memory_bytes"] > engine.base_memory  # the accounted peak
    assert last["replay/divergences"] == last["replay/rejections"] == 0

    path = tmp_path / "replay" / "records.sqlite"
    rows = _records(path)
    assert tuple(rows[0]) == COLUMNS
    checked = sorted({r["step"] for r in rows if r["check"] in ("grad", "bytes")})
    assert checked == [3, 6, 9]  # every third window
    assert last["replay/matches"] == sum(r["check"] in ("grad", "bytes", "probe") for r in rows)
    assert {r["rank"] for r in rows} == {0}
    assert {r["run_id"] for r in rows} == {engine.records.run_id}
    assert [r for r in rows if r["check"] == "plan"][0]["contract_version"] == 1


def test_only_the_requested_checks_run(tmp_path):
    t = trainer(
        tmp_path,
        strategy="replay",
        max_steps=4,
        callbacks=[ReplayCallback(check_every_n_steps=2, checks=("grad",))],
    )
    t.fit(HazardNet(), loader())
    checks = {r.check for r in t.strategy.engine.records.read()}
    assert "grad" in checks and "bytes" not in checks


# ---------------------------------------------------------------------- divergences
def test_state_changed_outside_the_contract_is_caught_recorded_and_counted(tmp_path):
    """``on_before_backward`` rescales a tensor outside the model through ``.data`` (no version
    bump) after the segment's forward: its replay sees other state than its forward did. The
    checks catch it, record divergences, count them - and train on the reference gradients,
    so the weights still equal plain training's."""
    ref = OutsideStateNet(bump_at=(3,))
    trainer(tmp_path, max_steps=6).fit(ref, loader())

    model = OutsideStateNet(bump_at=(3,))
    cb = ReplayCallback(check_every_n_steps=1, records_path=tmp_path / "checked.sqlite")
    t = trainer(
        tmp_path, strategy=ReplayStrategy(planner="fixed_regions"), max_steps=6, callbacks=[cb]
    )
    t.fit(model, loader())

    diverged = _records(tmp_path / "checked.sqlite", "outcome = 'divergence'")
    assert {(r["step"], r["segment"]) for r in diverged} == {(4, "blocks.1")}
    assert {r["check"] for r in diverged} == {"grad", "bytes"}
    assert any("external[0]" in r["detail"] for r in diverged)  # names the state that moved
    assert cb.last_metrics["divergences"] == len(diverged)
    assert float(t.callback_metrics["replay/divergences"]) == len(diverged)
    assert differing(state(ref), state(model)) == []

    # Unchecked, the same hazard silently reaches the weights: that is what checks are for.
    model = OutsideStateNet(bump_at=(3,))
    cb = ReplayCallback(check_every_n_steps=None, records_path=tmp_path / "unchecked.sqlite")
    trainer(
        tmp_path, strategy=ReplayStrategy(planner="fixed_regions"), max_steps=6, callbacks=[cb]
    ).fit(model, loader())
    assert differing(state(ref), state(model)) != []
    assert cb.last_metrics["divergences"] == 0


def test_a_divergence_replans_like_a_rejection(tmp_path):
    """Issue 12: a check's divergence counts as a contract violation for re-planning."""
    replans = {}
    for replan_on in (("violations",), ()):
        cb = ReplayCallback(
            check_every_n_steps=1,
            replan_on=replan_on,
            records_path=tmp_path / f"{len(replan_on)}.sqlite",
        )
        t = trainer(
            tmp_path, strategy=ReplayStrategy(planner="fixed_regions"), max_steps=6, callbacks=[cb]
        )
        t.fit(OutsideStateNet(bump_at=(3,)), loader())
        assert cb.last_metrics["divergences"] > 0
        # the version guard saw nothing (a .data write): the divergence is what re-plans
        assert t.strategy.engine.records.read(check="version") == []
        replans[replan_on] = cb.replans
    assert replans == {("violations",): 1, (): 0}


# ---------------------------------------------------------------------- what a user sees
def test_fit_ends_with_a_summary_of_plan_memory_checks_and_records(tmp_path, caplog):
    """A run shorter than check_every_n_steps still checks (the first settled step); the
    printed block names the plan, the real peak beside the budget, the predicted peak beside
    retaining every segment (predicted alike), the checks and the records file. The
    retain-everything prediction is held against a run that really retains every segment."""

    def retain_everything() -> dict:
        cb = ReplayCallback(check_every_n_steps=None, summary=False)
        trainer(
            tmp_path / "retained",
            strategy=ReplayStrategy(planner="retain_all", calibration_steps=1),
            max_steps=8,
            callbacks=[cb],
        ).fit(HazardNet(), loader(16, batch=WIDE))
        return dict(cb.fit_summary)

    gc.collect()  # both runs measure the same process: no garbage of earlier tests in it
    retained = retain_everything()
    gc.collect()  # the real peak is the whole process's: nothing of that run may stay behind

    cb = ReplayCallback(check_every_n_steps=50, progress_bar=True)
    t = trainer(
        tmp_path / "replayed",
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=8,
        callbacks=[cb],
    )
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        t.fit(HazardNet(), loader(16, batch=WIDE))
    engine = t.strategy.engine
    s = cb.fit_summary
    checks = engine.records.read(kind="check")
    # the sampled checks, and each replayed probe's comparison with its forward (step 1)
    assert s["checked_steps"] == 1 and {r.check for r in checks} == {"grad", "bytes", "probe"}
    assert s["matches"] == len(checks) > 0 and s["divergences"] == 0
    assert {n: d["option"] for n, d in s["segments"].items()} == engine.plan.choices
    assert s["replays"] == sum(x["replays"] for x in engine.summary().values()) > 0
    # retaining everything, predicted in the plan's terms, bounds what a run that retains
    # everything really held (the profiler's peak), and is near it
    real_retained = retained["real_peak_bytes"]
    assert real_retained and s["retain_all_peak_bytes"] >= real_retained * 0.95, (
        s["retain_all_peak_bytes"],
        real_retained,
    )
    assert s["retain_all_peak_bytes"] <= real_retained * 1.3
    # ... in the accountant's own terms, it is what retaining everything accounts
    acc = retained["accounted_peak_bytes"]
    assert abs(s["retain_all_accounted_bytes"] - acc) <= 0.02 * acc
    # ... and replaying really holds fewer activations (at this size the real peak is mostly
    # the process's own: the two runs' real peaks are within a few KiB of each other)
    assert s["accounted_peak_bytes"] < acc
    assert s["real_peak_bytes"] < real_retained * 1.05
    text = "\n".join(
        r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_replay:")
    )
    assert text.startswith("lightning_replay: 8 steps, run ")
    for name, option in engine.plan.choices.items():
        assert re.search(rf"\n  {re.escape(name)}\s+{option}\s+contract v1", text), text
    assert f"real peak {format_bytes(s['real_peak_bytes'])} (no budget" in text, text
    assert (
        f"predicted peak {format_bytes(s['predicted_peak_bytes'])} vs "
        f"{format_bytes(s['retain_all_peak_bytes'])} retaining every segment (predicted)" in text
    )
    assert f"checks on 1 step (first settled step, then every 50): {len(checks)} matched" in text
    assert "skipped" not in text
    assert str(tmp_path / "replayed" / "replay" / "records.sqlite") in text
    # progress_bar=True: the real peak, the predicted peak and its saving, in MiB
    bar = t.progress_bar_metrics
    assert bar["replay/predicted_MiB"] == pytest.approx(engine.plan.peak_memory / 2**20)
    assert bar["replay/saved_MiB"] == pytest.approx(
        (s["retain_all_peak_bytes"] - engine.plan.peak_memory) / 2**20
    )
    assert bar["replay/real_peak_MiB"] == pytest.approx(
        engine.window_stats()["real_peak_bytes"] / 2**20
    )


def test_summary_off_prints_nothing(tmp_path, caplog):
    cb = ReplayCallback(check_every_n_steps=None, summary=False)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer(
            tmp_path, strategy=ReplayStrategy(calibration_steps=1), max_steps=4, callbacks=[cb]
        ).fit(HazardNet(), loader(16))
    assert not any(r.getMessage().startswith("lightning_replay:") for r in caplog.records)
    assert cb.fit_summary["checked_steps"] == 0 and "replay/real_peak_MiB" not in cb.last_metrics


# ---------------------------------------------------------------------- re-plans
def test_a_lowered_budget_replans_and_the_measured_peak_holds_it(tmp_path):
    budgets = {}

    def lower(t):  # the budget a user would set to force recomputation
        engine = t.strategy.engine
        # in the budget's terms: the accounted peak plus what the measured step held beyond it,
        # no less than the plan's prediction with every phase measured so far (each charged at
        # its moment; the plan's own figure may predate its first measured step)
        now = predicted_peak(
            engine.costs, engine.plan.choices, engine.real_base_memory, **engine.phase_peak_args
        )
        budgets["peak_before"] = max(
            int(cb.last_metrics["peak_memory_bytes"]) + engine.unaccounted_bytes, now
        )
        # halfway down to the lowest plan: the new plan's own measured step may hold a little
        # more beyond its prediction than the old plan's did (at the very lowest budget that
        # makes it infeasible, and the engine runs the lowest plan with a warning instead)
        lowest = min_feasible_budget(
            engine.costs, engine.real_base_memory, **engine.phase_peak_args
        )
        budgets["new"] = (lowest + budgets["peak_before"]) // 2
        engine.reconfigure(budget=budgets["new"])

    cb = ReplayCallback(check_every_n_steps=None, replan_on=("memory",), replan_cooldown_steps=1)
    logged, engine_stats = {}, {}

    def record(t):  # runs after ReplayCallback: its peak for this window, the engine's for the last
        logged[t.strategy.engine.step] = int(cb.last_metrics["peak_memory_bytes"])
        stats = t.strategy.engine.step_stats()
        engine_stats[stats["step"]] = stats["peak_bytes"]

    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(budget="1GiB", calibration_steps=1),
        max_steps=12,
        callbacks=[_At([7], lower), cb, _At(range(1, 13), record)],
    )
    t.fit(HazardNet(), loader(16, batch=WIDE))

    engine = t.strategy.engine
    # one re-plan by the callback; the engine may make the plan again for the same budget
    # when a later measured step's real figure grows its prediction
    assert engine.plan_version >= 2 and cb.replans == 1
    assert budgets["peak_before"] > budgets["new"]  # the all-retained plan no longer fits
    assert engine.plan.budget == budgets["new"]
    assert any(o != "retain" for o in engine.plan.choices.values())
    after = [logged[s] for s in range(9, 13)]
    assert max(after) <= budgets["new"], (after, budgets)
    # the callback's per-window peak is the engine's own accounted peak for that window
    assert all(logged[s] == engine_stats[s] for s in engine_stats if s in logged and s > 0)


def test_checked_steps_stay_within_the_budget_and_trigger_no_memory_replan(tmp_path):
    """Under a budget with no headroom a derivative check would keep graphs the plan replays:
    it is skipped (with a warning), so no step exceeds the budget and no re-plan follows."""
    peaks = {}

    def lower(t):
        engine = t.strategy.engine
        engine.reconfigure(
            budget=min_feasible_budget(
                engine.costs, engine.real_base_memory, **engine.phase_peak_args
            )
        )

    def record(t):
        engine = t.strategy.engine
        peaks[engine.step] = (engine.window_stats()["peak_bytes"], engine.budget)

    cb = ReplayCallback(check_every_n_steps=4, replan_on=("memory",), replan_cooldown_steps=1)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(budget="1GiB", calibration_steps=1),
        max_steps=16,
        callbacks=[_At([5], lower), cb, _At(range(1, 17), record)],
    )
    with pytest.warns(RuntimeWarning, match="derivative check skipped"):
        t.fit(HazardNet(), loader(16, batch=WIDE))
    after = {s: p for s, p in peaks.items() if s >= 7}
    assert all(peak <= budget for peak, budget in after.values()), after
    assert cb.replans == 0 and t.strategy.engine.checks_skipped >= 2
    assert cb.last_metrics["checks_skipped"] == t.strategy.engine.checks_skipped


def test_an_infeasible_budget_is_recorded_and_the_plan_kept(tmp_path):
    cb = ReplayCallback(check_every_n_steps=None, replan_on=("memory",))
    lower = _At([7], lambda t: t.strategy.engine.reconfigure(budget=1024))
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(budget="1GiB", calibration_steps=1),
        max_steps=8,
        callbacks=[lower, cb],
    )
    with pytest.warns(UserWarning, match="re-plan \\(memory\\) failed, keeping plan v1"):
        t.fit(HazardNet(), loader(16))
    engine = t.strategy.engine
    assert engine.plan_version == 1
    rejected = engine.records.read(outcome="rejection")
    assert [r.check for r in rejected] == ["plan"] and "1024" in rejected[0].detail


def test_a_violation_replans_once_the_new_contract_is_in_force(tmp_path):
    cb = ReplayCallback(check_every_n_steps=None, replan_on=("violations",))
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1, planner="fixed_regions"),
        max_steps=12,
        callbacks=[cb],
    )
    with pytest.warns(RuntimeWarning, match="segment 'blocks.1'.*'shift'"):
        t.fit(ViolationNet(bump_at=tuple(range(7, 12))), loader(16))  # from step 8 on
    engine = t.strategy.engine
    rejected = engine.records.read(outcome="rejection")
    assert [(r.step, r.segment, r.check) for r in rejected] == [(8, "blocks.1", "version")]
    contracts = [
        r for r in engine.records.read() if r.check == "contract" and r.segment == "blocks.1"
    ]
    assert [r.contract_version for r in contracts] == [1, 2]
    assert '"shift"' in contracts[1].detail  # the new version preserves the moved buffer
    plans = [r for r in engine.records.read() if r.check == "plan"]
    assert [r.contract_version for r in plans] == [1, 2]  # plan versions
    assert plans[1].step > contracts[1].step  # planned after the new contract, not before
    assert cb.replans == 1 and engine.plan_version == 2
    assert cb.last_metrics["rejections"] == 1


def _varying(sizes):
    x = torch.randn(sum(sizes), DIM, generator=torch.Generator().manual_seed(0))
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return DataLoader(
        TensorDataset(x), batch_sampler=[list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    )


@pytest.mark.parametrize(
    "sizes, replans",
    [
        ([8] * 7 + [4] * 3, 1),  # the shapes change for good: one re-plan
        ([8] * 7 + [4] + [8] * 2, 0),  # one short batch: no re-plan
    ],
)
def test_changed_input_shapes_replan_once_they_persist(tmp_path, sizes, replans):
    cb = ReplayCallback(check_every_n_steps=None, replan_on=("shapes",), replan_cooldown_steps=1)
    t = trainer(
        tmp_path, strategy=ReplayStrategy(calibration_steps=1), max_steps=len(sizes), callbacks=[cb]
    )
    t.fit(HazardNet(), _varying(sizes))
    assert cb.replans == replans
    # a re-plan that gives the same choices makes no new plan version (issue 17.7)
    assert 1 <= t.strategy.engine.plan_version <= 1 + replans


def test_a_shape_replan_plans_with_activation_bytes_measured_at_the_new_shapes(tmp_path):
    sizes = [16] * 7 + [WIDE] * 3
    cb = ReplayCallback(check_every_n_steps=None, replan_on=("shapes",), replan_cooldown_steps=1)
    t = trainer(
        tmp_path, strategy=ReplayStrategy(calibration_steps=1), max_steps=len(sizes), callbacks=[cb]
    )
    t.fit(HazardNet(), _varying(sizes))
    engine = t.strategy.engine
    assert cb.replans == 1
    probed = {n: c.activation_bytes for n, c in engine.contracts.items()}
    measured = {c.name: c.activation_bytes for c in engine.costs}
    # every segment's A(s) was measured again at the larger batch (the step before the re-plan) ...
    assert set(engine.meter.activation_bytes) == set(probed)
    assert all(measured[n] > probed[n] for n in probed), (measured, probed)
    # ... and the re-plan (engine.costs is what it plans from) charged them; before it, the
    # engine may make the lowest plan once more itself, when a measured phase shows a lower one
    assert engine.plan_version >= 2


# ---------------------------------------------------------------------- resume
def test_resume_continues_plan_version_records_and_weights(tmp_path):
    """An interrupted run resumed from its checkpoint ends with the weights of an uninterrupted
    run; the plan version, the engine's step and the records continue (one run id, appended)."""

    def fit(model, root, epochs, ckpt_path=None, callbacks=()):
        cb = ReplayCallback(check_every_n_steps=3)
        t = trainer(
            root,
            strategy=ReplayStrategy(calibration_steps=1),
            max_steps=-1,
            max_epochs=epochs,
            callbacks=[*callbacks, cb],
        )
        t.fit(model, loader(6), ckpt_path=ckpt_path)
        return t, cb

    L.seed_everything(7)
    full = HazardNet()
    fit(full, tmp_path / "full", 2)

    L.seed_everything(7)
    first = HazardNet()
    t1, cb1 = fit(first, tmp_path / "run", 1)
    ckpt = tmp_path / "run.ckpt"
    t1.save_checkpoint(ckpt)
    # the replay state in a checkpoint is plain data: it loads without unpickling any object
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["ReplayCallback"]
    assert saved["plan_version"] == 1 and saved["engine"]["step"] == 6
    seq_at_ckpt = saved["record_seq"]
    run_id = saved["run_id"]

    L.seed_everything(99)
    resumed = HazardNet(seed=5)
    replan = _At([9], lambda t: t.strategy.replan())
    t2, cb2 = fit(resumed, tmp_path / "run", 2, ckpt_path=ckpt, callbacks=[replan])

    assert differing(state(full), state(resumed)) == []
    engine = t2.strategy.engine
    assert engine.step == 12
    # continued from 1, not restarted: the resumed engine kept its plan (no calibration, no
    # new plan record), and the explicit re-plan gave the same choices, so no new version
    assert engine.plan_version == 1
    rows = _records(tmp_path / "run" / "replay" / "records.sqlite")
    assert {r["run_id"] for r in rows} == {run_id}
    after = [r for r in rows if r["seq"] > seq_at_ckpt]
    assert not [r for r in after if r["check"] == "plan"]
    assert after and min(r["step"] for r in after) == 7  # steps continue after the checkpoint
    assert [r["contract_version"] for r in after if r["check"] == "plan"] == []
    assert {r["contract_version"] for r in after if r["check"] == "contract"} == {2}
    assert cb2.counters["matches"] > cb1.counters["matches"]  # counts continue too
    assert cb2.counters["matches"] == sum(r["check"] in ("grad", "bytes", "probe") for r in rows)


def test_state_dict_round_trip_and_version_check():
    cb = ReplayCallback()
    state_dict = {
        "version": 1,
        "run_id": "abc",
        "record_seq": 41,
        "counters": {"matches": 3, "rejections": 1, "divergences": 2},
        "replans": 4,
        "plan_version": 5,
        "engine": None,
    }
    cb.load_state_dict(state_dict)
    assert cb.record_seq == 41 and cb.replans == 4
    assert cb.counters == {"matches": 3, "rejections": 1, "divergences": 2}
    with pytest.raises(ReplayConfigError, match="state has version 7"):
        cb.load_state_dict({**state_dict, "version": 7})


def test_checks_under_mixed_precision_report_no_divergence(tmp_path):
    ref = HazardNet()
    L.seed_everything(7)
    trainer(tmp_path, max_steps=4, precision="bf16-mixed").fit(ref, loader())
    model = HazardNet()
    L.seed_everything(7)
    t = trainer(
        tmp_path,
        strategy="replay",
        max_steps=4,
        precision="bf16-mixed",
        callbacks=[ReplayCallback(check_every_n_steps=2)],
    )
    t.fit(model, loader())
    assert differing(state(ref), state(model)) == []
    records = t.strategy.engine.records.read()
    assert any(r.check == "grad" for r in records)  # derivative checks ran under autocast
    assert [r for r in records if r.outcome == "divergence"] == []


def test_times_replan_votes_through_the_callback_until_its_plan_was_timed(tmp_path, monkeypatch):
    """``replan_on=("times",)`` under the strategy: the replays timed under the first plan
    (made 10 x slower here, whatever the clock reads) are off what it was planned with, so the
    callback re-plans after ``time_patience`` steps of it, and stops once its plan was timed."""
    from lightning.pytorch.callbacks import Callback

    from lightning_replay.core.mechanisms.costs import CostMeter

    planned = {"now": False}
    add = CostMeter.add_time
    monkeypatch.setattr(
        CostMeter,
        "add_time",
        lambda self, seg, opt, s: add(self, seg, opt, s * (10 if planned["now"] else 1)),
    )

    class Watch(Callback):
        def on_train_batch_start(self, trainer, *args):
            planned["now"] = trainer.strategy.engine.plan is not None

    cb = ReplayCallback(check_every_n_steps=None, replan_on=("times",), time_patience=3)
    t = trainer(
        tmp_path,
        strategy=ReplayStrategy(calibration_steps=1),
        max_steps=40,
        callbacks=[Watch(), cb],
    )
    t.fit(HazardNet(), loader(40, batch=WIDE))
    engine = t.strategy.engine
    assert engine.plan is not None and planned["now"]
    assert any(o != "retain" for o in engine.plan.choices.values())  # replays to time
    # each re-plan brings in options timed by calibration only (1 x), which the steps under
    # the new plan then time at 10 x: it re-plans until the chosen options were all timed
    # under a plan, then stays (the last plan ran more than time_patience steps unchanged)
    policy = cb._policy
    assert 1 <= cb.replans <= 4 and engine.plan_version <= 1 + cb.replans, cb.replans
    assert engine.step - policy.last_replan_step > cb.time_patience + 1, (
        engine.step,
        policy.last_replan_step,
    )
