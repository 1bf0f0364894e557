"""What each slot of a segment's modules held at forward time, put back for the replay.

A replay must see the objects the forward saw, not only their bytes. Models rebind state as
often as they write it in place: ``self.h = h.detach()`` (a stateful RNN),
``self.queue = torch.cat([k, self.queue[:-B]])`` (a queue written the common non-in-place way),
an attribute re-pointed to a new view, parameters substituted by ``torch.func.functional_call``,
a new ``torch.Generator`` each step, an annealed float, an enum mode. At each forward the engine
takes :func:`capture_slots` of the segment's modules (C-level dict copies, plus copies of small
containers of plain values); at replay :func:`swap_slots` puts every slot whose object or value
differs back as it was and returns the live objects, which :func:`restore_slots` reinstates
afterwards, so the replay's own rebinding never leaks either. Generator objects found in the
slots have their states captured too (:func:`capture_generators`).
"""

from __future__ import annotations

import copy
import enum
import math
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_replay._compat import dict_version
from lightning_replay.host_rng import as_host_rng, is_host_rng

#: Immutable values that are put back by value.
SCALAR_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    enum.Enum,
    np.generic,
    torch.dtype,
    torch.device,
    torch.Size,
)

#: nn.Module's own bookkeeping in ``__dict__`` (the parameter, buffer and submodule dicts are
#: handled separately; hooks are guarded, never swapped).
MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}

#: Mutable containers (and their subclasses: ``OrderedDict``, ``defaultdict``, ``Counter``),
#: put back by their items, not by identity.
_CONTAINERS = (list, dict, set)

_CONTAINER_LIMIT = 4096  # items; larger containers of plain values are not copied per step


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


def is_scalar(v: Any) -> bool:
    return isinstance(v, SCALAR_TYPES)


def copy_plain(v: Any, budget: list[int] | None = None) -> Any:
    """A copy of a (nested) list/dict/set/tuple of plain scalars, or ``MISSING`` when ``v``
    holds anything else or is too large to copy every step."""
    if budget is None:
        budget = [_CONTAINER_LIMIT]
    if is_scalar(v):
        return v
    budget[0] -= 1
    if budget[0] < 0:
        return MISSING
    t = type(v)
    if t in (list, tuple, set, frozenset):
        out = []
        for x in v:
            c = copy_plain(x, budget)
            if c is MISSING:
                return MISSING
            out.append(c)
        return t(out)
    if t is dict:
        out_d = {}
        for k, x in v.items():
            c = copy_plain(x, budget)
            if c is MISSING or not is_scalar(k):
                return MISSING
            out_d[k] = c
        return out_d
    return MISSING


def same_value(a: Any, b: Any) -> bool:
    """Equality that never asks a tensor for its truth value: tensors, generators and other
    objects compare by identity; plain values by value (NaN equals NaN); containers item by
    item."""
    if a is b:
        return True
    ta, tb = type(a), type(b)
    if ta is not tb:
        return False
    if issubclass(ta, (list, tuple)):  # and their subclasses: a named tuple, a UserList...
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if issubclass(ta, dict):  # the order too: a forward may iterate it (an OrderedDict...)
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if issubclass(ta, (set, frozenset)):
        return a == b
    if is_scalar(a):
        try:
            eq = a == b
            if isinstance(eq, np.ndarray):
                return bool(eq.all())
            if bool(eq):
                return True
        except Exception:  # noqa: BLE001 - a value whose comparison fails is "different"
            return False
        return isinstance(a, (float, np.floating)) and math.isnan(a) and math.isnan(b)
    return False


def is_holder(v: Any) -> bool:
    """A plain Python object with attributes of its own (not a module, tensor, generator,
    class, function or Python module): a config namespace, a dataclass, a state holder."""
    if isinstance(v, (nn.Module, torch.Tensor, torch.Generator, type, *_CONTAINERS, tuple)):
        return False  # (an OrderedDict, a defaultdict: containers, put back by their items)
    if callable(v):
        return False
    d = getattr(v, "__dict__", None)
    return (
        type(d) is dict
        and type(v).__module__ not in ("builtins", "types.ModuleType")
        and not isinstance(v, type(math))
    )


