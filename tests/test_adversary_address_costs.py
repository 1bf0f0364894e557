"""Byte figures that named state by the address a storage had at an earlier point.

Two structures keyed by ``storage_key`` outlived the point where a parameter's storage moves:

* the memory accountant's static set (the model's parameters and buffers as the window began,
  left out of the saved-tensor count): FSDP2 frees a gathered parameter after its block's
  forward and gathers it again elsewhere; an activation that later lands at the parameter's old
  address was taken for the parameter and not counted, so the step's accounted peak read low;
* the segment's ``state_keys`` (the storages its probe saw as state, left out of a measured
  call's activation bytes): a parameter that moved since the probe (regathered, or put on new
  storage by an optimizer every step) was counted as an activation, and an activation landing
  where the probe's state or input had been was not.

Referee: the same model and steps without the storage moves (same shapes, same bytes held), whose
figures the engine must reproduce exactly; moving a storage changes no byte a step holds.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import lightning_replay as lr
from tests.test_adversary_address import SEGS, D, RebindingSGD, Stack, _Regather

STEPS = 6


def _x(step: int) -> torch.Tensor:
    """A batch of ``D`` rows: each activation is the size of a weight, so the allocator hands
    a freed weight's address to an activation (as FSDP2's gathered blocks meet on a GPU)."""
    return torch.randn(D, D, generator=torch.Generator().manual_seed(1000 + step))


def _regathered() -> Stack:
    m = Stack()
    for blk in m.blocks:
        blk.register_forward_hook(_Regather(blk).after_forward)
    return m


def _figures(make, opt, setting: dict) -> tuple[list, dict]:
    """Each step's accounted peak, and the activation bytes the checked calls measured."""
    torch.manual_seed(0)
    model = make()
    eng = lr.install(model, list(SEGS), on_violation="record", track_memory=True, **setting)
    optim = opt(model.parameters())
    peaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(STEPS):
            eng.request_check()
            optim.zero_grad(set_to_none=True)
            (model(_x(step)) ** 2).mean().backward()
            optim.step()
            peaks.append(eng.window_stats()["peak_bytes"])
    measured = dict(eng.meter.activation_bytes)
    bad = [r for r in eng.records.read() if r.outcome != "match" and r.check != "guard"]
    eng.uninstall()
    assert not bad, bad
    return peaks, measured


SGD = functools.partial(torch.optim.SGD, lr=0.05)
SETTINGS = {
    "retain": {"preservation": "retain"},
    "whole": {"preservation": "whole"},
    "min": {"budget": "min", "calibration_steps": 1},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_regathered_parameters_leave_the_accounted_bytes_unchanged(setting):
    """FSDP2-like free and regather after each block's forward: every step's accounted peak
    and every measured activation figure equal those without it. Before the fix (retain): an
    activation at a freed weight's address went uncounted (15,232 against 16,256 bytes at
    D = 16); under ``min`` the regathered weight was measured as an activation (2,048
    against 1,024 bytes)."""
    assert _figures(_regathered, SGD, SETTINGS[setting]) == _figures(Stack, SGD, SETTINGS[setting])


def test_parameters_moved_by_the_optimizer_are_not_measured_as_activations():
    """An optimizer that puts every weight on new storage each step (``p.data = p - lr * g``):
    the checked calls' activation bytes equal those under an in-place SGD."""
    moved = _figures(Stack, RebindingSGD, SETTINGS["min"])
    assert moved == _figures(Stack, SGD, SETTINGS["min"])
