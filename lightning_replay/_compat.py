"""Every private torch and Lightning access of the package, in one place.

An upgrade that moves one of these breaks here (and in ``tests/test_compat.py``, one test
each), not deep in the engine. Lightning is never imported here: its accessors take the objects
they read, so the core stays free of Lightning.

Example:
    >>> import torch
    >>> t = torch.zeros(2)
    >>> t.add_(1); version(t)
    tensor([1., 1.])
    1
    >>> set_versions([t], [0]); version(t)
    0
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import torch
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401

__all__ = [
    "TorchDispatchMode",
    "accelerator_connector",
    "at_backward_end",
    "checkpoint_frame_forward",
    "checkpoint_frame_recomputing",
    "dict_version",
    "dispatch_modes_on",
    "distributed_is_initialized",
    "graph_task_keeps_graph",
    "hooks_disabled_with",
    "in_reentrant_checkpoint_backward",
    "logger_connector",
    "op_arguments",
    "parametrization_cache",
    "precision_plugin",
    "set_parametrization_caching",
    "set_versions",
    "start_method",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "version",
]


# ------------------------------------------------------------------------------------ torch
def parametrization_cache() -> dict | None:
    """torch's parametrization cache (``{(id(module), name): tensor}``) while a
    ``torch.nn.utils.parametrize.cached()`` context is active, else None (also where torch
    keeps it elsewhere)."""
    if not getattr(parametrize, "_cache_enabled", 0):
        return None
    cache = getattr(parametrize, "_cache", None)
    return cache if isinstance(cache, dict) else None


def set_parametrization_caching(depth: int) -> int:
    """Set how many ``parametrize.cached()`` contexts torch takes as active (0: none, reads
    compute every time); returns the depth before."""
    old = getattr(parametrize, "_cache_enabled", 0)
    parametrize._cache_enabled = depth
    return old


def version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by each in-place write through autograd)."""
    return t._version


def set_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    """Put version counters back (after a replay's own in-place ops on state that is byte for
    byte back as it was)."""
    if tensors:
        torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def under_functorch() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ``jvp``, ...) is
    running: its tensors are wrapped per level, and ``grad``/``vjp`` refuse saved-tensor
    hooks, which checkpoint and the probe need."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def saved_tensors_hooks_disabled() -> bool:
    """Whether ``torch.autograd.graph.disable_saved_tensors_hooks`` is in force (as functorch
    and some libraries enter it): registering a saved-tensor hook then raises, and the probe
    and checkpoint need one. False where torch cannot tell."""
    read = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return read is not None and not read()


_DISABLED = threading.local()  # .messages: this thread's latest disable_saved_tensors_hooks


def _watch_hooks_disable() -> None:
    """Note each message ``torch.autograd.graph.disable_saved_tensors_hooks`` is entered with,
    per thread (the latest few): torch raises that message, and nothing else, when an op
    saves a tensor while hooks are disabled and any are registered (a replay's are), so the
    error alone cannot tell which segment's code switched them off (see
    :func:`hooks_disabled_with`). Wraps torch's switch once per process."""
    ag = torch._C._autograd
    disable = getattr(ag, "_saved_tensors_hooks_disable", None)
    if disable is None or getattr(disable, "_lightning_replay", False):
        return

    def noted(message: str, *args: Any, **kwargs: Any) -> Any:
        seen = getattr(_DISABLED, "messages", None)
        if seen is None:
            seen = _DISABLED.messages = []
        if message not in seen:
            seen.append(message)
            del seen[:-8]
        return disable(message, *args, **kwargs)

    noted._lightning_replay = True  # type: ignore[attr-defined]
    try:
        ag._saved_tensors_hooks_disable = noted
    except (AttributeError, TypeError):  # a build that forbids it: messages go unnamed
        pass


def hooks_disabled_with(message: str) -> bool:
    """Whether code on this thread recently disabled saved-tensor hooks with ``message``."""
    return message in (getattr(_DISABLED, "messages", None) or ())


_watch_hooks_disable()


def dispatch_modes_on() -> bool:
    """Whether a Python dispatch mode (``TorchDispatchMode``) is on: ATen's composite ops
    take other paths under one (their tensor-subclass-safe paths: ``ctc_loss`` with tensor
    lengths saves the lengths for backward then)."""
    return torch._C._len_torch_dispatch_stack() > 0


