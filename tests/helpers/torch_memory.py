"""An independent memory referee: what the CPU allocator really handed out during a step.

``torch.profiler`` with ``profile_memory=True`` records one event per allocation (+bytes) and
per free (-bytes) of the CPU allocator, with a timestamp. The peak of their running sum over a
step, plus the bytes already live when it began, is the step's real peak. None of this shares
code with ``lightning_replay.accounting`` (which counts saved tensors and snapshots through
hooks), so it can referee the engine's budget claims.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def allocation_peak(fn: Callable[[], object]) -> int:
    """Run ``fn`` under the profiler; return the peak of the running sum of its CPU
    allocation events: bytes allocated during ``fn`` and live at once, above the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak = net_peak(prof)
    if peak is None:
        raise AssertionError(
            "torch.profiler recorded no CPU memory events: is the allocator "
            "reporting to the profiler?"
        )
    return peak


def net_peak(prof: profile) -> int | None:
    """The peak of the running sum of a finished profile's CPU allocation events (bytes live
    at once above its start), or None where it recorded none."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    if not events:
        return None
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type == "cpu":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _storage_of(obj: object):
    """The untyped storage behind a live tensor object, or None (meta, fake, sparse, freed)."""
    t = getattr(obj, "_local_tensor", obj)  # a DTensor: this rank's shard
    if t.is_sparse or t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        ptr = s.data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):
        # a freed FSDP2 storage, a wrapper subclass, a lazy module's uninitialized parameter
        return None
    return s if ptr else None


def process_tensor_storages(device: str = "cpu") -> dict[int, int]:
    """Every tensor storage on ``device`` that a Python object keeps alive right now, found by a
    walk of the garbage collector's objects: ``{data_ptr: nbytes}``, each storage once.

    This is the process's own view, not the engine's: a tensor the engine keeps anywhere (a
    probe's observation, a saved copy, a cache) counts, whoever owns it. Tensors that only C++
    holds (an autograd graph nobody references from Python) are not seen; between steps there
    should be none. A leaf's gradient, which lives in C++ until Python reads it, is counted
    with its leaf (gradients kept between steps, or a micro-batch's window beginning with the
    gradients of the ones before)."""
    import gc
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on a deprecated lazy object warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and obj.device.type == device:
                s = _storage_of(obj)
                if s is not None:
                    seen[s.data_ptr()] = s.nbytes()
                try:
                    g = obj.grad if obj.is_leaf and obj.requires_grad else None
                except (RuntimeError, AttributeError):  # a wrapper subclass without one
                    g = None
                if g is not None and g.device.type == device:
                    s = _storage_of(g)
                    if s is not None:
                        seen[s.data_ptr()] = s.nbytes()
    return seen


def process_tensor_bytes(device: str = "cpu") -> int:
    """Bytes of :func:`process_tensor_storages`: the whole process's live tensor bytes."""
    return sum(process_tensor_storages(device).values())


def whole_step_peak(fn: Callable[[], object]) -> int:
    """The whole process's tensor peak over ``fn``: every live storage when it starts (taken from
    the process, never rebuilt from parameters and optimizer state) plus the profiler's net peak
    inside it."""
    return process_tensor_bytes() + allocation_peak(fn)


def state_storages(model: torch.nn.Module, optimizers: Iterable[object] = ()) -> set[int]:
    """The storages a model and its optimizers keep as state between steps: parameters,
    buffers and their gradients, tensor attributes of its modules (also inside lists, tuples
    and dicts), and the optimizers' state."""
    found: list = []

    def add(v: object, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            found.append(v)
            if v.grad is not None:
                found.append(v.grad)
        elif depth < 2 and isinstance(v, (list, tuple)):
            for x in v:
                add(x, depth + 1)
        elif depth < 2 and isinstance(v, dict):
            for x in v.values():
                add(x, depth + 1)

    for m in model.modules():
        for k, v in vars(m).items():
            if k != "_modules":
                add(v)
    for opt in optimizers:
        for st in getattr(opt, "state", {}).values():
            add(st)
    out = set()
    for t in found:
        s = _storage_of(t) if t.device.type == "cpu" else None
        if s is not None:
            out.add(s.data_ptr())
    return out


def tensors_outside(keep: set[int]) -> list:
    """Weak references to every live tensor of the process (a garbage-collector walk) whose
    storage is not in ``keep``: with :func:`state_storages`, what a step left behind. Two
    steps later each must be dead, or have become state (call with the state then)."""
    import gc
    import warnings
    import weakref

    out = []
    with warnings.catch_warnings():  # isinstance on a deprecated lazy object warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
                s = _storage_of(obj)
                if s is not None and s.data_ptr() not in keep:
                    out.append(weakref.ref(obj))
    return out


def outlived(refs: list, model: torch.nn.Module, optimizers: Iterable[object] = ()) -> list:
    """Of ``refs`` (:func:`tensors_outside` some steps ago), the tensors still alive that are
    not the model's or the optimizers' state now: what outlived its step."""
    optimizers = list(optimizers)
    keep = state_storages(model, optimizers)
    out = []
    for r in refs:
        t = r()
        if t is not None:
            s = _storage_of(t)
            if s is not None and s.data_ptr() not in keep:
                out.append(t)
    return out


def snapshot_pool_storages(engine: object) -> set[int]:
    """The storages of the spare buffers an engine's segments keep for their small whole
    snapshots (``restore.SnapshotPool``, at most ``2 * _POOL_LIMIT`` bytes per segment): reused
    from step to step, they are the preserved state's bytes, not something a step left."""
    from lightning_replay import restore

    out = set()
    for rt in getattr(engine, "runtimes", {}).values():
        pool = restore._POOLS.get(rt)
        for flat, views in pool.spare if pool is not None else ():
            for t in [flat, *views]:
                s = _storage_of(t)
                if s is not None:
                    out.add(s.data_ptr())
    return out


class StepReferee:
    """Each training step's whole-process peak, beside an engine that measures some steps itself.

    Only one profiler runs at a time: where the engine measures a step (its own profiler is
    running when the step's first module is called), the referee stays off and reports the
    engine's figure for that step (the same definition: the process's live storages when the
    step began + the profiler's net peak), marked ``"engine"``; elsewhere it measures the step
    itself, from the first module call after the engine's window opened (the walk then sees the
    batch and whatever anyone holds) to the end of the step, marked ``"referee"``.

    The module pre-hook it needs stays registered for the whole run (``close()`` removes it):
    hooks are part of a segment's preconditions, and one added and removed around every step
    would re-probe every step.
    """

    def __init__(self) -> None:
        self._state: dict | None = None
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def close(self) -> None:
        self._handle.remove()

    def _hook(self, module: object, args: object) -> None:
        st = self._state
        if st is None or st["prof"] is not None or st["engine"]:
            return
        engine = st["e"]
        if engine is not None and engine.step == st["step"]:
            return  # the engine's window has not opened yet
        if bool(torch.autograd.profiler._is_profiler_enabled):
            st["engine"] = True
            return
        st["base"] = process_tensor_bytes()
        st["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        st["prof"].__enter__()

    def __call__(self, fn: Callable[[], object], engine: object = None) -> tuple[int, str]:
        """Run one step ``fn``; return ``(peak bytes, "referee" | "engine")``."""
        st = self._state = {
            "prof": None,
            "engine": False,
            "e": engine,
            "step": getattr(engine, "step", None),
        }
        try:
            fn()
        except BaseException:
            if st["prof"] is not None:  # a step that raised leaves no profiler running
                st["prof"].__exit__(None, None, None)
            raise
        finally:
            self._state = None
        if st["engine"]:
            peak = getattr(engine, "_truth_peak", None)
            if peak is None:
                raise AssertionError("another profiler ran through the step: nothing measured")
            return int(peak), "engine"
        if st["prof"] is None:
            raise AssertionError("no module ran in the step: nothing was measured")
        prof = st["prof"]
        prof.__exit__(None, None, None)
        return st["base"] + (net_peak(prof) or 0), "referee"
