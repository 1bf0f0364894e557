"""Reliability of the core: killed processes, long runs, random models (hypothesis)."""

from __future__ import annotations

import copy
import gc
import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
import torch.nn.functional as F
from torch import nn

import lightning_replay as lr
from lightning_replay.demos import hazards as hz
from tests.helpers.compare import assert_same_grads, diff_state, snapshot_state, train_steps
from tests.helpers.torch_memory import (
    outlived,
    process_tensor_bytes,
    process_tensor_storages,
    snapshot_pool_storages,
    state_storages,
    tensors_outside,
)

_CHILD = textwrap.dedent("""
    import sys, torch, lightning_replay as lr
    from lightning_replay.demos.hazards import HAZARDS
    h = HAZARDS["combined"]()
    engine = lr.install(h.model, h.segments, records=sys.argv[1])
    for step in range(10_000):
        engine.request_check()           # every step writes grad and bytes records
        torch.manual_seed(step)
        h.model(h.make_input(step)).pow(2).mean().backward()
        print(f"done {engine.step}", flush=True)
""")


def _wait_for_step(proc: subprocess.Popen, step: int, timeout: float) -> int:
    """Read the child's "done N" lines until N >= step or ``timeout`` seconds pass. Reads the
    raw pipe through select, so a child that stops printing cannot block past the deadline
    (a plain readline() would)."""
    deadline = time.monotonic() + timeout
    fd, buf, done = proc.stdout.fileno(), b"", 0
    while done < step:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:  # the child exited
            break
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"done"):
                done = int(line.split()[1])
    return done


def test_sigkill_leaves_consistent_records_and_resume_appends(tmp_path):
    db = tmp_path / "records.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(db)], stdout=subprocess.PIPE)
    try:
        done = _wait_for_step(proc, 6, timeout=120)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert done >= 6
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = conn.execute('SELECT seq, step, segment, "check" FROM records ORDER BY seq').fetchall()
    # every completed step checked all six segments: grad + bytes (outputs) + bytes (state),
    # but at step 2 blocks.4, re-probed at its flag's second value (FLAG_FLIPPED)
    for step in range(2, done + 1):
        per = [r for r in rows if r[1] == step and r[3] in ("grad", "bytes")]
        assert len(per) == 6 * 3 - 3 * (step == 2), (step, len(per))
    seqs = [r[0] for r in rows]
    assert seqs == list(range(1, len(seqs) + 1))
    # a resumed run appends after the last row: no duplicates, no gaps
    store = lr.RecordStore(db, run_id="resumed")
    store.append(
        step=done + 1,
        segment="s",
        contract_version=1,
        check="contract",
        outcome="match",
        detail="resumed",
    )
    seqs2 = [r.seq for r in store.read()]
    assert seqs2 == list(range(1, len(seqs) + 2))


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def test_long_run_memory_stays_flat():
    """1,000 steps of every hazard at once. From step 5 on, the engine holds nothing between
    steps and every step's accounted peak is the same; over the run, the interpreter's live
    allocations (``sys.getallocatedblocks``, after a full collection, past the caches' warm-up)
    grow by less than one block per 2 steps: a leak of anything per step would show. The
    process's own referees, not the engine's counters: its live tensor bytes (a walk of the
    garbage collector's objects) are the same from step 5 on, and every tensor alive after
    step 5 that is not the model's or the optimizer's state is dead two steps later, with the
    cyclic collector off."""
    steps, warmup, every = 1000, 400, 100
    h = hz.HAZARDS["combined"]()
    before = set(process_tensor_storages())  # (module-level constants and the like)
    engine = lr.install(h.model, h.segments, track_memory=True)
    opt = torch.optim.SGD(h.model.parameters(), lr=1e-3)
    held, live, peaks, blocks = set(), set(), set(), []
    process, left = {}, []  # the process's referees: live tensor bytes, weak references
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        h.model(h.make_input(step % 7)).pow(2).mean().backward()
        opt.step()
        if step >= 5:
            held.add(engine.preserved_bytes)
            live.add((len(engine.log.logs), len(engine.accountant._live)))
            peaks.add(engine.step_stats()["peak_bytes"])
        if step == 5:  # every tensor alive now that is not state: each must die within 2 steps
            gc.collect()
            gc.disable()
            process[step] = process_tensor_bytes()
            # the snapshot pools' spare buffers (restore.SnapshotPool: small whole snapshots
            # reuse them from step to step) are preserved state's bytes, not leftovers
            pools = snapshot_pool_storages(engine)
            left = tensors_outside(state_storages(h.model, [opt]) | before | pools)
        if step == 7:
            gc.enable()
            kept = outlived(left, h.model, [opt])
            assert not kept, [(tuple(t.shape), t.dtype) for t in kept]
        if step + 1 >= warmup and (step + 1 - warmup) % every == 0:
            gc.collect()
            blocks.append((step, sys.getallocatedblocks()))
            process[step] = process_tensor_bytes()
    assert len(set(process.values())) == 1, process  # the process's tensors: flat from step 5
    assert held == {0}  # every snapshot and region log released after its replay
    assert live == {(0, 0)}
    assert len(peaks) == 1  # the accounted peak of every step is the same
    # one contract each, and the re-probe of a flag the root flips after a segment
    # (test_engine_hazards.FLAG_FLIPPED): its guard record and the contract's next version
    probes = sum(s["contract_version"] for s in engine.summary().values())
    assert len(engine.records) == probes + (probes - len(h.segments))
    assert all(s["replays"] == steps - s["contract_version"] for s in engine.summary().values())
    assert _slope(blocks) < 0.5, blocks