def _holder_values(v: Any) -> dict:
    d = v.__dict__
    out = d.copy()
    for k, x in d.items():
        if isinstance(x, _CONTAINERS):
            out[k] = _at_forward(x)
    return out


def _holder_signature(d: dict) -> tuple:
    """Which object each attribute of a holder holds (names and ids, C-level tuples), with the
    dict's version tag (None without one) that stands for them while it is unchanged."""
    return dict_version(d) if dict_version else None, tuple(d), tuple(map(id, d.values()))


def _holder_same(d: dict, sig: tuple) -> bool:
    """Whether every attribute of the holder whose dict is ``d`` holds the object it held when
    ``sig`` was taken: at once when the dict is unchanged since, else by names and ids."""
    if sig[0] is not None and dict_version(d) == sig[0]:
        return True
    return sig[1] == tuple(d) and sig[2] == tuple(map(id, d.values()))


def _containers_unchanged(d: dict, saved: dict, containers: tuple) -> bool:
    return all(same_value(saved[c], d[c]) for c in containers)


# Per module and attribute name: the last capture of a plain holder object it holds (a config
# namespace such as transformers' ``PretrainedConfig``, dozens of attributes read by every
# layer), as (holder, values at forward, signature, container attribute names).
_HOLDERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _capture_holder(module: nn.Module, name: str, obj: Any) -> tuple:
    """The values of ``obj``'s attributes now, shared with the module's last capture of it
    when every attribute still holds the same object and every container attribute the same
    contents (the objects are kept alive by that capture, so equal ids are the same objects;
    immutable values cannot have changed; containers are compared by value). Captures are
    never mutated: a replay gets fresh copies of the containers (:func:`_swap_holder`)."""
    d = obj.__dict__
    cache = _HOLDERS.get(module)
    prev = cache.get(name) if cache is not None else None
    if (
        prev is not None
        and prev[0] is obj
        and _holder_same(d, prev[2])
        and _containers_unchanged(d, prev[1], prev[3])
    ):
        return prev
    containers = tuple(k for k, x in d.items() if isinstance(x, _CONTAINERS))
    entry = (obj, _holder_values(obj), _holder_signature(d), containers)
    if cache is None:
        cache = _HOLDERS[module] = {}
    cache[name] = entry
    return entry


#: how deep :func:`_capture_holders` follows holders held by holders (``config.text_config``)
_HOLDER_DEPTH = 4


def _capture_holders(module: nn.Module, name: str, obj: Any) -> list[tuple]:
    """:func:`_capture_holder` of ``obj`` and of every holder reachable from it through
    holder attributes, each once, to :data:`_HOLDER_DEPTH` levels (a multimodal config's
    ``text_config``, an options object inside a config): a replay puts back what each level
    held at forward. The captures are swapped in this order, outer first."""
    out: list[tuple] = []
    seen: set[int] = set()
    todo = [(name, obj, 0)]
    while todo:
        path, o, depth = todo.pop(0)
        if id(o) in seen:
            continue
        seen.add(id(o))
        entry = _capture_holder(module, path, o)
        out.append(entry)
        if depth + 1 < _HOLDER_DEPTH:
            todo += [(f"{path}.{k}", x, depth + 1) for k, x in entry[1].items() if is_holder(x)]
    return out


def _swap_holder(entry: tuple) -> dict | None:
    """Put a holder's attributes back as captured; returns the live values it replaced.
    Containers go back as fresh copies of their forward contents: a replay that mutates one
    must reach neither the live container nor the capture, which later calls may share."""
    obj, saved, sig, containers = entry
    d = obj.__dict__
    if _holder_same(d, sig):  # every attribute holds its forward object
        prev = None
        for c in containers:
            v = saved[c]
            if v is not d[c]:  # (else a set of objects, which _at_forward keeps as it is)
                if prev is None:
                    prev = {}
                prev[c] = d[c]
                d[c] = _at_forward(v)
        return prev
    prev = _swap_dict(d, saved)
    if prev:
        for c in containers:
            if c in prev and d.get(c, MISSING) is saved[c]:
                d[c] = _at_forward(saved[c])
    return prev


