"""A plan's memory promise, refereed by the allocator on one process (no FSDP, no Lightning).

What a plan's costs say recomputing a segment frees must really be freed: the bytes live when
backward begins, read from ``torch.profiler``'s CPU allocation events (nothing shared with the
engine's accountant), fall from the all-retained run by at least what the costs say. A replayed
call holds what ``torch.utils.checkpoint`` keeps for it besides its inputs, the CPU generator's
state (``preserve_rng_state=True``, 5,056 bytes); the costs charge it and the accountant holds it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from lightning_replay.accounting import checkpoint_rng_bytes
from lightning_replay.demos.hazards import BNBlock, MLPBlock

DIM = 32
BATCH = 64
STEPS = 9  # probe, one calibration step per option (up to three), then the plan in force
MARK = "test::backward_begins"


class Net(nn.Module):
    """Stateless blocks (recomputed as they are) and batch-norm blocks (running statistics
    written in the segment: replayed with their state preserved)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([MLPBlock(DIM), BNBlock(DIM), MLPBlock(DIM), BNBlock(DIM)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net_bytes_before(events: list, mark: str) -> int:
    """Bytes the CPU allocator handed out, net of frees, before the first ``mark``."""
    at = min(e.start_ns() for e in events if e.name() == mark)
    return sum(
        e.nbytes()
        for e in events
        if e.name() == "[memory]"
        and e.start_ns() < at
        and e.device_type() == torch.autograd.DeviceType.CPU
    )


def held_at_backward(**install: object) -> tuple[list[tuple[int, Any]], lr.ReplayEngine]:
    """Per step, the bytes allocated in the step and still live when backward begins (the
    step starts with no gradients and the same parameters in every run, so the runs differ
    only in what the forward left for backward), and the plan's choices at its end."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine = lr.install(model, "blocks.*", calibration_steps=1, **install)
    gen = torch.Generator().manual_seed(1)
    held = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, DIM, generator=gen)
        opt.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = (model(x) ** 2).mean()
            with torch.profiler.record_function(MARK):
                pass
            loss.backward()
        opt.step()
        choices = dict(engine.plan.choices) if engine.plan is not None else None
        held.append((_net_bytes_before(list(prof.profiler.kineto_results.events()), MARK), choices))
    return held, engine


@pytest.fixture(scope="module")
def runs() -> dict:
    retained, _ = held_at_backward(planner="retain_all", budget="min")
    planned, engine = held_at_backward(budget="min")
    return {"retained": retained, "planned": planned, "engine": engine}


def test_a_recomputed_plan_frees_at_least_what_its_costs_say(runs):
    """The lowest-memory plan replays blocks (stateless ones recomputed, batch-norm ones with
    their state preserved); the bytes live at backward's start fall from the all-retained run
    by what the plan's costs say they do: at least that (the promise), and not much more (the
    charges are what a replayed call really holds, not padding)."""
    engine = runs["engine"]
    choices = engine.plan.choices
    assert sum(o != "retain" for o in choices.values()) >= 2, choices
    assert {choices["blocks.0"], choices["blocks.2"]} == {"recompute"}, choices
    freed = sum(
        c.options["retain"].memory - c.options[choices[c.name]].memory for c in engine.costs
    )
    assert freed > 0
    # the steps that ran the final plan, from the step after it was made
    steps = [i for i in range(1, STEPS) if runs["planned"][i - 1][1] == choices]
    assert len(steps) >= 2, runs["planned"]
    real = [runs["retained"][i][0] - runs["planned"][i][0] for i in steps]
    assert min(real) >= freed, (real, freed)
    assert max(real) <= 1.05 * freed, (real, freed)


def test_the_costs_charge_the_rng_state_of_every_replayed_call(runs):
    """Each replayed option's memory is its checkpoint inputs, the generator state checkpoint
    keeps for the call, and what it preserves; a recomputed stateless block preserves
    nothing."""
    engine = runs["engine"]
    rng = torch.get_rng_state().nbytes
    for c in engine.costs:
        for option, cost in c.options.items():
            if option != "retain":
                assert cost.memory >= BATCH * DIM * 4 + rng, (c.name, option, cost)
    mlp = {c.name: c for c in engine.costs}["blocks.0"]
    assert mlp.options["recompute"].memory == BATCH * DIM * 4 + rng


def test_the_accountant_holds_the_rng_state_until_the_replay():
    """While a replayed call waits for its backward the accountant holds its inputs and the
    generator state checkpoint keeps; the replay releases both."""
    model = Net()
    engine = lr.install(model, "blocks.*", preservation="auto", track_memory=True)
    x = torch.randn(BATCH, DIM)
    (model(x) ** 2).mean().backward()  # the probe step
    acct = engine.accountant
    loss = (model(x) ** 2).mean()
    held = acct.by_tag.get("blocks.0", 0)
    assert held == BATCH * DIM * 4 + checkpoint_rng_bytes([x], "cpu"), held
    loss.backward()
    assert acct.by_tag.get("blocks.0", 0) == 0


def test_checkpoint_rng_bytes_is_what_checkpoint_keeps():
    """The referee is torch: the bytes live after a checkpointed call with
    ``preserve_rng_state=True``, less the same call without it, are the function's figure."""

    def live_after(preserve: bool) -> int:
        x = torch.randn(16, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state=preserve)
            with torch.profiler.record_function(MARK):
                pass
        del out
        return _net_bytes_before(list(prof.profiler.kineto_results.events()), MARK)

    kept = live_after(True) - live_after(False)
    assert kept == checkpoint_rng_bytes([torch.zeros(1)], "cpu") == torch.get_rng_state().nbytes
    # host bytes: nothing of an accelerator's memory
    assert checkpoint_rng_bytes([torch.zeros(1)], "cuda") == 0


# ---------------------------------------------------------------------- the real base on resume
class WideHead(Net):
    """A wide head outside the segments: its backward's gradient temporaries (64 x 1024
    floats) are memory the accountant does not count, which the measured step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(DIM, 1024), nn.Tanh(), nn.Linear(1024, 1))


def _trained_engine() -> lr.ReplayEngine:
    model = WideHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = lr.install(model, "blocks.*", calibration_steps=1, budget="min")
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        (model(torch.randn(BATCH, DIM, generator=gen)) ** 2).mean().backward()
        opt.step()
    return engine


def test_the_measured_real_base_survives_a_resume():
    """What measured steps held beyond the accountant (backward temporaries) and the base
    agreed over ranks are saved with the engine: a resumed engine plans with them from the
    start instead of re-measuring first. State dicts saved before they were kept still load."""
    engine = _trained_engine()
    phases = engine.state_dict()["unaccounted_phases"]
    # the CPU referee measured the first planned steps: the head's backward temporaries are
    # held in the forward phase (before the first replay), beyond the accountant's figures
    assert phases["forward"] > 0 and phases["replays"]
    engine.agree_real_base(engine.real_base_memory + 4096)  # a rank with a larger base
    state = engine.state_dict()

    resumed = lr.install(WideHead(), "blocks.*", calibration_steps=1, budget="min")
    assert resumed.state_dict()["unaccounted_phases"]["forward"] is None
    resumed.load_state_dict(state)
    assert resumed.state_dict()["unaccounted_phases"] == phases
    assert resumed.unaccounted_bytes == engine.unaccounted_bytes
    assert resumed.real_base_memory >= engine.real_base_memory  # the other rank's base

    old = {
        k: v
        for k, v in state.items()
        if k not in ("unaccounted_bytes", "unaccounted_phases", "ranks_base_bytes")
    }
    fresh = lr.install(WideHead(), "blocks.*", calibration_steps=1, budget="min")
    fresh.load_state_dict(old)
    assert fresh.unaccounted_bytes == 0
    assert fresh.state_dict()["unaccounted_phases"]["forward"] is None
    assert fresh.real_base_memory == fresh.base_memory
