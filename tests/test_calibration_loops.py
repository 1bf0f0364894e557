"""Issue 31 (session 15, items 2 to 4 of ``/work/notes/adv-s15.md``): calibration on loops
nobody listed.

A window the engine measures or calibrates in is a whole training step (forward, backward,
optimizer). A train-mode forward with grad on whose graph is dropped without a backward (a
logged forward, an eval-mode forward with grad on, the second of two forwards only one of which
is backpropagated) is none: the first plan comes after as many *training* steps as in the plain
loop, and the engine's measurement never runs on past such a forward. Two forwards whose
outputs feed one backward are one training step. The referee is the same engine on the plain
loop (one forward, one backward, one optimizer step), and torch's own profiler state.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr

W, N = 32, 128


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, 2 * W)
        self.b = nn.Linear(2 * W, W)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self, out: str = "tensor") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Blk() for _ in range(3))
        self.head = nn.Linear(W, 1)
        self.out = out

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        y = self.head(x)
        return {"y": y, "h": x} if self.out == "dict" else y


def _y(out):
    return out["y"] if isinstance(out, dict) else out


def _batch(s: int) -> torch.Tensor:
    return torch.randn(N, W, generator=torch.Generator().manual_seed(s))


def _profiling() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


_PLANNED: list[bool] = []  # per training forward: whether a plan ran it


def _plain(model, opt, s):
    out = model(_batch(s))
    _PLANNED.append(_ENGINE[0].plan is not None)
    _y(out).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _logged_after(model, opt, s):
    _plain(model, opt, s)
    _y(model(_batch(1000 + s))).mean().item()  # logged, never backpropagated


def _dropped_after(model, opt, s):
    _plain(model, opt, s)
    model(_batch(1000 + s))  # output dropped at once


def _eval_grad_after(model, opt, s):
    _plain(model, opt, s)
    model.eval()
    _y(model(_batch(1000 + s))).sum().item()  # eval mode, grad on, no backward
    model.train()


def _logged_before(model, opt, s):
    _y(model(_batch(1000 + s))).mean().item()
    _plain(model, opt, s)


def _two_forwards_one_backward(model, opt, s):
    a = model(_batch(s))
    _PLANNED.append(_ENGINE[0].plan is not None)
    b = model(_batch(2000 + s))
    (_y(a).pow(2).mean() + _y(b).pow(2).mean()).backward()
    opt.step()


def _backward_of_one_of_two(model, opt, s):
    a = model(_batch(s))
    _PLANNED.append(_ENGINE[0].plan is not None)
    b = model(_batch(2000 + s))
    _y(a).pow(2).mean().backward()
    del b
    opt.step()


LOOPS = {
    "forward_logged_after_each_step": _logged_after,
    "forward_output_dropped_after_each_step": _dropped_after,
    "eval_mode_forward_with_grad_after_each_step": _eval_grad_after,
    "forward_logged_before_each_step": _logged_before,
    "two_forwards_one_backward_of_their_sum": _two_forwards_one_backward,
    "backward_of_one_of_two_forwards": _backward_of_one_of_two,
}


_ENGINE: list = [None]


def _run(loop, budget, out="tensor", steps=8):
    """The first training step (0-based) whose training forward ran a plan, the engine's
    count of steps to the first plan, and the steps after which the engine's profiler was
    still on."""
    torch.manual_seed(0)
    model = Net(out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = _ENGINE[0] = lr.install(model, [f"blocks.{i}" for i in range(3)], budget=budget)
    left_on = []
    _PLANNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            (loop or _plain)(model, opt, s)
            if _profiling():
                left_on.append(s)
            opt.zero_grad(set_to_none=True)
    expected = engine.steps_to_first_plan
    engine.uninstall()
    _ENGINE[0] = None
    first_plan = _PLANNED.index(True) if True in _PLANNED else None
    return first_plan, expected, left_on


@pytest.mark.parametrize("budget", ["bytes", "min"])
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_only_training_steps_calibrate(loop, budget):
    # the referee: the same engine on the plain loop
    ref, expected, _ = _run(None, 10**9 if budget == "bytes" else "min")
    assert ref is not None and ref == expected - 1, (ref, expected)
    first, _, left_on = _run(LOOPS[loop], 10**9 if budget == "bytes" else "min")
    if loop == "forward_logged_before_each_step":
        # the probe watches a forward (no backward needed): the very first forward, the logged
        # one, is it; the calibration phases are training steps
        ref -= 1
    assert first == ref, (
        f"{loop}: the first plan ran at training step {first}, the plain loop's at {ref}: "
        "forwards without a backward of their own counted as calibration steps"
    )
    assert not left_on, f"{loop}: the engine's profiler still ran after steps {left_on}"


def test_dict_output_logged_forward_is_no_step():
    """The token hangs on every output with a graph (a dict here)."""
    ref, _, _ = _run(None, "min", out="dict")
    first, _, left_on = _run(_logged_after, "min", out="dict")
    assert first == ref and not left_on, (first, ref, left_on)


# ------------------------------------------------ batches whose size changes between steps
# Each step, from the probe on, judged on its own by the whole-process referee
# (tests.helpers.torch_memory.StepReferee through budget_runner.run_arm: AdamW,
# model(x).pow(2).mean()), against a budget halfway between torch checkpoint's and plain
# training's largest steady peak over the same batches. A step whose batch is larger than any
# the run measured runs within the budget; a big first batch does not make the first plan's
# refusal name a minimum that only that batch needed.

from tests.helpers.budget_runner import run_arm  # noqa: E402

MIB = 2**20
TOLERANCE = 1.02
SW, SN = 48, 384


class Mlp(nn.Module):
    def __init__(self, hidden: int = 3 * SW) -> None:
        super().__init__()
        self.up = nn.Linear(SW, hidden)
        self.down = nn.Linear(hidden, SW)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Chain(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(n))
        self.head = nn.Linear(SW, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _sizes(pattern):
    def batch(s: int) -> torch.Tensor:
        rows = pattern(s)
        return torch.randn(rows, SW, generator=torch.Generator().manual_seed(s))

    return batch


#: name -> rows of step s
SIZES = {
    # the big batch comes during calibration, on its third step
    "small_small_then_twice": lambda s: (SN // 2, SN, 2 * SN)[s % 3],
    # a 3 x batch every fourth step (the first of them a calibration step)
    "three_times_every_fourth": lambda s: 3 * SN if s % 4 == 3 else SN,
    # the first batch 3 x the rest, then one size
    "first_batch_three_times": lambda s: 3 * SN if s == 0 else SN,
    # the first batch 4 x, then half and whole batches in turn
    "first_batch_four_times_then_two_sizes": lambda s: 4 * SN if s == 0 else (SN // 2, SN)[s % 2],
}

_SREF: dict = {}


def _size_refs(name, referee, steps=12):
    if name not in _SREF:
        batch = _sizes(SIZES[name])
        plain = run_arm(Chain, _snames(), "plain", referee, batch, steps=steps).peaks
        ckpt = run_arm(Chain, _snames(), "checkpoint", referee, batch, steps=steps).peaks
        _SREF[name] = plain, ckpt
    return _SREF[name]


def _snames():
    return [f"blocks.{i}" for i in range(3)]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_changing_batch_sizes_hold_a_halfway_budget(name, referee):
    plain, ckpt = _size_refs(name, referee)
    batch = _sizes(SIZES[name])
    # steady figures: the first step of each arm is a cold start (and may be the big batch)
    top_plain, top_ckpt = max(plain[1:]), max(ckpt[1:])
    halfway = (top_plain + top_ckpt) // 2
    run = run_arm(
        Chain, _snames(), "replay", referee, batch, budget=halfway, steps=4, keep_refusal=True
    )
    report = ", ".join(f"{p / MIB:.3f}" for p in run.peaks)
    assert run.refused is None, (
        f"{name}: refused {halfway / MIB:.3f} MiB, which torch checkpoint meets on every batch "
        f"after the first ({top_ckpt / MIB:.3f}); steps {report}: {run.refused}"
    )
    assert run.planned, f"{name}: no plan; steps {report}"
    # the first batch (the probe's): the budget, or what torch checkpoint needs for it
    bounds = [max(halfway, ckpt[0])] + [halfway] * (len(ckpt) - 1)
    over = [
        (s + 1, round(p / bounds[s], 3))
        for s, p in enumerate(run.peaks)
        if p > TOLERANCE * bounds[s]
    ]
    assert not over, (
        f"{name}: (step, peak / budget) over {TOLERANCE}: {over}; budget "
        f"{halfway / MIB:.3f} MiB; steps {report}; plain "
        + ", ".join(f"{p / MIB:.3f}" for p in plain[: len(run.peaks)])
    )
