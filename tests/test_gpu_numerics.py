"""Issue 32: no false divergences from GPU numerics, reproduced on the CPU.

On a GPU, kernels do things a replay cannot and need not reproduce: fused attention saves
integer RNG seed/offset outputs that it never wrote when it drew nothing (``dropout_p=0``), saves
statistics as views into padded buffers, and accumulates gradients with atomics, so that its
backward differs from one run to the next in the last bits. None of that is a missed state, and
none of it may be recorded as a divergence. CI has no GPU: each class is reproduced here with a
small custom op or autograd Function, several variants per class, plus one class nobody listed
(an auxiliary output left unwritten, a workspace):

- ``padded_*``: a saved tensor that is a view into a larger ``torch.empty`` storage whose
  padding (or the gaps between its strided elements) changes at every call;
- ``noisy_*``: a backward that adds ulp-level noise drawn from ``os.urandom`` (a stand-in for
  atomics: a generator outside the model, nothing a replay could restore);
- ``rng_*``: a forward whose seed/offset outputs move although it draws nothing;
- ``unwritten_*``: an auxiliary output (a workspace, padded rows of a statistic) holding
  whatever bytes the allocator left there.

Each trains 20 steps with checks requested on every step, under no budget (retained probe) and
``budget="min"`` (replayed probe), and under preservation auto/whole/regions: no divergence and
no rejection. Each model's twin with real missed state (a buffer written between forward and
backward through ``.data``: no version bump, outside the contract's sight) is caught on the
first step it happens.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.checks import NOISE_FACTOR, _Noise
from lightning_replay.kernel_noise import (
    NOISE_SAMPLES,
    NOISE_SAMPLES_MAX,
    GradNoise,
    measure_noise,
)
from tests.helpers.noisy_kernels import noisy_linear, ulp_noise

D, B, STEPS = 8, 6, 20
#: the step from which a missed-state twin writes its buffer between forward and backward: the
#: first after the probe (under budget="min" a calibration step, before the plan retains them)
MISS_FROM = 1


def _garbage(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of arbitrary bytes, as an uninitialized allocation holds: drawn from
    ``os.urandom``, so no generator a replay restores reproduces them."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.frombuffer(bytearray(os.urandom(n * size)), dtype=torch.uint8)
    return raw.view(dtype).clone()


# ------------------------------------------------------------------ class 1: padded views
class PaddedTanh(torch.autograd.Function):
    """Saves ``tanh(x)`` as a view into a longer ``torch.empty`` buffer whose tail (the
    kernel's padding) is new garbage at every call; the backward reads the view only."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        buf = _garbage(y.numel() + 37, y.dtype)
        buf[: y.numel()] = y.reshape(-1)
        ctx.save_for_backward(buf[: y.numel()].view(y.shape))
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class StridedTanh(torch.autograd.Function):
    """Saves ``tanh(x)`` as every other element of a garbage buffer (a strided view whose gaps
    change at every call)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        buf = _garbage(2 * y.numel(), y.dtype)
        buf[::2] = y.reshape(-1)
        ctx.save_for_backward(buf[::2].view(y.shape))
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class PaddedLSE(torch.autograd.Function):
    """A softmax over the last dimension that saves its log-sum-exp as attention kernels do: a
    float32 ``[batch, heads, rows, 1]`` view into ``[batch, heads, rows rounded up to 32]``."""

    @staticmethod
    def forward(ctx, x):
        b, n = x.shape
        s = x.view(b, 2, n // 2)
        lse = torch.logsumexp(s, dim=-1)  # [b, 2]
        pad = _garbage(b * 2 * 32, torch.float32).view(b, 2, 32)
        pad[:, :, :1] = lse.unsqueeze(-1)
        view = pad[:, :, :1].unsqueeze(-1)  # [b, 2, 1, 1]
        ctx.save_for_backward(s, view)
        return torch.exp(s - view.squeeze(-1)).view(b, n)

    @staticmethod
    def backward(ctx, g):
        s, lse = ctx.saved_tensors
        p = torch.exp(s - lse.squeeze(-1))
        gs = g.view_as(p)
        return (p * (gs - (gs * p).sum(-1, keepdim=True))).view(g.shape)


# ------------------------------------------------------------------ class 2: noisy backward
NoisyWeightLinear = noisy_linear(
    "NoisyWeightLinear",
    "``x @ w.T`` whose weight gradient carries ulp-level noise (atomics' stand-in).",
    weight=ulp_noise,
)
NoisyInputLinear = noisy_linear(
    "NoisyInputLinear",
    "``x @ w.T`` whose input gradient carries noise of up to 3 ulps (which then flows into "
    "every gradient upstream).",
    input=lambda gx: ulp_noise(gx, ulps=3),
)


@torch.library.custom_op("lr_gpu_numerics::noisy_scale", mutates_args=())
def noisy_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An op whose registered backward is nondeterministic in both gradients."""
    return x * w


def _noisy_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _noisy_scale_backward(ctx, g):
    x, w = ctx.saved_tensors
    return ulp_noise(g * w), ulp_noise((g * x).sum(0))


noisy_scale.register_autograd(_noisy_scale_backward, setup_context=_noisy_scale_setup)


# ------------------------------------------------------------------ class 3: moving RNG outputs
_CALLS = {"n": 0}


@torch.library.custom_op(
    "lr_gpu_numerics::attention_like",
    mutates_args=(),
    schema="(Tensor x, float dropout_p) -> (Tensor output, Tensor logsumexp, "
    "Tensor philox_seed, Tensor philox_offset)",
)
def attention_like(x: torch.Tensor, dropout_p: float):
    """A softmax kernel with attention's outputs: its seed is never written (garbage) and its
    offset advances at every call, though with ``dropout_p=0`` nothing is drawn."""
    _CALLS["n"] += 1
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    seed = _garbage(1, torch.int64).view(())
    offset = torch.tensor(_CALLS["n"] * 4, dtype=torch.int64)
    return torch.exp(x - lse), lse, seed, offset


def _attention_setup(ctx, inputs, output):
    out, lse, seed, offset = output
    ctx.save_for_backward(out, lse, seed, offset)


def _attention_backward(ctx, g, *_):
    out, lse, seed, offset = ctx.saved_tensors  # seed and offset: only read with dropout
    return out * (g - (g * out).sum(-1, keepdim=True)), None


attention_like.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op(
    "lr_gpu_numerics::flash_like",
    mutates_args=(),
    schema="(Tensor x, float dropout_p) -> (Tensor output, Tensor rng_state, Tensor unused)",
)
def flash_like(x: torch.Tensor, dropout_p: float):
    """Flash attention's naming: ``rng_state`` (seed and offset) and ``unused``, both moving."""
    _CALLS["n"] += 1
    state = torch.tensor([_CALLS["n"], 7 * _CALLS["n"]], dtype=torch.int64)
    return torch.tanh(x), state, _garbage(1, torch.int64).view(())


def _flash_setup(ctx, inputs, output):
    out, state, unused = output
    ctx.save_for_backward(out, state, unused)


def _flash_backward(ctx, g, *_):
    out, _state, _unused = ctx.saved_tensors
    return g * (1 - out * out), None


flash_like.register_autograd(_flash_backward, setup_context=_flash_setup)


# ------------------------------------------------------------------ class 4: unwritten outputs
@torch.library.custom_op("lr_gpu_numerics::with_workspace", mutates_args=())
def with_workspace(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel that returns (and autograd saves) a workspace it never initializes."""
    return torch.sigmoid(x), _garbage(64, torch.float32)


def _workspace_setup(ctx, inputs, output):
    out, ws = output
    ctx.save_for_backward(out, ws)


def _workspace_backward(ctx, g, _g_ws):
    out, _ws = ctx.saved_tensors
    return g * out * (1 - out)


with_workspace.register_autograd(_workspace_backward, setup_context=_workspace_setup)


@torch.library.custom_op("lr_gpu_numerics::padded_stat", mutates_args=())
def padded_stat(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maxima padded to a multiple of 8 rows: only the valid rows are written."""
    rows = x.shape[0]
    stat = _garbage(((rows + 7) // 8) * 8, x.dtype)
    stat[:rows] = x.amax(-1)
    return x - stat[:rows].unsqueeze(-1), stat


def _stat_setup(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]
    ctx.save_for_backward(output[1])


def _stat_backward(ctx, g, _g_stat):
    (stat,) = ctx.saved_tensors
    del stat  # read only for its valid rows' shape: the gradient of x - max is g (max: no grad)
    return g


padded_stat.register_autograd(_stat_backward, setup_context=_stat_setup)


# ------------------------------------------------------------------ real evidence, same shape
def _closure_scale_op():
    """A kernel that draws its gradient scale from a numpy generator held in its closure (out
    of any probe's sight, like a C++ kernel's own RNG) and saves it beside its output: an
    auxiliary value that the gradient reads. Its replay draws another, and so does a second
    run: to the probe it is a value the kernel does not reproduce, and whether the gradient
    reads it is for the derivative check to say."""
    rng = np.random.default_rng(0)

    @torch.library.custom_op("lr_gpu_numerics::closure_grad_scale", mutates_args=())
    def closure_grad_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.from_numpy(rng.uniform(0.5, 1.5, size=tuple(x.shape)).astype("float32"))
        return x.clone(), c

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output[1])

    def backward(ctx, g, _g_c):
        (c,) = ctx.saved_tensors
        return g * c

    closure_grad_scale.register_autograd(backward, setup_context=setup)
    return closure_grad_scale


closure_grad_scale = _closure_scale_op()


# ------------------------------------------------------------------ the blocks
KERNELS: dict[str, Callable] = {
    "padded_view": lambda blk, h: PaddedTanh.apply(h),
    "padded_strided": lambda blk, h: StridedTanh.apply(h),
    "padded_lse_4d": lambda blk, h: PaddedLSE.apply(h),
    "noisy_weight_grad": lambda blk, h: NoisyWeightLinear.apply(h, blk.w),
    "noisy_input_grad": lambda blk, h: NoisyInputLinear.apply(h, blk.w),
    "noisy_custom_op": lambda blk, h: noisy_scale(h, blk.w[0]),
    "rng_seed_offset": lambda blk, h: attention_like(h, 0.0)[0],
    "rng_state_unused": lambda blk, h: flash_like(h, 0.0)[0],
    "unwritten_workspace": lambda blk, h: with_workspace(h)[0],
    "unwritten_padded_rows": lambda blk, h: padded_stat(h)[0],
}
#: kernels whose saved auxiliary value is real evidence (not part of KERNELS)
EVIDENCE: dict[str, Callable] = {
    "closure_grad_scale": lambda blk, h: closure_grad_scale(h)[0],
}


class Block(nn.Module):
    """Linear, the kernel under test, a read of a buffer (what the missed-state twin writes
    through ``.data`` between forward and backward), and a linear."""

    def __init__(self, kernel: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kernel = {**KERNELS, **EVIDENCE}[kernel]
        self.a = nn.Linear(D, D, dtype=dtype)
        self.w = nn.Parameter(torch.randn(D, D, dtype=dtype) / 3)
        self.b = nn.Linear(D, D, dtype=dtype)
        self.register_buffer("table", torch.eye(D, dtype=dtype))

    def forward(self, x):
        h = self.kernel(self, self.a(x))
        return x + self.b(h @ self.table.clone())


class Net(nn.Module):
    def __init__(self, kernel: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(kernel, dtype), Block(kernel, dtype))
        self.head = nn.Linear(D, 1, dtype=dtype)

    def forward(self, x):
        return self.head(self.blocks(x))


SEGMENTS = ["blocks.0", "blocks.1"]
#: (budget, preservation, first checked step): a retained probe and each preservation option;
#: under budget="min" with checks on every step (a checked probe keeps its graph) and on every
#: step after the first (the probe is replayed: its replay's saved tensors are compared)
CONFIGS = {
    "auto": (None, "auto", 0),
    "whole": (None, "whole", 0),
    "regions": (None, "regions", 0),
    "min": ("min", "auto", 0),
    "min_replayed_probe": ("min", "auto", 1),
}


def _train(
    kernel: str, budget, preservation, check_from=0, miss: bool = False, dtype=torch.float32
):
    """20 steps with checks on every step from ``check_from``; (records, the engine step of
    the first missed write or None)."""
    torch.manual_seed(0)
    model = Net(kernel, dtype)
    engine = lr.install(
        model, SEGMENTS, budget=budget, preservation=preservation, on_violation="record"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    first_miss = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # divergences are read from records
        for step in range(STEPS):
            if step >= check_from:
                engine.request_check()
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(step)).to(dtype)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            if miss and step >= MISS_FROM:
                if first_miss is None:
                    first_miss = engine.step
                for blk in model.blocks:
                    blk.table.data.mul_(1.25)  # no version bump: outside the contract's sight
            out.float().pow(2).mean().backward()
            opt.step()
    records = engine.records.read()
    engine.uninstall()
    return records, first_miss


def _bad(records) -> list:
    return [(r.step, r.segment, r.check, r.outcome) for r in records if r.outcome != "match"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_numerics_are_no_divergence(kernel, config):
    records, _ = _train(kernel, *CONFIGS[config])
    assert _bad(records) == [], f"{kernel} ({config}): {_bad(records)[:6]}"
    assert [r for r in records if r.check == "grad"], "no derivative check ran"
    if config == "min_replayed_probe":
        assert [r for r in records if r.check == "probe"], "the probe was not replayed"


@pytest.mark.parametrize("config", ["auto", "min"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_missed_state_is_still_caught_on_the_first_checked_step(kernel, config):
    records, first_miss = _train(kernel, *CONFIGS[config], miss=True)
    divergences = sorted({r.step for r in records if r.outcome == "divergence"})
    assert divergences and divergences[0] == first_miss, (
        f"{kernel} ({config}): missed state from step {first_miss}, divergences at {divergences}"
    )


def test_bfloat16_noise_is_judged_by_its_own_dtype():
    """A bf16 model whose weight gradients carry bf16 ulp noise: matched within the measured
    spread (a float32 tolerance would call every bf16 last-bit difference a divergence)."""
    records, _ = _train("noisy_weight_grad", None, "auto", dtype=torch.bfloat16)
    assert _bad(records) == []
    noisy = [json.loads(r.detail) for r in records if r.check == "grad" and "noise" in r.detail]
    assert noisy and all(
        "within the kernels' own run-to-run spread" in d["noise"]["summary"] for d in noisy
    )


def test_a_noisy_match_records_the_reference_spread():
    """The record says the check matched within the kernel's own spread, and how large it was."""
    records, _ = _train("noisy_weight_grad", None, "auto")
    noisy = [json.loads(r.detail) for r in records if r.check == "grad" and "noise" in r.detail]
    assert noisy, "no check measured the reference's noise"
    d = noisy[0]
    assert d["differ"] == [] and d["noise"]["spread"] > 0
    assert d["noise"]["summary"].startswith("matched within the kernels' own run-to-run spread")
    assert d["noise"]["reference_passes"] >= 2 and d["noise"]["tensors"]


def test_an_exact_reference_stays_bitwise():
    """No noise in the backward: a replay off by one ulp in a buffer is a divergence (the
    reference's passes agree, so nothing is tolerated)."""
    torch.manual_seed(0)
    model = Net("padded_view")
    engine = lr.install(model, SEGMENTS, on_violation="record")
    x = torch.randn(B, D)
    for _ in range(2):
        model(x).sum().backward()
    engine.request_check(bytes=False)
    out = model(x)
    for blk in model.blocks:
        blk.table.data.copy_(torch.nextafter(blk.table, torch.full_like(blk.table, 2.0)))
    out.sum().backward()
    grad = [r for r in engine.records.read() if r.check == "grad"]
    assert grad and all(r.outcome == "divergence" for r in grad)
    assert all("noise" not in json.loads(r.detail) for r in grad)


def test_noise_allowance_scales_with_the_measured_spread_and_the_dtype():
    ref = (torch.ones(4), torch.ones(4, dtype=torch.bfloat16))
    same = _Noise(ref, [tuple(t.clone() for t in ref)])
    assert not same.noisy
    moved = (ref[0] + torch.tensor([0, 1e-6, 0, 0]), ref[1])
    noise = _Noise(ref, [moved])
    assert noise.noisy and noise.spread[0] == pytest.approx(1e-6, rel=0.1)
    assert noise.allowance(0, ref[0]) == pytest.approx(NOISE_FACTOR * noise.spread[0])
    # no spread measured on the bf16 gradient: its floor is a few bf16 ulps, not float32's
    assert noise.allowance(1, ref[1]) >= torch.finfo(torch.bfloat16).eps


def _scripted(passes: list) -> Callable[[], tuple]:
    """A backward pass that returns the next of ``passes`` at each call (a noise drawn in
    advance), and fails past the last."""
    it = iter(passes)
    return lambda: next(it)


def test_noise_whose_first_passes_fell_small_is_judged_by_its_full_width():
    """A gradient of small values summed from large terms (cancellation: its noise is many of
    its own ulps). The replay is one more draw of the noise, 2e-7 away; the first further
    passes happened to move only a tiny element (1e-9): from them alone (4 x a spread of 1e-9,
    and a floor of 4 ulps of 1e-3) the replay looked diverged, as the flaky
    noisy_custom_op-regions check did once. The gap is noise-sized, so more passes are taken,
    and they show the noise's full width: a match."""
    ref = torch.tensor([1e-3, -1e-3, 1e-5, 2e-4])
    at = torch.tensor([1.0, 0.0, 0.0, 0.0])
    small = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rep = ref + 2e-7 * at
    early = [(ref + 1e-9 * small,), (ref - 1e-9 * small,)]
    later = [(ref + (-1) ** k * 1e-7 * at,) for k in range(NOISE_SAMPLES_MAX)]
    first = GradNoise((ref,), early, (rep,), [(rep,)])
    assert first.beyond() == [0] and first.close()  # the rule before: a false divergence
    noise = measure_noise((ref,), (rep,), _scripted(early + later), _scripted([(rep,)]))
    assert noise.beyond() == [], noise.spread
    assert noise.samples == 1 + 4  # 2 passes more settled it (2, then 4)


def test_a_missed_state_costs_no_more_passes_and_stays_a_divergence():
    """A gap far beyond the noise (a missed state's effect) is not close: judged on the first
    passes, a divergence. A replay that differs where no pass ever does (a deterministic
    kernel) stays a divergence after the most passes."""
    ref = torch.linspace(-1, 1, 8)
    rep = ref * 1.001  # 0.1 %: ~8,000 float32 ulps

    def draws(at: torch.Tensor) -> Callable[[], tuple]:
        gen = torch.Generator().manual_seed(0)
        return lambda: (at + 1e-7 * torch.randn(8, generator=gen),)

    noise = measure_noise((ref,), (rep,), draws(ref), draws(rep))
    assert noise.beyond() == [0] and noise.samples == 1 + NOISE_SAMPLES
    one_ulp = torch.nextafter(ref, torch.full_like(ref, 2.0))
    exact = measure_noise((ref,), (one_ulp,), lambda: (ref.clone(),), lambda: (one_ulp.clone(),))
    assert not exact.noisy and exact.beyond() == [0]
    assert exact.samples == 1 + NOISE_SAMPLES_MAX


def _allowance_draws(kernel: str, draws: int, miss: float | None) -> tuple[int, int]:
    """``draws`` checks of the allowance alone on a block with ``kernel`` (seed = draw): the
    reference's passes and the replay's are backward passes of a forward with the same values
    (an exact replay), or of one whose buffer moved by ``miss`` (a missed state). (judged
    divergences, further passes taken in all)."""
    flagged = passes = 0
    for seed in range(draws):
        torch.manual_seed(seed)
        blk = Block(kernel)
        gen = torch.Generator().manual_seed(10_000 + seed)
        x, g = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)

        def backward(block: nn.Module) -> Callable[[], tuple]:
            xx = x.clone().requires_grad_()
            out, wrt = block(xx), [xx, *block.parameters()]
            return lambda: torch.autograd.grad(out, wrt, g, retain_graph=True, allow_unused=True)

        twin = copy.deepcopy(blk)
        if miss is not None:
            twin.table.data.mul_(1 + miss)
        ref_pass, rep_pass = backward(blk), backward(twin)
        noise = measure_noise(ref_pass(), rep_pass(), ref_pass, rep_pass)
        flagged += bool(noise.beyond())
        passes += noise.samples + noise.replay_passes - 2
    return flagged, passes


@pytest.mark.parametrize("kernel", ["noisy_custom_op", "noisy_input_grad", "noisy_weight_grad"])
def test_the_allowance_alone_over_many_draws(kernel):
    """200 draws of an exact replay of a noisy kernel: no divergence; 200 with a missed state of
    0.1 % (the buffer the blocks read): every one a divergence."""
    assert _allowance_draws(kernel, 200, None)[0] == 0
    assert _allowance_draws(kernel, 200, 1e-3)[0] == 200


@pytest.mark.parametrize(
    ("kernel", "why"),
    [
        ("rng_seed_offset", "drew no random numbers"),
        ("rng_state_unused", "drew no random numbers"),
        ("unwritten_workspace", "differs between two runs on the same arguments"),
        ("unwritten_padded_rows", "differs between two runs on the same arguments"),
    ],
)
def test_a_replayed_probe_names_the_values_its_kernels_do_not_reproduce(kernel, why):
    """The probe's match record says which saved tensors differed and why they are no
    evidence of state; nothing is retained, nothing warned."""
    records, _ = _train(kernel, *CONFIGS["min_replayed_probe"])
    probes = [json.loads(r.detail) for r in records if r.check == "probe"]
    assert probes and all(r.outcome == "match" for r in records if r.check == "probe")
    named = [t for d in probes for t in d.get("unreproduced_saved_tensors", [])]
    assert named and all(why in t for t in named), named
    assert all("differing_saved_tensors" not in d for d in probes)


#: a replayed probe (budget="min") and no checks requested at all
PROBE_ONLY = ("min", "auto", STEPS)


def test_a_value_no_probe_can_tell_is_settled_by_a_derivative_check_next_step():
    """A saved value the kernel does not reproduce is no evidence at the probe, but the
    gradient may read it (here a scale drawn from a generator in the kernel's closure): the
    probe records it by name and asks for a derivative check of the segment on the next step,
    which compares the gradients from the forward's saved values and the replay's and records
    the divergence, with no check requested by the user."""
    records, _ = _train("closure_grad_scale", *PROBE_ONLY)
    probes = [r for r in records if r.check == "probe"]
    assert probes and all(r.outcome == "match" for r in probes)
    first = [json.loads(r.detail) for r in probes]
    assert all(d["follow_up"] == "derivative check on the next step" for d in first), first
    probe_step = probes[0].step
    grad = [r for r in records if r.check == "grad"]
    assert grad and grad[0].step == probe_step + 1 and grad[0].outcome == "divergence", [
        (r.step, r.segment, r.outcome) for r in grad
    ]


@pytest.mark.parametrize("kernel", ["unwritten_workspace", "unwritten_padded_rows"])
def test_the_follow_up_check_of_an_unread_workspace_matches(kernel):
    records, _ = _train(kernel, *PROBE_ONLY)
    assert _bad(records) == []
    grad = [r for r in records if r.check == "grad"]
    assert grad and grad[0].step == min(r.step for r in records if r.check == "probe") + 1


def test_running_a_kernel_again_never_writes_what_it_read():
    """Eager CPU batch norm writes its running statistics without a schema annotation: the
    probe's second run of it (to tell whether its saved mean is reproducible) leaves them as
    the first run left them, and calls the value no kernel noise."""
    from lightning_replay.kernel_noise import ProducerLog

    x = torch.randn(6, 3)
    mean, var = torch.zeros(3), torch.ones(3)
    log = ProducerLog()
    with log:
        out, save_mean, _ = torch.ops.aten.native_batch_norm(
            x, None, None, mean, var, True, 0.1, 1e-5
        )
    after = mean.clone(), var.clone()
    assert not torch.equal(after[0], torch.zeros(3))  # the first run wrote them
    assert log.unreproduced(save_mean) is None
    assert torch.equal(mean, after[0]) and torch.equal(var, after[1])


@pytest.mark.parametrize(
    "op",
    [
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ],
)
def test_torch_attention_ops_rng_outputs_are_known_by_their_schema(op):
    """The rule the probe applies to the GPU kernels themselves (no CUDA needed to read their
    schemas): with dropout_p=0 their seed/offset (or rng_state/unused) outputs are no evidence;
    with dropout they are."""
    from lightning_replay.kernel_noise import _rng_outputs

    func = getattr(torch.ops.aten, op).default

    def args(p):
        return tuple(p if a.name == "dropout_p" else None for a in func._schema.arguments)

    names = {func._schema.returns[i].name for i in _rng_outputs(func, args(0.0), {})}
    assert names in ({"philox_seed", "philox_offset"}, {"rng_state", "unused"})
    assert _rng_outputs(func, args(0.1), {}) == set()