_PLANS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _needs_more(v: Any) -> bool:
    """An attribute value that an identity copy of the dict does not cover: containers (copied
    by value, or which objects they hold), plain holder objects, generators, tensors (sparse
    ones are copied)."""
    return (
        isinstance(v, (*_CONTAINERS, tuple, torch.Tensor, torch.Generator))
        or is_host_rng(v)
        or is_holder(v)
    )


def _attr_plan(module: nn.Module, d: dict) -> tuple:
    """The attribute keys of ``module`` that need more than an identity copy, cached while the
    attribute names and value types stay the same (most forwards: nothing to rescan)."""
    sig = (tuple(d), tuple(map(type, d.values())))
    cached = _PLANS.get(module)
    if cached is not None and cached[0] == sig:
        return cached[1]
    keys = tuple(k for k, v in d.items() if k not in MODULE_INTERNALS and _needs_more(v))
    _PLANS[module] = (sig, keys)
    return keys


def identities(d: dict) -> tuple:
    """Which object each slot of a module holds, in order, with the slot names: equal for two
    moments exactly when every parameter, buffer and attribute slot holds the same object (the
    objects are kept alive by the captured slots, so their ids are not reused)."""
    p, b = d["_parameters"], d["_buffers"]
    return (
        tuple(d),
        tuple(map(id, d.values())),
        tuple(p),
        tuple(map(id, p.values())),
        tuple(b),
        tuple(map(id, b.values())),
    )


def slot_token(d: dict) -> tuple:
    """A cheap stand-in for :func:`identities` of the module whose ``__dict__`` is ``d``: the
    version tags of its attribute, parameter and buffer dicts (equal: none of them changed, so
    every slot holds the same object), or the identities themselves where the interpreter has
    no version tags to trust (:data:`~lightning_replay._compat.dict_version`)."""
    if dict_version is None:
        return identities(d)
    return dict_version(d), dict_version(d["_parameters"]), dict_version(d["_buffers"])


def same_slots(d: dict, s: "ModuleSlots", token: tuple | None = None) -> bool:
    """Whether every slot of the module whose ``__dict__`` is ``d`` holds the object it held
    when ``s`` was captured: at once when no slot dict changed since, else by identities
    (written and put back, or rebound to the same object). A match on identities refreshes the
    capture's token, which then stands for this moment too (both have its identities).
    ``token``: :func:`slot_token` of ``d`` just read, if at hand."""
    if token is None:
        token = slot_token(d)
    if token == s.token:
        return True
    if dict_version is None or identities(d) != s.ids:
        return False
    s.token = token
    return True


class ModuleSlots:
    """One module's slots at one moment: parameter, buffer and attribute objects.

    ``plain`` is true when the slots are all there is to put back (no container contents,
    holder values or sparse copies, which can change while the slots hold the same objects):
    such a capture stands for any later moment whose :func:`identities` are the same.
    """

    __slots__ = (
        "module",
        "params",
        "buffers",
        "attrs",
        "copies",
        "layout",
        "shallow",
        "holders",
        "gens",
        "ids",
        "token",
        "plain",
        "holder_entries",
        "found",
    )

    def __init__(self, module: nn.Module, token: tuple | None = None) -> None:
        d = module.__dict__
        self.module = module
        self.token = slot_token(d) if token is None else token
        self.ids = self.token if dict_version is None else identities(d)
        self.found: list | None = None  # slot_generators' scan of this capture, once
        self.params = d["_parameters"].copy()
        self.buffers = d["_buffers"].copy()
        self.attrs = attrs = d.copy()
        # Sparse (non-strided) tensors have no storage the engine can preserve in place:
        # each is copied whole, and the copy stands in at replay if it was written since.
        layout = None
        for k, v in self.buffers.items():
            if v is not None and v.layout != torch.strided:
                if layout is None:
                    layout = {}
                with torch.no_grad():
                    layout[("b", k)] = (v._version, v.detach().clone())
        copies = shallow = holders = gens = None
        self.holder_entries: list[tuple] | None = None
        for k in _attr_plan(module, d):
            v = attrs[k]
            if isinstance(v, torch.Generator) or is_host_rng(v):
                gens = [v] if gens is None else gens + [v]
            elif isinstance(v, torch.Tensor):
                if v.layout != torch.strided:
                    if layout is None:
                        layout = {}
                    with torch.no_grad():
                        layout[("a", k)] = (v._version, v.detach().clone())
            elif isinstance(v, _CONTAINERS):
                c = copy_plain(v)
                if c is not MISSING:
                    if copies is None:
                        copies = {}
                    copies[k] = c
                elif not isinstance(v, set):  # objects, or a subclass: which object each item held
                    if shallow is None:
                        shallow = {}
                    shallow[k] = copy.copy(v)
                if isinstance(v, list):
                    g = [x for x in v if _is_generator(x)]
                    if g:
                        gens = g if gens is None else gens + g
            elif isinstance(v, tuple):
                g = [x for x in v if _is_generator(x)]
                if g:
                    gens = g if gens is None else gens + g
            elif is_holder(v):
                # a plain object the module holds (a config shared with the root...): the
                # values of its attributes at forward, and of the holders it holds in turn
                if holders is None:
                    holders, self.holder_entries = [], []
                for entry in _capture_holders(module, k, v):
                    holders.append(entry[:2])
                    self.holder_entries.append(entry)
        self.layout = layout
        self.copies = copies
        self.shallow = shallow
        self.holders = holders
        self.gens = gens
        self.plain = layout is None and copies is None and shallow is None and holders is None


