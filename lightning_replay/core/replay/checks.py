"""Where a check is decided: derivative and byte checks of replays, and how they compare.

A derivative-checked call runs its forward with its graph, as a retained segment does, so
training on that step is plain PyTorch's; its outputs pass through a tap
(:class:`_CheckTap`) whose backward replays the segment under its contract and differentiates
the replay twice: from the tensors the forward saved (the reference) and from its own.
Gradients are compared bit for bit. Where they differ, both are differentiated again (the
reference :data:`NOISE_SAMPLES` times, the replay once, and the reference up to
``NOISE_SAMPLES_MAX`` times where the gap is noise-sized): passes from the same saved tensors
that differ among themselves are the kernels' noise (atomics), and the replay is then judged
against that measured spread with a floor by dtype (:class:`_Noise`, in
:mod:`~lightning_replay.core.mechanisms.kernel_noise`), the spread recorded with the check;
where the passes agree, the check stays bitwise. Byte checks compare digests of contract state and outputs.
A divergence makes the segment react (re-probe, then retain).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from lightning_replay.core.base.ports import CheckedSegment, CheckHost, RecordSink, StepClock
from lightning_replay._compat import (
    dispatch_modes_on,
    graph_task_keeps_graph,
    top_saved_tensors_hooks,
    tree_map,
)
from lightning_replay.core.mechanisms.arguments import (
    call_tensors,
    forward_attributes,
    unflatten_call,
    with_attributes,
)
from lightning_replay.core.mechanisms.grad_reads import forward_grads
from lightning_replay.core.mechanisms.kernel_noise import (  # noqa: F401 - NOISE_*: this API
    NOISE_FACTOR,
    NOISE_FLOOR_ULPS,
    NOISE_SAMPLES,
    GradNoise as _Noise,
    bitwise_equal as _bitwise_equal,
    max_abs_diff as _max_abs_diff,
    measure_noise,
)
from lightning_replay.core.mechanisms import backend_flags, param_cache
from lightning_replay.core.mechanisms.accounting import Saved
from lightning_replay.errors import ReplayError
from lightning_replay.core.base.contract import SELECTIVE
from lightning_replay.core.replay.restore import (
    _BytesSandbox,
    _Invocation,
    _ReplayContext,
    state_view,
)
from lightning_replay.core.mechanisms.selective import KeptEvent, SelectiveFrame, replaying
from lightning_replay.core.mechanisms.slots import (
    capture_slots,
    slot_tensors,
)
from lightning_replay.core.base.state import (
    digests,
    storage_key,
    tensor_leaves,
)


GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-8
#: (rtol, atol) per gradient dtype: a few units in the last place of each (one bf16 ulp is
#: 7.8e-3 relative, so float32's rtol would call every last-bit difference a divergence).
GRAD_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-14),
    torch.float32: (GRAD_RTOL, GRAD_ATOL),
    torch.float16: (4e-3, 1e-5),
    torch.bfloat16: (3.2e-2, 1e-5),
}


def grad_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The (rtol, atol) at which two gradients of ``dtype`` from a nondeterministic device
    are a match.

    Example:
        >>> grad_tolerance(torch.bfloat16)[0] > grad_tolerance(torch.float32)[0]
        True
    """
    return GRAD_TOLERANCE.get(dtype, (GRAD_RTOL, GRAD_ATOL))


def _rng_states(device: torch.device | None) -> tuple:
    """The global CPU RNG state and, on CUDA, that of the model's device only."""
    cuda = torch.cuda.get_rng_state(device) if device is not None else None
    return torch.get_rng_state(), cuda, device


