"""The selective option: recompute only the cheap ops, keep the expensive ones' outputs, and
stay exact where torch's own selective checkpoint is not.

The referee is plain PyTorch (no recomputation): gradients every step and all state after.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from lightning_replay import planner
from lightning_replay.contract import SELECTIVE
from lightning_replay.demos.hazards import HAZARDS
from lightning_replay.selective import (
    POLICIES,
    SAVED_OPS,
    SelectiveFrame,
    make_policy,
    torch_sac_context_fn,
    torch_sac_op_list,
)
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    clone_model,
    diff_state,
    grad_diffs,
    snapshot_state,
    train_steps,
)

STEPS = 4
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def run_selective(hazard: str, policy: str = "matmul", steps: int = STEPS):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, steps)
    model = clone_model(h.model)
    engine = lr.install(model, h.segments, preservation="selective", selective=policy)
    g_rep, _ = train_steps(model, h.make_input, steps)
    summary = engine.summary()
    engine.uninstall()
    return ref, model, g_ref, g_rep, summary


@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_selective_replays_every_hazard_exactly(hazard):
    ref, model, g_ref, g_rep, summary = run_selective(hazard)
    assert_same_grads(g_ref, g_rep, hazard)
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
    for name, s in summary.items():
        assert s["mode"] in SELECTIVE, (name, s)
        assert s["replays"] >= STEPS - 2, (name, s)  # the probe, a flag's re-probe
        assert s["violations"] == 0


@pytest.mark.parametrize("hazard", ["batch_norm", "queue", "rng", "bank_scatter", "combined"])
def test_every_other_matmul_is_exact_too(hazard):
    ref, model, g_ref, g_rep, summary = run_selective(hazard, "every_other_matmul")
    assert_same_grads(g_ref, g_rep, hazard)
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
    assert all(s["mode"] in SELECTIVE for s in summary.values())


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


class _TwoProducts(nn.Module):
    """Both products' outputs are saved by the op after them, so a full replay runs both."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


def _backward_ops(preservation: str, policy: str | None) -> tuple[int, int]:
    """Matrix products and tanh ops run inside one steady step's backward (the replays and
    the backward's own products) of three blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(_TwoProducts(), _TwoProducts(), _TwoProducts())
    lr.install(model, ["0", "1", "2"], preservation=preservation, selective=policy)
    for step in range(2):
        model(torch.randn(8, 16)).sum().backward()
    out = model(torch.randn(8, 16)).sum()
    with _CountOps() as mode:
        out.backward()
    mm = sum(n for f, n in mode.counts.items() if f in MATMULS)
    return mm, mode.counts.get(torch.ops.aten.tanh.default, 0)


def test_selective_recomputes_the_cheap_ops_and_keeps_the_products():
    full_mm, full_tanh = _backward_ops("auto", None)
    sel_mm, sel_tanh = _backward_ops("selective", "matmul")
    half_mm, half_tanh = _backward_ops("selective", "every_other_matmul")
    blocks = 3
    # a full replay runs each block's two linears again; a selective one runs none of them,
    # every other one runs one per block; each replays both tanh
    assert full_mm - sel_mm == 2 * blocks, (full_mm, sel_mm)
    assert full_mm - half_mm == blocks, (full_mm, half_mm)
    assert full_tanh == sel_tanh == half_tanh == 2 * blocks


def test_kept_bytes_are_the_kept_outputs_and_charged_to_the_option():
    h = HAZARDS["stateless"]()
    model = h.model
    engine = lr.install(model, h.segments, budget=10**9, selective="matmul", real_peak=False)
    for step in range(engine.steps_to_first_plan + 1):
        model(h.make_input(step)).sum().backward()
    # each block keeps its two linear outputs: (8 x 32) and (8 x 16) floats
    kept = 4 * (8 * 32 + 8 * 16)
    assert engine.meter.selective_bytes == {n: kept for n in h.segments}
    for c in engine.costs:
        assert set(c.options) == {"retain", "recompute", "selective"}
        assert c.options["selective"].memory == c.options["recompute"].memory + kept
        # of the kept outputs, autograd saves neither (tanh saves its own output; the second
        # product is added): the replay re-materializes all of the activations and consumes
        # every kept output as it goes (issue 30): it adds the activations less the kept bytes
        assert c.options["selective"].replay == max(c.activation_bytes - kept, 0)
        assert c.options["selective"].time > 0
    engine.uninstall()


# ---------------------------------------------------------------- torch's own SAC
def _torch_sac(model: nn.Module, names: list[str], policy: str = "matmul") -> nn.Module:
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward

        def wrapped(*args, _fwd=fwd, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(
                _fwd, *args, use_reentrant=False, context_fn=torch_sac_context_fn(policy), **kwargs
            )

        mod.forward = wrapped
    return model


def test_torch_sac_updates_batch_norm_stats_twice_where_selective_is_exact():
    h = HAZARDS["batch_norm"]()
    ref = clone_model(h.model)
    train_steps(ref, h.make_input, STEPS)
    sac = _torch_sac(clone_model(h.model), h.segments)
    train_steps(sac, h.make_input, STEPS)
    wrong = diff_state(snapshot_state(ref), snapshot_state(sac))
    assert any(n.endswith("running_mean") for n in wrong), wrong
    assert int(snapshot_state(sac)["blocks.0.bn.num_batches_tracked"]) == 2 * STEPS
    ref2, model, _, _, _ = run_selective("batch_norm")
    assert diff_state(snapshot_state(ref2), snapshot_state(model)) == []


@pytest.mark.parametrize("hazard", ["queue", "bank_scatter", "counter", "rng"])
def test_torch_sac_gradients_are_silently_wrong_where_selective_is_exact(hazard):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, STEPS)
    sac = _torch_sac(clone_model(h.model), h.segments)
    g_sac, _ = train_steps(sac, h.make_input, STEPS)  # no error raised: silently wrong
    assert grad_diffs(g_ref, g_sac)
    _, _, g_ref2, g_rep, _ = run_selective(hazard)
    assert grad_diffs(g_ref2, g_rep) == []


class _AttnDropBlock(nn.Module):
    """Attention with dropout inside the kernel, then a dropout after it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        return x + F.dropout(self.out(a), 0.3)