def graph_task_keeps_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``, or
    ``create_graph=True``, which implies it): a later backward can differentiate the same
    forward again. True where it cannot be told (no backward running, or torch moved it): the
    caller then keeps what a second backward would need."""
    if torch._C._current_graph_task_id() == -1:
        return True
    read = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if read is None else bool(read())


def in_reentrant_checkpoint_backward(depth: int = 64) -> bool:
    """Whether a reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``) is recomputing
    its function now: its ``CheckpointFunction.backward`` is on the Python stack (within
    ``depth`` frames). Asked only while a backward runs: any other custom Function's backward
    that calls a module (a reversible block re-running its F and G) is not a checkpoint."""
    import sys

    from torch.utils import checkpoint as _ckpt

    fn = getattr(getattr(_ckpt, "CheckpointFunction", None), "backward", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost active saved-tensor hooks (pack, unpack), or None: what
    ``torch.utils.checkpoint`` itself uses to find them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# the code of a checkpoint pack hook and a cell name -> that cell's index in its closure
_CELLS: dict[tuple[Any, str], int | None] = {}


def _pack_hook_cell(name: str) -> Any | None:
    """The contents of the cell ``name`` of the innermost saved-tensor pack hook's closure
    (torch.utils.checkpoint's hooks close over their frame), or None. The cell's index is
    found once per hook code: replays ask at every call."""
    hooks = top_saved_tensors_hooks()
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])  # a recomputation hook is under dynamo's disable
    code = getattr(pack, "__code__", None)
    i = _CELLS.get((code, name), -1)
    if i == -1:
        names = getattr(code, "co_freevars", ())
        i = _CELLS[code, name] = names.index(name) if name in names else None
    if i is None:
        return None
    try:
        return pack.__closure__[i].cell_contents
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def checkpoint_frame_recomputing() -> Any | None:
    """The frame of the ``torch.utils.checkpoint`` (non-reentrant) call whose recomputation is
    running now, or None (not called from inside a recomputation, or torch's internals moved).

    Its ``check_recomputed_tensors_match(gid)`` is what refuses a recomputation that saved other
    tensors than the forward did, right after the recomputation returns: the one check of
    checkpoint's that runs outside the recomputation's own context."""
    ref = _pack_hook_cell("target_frame_ref")
    frame = ref() if callable(ref) else None
    return frame if callable(getattr(frame, "check_recomputed_tensors_match", None)) else None


def checkpoint_frame_forward() -> Any | None:
    """The frame of the ``torch.utils.checkpoint`` (non-reentrant) call whose forward is
    running now (its pack hook is the innermost saved-tensor hook), or None: its
    ``weak_holders`` (one per saved tensor) and ``recompute_fn``."""
    frame = _pack_hook_cell("frame")
    ok = isinstance(getattr(frame, "weak_holders", None), list) and callable(
        getattr(frame, "recompute_fn", None)
    )
    return frame if ok else None


def _dict_version() -> Callable[[dict], int] | None:
    """torch dynamo's reader of a dict's version tag (PEP 509), if this interpreter has one
    that moves with every way a slot can be rebound; else None (callers compare identities).

    A version tag is taken from one global counter at each creation and each change of any
    dict, so an equal tag means the same dict unchanged: no key added, removed or bound to
    another object. The tag is CPython's private field (gone in 3.14), hence the test here of
    every path that writes an instance's attributes, also the interpreter's specialized ones."""
    try:
        from torch._C._dynamo.guards import dict_version as read
    except ImportError:
        return None

    class _Probe:
        pass

    def moves(d: dict, write: Callable[[], Any]) -> bool:
        before = read(d)
        write()
        return read(d) != before

    try:
        d: dict = {"a": object()}
        o = _Probe()
        od = o.__dict__  # materialized, as every module's is
        ok = (
            moves(d, lambda: d.__setitem__("a", object()))
            and moves(d, lambda: d.__setitem__("b", 1))
            and moves(d, lambda: d.pop("b"))
            and moves(d, lambda: d.update(c=object()))
            and moves(d, lambda: d.setdefault("e", 2))
            and moves(d, lambda: d.__delitem__("c"))
            and moves(d, d.popitem)
            and moves(d, d.clear)
            and not moves(d, lambda: d.get("a"))
            and moves(od, lambda: object.__setattr__(o, "x", object()))
            and moves(od, lambda: setattr(o, "x", object()))
            and moves(od, lambda: delattr(o, "x"))
        )
        wide = _Probe()
        for i in range(48):  # an object with many attributes: a specialization of its own
            setattr(wide, f"a{i}", i)
        wd = wide.__dict__
        for i in range(64):  # long enough for the interpreter to specialize the stores
            before, wide_before = read(od), read(wd)
            o.y = object()
            wide.a7 = object()
            ok = ok and read(od) != before and read(wd) != wide_before
    except Exception:  # noqa: BLE001 - any surprise: no fast path, identities instead
        return None
    return read if ok else None


#: ``dict_version(d)``: the version tag of ``d`` (see :func:`_dict_version`), or None where
#: this interpreter has none that can be trusted
dict_version: Callable[[dict], int] | None = _dict_version()


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward now running ends (call it from inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def op_arguments(func: Any) -> list[Any]:
    """The schema arguments of an aten op overload (``alias_info``, ``name``,
    ``default_value``)."""
    return func._schema.arguments


# -------------------------------------------------------------------------------- Lightning
def distributed_is_initialized() -> bool:
    """Whether a default process group exists (what Lightning's private helper checks)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def accelerator_connector(trainer: Any) -> Any:
    return trainer._accelerator_connector


def logger_connector(trainer: Any) -> Any:
    return trainer._logger_connector


def precision_plugin(strategy: Any) -> Any:
    return strategy._precision_plugin


def start_method(strategy: Any) -> str:
    return strategy._start_method
