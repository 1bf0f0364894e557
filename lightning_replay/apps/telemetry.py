"""Per-step telemetry that means the same thing under every method.

:class:`StepTelemetry` measures each training step the same way whether the run recomputes
nothing, uses ``torch.utils.checkpoint`` or runs under ``strategy="replay"``, and appends one
JSON line per step to ``<run_dir>/telemetry.jsonl`` (what the report plots):

* ``step_time_ms`` — wall time from ``on_train_batch_start`` to ``on_train_batch_end``;
* ``peak_bytes`` — the step's peak of live tensor memory. On CUDA the allocator's
  ``max_memory_allocated``. On CPU, which has no allocator counter, :class:`LiveBytes`: a
  dispatch mode that sees every tensor the step creates and when its storage is freed, plus
  what was already resident (parameters, buffers, gradients, optimizer state);
* ``replays`` — segment recomputations in the step (the engine's count, or the
  ``torch_checkpoint``/``torch_sac`` wrappers' count);
* under ``strategy="replay"``: the run id, the engine's accounted peak, the budget, the plan
  version, each segment's option, whether the step was checked, and its checks by outcome.

:class:`~lightning_replay.ReplayCallback` writes rows of its own without this callback (the
engine's figures, no live tensor peak); ``lightning-replay report`` reads either.

Example:
    >>> import torch
    >>> with LiveBytes() as live:
    ...     a = torch.zeros(1024)          # 4 KiB
    ...     b = torch.zeros(1024); del b   # another 4 KiB, freed
    >>> live.peak, live.current
    (8192, 4096)
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any, Iterable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_replay.core.engine.config import check_count
from lightning_replay._compat import TorchDispatchMode, tree_leaves
from lightning_replay.apps.torch_recompute import recompute_counts
from lightning_replay.core.base.records import CHECKS, CONTRACT

__all__ = ["LiveBytes", "StepTelemetry", "read_telemetry", "TELEMETRY_FILE"]

TELEMETRY_FILE = "telemetry.jsonl"
MEMORY_MODES = ("auto", "cuda", "live", "off")


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storage, on any device, counted per storage.

    Every aten op's outputs are seen as they are made; a storage counts from its first sight
    until it is freed (a weak reference on the storage). :meth:`add_resident` counts tensors
    that already exist (parameters, optimizer state) the same way, so freeing them is seen too.
    Storage made outside aten (inside a kernel's workspace) is not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple, int] = {}
        self._finalizers: list[weakref.finalize] = []
        self.current = 0
        self.peak = 0

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        # Storages that outlive the step (parameters, optimizer state) would keep their
        # finalizers, and through them this object, alive for good: a leak per tracked step.
        for f in self._finalizers:
            f.detach()
        self._finalizers = []
        return out

    def add_resident(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._see(t)
        self.peak = max(self.peak, self.current)

    def _drop(self, key: tuple) -> None:
        n = self._live.pop(key, None)
        if n is not None:
            self.current -= n

    def _see(self, t: Any) -> None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, meta-less wrappers
            return
        ptr = st.data_ptr()
        if not ptr:
            return
        key = (t.device.type, t.device.index, ptr)
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = n
        self.current += n
        self._finalizers.append(weakref.finalize(st, self._drop, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._see(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._see(t)
                elif isinstance(t, (tuple, list)):
                    for u in tree_leaves(t):
                        self._see(u)
        if self.current > self.peak:
            self.peak = self.current
        return out


def _resident(trainer: pl.Trainer, module: torch.nn.Module) -> list[torch.Tensor]:
    out: list[torch.Tensor] = list(module.parameters()) + list(module.buffers())
    out += [p.grad for p in module.parameters() if p.grad is not None]
    for opt in trainer.optimizers:
        for state in opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class StepTelemetry(Callback):
    """Step time, peak memory and (under ``strategy="replay"``) the plan, every training step.

    Args:
        path: the JSON-lines file; default ``<trainer.default_root_dir>/telemetry.jsonl``.
        memory: ``"auto"`` (CUDA allocator on CUDA, :class:`LiveBytes` elsewhere), ``"cuda"``,
            ``"live"`` or ``"off"``.
        log: also log ``telemetry/step_time_ms`` and ``telemetry/peak_bytes`` via
            ``pl_module.log``.
        memory_every_n_steps: with :class:`LiveBytes`, track memory on every n-th step only.
            The dispatch mode costs time per aten op, so tracked steps are slower than the
            others (rows say ``memory_tracked``); the CUDA counters are free and read every
            step.

    Example:
        >>> StepTelemetry(memory="live").memory
        'live'
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        memory: str = "auto",
        log: bool = True,
        memory_every_n_steps: int = 1,
    ) -> None:
        if memory not in MEMORY_MODES:
            raise ValueError(
                f"StepTelemetry(memory={memory!r}) is not known; use one of {list(MEMORY_MODES)}"
            )
        self.path = None if path is None else os.fspath(path)
        self.memory = memory
        self.log = bool(log)
        check_count("StepTelemetry", "memory_every_n_steps", memory_every_n_steps)
        self.memory_every_n_steps = memory_every_n_steps
        self.rows: list[dict[str, Any]] = []
        self._file: Any = None
        self._mode: LiveBytes | None = None
        self._t0 = 0.0
        self._replays = 0
        self._seq = 0

    # ------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        path = self.path or os.path.join(trainer.default_root_dir, TELEMETRY_FILE)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        # a resumed fit appends to the file; a new fit starts it afresh
        self._file = open(path, "a" if trainer.ckpt_path else "w", encoding="utf-8")
        engine = _engine(trainer)
        self._replays = (
            _total_replays(engine)
            if engine is not None
            else sum(c["replays"] for c in recompute_counts(pl_module).values())
        )
        self._seq = 0
        if engine is not None:
            self._seq = max(
                (r.seq for r in engine.records.read(run_id=engine.records.run_id)), default=0
            )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._exit_mode()
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _memory_mode(self, device: torch.device) -> str:
        if self.memory != "auto":
            return self.memory
        return "cuda" if device.type == "cuda" else "live"

    # ------------------------------------------------------------------ every step
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        device = trainer.strategy.root_device
        mode = self._memory_mode(device)
        if mode == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        elif mode == "live" and trainer.global_step % self.memory_every_n_steps == 0:
            self._mode = LiveBytes()
            self._mode.add_resident(_resident(trainer, pl_module))
            self._mode.add_resident(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
            self._mode.__enter__()
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        device = trainer.strategy.root_device
        mode = self._memory_mode(device)
        if mode == "cuda":
            torch.cuda.synchronize(device)
        step_ms = (time.perf_counter() - self._t0) * 1e3
        peak = None
        if mode == "cuda":
            peak = int(torch.cuda.max_memory_allocated(device))
        elif mode == "live":
            peak = self._exit_mode()
        row: dict[str, Any] = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "step_time_ms": step_ms,
            "peak_bytes": peak,
            "memory": mode,
            "memory_tracked": mode == "live" and peak is not None,
        }
        phase = getattr(pl_module, "phase", None)
        if isinstance(phase, str):
            row["phase"] = phase
        engine = _engine(trainer)
        if engine is not None:
            total = _total_replays(engine)
            row.update(
                {
                    "run_id": engine.records.run_id,
                    "accounted_peak_bytes": engine.window_stats()["accounted_peak_bytes"],
                    "budget": engine.budget,
                    "plan_version": engine.plan_version,
                    "replays": total - self._replays,
                    "plan": {n: s["mode"] for n, s in engine.summary().items()},
                    "predicted_peak_bytes": (
                        engine.plan.peak_memory if engine.plan is not None else None
                    ),
                }
            )
            self._replays = total
            store = engine.records
            new = store.read(run_id=store.run_id, since_seq=self._seq)
            if new:
                self._seq = max(r.seq for r in new)
            row["checked"] = any(r.check in CHECKS for r in new)
            for r in new:  # a segment probed in this step ran retained, under discovery
                if r.check == CONTRACT and r.segment in row["plan"]:
                    row["plan"][r.segment] = "probe"
            row["records"] = {
                o: sum(1 for r in new if r.is_check and r.outcome == o)
                for o in ("match", "rejection", "divergence")
            }
        else:
            counts = recompute_counts(pl_module)
            if counts:
                total = sum(c["replays"] for c in counts.values())
                row["replays"] = total - self._replays
                self._replays = total
        self.rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self.log:
            pl_module.log(
                "telemetry/step_time_ms",
                torch.tensor(step_ms, dtype=torch.float64),
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
            if peak is not None:
                pl_module.log(
                    "telemetry/peak_bytes",
                    torch.tensor(float(peak), dtype=torch.float64),
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                )

    def _exit_mode(self) -> int | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        return mode.peak


def _engine(trainer: pl.Trainer) -> Any:
    engine = getattr(trainer.strategy, "engine", None)
    return engine if engine is not None and getattr(engine, "installed", False) else None


def _total_replays(engine: Any) -> int:
    if engine is None:
        return 0
    return sum(s["replays"] for s in engine.summary().values())


def read_telemetry(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a telemetry file (a missing file reads as no rows)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, TELEMETRY_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
