"""Derivative-checked steps train exactly as plain PyTorch.

A checked step keeps the segment's own graph for training and checks a replay beside it
(:mod:`lightning_replay.checks`). Each model below is one way a check could change training:
a tensor that feeds the segment several times and later layers too (its gradient is a sum whose
order must be autograd's), a parameter two segments share, bf16 autocast (its cast cache decides
how many casts there are), the model's own checkpoint with batch norm inside a segment (its
recomputation writes running statistics), a tensor taken out of the segment by a hook, an
in-place write to the segment's output, outputs that alias, and structured outputs. Every test
trains a plain copy and an installed copy with checks on every step after the probe, and
asserts bit-identical gradients at every step, identical state after, and check records that
all say ``match``. The last tests make a replay really differ: the check records it, and
training stays exact all the same.
"""

from __future__ import annotations

import copy
import functools
import json
import operator
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr
from tests.helpers.compare import diff_state, grad_diffs, snapshot_state

D = 8
B = 6
STEPS = 5
CHECKED = (1, 2, 3, 4)  # every step after the probe (step 0)

StepFn = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]


def _loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _train(
    model: nn.Module,
    step_fn: StepFn,
    engine: lr.ReplayEngine | None = None,
    checks: tuple[int, ...] = CHECKED,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    grads = []
    for step in range(STEPS):
        if engine is not None and step in checks:
            engine.request_check()
        x = torch.randn(B, D, generator=data)
        torch.manual_seed(100 + step)
        opt.zero_grad(set_to_none=True)
        step_fn(model, x, step).backward()
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
    return grads


def assert_checked_exact(
    factory: Callable[[], nn.Module],
    segments: list[str],
    step_fn: StepFn = _loss,
    checked: list[str] | None = None,
    outcome: str = "match",
) -> list[lr.Record]:
    """Plain and installed copies trained alike, every step after the probe derivative-checked:
    the same gradients at every step and the same state after, bit for bit. With ``outcome``
    ``"match"``, the ``checked`` segments (default: all) have a grad record at every checked
    step and every grad and bytes record says match. Returns the records."""
    torch.manual_seed(0)
    base = factory()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, step_fn)
    engine = lr.install(model, segments)
    try:
        g_rep = _train(model, step_fn, engine)
        records = engine.records.read()
    finally:
        engine.uninstall()
    assert grad_diffs(g_ref, g_rep) == []
    assert diff_state(snapshot_state(ref), snapshot_state(model)) == []
    checks = [r for r in records if r.check in ("grad", "bytes")]
    if outcome == "match":
        grad = {(r.step, r.segment) for r in checks if r.check == "grad"}
        expected = {(s + 1, n) for s in CHECKED for n in checked or segments}  # steps from 1
        assert expected <= grad, sorted(expected - grad)
        assert all(r.outcome == "match" for r in checks), [
            (r.step, r.segment, r.check, r.detail) for r in checks if r.outcome != "match"
        ]
    return records


# ------------------------------------------------------------------------------ fan-out
class CrossBlock(nn.Module):
    """A decoder layer's use of encoder states ``e``: three times (keys, values, a gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.g = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.q(h) + self.k(e)) * self.v(e) + torch.sigmoid(self.g(e))


class FanOut(nn.Module):
    """Encoder states feed every block and the head: gradients summed from many places."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.blocks = nn.ModuleList([CrossBlock() for _ in range(3)])
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.tanh(self.enc(x))
        h = x
        for b in self.blocks:
            h = b(h, e)
        return h * self.head(e)


def test_input_used_many_times_inside_and_after_the_segment():
    assert_checked_exact(FanOut, ["blocks.0", "blocks.1", "blocks.2"])


class TwiceTied(nn.Module):
    """Two linear maps with one weight: the weight's gradient is a sum inside the segment."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class SharedParam(nn.Module):
    """Two segments and the head share one weight, used twice in each segment."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TwiceTied() for _ in range(2)])
        shared = self.blocks[0].a.weight
        self.blocks[1].a.weight = self.blocks[1].b.weight = shared
        self.head = nn.Linear(D, D)
        self.head.weight = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_parameter_shared_by_two_segments():
    assert_checked_exact(SharedParam, ["blocks.0", "blocks.1"])


