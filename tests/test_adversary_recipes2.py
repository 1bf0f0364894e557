"""Adversary, second round, for issue 33: new variants of classes 1-12 (argument containers,
views and strides, manual windows, double backward, ``autograd.grad`` inside a forward,
``torch.func``, hooks, AMP, channels_last, calls that change from step to step), plus the
TorchScript, budget and compile follow-ups. Reference: plain PyTorch, bit-equal gradients
(or a clear refusal naming the segment). Failures not fixed are ``xfail(strict=True)`` with
the measured failure as reason (see ``/work/notes/i33-rest.md``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_replay as lr

D = 8
B = 4
STEPS = 4
PRES = [{"preservation": "auto"}, {"preservation": "whole"}, {"preservation": "regions"}]
WITH_BUDGET = PRES + [{"budget": "min"}]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model: nn.Module, step: Callable, steps: int = STEPS) -> list[dict]:
    torch.manual_seed(11)
    g = torch.Generator().manual_seed(7)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for s in range(steps):
        o.zero_grad(set_to_none=True)
        extra = step(model, g, s) or {}
        got = _grads(model)
        got.update({f"extra.{k}": v.detach().clone() for k, v in extra.items()})
        out.append(got)
        o.step()
    return out


def _diff(a: list[dict], b: list[dict]) -> list[tuple[int, str]]:
    assert len(a) == len(b)
    out = []
    for s, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys(), (s, sorted(ga), sorted(gb))
        out += [(s, k) for k in ga if not torch.equal(ga[k], gb[k])]
    return out


def _replays(eng: Any) -> int:
    return sum(v.get("replays", 0) for v in eng.summary().values() if isinstance(v, dict))


def _check(
    make: Callable[[], nn.Module],
    step: Callable,
    kws: list[dict] = PRES,
    spec: Any = "blocks.*",
    replays: bool = True,
) -> None:
    torch.manual_seed(0)
    ref = make()
    expected = _run(copy.deepcopy(ref), step)
    for kw in kws:
        model = copy.deepcopy(ref)
        eng = lr.install(model, spec, **kw)
        try:
            got = _run(model, step)
            bad = _diff(expected, got)
            worst = max(
                (float((expected[i][k] - got[i][k]).abs().max()) for i, k in bad), default=0
            )
            assert bad == [], (kw, len(bad), sum(map(len, expected)), f"max|diff|={worst:.3g}")
            if replays:
                assert _replays(eng), (kw, eng.summary())
            assert eng.preserved_bytes == 0, kw
        finally:
            eng.uninstall()


class Blk(nn.Module):
    """A stateful block: a reduction over the batch and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x - x.mean(0))).tanh()


# ============================================================ TorchScript (class 8 follow-up)
# TorchScript's executor compiles a function's plan once per process for a graph: plain
# training itself differs between the first run in a process and later ones (measured: 28/32
# gradients). A fair referee runs plain and replay each in a fresh process.
_SCRIPT_WORKER = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from torch import nn
    import lightning_replay as lr

    @torch.jit.script
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)

    class Blk(nn.Module):
        def __init__(self, reach):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            if reach == "attribute":
                self.fn = gelu  # reached through an attribute: no name in the code
            self.reach = reach

        def forward(self, x):
            h = self.bn(self.lin(x))
            return self.fn(h) if self.reach == "attribute" else gelu(h)

    reach, kw = sys.argv[1], json.loads(sys.argv[2])
    torch.manual_seed(0)
    net = nn.Sequential(Blk(reach), Blk(reach))
    eng = lr.install(net, ["0", "1"], **kw) if kw is not None else None
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    grads = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(5):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            grads.append([p.grad.tolist() for p in net.parameters()])
            opt.step()
    out = {"grads": grads, "warned": [str(x.message) for x in w if "TorchScript" in str(x.message)]}
    if eng is not None:
        out["records"] = [str(r.detail) for r in eng.records if r.outcome == "rejection"]
    print(json.dumps(out))
    """
)


_PLAIN: dict = {}


def _script_run(tmp_path: Any, reach: str, kw: dict | None) -> dict:
    if kw is None and "plain" in _PLAIN:  # (both reaches compute the same in plain)
        return _PLAIN["plain"]
    path = tmp_path / "worker.py"
    path.write_text(_SCRIPT_WORKER)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, str(path), reach, json.dumps(kw)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if kw is None:
        _PLAIN["plain"] = out
    return out


@pytest.mark.parametrize(
    ("reach", "kw"),
    [
        ("global", {"preservation": "auto"}),
        ("global", {"budget": "min"}),
        ("attribute", {"preservation": "whole"}),
    ],
)
def test_torchscript_function_in_a_segment_is_kept_retained_and_exact(
    tmp_path: Any, reach: str, kw: dict
) -> None:
    """Measured on main (fresh processes): under auto/whole 10 of the gradients differ from
    plain (the optimising executor runs the replay through another plan than the forward),
    silently; under a budget a ReplayError at step 1. Now: the probe sees the call, the
    segment is kept retained, with a warning and a record naming it."""
    plain = _script_run(tmp_path, reach, None)
    got = _script_run(tmp_path, reach, kw)
    assert got["grads"] == plain["grads"]
    assert any("segment '0' calls TorchScript" in m for m in got["warned"]), got["warned"]
    assert any("TorchScript" in r and "retain" in r for r in got["records"]), got["records"]
