"""Installing replay on a model: :func:`install`, and how the model's forwards reach the engine.

:func:`install` checks the arguments once (a :class:`~lightning_replay.config.ReplayConfig`),
resolves the segments against the model and builds the
:class:`~lightning_replay.engine.ReplayEngine`. The engine :func:`attach`-es itself through class
swaps, not hooks: each segment module's class becomes a
subclass whose ``forward`` goes through the segment's
:class:`~lightning_replay.runtime.SegmentRuntime`, and, with ``window="root"``, the root's class
for one whose ``forward`` is one engine window. The subclasses keep the original name (reprs and
``state_dict`` keys do not change) and pickle and deep-copy as the original class, so a copy of
an installed model is a plain model with no engine attached. Uninstalling puts the classes back.
"""

from __future__ import annotations

import copyreg
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from lightning_replay._compat import saved_tensors_hooks_disabled, under_functorch
from lightning_replay.config import ReplanSettings, ReplayConfig
from lightning_replay.errors import ReplayConfigError
from lightning_replay.records import RecordStore
from lightning_replay.errors import SegmentError
from lightning_replay.segments import SegmentSpec, _is_compiled, resolve_segments

if TYPE_CHECKING:  # pragma: no cover
    from lightning_replay.engine import ReplayEngine

# Each installed module holds its runtime (a root, with window="root", its engine) in its own
# ``__dict__`` (under :data:`RUNTIME_KEY` / :data:`ENGINE_KEY`, which the walkers of a module's
# attributes skip, see ``slots.MODULE_INTERNALS``, and copies and pickles leave out): the model
# keeps its engine alive, as a user who drops the engine and keeps training expects, and
# nothing global does. A registry keyed weakly by module, with the runtime as value, kept every
# model installed and never uninstalled alive for the life of the process (the value held the
# engine, the engine the model, the model the key): no collection could free it, and in the
# test suite's order it kept later models' tensors alive after their own uninstall (issue 31).
# Now a dropped model and its engine are one cycle the collector frees; ``uninstall()`` frees
# them with no collector at all.
RUNTIME_KEY = "_lightning_replay_runtime"
ENGINE_KEY = "_lightning_replay_engine"
_REPLAY_CLASSES: dict[type, type] = {}


def _own(module: nn.Module, key: str) -> Any:
    """What ``module`` holds under ``key`` (not through its class's ``__getattribute__``: a
    probe's tracing subclass would count it as a read)."""
    return object.__getattribute__(module, "__dict__").get(key)


def _new_plain(cls: type, *args: Any) -> Any:
    """Unpickle/deep-copy target: a plain instance of the original class."""
    return cls.__new__(cls, *args)


