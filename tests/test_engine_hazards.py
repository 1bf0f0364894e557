"""Every hazard replays exactly: bit-identical gradients every step and identical state after."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    clone_model,
    diff_state,
    grad_diffs,
    snapshot_state,
    torch_checkpoint,
    train_steps,
)

STEPS = 5
STATEFUL = [h for h in HAZARDS if h != "stateless"]


def run_pair(hazard: str, preservation: str, steps: int = STEPS):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, steps)
    model = clone_model(h.model)
    engine = lr.install(model, h.segments, preservation=preservation)
    g_rep, _ = train_steps(model, h.make_input, steps)
    return ref, model, engine, g_ref, g_rep


@pytest.mark.parametrize("preservation", ["auto", "whole", "regions"])
@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_hazard_replays_exactly(hazard, preservation):
    ref, model, engine, g_ref, g_rep = run_pair(hazard, preservation)
    assert_same_grads(g_ref, g_rep)
    summary = engine.summary()
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
    for name, s in summary.items():
        # the probe step runs retained; every later step replays, but one: a flag the root
        # flips after the segment ran (python_attrs) is re-probed at its second value
        assert s["contract_version"] == 1 + (name in FLAG_FLIPPED.get(hazard, ())), (name, s)
        assert s["replays"] == STEPS - s["contract_version"], (name, s)
        assert s["violations"] == 0


#: The segments whose forward reads a flag the root flips after them, every step: re-probed once,
#: at the flag's second value (a value no probe's forward saw), then replayed at both.
FLAG_FLIPPED = {"python_attrs": {"blocks.0", "blocks.1"}, "combined": {"blocks.4"}}


#: How plain ``torch.utils.checkpoint`` fails each hazard over STEPS SGD steps: the README's
#: hazard table (percent of per-step parameter gradients not bit-identical, or the error).
NAIVE_FAILURES = {
    "batch_norm": "stats updated twice",
    "counter": 93,
    "queue": 93,
    "bank_index_copy": 93,
    "bank_index_put": 93,
    "bank_scatter": 93,
    "inplace_whole": 93,
    "tensor_attr": 85,
    "alias_input": (RuntimeError, "modified by an inplace operation"),
    "rng": 93,
    "python_attrs": (CheckpointError, "different number of tensors was saved"),
    "combined": (CheckpointError, "different number of tensors was saved"),
}


def test_every_stateful_hazard_has_a_stated_naive_failure():
    assert sorted(NAIVE_FAILURES) == sorted(STATEFUL)


@pytest.mark.parametrize("hazard", STATEFUL)
def test_torch_checkpoint_fails_as_the_readme_says(hazard):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, STEPS)
    naive = torch_checkpoint(clone_model(h.model), h.segments)
    expected = NAIVE_FAILURES[hazard]
    if isinstance(expected, tuple):
        error, message = expected
        with pytest.raises(error, match=message):
            train_steps(naive, h.make_input, STEPS)
        return
    g_naive, _ = train_steps(naive, h.make_input, STEPS)
    if expected == "stats updated twice":
        assert grad_diffs(g_ref, g_naive) == []  # the gradients survive; the state does not
        for name, t in snapshot_state(naive).items():
            if name.endswith("num_batches_tracked"):
                assert int(t) == 2 * STEPS, name
                assert int(snapshot_state(ref)[name]) == STEPS, name
        assert any(
            n.endswith("running_mean")
            for n in diff_state(snapshot_state(ref), snapshot_state(naive))
        )
        return
    total = sum(len(g) for g in g_ref)
    wrong = len(grad_diffs(g_ref, g_naive))
    assert round(100 * wrong / total) == expected, (wrong, total)


def _count_call(calls: dict, *args) -> None:
    calls["n"] += 1


def test_recomputation_really_happens():
    h = HAZARDS["stateless"]()
    # (passed in, not a closure cell: the replay puts back a closure's dict it changed)
    calls = {"n": 0}
    plain = clone_model(h.model)
    model = clone_model(h.model)
    blk = model.blocks[0].fc1
    blk.register_forward_hook(functools.partial(_count_call, calls))
    engine = lr.install(model, h.segments)

    def saved_bytes(m, x):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(x).pow(2).mean()
        held = sum(seen.values())  # what the forward keeps (a replay's tensors pass these
        loss.backward()  # hooks in backward too, as in plain training: not counted)
        return held

    x = torch.randn(64, 16)
    plain_bytes = saved_bytes(plain, x)
    saved_bytes(model, x)  # step 1: the probe, retained
    calls["n"] = 0
    replay_bytes = saved_bytes(model, x)  # step 2: dropped and replayed
    assert calls["n"] == 2  # inner forward ran twice in one step: forward + replay
    assert replay_bytes < plain_bytes / 2
    assert engine.summary()["blocks.0"]["mode"] == "recompute"


def test_regions_preserve_a_sixteenth_of_whole():
    from lightning_replay.demos.hazards import QueueModel

    def preserved(pres):
        m = QueueModel(rows=4096, dim=16, write_rows=64)
        engine = lr.install(m, ["blocks.0", "blocks.1"], preservation=pres)
        x = torch.randn(64, 16)
        for _ in range(3):
            m(x).pow(2).mean().backward()
        return sum(s["preserved_bytes"] for s in engine.summary().values())

    whole, regions = preserved("whole"), preserved("regions")
    assert whole == 2 * 4096 * 16 * 4
    assert 0 < regions <= whole / 16


def test_contract_names_state_and_roundtrips():
    h = HAZARDS["combined"]()
    engine = lr.install(h.model, h.segments)
    train_steps(h.model, h.make_input, 2)
    c = engine.contracts["blocks.2"]
    assert "queue" in [s.name for s in c.changing]
    bn = engine.contracts["blocks.0"]
    assert {"blocks.0.bn.running_mean", "blocks.0.bn.running_var"} <= {s.name for s in bn.changing}
    assert next(s for s in bn.state if s.name == "blocks.0.bn.running_mean").unannotated_write
    assert engine.contracts["blocks.3"].generators == ["blocks.3.gen"]
    assert engine.contracts["blocks.3"].uses_global_rng
    assert "blocks.4.calls" in engine.contracts["blocks.4"].python_attrs
    for c in engine.contracts.values():
        assert lr.ReplayContract.from_dict(c.to_dict()) == c
    assert engine.summary()["blocks.5"]["mode"] == "recompute"


@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_checked_every_step_trains_exactly_and_matches(hazard):
    """A derivative + byte check on every step: training uses the reference gradients (equal
    to training without recomputation) and every replay matches them."""
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, STEPS)
    model = clone_model(h.model)
    engine = lr.install(model, h.segments)

    def make_input(step):
        engine.request_check()
        return h.make_input(step)

    g_rep, _ = train_steps(model, make_input, STEPS)
    assert_same_grads(g_ref, g_rep)
    checks = [r for r in engine.records.read() if r.check in ("grad", "bytes")]
    assert {r.check for r in checks} == {"grad", "bytes"}
    assert all(r.outcome == "match" for r in checks), [
        r.detail for r in checks if r.outcome != "match"
    ]
    # every segment checked on every step after its probes (see FLAG_FLIPPED)
    grad_checks = [r for r in checks if r.check == "grad"]
    probes = sum(s["contract_version"] for s in engine.summary().values())
    assert len(grad_checks) == len(engine.segments) * STEPS - probes
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
