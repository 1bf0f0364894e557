"""A zoo of small models whose state breaks naive recomputation, one hazard each.

Used by the demo, the tests and the benchmarks. Each factory returns a :class:`Hazard`: the model,
the segment names to replay, and an input maker. ``HAZARDS`` maps names to factories.

Example:
    >>> h = HAZARDS["batch_norm"]()
    >>> h.model(h.make_input(0)).shape
    torch.Size([8, 1])
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

D = 16
B = 8


@dataclasses.dataclass
class Hazard:
    name: str
    description: str
    model: nn.Module
    segments: list[str]
    make_input: Callable[[int], torch.Tensor]
    uses_global_rng: bool = False


def _inputs(seed_base: int = 0, batch: int = B, dim: int = D) -> Callable[[int], torch.Tensor]:
    def make(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed_base + step)
        return torch.randn(batch, dim, generator=g)

    return make


class MLPBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * 2)
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _Stack(nn.Module):
    """blocks -> head; optional ``after`` hook runs inside forward after the blocks."""

    def __init__(self, blocks: list[nn.Module], dim: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 1)

    def after_blocks(self, h: torch.Tensor) -> None:
        pass

    def forward(self, x):
        h = x
        for b in self.blocks:
            h = b(h)
        self.after_blocks(h)
        return self.head(h)


# ------------------------------------------------------------------ buffers written inside
class BNBlock(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x):
        return x + F.relu(self.bn(self.fc(x)))


class CounterBlock(nn.Module):
    """Write-then-read: a step counter buffer incremented and then used."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return x + self.fc(x) * (1.0 + 0.1 * self.count)


