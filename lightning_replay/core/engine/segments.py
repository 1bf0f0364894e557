"""Resolving segment specifications (names, glob patterns, module classes, callables), and the
default choice when none is given (:func:`default_segments`)."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Callable, Iterable, Union

import torch
from torch import nn

from lightning_replay.errors import SegmentError

SegmentSpec = Union[str, type, Callable[[str, nn.Module], bool]]


def resolve_segments(
    model: nn.Module, segments: SegmentSpec | Iterable[SegmentSpec]
) -> dict[str, nn.Module]:
    """Map segment specs to ``{qualified name: module}`` in the model's module order.

    Args:
        model: the root module.
        segments: a qualified submodule name (``"encoder.blocks.0"``), a glob pattern
            (``"encoder.blocks.*"``: ``*`` stays within one name part, ``**`` spans parts), an ``nn.Module`` subclass (every instance below the root),
            a callable ``(name, module) -> bool``, or a list of these.

    Raises:
        SegmentError: unknown names, patterns that match nothing, non-module targets, the root
            itself, nested segments, or an empty selection.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> list(resolve_segments(m, nn.Linear))
        ['0', '2']
    """
    if not isinstance(model, nn.Module):
        raise SegmentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if (
        segments is None
        or isinstance(segments, (str, type))
        or callable(segments)
        and not isinstance(segments, (list, tuple, set))
    ):
        specs = [segments]
    else:
        specs = list(segments)
    if not specs or specs == [None]:
        raise SegmentError(
            "segments is empty: pass submodule names such as "
            "['encoder.blocks.0'], a glob such as 'encoder.blocks.*', or a module "
            "class"
        )
    named = dict(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    for spec in specs:
        for name in _match(model, named, spec):
            chosen[name] = named[name]
    if not chosen:
        raise SegmentError(f"segments={segments!r} selects no submodule of {type(model).__name__}")
    order = {n: i for i, n in enumerate(named)}
    names = sorted(chosen, key=order.__getitem__)
    for name in names:
        mod = chosen[name]
        why = opaque_reason(mod)
        if why is not None:
            raise SegmentError(f"segment {name!r} {why}")
        if not _has_forward(mod):
            raise SegmentError(
                f"segment {name!r} is a {type(mod).__name__}, which has no forward of its own: "
                "the model calls its children, never it, so replaying it would save nothing. "
                f"Name its children instead ({name + '.*'!r})."
            )
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if b.startswith(a + "."):
                raise SegmentError(
                    f"segments {a!r} and {b!r} are nested: {b!r} lies inside {a!r}. Choose one "
                    "level: either the outer block or its inner modules."
                )
    return {n: chosen[n] for n in names}


def default_segments(model: nn.Module) -> tuple[list[str], list[str]]:
    """Every repeated block of ``model``: the parameterized children of its block lists.

    A block list is a ``ModuleList`` or ``Sequential`` with at least two parameterized
    children. Lists whose blocks repeat a class (``layer1`` to ``layer4`` of a ResNet, the
    layers of a transformer) are preferred to lists of unlike modules (a ``downsample``
    ``Sequential(conv, norm)``); with none, every block list counts. All lists are taken,
    not the largest one: recomputation saves activation bytes, and a ResNet's early, wide
    stages hold most of them (``ReplayStrategy`` prints each segment's measured share after
    the probe step; choosing the largest list picked a ResNet's ``layer4``, 7 % of them).

    Three rules keep the blocks callable and apart:

    * a child with no ``forward`` of its own (a ``ModuleList`` of layers the model iterates by
      hand) is never called: its parameterized children stand in its place;
    * a list of stages that are block lists themselves (timm's EfficientNet ``blocks``, a
      ``Sequential`` of ``Sequential`` stages) gives way to them: the stages' blocks are the
      segments, and a stage that is no list (one block) stays a block of the outer list;
    * a list inside a block is left out: its children are parts of a block, not blocks.

    Returns:
        (the block lists' qualified names, the blocks' qualified names in module order).

    Raises:
        SegmentError: ``model`` holds no ``ModuleList``/``Sequential`` of parameterized blocks.

    Example:
        >>> m = nn.Module()
        >>> m.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> m.stage1 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> m.stage2 = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> default_segments(m)
        (['stage1', 'stage2'], ['stage1.0', 'stage1.1', 'stage2.0', 'stage2.2'])
        >>> m = nn.Module()
        >>> m.blocks = nn.Sequential(
        ...     nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        ... )
        >>> default_segments(m)
        (['blocks', 'blocks.1'], ['blocks.0', 'blocks.1.0', 'blocks.1.1'])
    """
    lists: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        if name and isinstance(mod, (nn.ModuleList, nn.Sequential)):
            kids = _callable_blocks(name, mod)
            if len(kids) >= 2:
                lists[name] = kids
    repeated = {
        name: kids for name, kids in lists.items() if len({type(c) for _, c in kids}) < len(kids)
    }
    pool = repeated or lists
    # stages that are lists of the pool give their own blocks instead
    own = {name: [(n, c) for n, c in kids if n not in pool] for name, kids in pool.items()}
    blocks = [n for kids in own.values() for n, _ in kids]
    chosen = [
        name
        for name, kids in own.items()
        if kids and not any(name.startswith(b + ".") or name == b for b in blocks)
    ]
    if not chosen:
        raise SegmentError(
            f"{type(model).__name__} has no ModuleList or Sequential of parameterized blocks to "
            "replay. Pass ReplayStrategy(segments=...) or define configure_replay_segments() "
            "on the LightningModule, returning names, glob patterns or module classes."
        )
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    names = sorted({n for c in chosen for n, _ in own[c]}, key=order.__getitem__)
    # a block inside another block (lists the rules above do not part): the outer one
    names = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return chosen, names


def _has_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward of its own (a ``ModuleList``, a
    ``ModuleDict`` or a bare ``nn.Module`` has none: calling one raises)."""
    if isinstance(module, torch.jit.ScriptModule):
        return True  # (its class's ``forward`` is a descriptor that fails on the class)
    return type(module).forward is not nn.Module.forward


def _is_compiled(module: nn.Module) -> str | None:
    """How ``module`` is compiled by ``torch.compile``, or None."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return "torch.compile"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "module.compile()"
    return None


def opaque_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be a segment (its forward runs where the engine cannot follow
    it), as the rest of a sentence that starts with the segment's name; None if it can.

    >>> opaque_reason(nn.Linear(2, 2)) is None
    True
    >>> print(opaque_reason(torch.jit.script(nn.Linear(2, 2))).split(":")[0])
    is a TorchScript module (torch.jit.script or torch.jit.trace)
    """
    if isinstance(module, torch.jit.ScriptModule):
        return (
            "is a TorchScript module (torch.jit.script or torch.jit.trace): its forward runs in "
            "the TorchScript interpreter, where lightning_replay can neither see the state it "
            "reads and writes nor put it back for a replay. Name the eager module (before "
            "scripting) as the segment, or leave this module out of `segments` (it then runs "
            "as in plain PyTorch)."
        )
    how = _is_compiled(module)
    if how is not None:
        return (
            f"is compiled ({how}): a compiled forward runs as one graph, which the probe "
            "cannot watch and a replay cannot re-run with the state it saw (torch.compile is "
            "not supported, see the README's Out of scope). Install replay on the eager "
            "module and do not compile the segments or the modules around them, or leave "
            "this module out of `segments`; modules that hold no segment may stay compiled."
        )
    return None


def _callable_blocks(name: str, mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """``mod``'s parameterized children by qualified name, each child without a forward of
    its own replaced by its own parameterized children, and so on down."""
    out: list[tuple[str, nn.Module]] = []
    for n, c in mod.named_children():
        if not any(True for _ in c.parameters()):
            continue
        q = f"{name}.{n}" if name else n
        if _has_forward(c):
            out.append((q, c))
        else:
            out += _callable_blocks(q, c)
    return out


def _match(model: nn.Module, named: dict[str, nn.Module], spec: SegmentSpec) -> list[str]:
    if isinstance(spec, str):
        if spec in ("", "."):
            raise SegmentError(
                "segment '' is the root module: the root's forward defines the "
                "window and cannot itself be replayed. Name its submodules."
            )
        if spec in named:
            return [spec]
        if any(c in spec for c in "*?["):
            hits = [n for n in named if n and _glob(n.split("."), spec.split("."))]
            if not hits:
                raise SegmentError(
                    f"segment pattern {spec!r} matches no submodule. "
                    f"Submodules include: {_some(named)}"
                )
            return hits
        target = _lookup_attr(model, spec)
        if target is not None:
            raise SegmentError(
                f"segment {spec!r} is a {type(target).__name__}, not a module. "
                "Segments must be nn.Module instances (name the module that "
                "holds it)."
            )
        close = _closest(spec, [n for n in named if n])
        hint = f" Did you mean {close}?" if close else f" Submodules include: {_some(named)}"
        raise SegmentError(f"segment {spec!r} is not a submodule of {type(model).__name__}.{hint}")
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise SegmentError(f"segment class {spec.__name__} is not an nn.Module subclass")
        hits = [n for n, m in named.items() if n and isinstance(m, spec)]
        # Instances nested in other instances of the class: keep the outermost.
        hits = [n for n in hits if not any(n.startswith(h + ".") for h in hits if h != n)]
        if not hits:
            raise SegmentError(f"no submodule of {type(model).__name__} is a {spec.__name__}")
        return hits
    if callable(spec):
        return [n for n, m in named.items() if n and spec(n, m)]
    raise SegmentError(
        f"segment spec {spec!r} ({type(spec).__name__}) is not a name, glob "
        "pattern, module class or callable"
    )


def _glob(parts: list[str], pattern: list[str]) -> bool:
    """Dotted-name glob: ``*`` matches within one name part, ``**`` any number of parts."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob(parts[1:], pattern[1:])
    )


def _lookup_attr(model: nn.Module, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _some(named: dict[str, nn.Module], k: int = 8) -> str:
    names = [n for n in named if n]
    return ", ".join(repr(n) for n in names[:k]) + (" ..." if len(names) > k else "")


def _closest(name: str, candidates: list[str], n: int = 3) -> list[str]:
    """The ``n`` candidates most similar to ``name`` (difflib's ratio, at least 0.6), most
    similar first; equally similar ones in the model's order (``blocks.1`` before ``blocks.3``).

    Example:
        >>> _closest("block.0", ["blocks", "blocks.0", "blocks.1", "blocks.2", "blocks.3"])
        ['blocks.0', 'blocks.1', 'blocks.2']
    """
    scored = []
    for i, c in enumerate(candidates):
        m = difflib.SequenceMatcher(None, name, c)
        if m.real_quick_ratio() >= 0.6 and m.quick_ratio() >= 0.6 and m.ratio() >= 0.6:
            scored.append((-m.ratio(), i, c))
    return [c for _, _, c in sorted(scored)[:n]]
