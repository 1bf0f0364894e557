"""Each private torch / Lightning access the package makes (lightning_replay._compat) still
works on the installed versions: an upgrade that breaks one fails here, by name."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_replay import _compat


def test_version_counters_read_and_put_back():
    t = torch.zeros(3)
    t.add_(1)
    assert _compat.version(t) == 1
    _compat.set_versions([t], [0])
    assert _compat.version(t) == 0 and torch.equal(t, torch.ones(3))


def test_top_saved_tensors_hooks_finds_the_active_pair():
    assert _compat.top_saved_tensors_hooks() is None

    def pack(x):
        return x

    def unpack(x):
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        top = _compat.top_saved_tensors_hooks()
    assert top is not None and top[0] is pack and top[1] is unpack


def test_checkpoint_frame_recomputing_is_the_frame_being_recomputed():
    import contextlib

    from torch.utils.checkpoint import checkpoint

    seen = []

    class Recompute:
        def __enter__(self):
            seen.append(_compat.checkpoint_frame_recomputing())

        def __exit__(self, *exc):
            return False

    assert _compat.checkpoint_frame_recomputing() is None
    x = torch.ones(3, requires_grad=True)
    y = checkpoint(
        lambda x: x.sin().cos(),
        x,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), Recompute()),
    )
    y.sum().backward()
    [frame] = seen
    assert callable(frame.check_recomputed_tensors_match) and frame.recompute_fn is not None


def test_checkpoint_frame_forward_is_the_frame_whose_forward_runs():
    from torch.utils.checkpoint import checkpoint

    seen = []

    def fn(x):
        y = x.sin()
        seen.append(_compat.checkpoint_frame_forward())
        return y.cos()

    assert _compat.checkpoint_frame_forward() is None
    x = torch.ones(3, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()
    frame, in_recomputation = seen  # the forward's frame; none while it is recomputed
    assert len(frame.weak_holders) == 2 and callable(frame.recompute_fn)  # sin, cos saved
    assert in_recomputation is None


def test_at_backward_end_runs_after_the_backward():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(
        lambda g: (_compat.at_backward_end(lambda: order.append("end")), order.append("hook"))[1]
    )
    y.sum().backward()
    assert order == ["hook", "end"]


def test_op_arguments_mark_writes():
    args = _compat.op_arguments(torch.ops.aten.add_.Tensor)
    assert args[0].name == "self" and args[0].alias_info is not None and args[0].alias_info.is_write
    assert _compat.op_arguments(torch.ops.aten.add.Tensor)[0].alias_info is None


def test_dispatch_mode_and_pytree():
    seen = []

    class Mode(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen
    flat, spec = _compat.tree_flatten(({"a": torch.ones(1)}, [2]))
    assert _compat.tree_unflatten(flat, spec)[1] == [2]


def test_lightning_accessors(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert hasattr(_compat.accelerator_connector(trainer), "use_distributed_sampler")
    assert hasattr(_compat.logger_connector(trainer), "should_update_logs")
    from lightning.pytorch.strategies import DDPStrategy

    ddp = DDPStrategy(start_method="spawn")
    assert _compat.start_method(ddp) == "spawn"
    assert _compat.precision_plugin(trainer.strategy) is not None
    assert _compat.distributed_is_initialized() is False


def test_graph_task_keeps_graph_tells_retain_and_create_graph_apart():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(_compat.graph_task_keeps_graph())
            return g

    x = torch.ones(3, requires_grad=True)
    y = Probe.apply(x).sum()
    y.backward(retain_graph=True)
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    y.backward()
    assert seen == [True, True, False]
    assert _compat.graph_task_keeps_graph()  # no backward running: keep (the safe answer)


def test_in_reentrant_checkpoint_backward_only_inside_its_recomputation():
    from torch.utils.checkpoint import checkpoint

    seen = []

    def fn(x):
        if torch._C._current_graph_task_id() != -1:
            seen.append(_compat.in_reentrant_checkpoint_backward())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    checkpoint(fn, x, use_reentrant=True).sum().backward()
    checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert seen == [True, False]
    assert not _compat.in_reentrant_checkpoint_backward()


def test_parametrization_cache_only_inside_cached():
    from torch import nn
    from torch.nn.utils import parametrize

    lin = nn.Linear(2, 2)
    parametrize.register_parametrization(lin, "weight", nn.Identity())
    assert _compat.parametrization_cache() is None
    with parametrize.cached():
        assert _compat.parametrization_cache() == {}
        w = lin.weight
        assert list(_compat.parametrization_cache().values()) == [w]
    assert _compat.parametrization_cache() is None


def test_set_parametrization_caching_turns_cached_off_and_back():
    from torch.nn.utils import parametrize

    with parametrize.cached():
        old = _compat.set_parametrization_caching(0)
        assert old == 1 and _compat.parametrization_cache() is None
        assert _compat.set_parametrization_caching(old) == 0
        assert _compat.parametrization_cache() == {}


def test_hooks_disabled_with_notes_the_message_torch_raises():
    from lightning_replay._compat import hooks_disabled_with

    message = "test_compat: hooks off here"
    assert not hooks_disabled_with(message)
    with torch.autograd.graph.disable_saved_tensors_hooks(message):
        assert hooks_disabled_with(message)
        with pytest.raises(RuntimeError, match=message):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                pass
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def test_dispatch_modes_on_sees_a_python_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not _compat.dispatch_modes_on()
    with Through():
        assert _compat.dispatch_modes_on()
    assert not _compat.dispatch_modes_on()
