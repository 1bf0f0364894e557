"""``lr.diagnose``: what activation checkpointing does to *your* model, measured before you trust it.

:func:`diagnose` trains a few steps on deep copies of a model — never on the model itself — and
reports:

* per segment, the state its forward reads and writes (parameters, buffers, tensor attributes,
  tensors shared between modules, inputs that alias state, generators, Python attributes), what
  of it changes between the forward and the replay, which preservation ``auto`` would choose and
  what it keeps, and the activation bytes recomputation would free (from the replay engine's
  probe: :func:`lightning_replay.install` on a copy);
* what ``torch.utils.checkpoint`` (non-reentrant, ``preserve_rng_state=True``, on the same
  segments) does to the model, **measured**: the same steps from identical copies and RNG state,
  with and without it, and which gradients and buffers differ and by how much, or the error it
  raises. A model that already checkpoints itself (HF ``gradient_checkpointing_enable()``, torch's
  or Lightning's ``checkpoint_wrapper``) is diagnosed as it stands against the same model with
  its checkpointing turned off;
* what ``lightning_replay`` does on the same segments, measured the same way;
* with ``selective=`` (``"matmul"`` by default), torch's own selective checkpoint and
  ``lightning_replay``'s selective option under that policy, measured the same way (the
  report's methods table puts every run side by side).

The report's types and its text, JSON and HTML forms are in :mod:`lightning_replay.doctor_report`
(re-exported here). The core never imports Lightning; ``lightning-replay doctor --config`` is the
command-line shell.

It is long (over 600 lines once ruff-formatted) because it runs each way of checkpointing a
model (three wrappers, torch checkpoint, replay) on copies and compares them; the report types
and their forms are in :mod:`~lightning_replay.doctor_report`.

Example:
    >>> import lightning_replay as lr
    >>> from lightning_replay.demos.hazards import HAZARDS
    >>> h = HAZARDS["batch_norm"]()
    >>> report = lr.diagnose(h.model, h.make_input)
    >>> report.verdict
    'torch checkpoint silently differs in 0 gradients and 6 buffers'
    >>> report.replay.exact
    True
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_replay.config import check_count
from lightning_replay.contract import ReplayContract
from lightning_replay.doctor_report import (
    CheckpointOutcome,
    DoctorReport,
    GradientDiff,
    SegmentDiagnosis,
    StateDiff,
    StateUse,
    first_line,
    plural,
)
from lightning_replay.errors import ReplayConfigError, ReplayError, SegmentError
from lightning_replay.host_rng import HostRNG, as_host_rng, global_rngs, same_state
from lightning_replay.segments import SegmentSpec, default_segments, resolve_segments
from lightning_replay.selective import POLICIES, checkpoint_kwargs, torch_sac_context_fn
from lightning_replay.state import PLAIN_TYPES

__all__ = [
    "CheckpointOutcome",
    "DoctorReport",
    "GradientDiff",
    "ModelRunError",
    "SegmentDiagnosis",
    "StateDiff",
    "StateUse",
    "diagnose",
]

BatchFn = Callable[[int], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]

_LR = 1e-2


class ModelRunError(ReplayError, RuntimeError):
    """The model, without any recomputation, fails on the batch ``batch_fn`` gave."""


# ------------------------------------------------------------------------------ diagnose
def diagnose(
    model: nn.Module,
    batch_fn: BatchFn,
    loss_fn: LossFn | None = None,
    segments: SegmentSpec | Iterable[SegmentSpec] | None = None,
    steps: int = 2,
    *,
    seed: int = 0,
    lr: float = _LR,
    selective: str | None = "matmul",
) -> DoctorReport:
    """Measure what activation checkpointing does to ``model``, on copies of it.

    Three runs of ``steps`` SGD steps each, every one from a fresh ``copy.deepcopy(model)`` in
    training mode and the same RNG state (torch's global generators are seeded with
    ``seed + step`` before each step's ``batch_fn``): plain training (the reference), torch
    checkpoint on the segments, and ``lightning_replay`` on the segments. Gradients are compared
    bit for bit at every step; buffers, tensor attributes, generator states and public plain
    Python attributes after the last step. ``model`` itself, its hooks and torch's global RNG
    state are left exactly as they were.

    Args:
        model: the model, on the device it trains on.
        batch_fn: ``batch_fn(step) -> batch`` for ``step`` in ``range(steps)``, on the model's
            device. It is called once per step and run; it may draw from torch's global RNG.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, called with the copy being trained.
            ``None``: ``model(batch)`` (``model(*batch)`` for a tuple or list, ``model(**batch)``
            for a dict), and the loss is the output's ``.loss`` / ``["loss"]`` when it has one
            (HF models given labels), else ``mean(output ** 2)``.
        segments: what to recompute: names, glob patterns, module classes or a callable (as
            for :func:`lightning_replay.install`). ``None``: the modules the model's own
            checkpointing covers when it has any, else the parameterized children of its largest
            ``ModuleList``/``Sequential``.
        steps: training steps per run (at least 1; 2 shows state carried from step to step).
        seed: base seed of each step's RNG state.
        lr: SGD learning rate of the runs (only so that later steps see updated parameters).
        selective: a selective policy (:data:`lightning_replay.selective.POLICIES`): two more
            runs compare selective recomputation with plain training, torch's own selective
            checkpoint (``create_selective_checkpoint_contexts`` with the same op list) and
            ``lightning_replay``'s selective option (``preservation="selective"``). ``None``:
            not run.

    Returns:
        A :class:`DoctorReport`.

    Raises:
        ReplayConfigError: bad arguments, a loss that is not a differentiable scalar, a batch
            on another device than the model.
        SegmentError: no candidate segments, or none of them runs in a training step.
        ModelRunError: the model fails on the batch without any recomputation.

    Example:
        >>> import torch, lightning_replay as lr
        >>> from lightning_replay.demos.hazards import HAZARDS
        >>> h = HAZARDS["stateless"]()
        >>> lr.diagnose(h.model, h.make_input, steps=1).verdict
        'torch checkpoint is exact on this model'
    """
    if not isinstance(model, nn.Module):
        raise ReplayConfigError(
            f"diagnose(model=...) must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not callable(batch_fn):
        raise ReplayConfigError(
            f"diagnose(batch_fn=...) must be a callable step -> batch, got "
            f"{type(batch_fn).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ReplayConfigError(
            f"diagnose(loss_fn=...) must be None or a callable "
            f"(model, batch) -> loss, got {type(loss_fn).__name__}"
        )
    check_count("diagnose", "steps", steps)  # 2 shows state carried between steps
    if selective is not None and selective not in POLICIES:
        raise ReplayConfigError(
            f"diagnose(selective={selective!r}) is not known; use one of {list(POLICIES)} or None"
        )

    existing = _ExistingCheckpointing.find(model)
    names, origin = _choose_segments(model, segments, existing)
    devices = _model_devices(model)
    with torch.random.fork_rng(devices=_cuda_indices(devices)), _host_fork():
        _check_batch_device(model, batch_fn, seed, devices)
        run = _Runner(batch_fn, loss_fn, steps, seed, lr, existing)

        ref = run.plain_copy(model)
        ref_grads = run.reference(ref)
        ref_state = _snapshot(ref)
        del ref

        ckpt_model = copy.deepcopy(model).train()
        if existing is not None:
            method = existing.description
        else:
            method = "torch.utils.checkpoint"
            _wrap_torch_checkpoint(ckpt_model, names)
        torch_outcome = run.compare(method, ckpt_model, ref_grads, ref_state)
        del ckpt_model

        replay_model = run.plain_copy(model)
        diagnoses, not_run, replay_outcome = run.replay(replay_model, names, ref_grads, ref_state)
        del replay_model

        torch_sac = replay_sac = None
        if selective is not None:
            # the same segments and op list: torch's selective checkpoint (state-unaware),
            # then lightning_replay's selective option
            sac_model = run.plain_copy(model)
            _wrap_torch_checkpoint(sac_model, names, selective)
            torch_sac = run.compare(
                f"torch selective checkpoint ({selective!r})", sac_model, ref_grads, ref_state
            )
            del sac_model
            sac_model = run.plain_copy(model)
            replay_sac = run.replay(sac_model, names, ref_grads, ref_state, selective=selective)[2]
            del sac_model

    if not diagnoses and replay_outcome.error is None:
        raise SegmentError(
            f"none of the segments {names} ({origin}) of {type(model).__name__} ran in a "
            "training step, so there is nothing to recompute. Pass segments= naming modules "
            "that the forward (or loss_fn) calls with gradients enabled."
        )
    return DoctorReport(
        model=type(model).__name__,
        steps=steps,
        segments=names,
        segment_origin=origin,
        existing_checkpointing=existing.description if existing else None,
        diagnoses=diagnoses,
        torch_checkpoint=torch_outcome,
        replay=replay_outcome,
        not_run=not_run,
        selective_policy=selective,
        torch_selective=torch_sac,
        replay_selective=replay_sac,
    )


# ------------------------------------------------------------------------------ runs
class _Runner:
    def __init__(
        self,
        batch_fn: BatchFn,
        loss_fn: LossFn | None,
        steps: int,
        seed: int,
        lr: float,
        existing: "_ExistingCheckpointing | None",
    ) -> None:
        self.batch_fn = batch_fn
        self.loss_fn = loss_fn
        self.steps = steps
        self.seed = seed
        self.lr = lr
        self.existing = existing

    def plain_copy(self, model: nn.Module) -> nn.Module:
        """A training-mode copy with the model's own checkpointing (if any) turned off."""
        m = copy.deepcopy(model).train()
        if self.existing is not None:
            self.existing.disable(m)
        return m

    def _train(
        self,
        model: nn.Module,
        on_grads: Callable[[int, dict], None],
        window: Callable[[], Any] | None = None,
        plain: bool = False,
    ) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ReplayConfigError(
                f"{type(model).__name__} has no parameter that requires "
                "grad: there is nothing to train and nothing to diagnose"
            )
        opt = torch.optim.SGD(params, lr=self.lr)
        for step in range(self.steps):
            _seed_all(self.seed + step)
            batch = self.batch_fn(step)
            opt.zero_grad(set_to_none=True)
            try:
                if window is not None:
                    with window():
                        loss = self._loss(model, batch, step)
                else:
                    loss = self._loss(model, batch, step)
                loss.backward()
            except (ReplayConfigError, ModelRunError):
                raise
            except Exception as exc:
                if plain:
                    raise ModelRunError(
                        f"{type(model).__name__} fails on batch_fn({step}) "
                        f"({_describe(batch)}) without any recomputation: "
                        f"{type(exc).__name__}: {first_line(str(exc))}. Fix the model, "
                        "batch_fn or loss_fn so that a plain training step runs; diagnose "
                        "compares against one."
                    ) from exc
                raise
            on_grads(
                step,
                {
                    n: p.grad.detach().clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                },
            )
            opt.step()

    def _loss(self, model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(model, batch)
            what = "loss_fn(model, batch)"
        else:
            loss = _default_loss(_call(model, batch))
            what = "the model's output (pass loss_fn= to say how to make a loss)"
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            seen = (
                f"a {type(loss).__name__}"
                if not isinstance(loss, torch.Tensor)
                else f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
            )
            raise ReplayConfigError(
                f"diagnose: the loss from {what} at step {step} must be a scalar tensor that "
                f"requires grad; got {seen}"
            )
        return loss

    def reference(self, model: nn.Module) -> list[dict[str, torch.Tensor]]:
        grads: list[dict[str, torch.Tensor]] = []
        self._train(model, lambda step, g: grads.append(g), plain=True)
        return grads

    def compare(
        self,
        method: str,
        model: nn.Module,
        ref_grads: list[dict],
        ref_state: dict,
        window: Callable[[], Any] | None = None,
    ) -> CheckpointOutcome:
        diffs: dict[str, GradientDiff] = {}
        out = CheckpointOutcome(method=method, parameters_compared=len(ref_grads[0]))
        try:
            self._train(
                model, lambda step, g: _grad_diffs(step, ref_grads[step], g, diffs), window=window
            )
        except (ReplayConfigError, ModelRunError):
            raise
        except Exception as exc:  # what the method does to this model: part of the report
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        out.gradients = sorted(diffs.values(), key=lambda d: d.name)
        ignore = self.existing.toggled if self.existing is not None else set()
        out.state = _state_diffs(ref_state, _snapshot(model), ignore)
        return out

    def replay(
        self,
        model: nn.Module,
        names: list[str],
        ref_grads: list[dict],
        ref_state: dict,
        selective: str | None = None,
    ) -> tuple[list[SegmentDiagnosis], list[str], CheckpointOutcome]:
        import warnings

        from lightning_replay.engine import install

        engine = install(
            model,
            names,
            preservation="auto" if selective is None else "selective",
            selective=selective,
            on_violation="record",
            window="manual",
        )
        method = (
            "lightning_replay"
            if selective is None
            else f"lightning_replay selective ({selective!r})"
        )
        try:
            with warnings.catch_warnings():
                # Contract events are the report's subject, not warnings for the user here.
                warnings.simplefilter("ignore")
                outcome = self.compare(method, model, ref_grads, ref_state, window=engine.window)
            contracts = engine.contracts
        finally:
            engine.uninstall()
        diagnoses = [_diagnosis(model, contracts[n]) for n in names if n in contracts]
        return diagnoses, [n for n in names if n not in contracts], outcome


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _default_loss(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is not None:
        return loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out.float().pow(2).mean()
    return out


def _wrap_torch_checkpoint(
    model: nn.Module, names: list[str], selective: str | None = None
) -> None:
    """What a user writes: each segment's forward under non-reentrant torch checkpoint (with
    torch's selective checkpoint under ``selective``'s op list, where given)."""
    extra: dict[str, Any] = {}
    if selective is not None:
        extra = {"context_fn": torch_sac_context_fn(selective), **checkpoint_kwargs()}
    for name in names:
        mod = model.get_submodule(name)
        fwd = mod.forward

        def forward(*args, _fwd=fwd, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            return checkpoint(
                _fwd, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs
            )

        mod.forward = forward


# ------------------------------------------------------------------------------ existing ckpt
class _ExistingCheckpointing:
    """Checkpointing the model does itself: HF layer flags, torch's ``CheckpointWrapper``."""

    def __init__(self, flagged: list[str], wrappers: list[str], hf_layers: list[str]) -> None:
        self.flagged = flagged  # modules with gradient_checkpointing=True (HF style)
        self.wrappers = wrappers  # CheckpointWrapper modules
        self.hf_layers = hf_layers  # flagged modules that checkpoint their own forward
        # Attributes disable() changes: never reported as state differences.
        self.toggled = {
            f"{n}.gradient_checkpointing" if n else "gradient_checkpointing" for n in flagged
        }
        parts = []
        if hf_layers:
            parts.append(
                f"HF gradient checkpointing on {len(hf_layers)} {plural(len(hf_layers), 'layer')}"
            )
        elif flagged:
            parts.append(
                f"gradient_checkpointing=True on {len(flagged)} {plural(len(flagged), 'module')}"
            )
        if wrappers:
            parts.append(f"checkpoint_wrapper on {len(wrappers)} {plural(len(wrappers), 'module')}")
        self.description = " and ".join(parts)

    @classmethod
    def find(cls, model: nn.Module) -> "_ExistingCheckpointing | None":
        wrapper_cls = _checkpoint_wrapper_class()
        hf_layer_cls = _hf_checkpointing_layer_class()
        flagged, wrappers, hf_layers = [], [], []
        for name, mod in model.named_modules():
            if getattr(mod, "gradient_checkpointing", None) is True:
                flagged.append(name)
                if hf_layer_cls is not None and isinstance(mod, hf_layer_cls):
                    hf_layers.append(name)
            if wrapper_cls is not None and isinstance(mod, wrapper_cls):
                wrappers.append(name)
        if not flagged and not wrappers:
            return None
        return cls(flagged, wrappers, hf_layers)

    def segments(self) -> list[str]:
        """The modules it checkpoints, by their inner names where a wrapper is in between."""
        return self.hf_layers + [f"{w}._checkpoint_wrapped_module" for w in self.wrappers]

    def disable(self, model: nn.Module) -> None:
        """Turn it off in ``model`` (a copy) without changing any qualified name."""
        for name in self.flagged:
            model.get_submodule(name).gradient_checkpointing = False
        for name in self.wrappers:
            w = model.get_submodule(name)
            inner = w._checkpoint_wrapped_module
            w.forward = lambda *a, _m=inner, **k: _m(*a, **k)


def _checkpoint_wrapper_class() -> type | None:
    try:  # private module: Lightning's FSDP policy and users import the class from here
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return CheckpointWrapper


def _hf_checkpointing_layer_class() -> type | None:
    """HF transformers' ``GradientCheckpointingLayer``, if transformers is loaded: a model whose
    layers subclass it has imported it, so doctor never imports transformers itself."""
    return getattr(
        sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None
    )


# ------------------------------------------------------------------------------ segments
def _choose_segments(
    model: nn.Module, segments: Any, existing: _ExistingCheckpointing | None
) -> tuple[list[str], str]:
    if segments is not None:
        return list(resolve_segments(model, segments)), f"segments={segments!r}"
    if existing is not None and existing.segments():
        return existing.segments(), "the modules the model's own checkpointing covers"
    try:
        containers, names = default_segments(model)  # the rule strategy="replay" uses
    except SegmentError:
        raise SegmentError(
            f"{type(model).__name__} has no candidate segments: no ModuleList or Sequential of "
            "parameterized blocks below the root, and no checkpointing of its own. Pass "
            "segments= (names such as 'encoder.layers.0', a glob such as 'encoder.layers.*', or "
            "a module class)."
        ) from None
    return names, f"the repeated blocks of {containers}"


# ------------------------------------------------------------------------------ devices
def _model_devices(model: nn.Module) -> set[torch.device]:
    return {t.device for t in list(model.parameters()) + list(model.buffers())}


def _cuda_indices(devices: set[torch.device]) -> list[int]:
    # torch.manual_seed seeds every CUDA device: restore all of them once CUDA is in use.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return sorted(
        {
            d.index if d.index is not None else torch.cuda.current_device()
            for d in devices
            if d.type == "cuda"
        }
    )


def _norm(d: torch.device) -> str:
    if d.type == "cuda" and d.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(d)


def _check_batch_device(
    model: nn.Module, batch_fn: BatchFn, seed: int, devices: set[torch.device]
) -> None:
    torch.manual_seed(seed)
    try:
        batch = batch_fn(0)
    except Exception as exc:
        raise ModelRunError(
            f"batch_fn(0) raised {type(exc).__name__}: {first_line(str(exc))}"
        ) from exc
    model_devs = {_norm(d) for d in devices}
    batch_devs = {_norm(t.device) for t in _tensors(batch)}
    if model_devs and batch_devs and not batch_devs <= model_devs:
        raise ReplayConfigError(
            f"diagnose: the model {type(model).__name__} is on {', '.join(sorted(model_devs))} "
            f"but batch_fn(0) returned tensors on {', '.join(sorted(batch_devs))}. Move the batch "
            "to the model's device in batch_fn (or the model with model.to(device)) first."
        )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _describe(batch: Any) -> str:
    ts = _tensors(batch)
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in ts[:4])
    return (
        f"a {type(batch).__name__}"
        + (f" of tensors {shapes}" if ts else "")
        + (" ..." if len(ts) > 4 else "")
    )


# ------------------------------------------------------------------------------ comparisons
def _grad_diffs(
    step: int,
    ref: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    acc: dict[str, GradientDiff],
) -> None:
    for name in sorted(ref.keys() | got.keys()):
        a, b = ref.get(name), got.get(name)
        if a is not None and b is not None and a.shape == b.shape and torch.equal(a, b):
            continue
        if a is None or b is None or a.shape != b.shape:
            max_abs = max_rel = math.inf
        else:
            d = b.double() - a.double()
            max_abs = float(d.abs().max())
            den = float(a.double().norm())
            max_rel = float(d.norm()) / den if den > 0 else math.inf
        g = acc.setdefault(name, GradientDiff(name, [], 0.0, 0.0))
        g.steps.append(step)
        g.max_abs = max(g.max_abs, max_abs)
        g.max_rel = max(g.max_rel, max_rel)


def _snapshot(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """Non-parameter state by qualified name: (kind, value)."""
    out: dict[str, tuple[str, Any]] = {}
    for mname, mod in model.named_modules():
        p = f"{mname}." if mname else ""
        for k, v in mod.__dict__.items():
            if k == "_buffers":
                for kk, t in v.items():
                    if t is not None:
                        out[p + kk] = ("buffer", t.detach().clone())
            elif k.startswith("_") or k == "training":
                continue
            elif isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                out[p + k] = ("tensor attribute", v.detach().clone())
            elif isinstance(v, torch.Generator):
                out[p + k] = ("generator", v.get_state())
            elif type(v) in PLAIN_TYPES:
                out[p + k] = ("Python attribute", v)
            elif (rng := as_host_rng(v)) is not None:
                out[p + k] = ("generator", _HostState(rng))
    for rng in global_rngs():  # a replay that draws again moves the process's streams
        out[rng.name] = ("generator", _HostState(rng))
    return out


class _HostState:
    """A generator's state outside torch, compared by value (numpy's holds arrays)."""

    def __init__(self, rng: HostRNG) -> None:
        self.state = rng.get_state()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostState) and same_state(self.state, other.state)

    def __repr__(self) -> str:
        return "<generator state>"


class _host_fork:
    """Python's and numpy's global generators put back as they were after the diagnosis,
    which seeds them (like torch's) at each step of each run."""

    def __enter__(self) -> None:
        self._saved = [(r, r.get_state()) for r in global_rngs()]

    def __exit__(self, *exc: Any) -> None:
        for r, st in self._saved:
            r.set_state(st)


def _seed_all(seed: int) -> None:
    """Every step of every run starts from the same random streams: torch's and, for a model
    that draws from them, Python's and numpy's global ones."""
    torch.manual_seed(seed)
    import random

    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


def _state_diffs(ref: dict, got: dict, ignore: set[str]) -> list[StateDiff]:
    diffs = []
    for name in sorted(ref.keys() | got.keys()):
        if name in ignore:
            continue
        if name not in ref or name not in got:
            kind = (ref.get(name) or got.get(name))[0]
            diffs.append(
                StateDiff(
                    name,
                    kind,
                    _short(ref.get(name, (None, "(absent)"))[1]),
                    _short(got.get(name, (None, "(absent)"))[1]),
                )
            )
            continue
        (kind, a), (_, b) = ref[name], got[name]
        if isinstance(a, torch.Tensor):
            if (
                isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            ):
                continue
            diff = StateDiff(name, kind, _short(a), _short(b))
            if kind != "generator" and isinstance(b, torch.Tensor) and a.shape == b.shape:
                d = b.double() - a.double()
                diff.max_abs = float(d.abs().max()) if d.numel() else 0.0
                den = float(a.double().norm())
                diff.max_rel = float(d.norm()) / den if den > 0 else math.inf
            diffs.append(diff)
        elif a != b:
            diffs.append(StateDiff(name, kind, _short(a), _short(b)))
    return diffs


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        if v.numel() == 1:
            return str(v.item())
        return f"tensor{tuple(v.shape)}"
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# ------------------------------------------------------------------------------ contracts
_KINDS = {"attribute": "tensor attribute", "external": "external tensor"}


def _diagnosis(model: nn.Module, c: ReplayContract) -> SegmentDiagnosis:
    rows: list[StateUse] = []
    params = 0
    aliased = set(c.input_aliases)
    for s in c.state:
        if s.kind == "parameter" and not s.changes_in_window and not s.written_by_segment:
            params += 1
            continue
        rows.append(
            StateUse(
                name=s.name,
                kind=_KINDS.get(s.kind, s.kind),
                access="writes" if s.written_by_segment else "reads",
                changes_in_window=s.changes_in_window,
                preservation=s.preservation,
                nbytes=s.nbytes,
                shared_with=list(s.aliases),
                aliased_input=s.name in aliased,
            )
        )
    rows += [
        StateUse(name=g, kind="generator", access="draws", preservation="restored")
        for g in c.generators
    ]
    rows += [
        StateUse(name=a, kind="Python attribute", access="changes", preservation="restored")
        for a in c.python_attrs
    ]
    options = [o for o in c.available_options() if o != "retain"]
    # ``auto``: the cheapest correct option by memory, whole winning ties (the engine's rule).
    auto = min(options, key=lambda o: (c.preserved_bytes(o), o != "whole"))
    return SegmentDiagnosis(
        name=c.segment,
        state=rows,
        parameters=params,
        uses_global_rng=c.uses_global_rng,
        auto_option=auto,
        preserved_bytes=c.preserved_bytes(auto),
        options={o: c.preserved_bytes(o) for o in options},
        activation_bytes=c.activation_bytes,
    )
