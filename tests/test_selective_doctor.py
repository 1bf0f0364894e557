"""The doctor's methods table shows torch's selective checkpoint beside lightning_replay's
selective option, measured on copies of the model against plain training."""

from __future__ import annotations

import json

import pytest

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS


@pytest.mark.parametrize("hazard, grads, state", [("batch_norm", 0, 6), ("queue", 6, 1)])
def test_torch_sac_differs_where_the_selective_option_is_exact(hazard, grads, state):
    h = HAZARDS[hazard]()
    report = lr.diagnose(h.model, h.make_input)
    sac, ours = report.torch_selective, report.replay_selective
    assert (len(sac.gradients), len(sac.state)) == (grads, state), report.table()
    assert not sac.exact and ours.exact, report.table()
    table = report.table()
    assert "torch selective checkpoint ('matmul')" in table
    row = next(line for line in table.splitlines() if line.startswith("torch selective"))
    assert row.split()[-2:] == ["silently", "differs"], row
    row = next(line for line in table.splitlines() if line.startswith("lightning_replay selective"))
    assert row.split()[-1] == "exact", row
    data = json.loads(json.dumps(report.to_dict()))
    assert data["torch_selective"]["exact"] is False and data["replay_selective"]["exact"] is True
    assert data["selective_policy"] == "matmul"
    assert "torch selective checkpoint" in report.to_html()


def test_selective_runs_can_be_left_out_and_a_bad_policy_is_named():
    h = HAZARDS["stateless"]()
    report = lr.diagnose(h.model, h.make_input, steps=1, selective=None)
    assert report.torch_selective is None and report.replay_selective is None
    assert "torch selective" not in report.table()
    with pytest.raises(lr.ReplayConfigError, match=r"diagnose\(selective='mm'\) is not known"):
        lr.diagnose(h.model, h.make_input, selective="mm")


@pytest.mark.parametrize("policy", ["every_other_matmul", "flops"])
def test_the_other_policies_are_diagnosed_too(policy):
    h = HAZARDS["counter"]()
    report = lr.diagnose(h.model, h.make_input, selective=policy)
    assert report.replay_selective.exact, report.table()
    assert f"('{policy}')" in report.replay_selective.method
