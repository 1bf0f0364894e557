"""The real peak memory of a training step, measured by a referee outside the accountant.

The accountant (:mod:`lightning_replay.accounting`) counts what the cost model talks about:
saved tensors, snapshots, re-materialized activations. A step holds more: backward's gradient
temporaries, kernel workspaces, the loss's intermediates, optimizer state. A budget is a promise
about the process's memory, so the planner's base must include them: :class:`StepPeak` measures
the real peak of one whole step (forward, backward, optimizer) and the engine adds what the
accountant did not see to the base.

* CPU: every tensor storage the process keeps alive when the step starts (a walk of the garbage
  collector's objects, each storage once: :func:`process_tensor_bytes`), plus the highest running
  sum of the step's net allocations from ``torch.profiler`` memory events (every allocation and
  free of the CPU allocator). The base is the process's, not rebuilt from the model: tensors
  anyone keeps between steps (the engine, a cache, the caller) are memory the step holds.
* CUDA: the caching allocator's own peak (``max_memory_allocated`` after
  ``reset_peak_memory_stats``) on the model's device, which counts what was held when the step
  began.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from lightning_replay.core.base.state import storage_key


_HELD_ITEMS = 4096  # items of a module's list or dict attribute looked at


def model_tensors(
    model: nn.Module, optimizers: Iterable[Any] = (), grads: bool = True
) -> Iterator[Any]:
    """The tensors a model and its optimizers hold between steps: parameters, buffers, their
    gradients (``grads=True``), the tensors modules hold as attributes (directly or in a list,
    tuple or dict: a cache dict, a queue kept as a plain attribute) and optimizer state."""
    for t in list(model.parameters()) + list(model.buffers()):
        yield t
        if grads and t.grad is not None:
            yield t.grad
    for m in model.modules():
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(v, torch.Tensor):
                yield v
            elif type(v) in (list, tuple):
                yield from v[:_HELD_ITEMS]
            elif type(v) is dict:
                yield from list(v.values())[:_HELD_ITEMS]
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            yield from state.values()


def live_model_bytes(model: nn.Module, optimizers: Iterable[Any] = (), grads: bool = True) -> int:
    """Bytes of :func:`model_tensors` live right now, each storage once. ``grads=False``:
    without the gradients (which come and go within a step)."""
    seen: dict = {}
    for t in model_tensors(model, optimizers, grads):
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)  # an FSDP2 shard: this rank's bytes
            key = storage_key(t)
            if key is not None:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _storage_of(obj: Any) -> Any:
    """The untyped storage behind a live tensor object, or None (meta, sparse, freed, a
    wrapper subclass without one)."""
    t = getattr(obj, "_local_tensor", obj)  # a DTensor: this rank's shard
    try:
        if t.is_sparse or t.device.type == "meta":
            return None
        s = t.untyped_storage()
        return s if s.data_ptr() else None
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # a freed FSDP2 storage, a fake tensor, a lazy module's uninitialized parameter
        return None


def process_tensor_bytes(device: str = "cpu", also: Iterable[Any] = ()) -> int:
    """Bytes of every tensor storage on ``device`` that a Python object keeps alive right now:
    a walk of the garbage collector's objects, each storage once (by its address), together
    with the storages of ``also`` (the model's and optimizers' tensors: :func:`model_tensors`).

    This is the process's view, not the engine's: a tensor anyone keeps (a probe's leftovers, a
    cache, the caller's batch) counts. A walk touches every object the collector tracks (0.3 s
    with half a million, transformers and Lightning loaded), so the engine takes it only at the
    start of a step it measures.

    The walk sees only the objects in the collector's generations: what a caller moved out of
    its sight with ``gc.freeze()`` (a process that forks its data workers does, to keep their
    pages shared) is invisible to it, the tensors among them included. ``also`` is what must
    count whatever the collector sees: a model frozen with the rest is still memory each step
    holds.

    Example:
        >>> import torch
        >>> before = process_tensor_bytes()
        >>> t = torch.empty(1 << 20, dtype=torch.uint8)
        >>> process_tensor_bytes() - before >= 1 << 20
        True
    """
    import gc
    import warnings

    seen: dict[int, int] = {}

    def add(obj: Any) -> None:
        try:
            on = obj.device.type == device
        except (RuntimeError, AttributeError):
            return
        if on:
            s = _storage_of(obj)
            if s is not None:
                seen[s.data_ptr()] = s.nbytes()

    with warnings.catch_warnings():  # reading a deprecated lazy object's device warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            # the type, not isinstance: isinstance reads __class__, which a dead weakref.proxy
            # raises on and a lazy proxy resolves (a tensor's proxy is no tensor storage)
            if issubclass(type(obj), torch.Tensor):
                add(obj)
                # a leaf's gradient lives in C++ until Python reads it: no object of the
                # walk holds it (a micro-batch's window begins with the gradients of the
                # ones before: 6 MiB unseen in test_adversary_memory's grad_accumulation)
                try:
                    g = obj.grad if obj.is_leaf and obj.requires_grad else None
                except (RuntimeError, AttributeError):  # a wrapper subclass without one
                    g = None
                if g is not None:
                    add(g)
        for obj in also:
            if issubclass(type(obj), torch.Tensor):
                add(obj)
    return sum(seen.values())


def profiler_busy() -> bool:
    """Whether a profiler is already running in this process (then we measure nothing)."""
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:  # pragma: no cover - older torch
        return False


class StepPeak:
    """Measures the real peak of the step between :meth:`start` and :meth:`stop`.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(256, 256)
        >>> meter = StepPeak(m)
        >>> meter.start()
        >>> m(torch.randn(64, 256)).sum().backward()
        >>> peak = meter.stop()
        >>> peak >= 2 * 256 * 256 * 4  # weights and their gradient at least
        True
    """

    def __init__(
        self, model: nn.Module, device: torch.device | None = None, optimizers: Iterable[Any] = ()
    ) -> None:
        self.model = model
        self.device = device
        #: their state counts in :attr:`base` even where the collector cannot see it
        self.optimizers = list(optimizers)
        self._prof: Any = None
        #: the bytes live when the step began (CPU: the process's tensor storages)
        self.base = 0
        #: after :meth:`stop`: the real peak of each phase, by the label :meth:`mark` began it
        #: with (``"start"`` for the first), in the order they ran
        self.phases: dict[str, int] = {}
        self._marks: list[str] = []
        self._cuda_phases: list[int] = []
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        self._marks, self._cuda_phases, self.phases = ["start"], [], {}
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.base = process_tensor_bytes(also=model_tensors(self.model, self.optimizers))
        # kineto's own log lines (a CUDA build probing for GPUs) are noise to the user
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        before = torch.empty(1)  # allocated before the profiler: see _native_noise_captured
        with _native_noise_captured():
            self._prof.__enter__()
            del before
        # A meter whose step never ends (the last step of a loop with no optimizer step; an
        # engine dropped mid-step) must not leave torch's profiler on: it would slow every op
        # after it, keep any other profiler from starting, and crash the interpreter at exit
        # (a segfault in libtorch's callbacks, exit code 139). The profiler stops when the
        # meter is collected, or at exit.
        self._finalizer = weakref.finalize(self, _stop_profiler, self._prof)

    def mark(self, label: str) -> None:
        """A new phase of the step begins here (the first replay, the optimizer step): its
        peak is told apart in :attr:`phases`. CPU: a profiler annotation, whose timestamp
        splits the running sum; CUDA: the allocator's peak so far is read and reset (host-side
        counters, no synchronization)."""
        if label in self._marks:
            return
        if self.device is not None and self.device.type == "cuda":
            self._cuda_phases.append(int(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._prof is None:
            return
        else:
            with torch.profiler.record_function(_MARK + label):
                pass
        self._marks.append(label)

    def stop(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            self._cuda_phases.append(int(torch.cuda.max_memory_allocated(self.device)))
            self.phases = dict(zip(self._marks, self._cuda_phases))
            return max(self._cuda_phases)
        prof, self._prof = self._prof, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        with _native_noise_captured():
            prof.__exit__(None, None, None)
        self.phases = {
            label: self.base + peak for label, peak in phase_peaks(prof, self._marks).items()
        }
        return max(self.phases.values())


def _stop_profiler(prof: Any) -> None:
    """Stop a meter's profiler that no :meth:`StepPeak.stop` will (see :meth:`StepPeak.start`)."""
    try:
        with _native_noise_captured():
            prof.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - at exit or in a collector: nothing to report to
        pass


