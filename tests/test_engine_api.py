"""The framework-free API: outputs, kwargs, autocast, violations, checks, records, uninstall."""

from __future__ import annotations

import copy
import functools
import json
import pickle
import sqlite3

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS, BNBlock, MLPBlock
from tests.helpers.compare import (
    assert_same_grads,
    assert_same_state,
    clone_model,
    snapshot_state,
    train_steps,
)
from tests.helpers.noisy_kernels import noisy_linear, ulp_step


class StructBlock(nn.Module):
    """Tuple/dict/non-tensor outputs and keyword arguments."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, scale=1.0, *, mask=None):
        self.seen.add_(1)
        h = torch.tanh(self.fc(x)) * scale
        if mask is not None:
            h = h * mask
        return {"h": h, "aux": (h.sum(), "tag", 3)}


class StructModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = StructBlock()
        self.b = MLPBlock()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        mask = (x > -1).float()  # does not require grad
        out = self.a(x, 0.5, mask=mask)
        assert out["aux"][1] == "tag" and out["aux"][2] == 3
        return self.head(self.b(out["h"])) + out["aux"][0]


def test_struct_outputs_kwargs_and_non_grad_inputs():
    make = lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
    ref = StructModel()
    model = copy.deepcopy(ref)
    g_ref, _ = train_steps(ref, make, 4)
    engine = lr.install(model, ["a", "b"])
    g_rep, _ = train_steps(model, make, 4)
    assert_same_grads(g_ref, g_rep)
    assert engine.summary()["a"]["replays"] == 3
    assert_same_state(snapshot_state(ref), snapshot_state(model))


def test_input_without_grad():
    h = HAZARDS["batch_norm"]()
    ref, model = clone_model(h.model), clone_model(h.model)
    lr.install(model, ["blocks.0"])
    for m in (ref, model):
        for p in m.blocks[0].parameters():
            p.requires_grad_(False)
    g_ref, _ = train_steps(ref, h.make_input, 4)
    g_rep, _ = train_steps(model, h.make_input, 4)
    assert_same_grads(g_ref, g_rep)
    assert_same_state(snapshot_state(ref), snapshot_state(model))


@pytest.mark.parametrize("hazard", ["combined", "queue", "batch_norm"])
def test_cpu_bf16_autocast(hazard):
    h = HAZARDS[hazard]()
    ref, model = clone_model(h.model), clone_model(h.model)
    engine = lr.install(model, h.segments)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g_ref, _ = train_steps(ref, h.make_input, 4)
        g_rep, _ = train_steps(model, h.make_input, 4)
    assert_same_grads(g_ref, g_rep)
    # (a flag the root flips after a segment is re-probed once: test_engine_hazards.FLAG_FLIPPED)
    assert all(s["replays"] == 4 - s["contract_version"] for s in engine.summary().values())
    assert_same_state(snapshot_state(ref), snapshot_state(model))


def test_no_grad_and_graphless_eval_run_plain_and_eval_with_trained_weights_is_probed():
    """No graph, nothing to replay: under no_grad, or in eval() with nothing requiring grad (a
    frozen teacher). A segment in eval() whose weights train (a frozen-BatchNorm backbone)
    builds a graph like one in training mode, and is probed (then replayed) like one."""
    h = HAZARDS["batch_norm"]()
    engine = lr.install(h.model, h.segments)
    with torch.no_grad():
        h.model(h.make_input(0))
    h.model.eval()
    h.model.requires_grad_(False)
    h.model(h.make_input(0))
    s = engine.summary()["blocks.0"]
    assert s["forwards"] == 0 and s["mode"] == "plain"  # two windows, no graph: named so
    h.model.requires_grad_(True)
    h.model(h.make_input(0)).sum().backward()
    assert engine.summary()["blocks.0"]["forwards"] == 1


def test_state_dict_keys_and_uninstall():
    h = HAZARDS["combined"]()
    keys = list(h.model.state_dict())
    classes = [type(m) for m in h.model.modules()]
    engine = lr.install(h.model, h.segments)
    assert list(h.model.state_dict()) == keys
    assert repr(h.model.blocks[0]).startswith("BNBlock(")
    train_steps(h.model, h.make_input, 2)
    with pytest.raises(lr.ReplayConfigError, match="already has lightning_replay installed"):
        lr.install(h.model, h.segments)
    engine.uninstall()
    assert [type(m) for m in h.model.modules()] == classes
    assert list(h.model.state_dict()) == keys
    lr.install(h.model, h.segments).uninstall()  # installing again after uninstall works


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _hooks(model: nn.Module) -> list[tuple[str, str, int]]:
    return [
        (name, d, len(getattr(m, d)))
        for name, m in model.named_modules()
        for d in _HOOK_DICTS
        if getattr(m, d, None)
    ]


def _pickle_round_trip(model: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(model))


@pytest.mark.parametrize("copier", [copy.deepcopy, _pickle_round_trip], ids=["deepcopy", "pickle"])
def test_copies_of_an_installed_model_are_plain_models(copier):
    """README: copies (copy.deepcopy, pickle) of an installed model are plain models. The copy
    trains exactly like the plain model, and training it leaves the original's engine alone."""
    h = HAZARDS["combined"]()
    plain = clone_model(h.model)  # the reference: never installed
    classes = [type(m) for m in plain.modules()]
    plain_hooks = _hooks(plain)
    engine = lr.install(h.model, h.segments, records=lr.RecordStore(None, run_id="orig"))
    train_steps(plain, h.make_input, 2)
    train_steps(h.model, h.make_input, 2)  # probe, then one replayed step

    copied = copier(h.model)
    assert [type(m) for m in copied.modules()] == classes
    assert _hooks(copied) == plain_hooks
    assert list(copied.state_dict()) == list(plain.state_dict())
    assert_same_state(snapshot_state(plain), snapshot_state(copied), "copy at copy time")

    step, summary, records = engine.step, engine.summary(), engine.records.read()
    g_plain, _ = train_steps(plain, lambda s: h.make_input(s + 2), 3)
    g_copy, _ = train_steps(copied, lambda s: h.make_input(s + 2), 3)
    assert_same_grads(g_plain, g_copy, "the copy trains as a plain model")
    assert_same_state(snapshot_state(plain), snapshot_state(copied), "copy after training")
    assert (engine.step, engine.summary(), engine.records.read()) == (step, summary, records)

    # the original still trains under its engine, exactly, from where it was
    ref = clone_model(h.model)  # a copy is plain: the reference for the original's next steps
    g_ref, _ = train_steps(ref, lambda s: h.make_input(s + 2), 2)
    g_orig, _ = train_steps(h.model, lambda s: h.make_input(s + 2), 2)
    assert_same_grads(g_ref, g_orig, "the original after the copy trained")
    assert engine.step == step + 2
    assert all(s["replays"] == summary[n]["replays"] + 2 for n, s in engine.summary().items())
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(h.model), "original")