# ------------------------------------------------------------------ random models
class _SharedQueue(nn.Module):
    def __init__(self, rows, dim):
        super().__init__()
        self.register_buffer("queue", torch.randn(rows, dim))


class _DirectReader(nn.Module):
    """Reads the shared queue itself (no copy): autograd saves it for backward."""

    def __init__(self, owner, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        object.__setattr__(self, "_owner", owner)

    def forward(self, x):
        q = self._owner.store.queue
        return x + torch.softmax(self.fc(x) @ q.t(), dim=1) @ q


class _LateWriter(nn.Module):
    """Behaviour that starts after the probe step: from its third call on, a write-then-read
    buffer update."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.zeros(dim))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 2:
            self.shift.add_(0.1 * x.detach().mean(0))
        return x + torch.tanh(self.fc(x) - self.shift)


class _InplaceInput(nn.Module):
    """An in-place op on the segment's own input, first thing in the forward."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        x = F.leaky_relu_(x, 0.1)
        return x + torch.tanh(self.fc(x))


class _TupleState(nn.Module):
    """Tuple state set in ``__init__`` and rebound (detached) by every forward."""

    def __init__(self, dim, batch):
        super().__init__()
        self.cell = nn.GRUCell(dim, dim)
        self.state = (torch.zeros(batch, dim), torch.ones(dim))

    def forward(self, x):
        h = self.cell(x, self.state[0]) * self.state[1]
        self.state = (h.detach(), self.state[1] * 0.9)
        return x + h


class _HFAttention(nn.Module):
    """A pre-norm residual around a Hugging Face attention layer with attention and output
    dropout on the global RNG, built from a tiny config (nothing downloaded). The batch's rows
    are the tokens of one sequence: ``(batch, dim) -> (1, batch, dim)``.

    ``"gpt2"``: ``GPT2Attention``, eager softmax + ``nn.functional.dropout``, bidirectional.
    ``"llama"``: ``LlamaAttention`` with rotary embeddings (a non-persistent ``inv_freq``
    buffer), grouped-query heads and causal SDPA with ``dropout_p``.
    """

    def __init__(self, arch, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        if arch == "gpt2":
            from transformers import GPT2Config
            from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

            config = GPT2Config(
                n_embd=dim, n_head=2, n_positions=8, attn_pdrop=0.3, resid_pdrop=0.2
            )
            config._attn_implementation = "eager"
            self.attn, self.rope = GPT2Attention(config, layer_idx=0), None
        else:
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import (
                LlamaAttention,
                LlamaRotaryEmbedding,
            )

            config = LlamaConfig(
                hidden_size=dim,
                intermediate_size=2 * dim,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=8,
                attention_dropout=0.3,
            )
            config._attn_implementation = "sdpa"
            self.attn = LlamaAttention(config, layer_idx=0)
            self.rope = LlamaRotaryEmbedding(config)

    def forward(self, x):
        h = self.norm(x).unsqueeze(0)
        if self.rope is None:
            out = self.attn(h)[0]
        else:
            positions = torch.arange(h.shape[1]).unsqueeze(0)
            out = self.attn(h, position_embeddings=self.rope(h, positions), attention_mask=None)[0]
        return x + out.squeeze(0)


class _TimmDropPath(nn.Module):
    """timm's stochastic-depth residual: ``x + DropPath(Mlp(LayerNorm(x)))``, the MLP with
    dropout; both draw from the global RNG."""

    def __init__(self, dim):
        super().__init__()
        from timm.layers import DropPath, Mlp

        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden_features=2 * dim, drop=0.1)
        self.drop_path = DropPath(0.4)

    def forward(self, x):
        return x + self.drop_path(self.mlp(self.norm(x)))


class RandomStack(nn.Module):
    KINDS = (
        "mlp",
        "bn",
        "counter",
        "noise",
        "flag",
        "queue",
        "direct",
        "late",
        "inplace",
        "tuple",
        "gpt2_attn",
        "llama_attn",
        "drop_path",
    )

    def __init__(self, kinds, dim, rows, write, batch=4):
        super().__init__()
        self.store = _SharedQueue(rows, dim)
        blocks = []
        for i, k in enumerate(kinds):
            if k == "mlp":
                blocks.append(hz.MLPBlock(dim))
            elif k == "bn":
                blocks.append(hz.BNBlock(dim))
            elif k == "counter":
                blocks.append(hz.CounterBlock(dim))
            elif k == "noise":
                blocks.append(hz.NoiseBlock(dim, seed=i))
            elif k == "flag":
                blocks.append(hz.FlagBlock(dim))
            elif k == "direct":
                blocks.append(_DirectReader(self, dim))
            elif k == "late":
                blocks.append(_LateWriter(dim))
            elif k == "inplace":
                blocks.append(_InplaceInput(dim))
            elif k == "tuple":
                blocks.append(_TupleState(dim, batch))
            elif k in ("gpt2_attn", "llama_attn"):
                blocks.append(_HFAttention(k.split("_")[0], dim))
            elif k == "drop_path":
                blocks.append(_TimmDropPath(dim))
            else:
                blocks.append(hz.QueueReader(self, "store.queue", dim))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 1)
        self.write = write

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if self.write == "rows":
            idx = (x.detach()[:, 0].abs() * 100).long() % self.store.queue.shape[0]
            self.store.queue.index_copy_(0, idx, x.detach())
        elif self.write == "slice":
            self.store.queue[:2] = x.detach()[:2]
        elif self.write == "all":
            self.store.queue.mul_(0.5)
        elif self.write == "rebind":  # a new tensor, not an in-place write
            self.store.queue = torch.cat([x.detach()[:1], self.store.queue[:-1]])
        return self.head(x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(RandomStack.KINDS), min_size=1, max_size=4),
    dim=st.sampled_from([4, 8, 12]),
    batch=st.integers(2, 6),
    rows=st.integers(3, 16),
    write=st.sampled_from(["rows", "slice", "all", "rebind", "none"]),
    preservation=st.sampled_from(["auto", "whole", "regions"]),
    checked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_hazard_stacks_replay_exactly(
    kinds, dim, batch, rows, write, preservation, checked, seed
):
    """Exact gradients and state, with or without derivative checks on every step; or, for a
    model plain PyTorch rejects (a block saves the queue and the step writes it), an error.
    Blocks include behaviour that starts after the probe step, in-place ops on the segment's
    input and tuple state, and real-model blocks that draw from the global RNG (HF GPT-2 and
    Llama attention with attention dropout, timm DropPath); the step's queue write may rebind
    the buffer instead."""
    torch.manual_seed(seed)
    base = RandomStack(kinds, dim, rows, write, batch)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    make = lambda s: torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed + s))
    engine = lr.install(
        model, [f"blocks.{i}" for i in range(len(kinds))], preservation=preservation
    )

    def make_checked(s):
        if checked:
            engine.request_check()
        return make(s)

    try:
        g_ref, _ = train_steps(ref, make, 3)
    except RuntimeError as exc:
        assert "inplace operation" in str(exc) and "direct" in kinds and write != "none"
        with pytest.raises(lr.SavedTensorModified, match="store.queue"):
            train_steps(model, make_checked, 3)
        return
    g_rep, _ = train_steps(model, make_checked, 3)
    assert_same_grads(g_ref, g_rep)
    outcomes = {r.outcome for r in engine.records.read() if r.check in ("grad", "bytes")}
    assert outcomes == ({"match"} if checked else set())
    engine.uninstall()
    assert diff_state(snapshot_state(ref), snapshot_state(model)) == []
