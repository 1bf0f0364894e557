"""Trainer(strategy="replay_fsdp"): replay under FSDP2, against plain ModelParallelStrategy.

Two ranks on CPU with gloo, spawned: forked ranks abort now and then in autograd's thread
start ("Invalid thread pool", an OpenMP pool inherited through fork), with or without replay. The references are Lightning's own
ModelParallelStrategy with the same sharding and the same launcher.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.torch_memory import process_tensor_bytes

from lightning_replay import ReplayCallback, ReplayConfigError, ReplayFSDPStrategy
from lightning_replay.demos.sharded import ResidualBNBlock, ShardedDemoData, ShardedDemoNet
from lightning_replay.core.engine.rank_phases import phase_args
from lightning_replay.planner import min_feasible_budget, plan, predicted_peak
from lightning_replay.strategies.replay_fsdp import (
    STRATEGY_NAMES,
    _full_state_dict,
    _ShardedMultiProcessingLauncher,
    register,
)

DIM = 16
# A block's activations (about 14 KiB at this batch) well above the 5,056 bytes of CPU RNG
# state a replayed call holds (torch.utils.checkpoint's preserve_rng_state), so that replaying
# a block frees memory and a budget below retaining everything has a plan.
BATCH = 32
ROWS = 32


class StatefulBlock(nn.Module):
    """Batch norm (running stats written in the segment), dropout (global RNG), and a read of
    the owner's queue, which the owner overwrites after the blocks in the same step."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.2)
        object.__setattr__(self, "_owner", owner)  # a back-reference, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._owner.queue.clone().detach()  # MoCo: the replay would clone the new queue
        h = self.drop(F.relu(self.bn(self.fc(x))))
        return x + h + torch.softmax(h @ q.t(), dim=1) @ q