# ------------------------------------------------------------------------------ autocast
class Attention(nn.Module):
    """q, k and v of one float32 input: under autocast, three casts of it (it is no leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.q(x) @ self.k(x).transpose(0, 1), dim=-1)
        return x + (a @ self.v(x)).float()


class AutocastNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Attention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x).float()  # float32 into the blocks, as after a LayerNorm
        for b in self.blocks:
            h = b(h)
        return h


def _autocast_loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return out.float().pow(2).mean()


def _uncached_autocast_loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # Lightning's
        out = model(x)
    return out.float().pow(2).mean()


@pytest.mark.parametrize("step_fn", [_autocast_loss, _uncached_autocast_loss])
def test_bf16_autocast_with_an_input_used_three_times(step_fn):
    assert_checked_exact(AutocastNet, ["blocks.0", "blocks.1"], step_fn)


# ------------------------------------------------------------------------------ nested checkpoint
class CheckpointedNorm(nn.Module):
    """torchvision's DenseNet(memory_efficient=True) layer: its own checkpoint around a BN."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.lin = nn.Linear(D, D)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(checkpoint(self._norm, x, use_reentrant=False))


def test_the_models_own_checkpoint_with_batch_norm_inside_a_segment():
    records = assert_checked_exact(
        lambda: nn.Sequential(CheckpointedNorm(), CheckpointedNorm()), ["0", "1"]
    )
    assert records  # running statistics and num_batches_tracked compared by the harness


# ------------------------------------------------------------------------------ side channel
class Routed(nn.Module):
    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(D, D)
        self.ff = nn.Linear(D, D)
        self.routed = routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.routed:  # an MoE router: the output uses the logits too
            return x + torch.tanh(self.ff(x)) * logits.sigmoid()
        return x + torch.tanh(self.ff(x))


class SideChannel(nn.Module):
    """Each gate's output is taken by a forward hook, as HF's output_router_logits does, and
    goes into the loss."""

    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Routed(routed) for _ in range(2)])
        self._sink: list[torch.Tensor] = []
        for b in self.blocks:
            b.gate.register_forward_hook(self._take)  # bound: a deep copy takes its own

    def _take(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self._sink.append(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._sink.clear()
        h = self.enc(x)
        for b in self.blocks:
            h = b(h)
        return h.pow(2).mean() + 0.1 * sum(t.pow(2).mean() for t in self._sink)


def _own_loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    return model(x)


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "side-channel-only"])
def test_a_hook_takes_a_tensor_out_of_the_segment_into_the_loss(routed):
    assert_checked_exact(lambda: SideChannel(routed), ["blocks.0", "blocks.1"], _own_loss)


# ------------------------------------------------------------------------------ outputs
class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(x))


