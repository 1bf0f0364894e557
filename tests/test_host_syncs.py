"""A steady unchecked step under replay asks the device for no more host reads than plain
training does (issue 31: on an H200 every host read of a device value synchronizes the stream).

The referee is plain PyTorch: the same model and AdamW, trained the same steps without
lightning_replay, counted by the same counter (``benchmarks/sync_counter.py``: a dispatch mode
and a function mode that see ``.item()``, ``bool()``, ``int()``, ``float()``, ``torch.equal``,
``.tolist()``, ``.numpy()``, blocking copies to the host, data-dependent shapes and
``torch.cuda.synchronize``). AdamW's own ``step.item()`` counts on both sides.

The engine decides some things from tensor values only where reading them is free (CPU
tensors: :func:`lightning_replay.state.host_reads_free`) and takes other branches on CUDA
(``engine._cuda``: allocator peaks, no profiler). :func:`accelerator_paths` runs those
accelerator branches on CPU tensors, with the allocator's host-side counters stubbed, so that
the count on CPU is the count a GPU run asks for.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
import lightning_replay.engine as _engine
import lightning_replay.state as _state
from lightning_replay.demos.hazards import HAZARDS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
from sync_counter import SyncCounter  # noqa: E402

sys.path.pop(0)


@contextlib.contextmanager
def accelerator_paths():
    """The engine's accelerator branches on CPU tensors: the model counts as on CUDA (its
    allocator's host-side counters stubbed: they never synchronize) and no tensor's values
    are free to read on the host."""
    saved = []

    def patch(owner, attr, value):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    patch(_engine, "_first_param_is_cuda", lambda model: True)
    patch(_engine, "_model_cuda_device", lambda model: torch.device("cpu"))
    for name in ("max_memory_allocated", "memory_allocated", "max_memory_reserved"):
        patch(torch.cuda, name, lambda device=None: 0)
    patch(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    patch(torch.cuda, "synchronize", lambda device=None: None)  # counted by SyncCounter
    patch(_state, "host_reads_free", lambda t: False)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


class ConvBN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBN(c) for _ in range(3)])
        self.head = nn.Linear(c, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _images(step: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))


def _gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    cfg.use_cache = False
    model = GPT2LMHeadModel(cfg)

    def make(step: int) -> torch.Tensor:
        return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))

    return model, ["transformer.h.0", "transformer.h.1"], make, lambda m, x: m(x).logits


def _hazard(name: str):
    def build():
        torch.manual_seed(0)
        h = HAZARDS[name]()
        return h.model, h.segments, h.make_input, lambda m, x: m(x)

    return build


MODELS = {
    **{
        n: _hazard(n)
        for n in (
            "stateless",
            "batch_norm",
            "counter",
            "queue",
            "bank_index_put",
            "tensor_attr",
            "alias_input",
            "rng",
            "python_attrs",
            "combined",
        )
    },
    "convnet_bn": lambda: (
        (torch.manual_seed(0), ConvNet())[1],
        ["blocks.0", "blocks.1", "blocks.2"],
        _images,
        lambda m, x: m(x),
    ),
    "gpt2": _gpt2,
}
OPTIONS = {
    "auto": {},
    "whole": {"preservation": "whole"},
    "regions": {"preservation": "regions"},
    "recompute_or_whole_min": {"budget": "min"},
}


def _train(model, make, forward, install=None, steps=6, counted=(), check=()):
    """AdamW steps, at least ``steps``; under a budget on until the plan has run a step. The
    last step and those in ``counted`` run under a :class:`SyncCounter`: returns them by
    step, and the engine."""
    engine = install(model) if install is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counters = {}
    planned = step = 0
    while True:
        last = step >= steps - 1 and (
            engine is None or not engine.measure_costs or planned >= 1
        )  # under a budget: after the probe, the calibration and the plan's first step
        if step in check:
            engine.request_check()
        x = make(step)
        with SyncCounter() if (step in counted or last) else contextlib.nullcontext() as c:
            forward(model, x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if c is not None:
            counters[step] = c
        planned += engine is not None and engine.plan is not None
        step += 1
        if last:
            return counters, engine
        assert step < 60, "no plan after 60 steps"


def _plain_count(build, step: int) -> int:
    model, _, make, forward = build()
    counters, _ = _train(model, make, forward, steps=step + 1, counted=(step,))
    return counters[step].count


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_steady_unchecked_step_syncs_as_plain_training(name, option):
    """The last step of a run (after the probe, and under a budget after calibration and the
    plan's first step) asks for exactly as many host reads as plain training's same step."""
    build = MODELS[name]
    model, segments, make, forward = build()
    with warnings.catch_warnings(), accelerator_paths():
        warnings.simplefilter("ignore")
        counters, engine = _train(
            model, make, forward, install=lambda m: lr.install(m, segments, **OPTIONS[option])
        )
    step = max(counters)
    replay = counters[step]
    plain = _plain_count(build, step)
    assert replay.count == plain, (
        f"{name}/{option}: step {step} asked for {replay.count} host reads under replay, "
        f"{plain} in plain training: {dict(replay.by_kind)}"
    )


def test_counter_sees_every_kind_of_host_read():
    """The referee itself: each kind of host read counts once, device work does not."""
    t = torch.arange(6.0)
    with SyncCounter() as c:
        t.sum().item()
        bool(t[1] > 0)
        int(t[2])
        float(t[3])
        t.tolist()
        t.numpy()
        torch.equal(t, t)
        t.cpu()
        t.to("cpu")
        t[t > 2]
        torch.nonzero(t)
        t.clone().add_(1).mul(2)  # device work: none
    assert c.count == 11, dict(c.by_kind)


def test_a_checked_step_may_read_more_but_the_next_unchecked_one_does_not():
    """A derivative- and byte-checked step compares on the host (that is what it is for); the
    unchecked step after it is back to plain training's count. (CPU branches: a checked step
    saves the device's generator states, which the accelerator stand-in does not have.)"""
    build = MODELS["combined"]
    model, segments, make, forward = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counters, _ = _train(
            model,
            make,
            forward,
            install=lambda m: lr.install(m, segments),
            steps=6,
            counted=(3, 4),
            check=(3,),
        )
    plain3, plain4 = _plain_count(build, 3), _plain_count(build, 4)
    assert counters[3].count > plain3
    assert counters[4].count == plain4
