"""Exact under real training recipes' segment interfaces (issue 33, classes 1, 2, 3, 7, 8, 9, 12).

Every test trains a model of its own under ``lr.install`` and in plain PyTorch from an
identical deep copy, and asserts bit-identical gradients at every step (or a refusal before the
first step that names the segment and the reason, where the README puts the case out of scope).

* class 1: segment arguments that are no pytree (a dataclass batch, nested ones, a list of
  them, ``__slots__``, a dict subclass, a ``UserDict`` like HF's ``BatchEncoding``, an
  ``ImageList``-like object), with a field written in place or rebound between the forward and
  backward;
* class 2: a strided input (a slice, a transpose, an expanded or channels-last view, an offset
  view) whose base the step writes after the segment: the replay's copy keeps its strides;
* class 3: the user's own saved-tensor hooks around the step;
* class 7: ``torch.func`` transforms over an installed model;
* class 8: a ``torch.jit.script``-ed segment;
* class 9: a ``torch.compile``-d segment or model;
* class 12: state read where the dispatcher cannot see it (``.tolist()``, ``.item()``,
  ``float(t)``, ``.numpy()``), and an in-place op on a sparse buffer.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import warnings
from typing import Any, Callable, NamedTuple

import pytest
import torch
from torch import nn

import lightning_replay as lr

D = 8
B = 4
STEPS = 5
PRESERVATIONS = ["auto", "whole", "regions"]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _diff(a: list[dict], b: list[dict]) -> list[tuple[int, str]]:
    assert len(a) == len(b)
    out = []
    for s, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys(), (s, ga.keys(), gb.keys())
        out += [(s, k) for k in ga if not torch.equal(ga[k], gb[k])]
    return out


# ----------------------------------------------------------------------------- class 1
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass
class Inner:
    x: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Slotted:
    __slots__ = ("x", "w")

    def __init__(self, x: torch.Tensor, w: torch.Tensor) -> None:
        self.x = x
        self.w = w


class ImageListLike:
    """Like torchvision's ``ImageList``: a tensor and the sizes, no pytree."""

    def __init__(self, tensors: torch.Tensor, image_sizes: list[tuple[int, int]]) -> None:
        self.tensors = tensors
        self.image_sizes = image_sizes


class EncodingLike(collections.UserDict):
    """Like HF's ``BatchEncoding``: a ``UserDict`` whose keys read as attributes."""

    def __getattr__(self, item: str) -> Any:
        try:
            return self.data[item]
        except KeyError as exc:
            raise AttributeError(item) from exc


def _batch_encoding(data: dict) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(data)


class TensorDict(dict):
    """A dict subclass with an attribute of its own."""


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Variant:
    make: Callable[[torch.Tensor], Any]  # batch object from a (B, D) tensor
    read: Callable[[Any], torch.Tensor]  # what the segment computes from
    inplace: Callable[[Any], None]  # a tensor of it written in place
    rebind: Callable[[Any], None] | None  # a field rebound to a new tensor


def _set(obj: Any, name: str, v: Any) -> None:
    object.__setattr__(obj, name, v)


