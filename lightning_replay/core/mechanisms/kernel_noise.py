"""Which saved values a kernel does not reproduce by itself: not evidence of state.

A replayed probe compares the tensors its replay saves for backward with the forward's (see
:mod:`~lightning_replay.probe_replay`). Some kernels save values that are not a function of
their inputs, and differ from one run to the next whatever the state:

- the integer RNG seed and offset outputs of fused attention (``philox_seed``,
  ``philox_offset``; flash attention's ``rng_state`` and ``unused``). With ``dropout_p == 0``
  they draw nothing and the kernel allocates them without writing them (torch's cuDNN path
  allocates them with ``at::empty``), so their bytes are whatever the allocator's block held;
  the backward never reads them then;
- any other auxiliary output the kernel leaves unwritten or computes nondeterministically (a
  workspace, a padded statistic).

:class:`ProducerLog` watches the replay's aten ops and remembers which op produced each
storage with more than one output. When a saved tensor differs from the forward's while the
replay's outputs match bit for bit, :meth:`ProducerLog.unreproduced` says whether the kernel
itself is the cause: an RNG output of an op that drew nothing, or a value that a second run of
the same op on the same arguments does not reproduce either. A value that the op reproduces on
its own arguments but that differs from the forward's is evidence of state, and stays a
divergence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch

from lightning_replay._compat import TorchDispatchMode
from lightning_replay.core.mechanisms.host_rng import global_rngs, states
from lightning_replay.core.mechanisms.preservation import write_args
from lightning_replay.core.base.state import (
    StorageKey,
    digest_token,
    digests,
    resolve_tokens,
    sparse_parts,
    storage_bytes,
    storage_key,
)

#: names torch gives the RNG outputs of its fused attention ops
RNG_OUTPUT_NAMES = frozenset(
    {"philox_seed", "philox_offset", "rng_state", "unused", "seed", "offset"}
)
#: the argument that says whether such an op draws random numbers at all
DROPOUT_ARGUMENT = "dropout_p"
#: fills of the freed memory a kernel is run again over (None: as the allocator has it), to
#: show the bytes it leaves unwritten (see :meth:`ProducerLog.unreproduced`)
POISONS = (None, 0xA5, 0x5A)
#: ops whose output is uninitialized memory (their tensor argument, if any, gives its shape only)
UNINITIALIZED_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
)
#: ops that wrap a tensor just made from host (Python) data (``torch.tensor``, ``as_tensor``)
LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})


@dataclasses.dataclass
class _Fresh:
    """A single-output tensor of the replay that no tensor's value went into."""

    func: Any
    uninitialized: bool  # torch.empty and kin; otherwise made from host values
    token: Any  # digest_token of its storage's bytes when it was made
    #: a weak reference to its storage: the entry speaks for that address while it lives
    storage: Any = None


@dataclasses.dataclass
class _Produced:
    """One output of a multi-output op of the replay: enough to run the op again."""

    func: Any
    args: tuple
    kwargs: dict
    index: int  # position among the op's tensor outputs
    offset: int  # the output's storage offset (a saved view of it is read through it)
    draws: bool  # whether the op may draw random numbers (seeded, dropout not 0)
    rng_output: bool  # an RNG output (by name) of an op that drew nothing
    rngs: tuple  # the global generators' states before it ran (see _rng_snapshot)
    #: grad mode as it ran (below autograd): some kernels read it (mkldnn_rnn_layer returns an
    #: empty workspace without it, so a run under no_grad compares nothing)
    grad: bool = False
    #: a weak reference to its storage: the entry speaks for that address while it lives
    #: (storage allocated by no op's output, a ``resize_``, may get a freed output's address)
    storage: Any = None


def _same_storage(entry: Any, t: torch.Tensor) -> bool:
    return entry.storage is None or entry.storage() is t.untyped_storage()


def _dropout(func: Any, args: tuple, kwargs: dict) -> float | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == DROPOUT_ARGUMENT:
            v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            return float(v) if isinstance(v, (int, float)) else None
    return None


