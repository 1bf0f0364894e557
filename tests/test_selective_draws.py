"""Random draws under the selective option: a dropout mask drawn in place is kept (one byte an
element) and the replay copies it instead of drawing; a kept op that draws (an attention
kernel with dropout) keeps its generator's state after the draw, and the replay sets it.

Referees: plain PyTorch (no recomputation), gradients every step, bit for bit; the random ops
that run at a replay, counted by a dispatch mode around backward (a mask kept is not drawn
again); a random op *after* a kept one in the same segment, which draws what the forward drew
only if the generator was set where the forward's draw left it (without that the gradients
differ: checked by breaking it in ``test_the_generator_is_set_after_a_kept_mask``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from lightning_replay.selective import SelectiveFrame, checkpoint_kwargs
from tests.helpers.compare import assert_same_grads, clone_model, grad_diffs, train_steps

STEPS = 4


class _Draws(TorchDispatchMode):
    """Counts the random ops (tagged seeded) that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class DropBlock(nn.Module):
    """A linear, dropout (decomposed on the CPU: ``bernoulli_`` into a mask), a tanh."""

    def __init__(self, d: int = 16, p: float = 0.3) -> None:
        super().__init__()
        self.fc, self.p = nn.Linear(d, d), p

    def forward(self, x):
        return x + torch.tanh(F.dropout(self.fc(x), self.p, self.training))


class DropThenNoise(DropBlock):
    """A kept mask, then a draw nobody keeps (``rand_like``): it must draw the forward's
    numbers at the replay, so the generator must be where the forward's mask left it."""

    def forward(self, x):
        h = F.dropout(self.fc(x), self.p, self.training)
        return x + torch.tanh(h) * torch.rand_like(h)


class AttnDrop(nn.Module):
    """Attention with dropout in the kernel (a kept op that draws), a dropout, noise after."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        h = F.dropout(self.out(a), 0.2)
        return x + h * (1 + torch.randn_like(h))


class OwnGenerator(DropBlock):
    """A mask drawn from the module's own generator: not the default one, never kept (the
    engine preserves the generator itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x):
        h = self.fc(x)
        mask = torch.empty_like(h).bernoulli_(0.7, generator=self.gen)
        return x + torch.tanh(h * mask)


MODELS = {
    "dropout": lambda: nn.Sequential(DropBlock(), DropBlock(), nn.Linear(16, 1)),
    "dropout_then_noise": lambda: nn.Sequential(DropThenNoise(), DropThenNoise()),
    "attention_dropout": lambda: nn.Sequential(AttnDrop(), AttnDrop()),
    "own_generator": lambda: nn.Sequential(OwnGenerator(), DropBlock()),
}


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, 96, 16, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("policy", ["matmul", "flops", "every_other_matmul"])
@pytest.mark.parametrize("name", list(MODELS))
def test_selective_with_draws_is_exact(name, policy):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = clone_model(model)
    g_ref, _ = train_steps(ref, _x, STEPS)
    rep = clone_model(model)
    engine = lr.install(rep, ["0", "1"], preservation="selective", selective=policy)
    engine.request_check()  # a derivative and byte check on the first window too
    g_rep, _ = train_steps(rep, _x, STEPS)
    assert_same_grads(g_ref, g_rep, name)
    assert {s["mode"] for s in engine.summary().values()} == {"selective"}
    bad = [r for r in engine.records.read() if r.outcome in ("divergence", "rejection")]
    assert not bad, bad
    engine.uninstall()


def _frame_run(block: nn.Module, x: torch.Tensor, seed: int = 5):
    """One checkpointed call of ``block`` under a frame; the random ops its replay ran."""
    frame = SelectiveFrame("matmul")
    torch.manual_seed(seed)
    y = checkpoint(
        block,
        x,
        use_reentrant=False,
        context_fn=frame.contexts,
        preserve_rng_state=True,
        **checkpoint_kwargs(),
    )
    kept = [(t.dtype, tuple(t.shape)) for t in frame.kept_tensors()]
    draws = _Draws()
    with draws:
        y.sum().backward()
    return y, kept, draws.ops


def test_a_mask_is_kept_as_bool_and_not_drawn_again():
    torch.manual_seed(0)
    block = DropBlock()
    x = torch.randn(4, 96, 16, requires_grad=True)
    _, kept, replayed = _frame_run(block, x)
    assert (torch.bool, (4, 96, 16)) in kept  # the mask, one byte an element
    assert not [op for op in replayed if "bernoulli" in op], replayed
    # a plain checkpoint (no frame) draws it again: the counter sees draws
    draws = _Draws()
    y = checkpoint(block, x, use_reentrant=False)
    with draws:
        y.sum().backward()
    assert [op for op in draws.ops if "bernoulli" in op]


