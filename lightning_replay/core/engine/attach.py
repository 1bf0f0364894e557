"""How an engine reaches a model's forwards: class swaps, undone by :func:`detach`.

:func:`attach` swaps each segment module's class for a subclass whose ``forward`` goes through
the segment's :class:`~lightning_replay.core.runtime.SegmentRuntime` and, with
``window="root"``, the root's class for one whose ``forward`` is one engine window; not hooks.
The subclasses keep the original name (reprs and ``state_dict`` keys do not change) and pickle
and deep-copy as the original class (:func:`_new_plain`), so a copy of an installed model is a
plain model with no engine attached. The engine calls these; :func:`~lightning_replay.core.
engine.installation.install` builds the engine, so this module is below both.
"""

from __future__ import annotations

import copyreg
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from lightning_replay._compat import saved_tensors_hooks_disabled, under_functorch
from lightning_replay.core.base.state import storage_bytes, storage_key
from lightning_replay.core.engine.step_graph import watch_outputs
from lightning_replay.errors import ReplayConfigError
from lightning_replay.core.mechanisms.arguments import held_tensors
from lightning_replay.core.mechanisms.outside_reads import CLASS_LOCK, engine_swapped
from lightning_replay.core.mechanisms.subclassing import quiet_subclass

#: module_globals: this module's globals are machinery, never user state
_REPLAY_MACHINERY = True

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
        if torch.compiler.is_compiling():  # (dynamo traces: it does not see RUNTIME_KEY)
            return _eager_under_compile(self, RUNTIME_KEY, lambda: forward(self, *args, **kwargs))
        rt = _own(self, RUNTIME_KEY)
        if rt is None:
            return cls.forward(self, *args, **kwargs)
        return rt(args, kwargs)

    new = _swapped_class(cls, forward)
    _REPLAY_CLASSES[cls] = new
    return new


