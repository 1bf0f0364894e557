"""Probes in two threads at once (CI, stop 42): a probe patches what every thread shares
(``torch.Tensor.tolist``/``numpy``, Python's generator, the classes of every installed model's
modules, the traced-number log). Two probes whose windows overlapped restored each other's
patches out of order and left them in place for the rest of the process: ``tolist`` watched
(uncounted by a later sync counter), arithmetic on a number read in a probe traced forever.

The forwards meet inside their probes: thread 0's waits (up to a timeout) for thread 1's
to begin, thread 1's waits for thread 0's to return, so without one probe at a time the
windows overlap and end out of order every run."""

from __future__ import annotations

import random
import threading
import time

import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.core.mechanisms import outside_reads

_MEET: dict = {}  # thread index -> (entered, returned) events, and the calls seen


class Block(nn.Module):
    def __init__(self, dim: int, index: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.index = index
        self.temp = 0.5

    def forward(self, x):
        _rendezvous(self.index)
        h = self.bn(self.fc(x))
        scale = self.bn.running_mean.tolist()[0]  # a host read: watched in the probe
        if self.temp * 2 < 1.5:  # a traced number's comparison
            h = h * (1 + 0 * scale)
        return x + torch.tanh(h)


def _rendezvous(index: int) -> None:
    first = _MEET.setdefault(("calls", index), [0])
    first[0] += 1
    if first[0] != 1:
        return
    entered, returned = _MEET[index]
    entered.set()
    if index == 0:
        _MEET[1][0].wait(timeout=1.0)  # thread 1's probe begins inside this one's
    else:
        _MEET[0][1].wait(timeout=5.0)  # ... and ends after this one's
        time.sleep(0.05)


class Net(nn.Module):
    def __init__(self, index: int, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, index)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_overlapping_probes_leave_nothing_patched():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "numpy", "__array__")}
    getstate = random.getstate
    _MEET.clear()
    for i in range(2):
        _MEET[i] = (threading.Event(), threading.Event())
        # (made here, not by the first forward: a probe reads this module's globals, and a
        # dict another thread grows while a walk iterates it raised "dictionary changed size
        # during iteration" once in CI, at 528f3f0)
        _MEET[("calls", i)] = [0]
    torch.manual_seed(0)
    models = [Net(i) for i in range(2)]
    classes = [[type(m) for m in net.modules()] for net in models]
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    errors: list = []
    grads: dict = {}

    def work(i: int) -> None:
        try:
            model = models[i]
            engine = lr.install(model, "blocks.*")
            out = []
            for s, x in enumerate(xs):
                model.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
                if s == 0:
                    _MEET[i][1].set()
                out.append([p.grad.clone() for p in model.parameters()])
            engine.uninstall()
            grads[i] = out
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    after = {n: torch.Tensor.__dict__.get(n) for n in before}
    assert after == before, "a probe's tolist/numpy watcher outlived it"
    assert random.getstate is getstate
    assert outside_reads._COMPARISONS is None, "the traced-number log outlived the probes"
    assert outside_reads._LAZY is None
    assert [[type(m) for m in net.modules()] for net in models] == classes
    # ... and both trained exactly as plain PyTorch
    _MEET.update({("calls", i): [1] for i in range(2)})  # (no more meetings)
    torch.manual_seed(0)
    refs = [Net(i) for i in range(2)]
    for i, ref in enumerate(refs):
        for s, x in enumerate(xs):
            ref.zero_grad(set_to_none=True)
            ref(x).pow(2).mean().backward()
            for p, g in zip(ref.parameters(), grads[i][s]):
                assert torch.equal(p.grad, g), (i, s)
