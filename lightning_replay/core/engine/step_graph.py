"""Whether a window's graph saw a backward: the training step a window belongs to.

The engine counts a training step (a probe, a calibration phase, a measured real peak) per
window of the root's forward. A train-mode forward with grad on is a window, but not every
such forward is a training step:

- a forward whose output is only logged (``out.mean().item()``) and whose graph is dropped
  without a backward: no replay runs and nothing of a step's backward or optimizer is seen.
  Counted, it took a calibration phase (its warm-up measured a forward alone, and the step
  after it ran a plan fitted with that) and its measurement ran on through the caller's code
  into the next step;
- two forwards whose outputs feed one backward (``(model(a) + model(b)).sum().backward()``):
  one training step. Counted as two, the first one's measurement stopped before its
  backward, and each forward took a calibration phase of its own.

Each window opened by the root's forward hangs a token on the autograd nodes of its outputs
(a pre-hook: it runs when a backward reaches the node; the node holds it, so the token dies
with the graph). As the next window opens, :func:`previous_step` says what became of the
step's graph: a backward reached it (``"trained"``), it is still held with no backward yet
(``"pending"``: this forward belongs to the same step), or it was dropped with none
(``"dropped"``: the window was no training step; the engine gives its calibration phase and
its measurement back). A window whose outputs carry no graph, or one opened by hand
(``engine.window()``), is a step as before (``"unknown"``).

Functions over the engine (``eng``, a
:class:`~lightning_replay.core.engine.engine.ReplayEngine`): its ``_step_graph``, calibration
list and real-peak measurement.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_replay._compat import tree_leaves
from lightning_replay.core.engine.real_peak import stop_truth


class StepGraph:
    """What a step's windows' graphs saw: whether a backward reached any of them, how many of
    their tokens are alive, and what the step's first window took (its calibration phase, the
    measurement it began) so that a step that was none gives them back. Holds no tensor; the
    engine only weakly."""

    __slots__ = ("engine", "watched", "hit", "alive", "phase", "truth", "truth_size", "__weakref__")

    def __init__(self, engine: Any) -> None:
        self.engine = weakref.ref(engine)
        self.watched = False  # a token hangs on an output's node
        self.hit = False  # a backward reached one
        self.alive = 0  # tokens whose graph is still held
        self.phase: str | None = None  # the calibration phase the window took
        # the measurement the window began (CPU), weakly: it holds the model
        self.truth: weakref.ref | None = None
        self.truth_size: int | None = None  # the engine's largest measured input before it

    def reached(self) -> None:
        self.hit = True

    def token_died(self) -> None:
        self.alive -= 1
        if self.alive or self.hit:
            return
        eng = self.engine()
        if eng is not None and eng._step_graph is self and not eng._forward_open:
            # dropped with no backward: the measurement it began ends now, not in the next
            # step (the caller's code between steps is no step's)
            discard_truth(eng, self)


class _Token:
    """A pre-hook on an output's autograd node (the node holds it: it dies with the graph)."""

    __slots__ = ("graph", "__weakref__")

    def __init__(self, graph: StepGraph) -> None:
        self.graph = graph

    def __call__(self, grad_outputs: Any) -> None:
        self.graph.reached()


def watch_outputs(eng: Any, outputs: Any) -> None:
    """As a window's root forward returns: hang a token on each output's autograd node."""
    graph = eng._step_graph
    if graph is None:
        return
    seen: set[int] = set()
    for t in tree_leaves(outputs):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        token = _Token(graph)
        try:
            node.register_prehook(token)
        except (AttributeError, RuntimeError):  # (a node that takes no hooks: not watched)
            continue
        graph.watched = True
        graph.alive += 1
        # (not at interpreter exit: a graph alive then is no step's)
        weakref.finalize(token, graph.token_died).atexit = False


def previous_step(eng: Any) -> str:
    """What became of the step now in hand as another window opens: ``"trained"``,
    ``"pending"``, ``"dropped"`` or ``"unknown"`` (see the module's docstring)."""
    graph = eng._step_graph
    if graph is None or not graph.watched:
        return "unknown"
    if graph.hit:
        return "trained"
    return "pending" if graph.alive else "dropped"


def discard_truth(eng: Any, graph: StepGraph) -> None:
    """End the measurement a window that was no training step began, unkept: a later step
    measures instead."""
    truth = graph.truth() if graph.truth is not None else None
    graph.truth = None
    if truth is None or eng._truth is not truth:
        return
    stop_truth(eng, truth)
    eng._truth_peak = None
    eng._truth_pending = True
    eng._truth_rounds = max(eng._truth_rounds - 1, 0)
    eng._truth_size = graph.truth_size


def give_back(eng: Any, graph: StepGraph) -> None:
    """A window whose graph was dropped with no backward: its measurement is discarded and its
    calibration phase runs again in the next window (a plan it made stays)."""
    discard_truth(eng, graph)
    if graph.phase is not None and graph.phase != "plan":
        eng._calibration.insert(0, graph.phase)
    graph.phase = None
