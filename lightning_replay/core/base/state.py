"""Naming and handling tensor state at the storage level.

State is identified by storage, not by tensor object: a view, a shared tensor and an aliased
input all reach the same bytes. Names come from the model (parameters, buffers, plain tensor
attributes, in ``named_modules`` order); storage nobody in the model names is ``external[i]``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
import zlib
from typing import Any, Iterator

import torch
from torch import nn

PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None), tuple, frozenset)
_SWAP_CHUNK = 1 << 22  # bytes swapped per step: keeps the swap's extra memory at 4 MiB

StorageKey = tuple[str, int]


def storage_key(t: torch.Tensor) -> StorageKey | None:
    """Identity of a tensor's storage, or None for tensors without plain storage."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        st = t.untyped_storage()
        # A wrapper subclass (an FSDP2 sharded parameter is a DTensor) has a storage object
        # with no data behind it: its data pointer raises. Freed storage (FSDP2's unsharded
        # parameters between all-gathers) has a null pointer. A lazy module's uninitialized
        # parameter refuses to give its storage.
        ptr = st.data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: a lazy parameter)
        return None
    if ptr == 0 or st.nbytes() == 0:
        return None
    return (str(t.device), ptr)


def storage_identity(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s storage lives and how large it is: changes when ``t`` is pointed at other
    bytes (``.data =``, ``set_``, a reallocating ``resize_``)."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``t`` (writes go straight to its bytes).

    Its version counter is its own, so writing through it bumps no version of ``t``.
    """
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)


Extent = tuple[int, int]  # [start, end) byte offsets inside a storage


def byte_span(t: torch.Tensor) -> Extent | None:
    """The bytes of its storage that ``t`` reaches, ``[start, end)``: from its first element
    to its last, with what a stride skips between them (``x[:, ::2]``, ``x.t()``), or None for
    a tensor with no elements.

    >>> base = torch.zeros(8, 4)
    >>> byte_span(base[4:]), byte_span(base[:, ::2]), byte_span(base.t()[1])
    ((64, 128), (0, 124), (4, 120))
    """
    if t.numel() == 0:
        return None
    item = t.element_size()
    lo = t.storage_offset() * item
    return lo, lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * item


def hull(a: Extent | None, b: Extent | None) -> Extent | None:
    """The smallest extent covering both (None, the whole storage, covers everything)."""
    if a is None or b is None:
        return None
    return min(a[0], b[0]), max(a[1], b[1])


def extent_bytes(t: torch.Tensor, extent: Extent | list[int] | None) -> torch.Tensor:
    """A flat uint8 view of the bytes ``extent`` names in ``t``'s storage (its whole storage
    where ``extent`` is None, or where the storage no longer reaches the extent's end)."""
    whole = storage_bytes(t)
    if extent is None or extent[1] > whole.numel():
        return whole
    return whole[extent[0] : extent[1]]


def swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two same-shaped flat uint8 tensors in bounded extra memory."""
    n = a.numel()
    tmp = torch.empty(min(n, _SWAP_CHUNK), dtype=a.dtype, device=a.device)
    with torch.no_grad():
        for start in range(0, n, _SWAP_CHUNK):
            end = min(start + _SWAP_CHUNK, n)
            t = tmp[: end - start]
            t.copy_(a[start:end])
            a[start:end].copy_(b[start:end])
            b[start:end].copy_(t)


_DIGEST_CHUNK = 1 << 22  # int64 words per reduction on accelerators: 32 MiB of temporaries


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether the host can read ``t``'s values without waiting for a device: a CPU tensor.

    The one place the engine asks before it decides anything from tensor values. On an
    accelerator every such read (``.item()``, ``bool()``, ``torch.equal``, ``.tolist()``, a copy
    to the host) synchronizes the stream, so a decision taken on every step does without them
    there (it reads them on checked steps only, or asynchronously). Tests run the accelerator
    branches on CPU by making this say False."""
    return t.device.type == "cpu"


def digest(t: torch.Tensor) -> int:
    """A 64-bit checksum of a tensor's bytes, order-sensitive, without big temporaries.

    CPU: CRC-32 of the bytes (zlib, a few GB/s, no copy for contiguous tensors) and their
    length. Accelerators: on the device, three int64 sums of the bytes as words (plain,
    position-weighted, bit-mixed) reduced in bounded chunks, read back with one sync. Either
    changes with any single flipped bit; digests are compared on the device they came from.
    """
    with torch.no_grad():
        b = _bytes_of(t)
        n = b.numel()
        if n == 0:
            return 0
        if host_reads_free(b):
            return zlib.crc32(_host_view(b)) ^ (n << 32)
        return _word_digest(b)


def digests(tensors: list[torch.Tensor]) -> list[int]:
    """:func:`digest` of each tensor, with one read back per device (not one per tensor): the
    on-device sums of all of them are gathered and copied to the host at once.

    >>> a, b = torch.arange(4.0), torch.ones(3)
    >>> digests([a, b]) == [digest(a), digest(b)]
    True
    """
    out: list[int | None] = [None] * len(tensors)
    pending: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            b = _bytes_of(t)
            if b.numel() == 0:
                out[i] = 0
            elif _on_host(b):
                out[i] = zlib.crc32(_host_view(b)) ^ (b.numel() << 32)
            else:
                pending.setdefault(b.device, []).append((i, b.numel(), _word_sums(b)))
        for items in pending.values():
            sums = torch.stack([acc for _, _, acc in items]).tolist()  # one sync per device
            for (i, n, _), (h1, h2, h3) in zip(items, sums):
                out[i] = _mix(h1, h2, h3, n)
    return out  # type: ignore[return-value]


def digest_token(t: torch.Tensor) -> Any:
    """The digest of ``t`` now, without a host sync: an ``int`` on the host, a small device
    tensor on an accelerator; :func:`resolve_tokens` turns a list of them into digests with
    one read back per device."""
    with torch.no_grad():
        b = _bytes_of(t)
        if b.numel() == 0:
            return 0
        if _on_host(b):
            return zlib.crc32(_host_view(b)) ^ (b.numel() << 32)
        return (b.numel(), _word_sums(b))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes a digest reads, as a flat ``uint8`` tensor: a strided tensor's own (no copy
    where contiguous); a sparse one's parts in order (its indices, values and shape: a copy, as
    small as its non-zeros)."""
    t = t.detach()
    if t.layout == torch.strided:
        return t.contiguous().reshape(-1).view(torch.uint8)
    parts = [*sparse_parts(t), torch.tensor(t.shape, dtype=torch.int64, device=t.device)]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A sparse tensor's indices and values as stored: COO's (in its own order, coalesced or
    not), or the compressed ones (CSR, CSC, BSR, BSC)."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def resolve_tokens(tokens: list) -> list[int]:
    """:func:`digest_token` results as digests (equal to :func:`digest`'s)."""
    out: list[int | None] = [t if isinstance(t, int) else None for t in tokens]
    pending: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int):
            pending.setdefault(tok[1].device, []).append((i, tok[0], tok[1]))
    for items in pending.values():
        sums = torch.stack([acc for _, _, acc in items]).tolist()
        for (i, n, _), (h1, h2, h3) in zip(items, sums):
            out[i] = _mix(h1, h2, h3, n)
    return out  # type: ignore[return-value]