class FSDPNet(L.LightningModule):
    """Blocks sharded one unit each, then the root, in ``configure_model``."""

    def __init__(self, reshard_after_forward: bool = True, shard: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([StatefulBlock(self) for _ in range(3)])
        self.head = nn.Linear(DIM, 1)
        self.register_buffer("queue", F.normalize(torch.randn(ROWS, DIM), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.reshard_after_forward = reshard_after_forward
        self.shard = shard
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self, mesh=mesh, reshard_after_forward=self.reshard_after_forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h)
        # MoCo-style: enqueue after the blocks, in place, in the same step
        k = F.normalize(h.detach()[: BATCH // 2], dim=1)
        p = int(self.ptr)
        self.queue[p : p + k.shape[0]] = k
        self.ptr.fill_((p + k.shape[0]) % ROWS)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Dropout draws per step and rank: a resumed run draws what an uninterrupted one does
        # (Lightning's distributed checkpoint keeps no per-rank RNG state).
        torch.manual_seed(1000 * self.global_step + self.global_rank)
        (x,) = batch
        loss = (self(x) ** 2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(n_batches: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randn(n_batches * BATCH, DIM, generator=g)),
        batch_size=BATCH,
        shuffle=False,
    )


class ForkedModelParallel(ModelParallelStrategy):
    """The reference: Lightning's ModelParallelStrategy, forked like the replay runs, one
    CPU thread per rank (bit-exact comparisons need equal thread counts)."""

    def _configure_launcher(self) -> None:
        self._launcher = _ShardedMultiProcessingLauncher(self, start_method="spawn")

    def setup_environment(self) -> None:
        torch.set_num_threads(1)
        super().setup_environment()

    def teardown(self) -> None:
        super().teardown()
        if torch.distributed.is_initialized():
            self._full_state_dict = _full_state_dict(self.lightning_module)
            torch.distributed.destroy_process_group()


class SaveRank(L.Callback):
    """Each rank's full weights (gathered), its buffers, losses and engine state at the end."""

    def __init__(self, out_dir: Any) -> None:
        self.out_dir = str(out_dir)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in pl_module.state_dict().items()
        }
        engine = getattr(trainer.strategy, "engine", None)
        out = {
            "state": state,
            "losses": list(pl_module.losses),
            "keys": list(pl_module.state_dict()),
        }
        if engine is not None:
            out.update(
                summary=engine.summary(),
                plan_version=engine.plan_version,
                plan=engine.plan.to_dict() if engine.plan is not None else None,
                budget=engine.budget,
                peaks=list(self.peaks),
                metrics={
                    k: float(v)
                    for k, v in trainer.callback_metrics.items()
                    if k.startswith("replay/")
                },
            )
        torch.save(out, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))

    def on_train_start(self, *args: Any) -> None:
        self.peaks: list = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            stats = engine.window_stats()
            retain_all = None
            if engine.plan is not None and engine.costs:
                retain_all = predicted_peak(
                    engine.costs, {c.name: "retain" for c in engine.costs}, engine.base_memory
                )
            self.peaks.append(
                {
                    "step": stats["step"],
                    "peak": stats["peak_bytes"],
                    "choices": dict(engine.plan.choices) if engine.plan else None,
                    "predicted": engine.plan.peak_memory if engine.plan else None,
                    "retain_all": retain_all,
                }
            )


class RequestChecks(L.Callback):
    """Derivative and byte checks on every n-th window once a plan is in force (the engine's
    own API, as ReplayCallback uses it)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        if engine.plan is not None and (engine.step + 1) % self.every == 0:
            engine.request_check(grad=True, bytes=True)


def fit(
    root: Any,
    strategy: Any,
    model: FSDPNet,
    steps: int,
    callbacks=(),
    ckpt_path=None,
    data: Any = None,
    **kwargs: Any,
) -> list[dict]:
    """Fit on two spawned ranks; returns what each rank saved at the end (see SaveRank)."""
    os.makedirs(root, exist_ok=True)
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
        callbacks=[SaveRank(root), *callbacks],
        **kwargs,
    )
    if data is None:
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    else:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]


def replay_fsdp(**kwargs: Any) -> ReplayFSDPStrategy:
    return ReplayFSDPStrategy(
        start_method="spawn", data_parallel_size=2, tensor_parallel_size=1, **kwargs
    )


def reference() -> ForkedModelParallel:
    return ForkedModelParallel(data_parallel_size=2, tensor_parallel_size=1)


def differing(a: dict, b: dict) -> list[str]:
    return sorted(
        k
        for k in a.keys() | b.keys()
        if k not in a
        or k not in b
        or a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(a[k], b[k])
    )


# ---------------------------------------------------------------------- registration
def test_import_registers_replay_fsdp_once():
    assert STRATEGY_NAMES == {"replay_fsdp": "popen"}
    assert StrategyRegistry["replay_fsdp"]["strategy"] is ReplayFSDPStrategy
    trainer = L.Trainer(strategy="replay_fsdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ReplayFSDPStrategy)
    assert isinstance(trainer.strategy, ModelParallelStrategy)
    register()  # a second import (or reload) is a no-op
    from lightning.fabric.strategies.registry import _StrategyRegistry

    foreign = _StrategyRegistry()
    foreign.register("replay_fsdp", ModelParallelStrategy)
    with pytest.raises(ReplayConfigError, match="'replay_fsdp' is already registered by"):
        register(foreign)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"planner": "greedy"}, r"ReplayFSDPStrategy\(planner='greedy'\) is not known"),
        ({"budget": "lots"}, r"ReplayFSDPStrategy\(budget='lots'\)"),
        ({"start_method": "thread"}, r"ReplayFSDPStrategy\(start_method='thread'\) is not known"),
        ({"calibration_steps": 0}, r"calibration_steps=0\) must be an int >= 1"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ReplayConfigError, match=match):
        ReplayFSDPStrategy(**kwargs)


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_matches_plain_model_parallel_bit_for_bit(tmp_path, reshard_after_forward):
    """Weights, batch-norm stats and the queue on each rank after 8 steps equal plain
    ModelParallelStrategy's with the same sharding, every block having replayed, and the
    callback's grad and bytes checks recorded as matches on both ranks."""
    L.seed_everything(7)
    want = fit(
        tmp_path / "plain",
        reference(),
        FSDPNet(reshard_after_forward=reshard_after_forward),
        steps=10,
    )
    L.seed_everything(7)
    records = tmp_path / "records.sqlite"
    got = fit(
        tmp_path / "replay",
        replay_fsdp(records=records, calibration_steps=1),
        FSDPNet(reshard_after_forward=reshard_after_forward),
        steps=10,
        callbacks=[RequestChecks(every=3)],
    )
    for r in (0, 1):
        assert differing(want[r]["state"], got[r]["state"]) == [], f"rank {r}"
        assert want[r]["losses"] == got[r]["losses"], f"rank {r}"
        assert want[r]["keys"] == got[r]["keys"]  # state-dict keys unchanged
        summary = got[r]["summary"]
        assert set(summary) == {"blocks.0", "blocks.1", "blocks.2"}
        assert all(s["replays"] >= 3 for s in summary.values()), summary
        # FSDP's gathered parameters are no contract state: BN stats (written) and the queue
        assert all(
            not any(n.endswith(("weight", "bias")) for n in s["changing_state"])
            for s in summary.values()
        ), summary
    # rank 0's plan on every rank (each rank predicts its own peak from its own base)
    assert got[0]["plan"] is not None
    assert got[0]["plan"]["choices"] == got[1]["plan"]["choices"]
    assert got[0]["plan_version"] == got[1]["plan_version"]
    with sqlite3.connect(records) as db:
        rows = db.execute('SELECT rank, "check", outcome FROM records').fetchall()
    assert {(r, c) for r, c, o in rows if o == "match"} >= {
        (0, "grad"),
        (1, "grad"),
        (0, "bytes"),
        (1, "bytes"),
    }
    assert [row for row in rows if row[2] != "match"] == []


# ---------------------------------------------------------------------- resume
def test_resume_from_a_distributed_checkpoint_carries_on_bit_identically(tmp_path):
    """Lightning's distributed checkpoint (a folder of shards) at step 6, resumed to step 10:
    equal, on every rank, to plain ModelParallelStrategy resumed from its own checkpoint.

    Not to an uninterrupted run, with either strategy: buffers are not sharded, and the
    distributed checkpoint keeps one copy of each (rank 0's), so rank 1's queue restarts
    from rank 0's."""
    runs = {}
    for name, make in (("plain", reference), ("replay", replay_fsdp)):
        ckpt = ModelCheckpoint(
            dirpath=tmp_path / name / "ckpt", every_n_train_steps=6, save_top_k=-1
        )
        fit(
            tmp_path / name / "first",
            make(),
            FSDPNet(),
            steps=6,
            callbacks=[ckpt],
            enable_checkpointing=True,
        )
        path = tmp_path / name / "ckpt" / "epoch=0-step=6.ckpt"
        assert path.is_dir() and len(list(path.glob("*.distcp"))) == 2  # one shard per rank
        runs[name] = fit(
            tmp_path / name / "resumed", make(), FSDPNet(), steps=10, ckpt_path=str(path)
        )
    for r in (0, 1):
        assert differing(runs["plain"][r]["state"], runs["replay"][r]["state"]) == [], r
        assert runs["plain"][r]["losses"] == runs["replay"][r]["losses"], r
        assert all(s["replays"] >= 1 for s in runs["replay"][r]["summary"].values())


# ---------------------------------------------------------------------- budget
class HeldAtBackward(L.Callback):
    """The referee, independent of the engine's accountant and costs: per rank and step, what
    the whole process really holds (tests/helpers/torch_memory.py), beside the engine's
    accounted and predicted peaks and the plan's costs.

    The base is taken from the process, never rebuilt from parameters and optimizer state: the
    bytes of every live tensor storage (a garbage-collector walk; a DTensor counts as its local
    shard) when the step's first module runs, after the engine's window opened, so that the
    batch and whatever anyone keeps between steps (the engine included) count. On top of it,
    the profiler's CPU allocation events: ``held``, their net sum until backward begins
    (everything the step holds for backward), and ``real``, the highest running sum over the
    whole step (forward, the replays in backward, FSDP's gathers and reduce-scatters, the
    optimizer step). Only one profiler runs at a time: on a step the engine measures itself
    (its profiler is running when the step's first module is called) the referee stays off
    and reads the engine's figure, of the same definition (``source`` ``"engine"``, ``held``
    None). The module pre-hook it needs stays registered for the whole run: a hook added and
    removed around every step would change the segments' preconditions."""

    MARK = "test::backward_begins"

    def __init__(self, out_dir: Any) -> None:
        self.out_dir = str(out_dir)
        self.rows: list[dict] = []
        self._state: dict | None = None
        self._handle: Any = None

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        st = self._state
        if st is None or st["prof"] is not None or st["engine"]:
            return
        if st["e"].step == st["step"]:
            return  # the engine's window has not opened yet
        if bool(torch.autograd.profiler._is_profiler_enabled):
            st["engine"] = True  # the engine measures this step
            return
        st["base"] = process_tensor_bytes()
        st["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        st["prof"].__enter__()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        self._state = {"prof": None, "engine": False, "e": engine, "step": engine.step}

    def on_before_backward(self, *args: Any) -> None:
        with torch.profiler.record_function(self.MARK):
            pass

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        st, self._state = self._state, None
        engine = trainer.strategy.engine
        if st["engine"]:
            held, real, source = None, engine._truth_peak, "engine"
            assert real is not None, "another profiler ran through the step: nothing measured"
        else:
            assert st["prof"] is not None, "no module ran in the step: nothing was measured"
            st["prof"].__exit__(None, None, None)
            events = list(st["prof"].profiler.kineto_results.events())
            mark = min(e.start_ns() for e in events if e.name() == self.MARK)
            allocs = sorted(
                (e.start_ns(), e.nbytes())
                for e in events
                if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
            )
            running = peak = 0
            for _, nbytes in allocs:
                running += nbytes
                peak = max(peak, running)
            held = st["base"] + sum(n for t, n in allocs if t < mark)
            real, source = st["base"] + peak, "referee"
        stats = engine.window_stats()
        self.rows.append(
            {
                "step": stats["step"],
                "held": held,
                "real": int(real),
                "source": source,
                "accounted": stats["accounted_peak_bytes"],
                "predicted": stats["predicted_peak_bytes"],
                "choices": dict(engine.plan.choices) if engine.plan else None,
            }
        )

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
        engine = trainer.strategy.engine
        costs = engine.costs
        base = engine.real_base_memory
        torch.save(
            {
                "rows": self.rows,
                "costs": costs,
                "base": base,
                "gathered_bytes": trainer.strategy.gathered_bytes,
                # with every phase the engine measured (each segment's forward under its
                # option, the replays, the forward's end), as the engine's own plans are made
                "min_budget": min_feasible_budget(costs, base, **engine.phase_peak_args),
                "retain_all": predicted_peak(
                    costs, {c.name: "retain" for c in costs}, base, **engine.phase_peak_args
                ),
            },
            os.path.join(self.out_dir, f"held{trainer.global_rank}.pt"),
        )


def fit_refereed(root: Any, **kwargs: Any) -> list[dict]:
    fit(
        root,
        replay_fsdp(calibration_steps=1, **kwargs),
        FSDPNet(),
        # the engine measures the plan's first step and then now and then itself (on a rank
        # steps 6, 7, 9 and 11 once): 14 steps leave the referee at least 3 planned steps
        steps=14,
        callbacks=[HeldAtBackward(root)],
    )
    return [torch.load(os.path.join(root, f"held{r}.pt"), weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def budget_runs(tmp_path_factory) -> dict:
    """Every block retained, then a per-rank budget between the lowest-memory plan and that."""
    root = tmp_path_factory.mktemp("budget")
    retained = fit_refereed(root / "retain_all", planner="retain_all")
    # three quarters of the way up: the lowest plan's figures measured in the retained run
    # (its calibration) can read a few hundred bytes under what that plan holds once it runs
    budget = max((rank["min_budget"] + 3 * rank["retain_all"]) // 4 for rank in retained)
    return {
        "retained": retained,
        "budget": budget,
        "planned": fit_refereed(root / "budget", budget=budget),
    }


def _planned(rank: dict) -> list[dict]:
    return [row for row in rank["rows"] if row["choices"] is not None]


def test_a_budget_holds_on_every_rank(budget_runs):
    """Once the plan is in force, on each rank and planned step, the whole process's real peak
    (its live tensor storages when the step began + the profiler's net peak over the step: the
    referee of HeldAtBackward, or the engine's own measurement on the steps it measures) is
    within the plan's predicted peak, and that within the budget. FSDP's gathered parameters,
    which a replayed block's recomputation saves for its backward, are real bytes of that
    peak: the plan must charge them (in the base, ``gathered_bytes``) for the prediction to
    hold. The accounted peak
    (gathered parameters counted once, in the base) is within the prediction too; every rank
    runs the same plan, and it replays a block."""
    budget, got = budget_runs["budget"], budget_runs["planned"]
    assert all(rank["min_budget"] < budget < rank["retain_all"] for rank in budget_runs["retained"])
    # at least 3 planned steps seen by the referee itself, not only by the engine (after main's
    # merge at 00:40 one rank's engine measured every planned step itself, once)
    refereed = [row for rank in got for row in _planned(rank) if row["source"] == "referee"]
    assert len(refereed) >= 3, [rank["rows"] for rank in got]
    for r in (0, 1):
        planned = _planned(got[r])
        assert len(planned) >= 3, got[r]["rows"]
        # Rank 0 makes the plan every rank runs; it plans with the largest of each measured
        # phase figure over the ranks (the strategy agrees them at the plan), so each rank's
        # own prediction for that plan is within the budget, exactly. (With rank 0's own
        # figures alone, another rank's prediction for the same plan exceeded the budget by a
        # few bytes: 92,736 against 92,717 once.)
        over = [
            (i, row["step"], row["source"], row["real"], row["predicted"])
            for i, row in enumerate(planned)
            if not (row["real"] <= row["predicted"] <= budget)
        ]
        # (a plan's first step, which the engine measures itself, is held to it too: it ran
        # 240-392 B over when a replay phase's residual was paired with the preserved bytes
        # its call had already given back; see the note below this test)
        print(
            f"rank {r}: planned steps {[(row['choices'], row['real'], row['predicted']) for row in planned]}"
        )
        assert not over, (r, budget, over, got[r]["rows"])
        for row in planned:
            assert row["accounted"] <= row["predicted"], (r, row, budget)
        # the base holds the gathered parameters: the root (kept from forward to backward)
        # and the two largest blocks (one running, one prefetched), each (16 x 16 + 3 x 16)
        # float32 unsharded; the root's 1 x 16 head weight padded to 2 rows, and its bias
        assert got[r]["gathered_bytes"] == 2 * (16 * 16 + 3 * 16) * 4 + (2 * 16 + 2) * 4
    choices = [_planned(rank)[-1]["choices"] for rank in got]
    assert choices[0] == choices[1]
    assert any(o != "retain" for o in choices[0].values()), choices


# Measured after merging main at 00:40 (issue 31's per-phase residuals), in 3 runs of 4: the
# plan's first step (retain, regions, retain) held 91,456 B on rank 0 against the prediction
# 91,216 and the budget 91,244 (+240 B); the engine measured it and re-planned. The cause (found
# on one process, tests/test_budget_probe_steps.py's big_buffer_last, 256 KiB low): a replay
# phase's residual was paired with the formula's figure, which holds the segment's preserved
# bytes, but the call gives them back as its replay ends, before the backward's temporaries
# peak; the residual came out that much short, and a plan that retains the block (nothing
# preserved, the same temporaries) was predicted that much low. The engine now pairs it
# without them (engine._phase_residuals; restore.py no longer holds the entries through the
# backward either). 3 runs of 3 within since (i31-steps).


def test_the_plan_frees_real_memory_on_every_rank(budget_runs):
    """The referee, outside the accountant: the bytes really live when backward begins (the
    process's live storages when the step began + the profiler's allocation events until
    backward, per rank, on the steps the referee measures) fall from the all-retained run by
    at least what the plan's costs say it frees (the least of the planned steps: now and then FSDP's next unit
    is already gathered there). A replayed block's costs charge the generator state checkpoint
    keeps for it, and its activation bytes leave out FSDP's gathered parameters, which are
    refilled, perhaps at another address, before the probe's replay measures them."""
    judged = 0
    for r in (0, 1):
        planned = _planned(budget_runs["planned"][r])
        retained = _planned(budget_runs["retained"][r])
        if not all(any(row["held"] is not None for row in rows) for rows in (planned, retained)):
            continue  # the engine measured every planned step of a run on this rank itself
        judged += 1
        choices = planned[-1]["choices"]
        freed = sum(
            c.options["retain"].memory - c.options[choices[c.name]].memory
            for c in budget_runs["planned"][r]["costs"]
        )
        all_retained = min(row["held"] for row in retained if row["held"] is not None)
        held = min(row["held"] for row in planned if row["held"] is not None)
        assert all_retained - held >= freed > 0, (r, all_retained, held, freed)
    assert judged, "the referee measured no planned step on either rank"


def referee_slack(blocks: int = 3, dim: int = 32) -> int:
    """How far a profiled real peak may read over the plan's prediction on these 2-rank gloo
    runs: every block's unsharded gradient bytes and 2 KiB.

    - On one step in about three runs, at any step, the profiler referee saw one or two blocks'
      unsharded gradient bytes more than on the others (4,480 B a block at dim 32: 4,480-4,676
      B on CI for stop 39, 9,176 B at load 3), the size of the gradients FSDP2 reduce-scatters
      a block at a time (gloo runs collectives on threads of its own: what one holds goes at a
      moment that varies with the load). Flaky at cff06aa too, 2 runs of 4. As every block's
      could be in flight at once, the slack counts every block.
    - A few hundred bytes to 2 KiB otherwise: 2,140 B once on CI at 921ef1d (rank 1, step 14).

    The prediction and the real peak are still held to the budget exactly."""
    unit = sum(p.numel() * p.element_size() for p in ResidualBNBlock(dim).parameters())
    return blocks * unit + 2048


# ---------------------------------------------------------------------- real peak per rank
#: Bytes rank 1 alone holds through each of its steps (see UnevenRanks).
EXTRA = 24 * 1024
_HELD: dict[str, torch.Tensor] = {}


class UnevenRanks(ShardedDemoNet):
    """The demo model (batch-norm blocks with dropout, one FSDP unit each), where rank 1 keeps
    an extra tensor alive through each of its steps (a per-rank cache, say): bytes that no
    accountant counts, which only rank 1's measured real peak shows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            _HELD["cache"] = torch.ones(EXTRA // 4)
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        _HELD.clear()


class RealStepPeak(L.Callback):
    """The referee, independent of the engine: per rank and planned step, the step's real peak
    (the whole process's live tensor storages at its start plus the highest running sum of the
    profiler's CPU allocation events from batch start to batch end, as
    tests/helpers/torch_memory.py measures), beside
    the plan's prediction. The engine measures the first steps of each plan with the profiler
    itself; the referee, a profiler too, stays off until this rank has measured one, and on the
    steps the engine measures, where it reads the engine's figure, of the same definition (the
    live storages when the step began + the step's net peak; ``source`` ``"engine"``), as
    HeldAtBackward does: each rank has refereed steps, however many the engine measured."""

    def __init__(self, out_dir: Any) -> None:
        self.out_dir = str(out_dir)
        self.rows: list[dict] = []
        self.prof: Any = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        from torch.profiler import ProfilerActivity, profile

        engine = trainer.strategy.engine
        if engine.plan is None or engine.last_real_peak is None or engine._truth_pending:
            return  # (on a step the engine measures, its figure is read at the batch's end)
        # the whole process's live storages (a DTensor counts as its local shard): the batch,
        # the data set and whatever anyone holds count, as in the engine's own figure
        self.live_at_start = process_tensor_bytes()
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        if self.prof is None:
            if engine.plan is not None and engine._truth_peak is not None:
                self.rows.append(self._row(engine, engine._truth_peak, "engine"))
            return
        self.prof.__exit__(None, None, None)
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in self.prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        self.prof = None
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
        self.rows.append(self._row(engine, self.live_at_start + peak, "referee"))

    @staticmethod
    def _row(engine: Any, real: int, source: str) -> dict:
        return {
            "step": engine.step,
            "real": int(real),
            "source": source,
            "predicted": engine.plan.peak_memory,
            "choices": dict(engine.plan.choices),
        }

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        torch.save(
            {
                "rows": self.rows,
                "costs": engine.costs,
                "own_base": engine.base_memory + engine.unaccounted_bytes,
                "real_base": engine.real_base_memory,
                "unaccounted": engine.unaccounted_bytes,
                "plan": engine.plan.to_dict(),
                "plan_version": engine.plan_version,
            },
            os.path.join(self.out_dir, f"real{trainer.global_rank}.pt"),
        )


class BudgetRankZeroWouldRetainAll(L.Callback):
    """At training step ``at`` (each rank has measured its real peak, under the lowest-memory
    plan), every rank sets the budget, through the strategy's own ``replan``, where rank 0 would
    retain every block if it planned for its own real base: a plan rank 1's larger base cannot
    hold. Called on all ranks at the same point, as ``replan`` asks."""

    def __init__(self, at: int, out_dir: Any) -> None:
        self.at = at
        self.out_dir = str(out_dir)
        self.figures: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at:
            return
        strategy, engine = trainer.strategy, trainer.strategy.engine
        # (plus what every plan keeps free for the reduce-scatter's timing: the same on each)
        own = torch.tensor(
            [engine.base_memory + engine.unaccounted_bytes + engine.config.reserve_memory]
        )
        bases = [int(b) for b in strategy.all_gather(own).flatten()]
        costs = engine.costs
        retain = {c.name: "retain" for c in costs}
        budget = strategy.broadcast(predicted_peak(costs, retain, bases[0]))
        self.figures = {
            "bases": bases,
            "budget": budget,
            "rank0_alone": plan(costs, budget, bases[0]).choices,
            "retain": retain,
            "rank1_retain_all": predicted_peak(costs, retain, bases[1]),
            "rank1_min": min_feasible_budget(costs, bases[1]),
        }
        strategy.replan(budget=budget)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        path = os.path.join(self.out_dir, f"budget{trainer.global_rank}.pt")
        torch.save(self.figures, path)


def test_every_rank_holds_the_budget_when_the_ranks_bases_differ(tmp_path):
    """Each rank measures its own real peak, and rank 0's plan is made for the largest real base
    of any rank. Rank 1 holds 24 KiB more than rank 0 through every step, which no accountant
    sees. At step 9 the budget is set where rank 0, planning for its own base, would retain
    every block: a plan rank 1's real step exceeds (by about 24 KiB). Refereed by the profiler
    on each rank: on every step under that budget the real peak is within the plan's
    prediction, and that within the budget, on both ranks. On the steps the engine measures
    itself (the referee's profiler cannot run beside its own) the referee reads the engine's
    figure, of the same definition."""
    # 7 steps after the budget: the engine measures the new plan's first step itself, and its
    # periodic measurement may fall in the same stretch (steps 10 and 13 in one run); in a full
    # suite once, on rank 1, every one of them (0 of 4 profiled by the referee itself)
    at, steps = 9, 16
    budget = BudgetRankZeroWouldRetainAll(at, tmp_path)
    L.seed_everything(0)
    fit(
        tmp_path,
        replay_fsdp(calibration_steps=1),  # budget None (the lowest-memory plan) until step 9
        UnevenRanks(blocks=3, dim=32, dropout=0.1),
        steps=steps,
        callbacks=[budget, RealStepPeak(tmp_path)],
        data=ShardedDemoData(dim=32, batch_size=64, n_batches=steps),
    )
    got = [torch.load(tmp_path / f"real{r}.pt", weights_only=False) for r in (0, 1)]
    fig = torch.load(tmp_path / "budget0.pt", weights_only=False)
    bases = fig["bases"]  # each rank's own real base, as its engine measured it
    # rank 1 holds EXTRA more; a measured base can read high by a few KiB (the profiler misses
    # one unit-sized free now and then, see replay_fsdp.py): 52,552 against 49,280 B once
    assert bases[1] - bases[0] >= 0.5 * EXTRA, bases
    # a plan for rank 0's base alone retains every block, which rank 1 cannot hold
    assert fig["rank0_alone"] == fig["retain"]
    assert fig["rank1_min"] <= fig["budget"] < fig["rank1_retain_all"], fig
    for r in (0, 1):
        rows = [row for row in got[r]["rows"] if row["step"] > at]
        # The real peak and the prediction are held to the budget exactly (rank 0's plan for
        # its own base would put rank 1's real peak about 24 KiB over it); the real peak to the
        # prediction within the referee's slack (15,488 B): 2,140 B over once on CI at 921ef1d
        for row in rows:
            limit = fig["budget"]
            assert row["real"] <= limit and row["predicted"] <= limit, (r, row, limit)
            assert row["real"] <= row["predicted"] + referee_slack(), (r, row, limit)
        assert len(rows) >= 4, (r, got[r]["rows"])
        assert got[r]["plan"] == got[0]["plan"]  # rank 0's plan on every rank
    # The last plan is made for the largest base of any rank: at least the bases the ranks had
    # at step 9 (planned for rank 0's alone it would be 24 KiB under). Not always equal to them:
    # in one full suite run the last plan's base was 211,844 B against 209,228 at step 9 (the
    # real peaks within the predictions; passes 5 of 5 alone), as when a later measured step
    # reads a rank's base higher (see the bases' note above) and the plan is made again.
    assert got[0]["plan"]["base_memory"] >= max(bases), (got[0]["plan"], bases)
    assert got[0]["plan"]["budget"] == fig["budget"]
    assert any(o != "retain" for o in got[0]["plan"]["choices"].values())


#: Bytes rank 1 alone allocates after the forward, in its loss (see RankOneLossScratch).
SCRATCH = 64 * 1024


class RankOneLossScratch(ShardedDemoNet):
    """The demo model, where rank 1 alone allocates a scratch tensor in its loss, after the
    blocks' forward, freed as ``training_step`` returns: the bases of the ranks are equal, but
    rank 1's measured phase at the forward's end (loss temporaries on top of the retained
    blocks) holds ``SCRATCH`` more than rank 0's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1:
            scratch = torch.ones(SCRATCH // 4)
            loss = loss + scratch.sum() * 0.0
        self.losses.append(loss.item())
        return loss


def own_phases(engine: Any) -> dict:
    """This rank's own measured phase figures (not the ranks' agreed largest)."""
    return phase_args(engine.phase_row(), engine.segments)


class BudgetRankZeroAloneRetainsAll(L.Callback):
    """At training step ``at``, every rank sets the budget, through the strategy's own
    ``replan``, at rank 0's prediction for retaining every block with its own measured phases:
    a plan that fits rank 0's figures exactly and not rank 1's (its loss holds more)."""

    def __init__(self, at: int, out_dir: Any) -> None:
        self.at = at
        self.out_dir = str(out_dir)
        self.figures: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at:
            return
        strategy, engine = trainer.strategy, trainer.strategy.engine
        costs, base = engine.costs, engine.real_base_memory
        retain = {c.name: "retain" for c in costs}
        mine = own_phases(engine)
        budget = strategy.broadcast(predicted_peak(costs, retain, base, **mine))
        self.figures = {
            "budget": budget,
            "retain": retain,
            "retain_all": predicted_peak(costs, retain, base, **mine),
            "min": min_feasible_budget(costs, base, **mine),
        }
        strategy.replan(budget=budget)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        path = os.path.join(self.out_dir, f"budget{trainer.global_rank}.pt")
        torch.save(self.figures, path)


def test_rank_zero_plans_with_every_ranks_phase_figures(tmp_path):
    """Rank 0 makes the plan every rank runs; the ranks' measured phases differ (rank 1's loss
    holds 64 KiB more after the forward, which only its own real-peak measurement sees; the
    bases are equal). At step 9 the budget is set at rank 0's own prediction for retaining
    every block, which rank 1's figures put over it. Planned with the ranks' largest figures
    (agreed at the plan), on every step under that budget and on both ranks, the prediction
    and the real peak (the profiler referee, or the engine's figure on the steps it measures)
    are within the budget, exactly, and the real peak within the prediction (1 %). Planned
    with rank 0's figures alone, rank 1's first step of the plan held 316,880 B against the
    prediction 299,188 (5.9 % over)."""
    at, steps = 9, 16
    budget = BudgetRankZeroAloneRetainsAll(at, tmp_path)
    L.seed_everything(0)
    fit(
        tmp_path,
        replay_fsdp(calibration_steps=1),  # budget None (the lowest-memory plan) until step 9
        RankOneLossScratch(blocks=3, dim=32, dropout=0.1),
        steps=steps,
        callbacks=[budget, RealStepPeak(tmp_path)],
        data=ShardedDemoData(dim=32, batch_size=64, n_batches=steps),
    )
    got = [torch.load(tmp_path / f"real{r}.pt", weights_only=False) for r in (0, 1)]
    fig = [torch.load(tmp_path / f"budget{r}.pt", weights_only=False) for r in (0, 1)]
    limit = fig[0]["budget"]
    print(f"budget {limit}; per rank {fig}")
    # the premise: rank 1's own figures put retaining every block over the budget, and a plan
    # under it exists
    assert fig[0]["retain_all"] == limit
    assert fig[1]["min"] <= limit < fig[1]["retain_all"], fig
    for r in (0, 1):
        rows = [row for row in got[r]["rows"] if row["step"] > at]
        print(f"rank {r}: {[(row['step'], row['real'], row['predicted']) for row in rows]}")
        # The prediction and the real peak are held to the budget exactly, the real peak to
        # the prediction within referee_slack() (on rank 1 the new plan's first step, measured
        # by the engine, held 220-672 B more than predicted in 5 runs: its forward-end phase,
        # the loss scratch on top of the retained block, measured under the lowest-memory plan
        # being that much short under this one; a later step once 1,056 B). Without the ranks'
        # agreed phases that first step ran 17,692 B over rank 0's prediction: past this slack
        # (15,488 B).
        slack = referee_slack()
        over = [
            row
            for row in rows
            if not (row["predicted"] <= limit and row["real"] <= limit)
            or row["real"] > row["predicted"] + slack
        ]
        assert not over, (r, limit, over)
        assert len(rows) >= 4, (r, got[r]["rows"])
        assert got[r]["plan"] == got[0]["plan"]  # rank 0's plan on every rank
    assert got[0]["plan"]["budget"] == limit
    assert got[0]["plan"]["choices"] != fig[0]["retain"]


# ---------------------------------------------------------------------- bad input
class Unsharded(FSDPNet):
    def __init__(self) -> None:
        super().__init__(shard=False)


def test_a_model_that_configure_model_does_not_shard_is_refused(tmp_path):
    with pytest.raises(
        ProcessRaisedException, match=r"configure_model\(\) sharded nothing"
    ) as info:
        fit(tmp_path, replay_fsdp(), Unsharded(), steps=1)
    assert "lightning_replay.errors.ReplayConfigError" in str(info.value)
    assert "strategy='replay'" in str(info.value)  # what to do instead


def test_a_segment_crossing_fsdp_units_is_refused(tmp_path):
    """Each block is a unit: a segment over their container would replay three units."""
    crossing = (
        r"segment 'blocks' crosses FSDP units: it contains the unit\(s\) "
        r"\['blocks.0', 'blocks.1', 'blocks.2'\]"
    )
    model = FSDPNet()
    model.blocks = nn.Sequential(*model.blocks)  # a container with a forward (a ModuleList is
    # refused first, as never called)
    with pytest.raises(ProcessRaisedException, match=crossing) as info:
        fit(tmp_path, replay_fsdp(segments="blocks"), model, steps=1)
    assert "lightning_replay.errors.SegmentError" in str(info.value)


# ---------------------------------------------------------------------- ReplayCallback
def test_replay_callback_checks_match_and_its_engine_state_resumes(tmp_path):
    """ReplayCallback's grad and bytes checks record matches on both ranks, and its state
    (the engine's plan and contract versions) travels in the distributed checkpoint."""
    callback = ReplayCallback()
    trainer = L.Trainer(
        strategy=replay_fsdp(),
        accelerator="cpu",
        devices=2,
        logger=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
    )
    callback.setup(trainer, FSDPNet(), "fit")  # in this process: the blocker, as it is
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    first = fit(
        tmp_path / "first",
        replay_fsdp(calibration_steps=1),
        FSDPNet(),
        steps=6,
        callbacks=[ReplayCallback(check_every_n_steps=2), ckpt],
        enable_checkpointing=True,
    )
    with sqlite3.connect(tmp_path / "first" / "replay" / "records.sqlite") as db:
        rows = db.execute('SELECT rank, "check", outcome FROM records').fetchall()
    assert {(r, c) for r, c, o in rows if o == "match"} >= {
        (0, "grad"),
        (1, "grad"),
        (0, "bytes"),
        (1, "bytes"),
    }
    assert [row for row in rows if row[2] != "match"] == []
    resumed = fit(
        tmp_path / "first",
        replay_fsdp(calibration_steps=1),
        FSDPNet(),
        steps=10,
        callbacks=[ReplayCallback(check_every_n_steps=2)],
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt"),
    )
    for r in (0, 1):  # the plan carried on: no new plan version, contracts re-probed once
        assert resumed[r]["plan_version"] == first[r]["plan_version"]


# ---------------------------------------------------------------------- the config
CONFIG = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "configs", "replay_fsdp_cpu.yaml")
)


def test_the_replay_fsdp_config_trains_through_the_console_script(tmp_path):
    """configs/replay_fsdp_cpu.yaml through ``lightning-replay fit`` with its own (popen)
    launcher, which re-runs the command line in the child, hence a process of its own (most of
    its ~20 s is two interpreters starting): the demo model shards itself in configure_model,
    both ranks probe every block and record its contract, and nothing diverges."""
    env = dict(
        os.environ, WANDB_MODE="disabled", PYTHONPATH=os.path.dirname(os.path.dirname(CONFIG))
    )
    for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "lightning_replay.cli",
        "fit",
        "--config",
        CONFIG,
        "--trainer.max_steps=6",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.dim=16",
        "--data.init_args.dim=16",
        "--data.init_args.batch_size=8",
        "--data.init_args.n_batches=6",
        "--trainer.strategy.init_args.calibration_steps=1",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "replay" / "records.sqlite") as db:
        rows = db.execute('SELECT rank, segment, "check", outcome FROM records').fetchall()
    assert {r for r, *_ in rows} == {0, 1}
    for rank in (0, 1):  # every block of the demo's configure_replay_segments, on each rank
        assert {s for r, s, c, _ in rows if r == rank and c == "contract"} == {
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "blocks.3",
        }
    assert [row for row in rows if row[3] == "divergence"] == []


class _SaveMesh(L.Callback):
    def __init__(self, out_dir: Any) -> None:
        self.out_dir = str(out_dir)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            mesh = trainer.strategy.device_mesh
            out = {
                "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
                "batch": batch[0].clone(),
                "sharded": pl_module.blocks[0].fc.weight.to_local().shape[0],
            }
            torch.save(out, os.path.join(self.out_dir, f"mesh{trainer.global_rank}.pt"))


def test_default_mesh_shards_over_the_data_parallel_dimension(tmp_path):
    """What ``strategy="replay_fsdp"`` builds (no mesh arguments): every device data-parallel,
    as FSDP's name promises (ModelParallelStrategy's "auto" would make them tensor-parallel,
    leave a ``fully_shard``-only model unsharded and feed both ranks the same batches)."""
    strategy = ReplayFSDPStrategy(start_method="spawn", segments="blocks.*")
    fit(tmp_path, strategy, FSDPNet(), steps=1, callbacks=[_SaveMesh(tmp_path)])
    ranks = [torch.load(tmp_path / f"mesh{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["mesh"] == {"data_parallel": 2, "tensor_parallel": 1} for r in ranks), ranks
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == DIM // 2  # each rank holds half
    assert not torch.equal(ranks[0]["batch"], ranks[1]["batch"])  # each rank its own data
