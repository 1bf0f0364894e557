"""Tiny real models of kinds the other tests do not have, built from configs (no downloads).

Each builder returns ``(model, pattern, make_input)``: ``model`` is a root module whose forward
takes one tensor and returns the training loss (a scalar), ``pattern`` a glob naming its
segments, ``make_input(step)`` the step's batch. Dropout, drop path and router noise stay on.
Where :mod:`tests.real_models` builds the architecture too, its builder makes the model, with
this file's sizes.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from tests.real_models import models as real, zoo

Builder = Callable[[], tuple[nn.Module, str, Callable[[int], torch.Tensor]]]


class Root(nn.Module):
    """The model under ``m`` and a loss: the window's root."""

    def __init__(self, m: nn.Module, loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.m = m
        self._loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._loss(self.m, x)


#: the batch is multiplied by this (the memory tests raise it: activations of a few MiB, so
#: that 1 MiB of slack is small beside what a leak would keep)
SCALE = {"batch": 1}


def _images(n: int, px: int) -> Callable[[int], torch.Tensor]:
    n *= SCALE["batch"]
    return lambda s: torch.randn(n, 3, px, px, generator=torch.Generator().manual_seed(s))


def _tokens(n: int, seq: int, vocab: int = 128) -> Callable[[int], torch.Tensor]:
    n *= SCALE["batch"]
    return lambda s: torch.randint(1, vocab, (n, seq), generator=torch.Generator().manual_seed(s))


def _logits_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


def _causal_lm_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x, labels=x).loss


def vit() -> tuple[nn.Module, str, Callable]:
    """timm ViT, tiny dims, dropout + attention dropout + drop path."""
    pytest.importorskip("timm")
    m = real._vit(proj_drop_rate=0.1, attn_drop_rate=0.1)
    return Root(m, _logits_loss), "m.blocks.*", _images(4, 32)


def convnext() -> tuple[nn.Module, str, Callable]:
    """timm ConvNeXt (atto-like, smaller dims): layer scale, LayerNorm2d, drop path."""
    cn = pytest.importorskip("timm.models.convnext")
    m = cn.ConvNeXt(depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=10, drop_path_rate=0.2)
    return Root(m, _logits_loss), "m.stages.*", _images(4, 32)


def timm_mobilenetv3() -> tuple[nn.Module, str, Callable]:
    """timm MobileNetV3 (BN, squeeze-excite, hard-swish, drop path)."""
    pytest.importorskip("timm")
    m = zoo._timm("mobilenetv3_small_050", drop_rate=0.1, drop_path_rate=0.2)()
    return Root(m, _logits_loss), "m.blocks.*", _images(4, 32)


def tv_efficientnet() -> tuple[nn.Module, str, Callable]:
    """torchvision EfficientNet-B0 layout at a quarter width: BN, SE, stochastic depth."""
    ef = pytest.importorskip("torchvision.models.efficientnet")
    setting, last = ef._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.4)
    m = ef.EfficientNet(
        setting, dropout=0.2, stochastic_depth_prob=0.3, num_classes=10, last_channel=last
    )
    return Root(m, _logits_loss), "m.features.*", _images(4, 32)


def tv_mobilenet_v3() -> tuple[nn.Module, str, Callable]:
    """torchvision MobileNetV3-small at half width: BN, SE, dropout in the head."""
    tv = pytest.importorskip("torchvision.models")
    m = tv.mobilenet_v3_small(num_classes=10, width_mult=0.25)
    return Root(m, _logits_loss), "m.features.*", _images(4, 32)


def tv_regnet() -> tuple[nn.Module, str, Callable]:
    """torchvision RegNet with small widths (grouped convs, BN, SE)."""
    rg = pytest.importorskip("torchvision.models.regnet")
    params = rg.BlockParams.from_init_params(
        depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25
    )
    m = rg.RegNet(params, num_classes=10)
    return Root(m, _logits_loss), "m.trunk_output.*.*", _images(4, 32)