def capture_slots(
    modules: list[nn.Module], tokens_now: list[tuple] | None = None, last: list | None = None
) -> list[ModuleSlots]:
    """The slots of ``modules`` now.

    ``tokens_now``: each module's :func:`slot_token` just read (by the guard of the same
    forward), if at hand. ``last``: per module, its last capture while its slots have always held the
    same objects (``MISSING`` before the first one, ``None`` once they were seen to change:
    rebound state, annealed values); updated in place. A module whose slots hold the same
    objects as at that capture, with nothing else to put back (or only plain holder objects
    whose attributes hold the same objects and contents), shares it (captures are never
    mutated): the forward of a steady model copies no dicts. Modules seen to change are
    captured afresh every time, so no stale capture keeps old objects alive between steps.
    """
    out = []
    for i, m in enumerate(modules):
        token = slot_token(m.__dict__) if tokens_now is None else tokens_now[i]
        prev = MISSING if last is None else last[i]
        if (
            prev is not None
            and prev is not MISSING
            and same_slots(m.__dict__, prev, token)
            and (prev.plain or _holders_current(prev.holder_entries))
        ):
            out.append(prev)
            continue
        s = ModuleSlots(m, token)
        if last is not None:
            last[i] = s if _shareable(s) and prev is MISSING else None
        out.append(s)
    return out


def _shareable(s: ModuleSlots) -> bool:
    """A capture that stands for a later moment with the same slot objects: nothing else to
    put back (``plain``), or only holder objects, re-checked at each share."""
    return s.plain or (
        s.layout is None and s.copies is None and s.shallow is None and bool(s.holder_entries)
    )


def _holders_current(entries: list[tuple] | None) -> bool:
    """Whether every holder still holds the objects and container contents it was captured
    with (then its capture stands for now)."""
    if not entries:
        return False
    for obj, saved, sig, containers in entries:
        d = obj.__dict__
        if not _holder_same(d, sig) or not _containers_unchanged(d, saved, containers):
            return False
    return True


def _swap_dict(
    live: dict,
    saved: dict,
    skip: frozenset = frozenset(),
    copies: dict | None = None,
    frozen: dict | None = None,
) -> dict | None:
    out = None
    for k, v in saved.items():
        if k in skip:
            continue
        cur = live.get(k, MISSING)
        if frozen is not None and k in frozen:
            version, copy = frozen[k]
            if cur is v and v._version == version:
                continue
            v = copy  # written in place (or rebound) since forward: its copy stands in
        elif copies is not None and k in copies:
            if cur is v and same_value(copies[k], v):
                continue
            v = copies[k]  # the contents at forward time (the object may have been mutated)
        elif cur is v:
            continue
        elif is_scalar(v) and type(cur) is type(v) and same_value(cur, v):
            continue
        if out is None:
            out = {}
        out[k] = cur
        live[k] = v
    if len(live) != len(saved) or out:
        for k in [k for k in live.keys() - saved.keys() if k not in skip]:
            if out is None:
                out = {}
            out[k] = live.pop(k)
    return out