# Lines libtorch and kineto write straight to file descriptor 2 when a CPU profiler starts and
# stops (``USDT: ... profiler_start``; a CPU-only build probing for GPUs), and c10's warning,
# once per process, that a block allocated before profiling was freed inside it. No setting
# silences them in torch 2.14 (KINETO_LOG_LEVEL does not reach the USDT lines).
_NATIVE_NOISE = (
    "USDT:",
    "profiler_start",
    "profiler_stop",
    "allocated before the profiling started",
    "gpuGetDeviceCount failed",
)


@contextlib.contextmanager
def _native_noise_captured() -> Iterator[None]:
    """Run the block with file descriptor 2 going to a buffer; write back to stderr every
    line that is not the profiler's own noise (:data:`_NATIVE_NOISE`).

    Around the profiler's start and stop only: there the USDT lines are written. The c10
    warning about a block freed under the profiler prints once per process, so
    :meth:`StepPeak.start` frees one such block inside this block, and the step's own frees
    find it already said."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 (an embedded interpreter)
        yield
        return
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except ValueError:
                pass
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            kept = [
                line
                for line in buf.read().decode(errors="replace").splitlines(keepends=True)
                if not any(n in line for n in _NATIVE_NOISE)
            ]
            if kept:
                sys.stderr.write("".join(kept))


_MARK = "lightning_replay::phase::"  # the profiler annotation StepPeak.mark leaves


def net_peak(prof: Any) -> int:
    """Highest running sum of the CPU allocations and frees a profiler saw."""
    return max(phase_peaks(prof, ["start"]).values())


def phase_peaks(prof: Any, labels: list[str]) -> dict[str, int]:
    """Highest running sum of the CPU allocations and frees a profiler saw, per phase: the
    first phase (``labels[0]``) from the start, each later one from its :meth:`StepPeak.mark`
    annotation on, counting what was held when it began. A phase whose mark the profiler did
    not record is left out (its bytes count in the phase before)."""
    events = prof.profiler.kineto_results.events()
    marks = {e.name()[len(_MARK) :]: e.start_ns() for e in events if e.name().startswith(_MARK)}
    starts = sorted((marks[x], x) for x in labels[1:] if x in marks)
    memory = [
        e
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    memory.sort(key=lambda e: e.start_ns())
    label = labels[0]
    peaks = {label: 0}
    run = 0
    k = 0
    for e in memory:
        while k < len(starts) and e.start_ns() >= starts[k][0]:
            label = starts[k][1]
            peaks[label] = run
            k += 1
        run += e.nbytes()
        peaks[label] = max(peaks[label], run)
    for _, later in starts[k:]:  # nothing allocated after it: what it held when it began
        peaks[later] = run
    return peaks