def test_the_generator_is_set_after_a_kept_mask(monkeypatch):
    """The mask kept and copied, but the generator left where the replay began: the noise drawn
    after it differs from the forward's and so do the gradients (the failure the frame's
    ``set_state`` prevents; the referee sees it)."""
    torch.manual_seed(0)
    block = DropThenNoise()
    x = torch.randn(4, 96, 16)

    def grads(frame_ctx) -> list[torch.Tensor]:
        block.zero_grad()
        torch.manual_seed(7)
        y = checkpoint(block, x, use_reentrant=False, context_fn=frame_ctx, **checkpoint_kwargs())
        y.sum().backward()
        return [p.grad.clone() for p in block.parameters()]

    torch.manual_seed(7)
    block.zero_grad()
    block(x).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()]
    good = grads(SelectiveFrame("matmul").contexts)
    assert all(torch.equal(a, b) for a, b in zip(plain, good))

    from lightning_replay.core.mechanisms import selective

    real = selective._KeptReplay._mask

    def without_state(self, func, args, kwargs):
        frame = self.frame
        key = selective._sac_storage_key(func, args)
        kept = frame._drawn.get((key, self.counter[key]))
        if kept is not None:  # drop the state: the generator stays where the replay is
            frame._drawn[(key, self.counter[key])] = (
                kept[0],
                kept[1],
                kept[1].get_state(),
                kept[3],
            )
        return real(self, func, args, kwargs)

    monkeypatch.setattr(selective._KeptReplay, "_mask", without_state)
    broken = grads(SelectiveFrame("matmul").contexts)
    assert not all(torch.equal(a, b) for a, b in zip(plain, broken))


def test_torch_sac_arm_still_recomputes_draws():
    """The baseline's policy (torch's modes cannot set a generator) keeps no op that draws."""
    from lightning_replay.selective import make_policy

    p = make_policy("matmul")
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 2, 4)
    assert p(None, sdpa, q, q, q, 0.3).name == "PREFER_RECOMPUTE"
    assert make_policy("matmul", draws=True)(None, sdpa, q, q, q, 0.3).name == "MUST_SAVE"


class NativeDropThenNoise(nn.Module):
    """``native_dropout`` (one op that draws and returns the output and its mask), then noise
    drawn after it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h, _ = torch.ops.aten.native_dropout(self.fc(x), 0.3, True)
        return x + torch.tanh(h) * torch.rand_like(h)


def test_a_kept_op_that_draws_sets_the_generator_at_the_replay(monkeypatch):
    """On the CPU no kept op draws (its flash attention refuses dropout); a CUDA attention
    kernel with dropout does. Stand-in: ``native_dropout`` added to the kept ops. Its output is
    kept and the noise drawn after it at the replay is the forward's only if the generator was
    set after the kept op (without it the gradients differ: shown by breaking it)."""
    from lightning_replay.core.mechanisms import selective

    op = torch.ops.aten.native_dropout.default
    monkeypatch.setattr(selective, "SAVED_OPS", selective.SAVED_OPS | {op})
    torch.manual_seed(0)
    model = nn.Sequential(NativeDropThenNoise(), NativeDropThenNoise())
    ref = clone_model(model)
    g_ref, _ = train_steps(ref, _x, STEPS)

    def run():
        rep = clone_model(model)
        engine = lr.install(rep, ["0", "1"], preservation="selective", selective="matmul")
        g_rep, _ = train_steps(rep, _x, STEPS)
        engine.uninstall()
        return g_rep

    frame = SelectiveFrame("matmul")
    x = torch.randn(4, 96, 16, requires_grad=True)
    checkpoint(model[0], x, use_reentrant=False, context_fn=frame.contexts, **checkpoint_kwargs())
    assert frame._post, "native_dropout was not kept with its generator's state"
    assert_same_grads(g_ref, run())
    real = selective._KeptReplay.__torch_dispatch__

    def no_post(self, func, types, args=(), kwargs=None):
        self.frame._post.clear()  # the kept op stands in, the generator is not set
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(selective._KeptReplay, "__torch_dispatch__", no_post)
    assert grad_diffs(g_ref, run())