class ExternalReader(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        object.__setattr__(self, "_table", table)  # state the model does not own

    def forward(self, x):
        return x + self.fc(x) @ self._table.clone()


def _external_model():
    table = torch.eye(16)
    m = nn.Sequential(ExternalReader(table), nn.Linear(16, 1))
    return m, table


def test_violation_raises_with_names():
    m, table = _external_model()
    lr.install(m, ["0"], on_violation="raise")
    x = torch.randn(4, 16)
    m(x).sum().backward()  # probe: table constant
    m(x).sum().backward()
    out = m(x)
    table.add_(1.0)  # changed between the forward and the replay
    with pytest.raises(lr.ContractViolation) as err:
        out.sum().backward()
    assert err.value.segment == "0" and err.value.state == "0._table"
    assert "version" in str(err.value) and "on_violation='record'" in str(err.value)


def test_violation_record_reprobes_and_extends_contract(tmp_path):
    db = tmp_path / "records.sqlite"
    m, table = _external_model()
    ref, ref_table = copy.deepcopy((m, table))
    engine = lr.install(m, ["0"], on_violation="record", records=str(db))
    # No optimizer step: step 2's recorded, unverified gradient must not carry into later steps.
    mismatched = []
    for step in range(7):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        grads = []
        for model, tab in ((ref, ref_table), (m, table)):
            model.zero_grad()
            out = model(x)
            if step >= 2:
                tab.add_(0.5)  # from step 2 on, the table changes inside every window
            if model is m and step == 2:
                with pytest.warns(RuntimeWarning, match="0._table"):
                    out.sum().backward()
            else:
                out.sum().backward()
            grads.append(model[0].fc.weight.grad.clone())
        if not torch.equal(*grads):
            mismatched.append(step)
    # step 2 replayed with the live table (recorded as a rejection); step 3 re-probes
    # (retained, exact), and from step 4 the table is preserved whole.
    assert mismatched == [2]
    c = engine.contracts["0"]
    assert c.version == 2 and c.changing[0].name == "0._table"
    rows = (
        sqlite3.connect(db)
        .execute(
            'SELECT step, segment, contract_version, "check", outcome FROM records ORDER BY seq'
        )
        .fetchall()
    )
    # engine steps count from 1: the loop's step 2 is the engine's step 3
    assert rows == [
        (1, "0", 1, "contract", "match"),
        (3, "0", 1, "version", "rejection"),
        (4, "0", 2, "contract", "match"),
    ]


def test_checks_match_on_exact_replay():
    h = HAZARDS["combined"]()
    engine = lr.install(h.model, h.segments)
    train_steps(h.model, h.make_input, 2)
    engine.request_check(grad=True, bytes=True)
    train_steps(h.model, h.make_input, 1)
    recs = engine.records.read()
    checks = [r for r in recs if r.check in ("grad", "bytes")]
    assert checks and all(r.outcome == "match" for r in checks), [
        r.detail for r in checks if r.outcome != "match"
    ]
    assert {r.check for r in checks} == {"grad", "bytes"}


def test_checks_catch_state_the_contract_cannot_restore():
    m, table = _external_model()
    engine = lr.install(m, ["0"])
    x = torch.randn(4, 16)
    for _ in range(2):
        m(x).sum().backward()
    w_before = m[0].fc.weight.detach().clone()
    engine.request_check()
    out = m(x)
    table.data.add_(1.0)  # no version bump: only the checks can see it
    m[0].fc.weight.grad = None
    out.sum().backward()
    outcomes = {(r.check, r.outcome) for r in engine.records.read()}
    assert ("bytes", "divergence") in outcomes and ("grad", "divergence") in outcomes
    # training used the reference gradient: it equals a plain model's on the same state
    plain = nn.Sequential(ExternalReader(table - 1.0), nn.Linear(16, 1))
    plain.load_state_dict(m.state_dict())
    assert torch.equal(w_before, plain[0].fc.weight)
    plain(x).sum().backward()
    assert torch.equal(m[0].fc.weight.grad, plain[0].fc.weight.grad)
    assert engine.summary()["0"]["divergences"] >= 2


def test_records_sqlite_schema_and_append(tmp_path):
    path = tmp_path / "r.sqlite"
    s1 = lr.RecordStore(path, run_id="a")
    s1.append(
        step=1, segment="s", contract_version=1, check="contract", outcome="match", detail="x"
    )
    s1.close()
    s2 = lr.RecordStore(path, run_id="b")
    s2.append(
        step=2, segment="s", contract_version=1, check="grad", outcome="divergence", detail={"k": 1}
    )
    assert [r.run_id for r in s2.read()] == ["a", "b"]
    cols = [c[1] for c in sqlite3.connect(path).execute("PRAGMA table_info(records)")]
    assert cols[1:] == [
        "run_id",
        "step",
        "rank",
        "segment",
        "contract_version",
        "check",
        "outcome",
        "detail",
        "created_at",
    ]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_records_bad_path_is_a_clear_error(tmp_path):
    bad = tmp_path / "not-a-db.sqlite"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(lr.RecordsError, match="cannot be used as a records database"):
        lr.RecordStore(bad)


def test_contract_schema_mismatch():
    c = lr.ReplayContract(segment="s")
    d = c.to_dict()
    d["schema"] = 99
    with pytest.raises(lr.ContractSchemaError, match="schema 99"):
        lr.ReplayContract.from_dict(d)


@pytest.mark.parametrize(
    "segments,match",
    [
        (["nope"], "not a submodule"),
        ([], "empty"),
        (["blocks.0", "blocks.0.fc"], "nested"),
        ([""], "root module"),
        (["head.weight"], "not a module"),
        ("blocks.9*", "matches no submodule"),
    ],
)
def test_bad_segments(segments, match):
    h = HAZARDS["batch_norm"]()
    with pytest.raises(lr.SegmentError, match=match):
        lr.install(h.model, segments)


def test_bad_preservation_and_on_violation():
    h = HAZARDS["batch_norm"]()
    with pytest.raises(lr.ReplayConfigError, match="preservation='fast'"):
        lr.install(h.model, h.segments, preservation="fast")
    with pytest.raises(lr.ReplayConfigError, match="on_violation='ignore'"):
        lr.install(h.model, h.segments, on_violation="ignore")
    with pytest.raises(lr.ReplayConfigError, match="blocks.7"):
        lr.install(h.model, h.segments, preservation={"blocks.7": "whole"})


def test_segments_by_class_and_glob():
    from lightning_replay.demos.hazards import BNBlock

    h = HAZARDS["batch_norm"]()
    e = lr.install(h.model, BNBlock)
    assert e.segments == ["blocks.0", "blocks.1"]
    e.uninstall()
    e = lr.install(h.model, "blocks.*")
    assert e.segments == ["blocks.0", "blocks.1"]


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([BNBlock(), MLPBlock()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Nested(nn.Module):
    """encoder.stages.{0,1}.blocks.{0: BNBlock, 1: MLPBlock} -> head."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.stages = nn.ModuleList([_Stage(), _Stage()])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for s in self.encoder.stages:
            x = s(x)
        return self.head(x)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (
            "encoder.**.blocks.*",
            [
                "encoder.stages.0.blocks.0",
                "encoder.stages.0.blocks.1",
                "encoder.stages.1.blocks.0",
                "encoder.stages.1.blocks.1",
            ],
        ),
        ("**.bn", ["encoder.stages.0.blocks.0.bn", "encoder.stages.1.blocks.0.bn"]),
        ("encoder.*.1", ["encoder.stages.1"]),
        (lambda name, m: isinstance(m, MLPBlock) and ".1." in name, ["encoder.stages.1.blocks.1"]),
        (
            [lambda name, m: name.endswith("blocks.1"), "encoder.stages.0.blocks.0"],
            ["encoder.stages.0.blocks.0", "encoder.stages.0.blocks.1", "encoder.stages.1.blocks.1"],
        ),
    ],
    ids=["double-star", "leading-double-star", "single-star", "callable", "callable+name"],
)
def test_glob_and_callable_segment_specs_select_and_replay_exactly(spec, expected):
    """README: dotted globs (``**`` spans levels) and callables ``(name, module) -> bool``."""
    torch.manual_seed(0)
    plain = _Nested()
    model = copy.deepcopy(plain)
    engine = lr.install(model, spec)
    assert engine.segments == expected
    make = lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s))  # noqa
    g_ref, _ = train_steps(plain, make, 3)
    g_rep, _ = train_steps(model, make, 3)
    assert_same_grads(g_ref, g_rep)
    assert all(s["replays"] == 2 for s in engine.summary().values())
    engine.uninstall()
    assert_same_state(snapshot_state(plain), snapshot_state(model))


def _count_call(calls: list, *_) -> None:
    calls[0] += 1


def _count_forwards(module: nn.Module) -> list[int]:
    # passed in, not a closure cell: the replay puts back a closure's list it changed (a
    # replay's side effects never leak), so a closure would count as plain PyTorch does
    calls = [0]
    module.register_forward_hook(functools.partial(_count_call, calls))
    return calls


def test_preservation_retain_keeps_activations_and_never_replays():
    h = HAZARDS["combined"]()
    ref, model = clone_model(h.model), clone_model(h.model)
    calls = _count_forwards(model.blocks[0].fc)  # runs first: an early-stopped replay runs it
    engine = lr.install(model, h.segments, preservation="retain")
    g_ref, _ = train_steps(ref, h.make_input, 4)
    g_rep, _ = train_steps(model, h.make_input, 4)
    assert_same_grads(g_ref, g_rep)
    assert calls == [4]  # one forward per step: nothing recomputed
    assert {(s["mode"], s["replays"], s["preserved_bytes"]) for s in engine.summary().values()} == {
        ("retain", 0, 0)
    }
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(model))


def test_preservation_per_segment_dict():
    """A dict picks the option per segment; segments it leaves out get "auto"."""
    from lightning_replay.demos.hazards import QueueModel

    torch.manual_seed(0)
    plain = QueueModel(rows=1024, dim=16, write_rows=16)
    model = copy.deepcopy(plain)
    queue_bytes = plain.queue.numel() * plain.queue.element_size()
    engine = lr.install(model, "blocks.*", preservation={"blocks.0": "whole", "blocks.1": "retain"})
    make = lambda s: torch.randn(16, 16, generator=torch.Generator().manual_seed(s))  # noqa
    g_ref, _ = train_steps(plain, make, 3)
    g_rep, _ = train_steps(model, make, 3)
    assert_same_grads(g_ref, g_rep)
    s = engine.summary()
    assert (s["blocks.0"]["mode"], s["blocks.0"]["replays"]) == ("whole", 2)
    assert s["blocks.0"]["preserved_bytes"] == queue_bytes  # the whole queue, once
    assert (s["blocks.1"]["mode"], s["blocks.1"]["replays"]) == ("retain", 0)
    engine.uninstall()
    assert_same_state(snapshot_state(plain), snapshot_state(model))

    model = copy.deepcopy(plain)
    engine = lr.install(model, "blocks.*", preservation={"blocks.1": "whole"})
    train_steps(model, make, 3)
    # "auto": the cheapest correct option by memory, here the region undo log
    assert engine.summary()["blocks.0"]["mode"] == "regions"
    assert engine.summary()["blocks.1"]["mode"] == "whole"


def test_suspended_runs_segments_as_plain_modules():
    """README: ``engine.suspended()``: no probe, no replay inside; the engine resumes after."""
    h = HAZARDS["combined"]()
    ref, model = clone_model(h.model), clone_model(h.model)
    calls = _count_forwards(model.blocks[0].fc)  # runs first: an early-stopped replay runs it
    engine = lr.install(model, h.segments)
    g_ref, _ = train_steps(ref, h.make_input, 5)
    g_rep, _ = train_steps(model, h.make_input, 2)  # probe, one replay
    assert calls == [3]
    before = engine.summary()
    with engine.suspended():
        g_rep += train_steps(model, lambda s: h.make_input(s + 2), 2, rng_seed=102)[0]
    assert calls == [5]  # one forward per suspended step
    assert engine.summary() == before
    g_rep += train_steps(model, lambda s: h.make_input(s + 4), 1, rng_seed=104)[0]
    assert calls == [7]  # replayed again: forward + replay
    assert_same_grads(g_ref, g_rep)
    assert all(s["replays"] == before[n]["replays"] + 1 for n, s in engine.summary().items())
    engine.uninstall()
    assert_same_state(snapshot_state(ref), snapshot_state(model))


def test_checked_steps_do_not_leak_models():
    import gc
    import weakref
    from lightning_replay.demos.hazards import QueueModel

    refs = []
    for _ in range(2):
        m = QueueModel()
        e = lr.install(m, "blocks.*")
        for s in range(3):
            if s == 2:
                e.request_check()
            m(torch.randn(8, 16)).pow(2).mean().backward()
        assert e.records.counts()["match"] > 0
        e.uninstall()
        refs.append(weakref.ref(m))
        del m, e
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_records_opened_by_several_ranks_at_once(tmp_path):
    import threading

    path = tmp_path / "new.sqlite"
    errors, stores = [], []

    def open_one(rank):
        try:
            stores.append(lr.RecordStore(path, run_id="r", rank=rank))
        except Exception as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 6
    for s in stores:
        s.append(
            step=1, segment="s", contract_version=1, check="contract", outcome="match", detail=""
        )
    assert sorted(r.rank for r in stores[0].read()) == list(range(6))


def test_records_open_waits_for_a_database_another_process_holds_locked(tmp_path):
    import threading
    import time

    path = tmp_path / "locked.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")  # another rank, mid-write
    hold = 0.3
    releaser = threading.Timer(hold, lambda: holder.execute("COMMIT"))
    start = time.monotonic()
    releaser.start()
    try:
        store = lr.RecordStore(path, run_id="late")
    finally:
        releaser.join()
        holder.close()
    assert time.monotonic() - start >= hold  # it waited for the lock instead of failing
    store.append(
        step=1, segment="s", contract_version=1, check="contract", outcome="match", detail=""
    )
    assert [r.run_id for r in store.read()] == ["late"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _busy_wal_switch(monkeypatch, failures: int, message: str = "database is locked"):
    """Make the first ``failures`` switches to WAL fail as when another connection holds the
    new file: sqlite's busy timeout does not always cover that switch (whether it does
    depends on timing), so the store retries it itself."""
    import lightning_replay.records as records_mod

    left = [failures]
    sleeps: list[float] = []

    class Busy(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql.startswith("PRAGMA journal_mode=WAL") and left[0]:
                left[0] -= 1
                raise sqlite3.OperationalError(message)
            return super().execute(sql, *args)

    real_connect = sqlite3.connect
    monkeypatch.setattr(
        records_mod.sqlite3, "connect", lambda *a, **k: real_connect(*a, factory=Busy, **k)
    )
    monkeypatch.setattr(records_mod.time, "sleep", sleeps.append)
    return sleeps


def test_records_open_retries_a_locked_switch_to_wal(tmp_path, monkeypatch):
    sleeps = _busy_wal_switch(monkeypatch, failures=5)
    store = lr.RecordStore(tmp_path / "r.sqlite", run_id="a")
    assert len(sleeps) == 5  # one pause per failed attempt, then it opened
    store.append(
        step=1, segment="s", contract_version=1, check="contract", outcome="match", detail=""
    )
    assert len(store.read()) == 1
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize(
    "failures,message,attempts",
    [
        (10**6, "database is locked", 99),  # locked for good: gives up after its retries
        (1, "disk I/O error", 0),  # not a lock: no retry
    ],
)
def test_records_open_gives_up_with_a_clear_error(
    tmp_path, monkeypatch, failures, message, attempts
):
    sleeps = _busy_wal_switch(monkeypatch, failures, message)
    with pytest.raises(lr.RecordsError, match="cannot be used as a records database") as err:
        lr.RecordStore(tmp_path / "r.sqlite")
    assert message in str(err.value) and "records=None" in str(err.value)
    assert len(sleeps) == attempts


class _Odd(nn.Module):
    """Keyword inputs, an input that needs no grad, a nested output with a repeated tensor, an
    integer output and an input passed straight through."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, *, scale, mask):
        h = torch.tanh(self.fc(x)) * scale
        return {"h": h, "pair": (h, x), "idx": (h > 0).sum(1), "masked": h * mask}


class _OddNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.odd = _Odd()

    def forward(self, x):
        z = self.pre(x)
        scale = torch.ones(8, requires_grad=False) * 0.5
        out = self.odd(z, scale=scale, mask=(z > 0).float())
        return (
            out["h"] + out["pair"][0] * out["pair"][1] + out["masked"] + out["idx"][:, None].float()
        )


def test_checked_calls_keep_structure_and_gradients_of_odd_segments():
    torch.manual_seed(0)
    plain = _OddNet()
    model = copy.deepcopy(plain)
    engine = lr.install(model, ["odd"])
    x = torch.randn(4, 8)
    for step in range(3):
        if step == 2:
            engine.request_check()
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
        for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
            assert torch.equal(a.grad, b.grad), (step, n)
    outcomes = {(r.check, r.outcome) for r in engine.records.read()}
    assert ("grad", "match") in outcomes and ("bytes", "match") in outcomes
    assert not any(o == "divergence" for _, o in outcomes)


def test_checked_step_backward_twice_matches_plain():
    """A checked step differentiated twice (retain_graph=True): checked at the first
    backward, the second runs on the segment's own graph, as plain PyTorch's does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    plain = copy.deepcopy(model)
    engine = lr.install(model, ["0"])
    x = torch.randn(3, 4)
    for m in (plain, model):
        m(x).sum().backward()
    engine.request_check()
    for m in (plain, model):
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    assert [r.outcome for r in engine.records.read(check="grad")] == ["match"]


_NoisyBackwardLinear = noisy_linear(
    "_NoisyBackwardLinear",
    "``x @ w.T`` whose weight gradient moves by one ulp at random (``os.urandom``): a backward "
    "that, like atomics on a GPU, is not bitwise reproducible.",
    weight=ulp_step,
)


class _NoisyExternalReader(ExternalReader):
    def __init__(self, table):
        super().__init__(table)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return x + _NoisyBackwardLinear.apply(self.fc(x), self.w) @ self._table.clone()


@pytest.mark.parametrize(
    ("noisy", "change", "outcome"),
    [
        (False, 1e-7, "divergence"),  # exact reference: a last-bits change is a divergence
        (True, 0.0, "match"),  # noisy reference, nothing missed: within its own spread
        (True, 1e-2, "divergence"),  # noisy reference, missed state: far beyond the spread
    ],
)
def test_grad_check_tolerance_only_where_the_reference_itself_is_noisy(noisy, change, outcome):
    """The derivative check measures the reference's own run-to-run spread (it differentiates
    it again): bit for bit where the reference is reproducible; within the measured spread,
    recorded with the check, where its backward is not (the reproductions of GPU numerics are
    in tests/test_gpu_numerics.py). State the contract cannot see (a ``.data`` write) is a
    divergence either way."""
    table = torch.eye(16)
    reader = _NoisyExternalReader(table) if noisy else ExternalReader(table)
    m = nn.Sequential(reader, nn.Linear(16, 1))
    engine = lr.install(m, ["0"])
    x = torch.randn(4, 16)
    for _ in range(2):
        m(x).sum().backward()
    engine.request_check(bytes=False)
    out = m(x)
    table.data.mul_(1 + change)  # a change the contract cannot see (no version bump)
    out.sum().backward()
    grad = [r for r in engine.records.read() if r.check == "grad"]
    assert [r.outcome for r in grad] == [outcome]
    detail = json.loads(grad[0].detail)
    assert "within_tolerance" not in detail
    if noisy:
        assert detail["noise"]["spread"] > 0 and detail["noise"]["reference_passes"] >= 2
        matched = detail["noise"]["summary"].startswith("matched within")
        assert matched == (outcome == "match") and (detail["differ"] == []) == matched
    else:
        assert detail["differ"] and "noise" not in detail
