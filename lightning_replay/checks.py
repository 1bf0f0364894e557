"""Where a check is decided: derivative and byte checks of replays, and how they compare.

A derivative-checked call keeps its reference graph and replays beside it at backward
(:class:`_CheckedSegment`); gradients are compared bit for bit, or within a tolerance by dtype on
a nondeterministic device; byte checks compare digests of contract state and outputs. A
divergence makes the segment react (re-probe, then retain). Training always uses the
reference gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from lightning_replay._compat import top_saved_tensors_hooks, tree_map, tree_unflatten
from lightning_replay.accounting import Saved
from lightning_replay.errors import ReplayError
from lightning_replay.restore import _BytesSandbox, _Invocation, _ReplayContext
from lightning_replay.slots import (
    capture_slots,
    slot_tensors,
)
from lightning_replay.state import (
    digests,
    storage_key,
    tensor_leaves,
)

if TYPE_CHECKING:  # annotations only: these modules import this one
    from lightning_replay.runtime import SegmentRuntime


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


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: a NaN where the reference has the same NaN is equal (a model that blew up
    is not a divergence of the replay)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _nondeterministic(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and not torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def _saving_counted(
    saved: dict, exclude: set, where: str, namer: Callable, acct: Any = None
) -> Iterator[None]:
    """Count the storages autograd saves inside the block (each once, ``exclude`` left out,
    and those the accountant ``acct`` counts elsewhere: FSDP's gathered parameters) into
    ``saved``, handing each tensor on to the saved-tensor hooks already active (the memory
    accountant's) or, without any, to a version-checked :class:`Saved` handle."""
    # torch-private, but what torch.utils.checkpoint itself uses to find the active hooks
    top = top_saved_tensors_hooks()
    outer_pack, outer_unpack = top if top is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key is not None and key not in exclude and not (acct is not None and acct.elsewhere(t)):
            saved[key] = t.untyped_storage().nbytes()
        return outer_pack(t) if outer_pack is not None else Saved(t, where, namer)

    unpack = outer_unpack if outer_unpack is not None else Saved.unpack
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    """The differentiable tensors of a segment's output, each once, in order."""
    seen: set[int] = set()
    outs = []
    for t in tensor_leaves(out):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            outs.append(t)
    return outs


@dataclasses.dataclass(slots=True)
class _CheckBox:
    """What the backward of one checked call needs; ``outs`` is emptied when it has run."""

    rt: SegmentRuntime
    inv: _Invocation
    args: tuple  # the call's arguments, differentiable tensors replaced by ``inputs``
    kwargs: dict
    inputs: list[torch.Tensor]  # detached leaves the reference graph starts from
    params: list[torch.Tensor]
    outs: list[torch.Tensor]  # the reference outputs (their graph)
    rng: tuple  # global RNG states at forward (see _rng_states)
    autocast: list
    out_digests: list[int] | None


class _CheckedSegment(torch.autograd.Function):
    """Joins a checked call's reference graph to the model's graph.

    Inputs: the segment's differentiable inputs and parameters (so that autograd, DDP's hooks
    and gradient accumulation see them as usual); outputs: the reference outputs, detached.
    """

    @staticmethod
    def forward(ctx, box: _CheckBox, *inputs_and_params: torch.Tensor):
        ctx.box = box
        return tuple(o.detach() for o in box.outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        box = ctx.box
        ctx.box = None
        if box is None or not box.outs:
            raise ReplayError(
                "a derivative-checked segment's backward ran a second time (backward with "
                "retain_graph=True?). Checked steps free their reference graph after the first "
                "backward; use preservation='retain' for segments whose graph is reused."
            )
        ref = box.rt._compare_grads(box, list(grads))
        return (None, *ref)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """Autocast settings of the current forward, per device type that has autocast."""
    out = []
    for dev in ("cpu", "cuda"):
        if torch.amp.is_autocast_available(dev):
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return out


class SegmentChecks:
    """The derivative and byte checks of one segment (mixed into :class:`~lightning_replay.runtime.SegmentRuntime`)."""

    def _measured_call(self, args: tuple, kwargs: dict) -> Any:
        """A forward that keeps its graph (checked or retained on a checked step), measuring
        what it saves: A(s) at today's shapes (the probe's figure goes stale when shapes
        change)."""
        eng = self.engine
        saved: dict = {}
        exclude = self.state_keys | {storage_key(t) for t in tensor_leaves((args, kwargs))}
        eng._segment_depth += 1
        try:
            with _saving_counted(
                saved, exclude, f"segment {self.name!r}", eng.state_name, eng.accountant
            ):
                out = self.orig_forward(*args, **kwargs)
        finally:
            eng._segment_depth -= 1
        if eng.measure_costs:
            eng.meter.activation_bytes[self.name] = sum(saved.values())
            eng.meter.activation_size[self.name] = eng._window_size
        return out

    def _checked_call(self, args: tuple, kwargs: dict) -> Any:
        """Derivative check: run the segment with its graph, replay it beside it at backward.

        The forward runs ordinarily on detached inputs (the *reference* graph) and its outputs
        reach the model through :class:`_CheckedSegment`, whose backward takes the reference
        gradients from that graph, replays the segment under its contract, compares, and hands
        the reference gradients on: training always uses the reference, and a checked step costs
        one replay forward and backward more than a plain one.
        """
        eng = self.engine
        inv, call, spec = self._prepare(args, kwargs, eng._check_bytes)
        rng = _rng_states(eng._cuda_device)
        autocast = _autocast_state()
        # the reference forward starts from detached leaves with the forward's bytes (a copy
        # where the window changes an argument); gradients reach the live arguments
        in_req, leaves, ref_flat = [], [], list(call)
        for i, x in enumerate(call):
            live = inv.subs[i][0] if i in inv.subs else x
            if isinstance(live, torch.Tensor) and live.requires_grad:
                leaf = x.detach().requires_grad_()
                in_req.append(live)
                leaves.append(leaf)
                ref_flat[i] = leaf
        args2, kwargs2 = (ref_flat, {}) if spec is None else tree_unflatten(ref_flat, spec)
        out = self._measured_call(args2, kwargs2)  # the reference forward keeps its graph
        outs = _grad_outputs(out)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not outs:
            inv.release()
            return out
        box = _CheckBox(
            self,
            inv,
            args2,
            kwargs2,
            leaves,
            params,
            outs,
            rng,
            autocast,
            digests(tensor_leaves(out)) if eng._check_bytes else None,
        )
        bridged = _CheckedSegment.apply(box, *in_req, *params)
        by_id = {id(o): b for o, b in zip(outs, bridged)}
        return tree_map(lambda x: by_id.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    def _compare_grads(
        self, box: "_CheckBox", grads: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Reference and replayed gradients of one checked call; returns the reference."""
        eng = self.engine
        inv = box.inv
        grads = [torch.zeros_like(o) if g is None else g for o, g in zip(box.outs, grads)]
        with torch.enable_grad():
            ref = torch.autograd.grad(box.outs, box.inputs + box.params, grads, allow_unused=True)
            box.outs = []  # the reference graph is freed
            in2 = [a.detach().requires_grad_() for a in box.inputs]
            swap = {id(a): b for a, b in zip(box.inputs, in2)}
            args2, kwargs2 = tree_map(
                lambda x: swap.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                (box.args, box.kwargs),
            )
            # A checked replay leaks nothing into the model, whatever the contract missed:
            # every buffer and tensor attribute of the segment is put back byte for byte
            # (slots, generators and the global RNG are put back by the replay context and
            # fork_rng). Backward runs outside the forward's autocast: re-enter it, as
            # checkpoint does for its own recomputation.
            sandbox = _BytesSandbox([t for _, t in slot_tensors(capture_slots(self.modules))])
            try:
                with _ReplayContext(inv), _forked_rng(box.rng), contextlib.ExitStack() as ac:
                    for dev, enabled, dtype in box.autocast:
                        ac.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
                    out2 = self.orig_forward(*args2, **kwargs2)
            finally:
                sandbox.restore()
            outs2 = _grad_outputs(out2)
            if len(outs2) == len(grads) and all(a.shape == b.shape for a, b in zip(outs2, grads)):
                rep = torch.autograd.grad(outs2, in2 + box.params, grads, allow_unused=True)
            else:
                rep = None
        names = [f"input[{i}]" for i in range(len(box.inputs))] + [
            f"{self.name}.{n}" for n, p in self.module.named_parameters() if p.requires_grad
        ]
        bad = []
        if rep is None:
            bad.append(
                f"outputs: the replay produced {len(outs2)} differentiable outputs "
                f"{[tuple(t.shape) for t in outs2]}, the forward "
                f"{[tuple(g.shape) for g in grads]}"
            )
        tolerated = []
        tol = (GRAD_RTOL, GRAD_ATOL)
        if rep is not None:
            for n, a, b in zip(names, ref, rep):
                if (a is None) != (b is None):
                    bad.append(f"{n}: missing")
                elif a is not None and not _bitwise_equal(a, b):
                    diff = f"max abs diff {float((a.double() - b.double()).abs().max()):.3g}"
                    rtol, atol = grad_tolerance(a.dtype)
                    if _nondeterministic(a) and torch.allclose(a, b, rtol=rtol, atol=atol):
                        tolerated.append(f"{n}: {diff}")
                        tol = max(tol, (rtol, atol))
                    else:
                        bad.append(f"{n}: {diff}")
        self.checks += 1
        if bad:
            self.divergences += 1
        detail = {"compared": len(names), "differ": bad[:16]}
        if tolerated:
            detail["within_tolerance"] = {"rtol": tol[0], "atol": tol[1], "tensors": tolerated[:16]}
        eng.records.append(
            step=inv.step,
            segment=self.name,
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
                self.divergences += 1
                diverged = True
            eng.records.append(
                step=inv.step,
                segment=self.name,
                contract_version=inv.version,
                check="bytes",
                outcome="match" if same else "divergence",
                detail={"what": "replayed outputs", "outputs": len(d2)},
            )
        if diverged:
            self._diverged(inv)
        return list(ref)

    def _diverged(self, inv: _Invocation) -> None:
        """A check saw a replay differ. The step itself trained on the reference (derivative
        check) or the contract state was found wrong (byte check); from now on: the first time,
        re-probe the segment and extend its contract; the second time, retain it for good
        (exact by construction)."""
        if self.demoted:
            return
        eng = self.engine
        self.reactions += 1
        if self.reactions == 1:
            action = "re-probe"
            if self.status in ("active", "retain"):
                self.status = "probe"
        else:
            action = "retain"
            self.demoted = True
            self.planned_option = "retain"
            if self.contract is not None:
                self.contract.apply_option("retain")
                self._derive()
            if self.status in ("active", "retain"):
                self.status = "retain"
        eng.records.append(
            step=inv.step,
            segment=self.name,
            contract_version=inv.version,
            check="reaction",
            outcome="rejection",
            detail={"action": action, "divergences": self.divergences},
        )
        eng._contracts_changed()

    def _check_state_digests(self, inv: _Invocation) -> None:
        eng = self.engine
        now = digests([t for _, t in inv.tensors])
        bad = [e.name for (e, _), a, b in zip(inv.tensors, inv.digests, now) if a != b]
        self.checks += 1
        if bad:
            self.divergences += 1
        eng.records.append(
            step=inv.step,
            segment=self.name,
            contract_version=inv.version,
            check="bytes",
            outcome="divergence" if bad else "match",
            detail={"what": "contract state at replay", "compared": len(now), "differ": bad[:16]},
        )
        if bad:
            self._diverged(inv)
