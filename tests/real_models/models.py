"""Tiny real models built from configs in code (no downloads), with a batch and a loss each.

Each entry builds the model under a fixed seed, makes batches from a private generator, and
computes the loss a user would train with. Sizes are tiny so a test takes a few seconds on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 96
SEQ = 16
BATCH = 4


@dataclass(frozen=True)
class RealModel:
    """How to build one real model, feed it and train it."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    segments: str  # a glob for install(); the strategy auto-detects its own

    def __repr__(self) -> str:
        return self.name


def _make(cls: Callable[..., Any], overrides: dict[str, Any], **fields: Any) -> Any:
    """``cls(**fields)``, with ``overrides`` in place of fields or beside them: one builder
    serves another file's sizes (``tests/adversary_round3_zoo.py``)."""
    return cls(**{**fields, **overrides})


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _images(size: int, batch: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(step: int) -> tuple[torch.Tensor, ...]:
        g = _gen(step)
        return (
            torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )

    return make


def _tokens(step: int) -> tuple[torch.Tensor, ...]:
    g = _gen(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -5:] = 0  # one padded row: the attention mask really masks
    return ids, mask


def _classify(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _causal_lm(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _vit(**overrides: Any) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return _make(
        VisionTransformer,
        overrides,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=3,
        num_heads=2,
        mlp_ratio=2.0,
        num_classes=10,
        drop_rate=0.1,
        drop_path_rate=0.2,
    )


def _gpt2(use_cache: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=use_cache,
        )  # dropout 0.1 everywhere (GPT-2's default)
        return GPT2LMHeadModel(config)

    return build


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _bert(**overrides: Any) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = _make(
        BertConfig,
        overrides,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )  # dropout 0.1 (BERT's default)
    return BertForMaskedLM(config)


MODELS: dict[str, RealModel] = {
    m.name: m
    for m in [
        # 16x16 keeps resnet18's 11M parameters to a few seconds; layer4 still sees 1x1 maps of a
        # batch of 2 (batch norm needs more than one value per channel)
        RealModel("resnet18", _resnet18, _images(16, 2), _classify, "layer*.*"),
        RealModel("vit_drop_path", _vit, _images(32, BATCH), _classify, "blocks.*"),
        RealModel("gpt2", _gpt2(), _tokens, _causal_lm, "transformer.h.*"),
        RealModel("llama", _llama, _tokens, _causal_lm, "model.layers.*"),
        RealModel("bert", _bert, _tokens, _causal_lm, "bert.encoder.layer.*"),
    ]
}

#: GPT-2 at its default config: use_cache=True hands a mutable cache object to every layer.
GPT2_WITH_CACHE = RealModel(
    "gpt2_use_cache", _gpt2(use_cache=True), _tokens, _causal_lm, "transformer.h.*"
)


def build(spec: RealModel, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return spec.build()


def train(
    model: nn.Module, spec: RealModel, steps: int, lr: float = 0.05, seed: int = 7
) -> list[dict[str, torch.Tensor]]:
    """Plain SGD steps; the global RNG (dropout, drop_path) seeded once. Returns each step's
    gradients."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    grads = []
    for step in range(steps):
        opt.zero_grad()
        spec.loss(model, spec.batch(step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def state(model: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