@contextlib.contextmanager
def _forked_rng(states: tuple) -> Iterator[None]:
    cpu, cuda, device = states
    with torch.random.fork_rng(devices=[device] if device is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _nondeterministic(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and not torch.are_deterministic_algorithms_enabled()


def _same_grad(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _bitwise_equal(a, b)


def _noise_samples(
    pairing: "_Pairing", sel: list, wrt: list, grads: list, ref: tuple, rep: tuple
) -> _Noise:
    """The backward's own noise (:func:`measure_noise`): more passes of the replay's graph,
    from the forward's saved tensors (the reference) and from its own."""

    def grad(forward: bool) -> tuple:
        pairing.forward = forward
        return torch.autograd.grad(sel, wrt, grads, retain_graph=True, allow_unused=True)

    return measure_noise(ref, rep, lambda: grad(True), lambda: grad(False))


@contextlib.contextmanager
def _saving_counted(
    saved: dict,
    exclude: set,
    where: str,
    namer: Callable,
    acct: Any = None,
    record: list | None = None,
) -> Iterator[None]:
    """Count the storages autograd saves inside the block (each once, ``exclude`` left out,
    and those the accountant ``acct`` counts elsewhere: FSDP's gathered parameters) into
    ``saved``, handing each tensor on to the saved-tensor hooks already active (the memory
    accountant's) or, without any, to a version-checked :class:`Saved` handle. ``record``,
    if given, gets every saved tensor in the order autograd saves them (a derivative check
    pairs them with its replay's, see :class:`_Pairing`)."""
    # torch-private, but what torch.utils.checkpoint itself uses to find the active hooks
    top = top_saved_tensors_hooks()
    outer_pack, outer_unpack = top if top is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key is not None and key not in exclude and not (acct is not None and acct.elsewhere(t)):
            saved[key] = t.untyped_storage().nbytes()
        if record is not None:
            record.append(t)
        return outer_pack(t) if outer_pack is not None else Saved(t, where, namer)

    unpack = outer_unpack if outer_unpack is not None else Saved.unpack
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        # ``pack`` can outlive the block: autograd keeps it with what it packed, in a graph that
        # a segment raising mid-step leaves to a cycle through C++ no collector sees. It must
        # not keep the recorded tensors (the caller has them) nor the counts alive (issue 31).
        record = None
        saved = {}


def _state_keys_now(seg: CheckedSegment) -> set:
    """Where the segment's state is now: its contract's tensors, looked up in the live model.
    Not the addresses its probe saw: a parameter FSDP2 freed and gathered again, a queue grown
    by ``resize_`` or a weight an optimizer put on new storage has moved since, and one of this
    call's activations may lie where it was (it is this call's, and counts)."""
    keys = {storage_key(t) for t in (b.get() for b in seg.bound) if isinstance(t, torch.Tensor)}
    return keys - {None}


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    """The differentiable tensors of a segment's output, each once, in order."""
    seen: set[int] = set()
    outs = []
    for t in tensor_leaves(out):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            outs.append(t)
    return outs


def _tappable(outs: list[torch.Tensor], args: list[torch.Tensor]) -> list[int]:
    """Which differentiable outputs of a checked call pass through its tap (which copies
    them): those that share memory with no argument and no other output. An argument returned
    as it came, or a view of one, or two outputs on one storage, go on untouched, so that an
    in-place write to one is seen through the others as in plain PyTorch (the check gives them
    no gradient, in both of its backward passes alike)."""
    keys = [storage_key(o) for o in outs]  # None: no plain storage to tell by
    taken = {storage_key(a) for a in args} - {None}
    ids = {id(a) for a in args}
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return [
        i
        for i, (o, k) in enumerate(zip(outs, keys))
        if id(o) not in ids and (k is None or (k not in taken and counts[k] == 1))
    ]


def _meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device}"


class _Pair:
    """One saved tensor of a check's replay and the forward's at the same place (or None)."""

    __slots__ = ("forward", "replay")

    def __init__(self, forward: torch.Tensor | None, replay: torch.Tensor) -> None:
        self.forward = forward
        self.replay = replay


class _Pairing:
    """Saved-tensor hooks for a check's replay: the i-th tensor the replay saves is paired with
    the i-th its forward saved, and a backward through the replay's graph reads the forward's
    (while :attr:`forward` is set: the reference, what the segment's real graph computes from)
    or the replay's own (what an unchecked step's replay computes from).

    A replay tensor with the forward's bytes is not kept: the forward's stands for it. The
    segment's real graph is alive while its check runs, and this way an exact replay's graph
    holds next to nothing of its own.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> pairing = _Pairing([torch.full((2,), 3.0)])
        >>> with pairing.hooks():
        ...     y = (x * x.detach().mul(2)).sum()  # saves x*2 (its forward saved 3s)
        >>> pairing.mismatch() is None
        True
        >>> pairing.forward = True
        >>> torch.autograd.grad(y, x, retain_graph=True)[0].tolist()
        [3.0, 3.0]
        >>> pairing.forward = False
        >>> torch.autograd.grad(y, x)[0].tolist()
        [2.0, 2.0]
    """

    def __init__(self, saved: list[torch.Tensor], segment: str = "", timer: Any = None) -> None:
        self.saved = saved
        self.segment = segment
        self.pairs: list[_Pair] = []
        self.differ: list[str] = []
        self.forward = False
        self.timer = timer  # a clock, while the replay's time is measured
        self.seconds = 0.0  # spent in pack (no part of what the replay costs)

    def pack(self, t: torch.Tensor) -> _Pair:
        t0 = self.timer() if self.timer is not None else 0.0
        i = len(self.pairs)
        f = self.saved[i] if i < len(self.saved) else None
        if f is not None:
            if f.shape != t.shape or f.dtype != t.dtype or f.device != t.device:
                self.differ.append(f"saved tensor {i}: replay {_meta(t)}, forward {_meta(f)}")
                f = None
            else:
                f = f.detach()
                if _same_bytes(f, t):
                    t = f
        pair = _Pair(f, t)
        self.pairs.append(pair)
        if self.timer is not None:
            self.seconds += self.timer() - t0
        return pair

    def unpack(self, pair: _Pair) -> torch.Tensor:
        if pair.replay is None:
            raise ReplayError(
                f"a tensor computed by the derivative check's replay of segment "
                f"{self.segment!r} (kept by the model, e.g. appended to a list by a hook) was "
                "differentiated after the check. Only the segment's outputs from its forward "
                "belong to the step's graph."
            )
        if self.forward and pair.forward is not None:
            return pair.forward
        return pair.replay

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def mismatch(self) -> str | None:
        """Why the replay's saved tensors cannot stand in for the forward's, or None."""
        if len(self.pairs) != len(self.saved):
            return f"saved tensors: replay {len(self.pairs)}, forward {len(self.saved)}"
        return self.differ[0] if self.differ else None

    def clear(self) -> None:
        """Let go of every pair: a graph of the replay the model kept (a side channel) holds
        no tensor of the check's any more."""
        for p in self.pairs:
            p.forward = p.replay = None
        self.pairs = []
        self.saved = []


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same shape, dtype and device) hold the same bits; False where
    that cannot be told (a tensor without strided storage)."""
    try:
        if a.layout != torch.strided or b.layout != torch.strided:
            return False
        if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
            return True  # the same memory, read the same way
        return _bitwise_equal(a, b)
    except (RuntimeError, NotImplementedError):
        return False


@dataclasses.dataclass(slots=True)
class _CheckBox:
    """What the backward of one checked call needs; ``saved`` is None once it has run."""

    checks: "SegmentChecks"
    inv: _Invocation
    call: list  # the call's flattened arguments at forward, tensors detached (see _prepare)
    spec: Any  # their tree spec, None for a call of tensors only
    inputs: list[tuple[int, int, bool]]  # per differentiable argument: (position, input, leaf?)
    n_inputs: int  # distinct differentiable arguments
    params: list[torch.Tensor]
    outs: list[torch.Size]  # shapes of the forward's differentiable outputs
    tapped: list[int]  # which of them pass through the tap
    saved: list[torch.Tensor] | None  # what the forward saved for backward, in order
    rng: tuple  # global RNG states at forward (see _rng_states)
    autocast: list
    out_digests: list[int] | None
    # the differentiable outputs' digests: what the grad check compares besides gradients
    grad_out_digests: list[int]
    # a selective option's frame: the outputs the forward kept, which the check's replay uses
    sac: SelectiveFrame | None = None


class _CheckTap(torch.autograd.Function):
    """Between a checked call's outputs and the rest of the model: its backward receives the
    outputs' gradients, runs the check (:meth:`SegmentChecks._compare_grads`) and hands the
    gradients on unchanged to the segment's own graph, which training uses as in plain PyTorch.

    A node rather than tensor hooks: FSDP2 registers its pre-backward (unshard) hooks on the
    module's outputs, which are this node's, so parameters are gathered when the check runs.
    Its outputs are copies: a view of an input returned by a custom Function may not be
    modified in place, and models do modify a block's output in place (a residual ``+=``).
    """

    @staticmethod
    def forward(ctx: Any, box: _CheckBox, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.box = box
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        box = ctx.box
        if box is None or box.saved is None:
            # A second backward through the checked call (after one that kept the graph: a
            # gradient penalty, R1, retain_graph=True): checked once, at the first; training
            # differentiates the segment's own graph, which plain PyTorch would.
            return (None, *grads)
        if not graph_task_keeps_graph():
            ctx.box = None
        box.checks._compare_grads(box, list(grads))
        return (None, *grads)


def _autocast_state() -> list[tuple[str, bool, torch.dtype, bool]]:
    """Autocast settings of the current forward, per device type that has autocast: (device,
    enabled, dtype, cache enabled). The cache decides how many casts of a parameter there are,
    and so how their gradients are summed (Lightning's bf16-mixed turns it off)."""
    out = []
    cache = torch.is_autocast_cache_enabled()
    for dev in ("cpu", "cuda"):
        if torch.amp.is_autocast_available(dev):
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), cache))
    return out


