"""The ``"flops"`` selective policy: keep a product's output only where it saves more compute
per byte than retaining the whole segment does.

Referees: the kept outputs' shapes (an eager attention's score matrix is the product it must
drop, the projections the ones it must keep), the bytes each policy's option is charged, and
plain PyTorch (no recomputation) for gradients and state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import lightning_replay as lr
from lightning_replay.contract import SELECTIVE
from lightning_replay.demos.hazards import HAZARDS
from lightning_replay.selective import (
    SelectiveFrame,
    checkpoint_kwargs,
    make_policy,
    op_flops,
    torch_sac_context_fn,
)
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    clone_model,
    snapshot_state,
    train_steps,
)

STEPS = 4
B, S, H, D = 2, 32, 4, 32  # a score matrix (S x S per head) is 8x a head's output (S x D / H)


class _EagerAttention(nn.Module):
    """Attention written out (``q @ k^T``, softmax, ``@ v``) as GPT-2 or BERT's eager path does,
    with a batch norm over the channels after it: state a replay must see as the forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.norm = nn.BatchNorm1d(D)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.reshape(B, S, H, D // H).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        att = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, S, D)
        x = x + self.out(att)
        x = x + self.down(torch.tanh(self.up(x)))
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_EagerAttention(), _EagerAttention())


def _input(step: int) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(step))


def _saved_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """A(s): the bytes autograd saves in a plain forward of ``block`` (each storage once)."""
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def _kept_shapes(frame: SelectiveFrame) -> list[tuple]:
    return sorted(tuple(t.shape) for t in frame.kept_tensors())


def _frame_forward(block, x, policy, density=None) -> tuple[SelectiveFrame, torch.Tensor]:
    frame = SelectiveFrame(policy, density=density)
    x = x.clone().requires_grad_()
    y = checkpoint(block, x, use_reentrant=False, context_fn=frame.contexts, **checkpoint_kwargs())
    return frame, y


SCORES = (B * H, S, S)


def test_the_score_product_is_dropped_and_the_projections_kept():
    block = _model()[0]
    x = _input(0)
    act = _saved_bytes(block, x)
    matmul, _ = _frame_forward(block, x, "matmul")
    assert SCORES in _kept_shapes(matmul)  # torchtitan's list keeps every product
    first, y = _frame_forward(block, x, "flops")
    assert SCORES in _kept_shapes(first)  # no density yet: every candidate, until settled
    density = first.settle(act)
    assert density == pytest.approx(first.flops / act)
    kept = _kept_shapes(first)
    assert SCORES not in kept
    # the four linears' outputs and the attention's value product stay
    assert (B * S, 3 * D) in kept and (B * S, 4 * D) in kept and (B * H, S, D // H) in kept
    assert first.kept_bytes() < matmul.kept_bytes()
    y.sum().backward()  # the dropped output's op runs again at the replay
    # a frame that knows the density decides as each op runs: the same outputs, no pruning
    second, y2 = _frame_forward(block, x, "flops", density)
    assert _kept_shapes(second) == kept
    assert second.settle(act) == pytest.approx(density)
    y2.sum().backward()


def test_flops_are_torchs_formulas():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert op_flops(torch.ops.aten.mm.default, (a, b), {}, a @ b) == 2 * 8 * 16 * 4
    # no output known (torch before 2.9 asks a policy before the op runs): no figure
    assert op_flops(torch.ops.aten.mm.default, (a, b), {}, None) is None
    # an op with no formula
    assert op_flops(torch.ops.aten.tanh.default, (a,), {}, a.tanh()) is None


class _Ctx:
    def __init__(self, out):
        self.op_output = out


def test_the_policy_compares_an_ops_flops_per_byte_with_the_density():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    out = a @ b
    dense = 2 * 8 * 16 * 4 / out.nbytes  # 16 flops per byte
    mm = torch.ops.aten.mm.default
    keep, drop = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert make_policy("flops", dense)(_Ctx(out), mm, a, b) == keep
    assert make_policy("flops", dense * 1.01)(_Ctx(out), mm, a, b) == drop
    assert make_policy("flops")(_Ctx(out), mm, a, b) == keep  # no density: every candidate
    assert make_policy("flops", 1e12)(None, mm, a, b) == keep  # no output known
    assert make_policy("flops", 0.0)(_Ctx(a.tanh()), torch.ops.aten.tanh.default, a) == drop


def _engine_run(policy: str, steps: int = STEPS):
    model = _model()
    engine = lr.install(model, ["0", "1"], budget=2**60, selective=policy, real_peak=False)
    grads = []
    for step in range(engine.steps_to_first_plan + steps):
        model(_input(step)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return model, engine, grads


def test_the_engine_charges_the_flops_option_less_memory_and_stays_exact():
    ref = _model()
    model, engine, grads = _engine_run("flops")
    _, matmul_engine, _ = _engine_run("matmul")
    # the score matrices (4 bytes x B*H*S*S per block) are what "flops" does not keep
    scores = 4 * B * H * S * S
    for name in ("0", "1"):
        assert engine.runtimes[name].sac_density is not None
        flops_kept = engine.meter.selective_bytes[name]
        assert flops_kept == matmul_engine.meter.selective_bytes[name] - scores
        options = {c.name: c.options for c in engine.costs}[name]
        assert any(o in SELECTIVE for o in options)
    # plain PyTorch, the same steps: every step's gradients equal, bit for bit
    for step, g in enumerate(grads):
        ref(_input(step)).sum().backward()
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, g[n]), (step, n)
        ref.zero_grad(set_to_none=True)
    assert_same_state(snapshot_state(ref), snapshot_state(model), "eager attention")
    # the plan's selective options, pinned, replay exactly too
    pins = {c.name: next(o for o in c.options if o in SELECTIVE) for c in engine.costs}
    engine.set_options(pins)
    for step in range(2):
        model(_input(100 + step)).sum().backward()
        ref(_input(100 + step)).sum().backward()
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, dict(model.named_parameters())[n].grad), n
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert all(s["mode"] in SELECTIVE for s in engine.summary().values())