class InPlaceAfter(nn.Module):
    """The step writes each segment's output in place (a residual ``+=``, a scale ``mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual() for _ in range(3)])
        self.bias = nn.Parameter(torch.full((D,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            h = b(h)
            h.mul_(0.9)
            h += self.bias
        return h


def test_in_place_write_to_the_segments_output():
    assert_checked_exact(InPlaceAfter, ["blocks.0", "blocks.1", "blocks.2"])


class Aliasing(nn.Module):
    """Returns a tensor and a view of it, and a view of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x + self.fc(x)
        return h, h[:, : D // 2], x[:, D // 2 :]


class AliasingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.alias = Aliasing()
        self.post = Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, left, right = self.alias(self.pre(x))
        h.mul_(2.0)  # seen through ``left``, as in plain PyTorch
        return self.post(h) + torch.cat([left, right], dim=1)


def test_outputs_that_alias_each_other_or_an_input():
    """Aliasing outputs bypass the check's tap (it copies what it passes), so writes through
    one are seen through the other; a segment beside it is checked as usual."""
    assert_checked_exact(AliasingNet, ["alias", "post"], checked=["post"])


class Structured(nn.Module):
    """A dict and a tuple, with members that are not differentiable (a mask, a count, a
    flag) and one tensor returned twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.tanh(self.fc(x))
        return {"h": h, "pair": (h, (h > 0).sum(1)), "mask": h > 0, "flag": True}


class StructuredNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Structured() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for b in self.blocks:
            out = b(h)
            assert out["flag"] is True and out["pair"][0] is out["h"]
            h = h + out["h"] * out["mask"] + out["pair"][1][:, None].float()
        return h


def test_structured_outputs_with_members_that_are_not_differentiable():
    assert_checked_exact(StructuredNet, ["blocks.0", "blocks.1"])


# ------------------------------------------------------------------------------ divergences
class ExternalTable(nn.Module):
    """Reads a table the model does not own (a plain attribute set around nn.Module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        object.__setattr__(self, "_table", torch.eye(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) @ self._table.clone()


def _detail(records: list, check: str) -> list[dict]:
    return [json.loads(r.detail) for r in records if r.check == check and r.outcome != "match"]


def test_state_the_contract_misses_is_a_recorded_divergence_and_training_stays_exact():
    """At step 2 the table changes between the forward and backward, where no version counter
    sees it (``.data``): the check's replay reads other bytes than the forward did. The check
    says so; the step trained on the segment's own graph, as plain PyTorch."""

    def step_fn(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        loss = _loss(model, x, step)
        if step == 2:
            table = model[0]._table
            table.data.add_(0.5)
        return loss

    records = assert_checked_exact(
        lambda: nn.Sequential(ExternalTable(), nn.Linear(D, D)), ["0"], step_fn, outcome="any"
    )
    grad = [r for r in records if r.check == "grad"]
    assert [r.outcome for r in grad if r.step == 3] == ["divergence"]
    assert all(r.outcome == "match" for r in grad if r.step != 3)
    (detail,) = _detail(records, "grad")
    assert detail["compared"] == 2 and any(d.startswith("0.fc.weight") for d in detail["differ"])
    assert ("bytes", "divergence") in {(r.check, r.outcome) for r in records if r.step == 3}
    assert any(r.check == "reaction" for r in records)


_FLAG = [True]
#: read through a module-level ``functools.partial``: out of the engine's sight (a closure
#: cell, or a module-level value the forward names itself, would be in its contract)
_flag = functools.partial(operator.getitem, _FLAG, 0)


def _flagged_factory() -> tuple[Callable[[], nn.Module], list]:
    _FLAG[0] = True

    class Flagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + (torch.tanh(self.fc(x)) if _flag() else self.fc(x))

    return (lambda: nn.Sequential(nn.Linear(D, D), Flagged(), nn.Linear(D, D))), _FLAG


def test_a_replay_that_takes_another_path_is_a_divergence_naming_the_saved_tensors():
    """At step 2 a flag the engine cannot see flips between the forward and backward: the
    check's replay takes the other branch and saves fewer tensors. The check says so, naming
    the counts; training used the segment's own graph."""
    make, flag = _flagged_factory()

    def step_fn(model: nn.Module, x: torch.Tensor, step: int) -> _Restore:
        loss = _loss(model, x, step)
        if step == 2:
            flag[0] = False
        return _Restore(loss, flag)

    records = assert_checked_exact(make, ["1"], step_fn, outcome="any")
    (detail,) = _detail(records, "grad")
    assert detail["differ"] == ["saved tensors: replay 2, forward 3"]
    assert ("bytes", "divergence") in {(r.check, r.outcome) for r in records}


class _Restore:
    """A loss whose ``backward`` puts a flag back after it."""

    def __init__(self, loss: torch.Tensor, flag: list) -> None:
        self.loss, self.flag = loss, flag

    def backward(self) -> None:
        try:
            self.loss.backward()
        finally:
            self.flag[0] = True


def test_backward_twice_through_a_checked_step_matches_plain():
    """retain_graph=True, then a second backward: checked once, trained as plain PyTorch."""
    torch.manual_seed(0)
    model = FanOut()
    plain = copy.deepcopy(model)
    engine = lr.install(model, ["blocks.0", "blocks.1", "blocks.2"])
    x = torch.randn(B, D)
    for m in (plain, model):
        m(x).pow(2).mean().backward()
    engine.request_check()
    for m in (plain, model):
        loss = m(x).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    grads = engine.records.read(check="grad")
    assert grads and all(r.outcome == "match" for r in grads)


_SCALE = [1.0]
_scale = functools.partial(operator.getitem, _SCALE, 0)


def test_a_scalar_the_replay_reads_otherwise_is_a_grad_divergence_without_byte_checks():
    """A factor out of the engine's sight (read through a module-level partial) changes
    between the forward and backward: the replay's multiply keeps the new scalar in its node,
    not in a saved tensor, so both backward passes of the check use it. The grad check
    compares the replay's outputs with the forward's too, and says so with byte checks off."""
    scale = _SCALE
    scale[0] = 1.0

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x)) * _scale()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Scaled(), nn.Linear(D, D))
    engine = lr.install(model, ["1"], on_violation="record")
    try:
        for step in range(3):
            if step == 2:
                engine.request_check(grad=True, bytes=False)
            loss = model(torch.randn(B, D)).square().mean()
            if step == 2:
                scale[0] = 0.5
            loss.backward()
            scale[0] = 1.0
        grad = [r for r in engine.records.read() if r.check == "grad"]
    finally:
        engine.uninstall()
    assert [r.outcome for r in grad] == ["divergence"]
    assert _detail(grad, "grad")[0]["differ"] == [
        "outputs: the replay's differ from the forward's (bytes)"
    ]
