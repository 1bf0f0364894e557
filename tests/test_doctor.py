"""``lr.diagnose``: verdicts measured against plain training, on copies, never on the model."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn

import lightning_replay as lr
from lightning_replay.doctor import ModelRunError
from lightning_replay.demos.hazards import HAZARDS, BNBlock, MLPBlock, _Stack
from lightning_replay.verify import (
    diff_state,
    grad_diffs,
    snapshot_state,
    torch_checkpoint,
    train_steps,
)

EXACT = "torch checkpoint is exact on this model"
DIFFERS = re.compile(r"torch checkpoint silently differs in (\d+) gradients? and (\d+) buffers?$")
RAISES = re.compile(r"torch checkpoint raises (\w+): ")

#: What torch.utils.checkpoint does to each hazard (design notes, hazard table in the README).
EXPECTED = {
    "stateless": "exact",
    "batch_norm": "differs",
    "counter": "differs",
    "queue": "differs",
    "bank_index_copy": "differs",
    "bank_index_put": "differs",
    "bank_scatter": "differs",
    "inplace_whole": "differs",
    "tensor_attr": "differs",
    "alias_input": "raises",
    "rng": "differs",
    "python_attrs": "raises",
    "combined": "raises",
}


def _kind(verdict: str) -> str:
    if verdict == EXACT:
        return "exact"
    if DIFFERS.match(verdict):
        return "differs"
    assert RAISES.match(verdict), verdict
    return "raises"


@pytest.mark.parametrize("name", sorted(HAZARDS))
def test_hazard_verdicts(name):
    assert set(EXPECTED) == set(HAZARDS)
    h = HAZARDS[name]()
    report = lr.diagnose(h.model, h.make_input, segments=h.segments)
    assert _kind(report.verdict) == EXPECTED[name]
    # lightning_replay on the same segments is exact on every hazard.
    assert report.replay.exact, report.table()
    assert [d.name for d in report.diagnoses] == h.segments


def test_verdict_agrees_with_an_independent_torch_checkpoint_run():
    # The queue hazard by hand: plain training vs verify.torch_checkpoint, same seeds.
    h = HAZARDS["queue"]()
    seed_of = {}

    def batch(step):
        seed_of[step] = torch.initial_seed()
        return h.make_input(step)

    report = lr.diagnose(h.model, batch, segments=h.segments, seed=100)
    g_ref, _ = train_steps(copy.deepcopy(h.model), h.make_input, 2, lr=1e-2, rng_seed=100)
    ckpt = torch_checkpoint(copy.deepcopy(h.model), h.segments)
    g_ck, _ = train_steps(ckpt, h.make_input, 2, lr=1e-2, rng_seed=100)
    wrong = grad_diffs(g_ref, g_ck)
    assert seed_of == {0: 100, 1: 101}
    assert sorted({n for _, n in wrong}) == [g.name for g in report.torch_checkpoint.gradients]
    for g in report.torch_checkpoint.gradients:
        assert g.steps == sorted(s for s, n in wrong if n == g.name)
        worst = max(
            float((g_ck[s][g.name] - g_ref[s][g.name]).norm() / g_ref[s][g.name].norm())
            for s in g.steps
        )
        assert g.max_rel == pytest.approx(worst, rel=1e-5)
    assert [s.name for s in report.torch_checkpoint.state] == ["queue"]


def test_batch_norm_report_names_state_and_counts():
    h = HAZARDS["batch_norm"]()
    report = lr.diagnose(h.model, h.make_input)  # segments from the largest block list
    assert report.segments == ["blocks.0", "blocks.1"]
    assert report.verdict == "torch checkpoint silently differs in 0 gradients and 6 buffers"
    nbt = {s.name: s for s in report.torch_checkpoint.state}["blocks.0.bn.num_batches_tracked"]
    assert (nbt.kind, nbt.reference, nbt.observed) == ("buffer", "2", "4")  # updated twice
    d = report.diagnoses[0]
    assert d.auto_option == "whole"
    rm = {s.name: s for s in d.state}["blocks.0.bn.running_mean"]
    assert (rm.kind, rm.access, rm.changes_in_window, rm.preservation, rm.nbytes) == (
        "buffer",
        "writes",
        True,
        "whole",
        16 * 4,
    )
    assert d.preserved_bytes == 2 * 16 * 4 + 8 == d.options["whole"]
    assert d.activation_bytes > 0 and d.net_freed_bytes == d.activation_bytes - 136
    text = report.table()
    assert (
        report.verdict in text
        and "blocks.0.bn.num_batches_tracked (buffer): plain 2, this run 4" in text
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["verdict"] == report.verdict and data["replay"]["exact"] is True
    assert data["diagnoses"][0]["auto_option"] == "whole"
    assert "<section" in report.to_html() and report.verdict in report.to_html()


def test_kinds_generators_python_attributes_and_aliased_inputs():
    combined = HAZARDS["combined"]()
    report = lr.diagnose(combined.model, combined.make_input, segments=combined.segments)
    by = {d.name: d for d in report.diagnoses}
    assert {(s.name, s.kind) for s in by["blocks.3"].state} == {("blocks.3.gen", "generator")}
    assert by["blocks.3"].uses_global_rng
    assert {s.name for s in by["blocks.4"].state if s.kind == "Python attribute"} == {
        "blocks.4.calls",
        "blocks.4.use_gate",
    }
    assert by["blocks.2"].auto_option == "regions"
    assert by["blocks.2"].preserved_bytes < by["blocks.2"].options["whole"]
    assert by["blocks.5"].auto_option == "recompute" and by["blocks.5"].state == []

    attr = HAZARDS["tensor_attr"]()
    report = lr.diagnose(attr.model, attr.make_input, segments=attr.segments)
    (mem,) = report.diagnoses[0].state
    assert mem.kind == "tensor attribute" and mem.changes_in_window
    assert {mem.name, *mem.shared_with} == {"writer.memory", "blocks.1.shared"}

    alias = HAZARDS["alias_input"]()
    report = lr.diagnose(alias.model, alias.make_input, segments=alias.segments)
    assert {s.name for s in report.diagnoses[0].state if s.aliased_input} == {"memory"}


def test_model_hooks_and_global_rng_untouched():
    h = HAZARDS["combined"]()
    model = h.model
    calls = []
    handle = model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    model.eval()  # diagnose trains copies in training mode; the model keeps its own
    before = snapshot_state(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    hooks = {
        n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
        for n, m in model.named_modules()
    }
    forward = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()

    lr.diagnose(model, h.make_input, segments=h.segments)

    assert torch.equal(torch.get_rng_state(), rng)
    assert diff_state(before, snapshot_state(model)) == []
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert {
        n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
        for n, m in model.named_modules()
    } == hooks
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forward
    assert not model.training and all(p.grad is None for p in model.parameters())
    calls.clear()
    model(h.make_input(0))
    assert calls == [1]  # the user's hook still fires, once
    handle.remove()


def test_checkpoint_wrapper_in_the_model_is_diagnosed_as_it_stands():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = _Stack([checkpoint_wrapper(BNBlock()), checkpoint_wrapper(MLPBlock())])
    report = lr.diagnose(model, HAZARDS["batch_norm"]().make_input)
    assert report.existing_checkpointing == "checkpoint_wrapper on 2 modules"
    assert report.segments == [
        "blocks.0._checkpoint_wrapped_module",
        "blocks.1._checkpoint_wrapped_module",
    ]
    assert report.verdict == "torch checkpoint silently differs in 0 gradients and 3 buffers"
    assert report.replay.exact
    assert [d.auto_option for d in report.diagnoses] == ["whole", "recompute"]


def test_torchvision_resnet_silently_differs_batch_norm_updated_twice():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4)
    images = torch.randn(2, 3, 32, 32)
    report = lr.diagnose(
        model,
        lambda step: images,
        segments="layer*.*",
        loss_fn=lambda m, x: m(x).logsumexp(1).mean(),
    )
    assert torchvision and report.segments == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    n_bn = sum(
        isinstance(m, nn.BatchNorm2d) for n, m in model.named_modules() if n.startswith("layer")
    )
    m = DIFFERS.match(report.verdict)
    assert m and int(m[2]) == 3 * n_bn, report.verdict  # running mean, var and count of each
    state = {s.name: s for s in report.torch_checkpoint.state}
    assert (
        state["layer4.0.bn1.num_batches_tracked"].reference,
        state["layer4.0.bn1.num_batches_tracked"].observed,
    ) == ("2", "4")
    assert report.replay.exact
    assert {d.auto_option for d in report.diagnoses} == {"whole"}


def _tiny_gpt2(**overrides):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _token_batch(step):
    ids = torch.randint(0, 64, (2, 8))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_hf_gradient_checkpointing_with_dropout_is_exact():
    model = _tiny_gpt2(use_cache=False)
    model.gradient_checkpointing_enable()
    report = lr.diagnose(model, _token_batch)
    assert report.existing_checkpointing == "HF gradient checkpointing on 2 layers"
    assert report.segments == ["transformer.h.0", "transformer.h.1"]
    assert report.verdict == EXACT
    assert report.torch_checkpoint.parameters_compared > 0
    assert report.replay.exact
    # Dropout draws from the global RNG, which torch checkpoint restores for the replay.
    assert all(d.uses_global_rng and d.auto_option == "recompute" for d in report.diagnoses)
    assert model.transformer.h[0].gradient_checkpointing is True  # the user's model as it was


def test_hf_dropout_really_differs_without_rng_restore():
    # The exact verdict above is not vacuous: the same comparison sees dropout masks.
    model = _tiny_gpt2(use_cache=False)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(0)
    la = a(**_token_batch(0)).loss
    torch.manual_seed(1)
    lb = b(**_token_batch(0)).loss
    assert not torch.equal(la, lb)


# ------------------------------------------------------------------------------ bad input
def test_model_that_does_not_run_on_the_batch():
    h = HAZARDS["stateless"]()
    with pytest.raises(
        ModelRunError,
        match=r"_Stack fails on batch_fn\(0\).*\(8, 5\).*"
        r"without any recomputation",
    ):
        lr.diagnose(h.model, lambda step: torch.randn(8, 5))


def test_no_candidate_segments():
    model = nn.Linear(4, 4)
    with pytest.raises(lr.SegmentError, match="Linear has no candidate segments.*segments="):
        lr.diagnose(model, lambda step: torch.randn(2, 4))
    with pytest.raises(lr.SegmentError, match="'nope' is not a submodule"):
        lr.diagnose(HAZARDS["stateless"]().model, lambda s: torch.randn(8, 16), segments="nope")


def test_segments_that_never_run():
    h = HAZARDS["stateless"]()
    h.model.unused = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(lr.SegmentError, match=r"none of the segments \['unused.0'\]"):
        lr.diagnose(h.model, h.make_input, segments="unused.*")


def test_batch_on_another_device_than_the_model():
    model = HAZARDS["stateless"]().model.to("meta")
    with pytest.raises(
        lr.ReplayConfigError, match="is on meta but batch_fn\\(0\\) returned tensors on cpu"
    ):
        lr.diagnose(model, lambda step: torch.randn(8, 16))


def test_bad_arguments():
    h = HAZARDS["stateless"]()
    with pytest.raises(lr.ReplayConfigError, match="steps=0"):
        lr.diagnose(h.model, h.make_input, steps=0)
    with pytest.raises(lr.ReplayConfigError, match="batch_fn"):
        lr.diagnose(h.model, None)
    with pytest.raises(lr.ReplayConfigError, match="must be a scalar tensor that requires grad"):
        lr.diagnose(h.model, h.make_input, loss_fn=lambda m, x: m(x))


class _PyDropBlock(nn.Module):
    """A branch scaled by draws from Python's global ``random`` and from a module-held numpy
    generator: torch checkpoint's replay draws again (the same path, other values)."""

    def __init__(self) -> None:
        super().__init__()
        import numpy as np

        self.fc = nn.Linear(8, 8)
        self.rs = np.random.RandomState(0)

    def forward(self, x):
        import random

        scale = random.random() + float(self.rs.uniform(0.5, 1.5))
        return x + torch.tanh(self.fc(x) * scale)


def test_generators_outside_torch_are_seeded_compared_and_left_as_they_were():
    """Each run starts every step from the same Python and numpy streams; torch checkpoint's
    replay draws a second time and the report names the generators it moved (and the
    gradients that follow); lightning_replay puts them back. The process's own streams are
    as before the diagnosis."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = _Stack([_PyDropBlock(), _PyDropBlock()], 8)
    random.seed(5)
    np.random.seed(5)
    py, npy = random.getstate(), np.random.get_state()[1].copy()
    report = lr.diagnose(model, lambda s: torch.randn(4, 8), segments=["blocks.0", "blocks.1"])
    assert random.getstate() == py and (np.random.get_state()[1] == npy).all()
    moved = {s.name for s in report.torch_checkpoint.state if s.kind == "generator"}
    assert moved == {"random (Python global)", "blocks.0.rs", "blocks.1.rs"}, moved
    assert report.torch_checkpoint.gradients  # the replays' other draws, in the gradients
    assert report.replay.exact, report.table()
    assert report.replay.state == []