class SegmentChecks:
    """The derivative and byte checks of one segment, an object its runtime composes.

    It reaches the segment through ``seg`` (:class:`~lightning_replay.core.base.ports.CheckedSegment`:
    what a checked call reads, the counters and the reaction to a divergence), the engine through
    ``host`` (:class:`~lightning_replay.core.base.ports.CheckHost`), records every check in
    ``records``, and times a check's own work, to take it out of a replay's cost, with ``clock``.
    """

    def __init__(
        self, seg: CheckedSegment, host: CheckHost, records: RecordSink, clock: StepClock
    ) -> None:
        self.seg = seg
        self.host = host
        self.records = records
        self.clock = clock

    def _measured_call(self, args: tuple, kwargs: dict, record: list | None = None) -> Any:
        """A forward that keeps its graph (checked or retained on a checked step), measuring
        what it saves: A(s) at today's shapes (the probe's figure goes stale when shapes
        change). ``record`` gets the tensors it saves, in order (see :func:`_saving_counted`)."""
        eng = self.host
        saved: dict = {}
        exclude = _state_keys_now(self.seg) | {storage_key(t) for t in call_tensors(args, kwargs)}
        eng._segment_depth += 1
        try:
            with _saving_counted(
                saved, exclude, f"segment {self.seg.name!r}", eng.state_name, eng.accountant, record
            ):
                out = self.seg.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1
        if eng.measure_costs:
            # the window's calls add up (a segment called k times keeps k calls' worth)
            eng.meter.add_call_activation(self.seg.name, eng.step, sum(saved.values()))
            eng.meter.activation_size[self.seg.name] = eng._window_size
        return out

    def _checked_call(self, args: tuple, kwargs: dict) -> Any:
        """Derivative check: run the segment with its graph, replay it once at backward.

        The forward runs on the live arguments and keeps its graph, as a retained segment's
        does: training differentiates that graph, so gradients are summed in the order plain
        PyTorch sums them, side channels (tensors a hook takes from inside the segment) and
        the model's own checkpoints behave as in plain PyTorch. The tensors it saves for
        backward are recorded, and its differentiable outputs pass through :class:`_CheckTap`,
        whose backward replays the segment under its contract and compares (see
        :meth:`_compare_grads`). A checked step costs one replay (forward and two backward
        passes) of the segment more than a plain one, and keeps its graph until backward.
        """
        eng = self.host
        inv, call, spec = self.seg._prepare(args, kwargs, eng._check_bytes)
        rng = _rng_states(eng._cuda_device)
        autocast = _autocast_state()
        saved: list[torch.Tensor] = []
        # A selective option is checked as it replays: the forward keeps the outputs its
        # policy names (digested as each op runs), and the check's replay uses them
        sac = self.seg.selective_frame(verify=True) if inv.option in SELECTIVE else None
        cached = param_cache.forward_start()
        with sac.forward if sac is not None else contextlib.nullcontext():
            inv.moded = dispatch_modes_on()
            out = self._measured_call(args, kwargs, saved)
        if sac is not None:
            self.seg.settle_frame(sac)
        # the check's replay computes the parametrizations this forward cached again
        inv.param_cache = param_cache.forward_end(cached)
        outs = _grad_outputs(out)
        tapped = _tappable(outs, call_tensors(args, kwargs))
        if not tapped:
            inv.release()
            return out
        inputs: list[tuple[int, int, bool]] = []
        index: dict[int, int] = {}  # one input per tensor, however often it is passed
        for i, x in enumerate(call):
            live = inv.subs[i][0] if i in inv.subs else x
            if isinstance(live, torch.Tensor) and live.requires_grad:
                inputs.append((i, index.setdefault(id(live), len(index)), live.is_leaf))
        box = _CheckBox(
            self,
            inv,
            [x.detach() if isinstance(x, torch.Tensor) else x for x in call],
            spec,
            inputs,
            len(index),
            [p for p in self.seg.module.parameters() if p.requires_grad],
            [o.shape for o in outs],
            tapped,
            saved,
            rng,
            autocast,
            digests(tensor_leaves(out)) if eng._check_bytes else None,
            digests(outs),
            sac,
        )
        taps = _CheckTap.apply(box, *(outs[k] for k in tapped))
        by_id = {id(outs[k]): t for k, t in zip(tapped, taps)}
        return tree_map(lambda x: by_id.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    def _compare_grads(self, box: "_CheckBox", grads: list[torch.Tensor]) -> None:
        """The check of one checked call, run when its outputs' gradients ``grads`` arrive.

        The segment is replayed once under its contract, from leaves with the forward's bytes,
        while :class:`_Pairing` pairs each tensor it saves with the one the forward saved at the
        same place. Its graph is then differentiated twice with ``grads``: with the forward's
        saved tensors (the reference: what the segment's real graph computes from, whatever the
        contract restores) and with the replay's own; input and parameter gradients must agree
        bit for bit. Where they do not, the reference is differentiated again: if its own
        passes differ (a nondeterministic backward kernel), the replay matches within that
        spread (see :class:`_Noise`; recorded as ``detail["noise"]``); if they agree, any
        difference is a divergence (on a nondeterministic device without deterministic
        algorithms, the replay's forward may also differ in its last bits: within
        :data:`GRAD_TOLERANCE`). Saved tensors that differ in number, shape or dtype are a
        divergence by themselves. Training is not touched: the tap hands ``grads`` on to the
        real graph.
        """
        eng = self.host
        inv = box.inv
        fwd, box.saved = box.saved, None
        # The replay starts from leaves with the forward's bytes. An argument that was no leaf
        # in the forward is passed as a view of its leaf: autocast caches its cast of a leaf
        # that requires grad (one cast for every use, gradients summed in the low precision),
        # and the replay must cast as the forward did.
        leaves: list[torch.Tensor | None] = [None] * box.n_inputs
        views: dict[int, torch.Tensor] = {}
        flat = list(box.call)
        for i, j, was_leaf in box.inputs:
            if leaves[j] is None:
                leaves[j] = flat[i].detach().requires_grad_()
            if was_leaf:
                flat[i] = leaves[j]
            else:
                if j not in views:
                    with torch.enable_grad():  # backward runs without grad mode
                        views[j] = leaves[j].view_as(leaves[j])
                flat[i] = views[j]
        args, kwargs = (flat, {}) if box.spec is None else unflatten_call(flat, box.spec)
        wrt = leaves + box.params
        timed = eng.measure_costs and (eng._sync or not eng._cuda)
        pairing = _Pairing(fwd, self.seg.name, self.clock if timed else None)
        ref = rep = None
        noise = None  # the backward's own noise, measured where the replay differs
        bad: list[str] = []
        # A checked replay leaks nothing into the model, whatever the contract missed: every
        # buffer and tensor attribute of the segment is put back byte for byte (slots,
        # generators and the global RNG are put back by the replay context and fork_rng), after
        # both backward passes: a checkpoint inside the segment recomputes (and writes batch
        # norm statistics) in them. Backward runs outside the forward's autocast: re-enter it
        # for the replay's forward, as checkpoint does for its own recomputation.
        sandbox = _BytesSandbox([t for _, t in slot_tensors(capture_slots(self.seg.modules))])
        try:
            with torch.enable_grad(), _ReplayContext(inv), _forked_rng(box.rng):
                with contextlib.ExitStack() as ac:
                    for dev, enabled, dtype, cache in box.autocast:
                        ac.enter_context(
                            torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache)
                        )
                    ac.enter_context(pairing.hooks())
                    ac.enter_context(replaying())  # (see selective._REPLAYS)
                    if box.sac is not None:
                        ac.enter_context(box.sac.recompute)
                    # what the forward saw on its tensors: attributes, gradients it read
                    ac.enter_context(backend_flags.entered(inv.backends))
                    ac.enter_context(forward_attributes(flat, inv.tensor_attrs))
                    ac.enter_context(with_attributes(inv.state_attrs))
                    ac.enter_context(forward_grads(inv.grads))
                    ac.enter_context(backend_flags.dispatching_as(inv.moded))
                    out2 = self.seg.orig_forward(*args, **kwargs)
                t0 = self.clock() if timed else 0.0
                outs2 = _grad_outputs(out2)
                if len(outs2) != len(box.outs) or any(
                    a.shape != s for a, s in zip(outs2, box.outs)
                ):
                    bad.append(
                        f"outputs: the replay produced {len(outs2)} differentiable outputs "
                        f"{[tuple(t.shape) for t in outs2]}, the forward "
                        f"{[tuple(s) for s in box.outs]}"
                    )
                elif pairing.mismatch() is not None:
                    bad.append(pairing.mismatch())
                elif not wrt:  # nothing in the segment to differentiate for
                    ref = rep = ()
                else:
                    sel = [outs2[k] for k in box.tapped]
                    pairing.forward = True
                    ref = torch.autograd.grad(sel, wrt, grads, retain_graph=True, allow_unused=True)
                    pairing.forward = False
                    rep = torch.autograd.grad(sel, wrt, grads, retain_graph=True, allow_unused=True)
                    if not all(_same_grad(a, b) for a, b in zip(ref, rep)):
                        # the kernels' own run-to-run spread: differentiate both again
                        noise = _noise_samples(pairing, sel, wrt, grads, ref, rep)
                if timed:
                    # inside the replay context (its swapped-in state must hold for them), but
                    # the check's pairing and backward passes are no part of what a replay costs
                    inv.t_prep -= self.clock() - t0 + pairing.seconds
        finally:
            pairing.clear()
            sandbox.restore()
        names = [f"input[{j}]" for j in range(box.n_inputs)] + [
            f"{self.seg.name}.{n}" for n, p in self.seg.module.named_parameters() if p.requires_grad
        ]
        tolerated = []
        tol = (GRAD_RTOL, GRAD_ATOL)
        if noise is None and ref is not None:
            noise = _Noise(ref, rep=rep)
        within_noise: list[str] = []
        # The reference pass takes its saved tensors from the forward, but the rest of each
        # node (a Python scalar factor, a shape) from the replay: a replay that differs there
        # alone differs in its outputs, which are compared too
        out_differ = (
            ref is not None
            and digests(outs2) != box.grad_out_digests
            and not any(_nondeterministic(o) for o in outs2)
        )
        if ref is not None:
            for i, (n, a, b) in enumerate(zip(names, ref, rep)):
                if (a is None) != (b is None):
                    bad.append(f"{n}: missing")
                elif a is not None and not _bitwise_equal(a, b):
                    gap = _max_abs_diff(a, b)
                    diff = f"max abs diff {gap:.3g}"
                    rtol, atol = grad_tolerance(a.dtype)
                    if noise.noisy and gap <= noise.allowance(i, a):
                        within_noise.append(
                            f"{n}: {diff}, the reference's own spread {noise.spread[i]:.3g}"
                        )
                    elif _nondeterministic(a) and torch.allclose(a, b, rtol=rtol, atol=atol):
                        tolerated.append(f"{n}: {diff}")
                        tol = max(tol, (rtol, atol))
                    else:
                        bad.append(f"{n}: {diff}")
        if out_differ:
            bad.append("outputs: the replay's differ from the forward's (bytes)")
        if box.sac is not None and box.sac.events:
            # a kept output the replay could not use is a divergence of the selective replay,
            # even where running its op again made the gradients agree
            bad += self._kept_events(inv, box.sac.events, checked=True)
        self.seg.checks += 1
        if bad:
            self.seg.divergences += 1
        detail = {"compared": len(names), "differ": bad[:16]}
        if tolerated:
            detail["within_tolerance"] = {"rtol": tol[0], "atol": tol[1], "tensors": tolerated[:16]}
        if noise is not None and noise.noisy:
            detail["noise"] = noise.detail(within_noise, matched=not bad)
        self.records.append(
            step=inv.step,
            segment=self.seg.name,
            contract_version=inv.version,
            check="grad",
            outcome="divergence" if bad else "match",
            detail=detail,
        )
        diverged = bool(bad)
        if box.out_digests is not None:
            d2 = digests(tensor_leaves(out2))
            same = d2 == box.out_digests
            if not same:
                self.seg.divergences += 1
                diverged = True
            self.records.append(
                step=inv.step,
                segment=self.seg.name,
                contract_version=inv.version,
                check="bytes",
                outcome="match" if same else "divergence",
                detail={"what": "replayed outputs", "outputs": len(d2)},
            )
        if diverged:
            self._diverged(inv)

    def _kept_events(self, inv: _Invocation, events: list[KeptEvent], checked: bool) -> list[str]:
        """What a selective replay found wrong with its kept outputs (it ran their ops again
        instead, see :class:`~lightning_replay.selective.SelectiveFrame`).

        A kept output written in place after its op (version counter) is a rejection: the
        replay was exact without it, and the call is not kept from now on. Any other (bytes
        changed without a version bump, other arguments, calls out of order) is a divergence:
        recorded here on a replay (``check="bytes"`` or ``"selective"``), returned to the
        derivative check's record where ``checked``, and the segment reacts as to any other.
        A call whose bytes changed with no version bump (``.data`` or a NumPy view written: only
        a checked step's digest sees it) is not kept from now on either: the steps after the
        check are exact without waiting for the next one.
        """
        diverged: list[KeptEvent] = []
        for ev in events:
            if ev.kind == "bytes":
                self.seg.sac_skip.add((ev.op, ev.call))
            if ev.kind == "written":
                if (ev.op, ev.call) in self.seg.sac_skip:
                    # recorded already: the segment's other calls of this step kept it before
                    # the first one's replay said so (a cell called 8 times: 1 record, not 8)
                    continue
                self.seg.sac_skip.add((ev.op, ev.call))
                self.records.append(
                    step=inv.step,
                    segment=self.seg.name,
                    contract_version=inv.version,
                    check="selective",
                    outcome="rejection",
                    detail={"kept": ev.describe(), "action": "recomputed; not kept from now on"},
                )
            else:
                diverged.append(ev)
        if diverged and not checked:
            self.seg.divergences += 1
            self.records.append(
                step=inv.step,
                segment=self.seg.name,
                contract_version=inv.version,
                check="bytes" if all(ev.kind == "bytes" for ev in diverged) else "selective",
                outcome="divergence",
                detail={
                    "what": "kept outputs",
                    "differ": [ev.describe() for ev in diverged[:16]],
                    "action": "recomputed",
                },
            )
            self._diverged(inv)
        return [ev.describe() for ev in diverged]

    def _diverged(self, inv: _Invocation) -> None:
        """A check saw a replay differ. The step itself trained on the segment's own graph
        (derivative check) or the contract state was found wrong (byte check); from now on:
        the first time, re-probe the segment and extend its contract; the second time, retain
        it for good (exact by construction)."""
        if self.seg.demoted:
            return
        eng = self.host
        self.seg.reactions += 1
        if self.seg.reactions == 1:
            action = "re-probe"
            if self.seg.status in ("active", "retain"):
                self.seg.status = "probe"
        else:
            action = "retain"
            self.seg.demoted = True
            self.seg.planned_option = "retain"
            if self.seg.contract is not None:
                self.seg.contract.apply_option("retain")
                self.seg._derive()
            if self.seg.status in ("active", "retain"):
                self.seg.status = "retain"
        self.records.append(
            step=inv.step,
            segment=self.seg.name,
            contract_version=inv.version,
            check="reaction",
            outcome="rejection",
            detail={"action": action, "divergences": self.seg.divergences},
        )
        eng._contracts_changed()

    def _check_state_digests(self, inv: _Invocation) -> None:
        now = digests([state_view(e, t) for e, t in inv.tensors])
        bad = [e.name for (e, _), a, b in zip(inv.tensors, inv.digests, now) if a != b]
        self.seg.checks += 1
        if bad:
            self.seg.divergences += 1
        self.records.append(
            step=inv.step,
            segment=self.seg.name,
            contract_version=inv.version,
            check="bytes",
            outcome="divergence" if bad else "match",
            detail={"what": "contract state at replay", "compared": len(now), "differ": bad[:16]},
        )
        if bad:
            self._diverged(inv)
