"""Issue 32, the replayed probe and saved values that no tensor went into.

An autograd Function may save, beside its inputs, a ``torch.empty`` workspace it never writes or
an integer tensor made from a moving Python counter (``torch.tensor([calls])``). Neither is a
function of any tensor, so under ``budget="min"`` the replayed probe's saved-tensor comparison
sees them differ while the outputs match bit for bit: that is no evidence of state, and must
not be recorded as a divergence (:class:`lightning_replay.kernel_noise.ProducerLog`).

The other side: a value that *reads* state through the same kind of tensor (a workspace written
from a buffer by ``copy_``, by ``out=``, by numpy behind the dispatcher's back; an integer made
from a buffer's ``.item()`` or by an op; a float made from host values; a generator's draw; a
multi-output op's auxiliary value overwritten afterwards) is never called "not reproduced", so
when it differs it stays a divergence.
"""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from torch import nn

import lightning_replay as lr

D, B, STEPS = 8, 6, 10


class _Aux(torch.autograd.Function):
    """``x @ w.T``; saves ``aux`` as well, which the backward multiplies the input gradient
    by when ``read`` is set (a value only the gradient reads)."""

    @staticmethod
    def forward(ctx, x, w, aux, read):
        ctx.save_for_backward(x, w, aux)
        ctx.read = read
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w, aux = ctx.saved_tensors
        gx = g @ w
        if ctx.read:
            gx = gx * aux.to(gx.dtype).reshape(-1)[: gx.shape[-1]]
        return gx, g.t() @ x, None, None


#: a host counter the replay cannot put back (a plain module-level dict is watched and put back
#: since 9e2bd1d: its count would be reproduced, and nothing left to let be)
_CALLS = itertools.count(1)


def _empty(blk, x):
    return torch.empty(x.shape[0], 97), False


def _empty_like(blk, x):
    return torch.empty_like(x).t(), False


def _host_counter(blk, x):
    n = next(_CALLS)
    return torch.tensor([n, 7 * n], dtype=torch.int64), False


def _host_counter_bool(blk, x):
    return torch.full((3,), next(_CALLS) % 2 == 0), False


NOISE = {
    "empty": _empty,
    "empty_like_view": _empty_like,
    "host_counter": _host_counter,
    "host_counter_bool": _host_counter_bool,
}


class Block(nn.Module):
    def __init__(self, aux) -> None:
        super().__init__()
        self.aux = aux
        self.a = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D) / 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        aux, read = self.aux(self, h)
        return x + _Aux.apply(h, self.w, aux, read)


def _train(aux, check_from: int):
    torch.manual_seed(0)
    model = nn.Sequential(Block(aux), Block(aux), nn.Linear(D, 1))
    engine = lr.install(model, ["0", "1"], budget="min", on_violation="record")
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(STEPS):
            if step >= check_from:
                engine.request_check()
            x = torch.randn(B, D, generator=torch.Generator().manual_seed(step))
            opt.zero_grad(set_to_none=True)
            out = model(x)
            out.pow(2).mean().backward()
            opt.step()
    records = engine.records.read()
    engine.uninstall()
    return records


@pytest.mark.parametrize("check_from", [1, STEPS], ids=["checks_from_1", "probe_only"])
@pytest.mark.parametrize("case", list(NOISE))
def test_fresh_values_no_tensor_went_into_are_no_divergence(case, check_from):
    records = _train(NOISE[case], check_from)
    bad = [(r.step, r.segment, r.check, r.outcome) for r in records if r.outcome != "match"]
    assert bad == [], bad
    probes = [json.loads(r.detail) for r in records if r.check == "probe"]
    assert probes, "the probe was not replayed"
    named = [t for d in probes for t in d.get("unreproduced_saved_tensors", [])]
    assert named, probes  # the comparison did see them differ, and said why it let them be
    assert all(d.get("follow_up") for d in probes if d.get("unreproduced_saved_tensors"))


# ---------------------------------------------------------------- the classifier itself
# At the probe step the engine watches the state a segment reads, so a missed write there is
# seen by other means; what the saved-tensor comparison alone must settle is which differing
# values it may let be. These run ops under ProducerLog as a replay would, and ask it about
# each value the way the probe does. The referee is the op sequence: a value that reads a
# buffer (or that a generator drew) must never be called "not reproduced".
_BUF = torch.linspace(0.5, 1.5, D)


def _write_behind_dispatch(ws):
    ws.numpy()[:] = _BUF.numpy()  # the dispatcher does not see this write


STATE_READS = {
    "empty_then_copy_from_buffer": lambda: torch.empty(D).copy_(_BUF),
    "empty_then_out_from_buffer": lambda: torch.mul(_BUF, 2.0, out=torch.empty(D)),
    "empty_then_in_place_add": lambda: torch.empty(D).zero_().add_(_BUF),
    "empty_written_behind_dispatch": lambda: (lambda w: (_write_behind_dispatch(w), w)[1])(
        torch.empty(D)
    ),
    "int_from_buffer_item": lambda: torch.tensor([int(_BUF[0].item() * 4)], dtype=torch.int64),
    "float_from_host_values": lambda: torch.tensor([1.25] * D),
    "float_full": lambda: torch.full((D,), 1.25),
    "int_drawn_from_generator": lambda: torch.randint(0, 9, (D,)),
    "int_from_buffer_op": lambda: (_BUF * 4).to(torch.int64),
    "multi_output_aux_then_overwritten": lambda: (lambda o: o[1].copy_(_BUF[:1]))(
        torch.var_mean(torch.ones(D, 3), dim=1)
    ),
}
NOT_STATE = {
    "empty": (lambda: torch.empty(D, 97), "uninitialized memory"),
    "empty_like_view": (lambda: torch.empty_like(_BUF).view(2, -1).t(), "uninitialized memory"),
    "new_empty": (lambda: _BUF.new_empty((3, D)), "uninitialized memory"),
    "host_int": (lambda: torch.tensor([3, 21], dtype=torch.int64), "host (Python) values"),
    "host_bool_full": (lambda: torch.full((3,), True), "host (Python) values"),
}


def _classify(make):
    from lightning_replay.kernel_noise import ProducerLog

    log = ProducerLog()
    with log:
        t = make()
    return log.unreproduced(t)


@pytest.mark.parametrize("case", list(STATE_READS))
def test_a_value_that_reads_state_is_never_called_unreproduced(case):
    assert _classify(STATE_READS[case]) is None


@pytest.mark.parametrize("case", list(NOT_STATE))
def test_a_value_no_tensor_went_into_is_called_unreproduced(case):
    make, why = NOT_STATE[case]
    got = _classify(make)
    assert got is not None and why in got, got
