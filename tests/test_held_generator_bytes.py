"""A generator a segment's module holds is preserved once per call, and counted (issue 31):
between a forward and its backward, the replay holds one more generator state per segment
than torch checkpoint (which keeps the global RNG's), not one per Python wrapper the
dispatcher handed the probe, and :attr:`ReplayEngine.preserved_bytes` counts it. Trained
state equals plain PyTorch's bit for bit.

Models: a generator as an attribute, in a list attribute, one shared by two blocks.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_replay as lr

D, B = 64, 512
STATE = torch.Generator().get_state().numel()  # a CPU generator's state: 5,056 bytes


class Noisy(nn.Module):
    def __init__(self, gen: torch.Generator, in_list: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        if in_list:
            self.gens = [gen]
        else:
            self.gen = gen

    def forward(self, x):
        g = self.gens[0] if hasattr(self, "gens") else self.gen
        h = torch.tanh(self.lin(x))
        return x + h * (torch.rand(h.shape, generator=g) > 0.2)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "shared":
        g = torch.Generator().manual_seed(7)
        gens = [g, g, torch.Generator().manual_seed(8)]
    else:
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
    blocks = [Noisy(g, in_list=kind == "in_list") for g in gens]
    return nn.Sequential(*blocks, nn.Linear(D, 1))


def _states_held() -> int:
    """Live storages of a generator state's size (deduplicated; earlier arms' garbage
    collected first)."""
    gc.collect()
    seen = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.dtype == torch.uint8 and o.numel() == STATE:
            try:
                seen.add(o.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # another test's fake tensor: no bytes
                continue
    return len(seen)


def _run(kind: str, arm: str, steps: int = 10):
    before = _states_held()  # (whatever the process held already)
    model = _model(kind)
    engine = None
    if arm == "checkpoint":
        for m in list(model)[:3]:
            f = m.forward
            m.forward = lambda *a, _f=f: checkpoint(_f, *a, use_reentrant=False)
    elif arm == "replay":
        engine = lr.install(model, ["0", "1", "2"], budget="min")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = preserved = None
    for s in range(steps):
        loss = model(torch.randn(B, D, generator=torch.Generator().manual_seed(s))).square()
        if s >= steps - 4:  # the least of the last steps: a sampled check step keeps more
            n = _states_held() - before
            p = engine.preserved_bytes if engine is not None else 0
            held, preserved = min(n, held or n), min(p, preserved or p)
        loss.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = dict(engine.plan.choices) if engine is not None else None
    if engine is not None:
        engine.uninstall()
    return held, preserved, state, plan


@pytest.mark.parametrize("kind", ["attribute", "in_list", "shared"])
def test_a_held_generator_is_preserved_once_and_counted(kind):
    _, _, want, _ = _run(kind, "plain")
    ckpt_held = _run(kind, "checkpoint")[0]
    held, preserved, got, plan = _run(kind, "replay")
    assert all(o != "retain" for o in plan.values()), plan
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    assert not bad, bad
    assert held - ckpt_held == 3, (held, ckpt_held)  # one state per replayed call
    assert preserved >= 3 * STATE, preserved
