"""Issues 31 and 30 against real models nobody here tested (round 3 of the adversary).

Tiny models built from configs (:mod:`tests.adversary_round3_zoo`): timm ViT with drop path,
ConvNeXt, MobileNetV3 (BN + squeeze-excite); torchvision EfficientNet-B0, MobileNetV3 and RegNet
at small widths; HF BERT and RoBERTa (token types, padding mask, tied decoder), ALBERT (one layer
shared by every depth), T5 (relative position bias, encoder-decoder), Mixtral and Qwen2-MoE
(routers, jitter noise), Mamba; a model with weights tied across segments and a block called
twice. All trained with AdamW. The referees are the existing ones, imported, not copied:

- exactness: plain PyTorch, bit for bit on every weight and buffer after 6 steps, under
  ``auto``, ``whole``, ``regions`` and ``selective`` (policies ``matmul`` and
  ``every_other_matmul``);
- issue 31's budget from step one (halfway between torch checkpoint's and plain training's
  whole-process peak): :func:`tests.test_budget_every_step.test_every_step_holds_a_budget_halfway_between_checkpoint_and_plain`,
  also with ``planner="selective_all"`` (issue 30);
- issue 31's between-steps bytes, uninstall lifetime and ``budget="min"`` bound:
  :mod:`tests.test_memory_lifetime`'s three tests (a garbage-collector walk, weak references).

The memory tests run each model at 4 x its batch (Mamba's slow scan at 1 x) so that its
activations are a few MiB beside the 1 MiB of slack. A case that fails is a strict xfail whose
reason is the measured figure.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

import lightning_replay as lr
from tests import test_budget_every_step as every_step
from tests import test_memory_lifetime as lifetime
from tests.adversary_round3_zoo import MODELS, build

STEPS = 6
MEMORY_BATCH = {"mamba": 1}  # else 4; a case "name@n" runs the model at n x its batch

#: the whole matrix takes about 30 minutes on this 2-core machine under load (the memory
#: referees walk the garbage collector's objects every step of a process holding timm and
#: transformers); by default the memory tests run the failing cases and one model per family,
#: ``ADVERSARY_FULL=1`` runs every model
FULL = bool(os.environ.get("ADVERSARY_FULL"))
MEMORY_MODELS = list(MODELS) if FULL else ["mixtral", "albert", "shared_blocks"]
#: by default every model runs under ``auto`` and ``selective_matmul``; the other modes with
#: ``ADVERSARY_FULL=1``
DEFAULT_MODES = ("auto", "selective_matmul")


def _cases(xfails: dict, values: list[tuple]) -> list:
    """``values`` and known failures (strict xfails: a fix shows as an XPASS) whose model is in
    ``MEMORY_MODELS``."""
    cases = values + [v for v in xfails if v not in values]
    keep = [v for v in cases if v[0].partition("@")[0] in MEMORY_MODELS]
    return _xfail(xfails, *[v for v in keep if FULL or v not in FULL_ONLY])


def _batch(case: str) -> tuple[str, int]:
    name, _, n = case.partition("@")
    return name, int(n) if n else MEMORY_BATCH.get(name, 4)


def _train(model: torch.nn.Module, make, steps: int = STEPS) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(steps):
        torch.manual_seed(100 + s)  # the same dropout, drop path and router noise draws
        model(make(s)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def _plain(name: str) -> dict[str, torch.Tensor]:
    model, _, make = build(name)
    return _train(model, make)


#: failures that depend on the planner's measured times (which of several segments it retains):
#: non-strict xfails
TIMED: set = set()
#: halfway-budget cases left to ``ADVERSARY_FULL=1`` (30-50 s each here; they passed, or
#: repeat a failure another default case shows)
FULL_ONLY = {
    ("mixtral", "selective_all"),
    ("shared_blocks", "selective_all"),
    ("shared_blocks@1", "joint"),
}


def _xfail(cases: dict, *values) -> list:
    return [
        pytest.param(*v, marks=pytest.mark.xfail(strict=v not in TIMED, reason=cases[v]))
        if v in cases
        else pytest.param(*v)
        for v in values
    ]


# ------------------------------------------------------------------ exactness (30 and all)
MODES = {
    "auto": {"preservation": "auto"},
    "whole": {"preservation": "whole"},
    "regions": {"preservation": "regions"},
    "selective_matmul": {"preservation": "selective", "selective": "matmul"},
    "selective_every_other": {"preservation": "selective", "selective": "every_other_matmul"},
}
EXACT_XFAIL: dict = {}


@pytest.mark.parametrize(
    "name,mode",
    _xfail(EXACT_XFAIL, *[(n, m) for n in MODELS for m in MODES if FULL or m in DEFAULT_MODES]),
)
def test_bit_identical_to_plain_training(name, mode):
    want = _plain(name)
    model, pattern, make = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lr.install(model, pattern, **MODES[mode])
        got = _train(model, make)
    summary = engine.summary()
    engine.uninstall()
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    assert not bad, f"{name} {mode}: {len(bad)} of {len(want)} differ from plain, e.g. {bad[:5]}"
    replays = {n: s["replays"] for n, s in summary.items()}
    assert all(r >= STEPS - 2 for r in replays.values()), f"segments not replayed: {replays}"
    if mode.startswith("selective"):
        modes = {s["mode"] for s in summary.values()}
        assert modes <= {"selective", "selective_whole"}, modes


# ------------------------------------------------------------------ issue 31: every step
def _budget_builder(case: str):
    def make():
        model, pattern, inputs = build(*_batch(case))
        return model, pattern, inputs, lambda m, x: m(x)

    return make


_REGNET = (
    "measured: not the engine's: torch checkpoint's whole-process peak on RegNet's blocks is "
    "not below plain's (3,610,712 B against 3,605,656 at 4 x batch): the peak is outside the "
    "segments (the stem), so no budget lies between them (the referee's precondition fails)"
)
#: (ALBERT's shared layer called 3 x per forward and shared_blocks' block 0 called 2 x overran
#: the first planned step, up to 1.454 x: a segment's calls were charged as one; issue 31,
#: fixed: every call is charged, tests/test_budget_multicall.py)
HALFWAY_XFAIL: dict = {}
if FULL:  # (a minute of two runs that judge the referee's precondition, not the engine)
    HALFWAY_XFAIL.update({("tv_regnet", "joint"): _REGNET, ("tv_regnet", "selective_all"): _REGNET})


@pytest.mark.parametrize(
    "name,planner",
    _cases(
        HALFWAY_XFAIL,
        [(n, p) for n in MODELS for p in ("joint", "selective_all")]
        + [("shared_blocks@1", "joint")],
    ),
)
def test_every_step_within_a_budget_halfway(name, planner, referee, monkeypatch):
    """Probe, calibration and planned steps each peak at <= 1.02 x a budget halfway between
    torch checkpoint's and plain training's whole-process peak (``selective_all``: the plans
    issue 30's baseline makes, every segment selective under ``"matmul"``)."""
    monkeypatch.setitem(every_step.MODELS, name, _budget_builder(name))
    if planner != "joint":
        install = functools.partial(lr.install, planner=planner, selective="matmul")
        monkeypatch.setattr(every_step, "lr", SimpleNamespace(install=install))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every_step.test_every_step_holds_a_budget_halfway_between_checkpoint_and_plain(
            name, referee
        )


# ------------------------------------------------------------------ issue 31: lifetime
def _lifetime_builder(case: str):
    def make():
        model, pattern, inputs = build(*_batch(case))
        depth = pattern.count(".")
        names = [
            n
            for n, _ in model.named_modules()
            if n.count(".") == depth and fnmatch.fnmatch(n, pattern)
        ]
        return model, names, inputs

    return make


def _lifetime(monkeypatch, name: str) -> str:
    key = f"round3_{name}"
    monkeypatch.setitem(lifetime.MODELS, key, _lifetime_builder(name))
    return key


HELD_XFAIL: dict = {}
_MAMBA = (
    "measured: {n} tensors (parameter and AdamW-state shapes: (18, 64), (64, 1, 4), (128, 32)) "
    "alive after uninstall: not the engine's: HF MambaForCausalLM is a reference cycle of its "
    "own (built, never installed or trained, `del model` leaves its parameters alive until "
    "gc.collect()); the referee cannot tell the model's cycles from the engine's"
)
UNINSTALL_XFAIL: dict = {
    ("mamba", "none"): _MAMBA.format(n=88),
    ("mamba", "min"): _MAMBA.format(n=132),
}
MIN_XFAIL: dict = {}  # (shared_blocks@1 retained blocks 1 and 2 over the bound: fixed, issue 31)


@pytest.mark.parametrize(
    "name,arm", _cases(HELD_XFAIL, [(n, a) for n in MODELS for a in ("none", "min")])
)
def test_held_between_steps(name, arm, monkeypatch):
    """Between steps, live bytes minus torch checkpoint's <= preserved bytes + 1 MiB."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lifetime.test_held_between_steps_is_torch_checkpoints(_lifetime(monkeypatch, name), arm)


@pytest.mark.parametrize(
    "name,arm", _cases(UNINSTALL_XFAIL, [(n, a) for n in MODELS for a in ("none", "min")])
)
def test_uninstall_leaves_nothing_alive(name, arm, monkeypatch):
    """After uninstall and dropping model and optimizer, weak references to every tensor
    alive between steps are dead, with the cyclic collector off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lifetime.test_uninstall_leaves_no_tensor_alive_without_the_cyclic_collector(
            _lifetime(monkeypatch, name), arm
        )


@pytest.mark.parametrize("name", _cases(MIN_XFAIL, [(n,) for n in MODELS] + [("shared_blocks@1",)]))
def test_lowest_plan_within_torch_checkpoint_plus_preserved(name, monkeypatch):
    """Under ``budget="min"``, a planned step <= 1.02 x torch checkpoint's + preserved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lifetime.test_lowest_plan_peaks_as_torch_checkpoint(_lifetime(monkeypatch, name))
