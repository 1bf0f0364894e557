"""A user's ``torch.profiler`` on every step keeps a budgeted engine from measuring its real
peak (one profiler per process): the engine says so once, with a warning and a record, instead
of letting the budget go unchecked in silence (issue 31)."""

from __future__ import annotations

import json
import warnings

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import lightning_replay as lr
from tests.helpers.torch_memory import process_tensor_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(3)]
    )


def _train(budget, profiled: bool, steps: int = 6) -> tuple[list[str], list]:
    if budget is not None:
        # a budget is the whole process's memory: on top of what earlier tests left alive
        budget += process_tensor_bytes()
    model = _model()
    engine = lr.install(model, ["0", "1", "2"], budget=budget)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(s))

            def step() -> None:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if profiled:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                    step()
            else:
                step()
    said = [str(w.message) for w in caught if "another torch.profiler" in str(w.message)]
    records = [
        r
        for r in engine.records.read(check="plan")
        if json.loads(r.detail or "{}").get("event") == "real_peak_unmeasured"
    ]
    engine.uninstall()
    return said, records


def test_a_profiler_on_every_step_is_said_once_under_a_budget():
    said, records = _train(10 * 2**20, profiled=True)
    assert len(said) == 1, said
    assert "budget" in said[0]
    assert len(records) == 1 and records[0].outcome == "rejection"
    assert json.loads(records[0].detail)["reason"] == "profiler_active"


def test_nothing_is_said_without_a_profiler_or_without_a_budget():
    assert _train(10 * 2**20, profiled=False) == ([], [])
    assert _train(None, profiled=True) == ([], [])