def _host_view(b: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU uint8 tensor as a buffer, without copying them. Not
    ``b.numpy()``: that marks the storage non-resizable, and a queue grown by ``resize_``
    after a digest of it would fail."""
    return (ctypes.c_char * b.numel()).from_address(b.data_ptr())


def _on_host(b: torch.Tensor) -> bool:
    return host_reads_free(b)


def _mix(h1: int, h2: int, h3: int, n: int) -> int:
    return (h1 * 0x9E3779B97F4A7C15 ^ h2 * 0xC2B2AE3D27D4EB4F ^ h3 ^ n) & ((1 << 64) - 1)


def _word_sums(b: torch.Tensor, chunk: int = _DIGEST_CHUNK) -> torch.Tensor:
    """Three int64 sums of a flat uint8 tensor's bytes as words, on its device."""
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)
    acc = torch.zeros(3, dtype=torch.int64, device=w.device)
    for lo in range(0, w.numel(), chunk):
        c = w[lo : lo + chunk]
        pos = torch.arange(
            2 * lo + 3, 2 * (lo + c.numel()) + 3, 2, device=w.device, dtype=torch.int64
        )
        acc[0] += c.sum()
        acc[1] += (c * pos).sum()
        acc[2] += (c ^ (c >> 17)).sum()
    return acc


def _word_digest(b: torch.Tensor, chunk: int = _DIGEST_CHUNK) -> int:
    """The on-device digest of a flat uint8 tensor (see :func:`digest`)."""
    h1, h2, h3 = _word_sums(b, chunk).tolist()
    return _mix(h1, h2, h3, b.numel())


@dataclasses.dataclass
class StateRef:
    """How to find one named tensor of the model again (it may be replaced by ``.to()``)."""

    name: str
    kind: str
    module: nn.Module
    attr: str

    def get(self) -> torch.Tensor | None:
        d = self.module.__dict__
        if self.kind == "parameter":
            return d["_parameters"].get(self.attr)
        if self.kind == "buffer":
            return d["_buffers"].get(self.attr)
        v = d.get(self.attr)
        return v if isinstance(v, torch.Tensor) else None


def iter_named_state(model: nn.Module) -> Iterator[StateRef]:
    """Every tensor the model names: parameters, buffers and plain tensor attributes."""
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for k, p in mod._parameters.items():
            if p is not None:
                yield StateRef(prefix + k, "parameter", mod, k)
        for k, b in mod._buffers.items():
            if b is not None:
                yield StateRef(prefix + k, "buffer", mod, k)
        for k, v in mod.__dict__.items():
            if isinstance(v, torch.Tensor) and not k.startswith("__"):
                yield StateRef(prefix + k, "attribute", mod, k)