def _rng_outputs(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """Indices (among the schema's returns) of integer RNG outputs of an op that draws
    nothing: named as torch's attention ops name them, with ``dropout_p == 0``."""
    if _dropout(func, args, kwargs) != 0.0:
        return set()
    return {i for i, r in enumerate(func._schema.returns) if r.name in RNG_OUTPUT_NAMES}


class ProducerLog(TorchDispatchMode):
    """Remembers the ops of a replay that produce more than one tensor (the outputs a kernel
    saves beside its result: statistics, RNG state, workspaces), with their arguments.

    The arguments are held until :meth:`clear`: a replay's saved tensors are alive until its
    backward anyway, and these ops' arguments are, as a rule, among them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.produced: dict[StorageKey, _Produced] = {}
        self.fresh: dict[StorageKey, _Fresh] = {}
        self.written: set[StorageKey] = set()  # storages written after they were produced
        self.host_read = False  # a tensor's value was read to the host (.item()) in the replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rngs = _rng_snapshot() if _several_outputs(func) else ()
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [(i, t) for i, t in enumerate(outs) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_read = True
        self._note_writes(func, args, kwargs)
        self._forget_reused(func, outs)
        if len(tensors) == 1:
            self._note_fresh(func, args, kwargs, tensors[0][1])
        if len(tensors) > 1:
            rng = _rng_outputs(func, args, kwargs)
            seeded = torch.Tag.nondeterministic_seeded in func.tags
            draws = seeded and _dropout(func, args, kwargs) != 0.0
            for n, (i, t) in enumerate(tensors):
                key = storage_key(t)
                if key is not None and key not in self.produced:
                    self.produced[key] = _Produced(
                        func,
                        args,
                        kwargs,
                        n,
                        t.storage_offset(),
                        draws,
                        i in rng,
                        rngs,
                        torch.is_grad_enabled(),
                        weakref.ref(t.untyped_storage()),
                    )
        return out

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Storages this op wrote (per its schema) that an earlier op produced: their value is
        no longer the producer's."""
        if not (self.produced or self.fresh):
            return
        for pos, name in write_args(func):
            v = args[pos] if pos < len(args) else kwargs.get(name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                key = storage_key(t) if isinstance(t, torch.Tensor) else None
                if key is not None and (key in self.produced or key in self.fresh):
                    self.written.add(key)

    def _forget_reused(self, func: Any, outs: tuple | list) -> None:
        """An output in new storage (its return aliases no argument) at an address an earlier,
        since freed, output had: the earlier entry is stale."""
        returns = func._schema.returns
        if len(returns) != len(outs):
            return
        for r, t in zip(returns, outs):
            if isinstance(t, torch.Tensor) and r.alias_info is None:
                key = storage_key(t)
                if key is not None:
                    self.produced.pop(key, None)
                    self.fresh.pop(key, None)
                    self.written.discard(key)

    def _note_fresh(self, func: Any, args: tuple, kwargs: dict, t: torch.Tensor) -> None:
        name = func.overloadpacket.__name__
        uninitialized = name in UNINITIALIZED_OPS
        if not uninitialized:
            if torch.Tag.nondeterministic_seeded in func.tags:
                return  # a draw: a value that differs is RNG state
            if t.is_floating_point() or t.is_complex():
                return
            if name not in LIFT_OPS and _tensor_arguments(args, kwargs):
                return  # reads a tensor
            if self.host_read:
                return  # a host value read from a tensor (.item()) may have gone into it
        key = storage_key(t)
        if key is None:
            return
        # lift_fresh's argument is a tensor torch.tensor just made (outside the dispatcher,
        # perhaps at a freed storage's address): whatever was known of that address is stale
        self.produced.pop(key, None)
        self.written.discard(key)
        self.fresh[key] = _Fresh(
            func, uninitialized, digest_token(storage_bytes(t)), weakref.ref(t.untyped_storage())
        )

    def _unreproduced_fresh(self, saved: torch.Tensor, key: StorageKey) -> str | None:
        f = self.fresh[key]
        if resolve_tokens([f.token]) != digests([storage_bytes(saved)]):
            return None  # written since it was made, by a path the dispatcher did not see
        if f.uninitialized:
            return (
                f"uninitialized memory from {f.func}, never written since: its bytes are "
                "whatever the allocator held"
            )
        if saved.is_floating_point() or saved.is_complex():
            return None
        return (
            f"an integer value made by {f.func} from host (Python) values only, reading no "
            "tensor: a moving host counter, not tensor state"
        )

    def unreproduced(self, saved: torch.Tensor) -> str | None:
        """Why ``saved`` (a tensor the replay saved) is a value its kernel does not reproduce,
        or None (it is, or it cannot be told: then a difference is evidence of state)."""
        key = storage_key(saved)
        if key is None or key in self.written:
            return None  # written after it was produced: its producer no longer tells
        if key in self.fresh:
            if not _same_storage(self.fresh[key], saved):
                return None  # (that tensor's storage is gone: the address is another's now)
            return self._unreproduced_fresh(saved, key)
        p = self.produced.get(key)
        if p is None or not _same_storage(p, saved):
            return None
        name = str(p.func)
        if p.rng_output and not saved.is_floating_point():
            return f"an RNG output of {name}, which drew no random numbers (dropout_p=0)"
        if p.draws:
            return None  # a second run would draw again: not a measure of the kernel alone
        # Run it again, then again over freed memory filled with two patterns: bytes a kernel
        # leaves unwritten (a workspace's slack: mkldnn_rnn_layer writes about a fifth of
        # LSTM's) are whatever its allocation held, and a plain second run can get the very
        # bytes the replay's did (the same block, reused). Filled, they cannot equal both
        # patterns; bytes the kernel writes are the same in every run, whatever was there.
        # Whether an allocation gets the freed block is the allocator's choice (CI once ran
        # all three without it): a last run has torch fill every new allocation itself.
        for poison in POISONS:
            try:
                view = _again_as(p, saved, poison)
            except Exception:  # noqa: BLE001 - an op that cannot run again proves nothing
                return None
            if view is None:
                return None
            if digests([view]) != digests([saved]):
                return (
                    f"an auxiliary output of {name} that differs between two runs on the same "
                    "arguments" + ("" if poison is None else " (bytes it leaves unwritten)")
                )
        try:
            with _filling_new_memory():
                view = _again_as(p, saved, None)
        except Exception:  # noqa: BLE001
            return None
        if view is not None and _differs_only_in_fill(view, saved):
            return (
                f"an auxiliary output of {name} that differs between two runs on the same "
                "arguments (bytes it leaves unwritten)"
            )
        return None

    def clear(self) -> None:
        self.produced = {}
        self.fresh = {}
        self.written = set()
        self.host_read = False


def _tensor_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for v in [*args, *kwargs.values()]:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _several_outputs(func: Any) -> bool:
    returns = func._schema.returns
    return len(returns) > 1 or (len(returns) == 1 and str(returns[0].type).startswith("List"))


def _rng_snapshot() -> tuple:
    """The states of the generators a kernel might draw from without saying so: Python's and
    numpy's global ones, torch's CPU default and the current CUDA device's default."""
    hosts = global_rngs()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return hosts, states(hosts), torch.get_rng_state(), cuda


@contextlib.contextmanager
def _drawing_from(snapshot: tuple) -> Iterator[None]:
    """Generators as in ``snapshot`` inside the block, as they were before it after."""
    if not snapshot:
        yield
        return
    hosts, host_states, cpu, cuda = snapshot
    now = _rng_snapshot()
    for r, st in zip(hosts, host_states):
        r.set_state(st)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    try:
        yield
    finally:
        for r, st in zip(now[0], now[1]):
            r.set_state(st)
        torch.set_rng_state(now[2])
        if now[3] is not None:
            torch.cuda.set_rng_state(now[3])


def _run_again(p: _Produced, poison: int | None = None, nbytes: int = 0) -> torch.Tensor | None:
    """The op's output ``p.index`` from a second run on the same arguments, from the same
    generator states (a kernel drawing from a host generator reproduces its draw: a value it
    drew is evidence, not noise), outside autograd and autocast (the first ran below both: its
    arguments are as the kernel received them). None where the op writes: one its schema says
    writes is not run again; one that wrote an argument all the same (eager CPU batch norm's
    running statistics) has its bytes put back. With ``poison``, ``nbytes`` bytes filled with
    it are freed just before the op runs, so that an allocation of its size (on CPU and in
    CUDA's caching allocator) likely gets them: unwritten output bytes then hold the pattern."""
    if write_args(p.func):
        return None
    inputs: dict = {}
    for t in _tensor_arguments(p.args, p.kwargs):
        key = storage_key(t)
        if key is not None and key not in inputs:
            inputs[key] = (t, storage_bytes(t).clone())
    # below autograd as the first ran (no graph is built), in the grad mode it ran in
    below = torch._C._AutoDispatchBelowAutograd()
    with torch.set_grad_enabled(p.grad), below, _no_autocast(), _drawing_from(p.rngs):
        if poison is not None and nbytes:
            device = next((t.device for t, _ in inputs.values()), torch.device("cpu"))
            torch.full((nbytes,), poison, dtype=torch.uint8, device=device)  # freed at once
        out = p.func(*p.args, **p.kwargs)
        wrote = False
        for t, before in inputs.values():
            live = storage_bytes(t)
            if not torch.equal(live, before):
                live.copy_(before)
                wrote = True
    if wrote:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    return tensors[p.index] if p.index < len(tensors) else None


def _again_as(p: _Produced, saved: torch.Tensor, poison: int | None) -> torch.Tensor | None:
    """``saved``'s view of a second run's output (see :func:`_run_again`), or None."""
    again = _run_again(p, poison, saved.untyped_storage().nbytes())
    if again is None:
        return None
    if again.dtype != saved.dtype or again.untyped_storage().nbytes() < (
        saved.untyped_storage().nbytes()
    ):
        return None
    try:
        return again.as_strided(
            saved.shape, saved.stride(), again.storage_offset() + saved.storage_offset() - p.offset
        )
    except RuntimeError:
        return None


@contextlib.contextmanager
def _filling_new_memory() -> Iterator[None]:
    """torch fills what ``empty`` allocates (NaN, or an integer type's largest value) while
    deterministic algorithms are on: a kernel's unwritten output bytes then hold that fill,
    whichever block the allocator gives. Only warned about, never raised, here."""
    import warnings

    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill


def _differs_only_in_fill(view: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether the run over filled memory differs from ``saved`` and holds the fill in every
    element it differs in: those are elements the kernel left unwritten. Compared bit for bit:
    a NaN the kernel writes is the same in both runs (as values, NaN != NaN made every
    element a kernel wrote NaN look unwritten: a state difference elsewhere in a tensor with
    one NaN was called noise). A kernel that computes them otherwise (another algorithm under
    deterministic mode) differs elsewhere too."""
    with _filling_new_memory():
        fill = torch.empty(1, dtype=view.dtype, device=view.device)
    ours, theirs, fill = _bits(view), _bits(saved), _bits(fill)
    if ours is None or theirs is None or fill is None:
        return False
    if view.is_complex():  # (a real and an imaginary part per element)
        differ, filled = ours.ne(theirs).any(-1), ours.eq(fill.reshape(-1)).all(-1)
    else:
        differ, filled = ours.ne(theirs), ours.eq(fill.reshape(()))
    return bool(differ.any()) and bool(filled[differ].all())


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s elements as integers of their size (complex: a pair per element), or None."""
    if t.is_complex():
        t = torch.view_as_real(t)
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if dtype is None:
        return None
    try:
        return t if t.dtype == dtype else t.view(dtype)
    except RuntimeError:
        return None


class _no_autocast:
    def __enter__(self) -> None:
        self._stack = []
        for dev in ("cpu", "cuda"):
            if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
                ctx = torch.autocast(dev, enabled=False)
                ctx.__enter__()
                self._stack.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        for ctx in reversed(self._stack):
            ctx.__exit__(*exc)


# ------------------------------------------------------------------ a backward's own noise
#: further passes taken first where a replay's gradients differ from the reference's: this
#: many of the reference's backward, and one of the replay's own
NOISE_SAMPLES = 2
#: where that leaves a gradient close (see :meth:`GradNoise.close`), more of the reference's,
#: doubling, up to this many in all: enough that a kernel's noise is seen at its full width
NOISE_SAMPLES_MAX = 16
#: a replay within this many times the spread of the passes matches
NOISE_FACTOR = 4.0
#: and, where the reference is noisy at all, within this many units in the last place of the
#: gradient's dtype at its largest magnitude (a tensor whose passes agreed by chance)
NOISE_FLOOR_ULPS = 4.0
#: a gradient beyond its allowance by less than this factor is close: a noise-sized gap, which
#: more passes settle; a missed state's effect is orders of magnitude beyond (no more passes)
NOISE_CLOSE = 256.0


class GradNoise:
    """The kernels' own run-to-run spread, per gradient: the widest an element of it ranges
    over the reference's backward passes (all from the forward's saved tensors), or over the
    replay's passes (all from its own): a spread is the kernels' nondeterminism, never a
    difference of state, since each range is taken over passes from the same saved tensors.

    A reference whose passes agree bit for bit is exact: the replay must then be too. A noisy
    one admits, per gradient, :data:`NOISE_FACTOR` times its spread, and at least
    :data:`NOISE_FLOOR_ULPS` units in the last place of the gradient's dtype at its largest
    magnitude. A replay that misses state differs by the size of that state's effect, orders
    of magnitude above the last bits.

    Why a range, and why more passes when close (see :func:`measure_noise`): with an exact
    replay, its first pass is one more draw of the same noise as the reference's passes, so
    its gap to the reference's first pass is one of the pairwise differences of those draws.
    Measured against the first pass alone, from 2 further passes, the spread is the largest
    of 2 such differences, and a third (the replay's gap) exceeds 4 times it whenever those
    2 fell small by chance (a tensor of few elements, ulp noise that is often 0): a false
    divergence, now and then. The range over all passes is the largest pairwise difference,
    and from 17 passes the chance that one more difference exceeds 4 times the largest of
    their 136 is nil for any noise of bounded width (ulps moved, atomics' order).

    Example:
        >>> ref = (torch.ones(3),)
        >>> noise = GradNoise(ref, [(torch.ones(3) + torch.tensor([0.0, 1e-7, 0.0]),)])
        >>> noise.noisy, noise.allowance(0, ref[0]) > 1e-7
        (True, True)
        >>> GradNoise(ref, [(torch.ones(3),)]).noisy
        False
    """

    def __init__(
        self,
        ref: tuple,
        samples: list[tuple] | tuple = (),
        rep: tuple = (),
        rep_samples: list[tuple] | tuple = (),
    ) -> None:
        self.ref, self.rep = tuple(ref), tuple(rep)
        self.spread = [0.0] * len(self.ref)
        self.samples = 1  # the reference's passes
        self.replay_passes = 1 if self.rep else 0
        self._bounds: dict[str, list] = {
            "reference": [_bounds(t) for t in self.ref],
            "replay": [_bounds(t) for t in self.rep],
        }
        self._gaps: list[float | None] | None = None
        for s in samples:
            self.add(s)
        for s in rep_samples:
            self.add(s, replay=True)

    @property
    def noisy(self) -> bool:
        return any(s > 0 for s in self.spread)

    def add(self, grads: tuple, replay: bool = False) -> None:
        """One more backward pass: of the replay's graph from its own saved tensors
        (``replay``), else from the forward's (the reference's). Kept as a range, not kept."""
        bounds = self._bounds["replay" if replay else "reference"]
        if replay:
            self.replay_passes += 1
        else:
            self.samples += 1
        for i, g in enumerate(grads):
            if i >= len(bounds) or g is None or bounds[i] is None:
                continue
            lo, hi = bounds[i]
            g = _real(g.detach())
            if g.shape != lo.shape or g.dtype != lo.dtype:
                continue
            lo, hi = torch.fmin(lo, g), torch.fmax(hi, g)
            bounds[i] = (lo, hi)
            width = (hi.double() - lo.double()).nan_to_num(nan=0.0)
            if width.numel():
                self.spread[i] = max(self.spread[i], float(width.max()))

    def allowance(self, i: int, ref: torch.Tensor) -> float:
        """How far the replay's gradient ``i`` may be from the reference's ``ref``."""
        floor = 0.0
        if ref.is_floating_point() and ref.numel():
            top = float(ref.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())
            floor = NOISE_FLOOR_ULPS * torch.finfo(ref.dtype).eps * top
        return max(NOISE_FACTOR * self.spread[i], floor)

    def gaps(self) -> list[float | None]:
        """Per gradient, the largest elementwise difference between the replay's first pass
        and the reference's, or None where they agree bit for bit (or one is missing)."""
        if self._gaps is None:
            self._gaps = [
                None if a is None or b is None or bitwise_equal(a, b) else max_abs_diff(a, b)
                for a, b in zip(self.ref, self.rep)
            ]
        return self._gaps

    def beyond(self) -> list[int]:
        """The gradients the replay differs in beyond what the passes so far admit: any
        difference while every pass agreed, else one past :meth:`allowance`."""
        noisy = self.noisy
        return [
            i
            for i, gap in enumerate(self.gaps())
            if gap is not None and (not noisy or not gap <= self.allowance(i, self.ref[i]))
        ]

    def close(self) -> bool:
        """Some gradient is beyond what the passes admit, each such by a noise-sized gap
        (within :data:`NOISE_CLOSE` times its allowance, floor included): more passes may
        show the kernels' noise wider than the first few did."""
        out = self.beyond()
        return bool(out) and all(
            self.gaps()[i] <= NOISE_CLOSE * self.allowance(i, self.ref[i]) for i in out
        )

    def detail(self, within: list[str], matched: bool) -> dict[str, Any]:
        """The record's account of the noise (its ``detail["noise"]``)."""
        top = max(self.spread) if self.spread else 0.0
        summary = (
            f"matched within the kernels' own run-to-run spread of {top:.3g}"
            if matched
            else f"differs beyond the kernels' own run-to-run spread of {top:.3g}"
        )
        return {
            "summary": summary,
            "spread": top,
            "reference_passes": self.samples,
            "replay_passes": self.replay_passes,
            "factor": NOISE_FACTOR,
            "floor_ulps": NOISE_FLOOR_ULPS,
            "tensors": within[:16],
        }


def measure_noise(
    ref: tuple,
    rep: tuple,
    reference_pass: Callable[[], tuple],
    replay_pass: Callable[[], tuple],
) -> GradNoise:
    """The spread of the backward's own noise where the replay's gradients ``rep`` differ
    from the reference's ``ref``: one more pass of the replay's and :data:`NOISE_SAMPLES` of
    the reference's; then, while a gradient is :meth:`~GradNoise.close`, as many more of the
    reference's as it has had (2, 4, 8, 16), up to :data:`NOISE_SAMPLES_MAX`. A replay that
    missed state is far from close and costs no more passes; an exact one of a noisy kernel
    whose first passes agreed by chance is judged against the noise's full width.

    Example:
        >>> import os
        >>> def noisy():  # 1 ulp up or not at random, as atomics' order moves a sum
        ...     up = torch.frombuffer(bytearray(os.urandom(4)), dtype=torch.uint8) % 2
        ...     return (torch.where(up == 1, torch.ones(4).nextafter(torch.full((4,), 2.0)), 1.0),)
        >>> noise = measure_noise(noisy(), noisy(), noisy, noisy)
        >>> noise.beyond(), noise.samples >= 1 + NOISE_SAMPLES
        ([], True)
    """
    noise = GradNoise(ref, rep=rep)
    noise.add(replay_pass(), replay=True)
    for _ in range(NOISE_SAMPLES):
        noise.add(reference_pass())
    while noise.samples - 1 < NOISE_SAMPLES_MAX and noise.close():
        for _ in range(min(noise.samples - 1, NOISE_SAMPLES_MAX - (noise.samples - 1))):
            noise.add(reference_pass())
    return noise


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference (NaN in the same place as the other: none)."""
    d = (a.detach().double() - b.detach().double()).abs()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
    return float(d.max()) if d.numel() else 0.0


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _bounds(t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The elementwise (low, high) of one pass: where a range starts."""
    if t is None or not (t.is_floating_point() or t.is_complex()):
        return None
    t = _real(t.detach())
    return t, t


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: a NaN where the other has the same NaN is equal (a model that blew up is
    not a divergence of the replay)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): its parts
        pa, pb = sparse_parts(_coalesced(a)), sparse_parts(_coalesced(b))
        return len(pa) == len(pb) and all(bitwise_equal(x, y) for x, y in zip(pa, pb))
    if torch.equal(a, b):
        return True
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _coalesced(t: torch.Tensor) -> torch.Tensor:
    """COO coalesced (the same gradient may list its entries in another order, or a row
    twice); other layouts as they are."""
    t = t.detach()
    return t.coalesce() if t.layout == torch.sparse_coo else t