def swap_slots(slots: list[ModuleSlots]) -> list[tuple[dict, dict]]:
    """Put the captured objects and values back; returns what was live, for
    :func:`restore_slots`."""
    out = []
    for s in slots:
        d = s.module.__dict__
        same = same_slots(d, s)
        if same and s.plain:
            continue  # every slot holds the object it held at forward: nothing to swap
        lay = s.layout
        if not (same and lay is None and s.copies is None):
            # (with the same objects in every slot and no sparse copies or container contents
            # to compare, only the shallow containers and holders below can differ)
            fb = {k: v for (w, k), v in lay.items() if w == "b"} if lay else None
            fa = {k: v for (w, k), v in lay.items() if w == "a"} if lay else None
            for live, saved, skip, copies, frozen in (
                (d["_parameters"], s.params, frozenset(), None, None),
                (d["_buffers"], s.buffers, frozenset(), None, fb),
                (d, s.attrs, MODULE_INTERNALS, s.copies, fa),
            ):
                prev = _swap_dict(live, saved, skip, copies, frozen)
                if prev:
                    out.append((live, prev))
        if s.shallow:
            for k, saved in s.shallow.items():
                cur = d.get(k, MISSING)
                if type(cur) is type(saved) and not same_value(cur, saved):
                    out.append((d, {k: cur}))
                    d[k] = copy.copy(saved)  # the objects each item held at forward
        if s.holder_entries:
            for entry in s.holder_entries:
                prev = _swap_holder(entry)
                if prev:
                    out.append((entry[0].__dict__, prev))
    return out


def restore_slots(live: list[tuple[dict, dict]]) -> None:
    for d, values in reversed(live):
        for k, v in values.items():
            if v is MISSING:
                d.pop(k, None)
            else:
                d[k] = v


def _is_generator(x: Any) -> bool:
    return isinstance(x, torch.Generator) or is_host_rng(x)


def slot_generators(slots: list[ModuleSlots]) -> list[Any]:
    """Generator objects held as attributes (directly, in tuples or lists, in dict attributes,
    or on plain holder objects, directly or in their lists, tuples and dicts) of the modules, each once: torch's, and those outside torch
    (``random.Random``, numpy's ``RandomState`` and ``Generator``) as :class:`HostRNG`."""
    out: list[Any] = []
    seen: set[int] = set()
    for s in slots:
        found = s.found
        if found is None:  # a capture never changes: scanned once, however often it is shared
            found = list(s.gens or ())
            for v in (s.shallow or {}).values():
                found += [x for _, x in _items(v) if _is_generator(x)]
            for _, v in s.holders or ():
                for x in v.values():
                    if _is_generator(x):
                        found.append(x)
                    elif type(x) in (list, tuple, dict):  # a holder's list of generators
                        found += [y for _, y in _items(x) if _is_generator(y)]
            s.found = found
        for g in found:
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g if isinstance(g, torch.Generator) else as_host_rng(g))
    return out


def capture_generators(gens: list[torch.Generator]) -> list[tuple[torch.Generator, torch.Tensor]]:
    return [(g, g.get_state()) for g in gens]


def swap_generators(
    saved: list[tuple[torch.Generator, torch.Tensor]],
) -> list[tuple[torch.Generator, torch.Tensor]]:
    live = []
    for g, state in saved:
        live.append((g, g.get_state()))
        g.set_state(state)
    return live