class StateIndex:
    """Maps storages to the model's names for them."""

    def __init__(self, model: nn.Module) -> None:
        self.by_storage: dict[StorageKey, list[StateRef]] = {}
        #: the storage at each address when indexed (weakly): see :meth:`lookup`
        self.storages: dict[StorageKey, weakref.ref] = {}
        for ref in iter_named_state(model):
            t = ref.get()
            key = storage_key(t) if t is not None else None
            if key is None:
                continue
            refs = self.by_storage.setdefault(key, [])
            if all(r.name != ref.name for r in refs):
                refs.append(ref)
            self.storages.setdefault(key, weakref.ref(t.untyped_storage()))

    def lookup(self, key: StorageKey, storage: Any = None) -> list[StateRef]:
        """The names of the storage at ``key`` when indexed; given ``storage``, only if it is
        that storage (a storage reallocated in place by ``resize_`` leaves its address to the
        next one made, which the names of the first do not name)."""
        if storage is not None:
            held = self.storages.get(key)
            if held is None or held() is not storage:
                return []
        return self.by_storage.get(key, [])


def same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two generator objects drive the same generator.

    The dispatcher hands modes a fresh Python wrapper per op, so identity can't be compared:
    reseed one and see whether the other moves (then put the state back).
    """
    if a is b:
        return True
    if a.device != b.device:
        return False
    sa, sb = a.get_state(), b.get_state()
    if not torch.equal(sa, sb):
        return False
    try:
        for seed in (0x5EED, 0xC0FFEE):
            a.manual_seed(seed)
            if not torch.equal(b.get_state(), sb):
                return True
        return False
    finally:
        a.set_state(sa)


def find_generator_name(model: nn.Module, gen: torch.Generator) -> str | None:
    """The attribute name under which the model holds ``gen``, if any."""
    for mname, mod in model.named_modules():
        for k, v in mod.__dict__.items():
            if isinstance(v, torch.Generator) and same_generator(v, gen):
                return f"{mname}.{k}" if mname else k
    return None


def unique_generators(gens: list[torch.Generator]) -> list[torch.Generator]:
    out: list[torch.Generator] = []
    for g in gens:
        if not any(same_generator(g, o) for o in out):
            out.append(g)
    return out


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Tensors inside a nested structure of tuples, lists and dicts."""
    from lightning_replay._compat import tree_leaves

    return [x for x in tree_leaves(obj) if isinstance(x, torch.Tensor)]


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared counts once)."""
    seen = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


#: bytes of address alignment a stand-in copy reproduces (wider than any vector unit's)
_ALIGN = 64


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes laid out as ``t`` is: the same shape, strides (0 for an
    expanded dimension) and address alignment, on a storage of its own.

    ``clone`` makes a strided slice, an expanded or overlapping view contiguous, and starts
    every copy at an aligned address: a kernel that reads the copy may then reduce in another
    order or take another vector path than on ``t`` and differ in the last bits. The copy spans
    the storage region ``t`` reaches (for ``x[:, ::3]`` the skipped elements too, as
    ``empty_strided`` would allocate).

    >>> wide = torch.arange(24.0).reshape(4, 6)
    >>> for v in (wide[:, ::3], wide.t(), wide[1:, 2:], wide[:1].expand(5, 6)):
    ...     c = strided_copy(v)
    ...     assert c.stride() == v.stride() and torch.equal(c, v)
    ...     assert c.data_ptr() % 64 == v.data_ptr() % 64 and c.data_ptr() != v.data_ptr()
    """
    orig, t = t, t.detach()
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return t.clone()
    size = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    item = t.element_size()
    try:
        misalign = t.data_ptr() % _ALIGN
    except RuntimeError:  # a wrapper without data
        return t.clone()
    lead = misalign // item if misalign % item == 0 else 0
    with torch.no_grad():
        region = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), (size,), (1,)
        )
        buf = torch.empty(lead + size, dtype=t.dtype, device=t.device)
        buf[lead:].copy_(region)
        # (set_, not as_strided: a tensor of its own, no view, so it can become a leaf)
        out = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            buf.untyped_storage(), lead, t.shape, t.stride()
        )
    return _same_subclass(out, orig)


def _same_subclass(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``out`` as an instance of ``t``'s tensor subclass, with ``t``'s Python attributes, so
    that a segment's ``isinstance`` branch sees at replay the type it saw at the forward. Only
    for a plain Python subclass (no ``__torch_dispatch__`` of its own: a wrapper tensor is
    not rebuilt this way) and never a ``Parameter``/``Buffer``.

    >>> class Tagged(torch.Tensor): pass
    >>> t = torch.ones(2).as_subclass(Tagged); t.tag = 3
    >>> c = strided_copy(t)
    >>> type(c).__name__, c.tag, c.data_ptr() != t.data_ptr()
    ('Tagged', 3, True)
    """
    cls = type(t)
    if (
        cls is torch.Tensor
        or type(out) is cls
        or isinstance(t, nn.Parameter)
        or getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__
    ):
        return out
    out = out.as_subclass(cls)
    d = getattr(t, "__dict__", None)
    if d:
        out.__dict__.update(d)
    return out