VARIANTS = {
    "dataclass": Variant(
        lambda x: Batch(x),
        lambda b: b.x,
        lambda b: b.x.add_(1.0),
        lambda b: _set(b, "x", b.x + 1.0),
    ),
    "dataclass_scale": Variant(
        lambda x: Batch(x, 2.0),
        lambda b: b.x * b.scale,
        lambda b: b.x.mul_(0.5),
        lambda b: _set(b, "scale", 3.0),
    ),
    "nested": Variant(
        lambda x: Outer(Inner(x), (x > 0).float()),
        lambda b: b.inner.x * b.mask,
        lambda b: b.mask.zero_(),
        lambda b: _set(b.inner, "x", b.inner.x * 2),
    ),
    "list_of_dataclasses": Variant(
        lambda x: [Batch(x), Batch(x.flip(0))],
        lambda bs: bs[0].x + bs[1].x,
        lambda bs: bs[1].x.add_(1.0),
        lambda bs: _set(bs[0], "x", bs[0].x - 1),
    ),
    "frozen": Variant(
        lambda x: Frozen(x),
        lambda b: b.x,
        lambda b: b.x.sub_(1.0),
        lambda b: _set(b, "x", b.x + 1),
    ),
    "slots": Variant(
        lambda x: Slotted(x, torch.linspace(0, 1, D)),
        lambda b: b.x * b.w,
        lambda b: b.w.mul_(2.0),
        lambda b: _set(b, "x", b.x.clone().fill_(1.0)),
    ),
    "imagelist": Variant(
        lambda x: ImageListLike(x, [(2, 4)] * B),
        lambda b: b.tensors,
        lambda b: b.tensors.add_(2.0),
        lambda b: _set(b, "tensors", b.tensors * 0),
    ),
    "userdict": Variant(
        lambda x: EncodingLike({"input": x, "mask": torch.ones(B, D)}),
        lambda b: b.input * b.mask,
        lambda b: b["mask"].zero_(),
        lambda b: b.data.__setitem__("input", b["input"] + 5),
    ),
    "hf_batch_encoding": Variant(
        lambda x: _batch_encoding({"input": x, "mask": torch.ones(B, D)}),
        lambda b: b["input"] * b.mask,
        lambda b: b["mask"].zero_(),
        lambda b: b.data.__setitem__("input", b["input"] + 5),
    ),
    "deque_and_ordered_dict": Variant(
        lambda x: collections.deque([collections.OrderedDict(x=x), 2.0]),
        lambda q: q[0]["x"] * q[1],
        lambda q: q[0]["x"].add_(1.0),
        lambda q: q[0].__setitem__("x", q[0]["x"] * 3),
    ),
    "dict_subclass": Variant(
        lambda x: TensorDict(x=x),
        lambda b: b["x"],
        lambda b: b["x"].add_(1.0),
        lambda b: b.__setitem__("x", b["x"] + 1),
    ),
    "namedtuple": Variant(
        lambda x: Pair(x, x * 2),
        lambda b: b.x - b.y,
        lambda b: b.y.add_(1.0),
        None,
    ),
}


class ArgBlock(nn.Linear):
    def __init__(self, read: Callable[[Any], torch.Tensor]) -> None:
        super().__init__(D, D)
        self.read = read

    def forward(self, b: Any) -> torch.Tensor:
        x = self.read(b)
        return super().forward(x - x.mean(0))


class ArgNet(nn.Module):
    def __init__(self, read: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ArgBlock(read), nn.Linear(D, D)])

    def forward(self, b: Any) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](b).tanh())


