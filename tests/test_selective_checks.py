"""The independent checks validate selective replays, kept outputs included.

A kept output that would differ from what its op produced in the forward is never used
silently: the replay runs the op again, and the checks record it. Faults are injected the
ways a model can make them: a write through ``.data`` into an intermediate the model stashed
(no version bump: only a byte check sees it), an in-place op on a kept product (version bump:
torch's own selective checkpoint raises at backward), an in-place write into the segment's
output after it returned. The referee is plain PyTorch.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.contract import SELECTIVE
from lightning_replay.selective import SelectiveFrame, checkpoint_kwargs
from tests.helpers.compare import assert_same_grads

D = 8
STEPS = 5


class StashBlock(nn.Module):
    """Keeps its hidden product for someone else (a feature hook, a probe head)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
        self.stash = None

    def forward(self, x):
        h = self.fc1(x)  # addmm: kept by the selective policy
        self.stash = h
        return self.fc2(torch.tanh(h))  # tanh saves its output, not h


class StashNet(nn.Module):
    """After its blocks, rescales the stashed product in place through ``.data`` (no version
    bump): plain training's gradients never read it, a selective replay would."""

    def __init__(self, blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(StashBlock() for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        for b in self.blocks:
            b.stash.data.mul_(2.0)
        return x


class InplaceBlock(nn.Module):
    """An in-place activation on a kept product (``Linear`` then ``ReLU(inplace=True)``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.fc2(torch.relu_(self.fc1(x))) * 0.5 + x


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)  # kept, and returned
        return h, torch.tanh(h)


class OutputWrittenNet(nn.Module):
    """Blocks that return a kept product, which the model then writes in place (a residual
    ``+=`` on the block's output) after the block returned."""

    def __init__(self, blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(TwoOut() for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            h, t = b(x)
            h.add_(1.0)
            x = h * t
        return x


def _train(model, steps=STEPS, engine=None, check=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    grads = []
    for step in range(steps):
        if engine is not None and check is not None and step >= 1:
            engine.request_check(**check)
        x = torch.randn(4, D, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


class _Row:
    """A record with its detail parsed."""

    def __init__(self, r):
        self.check, self.outcome, self.segment = r.check, r.outcome, r.segment
        self.detail = json.loads(r.detail) if r.detail else {}

    def __repr__(self):
        return f"{self.segment} {self.check} {self.outcome} {self.detail}"


def _run(factory, check=None, steps=STEPS):
    torch.manual_seed(0)
    base = factory()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    g_ref = _train(ref, steps)
    engine = lr.install(model, "blocks.*", preservation="selective", selective="matmul")
    try:
        g_rep = _train(model, steps, engine, check)
        records = [_Row(r) for r in engine.records]
        summary = engine.summary()
    finally:
        engine.uninstall()
    return g_ref, g_rep, records, summary


def test_a_stale_kept_output_is_a_divergence_of_the_derivative_check():
    """Every step after the probe derivative-checked: the check replays selectively with the
    kept outputs, finds the stashed product's bytes changed since its op, records a
    divergence naming it, and the segment reacts once (re-probe): the call is not kept from
    then on, so no check diverges again and the segment stays selective (before: a second
    divergence, and the segment retained for good). Training, on the forward's own graph on
    checked steps, is plain PyTorch's bit for bit."""
    g_ref, g_rep, records, summary = _run(StashNet, check={})
    assert_same_grads(g_ref, g_rep, "stash")
    grad = [r for r in records if r.check == "grad" and r.outcome == "divergence"]
    assert grad, [(r.check, r.outcome, r.detail) for r in records]
    differ = grad[0].detail["differ"]
    assert any("kept output of aten.addmm" in d and "bytes changed" in d for d in differ), differ
    for seg in ("blocks.0", "blocks.1"):
        reactions = [
            r.detail["action"] for r in records if r.check == "reaction" and r.segment == seg
        ]
        assert reactions == ["re-probe"], (seg, reactions)
    assert all(s["mode"].startswith("selective") for s in summary.values()), summary


def test_a_stale_kept_output_is_a_divergence_of_the_byte_check():
    """Byte checks only (no derivative check): the replay itself verifies its kept outputs,
    runs the op again instead of using a stale one, and records a bytes divergence."""
    g_ref, g_rep, records, _ = _run(StashNet, check={"grad": False, "bytes": True})
    bad = [r for r in records if r.check == "bytes" and r.outcome == "divergence"]
    assert bad and bad[0].detail["what"] == "kept outputs", [(r.check, r.detail) for r in records]
    assert "aten.addmm" in bad[0].detail["differ"][0]
    # the replays on byte-checked steps recomputed the product: their gradients are exact
    assert_same_grads(g_ref[:2], g_rep[:2], "stash")


def test_without_checks_the_stale_kept_output_is_what_the_checks_are_for():
    """The same model unchecked: the selective replay uses the stashed product as kept and the
    gradients differ from plain PyTorch (a write without a version bump is seen by byte
    checks only, as for any other state): the checks above are what catches it."""
    g_ref, g_rep, records, _ = _run(StashNet)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(g_ref[1:], g_rep[1:]) for n in a), (
        "the injected fault no longer reaches the replay: the tests above check nothing"
    )


def _inplace_blocks():
    return nn.Sequential(*[InplaceBlock() for _ in range(2)])


@pytest.mark.parametrize(
    "factory, check",
    [
        (_inplace_blocks, None),  # replays
        (_inplace_blocks, {"grad": True, "bytes": True}),  # derivative checks
        # (a derivative-checked call hands the model copies of its outputs: unchecked here)
        (OutputWrittenNet, None),
        (OutputWrittenNet, {"grad": False, "bytes": True}),
    ],
)
def test_a_kept_output_written_in_place_is_recomputed_and_recorded_once(factory, check):
    """A kept product written in place after its op (version counter moved), inside the
    segment or after it returned: torch's selective checkpoint raises at backward. The replay
    runs the op again instead (exact), records one rejection per call, and does not keep that
    call again. A product the segment returns is not kept at all (the caller may write it by
    ways no version counter shows, ``SelectiveFrame.watch_outputs``): exact, nothing to
    reject."""

    def make():
        m = factory()
        return m if hasattr(m, "blocks") else _Wrapped(m)

    g_ref, g_rep, records, summary = _run(make, check=check)
    assert_same_grads(g_ref, g_rep, "in place")
    rej = [r for r in records if r.check == "selective"]
    assert all(s["mode"] in SELECTIVE for s in summary.values()), summary
    if factory is OutputWrittenNet:
        assert not rej, rej
        return
    assert rej and all(r.outcome == "rejection" for r in rej), rej
    assert "written in place" in rej[0].detail["kept"]
    assert len(rej) == len({(r.segment, r.detail["kept"]) for r in rej})  # once each
    assert not [r for r in records if r.outcome == "divergence"], records
    assert all(s["mode"] in SELECTIVE for s in summary.values()), summary


class _Wrapped(nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.blocks = seq

    def forward(self, x):
        return self.blocks(x)


def test_torch_sac_raises_where_the_kept_product_is_written_in_place():
    """The baseline the test above improves on: torch's own selective checkpoint refuses."""
    from torch.utils.checkpoint import checkpoint

    blk = InplaceBlock()
    x = torch.randn(4, D, requires_grad=True)
    from lightning_replay.selective import torch_sac_context_fn

    y = checkpoint(blk, x, use_reentrant=False, context_fn=torch_sac_context_fn())
    with pytest.raises(RuntimeError, match="mutated"):
        y.sum().backward()


def test_a_frame_hands_over_kept_outputs_that_pass_and_reruns_the_rest():
    """SelectiveFrame alone: a verified frame's replay uses a kept product whose bytes are
    intact, and runs the op again (with an event) where they changed."""
    lin = nn.Linear(D, D)

    def run(corrupt):
        frame = SelectiveFrame("matmul", verify=True)
        x = torch.randn(2, D, requires_grad=True)
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(
            lambda t: torch.tanh(lin(t)),
            x,
            use_reentrant=False,
            context_fn=frame.contexts,
            **checkpoint_kwargs(),
        )
        if corrupt:
            frame.kept_tensors()[0].data.add_(1.0)
        y.sum().backward()
        return frame.events

    assert run(False) == []
    (ev,) = run(True)
    assert ev.kind == "bytes" and ev.op == "aten.addmm.default" and ev.call == 0