def restore_generators(live: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for g, state in reversed(live):
        g.set_state(state)


def slot_tensors(slots: list[ModuleSlots]) -> list[tuple[str, torch.Tensor]]:
    """Non-parameter tensors of the modules (buffers, tensor attributes, tensors inside tuple
    or list attributes) with a local name, each object once."""
    out = []
    seen: set[int] = set()
    for i, s in enumerate(slots):
        items = list(s.buffers.items())
        for k, v in s.attrs.items():
            if k in MODULE_INTERNALS:
                continue
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                items.append((k, v))
            elif type(v) in (tuple, list):
                items.extend(
                    (f"{k}[{j}]", x) for j, x in enumerate(v) if isinstance(x, torch.Tensor)
                )
        for k, v in (s.shallow or {}).items():
            items.extend((f"{k}[{j!r}]", x) for j, x in _items(v) if isinstance(x, torch.Tensor))
        for j, (_, v) in enumerate(s.holders or ()):
            items.extend((f"holder{j}.{k}", x) for k, x in v.items() if isinstance(x, torch.Tensor))
        for k, v in items:
            if v is not None and id(v) not in seen:
                seen.add(id(v))
                out.append((f"{i}:{k}", v))
    return out


# ------------------------------------------------------------------ reads of outside modules
_TRACE_CLASSES: dict[type, type] = {}


def _trace_class(cls: type) -> type:
    """A subclass of ``cls`` that records which plain attributes are read (probe only)."""
    new = _TRACE_CLASSES.get(cls)
    if new is not None:
        return new

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        d = object.__getattribute__(self, "__dict__")
        reads = d.get("_lightning_replay_reads")
        if (
            reads is not None
            and name in d
            and name not in MODULE_INTERNALS
            and not isinstance(value, nn.Module)
            and (None, name) not in reads
        ):
            reads[None, name] = _at_forward(value)  # as first read (before any write)
        return value

    def __getattr__(self, name):  # registered buffers (parameters and submodules aside)
        value = cls.__getattr__(self, name)
        d = object.__getattribute__(self, "__dict__")
        reads = d.get("_lightning_replay_reads")
        if reads is not None and name in d["_buffers"] and ("_buffers", name) not in reads:
            reads["_buffers", name] = value
        return value

    new = type(
        cls.__name__,
        (cls,),
        {
            "__getattribute__": __getattribute__,
            "__getattr__": __getattr__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    _TRACE_CLASSES[cls] = new
    return new


class OutsideReads:
    """Records the attributes a segment's forward reads from modules outside it.

    A block may read a value that lives on another module (a temperature on the root that is
    annealed every step, a flag on a sibling). For the probe's forward every other module of
    the model gets a recording subclass; the reads become part of the contract and their
    values are captured at each forward and put back for the replay like the segment's own.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.classes: list[type] = []

    def __enter__(self) -> "OutsideReads":
        for m in self.modules:
            cls = type(m)
            self.classes.append(cls)
            m.__dict__["_lightning_replay_reads"] = {}
            m.__class__ = _trace_class(cls)
        return self

    def __exit__(self, *exc) -> None:
        self.reads = []
        self.first: list[tuple[dict, str, Any]] = []  # (dict, name, value as first read)
        for m, cls in zip(self.modules, self.classes):
            m.__class__ = cls
            reads = m.__dict__.pop("_lightning_replay_reads", {})
            for where, name in sorted(reads, key=lambda r: (r[0] or "", r[1])):
                self.reads.append((m, name if where is None else (where, name)))
                d = m.__dict__ if where is None else m.__dict__[where]
                self.first.append((d, name, reads[where, name]))


def _items(c: Any) -> Any:
    return c.items() if isinstance(c, dict) else enumerate(c)


def _at_forward(v: Any) -> Any:
    """What a value must be put back as: a copy of a container of plain values, a shallow
    copy of a list or dict of objects (which object each item held), else the object."""
    if isinstance(v, _CONTAINERS):
        c = copy_plain(v)
        if c is not MISSING:
            return c
        if not isinstance(v, set):
            return copy.copy(v)
    return v


def capture_outside(reads: list[tuple[nn.Module, Any]]) -> list[tuple[dict, str, Any]]:
    out = []
    for m, name in reads:
        d = m.__dict__
        if isinstance(name, tuple):  # a registered buffer: which tensor the slot held
            d, name = d[name[0]], name[1]
        out.append((d, name, _at_forward(d.get(name, MISSING))))
    return out


def swap_outside(saved: list[tuple[dict, str, Any]]) -> list[tuple[dict, dict]]:
    out = []
    for d, name, v in saved:
        cur = d.get(name, MISSING)
        if cur is v or same_value(cur, v):
            continue
        out.append((d, {name: cur}))
        if v is MISSING:
            d.pop(name, None)
        else:
            d[name] = v
    return out