def _train_args(
    model: nn.Module,
    v: Variant,
    how: str,
    engine: lr.ReplayEngine | None = None,
    checks: tuple[int, ...] = (),
) -> list[dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        if engine is not None and step in checks:
            engine.request_check()
        b = v.make(torch.randn(B, D, generator=data))
        opt.zero_grad(set_to_none=True)
        loss = model(b).pow(2).mean()
        with torch.no_grad():
            (v.inplace if how == "inplace" else v.rebind)(b)  # after the forward
        loss.backward()
        out.append(_grads(model))
        opt.step()
    return out


@pytest.mark.parametrize("how", ["inplace", "rebind"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_argument_objects_are_captured(name: str, how: str) -> None:
    """A tensor inside an argument object written in place, or a field rebound, between the
    forward and backward: the replay computes from the forward's value, as plain PyTorch's
    graph does (was: read new, wrong gradients from step 1)."""
    v = VARIANTS[name]
    if how == "rebind" and v.rebind is None:
        pytest.skip("a namedtuple's fields cannot be rebound")
    torch.manual_seed(0)
    ref = ArgNet(v.read)
    expected = _train_args(copy.deepcopy(ref), v, how)
    # (under a budget the replayed probe copies the arguments made outside autograd: an
    # in-place write after the forward is put back for its replay, i33-rest)
    for pres in PRESERVATIONS + ["budget"]:
        model = copy.deepcopy(ref)
        kw = {"budget": "min"} if pres == "budget" else {"preservation": pres}
        eng = lr.install(model, "blocks.*", **kw)
        got = _train_args(model, v, how, eng, checks=(3,))
        assert _diff(expected, got) == [], (name, how, pres)
        assert eng.summary()["blocks.0"]["replays"] > 0, eng.summary()
        assert not [r for r in eng.records.read() if r.outcome == "divergence"]
        eng.uninstall()


class AliasBlock(nn.Linear):
    """Called with a tensor and an object whose field is that same tensor."""

    def forward(self, x: torch.Tensor, b: Batch) -> torch.Tensor:
        return super().forward(x + b.x - b.x.mean(0))


class AliasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AliasBlock(D, D), AliasBlock(D, D)])

    def forward(self, b: Batch) -> torch.Tensor:
        h = self.blocks[0](b.x, b)
        return self.blocks[1](h, Batch(h.detach()))


@pytest.mark.parametrize("pres", PRESERVATIONS)
def test_tensor_argument_aliasing_a_field(pres: str) -> None:
    """The same tensor passed directly and as a field of an object, written in place after the
    forward: both reach the replay with the forward's bytes."""
    v = Variant(lambda x: Batch(x.requires_grad_()), None, lambda b: b.x.mul_(3.0), None)

    def run(model: nn.Module, eng: Any = None) -> list[dict]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(3)
        out = []
        for _ in range(STEPS):
            b = v.make(torch.randn(B, D, generator=data))
            opt.zero_grad(set_to_none=True)
            loss = model(b).pow(2).mean()
            with torch.no_grad():
                b.x.detach().mul_(3.0)  # (x is a leaf that requires grad: through a detach)
            loss.backward()
            g = _grads(model)
            g["input"] = b.x.grad.clone()
            out.append(g)
            opt.step()
        return out

    torch.manual_seed(1)
    ref = AliasNet()
    expected = run(copy.deepcopy(ref))
    model = copy.deepcopy(ref)
    eng = lr.install(model, "blocks.*", preservation=pres)
    assert _diff(expected, run(model, eng)) == []
    eng.uninstall()


class NoCopy:
    """An argument object that refuses to be copied."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __copy__(self) -> "NoCopy":
        raise TypeError("NoCopy objects are not copyable")


def test_uncopyable_argument_object_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = ArgNet(lambda b: b.x)
    eng = lr.install(model, "blocks.*")
    with pytest.raises(lr.ReplayConfigError, match=r"'blocks.0'.*argument 0.*NoCopy"):
        model(NoCopy(torch.randn(B, D)))
    eng.uninstall()


# ----------------------------------------------------------------------------- class 2
class ReduceBlock(nn.Module):
    """Reductions over both dimensions: their order follows the input's strides."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * x.sum(-1, keepdim=True) / 7 + x.sum(0, keepdim=True) * x.mean() + x.cumsum(0)
        return self.lin(y)


STRIDED = {
    # (base, the view the segment is called with); the step halves the base after it
    "slice": (lambda: torch.randn(8, 48), lambda w: w[:, ::3]),
    "transpose": (lambda: torch.randn(16, 64), lambda w: w.t()),
    "expand": (lambda: torch.randn(1, 16), lambda w: w.expand(64, 16)),
    "offset": (lambda: torch.randn(8 * 16 + 5), lambda w: w[5:].view(8, 16)),
    "offset_strided": (lambda: torch.randn(9, 17), lambda w: w[1:, 1:]),
    "channels_last": (
        lambda: torch.randn(2, 16, 2, 2).contiguous(memory_format=torch.channels_last),
        lambda w: w.permute(0, 2, 3, 1).flatten(0, 2),
    ),
}


class StridedNet(nn.Module):
    def __init__(self, view: Callable) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReduceBlock(), ReduceBlock()])
        self.view = view

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.view(w))
        w.mul_(0.5)  # the base written after the segment: the replay reads a copy
        return self.blocks[1](h)


@pytest.mark.parametrize("name", sorted(STRIDED))
def test_strided_input_copy_keeps_its_layout(name: str) -> None:
    """The replay's stand-in copy of an input whose base is written after the segment keeps
    the forward's strides and alignment, so its reductions sum in the same order (was: a
    contiguous copy, the last bits of some gradients differed for the slice, the expanded and
    the strided offset view)."""
    make, view = STRIDED[name]

    def run(model: nn.Module) -> list[dict]:
        torch.manual_seed(0)
        out = []
        for _ in range(4):
            model(make()).pow(2).sum().backward()
            out.append(_grads(model))
            model.zero_grad(set_to_none=True)
        return out

    torch.manual_seed(1)
    ref = StridedNet(view)
    expected = run(copy.deepcopy(ref))
    for pres in PRESERVATIONS:
        model = copy.deepcopy(ref)
        eng = lr.install(model, "blocks.*", preservation=pres)
        assert _diff(expected, run(model)) == [], pres
        assert eng.summary()["blocks.0"]["replays"] == 3
        eng.uninstall()


