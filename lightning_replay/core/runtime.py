"""The per-segment runtime: called in place of a segment's forward.

Its dispatch is the contract's lifecycle, one path: guards at every forward (re-probe when a
precondition changed) -> probe (:mod:`~lightning_replay.probe`) -> contract -> steady replays
under checkpoint with the entry state preserved (:mod:`~lightning_replay.restore`) -> sampled
checks and their reaction (:mod:`~lightning_replay.checks`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import types
import warnings
import weakref
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from lightning_replay._compat import (
    checkpoint_frame_forward,
    checkpoint_frame_recomputing,
    dispatch_modes_on,
    hooks_disabled_with,
    in_reentrant_checkpoint_backward,
    tree_leaves,
    saved_tensors_hooks_disabled,
    under_functorch,
)
from lightning_replay.core.mechanisms import backend_flags, param_cache
from lightning_replay.core.mechanisms.accounting import checkpoint_rng_bytes
from lightning_replay.core.mechanisms.arguments import (
    flatten_call,
    passed_generators,
    forward_attributes,
    state_attributes,
    tensor_attributes,
    unflatten_call,
    with_attributes,
)
from lightning_replay.core.mechanisms.grad_reads import capture_grads, forward_grads
from lightning_replay.core.replay.checks import SegmentChecks
from lightning_replay.core.base.contract import SELECTIVE, ReplayContract
from lightning_replay.core.base.clock import clock
from lightning_replay.core.base.nesting import segments_running
from lightning_replay.core.base.ports import CheckHost, CostSource, ProbeHost, ReplayHost
from lightning_replay.core.mechanisms.costs import saved_tensor_overhead
from lightning_replay.errors import ContractViolation, ReplayConfigError, ReplayError
from lightning_replay.core.mechanisms.guards import OUTSIDE, Guard
from lightning_replay.core.mechanisms.host_rng import as_host_rng
from lightning_replay.core.replay.probe import SegmentProbe, _Probe
from lightning_replay.core.replay.restore import (
    _Bound,
    _Invocation,
    _ReplayContext,
    user_saved_hooks,
)
from lightning_replay.core.mechanisms.selective import SelectiveFrame, replaying
from lightning_replay.core.mechanisms.slots import capture_generators
from lightning_replay.core.base.state import byte_span, storage_key, strided_copy
from lightning_replay.core.base.state import unique_bytes as _unique_bytes

#: calls of every segment's forward, in order: where each segment was last called
_CALL_SEQ = itertools.count()


class RuntimeHost(ReplayHost, ProbeHost, CheckHost, CostSource, Protocol):
    """The engine as a segment's runtime sees it: what restore, the probe and the checks use
    (:class:`~lightning_replay.core.base.ports.ReplayHost`,
    :class:`~lightning_replay.core.base.ports.ProbeHost`,
    :class:`~lightning_replay.core.base.ports.CheckHost`: the runtime hands its engine to them),
    and the window and calibration controls the runtime's dispatch reads. :class:`~lightning_replay.engine.ReplayEngine` is
    one; the runtime never names it (it is the layer above)."""

    budget: int | None
    _suspended: bool
    _window_depth: int
    _check_grad: bool
    _checked: Any
    _checked_ran: set[str]
    _warmup: bool

    def _next_order(self) -> int: ...

    def _implicit_window(self) -> Any: ...

    def _capture_if_open(self) -> None: ...

    def _tagged(self, name: str) -> Any: ...

    def _capture_sampling(self) -> bool: ...

    def _capture_sample(self, rt: Any) -> Any: ...


#: :meth:`SegmentRuntime.idle_reason`: never called in the model's forward (a spare module, a
#: misnamed segment), or called only without autograd (under ``torch.no_grad``, with nothing
#: requiring grad, or inside a backward): nothing to replay, it runs plain
NOT_CALLED = "not called"
PLAIN = "plain"
#: windows after which a segment whose siblings ran, never called itself, is named
SKIPPED_WINDOWS = 32


def idle_message(rt: "SegmentRuntime") -> str:
    """Why ``rt`` does not replay, for a warning or an error."""
    if rt.idle_reason() == NOT_CALLED:
        windows = "window" if rt.engine.step == 1 else f"{rt.engine.step} windows"
        return (
            f"segment {rt.name!r} was never called in the model's forward in the first "
            f"{windows}: it cannot replay (a spare module, or a segment named by mistake). "
            "The other segments are planned and checked without it; remove it from "
            "`segments`, or, for a module the forward calls only sometimes, install with "
            "on_violation='record' to be warned instead of stopped"
        )
    where = []
    if rt.backward_calls:
        where.append("inside a backward (a custom autograd.Function re-running it)")
    where.append(
        "without autograd (under torch.no_grad, or with no parameter or argument requiring grad)"
    )
    return (
        f"segment {rt.name!r} has run only {' or '.join(where)} in the first "
        f"{rt.engine.step} windows: it records nothing for backward, so there is nothing to "
        "replay and it runs plain, as in plain PyTorch. The other segments are planned without "
        "it; should it run with autograd later, it is probed then"
    )


def _transform_inside(name: str) -> ReplayConfigError:
    return ReplayConfigError(
        f"segment {name!r} runs a torch.func transform (grad, vjp, jacrev, hessian) inside its "
        "forward, and torch.func refuses the saved-tensor hooks that a replay needs (so does "
        "torch.utils.checkpoint): the segment cannot be replayed. Leave it out of the "
        "segments: it keeps its activations (segments called inside a transform run plain)."
    )


def _hooks_disabled_inside(name: str, message: str) -> ReplayConfigError:
    return ReplayConfigError(
        f"segment {name!r} switches saved-tensor hooks off inside its forward "
        f"(torch.autograd.graph.disable_saved_tensors_hooks, whose message torch raised: "
        f"{message!r}) while an op there saves a tensor for backward. A replay needs those "
        "hooks on every op it covers (so does torch.utils.checkpoint): the segment cannot be "
        "replayed. Leave it out of the segments (it keeps its activations), or choose "
        "segments inside it that run outside that block."
    )


def _checkpointed_around(name: str) -> ReplayConfigError:
    """The error for a segment called inside another recomputation: within the forward of a
    ``torch.utils.checkpoint`` call (its saved-tensor hooks innermost) or while a backward
    runs (a reentrant checkpoint recomputing its function)."""
    return ReplayConfigError(
        f"segment {name!r} runs inside torch.utils.checkpoint: the model checkpoints its own "
        "blocks (Hugging Face activation_checkpointing_enable(), timm set_grad_checkpointing(), "
        "torch's checkpoint_wrapper, or a checkpoint() call around the segment). "
        "lightning_replay recomputes its segments itself, with their state exact, and one "
        "recomputation cannot run inside another. Turn the model's own checkpointing off "
        "(model.activation_checkpointing_disable() for Hugging Face models, "
        "gradient_checkpointing_disable() before transformers 5, "
        "model.set_grad_checkpointing(False) for timm ones), or choose segments outside the "
        "checkpointed modules."
    )


class SegmentRuntime:
    """Per-segment state: its contract, mode and counters. Called in place of its forward.

    It composes its probe (:class:`~lightning_replay.core.replay.probe.SegmentProbe`, which makes
    the contract) and its checks (:class:`~lightning_replay.core.replay.checks.SegmentChecks`),
    each over a narrow port of it and of the engine (core/base/ports.py), and dispatches each
    call to one of them or to a replay (restore's invocation and replay context)."""

    def __init__(
        self, engine: "RuntimeHost", name: str, module: nn.Module, preservation: str
    ) -> None:
        self.engine = engine
        self.name = name
        self._module: nn.Module | None = module  # weak after release (see the property)
        self._module_ref = weakref.ref(module)
        self.orig_class = type(module)
        self.orig_forward = functools.partial(self.orig_class.forward, module)
        self.modules = list(module.modules())
        self._calls_script: bool | None = None  # its forwards call a TorchScript function
        self.module_names = {
            id(m): (f"{name}.{n}" if n else name) for n, m in module.named_modules()
        }
        self.guard = Guard(self.modules, name)
        self.outside: list[tuple[nn.Module, str]] = []  # plain attributes read from outside
        self.preservation = preservation
        self.contract: ReplayContract | None = None
        self.grad_reads: list = []  # weak references: tensors whose .grad its forwards read
        self.status = "probe"  # probe | probing | active | retain
        self.demoted = False  # retained for good after a second divergence
        self.retained_probe = False  # a replayed probe diverged: probe retained from now on
        self.version = 0
        self.bound: list[_Bound] = []
        self.generators: list[tuple[str, torch.Generator]] = []
        self.probes: list[_Probe] = []
        self.forwards = 0
        self.calls = 0  # every call of its forward, with autograd or not
        # the most forwards (with autograd) one window made of it, and this window's so far
        self.window_calls = 1
        self._window_step, self._window_forwards = -1, 0
        # the forwards of the last CALL_WINDOWS windows that called it: ``window_calls``
        # follows them (a count that fell stays charged until that many windows show it)
        self._recent_calls: collections.deque = collections.deque(maxlen=CALL_WINDOWS)
        self._shared_seen: tuple[int, dict] = (-1, {})  # (window, read-only copies used)
        self.last_call = -1
        self.backward_calls = 0  # ... of them made while a backward ran (see __call__)
        self.replays = 0
        self.violations = 0
        self.checks = 0
        self.divergences = 0
        self.reprobes = 0
        self._reprobe_streak = (0, -1)  # (re-probes in a row, the forward of the last)
        self.reactions = 0
        # (op, call) pairs of a selective forward found written after their op: not kept
        self.sac_skip: set[tuple[str, int]] = set()
        # flops per byte of activations of the last selective forward (policy "flops")
        self.sac_density: float | None = None
        # elements of the step's inputs when the contract (its A(s)) was made: 0 not known
        self.contract_size = 0
        self.last_preserved_bytes = 0
        self.order = -1
        self.planned_option: str | None = None
        self.input_bytes = 0
        self.input_saved_bytes = 0
        self.state_keys: set = set()  # storages the probe saw as state (not activations)
        self._entry_plan: tuple | None = None  # restore._entry_plan's cache
        # what it composes: the probe and the checks, each over its port of this runtime
        self.segment_probe = SegmentProbe(self, engine, engine.records)
        self.segment_checks = SegmentChecks(
            self, engine, engine.records, functools.partial(_timed_clock, engine)
        )
        if engine.measure_costs:
            saved_tensor_overhead()  # measured once per process, outside any step

    @property
    def module(self) -> nn.Module | None:
        """The segment's module; after :meth:`release`, only while something else holds it."""
        return self._module if self._module is not None else self._module_ref()

    def release(self) -> None:
        """Drop every reference to the model's modules and tensors (the engine's uninstall):
        probes and what they saw, the bound state, the guard's view of the modules, the
        generators, the outside attributes. The contract (names, shapes, versions) and the
        counters stay for the records and the summary. Pending replays keep what they took
        at their forward (restore._Invocation)."""
        for p in self.probes:
            p.mode.release()  # (its region-log arms: the log is cleared with the engine's)
            p.release()
        self.probes = []
        self._module = None
        self.orig_forward = None
        self.modules = []
        self.module_names = {}
        self.guard = Guard([])
        self.bound = []
        self.generators = []
        self.outside = []
        self.grad_reads = []
        self._entry_plan = None

    # ---------------------------------------------------------------- what others call
    def set_option(self, option: str) -> None:
        """Apply a planned option to the current contract (and to future re-probes): the
        engine's plan (:meth:`SegmentProbe.set_option`)."""
        self.segment_probe.set_option(option)

    def finish_stale_probes(self) -> None:
        """Conclude probes whose graph is gone without a backward
        (:meth:`SegmentProbe.finish_stale_probes`)."""
        self.segment_probe.finish_stale_probes()

    def _observe(self, probe: _Probe) -> None:
        """The window of ``probe`` ends (a replayed probe's replay, probe_replay.py)."""
        self.segment_probe._observe(probe)

    def _check_state_digests(self, inv: _Invocation) -> None:
        """The byte check of the contract state at a replay (restore's replay context)."""
        self.segment_checks._check_state_digests(inv)

    def _derive(self) -> None:
        """Cached lookups the per-step path uses (after the contract or its option changed)."""
        c = self.contract
        self.last_preserved_bytes = c.preserved_bytes() if c else 0

    # ---------------------------------------------------------------- dispatch
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        self.calls += 1
        if (
            not torch.is_grad_enabled()
            or eng._suspended
            or segments_running()  # (this engine's, or another engine's segment)
            or under_functorch()
            or not (self.module.training or _needs_grad(self.module, args, kwargs))
        ):
            # A segment called inside another segment's forward or replay is part of it: the
            # outer segment's contract covers its state and the outer replay re-runs it.
            # Under a torch.func transform (per-sample gradients: vmap(grad(functional_call)))
            # the segment runs plain: the transform differentiates its own graph, and refuses
            # the saved-tensor hooks a replay needs.
            return self.orig_forward(*args, **kwargs)
        if saved_tensors_hooks_disabled():
            # Saved-tensor hooks are switched off around this call: neither the probe nor
            # checkpoint can run. The segment runs plain (exact, keeps its activations).
            if not getattr(eng, "_warned_hooks_off", False):  # once per engine
                eng._warned_hooks_off = True
                warnings.warn(
                    f"segment {self.name!r} (and every segment called there) runs without "
                    "replay, keeping its activations: "
                    "it is called under torch.autograd.graph.disable_saved_tensors_hooks, "
                    "which forbids the saved-tensor hooks a replay needs. Call the model "
                    "outside that context to save its memory.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return self.orig_forward(*args, **kwargs)
        if checkpoint_frame_forward() is not None:
            raise _checkpointed_around(self.name)
        if torch._C._current_graph_task_id() != -1:
            # Called while a backward runs: a reentrant checkpoint recomputing the model's
            # own blocks is refused (one recomputation cannot run inside another); any other
            # caller (a reversible block's custom Function re-running F and G in its backward,
            # a hook) differentiates this call at once, within that backward: it runs plain,
            # as in plain PyTorch, and has no activations to drop.
            if in_reentrant_checkpoint_backward() or checkpoint_frame_recomputing() is not None:
                raise _checkpointed_around(self.name)
            self.backward_calls += 1
            return self.orig_forward(*args, **kwargs)
        self.forwards += 1
        if self._window_step != eng.step:  # calls per window: the costs charge each (issue 31)
            if self._window_step >= 0:
                self._recent_calls.append(self._window_forwards)
            self._window_step, self._window_forwards = eng.step, 0
            self.window_calls = max(self._recent_calls, default=1)
        self._window_forwards += 1
        if self._window_forwards > self.window_calls:
            self.window_calls = self._window_forwards
        self.last_call = next(_CALL_SEQ)  # (the costs' order: a segment at its last call)
        if self.order < 0:
            self.order = eng._next_order()
        if self.status in ("active", "retain") and not self.demoted:
            changed = self.guard.changed()
            if changed:
                self._reprobe(changed)
        try:
            return self._hooked_call(args, kwargs)
        except RuntimeError as err:
            if isinstance(err, ReplayError):
                raise
            message = str(err)
            if message.startswith("torch.func.") and "support saved tensor hooks" in message:
                raise _transform_inside(self.name) from err  # (functorch's own message)
            if hooks_disabled_with(message):
                raise _hooks_disabled_inside(self.name, message) from err
            raise

    def _hooked_call(self, args: tuple, kwargs: dict) -> Any:
        """The call under the engine's saved-tensor hooks: probed, retained, checked or
        replayed, by the segment's status and option."""
        eng = self.engine
        if (
            eng._window_depth
            and eng.accountant is None
            and self.status == "active"
            and not eng._check_grad
        ):
            return self._replay_call(args, kwargs)  # the steady-state fast path
        with eng._implicit_window(), eng._tagged(self.name):
            if self.status in ("probe", "probing"):
                if self._probe_replays():
                    return self.segment_probe._replayed_probe_call(args, kwargs)
                return self.segment_probe._probe_call(args, kwargs)
            option = self.contract.option if self.contract else "retain"
            if option == "retain" or self.status == "retain":
                if eng._check_grad and eng.measure_costs and self.contract is not None:
                    return self.segment_checks._measured_call(args, kwargs)
                return self._plain_call(args, kwargs)
            if eng._check_grad and self.name in eng._checked and not self.contract.written_inputs:
                eng._checked_ran.add(self.name)
                return self.segment_checks._checked_call(args, kwargs)
            return self._replay_call(args, kwargs)

    def _probe_replays(self) -> bool:
        """Whether this probe keeps no activations: under a memory budget (bytes, or ``"min"``
        for the lowest-memory plan) a probe step that kept every segment's activations would
        peak above a plain step. A segment pinned to
        ``retain``, demoted, or whose replayed probe diverged is probed retained, and so is
        every probe of a derivative-checked step (its reference keeps the graphs anyway), and
        of a segment whose code names a TorchScript function (its replay may run another
        compiled graph than its forward: probe.SegmentProbe._keep_for_script), or that runs
        under a user's saved-tensor hook with state of its own (seen rebound only where the hook
        packs in the forward: probe.SegmentProbe._keep_for_hook)."""
        eng = self.engine
        if getattr(self, "_calls_script", None) is None:
            self._calls_script = _calls_script_function(self.modules)
        return (
            (eng.budget is not None or eng.config.budget.min)
            and not self._calls_script
            and not self.segment_probe._user_hooks_have_state()
            and not self.retained_probe
            and not self.demoted
            and self.preservation != "retain"
            and not eng._check_grad
        )

    def _plain_call(self, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        eng._segment_depth += 1
        try:
            return self.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1

    def _reprobe(self, changed: list) -> None:
        """A precondition of the contract changed: probe this forward and extend the contract."""
        names = [self._field_name(k) for k in changed]
        self.status = "probe"
        self.reprobes += 1
        eng = self.engine
        self._warn_if_never_replays(names)
        eng.records.append(
            step=eng.step + (0 if eng._window_depth else 1),
            segment=self.name,
            contract_version=self.contract.version if self.contract else 0,
            check="guard",
            outcome="rejection",
            detail={"changed": names[:16], "action": "re-probe"},
        )
        eng._contracts_changed()
        # the window's forward may have begun without a capture (a plan that logs nothing):
        # the re-probe's state written later in it (by the root, after this segment) must
        # be logged, as a probe under a byte budget keeps only a digest of big state
        eng._capture_if_open()

    def _warn_if_never_replays(self, names: list[str]) -> None:
        """A precondition that changes at every forward (state rebuilt each step) keeps the
        segment re-probed, retained, for good: exact, but the memory it was installed to
        save is never saved. Said once, by name, with what changed (issue 33, class 11)."""
        n, last = self._reprobe_streak
        n = n + 1 if last == self.forwards - 1 else 1
        self._reprobe_streak = (n, self.forwards)
        if n != REPROBES_BEFORE_WARNING:
            return
        eng = self.engine
        eng.records.append(
            step=eng.step + (0 if eng._window_depth else 1),
            segment=self.name,
            contract_version=self.contract.version if self.contract else 0,
            check="guard",
            outcome="rejection",
            detail={
                "changed": names[:16],
                "action": "re-probed at every forward",
                "reprobes_in_a_row": n,
            },
        )
        warnings.warn(
            f"segment {self.name!r} was re-probed on {n} forwards in a row and has not "
            "replayed since (it keeps its activations: exact, but saves no memory): "
            f"{', '.join(names[:4])} changed at each. State rebuilt every step (a new "
            "submodule with parameters or buffers, a tensor rebound) is new state to the "
            "contract; build it once and update it in place, or leave the segment out.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _field_name(self, key: Any) -> str:
        if not isinstance(key, tuple):
            return str(key)
        if key[0] == OUTSIDE:  # read from outside the segment: named in the model already
            return key[2]
        mod = self.module_names.get(id(self.modules[key[0]]), self.name)
        return f"{mod}.{key[1] if len(key) == 2 else key[2]}"

    # ---------------------------------------------------------------- steady state
    def _prepare(self, args: tuple, kwargs: dict, check_bytes: bool, live: bool = False):
        """Take the invocation's entry state; returns it with the call's flattened arguments
        as checkpoint gets them and their tree spec. ``live``: the replay may read a changed
        argument from its live storage where the contract puts that storage back in place
        (see :func:`_restored_in_place`); else it reads a copy of the forward bytes."""
        eng = self.engine
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        t0 = clock(eng._cuda)
        inv = _Invocation(self, check_bytes)
        if inv.shared and eng.measure_costs:
            self._measure_shared(inv)
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            flat, spec = list(args), None  # the common call: tensors only, nothing to flatten
        else:
            # tensors inside argument objects (a dataclass batch) too: see arguments.py
            flat, spec = flatten_call(args, kwargs)
            # a generator passed in (torch's, or one outside torch): its state at this call,
            # put back for the replay (a generator made per step and passed to the segments
            # is no object the probe could have seen: the replay drew where the step's later
            # draws left it, wrong gradients with no record)
            held = {id(getattr(g, "obj", g)) for g, _ in inv.gens}
            passed = [
                x if isinstance(x, torch.Generator) else as_host_rng(x)
                for x in passed_generators(flat)
                if id(x) not in held
            ]
            if passed:
                states = capture_generators(passed)  # (each object once: passed_generators)
                inv.gens = inv.gens + states
                inv.preserved_bytes += sum(
                    t.untyped_storage().nbytes() for _, t in states if isinstance(t, torch.Tensor)
                )
        # Python attributes on argument tensors (``x.gain``), shallow-copied as the contract
        # copies module attributes: the replay reads them as the forward did
        inv.tensor_attrs = tensor_attributes(flat)
        inv.state_attrs = state_attributes(self.modules)  # (self.q.ptr, weight.mult)
        # a gradient the forward read (backward sets it before the replay): as at the forward
        inv.grads = capture_grads(self.grad_reads) if self.grad_reads else []
        inv.backends = backend_flags.capture()  # sdpa_kernel, mkldnn.flags around the forward
        written = self.contract.changed_inputs
        changing = _aliased_changing(flat, inv.changing) if inv.changing else None
        if written or changing:
            # An argument whose bytes the window changes (the segment writes it in place, the
            # step writes it after the segment, or it is a view of changing state) reaches
            # checkpoint as a copy of its forward bytes, which the replay computes from; the
            # forward itself runs on the live tensor, so its in-place writes are seen as in
            # plain PyTorch. Where its storage is state the contract puts back in place for
            # the replay (whole, or the regions written: a model's buffer passed as an
            # argument), the replay reads the live storage instead, and checkpoint keeps an
            # empty stand-in: no copy of the whole argument is held (issue 31).
            in_place = _restored_in_place(inv, eng) if live else None
            j = -1
            with torch.no_grad():
                for i, x in enumerate(flat):
                    if not isinstance(x, torch.Tensor):
                        continue
                    j += 1
                    if j in written or (changing and storage_key(x) in changing):
                        if (
                            in_place
                            and not x.requires_grad
                            and _inside(x, in_place.get(x.untyped_storage()._cdata, False))
                        ):
                            inv.subs[i] = (x, None)  # (the live tensor at the replay too)
                            continue
                        snap = strided_copy(x)  # as laid out at the forward (its strides)
                        inv.subs[i] = (x, snap)
                        inv.preserved_bytes += snap.untyped_storage().nbytes()
                        eng._held_bytes += snap.untyped_storage().nbytes()
            inv.kept = inv.kept or bool(inv.subs)
        call = (
            [_stand_in(inv.subs[i]) if i in inv.subs else x for i, x in enumerate(flat)]
            if inv.subs
            else flat
        )
        acct = eng.accountant
        if acct is not None or eng.measure_costs:
            leaves = [x for x in call if isinstance(x, torch.Tensor)]
            # the generator states checkpoint keeps for this call (preserve_rng_state=True)
            rng = checkpoint_rng_bytes(leaves, "cuda" if eng._cuda else "cpu")
            if eng.measure_costs:
                eng.meter.input_bytes[self.name] = _unique_bytes(leaves)
                eng.meter.input_size[self.name] = eng._window_size
                eng.meter.rng_bytes[self.name] = rng
            if acct is not None:
                for t in leaves:
                    key = acct.hold_tensor(t, self.name)
                    if key is not None:
                        inv.held.append(key)
                if rng:
                    acct.hold(("rng", id(inv)), rng, self.name)
                    inv.held.append(("rng", id(inv)))
        inv.watch()
        if eng._sync:
            torch.cuda.synchronize(eng._cuda_device)
        inv.t_prep = clock(eng._cuda) - t0
        return inv, call, spec

    def _measure_shared(self, inv: _Invocation) -> None:
        """The whole copies of read-only state this window's calls of the segment used, by
        copy (one serves every call that reads the same bytes): the most over the measured
        windows is what the costs charge once per window (CostMeter.held_bytes)."""
        eng = self.engine
        step, seen = self._shared_seen
        if step != eng.step:
            seen = {}
            self._shared_seen = (eng.step, seen)
        for sw, _ in inv.shared:
            seen[id(sw)] = sw.nbytes
        total = sum(seen.values())
        if total > eng.meter.shared_bytes.get(self.name, 0):
            eng.meter.shared_bytes[self.name] = total

    def _replay_call(self, args: tuple, kwargs: dict) -> Any:
        inv, call, spec = self._prepare(args, kwargs, self.engine._check_bytes, live=True)
        eng = self.engine
        forward = self.orig_forward
        # While costs are measured (calibration, or always when asked), checkpoint's own work
        # around this call is timed in place too: its frame around the forward here, and in
        # backward its work before and after the replay context (restore._ReplayContext).
        timed = eng.measure_costs and (eng._sync or not eng._cuda)
        # A selective option keeps the outputs of the ops its policy names: torch's selective
        # checkpoint modes run around the segment's own forward and, at backward, around its
        # replay inside the contract's replay context, so the ops that run again see the entry
        # state the contract swapped in (the engine's own work around them is not cached).
        sac = self.selective_frame(verify=eng._check_bytes) if inv.option in SELECTIVE else None
        if sac is None and self._measures_kept():
            # an untimed warm-up step of a full replay measures what a selective forward
            # would keep, so that the calibration of the selective options is fitted to the
            # budget with it (the frame is dropped after the forward: the replay is a full one)
            sac = self.selective_frame()
            sac_full = True
        else:
            sac_full = False
        inner = [0.0, None]  # the forward's own seconds, checkpoint's frame

        def replay(flat: Any) -> Any:
            # the call as at the forward: argument objects rebuilt with their fields then
            a, kw = (flat, {}) if spec is None else unflatten_call(list(flat), spec)
            # the kept outputs stand in for their ops; not in a replay run while the forward
            # itself still runs (its own autograd.grad reaching what it saved so far: the
            # frame is still keeping, and its replay mode would consume and release that)
            if sac is not None and not sac_full and not inv.in_forward:
                try:
                    with sac.recompute:
                        return forward(*a, **kw)
                finally:  # (checkpoint's early stop leaves by an exception)
                    if sac.events:  # kept outputs it could not use (see checks.py)
                        self.segment_checks._kept_events(inv, sac.events, checked=False)
            # (not a selective forward's own ops, if one runs around it; ATen's paths as at
            # the forward, which may have run under a dispatch mode)
            with replaying(), backend_flags.dispatching_as(inv.moded):
                return forward(*a, **kw)

        def fn(*flat: Any) -> Any:
            if inv.subs:
                flat = list(flat)
                for i, (live, snap) in inv.subs.items():
                    if inv.replaying and snap is not None:  # a fresh copy of the forward bytes
                        flat[i] = _replay_input(flat[i], live.requires_grad)
                    else:
                        flat[i] = live
            if inv.replaying:
                with (
                    backend_flags.entered(inv.backends),
                    forward_attributes(flat, inv.tensor_attrs),
                    with_attributes(inv.state_attrs),
                    forward_grads(inv.grads),
                ):
                    return replay(flat)
            a, kw = (flat, {}) if spec is None else (args, kwargs)  # the live objects
            eng._segment_depth += 1
            # a calibration step may run this forward under a capture mode of its own, to
            # measure what the mode costs per op in place (see CostMeter.capture_time)
            sampling = timed and eng._capture_sampling()
            sample = eng._capture_sample(self) if sampling else None
            if timed:
                inner[1] = checkpoint_frame_forward()
                t_in = _timed_clock(eng)
            inv.in_forward = True
            cached = param_cache.forward_start()
            try:
                with (
                    sac.forward if sac is not None else contextlib.nullcontext(),
                    sac.watch_saved()
                    if sac is not None and eng.measure_costs
                    else contextlib.nullcontext(),
                ):
                    if sample is None:
                        inv.moded = dispatch_modes_on()
                        out = forward(*a, **kw)
                    else:
                        with sample:
                            inv.moded = True
                            out = forward(*a, **kw)
                if sac is not None:
                    sac.watch_outputs(out)
            finally:
                inv.in_forward = False
                eng._segment_depth -= 1
                inv.param_cache = param_cache.forward_end(cached)
            if timed:
                inner[0] = _timed_clock(eng) - t_in
                if sampling:
                    eng.meter.add_forward_time(self.name, inner[0], sample)
                if not sample and not eng._warmup:
                    # what a selective forward's caching mode adds is in the forward's own
                    # time, which no option is charged: kept per option to charge the difference
                    eng.meter.add_option_forward(self.name, inv.option, inner[0])
            if inv.shared:  # a shared whole copy this forward wrote is not exchanged at replay
                inv.shared_writes = [t._version != sw.version for sw, t in inv.shared]
            return out

        # The user's saved-tensor hooks around the step apply to what the replay saves, as
        # plain training applies them to what the forward saves (restore._through_user_hooks)
        user = user_saved_hooks(eng)
        context_fn = _full_replay(inv, user)
        # ... but not to the inputs checkpoint saves for its replay: the replay starts from
        # the forward's arguments, not from what the user's hooks make of them (a bf16
        # rounding). In plain training no hook sees them as such.
        plain_inputs = (
            torch.autograd.graph.saved_tensors_hooks(_same, _same)
            if user is not None
            else contextlib.nullcontext()
        )
        # The global RNG is always preserved (torch's default): a segment may draw from it
        # only later (a dropout warming up from p=0, or put in train mode after the probe).
        if getattr(self, "_calls_script", None) is None:
            self._calls_script = _calls_script_function(self.modules)
        if self._calls_script or (self.contract is not None and self.contract.full_replay):
            # checkpoint's early stop raises from its pack hook; inside a scripted function
            # the TorchScript interpreter rewraps that exception and the replay fails; and an
            # op that writes an argument autograd saved first (F.rrelu's noise) would be
            # stopped before it writes it: the replay of such a segment runs to its end
            plain_inputs = _stacked(plain_inputs, set_checkpoint_early_stop(False))
        if not timed:
            with plain_inputs, _released_if_raised(inv, sac):
                out = checkpoint(
                    fn, *call, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
                )
            if sac is not None:
                self.settle_frame(sac)
                if eng.accountant is not None or eng.measure_costs:
                    self._charge_kept(inv, sac, held=not sac_full)
            return out
        t0 = _timed_clock(eng)
        with plain_inputs, _released_if_raised(inv, sac):
            out = checkpoint(
                fn, *call, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
            )
        inv.t_prep += _timed_clock(eng) - t0 - inner[0]
        if sac is not None:
            self.settle_frame(sac)
            self._charge_kept(inv, sac, held=not sac_full)
        frame, inner[1] = inner[1], None  # (fn, which the frame keeps, must not keep it)
        if frame is not None:
            # per saved tensor: its pack hook now and its unpack hook in backward, which no
            # timing point of the call sees (measured once on this machine)
            inv.t_prep += len(frame.weak_holders) * saved_tensor_overhead()
            recompute = frame.recompute_fn

            def stamped(*a: Any) -> Any:  # backward reached this call: checkpoint's work begins
                inv.t_unpack = _timed_clock(eng)
                return recompute(*a)

            frame.recompute_fn = stamped
        return out

    def selective_frame(self, verify: bool = False) -> SelectiveFrame:
        """A frame for one selective forward of this segment, under the engine's policy."""
        return SelectiveFrame(
            self.engine.config.selective_policy,
            verify=verify,
            skip=self.sac_skip,
            density=self.sac_density,
        )

    def settle_frame(self, frame: SelectiveFrame) -> None:
        """After a selective forward: the frame prunes what its policy drops once the forward's
        flops are known (``"flops"``), and the segment keeps its density for the next."""
        c, eng = self.contract, self.engine
        if self.name in eng.meter.activation_bytes:
            act = eng.meter.activation_bytes[self.name]
            at = eng.meter.activation_size.get(self.name, 0)
        else:
            act, at = (c.activation_bytes, self.contract_size) if c else (0, 0)
        # A(s) was measured at one step's inputs (the probe's, or a checked step's) and the
        # frame's flops are today's: scaled with the input size as the planner scales it
        # (unscaled, a batch 8x the probe's gave a density 8x too high: nothing kept)
        if act > 0 and at > 0 and eng._window_size > 0:
            act = act * eng._window_size / at
        density = frame.settle(act)
        if density is not None:
            self.sac_density = density

    def _measures_kept(self) -> bool:
        """Whether this call, a full replay on an untimed calibration step, measures what a
        selective forward would keep (once, before the selective options are calibrated)."""
        eng = self.engine
        return (
            eng.measure_costs
            and eng._warmup
            and eng.config.selective_policy is not None
            and self.contract is not None
            and self.contract.selective
            and self.name not in eng.meter.selective_bytes
        )

    def _charge_kept(self, inv: _Invocation, frame: SelectiveFrame, held: bool = True) -> None:
        """The outputs a selective forward kept are held until its replay: the accountant
        holds them for the invocation, the cost meter takes their bytes as the option's.
        ``held=False``: a measurement only (a full replay's forward ran under the frame), the
        frame's cache is emptied now."""
        eng = self.engine
        kept = frame.kept_tensors()
        if eng.measure_costs:
            eng.meter.selective_bytes[self.name] = _unique_bytes(kept)
            eng.meter.selective_saved_bytes[self.name] = frame.kept_saved_bytes()
        if not held:
            frame.release()
            return
        acct = eng.accountant
        if acct is not None:
            for t in kept:
                key = acct.hold_tensor(t, self.name)
                if key is not None:
                    inv.held.append(key)

    def _violation(self, state: str, detail: str, inv: _Invocation) -> None:
        eng = self.engine
        self.violations += 1
        eng.records.append(
            step=inv.step,
            segment=self.name,
            contract_version=inv.version,
            check="version",
            outcome="rejection",
            detail={"state": state, "seen": detail, "action": eng.on_violation},
        )
        if eng.on_violation == "raise":
            inv.release()
            raise ContractViolation(self.name, state, detail, inv.version)
        warnings.warn(
            str(ContractViolation(self.name, state, detail, inv.version))
            + " Recorded; this replay used the live value, and the segment runs "
            "retained until it is probed again.",
            RuntimeWarning,
            stacklevel=2,
        )
        # Probe again next time; the re-probe extends the contract (next version).
        if self.status in ("active", "retain"):
            self.status = "probe"
        eng._contracts_changed()

    # ---------------------------------------------------------------- reporting
    def idle_reason(self) -> str | None:
        """Why this segment has not replayed, once the engine can tell (after the first
        window: never called; after two: called only where nothing is recorded for backward),
        or None."""
        if self.contract is not None or self.forwards:
            return None
        step = self.engine.step
        if self.calls == 0:
            # one of a list whose other items ran (LayerDrop skips layers at random) is only
            # called "not called" once it has stayed so for a long while
            return NOT_CALLED if step >= (SKIPPED_WINDOWS if self.skipped() else 1) else None
        if step >= 2:
            return PLAIN
        return None

    def skipped(self) -> bool:
        """Whether another segment of the same parent module (an item of the same list) has
        been called: this one may be skipped at random (LayerDrop, stochastic depth over a
        list), not missing from the forward."""
        parent = self.name.rpartition(".")[0]
        return any(
            rt.calls and rt is not self and rt.name.rpartition(".")[0] == parent
            for rt in self.engine.runtimes.values()
        )

    def summary(self) -> dict[str, Any]:
        c = self.contract
        idle = self.idle_reason()
        status = self.status if idle is None else idle
        return {
            "mode": (c.option if c is not None and self.status in ("active", "retain") else status),
            "status": status,
            "forwards": self.forwards,
            "replays": self.replays,
            "contract_version": c.version if c else 0,
            "violations": self.violations,
            "checks": self.checks,
            "divergences": self.divergences,
            "activation_bytes": c.activation_bytes if c else 0,
            "preserved_bytes": self.last_preserved_bytes,
            "changing_state": [s.name for s in c.changing] if c else [],
            "options": c.available_options() if c else [],
        }


def _needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``module`` builds a graph: a parameter or a tensor argument requires
    grad. A segment in ``eval()`` whose weights train (a frozen-BatchNorm backbone, a
    linear probe's encoder) replays like one in training mode; one that builds no graph (a
    teacher evaluated with grad mode on) has nothing to drop and runs plain."""
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))


#: windows whose calls of a segment its call count (``window_calls``) follows: the most of
#: them. A segment called 3 times per window for a while and once since is charged one call
#: once this many windows called it once (a re-plan then sees it).
CALL_WINDOWS = 8


def _inside(x: torch.Tensor, extent: Any) -> bool:
    """Whether ``x``'s bytes are among those put back in place: ``extent`` is a storage's
    entry from :func:`_restored_in_place` (None: all of it; False: none)."""
    if extent is None or extent is False:
        return extent is None
    span = byte_span(x)
    return span is None or (extent[0] <= span[0] and span[1] <= extent[1])


def _restored_in_place(inv: _Invocation, eng: Any) -> dict[int, Any]:
    """The storages (by ``_cdata``) whose forward bytes the replay context of ``inv`` puts
    back in place for its replay: state preserved whole (or its regions, where the window's
    writes to it are logged), read-only whole copies included. A changed argument on one of
    these storages is read live at the replay, and the replay's writes to it are undone as
    the state's are (the sandbox of written regions, the swap back of whole snapshots)."""
    armed = {k for k, _ in inv.regions}
    out: dict[int, Any] = {}
    for (entry, t), p in zip(inv.tensors, inv.prs):
        if p == "whole" or (p == "regions" and (not eng._capturing or storage_key(t) in armed)):
            # (only its extent, where it has one: issue 31; an argument outside is copied)
            ext = tuple(entry.extent) if entry.extent is not None else None
            out[t.untyped_storage()._cdata] = ext
    return out


def _stand_in(sub: tuple) -> torch.Tensor:
    """What checkpoint keeps for a changed argument: the copy of its forward bytes, or, where
    the replay reads it live, an empty tensor on its device (checkpoint saves its inputs and
    checks their versions: the live one is written in the window)."""
    live, snap = sub
    return snap if snap is not None else live.new_empty(0)


def _replay_input(saved: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A writable copy of an argument's forward bytes for its replay, laid out as at the
    forward (:func:`~lightning_replay.state.strided_copy`); where it required grad, no leaf
    (a copy of a leaf that requires grad, as a ``clone`` would be), so that the segment's
    in-place ops on it run as in the forward."""
    x = strided_copy(saved)
    if not requires_grad:
        return x
    src = saved.detach().requires_grad_()
    try:
        with torch.enable_grad():
            return x.copy_(src)
    except RuntimeError:  # an expanded (overlapping) layout cannot be written: a view
        return src.view_as(src)


#: re-probes of a segment on this many forwards in a row: it is named in a warning
REPROBES_BEFORE_WARNING = 8


@contextlib.contextmanager
def _stacked(*ctxs: Any) -> Any:
    with contextlib.ExitStack() as stack:
        for c in ctxs:
            stack.enter_context(c)
        yield


def _calls_script_function(modules: list[nn.Module], depth: int = 2) -> bool:
    """Whether the forwards of ``modules`` (or the Python functions they name, ``depth``
    levels down) name a ``torch.jit.ScriptFunction`` in their globals, or the modules hold
    one as an attribute."""
    seen: set[int] = set()

    def names(fn: Any, level: int) -> bool:
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in seen or level > depth:
            return False
        seen.add(id(code))
        glob = getattr(fn, "__globals__", {})
        codes = [code]
        while codes:
            c = codes.pop()
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
            for n in c.co_names:
                g = glob.get(n)
                if isinstance(g, torch.jit.ScriptFunction):
                    return True
                if isinstance(g, types.FunctionType) and names(g, level + 1):
                    return True
        return False

    # a scripted function kept as a module attribute (``self.act = torch.jit.script(fn)``)
    if any(isinstance(v, torch.jit.ScriptFunction) for m in modules for v in vars(m).values()):
        return True
    # (every class's own forward: the segment's class is swapped for a replaying subclass)
    return any(names(vars(cls).get("forward"), 0) for m in modules for cls in type(m).__mro__)


def _same(t: Any) -> Any:
    return t


def _full_replay(inv: _Invocation, user: tuple | None = None):
    """``context_fn`` of a full replay: nothing around the forward, the contract's replay
    context around the recomputation."""
    return lambda: (contextlib.nullcontext(), _ReplayContext(inv, True, user))


@contextlib.contextmanager
def _released_if_raised(inv: _Invocation, frame: SelectiveFrame | None) -> Iterator[None]:
    """A forward that raised will never be replayed: what its invocation holds (region-log
    arms, copies, held bytes) and what its selective frame kept go at once. Left to the
    invocation's finalizer, the traceback's frames kept them (until the cyclic collector
    ran, if ever), and an arm kept logging its storage's writes every step."""
    try:
        yield
    except BaseException:
        inv.release()
        if frame is not None:
            frame.release()
        raise


def _timed_clock(eng: "RuntimeHost") -> float:
    if eng._sync:
        torch.cuda.synchronize(eng._cuda_device)
    return clock(eng._cuda)


def _aliased_changing(flat: list, changing: list) -> set | None:
    """The storage keys of the ``changing`` state storages that some tensor argument in
    ``flat`` shares, or None (nearly always: the arguments are activations). Data pointers
    first, the full key only for a pointer that matches."""
    ptrs = set()
    for x in flat:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_meta:
            try:
                ptrs.add(x.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
    ptrs.discard(0)
    if not ptrs:
        return None
    out = set()
    for st in changing:
        try:
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr in ptrs and st.nbytes():
            out.add((str(st.device), ptr))  # storage_key's form
    return out or None


# Derivative checks compare bit for bit, except on a device whose kernels may be
# nondeterministic (CUDA without torch.use_deterministic_algorithms(True)): there two runs of
# the same backward can differ in the last bits (atomic adds), so gradients within this
# tolerance are a match, recorded with their differences.