def test_a_block_that_draws_random_numbers_replays_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(_AttnDropBlock(), _AttnDropBlock())

    def make(step: int) -> torch.Tensor:
        return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(step))

    ref = clone_model(model)
    g_ref, _ = train_steps(ref, make, STEPS)
    rep = clone_model(model)
    lr.install(rep, ["0", "1"], preservation="selective")
    g_rep, _ = train_steps(rep, make, STEPS)
    assert_same_grads(g_ref, g_rep)
    # torch's policy (the baseline's) keeps the attention kernel only without dropout; the
    # engine's frames keep it with its generator's state (tests/test_selective_draws.py)
    p = make_policy("matmul")
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 2, 4)
    assert p(None, sdpa, q, q, q, 0.0).name == "MUST_SAVE"
    assert p(None, sdpa, q, q, q, 0.3).name == "PREFER_RECOMPUTE"


def test_policies_and_lists():
    assert POLICIES == ("matmul", "every_other_matmul", "flops")
    assert torch.ops.aten.mm.default in SAVED_OPS
    assert torch.ops.aten.convolution.default in SAVED_OPS
    assert torch.ops.aten.tanh.default not in SAVED_OPS
    assert set(torch_sac_op_list()) == SAVED_OPS
    with pytest.raises(ValueError, match="every_other_matmul"):
        make_policy("every_matmul")
    with pytest.raises(lr.ReplayConfigError, match="selective='fast'"):
        lr.install(nn.Sequential(nn.Linear(2, 2)), ["0"], selective="fast")


def test_selective_frame_counts_each_kept_storage_once():
    lin = nn.Linear(4, 8)
    frame = SelectiveFrame("matmul")
    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(
        lambda t: torch.relu(lin(t)) * 2, x, use_reentrant=False, context_fn=frame.contexts
    )
    assert frame.kept_bytes() == 3 * 8 * 4
    y.sum().backward()


def test_the_planner_takes_selective_where_it_is_faster_under_the_budget():
    # a selective replay holds more than a full one and costs less time
    costs = [
        planner.SegmentCost(
            f"b{i}",
            100,
            {
                "retain": planner.Option(100, 0.0),
                "recompute": planner.Option(10, 1.0),
                "selective": planner.Option(40, 0.2),
            },
        )
        for i in range(3)
    ]
    tight = planner.plan(costs, budget=130)
    assert "selective" not in tight.choices.values()  # only full replays fit
    mid = planner.plan(costs, budget=220)
    assert "selective" in mid.choices.values()
    without = [
        planner.SegmentCost(
            c.name, c.activation_bytes, {k: v for k, v in c.options.items() if k != "selective"}
        )
        for c in costs
    ]
    assert mid.extra_time < planner.plan(without, budget=220).extra_time
    assert set(planner.plan(costs, budget=10**6, method="selective_all").choices.values()) == {
        "selective"
    }