# ----------------------------------------------------------------------------- class 3
class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)).tanh() * x


class HookNet(nn.Module):
    def __init__(self, inside: Callable | None = None) -> None:
        super().__init__()
        self.blocks = nn.Sequential(NormBlock(), NormBlock(), NormBlock())
        self.head = nn.Linear(D, 1)
        self.inside = inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inside is None:
            return self.head(self.blocks(x))
        with self.inside():  # hooks entered inside the step (a training_step)
            h = self.blocks(x)
        return self.head(h)


def _bf16_hooks() -> Any:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.bfloat16(), lambda t: t.float())


def _half_hooks() -> Any:
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.half() if t.is_floating_point() else t,
        lambda t: t.float() if t.is_floating_point() else t,
    )


HOOKS = {
    "bf16": (_bf16_hooks, False),
    "half": (_half_hooks, False),
    "save_on_cpu": (torch.autograd.graph.save_on_cpu, False),
    "bf16_inside": (_bf16_hooks, True),
}


def _train_hooks(model: nn.Module, hooks: Callable, outside: bool, eng: Any = None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    out = []
    for step in range(STEPS):
        if eng is not None and step == 3:
            eng.request_check()
        x = torch.randn(16, D)
        with hooks() if outside else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        loss.backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_user_saved_tensor_hooks_apply_to_replays(name: str) -> None:
    """The user's saved-tensor hooks (bf16 rounding, save_on_cpu) around the step or inside it:
    backward reads what they make of each saved tensor, the replay's too (was: a replay
    differentiated the unrounded tensors, and its inputs came back rounded)."""
    hooks, inside = HOOKS[name]
    torch.manual_seed(1)
    ref = HookNet(hooks if inside else None)
    expected = _train_hooks(copy.deepcopy(ref), hooks, not inside)
    for kw in [{"preservation": p} for p in PRESERVATIONS] + [
        {"budget": "min"},
        {"track_memory": True},
    ]:
        model = copy.deepcopy(ref)
        eng = lr.install(model, "blocks.*", **kw)
        got = _train_hooks(model, hooks, not inside, eng)
        assert _diff(expected, got) == [], (name, kw)
        assert eng.summary()["blocks.1"]["replays"] >= 3, eng.summary()
        eng.uninstall()


# ----------------------------------------------------------------------------- class 7
def _per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi[None],))
        return (out.squeeze() - yi).pow(2)

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


class FuncNet(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        mk = (
            (lambda: nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.GELU()))
            if norm
            else (lambda: nn.Sequential(nn.Linear(D, D), nn.Tanh()))
        )
        self.blocks = nn.Sequential(mk(), mk())
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("norm", [False, True])
def test_torch_func_transforms_run_segments_plain(norm: bool) -> None:
    """DP-SGD's per-sample gradients (``vmap(grad(functional_call(model, ...)))``), a
    ``jacrev`` and a ``jvp`` over an installed model equal plain PyTorch's, between ordinary
    training steps that keep replaying (was: torch's "don't yet support saved tensor hooks"
    from the probe)."""
    from torch.func import functional_call, jacrev, jvp

    torch.manual_seed(2)
    ref = FuncNet(norm)
    model = copy.deepcopy(ref)
    eng = lr.install(model, "blocks.*")
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x, y = torch.randn(B, D, generator=g), torch.randn(B, generator=g)
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            (m(x).squeeze() - y).pow(2).mean().backward()
        assert _diff([_grads(ref)], [_grads(model)]) == []
        a, b = _per_sample_grads(ref, x, y), _per_sample_grads(model, x, y)
        assert all(torch.equal(a[k], b[k]) for k in a), step
        ja = jacrev(lambda z: functional_call(ref, dict(ref.named_parameters()), (z,)))(x)
        jb = jacrev(lambda z: functional_call(model, dict(model.named_parameters()), (z,)))(x)
        assert torch.equal(ja, jb)
        t = torch.ones_like(x)
        assert torch.equal(jvp(ref, (x,), (t,))[1], jvp(model, (x,), (t,))[1])
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
    assert eng.summary()["blocks.0"]["replays"] >= 2


