"""Under a byte budget, the probe and calibration steps hold it as planned steps do.

Issue 31, "the budget holds from step one": models whose segments keep big state that the
window rewrites in place (an exponential moving average of the activations, a buffer written
through a slice), in the first, the last or every segment. The budget is halfway between torch
checkpoint's and plain training's whole-process peak on the same blocks (AdamW), or
``budget="min"``, whose bound is torch checkpoint's peak plus the state the plan preserves.
Every step from the first is judged on its own by a referee of the whole process
(:class:`tests.helpers.torch_memory.StepReferee`), and the trained weights and buffers must equal
plain PyTorch's bit for bit.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.helpers.budget_runner import run_arm
from tests.helpers.torch_memory import StepReferee

MIB = 2**20
TOLERANCE = 1.02
W, N = 64, 1024  # one activation of one linear: 256 KiB
STEPS = 3  # planned steps judged after the first plan


class Ema(nn.Module):
    """A block whose buffer is an in-place moving average of its activations (rows ``rows``
    of a buffer of ``size`` rows): a chain of writes to one view in each forward."""

    def __init__(self, size: int = 0, rows: slice | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)
        self.rows = rows
        if size:
            self.register_buffer("ema", torch.zeros(size, W))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        if hasattr(self, "ema"):
            view = self.ema[self.rows] if self.rows is not None else self.ema
            view.mul_(0.9).add_(h.detach(), alpha=0.1)
            h = h + view.mean() * 1e-3
        return h


def _net(kinds: list[int]) -> nn.Module:
    blocks = nn.Sequential(
        *[Ema(size, slice(0, N) if size > N else None) if size else Ema() for size in kinds]
    )
    return nn.Sequential(blocks, nn.Linear(W, 1))


class Reader(Ema):
    """A block that reads a big buffer (``4 N`` rows) and never writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(4 * N, W))

    def forward(self, x):
        return super().forward(x) + self.table.mean(0) * 1e-3


