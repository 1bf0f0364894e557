"""Installing replay on a model: :func:`install` (and :func:`install_config`).

:func:`install` checks the arguments once (a
:class:`~lightning_replay.core.engine.config.ReplayConfig`), refuses models it cannot replay (a
compiled model, segments under the model's own checkpointing), resolves the segments against
the model and builds the :class:`~lightning_replay.core.engine.engine.ReplayEngine`, which
reaches the model's forwards through class swaps (:mod:`~lightning_replay.core.engine.attach`;
their names stay importable from here, where older pickles name ``_new_plain``).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from lightning_replay.core.engine.config import ReplanSettings, ReplayConfig
from lightning_replay.errors import ReplayConfigError
from lightning_replay.core.base.records import RecordStore
from lightning_replay.errors import SegmentError
from lightning_replay.core.engine.segments import SegmentSpec, _is_compiled, resolve_segments

from lightning_replay.core.engine.engine import ReplayEngine, _resolve_budget
from lightning_replay.core.engine.attach import (  # (moved there; old pickles name _new_plain here)
    ENGINE_KEY as ENGINE_KEY,
    RUNTIME_KEY as RUNTIME_KEY,
    _REPLAY_CLASSES as _REPLAY_CLASSES,
    _ROOT_CLASSES as _ROOT_CLASSES,
    _new_plain as _new_plain,
    _own as _own,
    _plain_reduce as _plain_reduce,
    _replay_class as _replay_class,
    _root_class as _root_class,
    _swapped_class as _swapped_class,
    attach as attach,
    detach as detach,
)


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
            only), ``"times"`` (once per plan, after 8 steps of it: the time its replays add
            by the medians now is more than 25 % off what it was planned with; calibration
            times each option on a few steps only). Off (``()``) by default; pass e.g. ``replan_on=("violations", "memory")`` to
            turn it on. Under ``Trainer(strategy="replay")``, ``ReplayCallback`` does this.
        replan_cooldown_steps: steps between two re-plans for ``"memory"`` or ``"shapes"``.
        selective: a selective policy (``"matmul"``: keep matrix product, attention and
            convolution outputs; ``"every_other_matmul"``; ``"flops"``: of those, the ones
            that save more compute per byte than retaining the segment; see
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