def _swapped_class(cls: type, forward: Callable) -> type:
    """A subclass of ``cls`` with ``forward``, the name of ``cls``, copied and pickled as
    ``cls``.

    Making it runs the ``__init_subclass__`` of ``cls``'s bases (transformers wraps a layer's
    ``forward`` there, on the new class). What that writes into the bases themselves and into
    their modules' globals is undone (:func:`~lightning_replay.core.mechanisms.subclassing.
    quiet_subclass`): a plugin registry keyed by class
    name (``REGISTRY[cls.__name__] = cls``) would map the user's name to this subclass, for
    good."""
    new = quiet_subclass(
        cls,
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
        if torch.compiler.is_compiling():  # (dynamo traces: it does not see ENGINE_KEY)
            return _eager_under_compile(self, ENGINE_KEY, lambda: forward(self, *args, **kwargs))
        eng = _own(self, ENGINE_KEY)
        if eng is None or under_functorch() or saved_tensors_hooks_disabled():
            # (a torch.func transform, or saved-tensor hooks switched off: no window, the
            # segments run plain, see runtime)
            return cls.forward(self, *args, **kwargs)
        eng._explicit_windows += 1
        opens = eng._window_depth == 0
        eng.begin_window(continuation=not torch.is_grad_enabled(), inputs=(args, kwargs))
        try:
            out = cls.forward(self, *args, **kwargs)
        finally:
            eng.end_forward()
        if opens:  # whether a backward reaches this forward's graph (a training step)
            watch_outputs(eng, out)
        if opens and eng._pending_probes:
            copy_held_activations(eng, out)
        return out

    new = _swapped_class(cls, forward)
    _ROOT_CLASSES[cls] = new
    return new


def copy_held_activations(engine: Any, outputs: Any) -> None:
    """Copy, as the window's forward ends, the activations a replayed probe passed to its
    segment uncopied that the step can still reach (the root's outputs, a module attribute):
    the step may write one in place before backward (``model.last.mul_(0.5)``), where no
    capture runs, and the probe's replay must read the bytes its forward read.

    A replayed probe (under a byte budget) copies the arguments made outside autograd at first
    touch, but not the window's activations (outputs of autograd ops, most often an earlier
    segment's output): copying each would add every segment's input to the probe step's peak.
    Only the ones held here are copied (a plain chain of blocks holds none); an activation
    written in the window after its segment ran (a logged write, undone at the replay) is left
    to its log. What the model does not hold (a global list, a hook's closure) stays
    uncopied: a write there is caught by the probe's comparison (a recorded ``ReplayError``).
    """
    probes = [
        p
        for rt in engine._pending_probes
        for p in rt.probes
        if p.replayed and p.observations is None and p.mode.uncopied
    ]
    if not probes:
        return
    try:
        held = {storage_key(t) for t in held_tensors(list(engine.model.modules()), outputs)}
    except Exception:  # noqa: BLE001 (an attribute no walk can read: the probe's comparison stays)
        return
    with torch.no_grad():
        for p in probes:
            for touch in p.mode.touched.values():
                key = touch.key
                if (
                    touch.snapshot is None
                    and key in p.mode.uncopied
                    and key in held
                    and not touch.entries(engine.log)
                ):
                    touch.snapshot = storage_bytes(touch.tensor).clone()


@torch.compiler.disable
def _eager_under_compile(module: nn.Module, key: str, call: Callable[[], Any]) -> Any:
    """Run an installed forward that ``torch.compile`` reached (the model compiled after
    :func:`install`, or a module holding it) eagerly, with one warning and one record.

    Traced by dynamo, the engine's own code would be compiled into the graph or skipped around
    it: the segments then run their original forwards on every later step, never replayed, and
    a byte budget is silently not held (measured: 1 probed forward, 0 replays in 4 steps). Run
    eagerly, the window and the segments work as without compile; the code around them stays
    compiled. The graph break this makes is the price; compile the modules apart from the
    segments (``model.head.compile()``) to keep compiling those.
    """
    held = _own(module, key)
    engine = held if key == ENGINE_KEY else getattr(held, "engine", None)
    if engine is not None and not getattr(engine, "_warned_compile", False):
        engine._warned_compile = True
        segment = held.name if key == RUNTIME_KEY else None
        where = f"segment {segment!r}" if segment is not None else "the installed model"
        engine.records.append(
            step=engine.step,
            segment=segment or "*",
            contract_version=0,
            check="install",
            outcome="rejection",
            detail={
                "what": f"torch.compile reached {where} after install",
                "action": "eager (graph break): the window and its segments are not compiled",
            },
        )
        warnings.warn(
            f"torch.compile reached {where}, installed for replay: its forward runs eagerly "
            "(a graph break), so that the segments replay and the window's state is watched "
            "as without compile; a compiled engine would run the original forwards and replay "
            "nothing. To compile, compile the modules apart from the segments (a head, the "
            "loss), or uninstall the engine.",
            RuntimeWarning,
            stacklevel=3,
        )
    return call()


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


def attach(engine: Any) -> type | None:
    """Route the forwards of ``engine``'s segments (and, with ``window="root"``, of its model)
    through it. Returns the root's own class (``None`` for manual windows), for
    :func:`detach`."""
    with CLASS_LOCK:  # (not while a probe in another thread reads or swaps these classes)
        return _attach(engine)


def _attach(engine: Any) -> type | None:
    classes = {}
    for name, rt in engine.runtimes.items():  # (all made first: a refusal leaves no swap)
        try:
            classes[name] = _replay_class(rt.orig_class)
        except Exception as exc:  # noqa: BLE001 - a class that forbids subclasses of it
            raise ReplayConfigError(
                f"segment {name!r}: its class {rt.orig_class.__qualname__} cannot be "
                f"subclassed ({type(exc).__name__}: {exc}); lightning_replay routes a "
                "segment's forward through a subclass of the segment's class. Choose its "
                "parent or its children as segments instead."
            ) from None
    root_new = None
    if engine.config.window == "root":
        try:
            root_new = _root_class(type(engine.model))
        except Exception as exc:  # noqa: BLE001 - as above
            raise ReplayConfigError(
                f"the model's class {type(engine.model).__qualname__} cannot be subclassed "
                f"({type(exc).__name__}: {exc}); with window='root' lightning_replay opens a "
                "step's window through a subclass of the model's class. Install with "
                "window='manual' and open each step's window yourself (engine.window())."
            ) from None
    for name, rt in engine.runtimes.items():
        rt.module.__dict__[RUNTIME_KEY] = rt
        rt.module.__class__ = classes[name]
        engine_swapped(rt.module)
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
    engine.model.__class__ = root_new
    engine_swapped(engine.model)
    return root_class


def detach(engine: Any, root_class: type | None) -> None:
    """Undo :func:`attach`: every module gets its own class back (a probe running meanwhile,
    in another thread or around this call, then leaves it: ``OutsideReads``)."""
    with CLASS_LOCK:
        _detach(engine, root_class)


def _detach(engine: Any, root_class: type | None) -> None:
    if root_class is not None:
        if engine.model.__dict__.get(ENGINE_KEY) is engine:
            del engine.model.__dict__[ENGINE_KEY]
        engine.model.__class__ = root_class
        engine_swapped(engine.model)
    for rt in engine.runtimes.values():
        if rt.module.__dict__.get(RUNTIME_KEY) is rt:
            del rt.module.__dict__[RUNTIME_KEY]
        base = getattr(type(rt.module), "_lightning_replay_base", None)
        rt.module.__class__ = base if base is not None else rt.orig_class
        engine_swapped(rt.module)
        become = getattr(rt.module, "cls_to_become", None)
        if become is not None and getattr(become, "_lightning_replay_base", None):
            if "cls_to_become" in rt.module.__dict__:
                del rt.module.__dict__["cls_to_become"]
