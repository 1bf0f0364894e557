"""Nothing the engine touches outlives its step unless the contract preserves it (issue 31).

The referees here are the process's own, never the engine's counters: the live tensor storages a
walk of the garbage collector finds (:func:`~tests.helpers.torch_memory.process_tensor_storages`),
weak references, and the profiler's allocation events. Three real models (torchvision ResNet-50
at 64 px, HF GPT-2 and a tiny HF Llama, built from configs), trained with AdamW, every block a
segment:

- between steps, from the second on (probe, calibration, planned steps), the whole process
  holds no more under replay than under ``torch.utils.checkpoint`` on the same blocks, beyond
  the bytes the engine preserves and 1 MiB;
- after ``engine.uninstall()`` and dropping the model and its optimizer, every tensor that was
  alive between steps is dead, with the cyclic garbage collector off: no reference cycle keeps
  one, and the engine (still referenced) holds none;
- under ``budget="min"`` the real whole-process peak of a planned step is within 2 % of torch
  checkpoint's plus the preserved bytes.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.verify import torch_checkpoint
from tests.helpers.torch_memory import allocation_peak

MiB = 2**20


def _resnet50() -> tuple[nn.Module, list[str], Callable[[int], Any]]:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet50(num_classes=10)
    names = [n for n, _ in model.named_modules() if n.startswith("layer") and n.count(".") == 1]

    def batch(step: int) -> torch.Tensor:
        return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(step))

    return model, names, batch


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (8, 128), generator=torch.Generator().manual_seed(step))


def _gpt2() -> tuple[nn.Module, list[str], Callable[[int], Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=128, n_embd=128, n_layer=3, n_head=2, use_cache=False
    )  # dropout 0.1 everywhere (GPT-2's default)
    model = transformers.GPT2LMHeadModel(config)
    return model, [f"transformer.h.{i}" for i in range(3)], _tokens


def _llama() -> tuple[nn.Module, list[str], Callable[[int], Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.1,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    return model, [f"model.layers.{i}" for i in range(3)], _tokens


MODELS = {"resnet50": _resnet50, "gpt2": _gpt2, "llama": _llama}


Build = Callable[[], tuple[nn.Module, list[str], Callable[[int], Any]]]


def _build(name: str, build: Build | None = None) -> tuple[nn.Module, list[str], Callable]:
    """``MODELS[name]``'s model, or ``build``'s (another file's model, under its own name)."""
    torch.manual_seed(0)
    return (build or MODELS[name])()


def _loss(out: Any) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return out.float().pow(2).mean()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: Any) -> None:
    _loss(model(x)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


#: budget="min": the probe, calibration (a warm-up and a timed step per phase: replay,
#: regions), then planned steps; no budget: the probe, then steady steps
STEPS = {"min": 6, "none": 4}
PEAKS = 1  # the last steps' whole-process peaks are measured (budget="min")


def _storage_ptr(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or t.layout != torch.strided:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _Walk:
    """The process's live tensors, walked between steps with the cyclic collector off.

    A full walk of the garbage collector's objects takes about half a second here; with the
    collector off, every object made since the full collection before the run stays in the
    youngest generation, so each step walks that one and re-checks the older tensors (seen
    once, by weak reference). Should anything run a collection meanwhile, it walks all.
    """

    def __init__(self, keep: list[torch.Tensor] = ()) -> None:
        self.exclude: set[int] = set()
        self.collections = self._collections()
        self.old: list[tuple[weakref.ref, int, int]] = []  # (tensor, storage, bytes)
        #: tensors alive before the run with no CPU storage to exclude them by (zero-size,
        #: meta or fake tensors: storage pointer 0), except ``keep`` (the model's): excluded by
        #: identity. By storage they were all watched: a zero-size tensor an earlier test left
        #: alive (a dynamo cache's fake tensors, an autograd graph a cached model holds) was
        #: reported alive after this run's uninstall, once per step (issue 31)
        self.before: dict[int, weakref.ref] = {}
        kept = {id(t) for t in keep}
        for obj in _objects(None):
            ptr = _storage_ptr(obj)
            self.old.append((weakref.ref(obj), ptr, obj.untyped_storage().nbytes() if ptr else 0))
            if not ptr and id(obj) not in kept:
                self.before[id(obj)] = weakref.ref(obj)

    def _watched(self, obj: torch.Tensor, ptr: int) -> bool:
        """Whether ``obj`` (storage ``ptr``) is one this run's referee watches."""
        if ptr:
            return ptr not in self.exclude
        r = self.before.get(id(obj))
        return r is None or r() is not obj

    def old_storages(self) -> dict[int, int]:
        return {ptr: n for r, ptr, n in self.old if ptr and r() is not None}

    @staticmethod
    def _collections() -> int:
        return sum(s["collections"] for s in gc.get_stats())

    def __call__(self) -> tuple[int, list[weakref.ref]]:
        """The process's live tensor bytes (each storage once, as
        :func:`process_tensor_storages` counts them) and weak references to every live tensor
        whose storage is not in ``exclude`` (and that is not one of ``before``)."""
        seen: dict[int, int] = {}
        refs = []
        if self._collections() != self.collections:
            young, old = _objects(None), []
        else:
            young, old = _objects(0), self.old
        for r, ptr, nbytes in old:
            obj = r()
            if obj is not None:
                if ptr:
                    seen[ptr] = nbytes
                if self._watched(obj, ptr):
                    refs.append(r)
            del obj
        for obj in young:
            ptr = _storage_ptr(obj)
            if ptr:
                seen[ptr] = obj.untyped_storage().nbytes()
            if self._watched(obj, ptr):
                refs.append(weakref.ref(obj))
        return sum(seen.values()), refs


def _objects(generation: int | None) -> list[torch.Tensor]:
    """The live tensors the garbage collector tracks (in ``generation``, or all)."""
    objs = gc.get_objects() if generation is None else gc.get_objects(generation)
    with warnings.catch_warnings():  # isinstance on a deprecated lazy object warns
        warnings.simplefilter("ignore")
        return [o for o in objs if issubclass(type(o), torch.Tensor)]


def _describe(obj: object) -> str:
    """A short name for an object that holds a tensor: its type, and what says where it is
    from (a function's or frame's code, a dict's keys, a module-level name)."""
    kind = type(obj).__name__
    if isinstance(obj, dict):
        keys = [k for k in list(obj)[:6] if isinstance(k, str)]
        return f"dict{keys}"
    if isinstance(obj, (list, tuple, set)):
        return f"{kind}[{len(obj)}]"
    code = getattr(obj, "f_code", None) or getattr(obj, "__code__", None)
    if code is not None:
        return f"{kind} {code.co_qualname} ({code.co_filename.rsplit('/', 2)[-1]}:{code.co_firstlineno})"
    return f"{type(obj).__module__}.{kind}"


def _holders(t: torch.Tensor, skip: tuple = (), depth: int = 3) -> list[str]:
    """The chains of referrers of ``t`` up to ``depth`` levels (``gc.get_referrers``), as
    ``holder <- holder's holder`` lines; frames of this file and the objects in ``skip`` (the
    caller's own lists) left out."""
    chains: list[str] = []
    ours = {id(o) for o in skip}

    def walk(obj: object, path: list[str], seen: frozenset) -> None:
        found = gc.get_referrers(obj)
        ours.add(id(found))  # (this walk's own lists refer to what they hold)
        refs = tuple(
            r
            for r in found
            if id(r) not in ours
            and id(r) not in seen
            and not (inspect.isframe(r) and r.f_code.co_filename == __file__)
        )
        ours.add(id(refs))
        del found
        if not refs or len(path) >= depth:
            chains.append(" <- ".join(path) or "(no referrer: a C reference)")
            return
        for k in range(min(len(refs), 3)):
            walk(refs[k], path + [_describe(refs[k])], seen | {id(refs[k])})

    walk(t, [], frozenset({id(chains)}))
    return chains


@functools.cache
def _run(name: str, arm: str, build: Build | None = None) -> dict[str, Any]:
    """Train a copy of the model for ``STEPS`` steps with AdamW under torch checkpoint
    (``arm="torch"``) or ``lr.install`` (``arm``: ``"none"`` for no budget, or ``"min"``),
    with the cyclic garbage collector off. Per step: the whole process's live tensor bytes
    after it (``held``) and the engine's preserved bytes then; the whole-process peak of the
    last ``PEAKS`` steps; then, after uninstall and ``del model, optimizer``: what is still
    alive of every tensor that was alive between steps. (Cached: each test reads one run.)"""
    proto, names, batch = _build(name, build)
    steps = max(STEPS.values()) if arm == "torch" else STEPS[arm]
    batches = [batch(i) for i in range(steps)]
    model = copy.deepcopy(proto)
    del proto
    gc.collect()  # (then everything made during the run is in the youngest generation)
    enabled = gc.isenabled()
    gc.disable()
    try:
        walk = _Walk(keep=list(model.parameters()) + list(model.buffers()))
        # what the test itself keeps (the batches, what the process held before): all else dies
        walk.exclude = set(walk.old_storages()) - {
            _storage_ptr(t) for t in list(model.parameters()) + list(model.buffers())
        }
        if arm == "torch":
            engine = None
            torch_checkpoint(model, names)
        else:
            budget = None if arm == "none" else arm
            engine = lr.install(model, names, budget=budget, calibration_steps=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(1)  # the same dropout draws in every arm
        out: dict[str, Any] = {"held": [], "preserved": [], "peaks": [], "planned_at": None}
        refs: list[weakref.ref] = []
        for i, x in enumerate(batches):
            if arm != "none" and i >= steps - PEAKS:
                # whole_step_peak's figure: the live storages when the step begins (the walk
                # after the step before) + the profiler's net peak inside it
                peak = allocation_peak(lambda m=model, o=opt, b=x: _step(m, o, b))
                out["peaks"].append(out["held"][-1] + peak)
            else:
                _step(model, opt, x)
            if engine is not None and engine.plan is not None and out["planned_at"] is None:
                out["planned_at"] = i  # (the plan is made as the window of step i begins)
            held, alive = walk()
            out["held"].append(held)
            out["preserved"].append(engine.preserved_bytes if engine is not None else 0)
            if engine is not None:
                refs += alive
            del alive
        if engine is not None:
            out["plan_preserved"] = engine.window_stats()["preserved_bytes"]
            engine.uninstall()
        del model, opt, x
        alive = [r() for r in refs]
        out["alive"] = [(tuple(t.shape), str(t.dtype)) for t in alive if t is not None]
        # who holds them (the first few): the failure message names the holders
        survivors = [t for t in alive if t is not None][:5]
        out["holders"] = [_holders(t, (alive, refs, survivors)) for t in survivors]
        del survivors
        out["watched"] = len(refs)
        out["engine"] = engine
        del alive
    finally:
        gc.collect()  # (torch_checkpoint's wrappers close over their modules: a cycle)
        if enabled:
            gc.enable()
    return out


ARMS = [(n, a) for n in sorted(MODELS) for a in ("none", "min") if (n, a) != ("resnet50", "none")]


@pytest.mark.parametrize("name,arm", ARMS)
def test_held_between_steps_is_torch_checkpoints(name, arm):
    """(a) Every step after the first (probe, calibration, planned steps), the process holds
    what it holds under torch checkpoint, plus at most the engine's preserved bytes and 1 MiB:
    no probe's observations, first-touch copies, saved copies or caches."""
    check_held(name, arm)


def check_held(name: str, arm: str, build: Build | None = None) -> None:
    """(a)'s referee, for ``MODELS[name]`` or ``build``'s model."""
    ref, rep = _run(name, "torch", build), _run(name, arm, build)
    over = [
        (i, (r - t) / MiB, p / MiB)
        for i, (r, t, p) in enumerate(zip(rep["held"], ref["held"], rep["preserved"]))
    ]
    bad = [o for o in over[1:] if o[1] > o[2] + 1]
    assert not bad, f"(step, MiB held beyond torch checkpoint, MiB preserved): {over}"


@pytest.mark.parametrize("name,arm", ARMS)
def test_uninstall_leaves_no_tensor_alive_without_the_cyclic_collector(name, arm):
    """(b) After uninstall and ``del model, optimizer``, with the cyclic garbage collector off
    from install on, every tensor that was alive between steps (the engine's included) is
    dead: no reference cycle and nothing the engine still references keeps one."""
    check_dead(name, arm)


def check_dead(name: str, arm: str, build: Build | None = None) -> None:
    """(b)'s referee, for ``MODELS[name]`` or ``build``'s model."""
    rep = _run(name, arm, build)
    assert rep["watched"]
    alive = rep["alive"]
    assert not alive, (
        f"{len(alive)} tensors still alive, e.g. {sorted(set(alive))[:20]}; held by "
        f"{rep['holders']}"
    )
    assert rep["engine"].summary()  # the engine itself stays usable for its records
    assert rep["engine"].model is None


@pytest.mark.parametrize("name", list(MODELS))
def test_lowest_plan_peaks_as_torch_checkpoint(name):
    """(c) Under ``budget="min"``, a planned step's real whole-process peak (live storages at
    its start + the profiler's peak inside it) is at most 1.02 x torch checkpoint's plus the
    bytes the plan preserves."""
    check_lowest(name)


def check_lowest(name: str, build: Build | None = None) -> None:
    """(c)'s referee, for ``MODELS[name]`` or ``build``'s model."""
    ref, rep = _run(name, "torch", build), _run(name, "min", build)
    assert rep["planned_at"] is not None and rep["planned_at"] <= STEPS["min"] - PEAKS
    preserved = rep["plan_preserved"]
    assert max(rep["peaks"]) <= 1.02 * max(ref["peaks"]) + preserved, (
        f"replay {[p / MiB for p in rep['peaks']]} MiB, torch checkpoint "
        f"{[p / MiB for p in ref['peaks']]} MiB, preserved {preserved / MiB:.2f} MiB"
    )