class Queue(Ema):
    """A block that reads a queue of ``4 N`` rows and then enqueues its activations with
    ``index_copy_`` at a moving pointer (MoCo's queue, written in its own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("queue", torch.randn(4 * N, W))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = super().forward(x) + self.queue.mean(0) * 1e-3
        rows = (self.ptr + torch.arange(x.shape[0])) % self.queue.shape[0]
        self.queue.index_copy_(0, rows, h.detach())
        self.ptr.add_(x.shape[0]).remainder_(self.queue.shape[0])
        return h


def _shared_net() -> nn.Module:
    """Two segments (the first and the third) holding one big buffer (``4 N`` rows), each
    writing its own rows of it."""
    net = _net([0, 0, 0, 0])
    shared = torch.zeros(4 * N, W)
    for i, rows in ((0, slice(0, N)), (2, slice(N, 2 * N))):
        block = net[0][i]
        block.register_buffer("ema", shared)
        block.rows = rows
    return net


class ArgBlock(Ema):
    """A block that writes the first ``N`` rows of the buffer it is given, if any."""

    def forward(self, x, state=None):
        h = self.b(torch.tanh(self.a(x)))
        if state is not None:
            view = state[:N]
            view.mul_(0.9).add_(h.detach(), alpha=0.1)
            h = h + view.mean() * 1e-3
        return h


class ArgNet(nn.Module):
    """Blocks whose written buffer is an argument: the root holds a big buffer (``4 N``
    rows) and passes it to the second block, which writes its first ``N`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ArgBlock() for _ in range(4)])
        self.head = nn.Linear(W, 1)
        self.register_buffer("state", torch.zeros(4 * N, W))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x, self.state if i == 1 else None)
        return self.head(x)


def _with(block: type, at: int) -> nn.Module:
    net = _net([0, 0, 0, 0])
    net[0][at] = block()
    return net


_BLOCKS = [f"0.{i}" for i in range(4)]

#: each shape: (model builder, segment names[, the builder torch checkpoint's peak is taken
#: from, where checkpoint cannot train the shape itself])
SHAPES: dict[str, tuple] = {
    # one segment whose state is as big as its activations
    "one_big_state": (lambda: _net([N, 0, 0]), [f"0.{i}" for i in range(3)]),
    # every segment stateful: their probes' copies together are more than the budget leaves
    "every_segment_stateful": (lambda: _net([N, N, N, N]), _BLOCKS),
    # a big buffer written through a slice, first or last
    "big_buffer_first": (lambda: _net([4 * N, 0, 0, 0]), _BLOCKS),
    "big_buffer_last": (lambda: _net([0, 0, 0, 4 * N]), _BLOCKS),
    # a big buffer read and never written
    "big_read_only": (lambda: _with(Reader, 0), _BLOCKS),
    # a queue written by index_copy_ at a moving pointer
    "queue_index_copy": (lambda: _with(Queue, 0), _BLOCKS),
    # two segments sharing one big buffer
    "shared_big_buffer": (_shared_net, _BLOCKS),
    # a written buffer passed as an argument instead of held as state. Torch checkpoint
    # refuses it (an input written in place since its forward: the hazard), so its
    # peak is taken from the same tensors held as state (the second block's buffer)
    "buffer_as_argument": (
        ArgNet,
        [f"blocks.{i}" for i in range(4)],
        lambda: _net([0, 4 * N, 0, 0]),
    ),
}


def _run(shape: str, arm: str, referee: StepReferee | None, budget=None, steps: int = 3):
    """Each step's peak and the trained state."""
    make, names, *proxy = SHAPES[shape]
    if arm == "checkpoint" and proxy:
        make, names = proxy[0], _BLOCKS
    run = run_arm(
        make,
        names,
        arm,
        referee,
        lambda s: torch.randn(N, W, generator=torch.Generator().manual_seed(s)),
        budget=budget,
        steps=steps,
        keep_refusal=True,
        keep_state=True,
    )
    return run.peaks, run.state, run.preserved, run.refused, run.planned


#: each shape's plain and checkpoint peaks, measured once for both budgets
_REFERENCE: dict[str, tuple[int, int]] = {}


def _references(shape: str, referee: StepReferee) -> tuple[int, int]:
    if shape not in _REFERENCE:
        plain = max(_run(shape, "plain", referee)[0][1:])
        ckpt = max(_run(shape, "checkpoint", referee)[0][1:])
        _REFERENCE[shape] = plain, ckpt
    return _REFERENCE[shape]


#: The probe keeps a digest, not a copy, of big state (discovery.py): the two cases that were
#: strict xfails here (big_buffer_first-min, probe 1.109 x; big_buffer_last-min, 1.11 x) hold
#: the budget since. A segment that writes its argument (buffer_as_argument) was calibrated
#: with a copy of the whole 1 MiB argument per call (calibration 1.168 x the halfway budget;
#: the lowest plan 5.296 MiB): an argument on state the contract puts back in place is read
#: live at the replay now (runtime._restored_in_place), and holds what the same buffer held
#: as state holds.
_XFAIL: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            c,
            id="-".join(c),
            marks=[pytest.mark.xfail(strict=True, reason=_XFAIL[c])] if c in _XFAIL else [],
        )
        for c in [(shape, b) for shape in sorted(SHAPES) for b in ["halfway", "min"]]
    ],
)
def test_every_step_holds_the_budget_from_the_probe_on(case, referee):
    shape, budget = case
    plain, ckpt = _references(shape, referee)
    assert ckpt < 0.98 * plain  # checkpointing pays: a budget between them means something
    halfway = (plain + ckpt) // 2
    peaks, state, _, refused, planned = _run(
        shape, "replay", referee, budget=halfway if budget == "halfway" else "min"
    )
    # the steps before the first plan: the probe and the calibration
    first = len(peaks) - planned
    # under "min" the budget is the lowest plan's own peak (what its planned steps hold)
    bound = halfway if budget == "halfway" else max(peaks[first:], default=0)
    report = ", ".join(f"{p / MIB:.3f}" for p in peaks)
    print(
        f"{shape} {budget}: plain {plain / MIB:.3f} MiB, checkpoint {ckpt / MIB:.3f}, "
        f"bound {bound / MIB:.3f}; "
        f"steps {report} ({first} before the first plan)"
    )
    # the same number of steps in plain PyTorch: the trained weights and buffers are its own
    want = _run(shape, "plain", None, steps=len(peaks))[1]
    for k, v in want.items():
        assert torch.equal(state[k], v), f"{shape}: {k} differs from plain PyTorch"
    if refused is not None:
        steps = ", ".join(f"{p / halfway:.3f}" for p in peaks)
        over = [p for p in peaks if p > TOLERANCE * halfway]
        assert not over, f"{shape}: steps before the refusal over the budget: {steps}"
        # A refusal is right where no plan fits: the lowest plan's real planned peak (the
        # same shape run under "min") is over the budget, and the figure the refusal names
        # is that plan's, within the tolerance.
        state = want = None  # the trained states: not the lowest plan's to hold
        low_peaks, _, _, _, low_planned = _run(shape, "replay", referee, budget="min")
        low = max(low_peaks[len(low_peaks) - low_planned :])
        assert low > halfway, (
            f"{shape}: the first plan refused {halfway} B, which the lowest plan meets "
            f"({low} B; steps {steps} x): {refused}"
        )
        named = refused.min_feasible
        assert abs(named - low) <= (TOLERANCE - 1) * low, (
            f"{shape}: the refusal names {named} B as the least budget; the lowest plan "
            f"really holds {low} B: {refused}"
        )
        return
    over = [(s, round(p / bound, 3)) for s, p in enumerate(peaks) if p > TOLERANCE * bound]
    assert not over, f"{shape} {budget}: steps over {TOLERANCE} x {bound} B: {over}; all {report}"
