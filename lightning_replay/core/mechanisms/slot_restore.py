"""Putting a segment's slots back for its replay, and the live objects back after it.

The restore half of :mod:`~lightning_replay.slots`, which captures them at forward: at replay
:func:`swap_slots` puts every slot whose object or value differs from its capture back as it
was and returns the live objects, which :func:`restore_slots` reinstates afterwards, so the
replay's own rebinding never leaks either. The same for the generator states found in the
slots (:func:`swap_generators`, :func:`restore_generators`) and for attributes read outside the
segment's modules (:func:`swap_outside`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_replay.core.mechanisms.slots import (
    _EMPTY,
    _GLOBAL_FLAG,
    _TORCH_MODULE_GLOBALS,
    GLOBAL_HOOK_DICTS,
    HOOK_DICTS,
    MISSING,
    MODULE_INTERNALS,
    ModuleSlots,
    _at_forward,
    _attrs_of,
    _holder_same,
    copy_items,
    HolderGroup,
    _hooks_of,
    global_hooks,
    is_scalar,
    same_slots,
    same_value,
    slot_token,
)


def _swap_holder(entry: tuple, out: list) -> None:
    """Put a holder's attributes back as captured, adding what it replaced to ``out`` (for
    :func:`restore_slots`). A container attribute that still holds its forward object gets
    its forward contents back in place (a fresh copy of them), and the live contents after:
    a replay that mutates one must reach neither the live contents nor the capture, which
    later calls may share. Where the contents are already the forward's, nothing is written
    (a config's tag stays still for the guard), and the restore puts them back only if the
    replay changed them."""
    owner, saved, sig, containers, empties = entry
    d = _attrs_of(owner)
    if _holder_same(d, sig):  # every attribute holds its forward object
        for c in containers:
            v, cur = saved[c], d[c]
            if v is cur:  # (a set of objects, which _at_forward keeps as it is)
                continue
            if same_value(v, cur):
                out.append((cur, _Refill(v, unless_equal=True)))
            else:
                out.append((cur, _Refill(copy.copy(cur))))
                _refill(cur, _at_forward(v))
        _empty_again(d, empties, out)
        return
    prev = _swap_dict(d, saved)
    if prev:
        for c in containers:
            if c in prev and d.get(c, MISSING) is saved[c]:
                d[c] = _at_forward(saved[c])
        out.append((d, prev))
    _empty_again(d, empties, out)


def _empty_again(d: Any, empties: tuple, out: list) -> None:
    """Empty the dicts of a module holder that were empty at its forward and hold something now
    (a hook registered since), adding their contents to ``out`` for the restore."""
    for k in empties:
        cur = d.get(k)
        if cur:
            out.append((cur, _Refill(copy.copy(cur))))
            cur.clear()


class _Refill:
    """A container's contents, which :func:`restore_slots` puts back into it in place (where
    ``unless_equal``: only if they differ, as a fresh copy of them)."""

    __slots__ = ("items", "unless_equal")

    def __init__(self, items: Any, unless_equal: bool = False) -> None:
        self.items = items
        self.unless_equal = unless_equal

    def apply(self, c: Any) -> None:
        if not self.unless_equal:
            _refill(c, self.items)
        elif not same_value(c, self.items):
            _refill(c, _at_forward(self.items))


def _refill(c: Any, items: Any) -> None:
    """Make the contents of the list, dict or set ``c`` those of ``items``, in their order."""
    if isinstance(c, list):
        c[:] = items
    else:
        c.clear()
        c.update(items)


def _swap_dict(
    live: Any,
    saved: dict,
    skip: frozenset = frozenset(),
    copies: dict | None = None,
    frozen: dict | None = None,
    ordered: bool = False,
) -> dict | _Refill | None:
    """Put ``saved``'s objects back into ``live`` (a dict, or a holder's :class:`SlotView`);
    returns the live values it replaced (``MISSING``: a key it added). ``ordered``: the order
    of the keys is put back too (the parameter, buffer, submodule and hook dicts, whose order
    a forward iterates), and where it differs the whole contents are replaced (and put back
    whole by :func:`restore_slots`)."""
    if ordered and tuple(live) != tuple(saved):
        whole = _Refill(dict(live))
        items = [(k, _forward_value(k, v, live.get(k, MISSING), frozen)) for k, v in saved.items()]
        live.clear()
        live.update(items)
        return whole
    out = None
    for k, v in saved.items():
        if k in skip:
            continue
        cur = live.get(k, MISSING)
        if frozen is not None and k in frozen:
            v = _forward_value(k, v, cur, frozen)
            if v is cur:
                continue
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


def _forward_value(k: str, v: Any, cur: Any, frozen: dict | None) -> Any:
    """What the slot ``k`` held at forward (``v``), or the copy that stands in for a sparse
    tensor written in place (or rebound) since."""
    if frozen is not None and k in frozen:
        version, copy = frozen[k]
        if not (cur is v and v._version == version):
            return copy
    return v


def _swap_hooks(live: tuple, saved: dict | None, names: tuple, out: list) -> None:
    for name, h in zip(names, live):
        was = saved.get(name, _EMPTY) if saved else _EMPTY
        if h is not None and (h or was):
            prev = _swap_dict(h, was, ordered=True)
            if prev:
                out.append((h, prev))


def swap_slots(slots: list[ModuleSlots]) -> list[tuple[Any, dict]]:
    """Put the captured objects and values back (and the global hooks, where ``slots`` is a
    :class:`SlotCaptures`); returns what was live, for :func:`restore_slots`."""
    out: list[tuple[Any, dict]] = []
    glob = getattr(slots, "hooks", MISSING)
    if glob is not MISSING:
        dicts, flag = global_hooks()
        if glob is not None or any(dicts) or flag is not None:
            was, was_flag = glob if glob is not None else (None, None)
            _swap_hooks(dicts, was, GLOBAL_HOOK_DICTS, out)
            if flag is not was_flag:
                out.append((_TORCH_MODULE_GLOBALS, {_GLOBAL_FLAG: flag}))
                _TORCH_MODULE_GLOBALS[_GLOBAL_FLAG] = was_flag
    for s in slots:
        d = s.module.__dict__
        token = slot_token(d)
        same = (token == s.token and s.order is None) or same_slots(d, s, token)
        if same and s.plain:
            continue  # every slot holds the object it held at forward: nothing to swap
        lay = s.layout
        if not (same and lay is None and s.copies is None):
            # (with the same objects in every slot and no sparse copies or container contents
            # to compare, only the shallow containers and holders below can differ)
            fb = {k: v for (w, k), v in lay.items() if w == "b"} if lay else None
            fa = {k: v for (w, k), v in lay.items() if w == "a"} if lay else None
            for live, saved, skip, copies, frozen, ordered in (
                (d["_parameters"], s.params, frozenset(), None, None, True),
                (d["_buffers"], s.buffers, frozenset(), None, fb, True),
                (d["_modules"], s.submodules, frozenset(), None, None, True),
                (d, s.attrs, MODULE_INTERNALS, s.copies, fa, False),
            ):
                prev = _swap_dict(live, saved, skip, copies, frozen, ordered)
                if prev:
                    out.append((live, prev))
            if not same:
                _swap_hooks(_hooks_of(d), s.hooks, HOOK_DICTS, out)
        if s.shallow:
            for k, saved in s.shallow.items():
                cur = d.get(k, MISSING)
                if type(cur) is type(saved) and not same_value(cur, saved):
                    out.append((d, {k: cur}))
                    d[k] = copy_items(saved)  # the objects each item held at forward
        if s.holder_entries:
            for entry in s.holder_entries:
                _swap_holder(entry, out)
    return out


def restore_slots(live: list[tuple[Any, dict]]) -> None:
    for d, values in reversed(live):
        if type(values) is _Refill:
            values.apply(d)
            continue
        for k, v in values.items():
            if v is MISSING:
                d.pop(k, None)
            else:
                d[k] = v


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


def swap_outside(saved: list[tuple[Any, Any, Any]]) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for d, name, v in saved:
        if d is None:  # the captures of a holder read there
            if type(v) is HolderGroup:  # (of the holders in a container read there)
                if v.unchanged():
                    continue
                for _, _, entries in v.captures:
                    for entry in entries:
                        _swap_holder(entry, out)
                continue
            for entry in v:
                _swap_holder(entry, out)
            continue
        cur = d.get(name, MISSING)
        if cur is v or same_value(cur, v):
            continue
        out.append((d, {name: cur}))
        if v is MISSING:
            d.pop(name, None)
        else:
            d[name] = v
    return out
