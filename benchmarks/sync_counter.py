"""Count the host-device synchronizations a block of PyTorch code asks for, on any device.

On CUDA a host read of a device value waits for the stream: ``.item()``, ``int(t)``,
``bool(t)``, ``float(t)`` (``aten::_local_scalar_dense``), ``torch.equal``, ``allclose``,
``aten::is_nonzero``, ``.tolist()``, ``.numpy()``, a blocking copy to the host (``.cpu()``,
``.to("cpu")``), an op whose output shape depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), and
``torch.cuda.synchronize`` itself. On CPU none of them waits for anything, but the same calls
happen: :class:`SyncCounter` sees them as ops (a dispatch mode) and as tensor methods (a
function mode), so a count taken on CPU is the count the same code asks for on a GPU.

``device="cpu"`` (the default on a CPU run) counts every such read of any tensor;
``device="cuda"`` counts only reads of CUDA tensors (a ``.item()`` of a CPU tensor, such as
AdamW's step counter with ``capturable=False``, costs the GPU nothing).

Example:
    >>> import torch
    >>> with SyncCounter() as c:
    ...     t = torch.arange(4.0)
    ...     _ = t.sum().item(), t.tolist(), bool(t[1] > 0), t[t > 1]
    >>> c.count, sorted(c.by_kind)
    (4, ['__bool__', 'index(bool mask)', 'item', 'tolist'])
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Tensor methods that read device values on the host: counted once each, whatever ops they
# run inside.
_HOST_METHODS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__repr__",
    "__str__",
    "__format__",
    "equal",
    "allclose",
}
# ops that read a device value on the host, or whose output shape depends on device values
_HOST_OPS = {
    aten._local_scalar_dense.default: "_local_scalar_dense",
    aten.equal.default: "equal",
    aten.is_nonzero.default: "is_nonzero",
    aten.allclose.default: "allclose",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
    aten.repeat_interleave.self_Tensor: "repeat_interleave",
}
_MASK_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_COPY_OPS = {aten._to_copy.default, aten.copy_.default}


class SyncCounter:
    """A context manager that counts host-device synchronizations (see the module docstring).

    Args:
        device: ``"cpu"`` counts host reads of any tensor; a CUDA device counts only reads
            of CUDA tensors (those that really wait on a GPU).
        where: also keep, per event, the innermost frames of the Python stack that asked
            (for finding a sync; slow).

    After the block: ``count``, ``by_kind`` (kind -> count) and ``events`` (kind, frames).
    """

    def __init__(self, device: str | torch.device = "cpu", where: bool = False) -> None:
        self.device_type = torch.device(device).type
        self.where = where
        self.count = 0
        self.by_kind: collections.Counter = collections.Counter()
        self.events: list[tuple[str, list[str]]] = []
        self._inside = 0  # > 0 inside a counted tensor method: its ops are not counted again
        self._modes: tuple[Any, Any] | None = None
        self._patched: list[tuple[Any, str, Any]] = []

    # ---------------------------------------------------------------- counting
    def _counts(self, tensors: list) -> bool:
        if self.device_type == "cpu":
            return True
        return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors)

    def _add(self, kind: str) -> None:
        self.count += 1
        self.by_kind[kind] += 1
        frames: list[str] = []
        if self.where:
            frames = [
                f"{f.filename}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[-14:-2]
                if "sync_counter" not in f.filename
            ]
        self.events.append((kind, frames))

    def _method(self, name: str, args: tuple, kwargs: dict) -> str | None:
        """The kind of host read a tensor method call is, or None."""
        if name in _HOST_METHODS:
            return name if self._counts(list(args)) else None
        if name in ("cpu", "to"):
            if kwargs.get("non_blocking") or any(a is True for a in args[1:]):
                return None  # an asynchronous copy: the host does not wait
            if name == "to":
                dev = kwargs.get("device")
                for a in args[1:]:
                    if isinstance(a, (str, torch.device)):
                        dev = a
                    elif isinstance(a, torch.Tensor):
                        dev = a.device
                if dev is None or torch.device(dev).type != "cpu":
                    return None
            return name if self._counts(list(args[:1])) else None
        return None

    def _op(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The kind of host read an aten op is, or None."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _HOST_OPS:
            if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
                if kwargs.get("output_size") is not None:
                    return None
            return _HOST_OPS[func] if self._counts(tensors) else None
        if func in _MASK_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                name = "index_put(bool mask)" if func != aten.index.Tensor else "index(bool mask)"
                return name if self._counts(tensors) else None
            return None
        if func in _COPY_OPS and self.device_type != "cpu":
            if func == aten._to_copy.default:
                src, dst = args[0], kwargs.get("device")
                blocking = not kwargs.get("non_blocking", False)
                if dst is not None and torch.device(dst).type == "cpu" and src.is_cuda:
                    return "to(cpu)" if blocking else None
            else:
                dst, src = args[0], args[1]
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                if dst.device.type == "cpu" and src.is_cuda and blocking:
                    return "copy_(to cpu)"
        return None

    # ---------------------------------------------------------------- context
    def __enter__(self) -> "SyncCounter":
        counter = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                kind = None
                if counter._inside == 0:
                    kind = counter._method(getattr(func, "__name__", ""), args, kwargs)
                if kind is None:
                    return func(*args, **kwargs)
                counter._add(kind)
                counter._inside += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    counter._inside -= 1

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if counter._inside == 0:
                    kind = counter._op(func, args, kwargs)
                    if kind is not None:
                        counter._add(kind)
                return func(*args, **kwargs)

        def counted(owner: Any, attr: str) -> None:
            orig = getattr(owner, attr)

            def wrapper(*a: Any, **k: Any) -> Any:
                counter._add(f"{getattr(owner, '__name__', owner)}.{attr}")
                return orig(*a, **k)

            self._patched.append((owner, attr, orig))
            setattr(owner, attr, wrapper)

        counted(torch.cuda, "synchronize")
        counted(torch.cuda.Event, "synchronize")
        counted(torch.cuda.Stream, "synchronize")
        self._modes = (_Ops(), _Functions())
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        ops, functions = self._modes
        functions.__exit__(*exc)
        ops.__exit__(*exc)
        self._modes = None
        for owner, attr, orig in reversed(self._patched):
            setattr(owner, attr, orig)
        self._patched.clear()
        return False

    def summary(self) -> dict[str, Any]:
        return {"count": self.count, "by_kind": dict(self.by_kind)}