#: BERT's and RoBERTa's sizes here (the real-model zoo's BERT is smaller)
_ENCODER = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def _bert_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n, seq = x.shape
    mask = torch.ones_like(x)
    mask[: n // 2, seq - seq // 4 :] = 0  # half the batch padded
    types = (torch.arange(seq) >= seq // 2).long().expand(n, seq)
    return m(input_ids=x, attention_mask=mask, token_type_ids=types, labels=x).loss


def bert_mlm() -> tuple[nn.Module, str, Callable]:
    """HF BERT for masked LM (decoder tied to the word embeddings), token types, padding."""
    pytest.importorskip("transformers")
    m = real._bert(**_ENCODER)
    return Root(m, _bert_loss), "m.bert.encoder.layer.*", _tokens(4, 32)


def roberta() -> tuple[nn.Module, str, Callable]:
    """HF RoBERTa for masked LM: padding-aware position ids, tied decoder."""
    tr = pytest.importorskip("transformers")
    cfg = tr.RobertaConfig(**_ENCODER, type_vocab_size=1, pad_token_id=0)

    def loss(m, x):
        mask = torch.ones_like(x)
        mask[:, -4:] = 0
        return m(input_ids=x * mask, attention_mask=mask, labels=x).loss

    return Root(tr.RobertaForMaskedLM(cfg), loss), "m.roberta.encoder.layer.*", _tokens(4, 32)


def albert() -> tuple[nn.Module, str, Callable]:
    """HF ALBERT: one shared layer called for every depth, a segment called 3 times a step."""
    pytest.importorskip("transformers")
    m = zoo._albert(vocab_size=128, num_attention_heads=2, max_position_embeddings=64)
    return Root(m, _bert_loss), "m.albert.encoder.albert_layer_groups.*", _tokens(4, 32)


def t5() -> tuple[nn.Module, str, Callable]:
    """HF T5 encoder-decoder: relative position bias (computed by block 0, passed on), cross
    attention, tied embeddings, dropout."""
    pytest.importorskip("transformers")
    # relative_attention_max_distance: T5's default (the real-model zoo's T5 sets 16)
    m = zoo._t5(vocab_size=128, relative_attention_max_distance=128)

    def loss(m, x):
        return m(input_ids=x, labels=x.flip(1)).loss

    return Root(m, loss), "m.*coder.block.*", _tokens(4, 16)


def mixtral() -> tuple[nn.Module, str, Callable]:
    """HF Mixtral MoE: top-2 routing over 4 experts, router jitter noise (RNG), aux loss."""
    pytest.importorskip("transformers")
    m = zoo._mixtral(True, vocab_size=128, intermediate_size=64, max_position_embeddings=64)()
    return Root(m, _causal_lm_loss), "m.model.layers.*", _tokens(4, 32)


def qwen_moe() -> tuple[nn.Module, str, Callable]:
    """HF Qwen2-MoE: routed experts + a gated shared expert, aux loss."""
    tr = pytest.importorskip("transformers")
    cfg = tr.Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        max_position_embeddings=64,
        use_cache=False,
    )
    return Root(tr.Qwen2MoeForCausalLM(cfg), _causal_lm_loss), "m.model.layers.*", _tokens(4, 32)


def mamba() -> tuple[nn.Module, str, Callable]:
    """HF Mamba (the slow, pure-torch scan on CPU): selective state space, depthwise conv."""
    pytest.importorskip("transformers")
    m = zoo._mamba(vocab_size=128, state_size=8)
    return Root(m, _causal_lm_loss), "m.backbone.layers.*", _tokens(4, 32)


class _SharedNet(nn.Module):
    """Tied weights across segments and one block object called twice per forward."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d, 2 * d),
                nn.BatchNorm1d(2 * d),
                nn.GELU(),
                nn.Dropout(0.1),
                nn.Linear(2 * d, d),
            )
            for _ in range(3)
        )
        self.blocks[2][0].weight = self.blocks[0][0].weight  # tied across two segments
        self.head = nn.Linear(d, 10)
        self.head.weight = nn.Parameter(self.embed.weight[:10, :16].clone().repeat(1, 2))

    def forward(self, x):
        h = self.embed(x)
        for i in (0, 1, 0, 2):  # block 0 runs twice
            h = h + self.blocks[i](h)
        return self.head(h)


def shared_blocks() -> tuple[nn.Module, str, Callable]:
    n = 32 * SCALE["batch"]
    return (
        Root(_SharedNet(), _logits_loss),
        "m.blocks.*",
        lambda s: torch.randn(n, 16, generator=torch.Generator().manual_seed(s)),
    )


MODELS: dict[str, Builder] = {
    f.__name__: f
    for f in [
        vit,
        convnext,
        timm_mobilenetv3,
        tv_efficientnet,
        tv_mobilenet_v3,
        tv_regnet,
        bert_mlm,
        roberta,
        albert,
        t5,
        mixtral,
        qwen_moe,
        mamba,
        shared_blocks,
    ]
}


def build(name: str, batch: int = 1) -> tuple[nn.Module, str, Callable]:
    """The model ``name``, its segments' pattern and its batches (``batch`` x the base batch)."""
    torch.manual_seed(0)
    SCALE["batch"] = batch
    try:
        return MODELS[name]()
    finally:
        SCALE["batch"] = 1


def params_of(out: Any) -> int:
    return sum(p.numel() for p in out.parameters())