# ----------------------------------------------------------------------------- classes 8, 9
class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(NormBlock(), NormBlock())
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("how", ["script", "trace", "script_by_class"])
def test_torchscript_segment_is_refused_by_name(how: str) -> None:
    """A ``torch.jit.script``-ed or traced segment: refused at install, naming the segment and
    why (was: AttributeError deep in segments._has_forward)."""
    model = TwoBlocks()
    if how == "trace":
        model.blocks[0] = torch.jit.trace(model.blocks[0], torch.randn(B, D))
    else:
        model.blocks[0] = torch.jit.script(model.blocks[0])
    spec = "blocks.*" if how != "script_by_class" else (lambda n, m: n.startswith("blocks."))
    with pytest.raises(lr.SegmentError, match=r"'blocks.0' is a TorchScript module"):
        lr.install(model, spec)
    assert type(model.blocks[1]) is NormBlock  # nothing installed
    # beside the segments too: its state cannot be watched either
    with pytest.raises(lr.SegmentError, match=r"module 'blocks.0' is a TorchScript module"):
        lr.install(model, ["blocks.1"])
    assert type(model.blocks[1]) is NormBlock


@pytest.mark.parametrize("how", ["compile", "module_compile", "whole", "whole_method", "inner"])
def test_compiled_segments_are_refused_by_name(how: str) -> None:
    """``torch.compile`` on a segment, on the model as a whole, or on a module inside a
    segment is refused at install, naming it and what to do (was: an InternalTorchDynamoError
    at step 2, or other gradients under inductor). Compiling is lazy: nothing is traced."""
    model = TwoBlocks()
    target: nn.Module = model
    if how == "compile":
        model.blocks[0] = torch.compile(model.blocks[0], backend="eager")
        err, match = lr.SegmentError, r"segment 'blocks.0' is compiled \(torch.compile\)"
    elif how == "module_compile":
        model.blocks[0].compile(backend="eager")
        err, match = lr.SegmentError, r"segment 'blocks.0' is compiled \(module.compile\(\)\)"
    elif how == "whole":
        target = torch.compile(model, backend="eager")
        err, match = lr.ReplayConfigError, r"model is compiled as a whole"
    elif how == "whole_method":
        model.compile(backend="eager")
        err, match = lr.ReplayConfigError, r"model is compiled as a whole"
    else:
        model.blocks[1].lin.compile(backend="eager")
        err, match = lr.SegmentError, r"'blocks.1.lin' is compiled .* lies inside segment"
    spec = "_orig_mod.blocks.*" if how == "whole" else "blocks.*"
    with pytest.raises(err, match=match):
        lr.install(target, spec)


def test_compiled_module_apart_from_the_segments_is_allowed() -> None:
    model = TwoBlocks()
    model.head.compile(backend="eager")
    lr.install(model, "blocks.*").uninstall()


# ----------------------------------------------------------------------------- class 12
HOST_READS = {
    "tolist": lambda g: torch.tensor(g.tolist()),
    "numpy": lambda g: torch.from_numpy(g.numpy().copy()),
    "asarray": lambda g: torch.tensor(__import__("numpy").asarray(g)),
    "item": lambda g: torch.stack([torch.tensor(g[i].item()) for i in range(D)]),
    "float": lambda g: torch.tensor([float(g[i]) for i in range(D)]),
    "int": lambda g: torch.tensor([int(g[i] * 100) for i in range(D)]) / 100.0,
}


class GainBlock(nn.Module):
    """Reads a buffer of the model that holds it (not a submodule: ``owner``) on the host."""

    def __init__(self, owner: nn.Module, read: Callable) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        object.__setattr__(self, "owner", owner)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.read(self.owner.gains)


class GainNet(nn.Module):
    def __init__(self, read: Callable) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GainBlock(self, read), GainBlock(self, read)])
        self.register_buffer("gains", torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](self.blocks[0](x).tanh())
        with torch.no_grad():
            self.gains.mul_(1.1)  # the root updates it after the segments ran
        return h


class SparseOwnerBlock(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        object.__setattr__(self, "owner", owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.owner.adj.to_dense() @ self.lin(x).t()).t().tanh()


class SparseOwnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("adj", _adjacency())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.adj * 2.0).to_dense().matmul(self.lin(x).t()).t().tanh()


