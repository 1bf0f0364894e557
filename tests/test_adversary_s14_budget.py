"""Adversary, session 14: the memory promise on shapes the budget tests lack.

Every step from the probe on, judged on its own by the whole-process referee
(:class:`tests.helpers.torch_memory.StepReferee`: live storages at the step's start + the
profiler's net peak), must peak at <= 1.02 x a budget halfway between torch checkpoint's and
plain training's peak on the same blocks (AdamW), or under ``budget="min"`` at <= 1.02 x the
planned steps' own peak (the steps before the first plan must not run over what the lowest
plan holds); the trained weights and buffers must equal plain PyTorch's bit for bit. A refusal
(``InfeasibleBudget``) is right only where the lowest plan's real peak is over the budget.

Shapes: many small segments (24), one segment larger than any other, a big input
that only the root reads, big integer, bool, complex and view state, a frozen parameter used
as big state, one big buffer every segment reads and the root writes, a generator per segment.
Strict xfails carry what was measured. See ``/work/notes/adv-s14.md``.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.helpers.budget_runner import run_arm

MIB = 2**20
TOLERANCE = 1.02
W, N = 64, 512  # one activation of one W-wide linear: 128 KiB


class Blk(nn.Module):
    def __init__(self, hidden: int = 2 * W) -> None:
        super().__init__()
        self.a = nn.Linear(W, hidden)
        self.b = nn.Linear(hidden, W)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """``stem`` (a plain layer), the blocks (the segments), a head; ``after(net, h)`` runs in
    the root forward after the blocks under no_grad."""

    def __init__(self, blocks, after=None, stem: nn.Module | None = None) -> None:
        super().__init__()
        self.stem = stem if stem is not None else nn.Identity()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(W, 1)
        self._after = after

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        if self._after is not None:
            with torch.no_grad():
                self._after(self, h.detach())
        return self.head(h)


class IntCounts(Blk):
    """A big int64 table (4 N x W): read as weights, bumped in place with ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.ones(4 * N, W, dtype=torch.long))

    def forward(self, x):
        y = super().forward(x) + self.counts[: x.shape[0]].float().log() * 1e-3
        with torch.no_grad():
            rows = (y.detach().abs().sum(1) * 100).long() % (4 * N)
            self.counts.index_add_(0, rows, torch.ones_like(x, dtype=torch.long))
        return y


class BoolMask(Blk):
    """A big bool mask (16 N x W bytes, 512 KiB) gating the output; the root flips it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.ones(16 * N, W, dtype=torch.bool))

    def forward(self, x):
        return super().forward(x) * self.keep[: x.shape[0]].to(x.dtype)


def _flip_masks(net, h):
    for b in net.blocks:
        if isinstance(b, BoolMask):
            b.keep[: h.shape[0]].logical_xor_(h > 1.5)


class ComplexState(Blk):
    """A big complex buffer (2 N x W complex64, 512 KiB), read, then rotated by the root."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("z", torch.polar(torch.ones(2 * N, W), torch.randn(2 * N, W)))

    def forward(self, x):
        return super().forward(x) + self.z[: x.shape[0]].real * 1e-3


def _rotate(net, h):
    for b in net.blocks:
        if isinstance(b, ComplexState):
            b.z[: h.shape[0]].mul_(torch.polar(torch.ones_like(h), h * 1e-2))


