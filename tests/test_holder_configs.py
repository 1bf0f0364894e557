"""Config objects that every layer holds (transformers' ``PretrainedConfig``, a dataclass of
hyperparameters): a replay sees their attributes as the forward did.

The engine captures a holder's attributes at each forward and shares the capture between calls
while every attribute holds the same object and every container attribute the same contents
(a GPT-2 layer reads a config of about 40 attributes: copying and comparing it per call was
most of the engine's per-call cost there). These tests change the config between a forward and
its replay in each way that sharing could miss, on steps where the capture is shared and on
steps where it is not, and compare gradients and state with plain PyTorch bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.test_exactness import D, SEGS2, Stack, assert_exact

STEPS = 6


class Config:
    """A plain config namespace, about the size of a real one."""

    def __init__(self) -> None:
        self.scale = 0.5
        self.weights = [1.0, 0.5]  # a list of plain values, mutated in place
        self.table = {"bias": 0.1}  # a dict of plain values, mutated in place
        self.calls: list[int] = []  # appended to by every forward (and so by every replay)
        for i in range(32):  # the rest of a real config: values nobody changes
            setattr(self, f"unused_{i}", i)


class ConfigBlock(nn.Module):
    def __init__(self, config: Config, index: int, append: bool) -> None:
        super().__init__()
        self.config = config
        self.index = index
        self.append = append
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self.append:  # (then no two calls see the same config: nothing is shared)
            c.calls.append(self.index)
        w = c.weights[self.index] * c.scale + c.table["bias"] + 0.01 * len(c.calls)
        # (inside tanh, whose saved output the replay recomputes: a replay that saw other
        # values would give other gradients)
        return x + torch.tanh(self.fc(x) * w)


class ConfigStack(Stack):
    """Two blocks share one config; after them, on some steps, the step changes it."""

    def __init__(self, change: str, append: bool = False) -> None:
        config = Config()
        super().__init__([ConfigBlock(config, i, append) for i in range(2)])
        self.config = config
        self.change = change
        self.steps = 0

    def after(self, h: torch.Tensor) -> None:
        c = self.config
        self.steps += 1
        if self.steps % 3:  # two steps in three change nothing: the capture is shared there
            return
        if self.change == "list_in_place":
            c.weights[0] += 1.0
        elif self.change == "dict_in_place":
            c.table["bias"] += 0.25
        elif self.change == "rebound_scalar":
            c.scale = c.scale * 1.5
        elif self.change == "rebound_container":
            c.weights = [w * 2 for w in c.weights]
        elif self.change == "cleared_calls":
            c.calls.clear()


def _factory(change: str):
    return lambda: ConfigStack(change, append=change == "cleared_calls")


def test_config_changed_in_place_or_rebound_between_forward_and_replay_is_exact():
    for change in (
        "list_in_place",
        "dict_in_place",
        "rebound_scalar",
        "rebound_container",
        "cleared_calls",
    ):
        summary, _ = assert_exact(_factory(change), SEGS2, "whole", steps=STEPS, min_replays=6)
        assert all(s["replays"] >= 3 for s in summary.values()), (change, summary)


def test_replays_never_leak_into_the_config_or_the_shared_capture():
    """Each block's forward appends to ``config.calls``; a replay that appended too (to the
    live list, or to the copy a later call's capture shares) would change the values later
    forwards compute. The live list must hold exactly the forwards' appends."""
    import copy

    import lightning_replay as lr
    from lightning_replay.verify import train_steps

    torch.manual_seed(0)
    base = ConfigStack("list_in_place", append=True)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    x = lambda s: torch.randn(4, D, generator=torch.Generator().manual_seed(s))  # noqa: E731
    g_ref, _ = train_steps(ref, x, STEPS)
    engine = lr.install(model, SEGS2, preservation="whole")
    g, _ = train_steps(model, x, STEPS)
    replays = sum(s["replays"] for s in engine.summary().values())
    engine.uninstall()
    assert replays >= 6
    assert model.config.calls == ref.config.calls == [0, 1] * STEPS
    assert model.config.weights == ref.config.weights
    for a, b in zip(g_ref, g):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