# ------------------------------------------------------------------ state changed after
def _getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class QueueReader(nn.Module):
    """Reads the owner's queue (MoCo style: ``queue.clone().detach()``) inside the segment."""

    def __init__(self, owner: nn.Module, attr: str, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        # A plain back-reference (not a submodule): deepcopy maps it to the copied owner.
        object.__setattr__(self, "_owner", owner)
        self._attr = attr

    def forward(self, x):
        q = _getattr_path(self._owner, self._attr).clone().detach()
        logits = self.fc(x) @ q.t() / 4.0
        return x + torch.softmax(logits, dim=1) @ q


class QueueModel(_Stack):
    """A dense queue read by the blocks and enqueued after them, every step."""

    def __init__(self, rows: int = 64, dim: int = D, write_rows: int = B) -> None:
        super().__init__([QueueReader(self, "queue", dim) for _ in range(2)], dim)
        self.register_buffer("queue", F.normalize(torch.randn(rows, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.write_rows = write_rows

    def after_blocks(self, h):
        k = F.normalize(h.detach()[: self.write_rows], dim=1)
        p = int(self.ptr)
        self.queue[p : p + k.shape[0]] = k
        self.ptr.fill_((p + k.shape[0]) % self.queue.shape[0])


class BankModel(_Stack):
    """A memory bank read densely inside, rows written after by data-dependent index ops."""

    def __init__(self, rows: int = 32, dim: int = D, op: str = "index_copy") -> None:
        super().__init__([QueueReader(self, "bank", dim) for _ in range(2)], dim)
        self.register_buffer("bank", torch.randn(rows, dim))
        self.op = op

    def after_blocks(self, h):
        f = h.detach()
        idx = (f[:, 0].abs() * 1000).long() % self.bank.shape[0]
        if self.op == "index_copy":
            self.bank.index_copy_(0, idx, f)
        elif self.op == "index_put":
            self.bank[idx] = f * 0.5
        elif self.op == "scatter":
            self.bank.scatter_(0, idx[:, None].expand(-1, f.shape[1]), f)
        else:  # whole-tensor in-place update (EMA)
            self.bank.mul_(0.9).add_(f.mean(0, keepdim=True), alpha=0.1)


class AttrModel(_Stack):
    """A plain tensor attribute (not a buffer), shared between two modules."""

    def __init__(self, dim: int = D) -> None:
        super().__init__([QueueReader(self, "writer.memory", dim), MLPBlock(dim)], dim)
        self.writer = nn.Module()
        self.writer.memory = torch.randn(12, dim)  # plain attribute, not registered
        self.blocks[1].shared = self.writer.memory  # the same tensor, held by a second module

    def after_blocks(self, h):
        self.writer.memory.mul_(0.5).add_(h.detach().mean(0))


class _TwoInputBlock(MLPBlock):
    def forward(self, x, mem=None):
        return super().forward(x) + (0 if mem is None else torch.sigmoid(mem))


class AliasModel(nn.Module):
    """A segment input that is a view of state overwritten later in the window."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.register_buffer("memory", torch.randn(B, dim))
        self.proj = nn.Linear(dim, dim)
        self.block = _TwoInputBlock(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.block(self.proj(x), self.memory[: x.shape[0]])
        self.memory.copy_(h.detach())
        return self.head(h)


# ------------------------------------------------------------------ randomness
class NoiseBlock(nn.Module):
    """Dropout (global RNG) and noise from a private torch.Generator."""

    def __init__(self, dim: int = D, seed: int = 1234) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.3)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        noise = torch.randn(x.shape, generator=self.gen) * 0.1
        return x + self.drop(torch.tanh(self.fc(x + noise)))


# ------------------------------------------------------------------ python attributes
class FlagBlock(nn.Module):
    """A Python counter changed inside, and a flag flipped by the root after the segment."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.calls = 0
        self.use_gate = True

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        if self.calls % 2 == 0:
            h = h * 0.5
        if self.use_gate:
            h = torch.sigmoid(h) * h
        return x + h


class FlagModel(_Stack):
    def __init__(self, dim: int = D) -> None:
        super().__init__([FlagBlock(dim), FlagBlock(dim)], dim)

    def after_blocks(self, h):
        for b in self.blocks:
            b.use_gate = not b.use_gate


# ------------------------------------------------------------------ everything at once
class CombinedModel(_Stack):
    def __init__(self, dim: int = D) -> None:
        super().__init__(
            [
                BNBlock(dim),
                CounterBlock(dim),
                QueueReader(self, "queue", dim),
                NoiseBlock(dim),
                FlagBlock(dim),
                MLPBlock(dim),
            ],
            dim,
        )
        self.register_buffer("queue", torch.randn(16, dim))

    def after_blocks(self, h):
        self.queue[:4] = h.detach()[:4]
        self.blocks[4].use_gate = not self.blocks[4].use_gate


def _blocks(n: int) -> list[str]:
    return [f"blocks.{i}" for i in range(n)]


def _make(name, desc, model, segments, rng=False, seed=0) -> Hazard:
    return Hazard(name, desc, model, segments, _inputs(seed), rng)


HAZARDS: dict[str, Callable[[], Hazard]] = {
    "stateless": lambda: _make(
        "stateless",
        "stateless MLP blocks",
        _Stack([MLPBlock(), MLPBlock(), MLPBlock()]),
        _blocks(3),
    ),
    "batch_norm": lambda: _make(
        "batch_norm",
        "batch norm running stats (CPU: no version bump)",
        _Stack([BNBlock(), BNBlock()]),
        _blocks(2),
    ),
    "counter": lambda: _make(
        "counter",
        "write-then-read step counter buffer",
        _Stack([CounterBlock(), CounterBlock()]),
        _blocks(2),
    ),
    "queue": lambda: _make(
        "queue", "dense queue read inside, enqueued after (MoCo)", QueueModel(), _blocks(2)
    ),
    "bank_index_copy": lambda: _make(
        "bank_index_copy",
        "memory bank, index_copy_ rows after",
        BankModel(op="index_copy"),
        _blocks(2),
    ),
    "bank_index_put": lambda: _make(
        "bank_index_put",
        "memory bank, index_put_ rows after",
        BankModel(op="index_put"),
        _blocks(2),
    ),
    "bank_scatter": lambda: _make(
        "bank_scatter", "memory bank, scatter_ rows after", BankModel(op="scatter"), _blocks(2)
    ),
    "inplace_whole": lambda: _make(
        "inplace_whole", "whole-tensor in-place EMA update after", BankModel(op="ema"), _blocks(2)
    ),
    "tensor_attr": lambda: _make(
        "tensor_attr", "plain tensor attribute shared by two modules", AttrModel(), _blocks(2)
    ),
    "alias_input": lambda: _make(
        "alias_input", "segment input is a view of state written after", AliasModel(), ["block"]
    ),
    "rng": lambda: _make(
        "rng",
        "dropout (global RNG) and a private torch.Generator",
        _Stack([NoiseBlock(seed=1), NoiseBlock(seed=2)]),
        _blocks(2),
        rng=True,
    ),
    "python_attrs": lambda: _make(
        "python_attrs", "Python counter and control-flow flag", FlagModel(), _blocks(2)
    ),
    "combined": lambda: _make(
        "combined", "all of the above in one model", CombinedModel(), _blocks(6), rng=True
    ),
}