def _replay_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward goes through the segment runtime.

    It keeps the name of ``cls`` (reprs and state_dict keys don't change) and pickles and
    deep-copies as ``cls``, so copies of an installed model are plain models.
    """
    if cls in _REPLAY_CLASSES:
        return _REPLAY_CLASSES[cls]

    def forward(self, *args, **kwargs):
        rt = _own(self, RUNTIME_KEY)
        if rt is None:
            return cls.forward(self, *args, **kwargs)
        return rt(args, kwargs)

    new = _swapped_class(cls, forward)
    _REPLAY_CLASSES[cls] = new
    return new


def _swapped_class(cls: type, forward: Callable) -> type:
    """A subclass of ``cls`` with ``forward``, the name of ``cls``, copied and pickled as
    ``cls``."""
    new = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "__reduce_ex__": _plain_reduce(cls, lambda: new),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_lightning_replay_base": cls,
        },
    )
    return new


_ROOT_CLASSES: dict[type, type] = {}


def _root_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward is one engine window (``install(window="root")``).

    Like :func:`_replay_class`, it keeps the name of ``cls`` and copies as ``cls``.
    """
    if cls in _ROOT_CLASSES:
        return _ROOT_CLASSES[cls]

    def forward(self, *args, **kwargs):
        eng = _own(self, ENGINE_KEY)
        if eng is None or under_functorch() or saved_tensors_hooks_disabled():
            # (a torch.func transform, or saved-tensor hooks switched off: no window, the
            # segments run plain, see runtime)
            return cls.forward(self, *args, **kwargs)
        eng._explicit_windows += 1
        eng.begin_window(continuation=not torch.is_grad_enabled(), inputs=(args, kwargs))
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            eng.end_forward()

    new = _swapped_class(cls, forward)
    _ROOT_CLASSES[cls] = new
    return new


def _plain_reduce(cls: type, swapped: Callable[[], type]) -> Callable:
    def __reduce_ex__(self, protocol):
        rv = cls.__reduce_ex__(self, protocol)
        if isinstance(rv, tuple) and rv and rv[0] is copyreg.__newobj__ and rv[1][0] is swapped():
            rv = (_new_plain, (cls,) + tuple(rv[1][1:])) + tuple(rv[2:])
        if isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
            if RUNTIME_KEY in rv[2] or ENGINE_KEY in rv[2]:  # a copy is a plain module
                state = {k: v for k, v in rv[2].items() if k not in (RUNTIME_KEY, ENGINE_KEY)}
                rv = rv[:2] + (state,) + rv[3:]
        return rv

    return __reduce_ex__


def attach(engine: "ReplayEngine") -> type | None:
    """Route the forwards of ``engine``'s segments (and, with ``window="root"``, of its model)
    through it. Returns the root's own class (``None`` for manual windows), for
    :func:`detach`."""
    for rt in engine.runtimes.values():
        rt.module.__dict__[RUNTIME_KEY] = rt
        rt.module.__class__ = _replay_class(rt.orig_class)
        become = getattr(rt.module, "cls_to_become", None)
        if isinstance(rt.module, LazyModuleMixin) and become is not None:
            # A lazy module turns into ``cls_to_become`` at its first forward: into the
            # replaying subclass of it, so it keeps replaying afterwards.
            rt.module.cls_to_become = _replay_class(become)
    if engine.config.window != "root":
        return None
    # The root's forward opens the window through a class swap, not hooks: a copy (deepcopy,
    # pickle) of the model is then a plain model, with no engine attached.
    root_class = type(engine.model)
    engine.model.__dict__[ENGINE_KEY] = engine
    engine.model.__class__ = _root_class(root_class)
    return root_class


def detach(engine: "ReplayEngine", root_class: type | None) -> None:
    """Undo :func:`attach`: every module gets its own class back."""
    if root_class is not None:
        if engine.model.__dict__.get(ENGINE_KEY) is engine:
            del engine.model.__dict__[ENGINE_KEY]
        engine.model.__class__ = root_class
    for rt in engine.runtimes.values():
        if rt.module.__dict__.get(RUNTIME_KEY) is rt:
            del rt.module.__dict__[RUNTIME_KEY]
        base = getattr(type(rt.module), "_lightning_replay_base", None)
        rt.module.__class__ = base if base is not None else rt.orig_class
        become = getattr(rt.module, "cls_to_become", None)
        if become is not None and getattr(become, "_lightning_replay_base", None):
            if "cls_to_become" in rt.module.__dict__:
                del rt.module.__dict__["cls_to_become"]


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def install(
    model: nn.Module,
    segments: SegmentSpec | Iterable[SegmentSpec],
    *,
    preservation: str | Mapping[str, str] = "auto",
    on_violation: str = "raise",
    records: RecordStore | str | None = None,
    window: str = "root",
    budget: int | str | None = None,
    planner: str = "joint",
    track_memory: bool = False,
    base_memory: int = 0,
    calibration_steps: int = 2,
    real_peak: bool = True,
    replan_on: Iterable[str] = (),
    replan_cooldown_steps: int = 10,
    selective: str | None = None,
) -> ReplayEngine:
    """Make the given submodules of ``model`` replay exactly under activation recomputation.

    Args:
        model: the root module; the window is its forward plus backward.
        segments: submodule names, glob patterns, module classes, or a callable
            ``(name, module) -> bool`` (see :func:`~lightning_replay.segments.resolve_segments`).
        preservation: ``"auto"`` (cheapest correct option by memory), ``"whole"``, ``"regions"``,
            ``"retain"``, or a dict from segment name to one of these.
        on_violation: ``"raise"`` raises :class:`ContractViolation`; ``"record"`` warns, records,
            and re-probes the segment.
        records: ``None`` (in memory), a SQLite path, or a :class:`RecordStore`.
        window: ``"root"`` (the window starts with each forward of ``model``) or ``"manual"``
            (the caller wraps each step in :meth:`ReplayEngine.window`).
        budget: peak-memory budget (bytes, ``"2GiB"``, or a fraction of the model's device:
            of the CUDA device's memory, or of physical memory on CPU), or ``"min"`` for the
            lowest-memory correct plan. With a budget, the steps after the probe calibrate
            each option (``calibration_steps`` each), then ``planner`` chooses one option per
            segment from the measured costs; ``engine.plan`` is the plan and
            ``engine.replan()`` makes a new one. ``None``: no planning (``preservation``
            decides).
        planner: ``"joint"`` (optimal), ``"eager_whole"``, ``"fixed_regions"``,
            ``"retain_all"`` or ``"whole_all"``.
        track_memory: count saved-tensor and snapshot bytes exactly every step (on whenever a
            budget is set); ``engine.window_stats()["peak_bytes"]`` reports the step's peak.
        base_memory: bytes outside the engine's view (optimizer state) added to the base.
        calibration_steps: steps per option measured before planning.
        real_peak: plan for the process's real memory, not only the accountant's figures: the
            first step of each plan is measured (the CUDA allocator; on CPU torch.profiler's
            memory events, single process only) and what it held beyond the accountant
            (backward temporaries, optimizer state via ``engine.track_optimizer``) joins the
            base (:attr:`ReplayEngine.real_base_memory`), so the plan's predicted peak bounds
            the real one. On by default; ``False`` holds the budget in the accountant's terms
            only (saved tensors, snapshots, region logs, parameters and gradients).
        replan_on: with a budget, when the engine plans again by itself, as each window
            begins (:class:`~lightning_replay.replan.ReplanPolicy`): ``"violations"`` (a
            rejection or a check's divergence, once the segment's new contract is in force),
            ``"memory"`` (the last step's peak above the budget or off the plan's prediction),
            ``"shapes"`` (the root's input shapes changed and stayed changed; ``window="root"``
            only). Off (``()``) by default; pass e.g. ``replan_on=("violations", "memory")`` to
            turn it on. Under ``Trainer(strategy="replay")``, ``ReplayCallback`` does this.
        replan_cooldown_steps: steps between two re-plans for ``"memory"`` or ``"shapes"``.
        selective: a selective policy (``"matmul"``: keep matrix product, attention and
            convolution outputs; ``"every_other_matmul"``; see
            :mod:`~lightning_replay.selective`): the planner may also replay a segment
            selectively, with the same preservation as a full replay. ``None`` (default): only
            segments pinned to ``preservation="selective"`` are, under ``"matmul"``.

    Returns:
        The :class:`ReplayEngine`; ``engine.uninstall()`` restores the model.

    Raises:
        ReplayConfigError: a bad argument (the message names it, the value, and what to use).
        SegmentError: ``segments`` does not resolve to valid, non-nested submodules.

    Example:
        >>> import torch, lightning_replay as lr
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
        ...                             torch.nn.Linear(4, 1))
        >>> engine = lr.install(model, segments=["0", "1"])
        >>> for _ in range(2):
        ...     model(torch.randn(8, 4)).sum().backward()
        >>> engine.summary()["1"]["replays"]
        1
        >>> engine.uninstall()
    """
    if not isinstance(model, nn.Module):
        raise ReplayConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replan = ReplanSettings(
        replan_on=replan_on, replan_cooldown_steps=replan_cooldown_steps, caller="install"
    )
    config = ReplayConfig(
        segments=segments,
        preservation=preservation,
        on_violation=on_violation,
        records=records,
        window=window,
        budget=budget,
        planner=planner,
        track_memory=track_memory,
        base_memory=base_memory,
        calibration_steps=calibration_steps,
        real_peak=real_peak,
        replan=replan,
        selective=selective,
        caller="install",
    )
    return install_config(model, config)


def install_config(model: nn.Module, config: ReplayConfig) -> ReplayEngine:
    """:func:`install` from a :class:`~lightning_replay.config.ReplayConfig` (what the
    strategies call). The checks that need the model happen here: the segments and the pins
    naming them resolve, the budget resolves against the model's device.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> engine = install_config(model, ReplayConfig(segments=["0"], budget="min"))
        >>> engine.config.budget, engine.budget
        (Budget('min'), None)
        >>> engine.uninstall()
    """
    if not isinstance(model, nn.Module):
        raise ReplayConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for mod in model.modules():
        rt = _own(mod, RUNTIME_KEY)
        if rt is not None:
            raise ReplayConfigError(
                f"model already has lightning_replay installed (segment "
                f"{rt.name!r}); call engine.uninstall() before installing again"
            )
    _refuse_compiled(model)
    resolved = resolve_segments(model, config.segments)
    _refuse_compiled_around(model, resolved)
    _refuse_own_checkpointing(model, resolved)
    config.pins(resolved)
    from lightning_replay.engine import ReplayEngine, _resolve_budget

    _resolve_budget(config, model)  # a fraction that cannot resolve fails before any change
    return ReplayEngine(model, resolved, config, config.make_records(rank=_rank()))


def _refuse_compiled(model: nn.Module) -> None:
    """A model compiled as a whole (``torch.compile(model)``, ``model.compile()``): its
    forward, the window, would be traced with the segments' runtimes inside it."""
    how = _is_compiled(model)
    if how is not None:
        raise ReplayConfigError(
            f"model is compiled as a whole ({how}): its forward would trace lightning_replay's "
            "own code into the compiled graph, which cannot probe or replay a segment "
            "(torch.compile is not supported, see the README's Out of scope). Install replay "
            "on the eager model (for torch.compile(model): its ._orig_mod) and do not compile "
            "it; compile only modules that hold no segment."
        )


def _refuse_compiled_around(model: nn.Module, segments: Mapping[str, nn.Module]) -> None:
    """A compiled module that holds a segment, or lies inside one: the same reason as
    :func:`_refuse_compiled` (a compiled module apart from every segment may stay)."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.jit.ScriptModule):
            raise SegmentError(
                f"module {name!r} is a TorchScript module (torch.jit.script or "
                "torch.jit.trace): its state lives in the TorchScript interpreter, where "
                "lightning_replay can neither watch it nor put it back for a replay (TorchScript "
                "is not supported, see the README's Out of scope). Keep the module eager while "
                "training with replay (script or trace it for deployment afterwards)."
            )
        how = _is_compiled(mod)
        if how is None:
            continue
        for seg in segments:
            if seg.startswith(name + ".") or name.startswith(seg + "."):
                where = "holds" if seg.startswith(name + ".") else "lies inside"
                raise SegmentError(
                    f"module {name!r} is compiled ({how}) and {where} segment {seg!r}: a "
                    "compiled forward runs as one graph, which the probe cannot watch and a "
                    "replay cannot re-run with the state it saw (torch.compile is not "
                    "supported, see the README's Out of scope). Do not compile the segments "
                    "or the modules around them; modules that hold no segment may stay "
                    "compiled."
                )


def _refuse_own_checkpointing(model: nn.Module, segments: Mapping[str, nn.Module]) -> None:
    """Refuse, before anything changes, a model whose own (Hugging Face style) gradient
    checkpointing is on in or around a segment: it would run a segment inside its own
    recomputation, and the first step would fail deep in autograd.

    The fix named is the model's own method: ``activation_checkpointing_disable()`` in
    transformers 5.x (``gradient_checkpointing_disable()`` is its deprecated alias there), the
    older name where only that exists, else the flag itself.
    """
    names = list(segments)
    flagged = [
        n
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", None) is True
        and any(n == s or _inside(n, s) or _inside(s, n) for s in names)
    ]
    if not flagged:
        return
    owners = [  # the outermost module above a flagged one that can turn it off
        n
        for n, m in model.named_modules()
        if any(n == f or _inside(f, n) for f in flagged)
        and (
            callable(getattr(m, "activation_checkpointing_disable", None))
            or callable(getattr(m, "gradient_checkpointing_disable", None))
        )
    ]
    if owners:
        owner = min(owners, key=lambda n: n.count(".") if n else -1)
        mod = model.get_submodule(owner)
        method = (
            "activation_checkpointing_disable"
            if callable(getattr(mod, "activation_checkpointing_disable", None))
            else "gradient_checkpointing_disable"
        )
        where = f"model.{owner}" if owner else "model"
        fix = f"call {where}.{method}() before installing"
    else:
        fix = "set " + ", ".join(f"{f or 'model'}.gradient_checkpointing = False" for f in flagged)
    shown = ", ".join(repr(f) for f in flagged[:4]) + (", ..." if len(flagged) > 4 else "")
    raise ReplayConfigError(
        f"the model checkpoints its own activations (gradient_checkpointing=True on {shown}), "
        "in or around the segments: lightning_replay recomputes its segments itself, with "
        f"their state exact, and one recomputation cannot run inside another. To replay, {fix}; "
        "or choose segments outside the checkpointed modules."
    )


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is strictly inside module ``outer`` (``""`` is the root)."""
    return outer == "" and name != "" or name.startswith(outer + ".")