class _GeluBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_a_kept_output_that_backward_saves_is_not_rematerialized_again():
    torch.manual_seed(0)
    model = nn.Sequential(_GeluBlock(), _GeluBlock())
    engine = lr.install(model, ["0", "1"], budget=10**9, selective="matmul", real_peak=False)
    for _ in range(engine.steps_to_first_plan + 1):
        model(torch.randn(8, 16)).sum().backward()
    first, second = 4 * 8 * 32, 4 * 8 * 16  # the two products' outputs
    for c in engine.costs:
        sel, full = c.options["selective"], c.options["recompute"]
        assert sel.memory == full.memory + first + second
        # gelu saves its input, the first product's output: kept, so not replayed again; the
        # second (added, not saved) is consumed as the replay uses it (issue 30)
        assert engine.meter.selective_saved_bytes[c.name] == first
        assert sel.replay == c.activation_bytes - first - second
    engine.uninstall()


def test_a_selective_forward_pays_for_its_caching_mode():
    """The caching mode runs in the segment's own forward, which no option's replay time
    includes: the meter charges a selective option the difference of the forward medians."""
    from lightning_replay.costs import CostMeter

    meter = CostMeter()
    assert meter.forward_extra("b", "selective") == 0.0  # nothing timed yet
    for t in (1.0, 1.2, 1.1):
        meter.add_option_forward("b", "recompute", t)
    for t in (1.5, 1.4, 1.6):
        meter.add_option_forward("b", "selective", t)
    assert meter.forward_extra("b", "selective") == pytest.approx(0.4)
    meter.add_option_forward("c", "whole", 2.0)
    meter.add_option_forward("c", "selective_whole", 1.0)
    assert meter.forward_extra("c", "selective_whole") == 0.0  # faster: noise, not a saving


def test_a_segment_timed_once_a_side_takes_the_caching_cost_pooled_over_segments():
    """At the default calibration steps a segment's forward is timed once or twice a side;
    one forward's noise is the size of the caching mode's cost (measured: 2.0-5.6 ms on four
    identical Llama blocks, in a run that charged ~0 to some). Below three a side, the ratio of
    medians is pooled over the segments timed both ways."""
    from lightning_replay.costs import CostMeter

    meter = CostMeter()
    for seg in ("a", "b", "c"):
        for t in (10.0, 10.2, 9.8):
            meter.add_option_forward(seg, "recompute", t / 1e3)
        for t in (13.0, 13.1, 12.9):
            meter.add_option_forward(seg, "selective", t / 1e3)
    # d: one noisy forward a side, the selective one even faster
    meter.add_option_forward("d", "recompute", 20.0 / 1e3)
    meter.add_option_forward("d", "selective", 19.5 / 1e3)
    assert meter.forward_extra("a", "selective") == pytest.approx(3.0e-3)  # its own, as before
    # pooled ratio 1.3 (a, b, c) applied to d's own full-replay forward
    assert meter.forward_extra("d", "selective") == pytest.approx(0.3 * 20.0e-3)
    # e: its selective forward ran only in capture-sampled steps (not timed alone)
    meter.add_option_forward("e", "whole", 5.0 / 1e3)
    assert meter.forward_extra("e", "selective") == pytest.approx(0.3 * 5.0e-3)


@pytest.mark.parametrize("bias", [True, False])
def test_a_replay_that_stops_early_leaves_no_kept_output_behind(bias):
    """Checkpoint stops a replay once backward has every tensor it saves: a block ending in a
    product (whose input is the last tensor saved, packed before the product runs) never
    reaches that product's call. Its kept output goes with the replay, not with the frame,
    which lives as long as the checkpoint's graph (measured: a Llama's four blocks all
    selective peaked 4 MiB higher, 48.7 against 44.7 MiB; torch's own SAC 45.2)."""
    from lightning_replay.selective import checkpoint_kwargs

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32, bias=bias), nn.Linear(32, 16, bias=bias)

    def block(x):
        return x + fc2(torch.relu(fc1(x)))

    x = torch.randn(8, 16, requires_grad=True)
    frame = SelectiveFrame("matmul")
    out = checkpoint(
        block, x, use_reentrant=False, context_fn=frame.contexts, **checkpoint_kwargs()
    )
    assert len(frame.kept_tensors()) == 2  # both products kept by the forward
    out.sum().backward()
    assert frame.kept_tensors() == []
    # and the gradients are plain PyTorch's
    ref_x = x.detach().clone().requires_grad_()
    grads = torch.autograd.grad(block(ref_x).sum(), [ref_x, fc1.weight, fc2.weight])
    assert torch.equal(grads[0], x.grad)