def test_torchs_sac_with_the_density_drops_the_same_product():
    block = _model()[0]
    x = _input(0)
    first, _ = _frame_forward(block, x, "flops")
    density = first.settle(_saved_bytes(block, x))
    count = {"bmm": 0}

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:
                count["bmm"] += 1
            return func(*args, **(kwargs or {}))

    for density_, recomputed in ((None, 0), (density, 1)):
        xi = x.clone().requires_grad_()
        y = checkpoint(
            block,
            xi,
            use_reentrant=False,
            context_fn=torch_sac_context_fn("flops", density_),
            **checkpoint_kwargs(),
        )
        count["bmm"] = 0
        with Count():
            y.sum().backward()
        # backward's own bmm: two per product (4); the replay adds the products it recomputes
        assert count["bmm"] == 4 + recomputed, (density_, count)


@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_the_flops_policy_replays_every_hazard_exactly(hazard):
    h = HAZARDS[hazard]()
    ref = clone_model(h.model)
    g_ref, _ = train_steps(ref, h.make_input, STEPS)
    model = clone_model(h.model)
    engine = lr.install(model, h.segments, preservation="selective", selective="flops")
    g_rep, _ = train_steps(model, h.make_input, STEPS)
    summary = engine.summary()
    engine.uninstall()
    assert_same_grads(g_ref, g_rep, hazard)
    assert_same_state(snapshot_state(ref), snapshot_state(model), hazard)
    for name, s in summary.items():
        assert s["mode"] in SELECTIVE, (name, s)
        assert s["violations"] == 0


def test_checked_steps_under_the_flops_policy_find_nothing_and_stay_exact():
    ref, model = _model(), _model()
    engine = lr.install(model, ["0", "1"], preservation="selective", selective="flops")
    for step in range(STEPS):
        if step >= 1:  # after the probe: every step checked, derivatives and bytes
            engine.request_check(grad=True, bytes=True)
        model(_input(step)).sum().backward()
        ref(_input(step)).sum().backward()
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, dict(model.named_parameters())[n].grad), (step, n)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    summary = engine.summary()
    assert all(s["checks"] >= STEPS - 2 and s["divergences"] == 0 for s in summary.values())
    assert all(engine.runtimes[n].sac_density is not None for n in ("0", "1"))
    assert_same_state(snapshot_state(ref), snapshot_state(model), "eager attention")


def test_a_pruned_output_is_freed_at_the_forwards_end():
    """The score matrix the first frame kept until it knew the density is dropped by
    ``settle``: nothing holds it after (a reference would hide it from the byte accounting)."""
    import gc
    import weakref

    block = _model()[0]
    x = _input(0)
    act = _saved_bytes(block, x)
    frame, y = _frame_forward(block, x, "flops")
    scores = [weakref.ref(t) for t in frame.kept_tensors() if tuple(t.shape) == SCORES]
    assert scores  # kept until the forward's end
    frame.settle(act)
    gc.disable()
    try:
        assert all(r() is None for r in scores)
    finally:
        gc.enable()
    y.sum().backward()


class _KeyMemoryAttention(_EagerAttention):
    """Attention over its keys and a memory of past keys (a buffer rebound after every step,
    outside the segment): only the score product reads the memory, and "flops" recomputes that
    product at replay, where "matmul" kept it."""

    def __init__(self) -> None:
        super().__init__()
        del self.norm  # (no batch norm here: the memory is the state)
        self.register_buffer("memory", torch.randn(B, H, 4, D // H))

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.reshape(B, S, H, D // H).transpose(1, 2) for t in (q, k, v))
        keys = torch.cat([k, self.memory], dim=2)
        scores = q @ keys.transpose(-1, -2) / (D // H) ** 0.5
        att = torch.softmax(scores, dim=-1)[..., :S] @ v
        x = x + self.out(att.transpose(1, 2).reshape(B, S, D))
        return x + self.down(torch.tanh(self.up(x)))


def test_state_only_a_recomputed_product_reads_is_the_forwards_at_replay():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(_KeyMemoryAttention(), _KeyMemoryAttention())

    ref, model = build(), build()
    engine = lr.install(model, ["0", "1"], preservation="selective", selective="flops")
    for step in range(STEPS):
        for m in (ref, model):
            m(_input(step)).sum().backward()
            for blk in m:  # rebound after the backward's replays... and before them, below
                blk.memory = torch.randn(
                    B, H, 4, D // H, generator=torch.Generator().manual_seed(step)
                )
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, dict(model.named_parameters())[n].grad), (step, n)
    # rebound between the forward and the backward: the replay must see the forward's memory
    for step in range(STEPS, STEPS + 3):
        losses = [m(_input(step)).sum() for m in (ref, model)]
        for m in (ref, model):
            for blk in m:
                blk.memory = blk.memory * 2.0
        for loss in losses:
            loss.backward()
        for n, p in ref.named_parameters():
            assert torch.equal(p.grad, dict(model.named_parameters())[n].grad), (step, n)
    assert all(engine.runtimes[n].sac_density is not None for n in ("0", "1"))
    assert all(s["mode"] in SELECTIVE and s["replays"] > 0 for s in engine.summary().values())