class ViewState(Blk):
    """The block's buffer is the second half of a base buffer (4 N x W) the root holds; the
    root writes the whole base in place after the forward."""

    def __init__(self, view: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("v", view)

    def forward(self, x):
        return super().forward(x) + self.v[: x.shape[0]] * 1e-3


class ViewNet(Net):
    def __init__(self) -> None:
        base = torch.zeros(8 * N, W)
        super().__init__([ViewState(base[4 * N :]), Blk(), Blk(), Blk()], after=self._write)
        self.register_buffer("base", base)

    @staticmethod
    def _write(net, h):
        net.base.mul_(0.9)


class ParamState(Blk):
    """A frozen ``nn.Parameter`` (4 N x W) used as an in-place moving average."""

    def __init__(self) -> None:
        super().__init__()
        self.avg = nn.Parameter(torch.zeros(4 * N, W), requires_grad=False)

    def forward(self, x):
        y = super().forward(x) + self.avg[: x.shape[0]] * 1e-3
        with torch.no_grad():
            self.avg[: x.shape[0]].mul_(0.9).add_(y.detach(), alpha=0.1)
        return y


class SharedReader(Blk):
    def __init__(self, holder: list) -> None:
        super().__init__()
        self.holder = holder  # a plain list: the buffer is the root's

    def forward(self, x):
        return super().forward(x) + self.holder[0][: x.shape[0]] * 1e-3


class SharedNet(Net):
    """One big buffer (4 N x W) of the root, read by every segment, written by the root
    after the forward."""

    def __init__(self) -> None:
        holder: list = []
        super().__init__([SharedReader(holder) for _ in range(4)], after=self._write)
        self.register_buffer("table", torch.randn(4 * N, W))
        holder.append(self.table)

    @staticmethod
    def _write(net, h):
        net.table[: h.shape[0]].mul_(0.5).add_(h)


class GenBlk(Blk):
    """Dropout-like noise from a generator the block holds."""

    def __init__(self, seed: int) -> None:
        super().__init__(hidden=W)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        keep = torch.rand(h.shape, generator=self.gen) > 0.2
        return x + h * keep


class WideIn(nn.Module):
    """The first segment reads the big input (16 W wide) directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16 * W, 2 * W)
        self.b = nn.Linear(2 * W, W)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class AuxBlk(Blk):
    """Returns ``(y, aux)``: ``aux`` is 8 x wider than ``y`` and the root drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(W, 8 * W)

    def forward(self, x):
        y = super().forward(x)
        return y, self.wide(y)


class AuxNet(Net):
    def forward(self, x):
        h = x
        for b in self.blocks:
            h, _ = b(h)
        return self.head(h)


class EmaBlk(Blk):
    """An in-place moving average of its output (N x W, 128 KiB), read first."""

    def __init__(self) -> None:
        super().__init__(hidden=W)
        self.register_buffer("ema", torch.zeros(N, W))

    def forward(self, x):
        y = super().forward(x) + self.ema[: x.shape[0]] * 1e-3
        with torch.no_grad():
            self.ema[: x.shape[0]].mul_(0.9).add_(y.detach(), alpha=0.1)
        return y


class LateNet(Net):
    """The last block joins at the 7th forward (after the first plan): progressive growing."""

    def __init__(self, blocks) -> None:
        super().__init__(blocks)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.stem(x)
        for b in self.blocks if self.calls >= 7 else self.blocks[:-1]:
            h = b(h)
        return self.head(h)


def _names(n: int) -> list[str]:
    return [f"blocks.{i}" for i in range(n)]


#: shape -> (model builder, segments, input width)
SHAPES: dict[str, tuple] = {
    # 24 small segments: per-segment fixed costs (inputs, RNG states) add up
    "many_small_segments": (lambda: Net([Blk(hidden=W) for _ in range(24)]), _names(24), W),
    # one segment larger than any other (hidden 12 W against 2 W; 12 small ones)
    "one_giant_segment": (
        lambda: Net([Blk() for _ in range(6)] + [Blk(hidden=12 * W)] + [Blk() for _ in range(6)]),
        _names(13),
        W,
    ),
    # a big input (16 W wide) only the root's stem reads
    "big_input_read_by_the_stem": (
        lambda: Net([Blk() for _ in range(4)], stem=nn.Linear(16 * W, W)),
        _names(4),
        16 * W,
    ),
    "big_int64_state_index_add": (lambda: Net([IntCounts(), Blk(), Blk(), Blk()]), _names(4), W),
    "big_bool_mask_flipped_by_root": (
        lambda: Net([Blk(), BoolMask(), Blk(), Blk()], after=_flip_masks),
        _names(4),
        W,
    ),
    "big_complex_state_rotated_by_root": (
        lambda: Net([Blk(), Blk(), ComplexState(), Blk()], after=_rotate),
        _names(4),
        W,
    ),
    "big_view_state_base_written_by_root": (ViewNet, _names(4), W),
    "big_frozen_parameter_as_state": (
        lambda: Net([ParamState(), Blk(), Blk(), Blk()]),
        _names(4),
        W,
    ),
    "big_root_buffer_read_by_every_segment": (SharedNet, _names(4), W),
    "a_generator_per_segment": (lambda: Net([GenBlk(i) for i in range(8)]), _names(8), W),
    # the big input goes into the first segment itself
    "big_input_into_the_first_segment": (
        lambda: Net([WideIn(), Blk(), Blk(), Blk()]),
        _names(4),
        16 * W,
    ),
    # each segment returns an 8 x wider auxiliary output that the root drops
    "big_auxiliary_output_dropped_by_the_root": (
        lambda: AuxNet([AuxBlk() for _ in range(4)]),
        _names(4),
        W,
    ),
    # 12 small segments, each with a 128 KiB moving average written in its forward
    "many_stateful_small_segments": (lambda: Net([EmaBlk() for _ in range(12)]), _names(12), W),
    # a fourth segment, as big as the others together, joins after the first plan
    "late_joining_big_segment": (
        lambda: LateNet([Blk(), Blk(), Blk(), Blk(hidden=8 * W)]),
        _names(4),
        W,
    ),
}

#: (shape, budget) -> what was measured where a case fails today
XFAIL: dict[tuple[str, str], str] = {
    ("many_stateful_small_segments", "halfway"): (
        "measured: plain 6.035 MiB, checkpoint 4.717, budget 5.376: the probe step peaks at "
        "5.569 (1.036 x the budget) and the untimed warm-up step at 6.092 (1.133 x); the "
        "third step's forward refuses, rightly (i31-b12: the warm-up's measured figures give "
        "the first plan's refusal figure, 6.08 MiB; the lowest plan holds 6.035: 12 segments' "
        "whole 128 KiB moving averages cost what their activations do). The probe and the "
        "warm-up run before anything real is measured: no figure bounds them yet. i31-refuse: "
        "at the probe's peak it holds checkpoint's first step + the 12 first-touch copies "
        "(1.5 MiB, what the lowest plan preserves too) + 112 KiB of the replay's tail (the "
        "moving-average update and output, which the probe's replay runs to compare outputs "
        "and torch checkpoint's early stop skips); without that tail it would be 5.455 (1.015 "
        "x)"
    ),
}


def _run(shape: str, arm: str, referee, budget=None, steps: int = 3):
    make, names, width = SHAPES[shape]
    return run_arm(
        make,
        names,
        arm,
        referee,
        lambda s: torch.randn(N, width, generator=torch.Generator().manual_seed(s)),
        budget=budget,
        steps=steps,
        keep_refusal=True,
        keep_state=True,
    )


def _segment_state_bytes(shape: str) -> int:
    """The bytes of state the segments can read (each block's buffers, frozen parameters,
    tensors in its list attributes and generators' states, a view counted by its own size):
    at most what the lowest
    plan must preserve beside torch checkpoint's activations."""
    make, names, _ = SHAPES[shape]
    model = make()
    seen, total = set(), 0
    for n in names:
        blk = model.get_submodule(n)
        ts = [*blk.buffers(), *(p for p in blk.parameters() if not p.requires_grad)]
        ts += [t for v in vars(blk).values() if isinstance(v, list) for t in v]
        for t in ts:
            if isinstance(t, torch.Tensor) and (t.data_ptr(), t.numel()) not in seen:
                seen.add((t.data_ptr(), t.numel()))
                total += t.numel() * t.element_size()
        gens = [v for v in vars(blk).values() if isinstance(v, torch.Generator)]
        total += sum(g.get_state().numel() for g in gens)
    return total


_REF: dict[str, tuple[int, int]] = {}


def _references(shape: str, referee) -> tuple[int, int]:
    if shape not in _REF:
        steps = 9 if shape.startswith("late_") else 3  # past the step a late segment joins
        plain = max(_run(shape, "plain", referee, steps=steps).peaks[1:])
        ckpt = max(_run(shape, "checkpoint", referee, steps=steps).peaks[1:])
        _REF[shape] = plain, ckpt
    return _REF[shape]


@pytest.mark.parametrize(
    ("shape", "budget"),
    [
        pytest.param(
            s,
            b,
            id=f"{s}-{b}",
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL[s, b])] if (s, b) in XFAIL else [],
        )
        for s in SHAPES
        for b in ("halfway", "min")
    ],
)
def test_every_step_holds_the_budget(shape, budget, referee):
    plain, ckpt = _references(shape, referee)
    assert ckpt < 0.98 * plain, (shape, plain, ckpt)  # a budget between them means something
    halfway = (plain + ckpt) // 2
    run = _run(shape, "replay", referee, budget=halfway if budget == "halfway" else "min")
    peaks = run.peaks
    first = len(peaks) - run.planned
    report = ", ".join(f"{p / MIB:.3f}" for p in peaks)
    print(
        f"{shape} {budget}: plain {plain / MIB:.3f} MiB, checkpoint {ckpt / MIB:.3f}, halfway "
        f"{halfway / MIB:.3f}; steps {report} ({first} before the first plan)"
    )
    want = _run(shape, "plain", None, steps=len(peaks)).state
    bad = [k for k, v in want.items() if not torch.equal(run.state[k], v)]
    assert not bad, f"{shape} {budget}: differ from plain PyTorch: {bad[:5]}"
    if run.refused is not None:
        over = [
            (s + 1, round(p / halfway, 3)) for s, p in enumerate(peaks) if p > TOLERANCE * halfway
        ]
        assert not over, f"{shape}: steps before the refusal over the budget: {over}; {report}"
        low = _run(shape, "replay", referee, budget="min")
        low_peak = max(low.peaks[len(low.peaks) - low.planned :])
        assert low_peak > halfway, (
            f"{shape}: refused {halfway / MIB:.3f} MiB, which the lowest plan meets "
            f"({low_peak / MIB:.3f}); steps {report}: {run.refused}"
        )
        return
    assert run.planned, f"{shape} {budget}: no plan in {len(peaks)} steps"
    bound = halfway if budget == "halfway" else max(peaks[first:])
    if budget == "min":  # the lowest plan: torch checkpoint's + at most the state it reads
        lowest = ckpt + _segment_state_bytes(shape)
        assert bound <= TOLERANCE * lowest, (
            f"{shape}: the lowest plan peaks at {bound / MIB:.3f} MiB, {bound / lowest:.3f} x "
            f"checkpoint's {ckpt / MIB:.3f} + the segments' state {(lowest - ckpt) / MIB:.3f}"
        )
    over = [(s + 1, round(p / bound, 3)) for s, p in enumerate(peaks) if p > TOLERANCE * bound]
    assert not over, (
        f"{shape} {budget}: (step, peak / bound) over {TOLERANCE}: {over}; bound "
        f"{bound / MIB:.3f} MiB, steps {report}"
    )