def _adjacency() -> torch.Tensor:
    i = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0], [1, 2, 3, 4, 5, 6, 7, 0, 0]])
    return torch.sparse_coo_tensor(i, torch.rand(9), (D, D)).coalesce()


class SparseNet(nn.Module):
    def __init__(self, own: bool) -> None:
        super().__init__()
        self.own = own
        if own:
            self.blocks = nn.ModuleList([SparseOwnBlock(), SparseOwnBlock()])
        else:
            self.blocks = nn.ModuleList([SparseOwnerBlock(self), SparseOwnerBlock(self)])
            self.register_buffer("adj", _adjacency())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](self.blocks[0](x))
        with torch.no_grad():  # an in-place op on the sparse buffer after the segments
            (self.blocks[0].adj if self.own else self.adj).mul_(0.5)
        return h


def _train_plain(model: nn.Module, eng: Any = None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        if eng is not None and step == 3:
            eng.request_check()
        model(torch.randn(B, D, generator=g)).pow(2).sum().backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_host_reads_of_state_are_preserved(name: str) -> None:
    """A buffer the root updates after the forward, read by the segment on the host
    (``.tolist()``, ``.numpy()``, ``np.asarray``, ``.item()``, ``float``, ``int``): the replay
    reads its value at the forward (was: ``.tolist()`` read the updated buffer, wrong gradients
    until a sampled check found it)."""
    torch.manual_seed(1)
    ref = GainNet(HOST_READS[name])
    expected = _train_plain(copy.deepcopy(ref))
    for pres in PRESERVATIONS:
        model = copy.deepcopy(ref)
        eng = lr.install(model, "blocks.*", preservation=pres)
        assert _diff(expected, _train_plain(model, eng)) == [], pres
        assert eng.summary()["blocks.0"]["replays"] >= 3
        assert "gains" in eng.summary()["blocks.0"]["changing_state"]
        assert not [r for r in eng.records.read() if r.outcome != "match"]
        eng.uninstall()


@pytest.mark.parametrize("own", [False, True])
def test_sparse_state_is_exact(own: bool) -> None:
    """A sparse COO buffer the segment reads and the step writes in place after it. The
    segment's own sparse buffer is copied with its slots and put back for the replay; one held
    outside the segment (read through ``owner``) cannot be preserved (an in-place op
    reallocates its values), so the segment keeps its activations, exact, with a warning and a
    record naming the buffer (was: replayed from the new values, wrong gradients)."""
    torch.manual_seed(1)
    ref = SparseNet(own)
    expected = _train_plain(copy.deepcopy(ref))
    for pres in PRESERVATIONS:
        model = copy.deepcopy(ref)
        eng = lr.install(model, "blocks.*", preservation=pres)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            got = _train_plain(model, eng)
        assert _diff(expected, got) == [], pres
        said = [str(w.message) for w in caught if "sparse model state" in str(w.message)]
        rejections = [r for r in eng.records.read() if r.outcome == "rejection"]
        if own:
            assert eng.summary()["blocks.0"]["replays"] >= 3
            assert not said and not rejections
        else:
            assert eng.summary()["blocks.0"]["mode"] == "retain"
            assert any("'blocks.0' reads sparse model state (adj)" in m for m in said), said
            assert any("adj" in str(r.detail) for r in rejections)
        eng.uninstall()


def test_argument_objects_deeper_than_the_walk_are_warned_about() -> None:
    """Tensors more than ``MAX_DEPTH`` levels down an argument object are passed live: the
    probe says so once, naming the segment and where (not silent)."""

    def nest(x: torch.Tensor, n: int) -> Any:
        return Inner(x) if n == 0 else [nest(x, n - 1)]

    def read(b: Any) -> torch.Tensor:
        while isinstance(b, list):
            b = b[0]
        return b.x

    model = ArgNet(read)
    eng = lr.install(model, "blocks.*")
    with pytest.warns(RuntimeWarning, match=r"'blocks.0' is called with tensors inside .* deep"):
        model(nest(torch.randn(B, D), 8)).sum().backward()
    model(nest(torch.randn(B, D), 3)).sum().backward()  # within the walk: no warning
    eng.uninstall()
