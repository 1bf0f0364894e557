"""A wider zoo of tiny third-party models (HF transformers, timm, torchvision), built from
configs in code (no downloads), for an adversarial sweep of replay against plain training.

Same shape as :mod:`.models`: each :class:`RealModel` builds the model under a fixed seed,
makes batches from a private generator and computes the loss a user would train with. Every
model trains with its dropout / drop path / stochastic depth switched on. The architectures
are chosen for what might trip a replay: encoder states fed to every decoder layer (T5, BART,
Whisper, Switch), relative position biases handed from one block to the next (T5, DeBERTa) or
from one shared module to all (BEiT), sliding-window, grouped- and multi-query attention
(Mistral, Qwen2, Gemma2, GPT-BigCode), parallel residuals (GPT-NeoX, Falcon), ALiBi (BLOOM),
one layer called three times per forward (ALBERT), mixture-of-experts routers with jitter
noise and a load-balancing loss (Mixtral, Switch), layer drop drawn outside the segments
(BART, OPT, Wav2Vec2), SpecAugment masks drawn with numpy (Wav2Vec2, Whisper), selective
scans (Mamba), batch norm with squeeze-excite and drop path (EfficientNet, MobileNetV3,
RegNet), window attention with index buffers (Swin), patch dropout and register tokens (ViT),
DropBlock, and DenseNet's own nested ``torch.utils.checkpoint``.

Left out: Reformer, whose training forward reseeds torch's global generator from the OS
(``torch.seed()`` for its reversible layers), so two plain runs already differ.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .models import BATCH, SEQ, VOCAB, RealModel, _classify, _gen, _images, _make, _tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

Batch = tuple[torch.Tensor, ...]

# ------------------------------------------------------------------------------ batches
IMAGES = _images(32, BATCH)
AUDIO_SAMPLES = 800  # wav2vec2's conv stack below turns 800 samples into 49 frames
MELS, FRAMES = 8, 32  # Whisper: frames == 2 * max_source_positions


def _seq2seq(step: int) -> Batch:
    ids, mask = _tokens(step)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=_gen(500 + step))
    return ids, mask, labels


def _waveform(step: int) -> Batch:
    g = _gen(step)
    return torch.randn(BATCH, AUDIO_SAMPLES, generator=g), torch.randint(
        0, 4, (BATCH,), generator=g
    )


def _mel(step: int) -> Batch:
    g = _gen(step)
    features = torch.randn(BATCH, MELS, FRAMES, generator=g)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)
    return features, labels


def _image_text(step: int) -> Batch:
    ids, mask = _tokens(step)
    (images, _) = IMAGES(step)
    return ids, mask, images


# ------------------------------------------------------------------------------ losses
def _lm(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _seq2seq_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _hf_image_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return model(pixel_values=x, labels=y).loss


def _audio_classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return model(input_values=x, labels=y).loss


def _whisper_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    features, labels = batch
    return model(input_features=features, labels=labels).loss


def _clip_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, mask, images = batch
    return model(input_ids=ids, attention_mask=mask, pixel_values=images, return_loss=True).loss


def _googlenet_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if isinstance(out, tuple):  # training: GoogLeNetOutputs(logits, aux_logits2, aux_logits1)
        return F.cross_entropy(out[0], y) + 0.3 * (
            F.cross_entropy(out[1], y) + F.cross_entropy(out[2], y)
        )
    return F.cross_entropy(out, y)


# ------------------------------------------------------------------------------ transformers
_TINY_TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)


def _t5(**overrides: Any) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = _make(
        T5Config,
        overrides,
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    return T5ForConditionalGeneration(config)


def _bart(layerdrop: float = 0.0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=SEQ,
            dropout=0.1,
            attention_dropout=0.1,
            activation_dropout=0.1,
            encoder_layerdrop=layerdrop,
            decoder_layerdrop=layerdrop,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
            use_cache=False,
        )
        return BartForConditionalGeneration(config)

    return build


def _distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=SEQ,
        dropout=0.1,
        attention_dropout=0.1,
    )
    return DistilBertForMaskedLM(config)


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        **_TINY_TEXT,
        intermediate_size=64,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        sliding_window=4,  # shorter than SEQ: the window really cuts
        attention_dropout=0.1,
        use_cache=False,
    )
    return MistralForCausalLM(config)


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_TINY_TEXT,
        intermediate_size=64,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
        use_cache=False,
    )
    return Qwen2ForCausalLM(config)


def _gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        **_TINY_TEXT,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        rotary_pct=0.5,
        use_parallel_residual=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cache=False,
    )
    return GPTNeoXForCausalLM(config)


def _opt(layerdrop: float = 0.0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            word_embed_proj_dim=32,
            dropout=0.1,
            attention_dropout=0.1,
            layerdrop=layerdrop,
            pad_token_id=1,
            use_cache=False,
        )
        return OPTForCausalLM(config)

    return build


def _falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        **_TINY_TEXT,
        new_decoder_architecture=False,
        parallel_attn=True,
        alibi=False,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cache=False,
    )
    return FalconForCausalLM(config)


def _mamba(**overrides: Any) -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    config = _make(
        MambaConfig,
        overrides,
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        use_cache=False,
    )
    return MambaForCausalLM(config)


def _deberta_v2() -> nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    config = DebertaV2Config(
        **_TINY_TEXT,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=SEQ,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return DebertaV2ForMaskedLM(config)


def _wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="group",
        hidden_dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        feat_proj_dropout=0.1,
        layerdrop=0.1,
        mask_time_prob=0.2,  # SpecAugment, drawn with numpy at each training forward
        mask_time_length=2,
        mask_feature_prob=0.2,
        mask_feature_length=2,
        num_labels=4,
        use_weighted_layer_sum=False,
    )
    return Wav2Vec2ForSequenceClassification(config)


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MELS,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        d_model=32,
        max_source_positions=FRAMES // 2,
        max_target_positions=SEQ,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        apply_spec_augment=True,
        mask_time_prob=0.2,
        mask_time_length=2,
        mask_feature_prob=0.2,
        mask_feature_length=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        use_cache=False,
    )
    return WhisperForConditionalGeneration(config)


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        attention_dropout=0.1,
    )
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _hf_swin() -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        mlp_ratio=2.0,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        drop_path_rate=0.2,
        num_labels=10,
    )
    return SwinForImageClassification(config)


def _hf_convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        num_channels=3,
        patch_size=2,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[2, 2],
        drop_path_rate=0.2,
        layer_scale_init_value=1e-2,
        num_labels=10,
    )
    return ConvNextForImageClassification(config)


def _albert(**overrides: Any) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = _make(
        AlbertConfig,
        overrides,
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=3,  # one shared layer, called three times per forward
        num_hidden_groups=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return AlbertForMaskedLM(config)


def _mixtral(router_logits: bool, **overrides: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = _make(
            MixtralConfig,
            overrides,
            **_TINY_TEXT,
            intermediate_size=32,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.1,  # uniform noise drawn inside each layer in training
            max_position_embeddings=SEQ,
            output_router_logits=router_logits,  # the load-balancing loss
            router_aux_loss_coef=0.01,
            attention_dropout=0.1,
            use_cache=False,
        )
        return MixtralForCausalLM(config)

    return build


def _switch() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        expert_capacity=8,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        router_jitter_noise=0.1,
        dropout_rate=0.1,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    return SwitchTransformersForConditionalGeneration(config)


def _bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cache=False,
    )
    return BloomForCausalLM(config)


def _modernbert() -> nn.Module:
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        global_attn_every_n_layers=2,  # local and global attention layers alternate
        local_attention=4,
        attention_dropout=0.1,
        mlp_dropout=0.1,
        embedding_dropout=0.1,
        reference_compile=False,
        pad_token_id=0,
    )
    return ModernBertForMaskedLM(config)


def _gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **_TINY_TEXT,
        intermediate_size=64,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=SEQ,
        sliding_window=4,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        attention_dropout=0.1,
        use_cache=False,
    )
    return Gemma2ForCausalLM(config)


def _gpt_bigcode() -> nn.Module:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, multi_query=True
    )
    config.use_cache = False
    return GPTBigCodeForCausalLM(config)


def _xlnet() -> nn.Module:
    from transformers import XLNetConfig, XLNetLMHeadModel

    config = XLNetConfig(
        vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.1, mem_len=None
    )
    return XLNetLMHeadModel(config)


def _funnel() -> nn.Module:
    from transformers import FunnelConfig, FunnelForMaskedLM

    config = FunnelConfig(
        vocab_size=VOCAB,
        block_sizes=[1, 1],
        block_repeats=[1, 1],
        num_decoder_layers=1,
        d_model=32,
        n_head=4,
        d_head=8,
        d_inner=64,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
    )
    return FunnelForMaskedLM(config)


#: the HF ViT-like image classifiers' sizes and their dropout and drop path
_TINY_HF_VIT = dict(
    image_size=32,
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    drop_path_rate=0.2,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    num_labels=10,
)


def _hf_beit() -> nn.Module:
    from transformers import BeitConfig, BeitForImageClassification

    config = BeitConfig(
        **_TINY_HF_VIT,
        intermediate_size=64,
        use_shared_relative_position_bias=True,  # one bias module, its output fed to every layer
        use_relative_position_bias=False,
        layer_scale_init_value=0.1,
    )
    return BeitForImageClassification(config)


def _dinov2() -> nn.Module:
    from transformers import Dinov2Config, Dinov2ForImageClassification

    config = Dinov2Config(**_TINY_HF_VIT, mlp_ratio=2, layerscale_value=0.1)
    return Dinov2ForImageClassification(config)


# ------------------------------------------------------------------------------ timm
#: the ViT-like timm models' sizes and their dropout and drop path
_TINY_VIT = dict(
    img_size=32,
    patch_size=8,
    embed_dim=32,
    depth=2,
    num_heads=2,
    mlp_ratio=2.0,
    num_classes=10,
    drop_rate=0.1,
    drop_path_rate=0.2,
)


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    return build


def _timm_efficientnet() -> nn.Module:
    # efficientnet_b0's block recipe (depthwise conv, squeeze-excite, BatchNormAct, drop path)
    # at a quarter of its width and half its depth
    from timm.models.efficientnet import _gen_efficientnet

    return _gen_efficientnet(
        "efficientnet_b0",
        channel_multiplier=0.25,
        depth_multiplier=0.5,
        pretrained=False,
        num_classes=10,
        drop_rate=0.1,
        drop_path_rate=0.2,
    )


def _timm_regnet() -> nn.Module:
    # a RegNetY (group conv, squeeze-excite, drop path) of 72 k parameters; its stages s1..s4
    # are RegStage modules, no ModuleList or Sequential
    from timm.models.regnet import RegNet, RegNetCfg

    cfg = RegNetCfg(depth=8, w0=16, wa=8.0, wm=1.6, group_size=8, se_ratio=0.25)
    return RegNet(cfg, num_classes=10, drop_path_rate=0.2)


def _timm_convnext() -> nn.Module:
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(
        depths=(1, 1, 2, 1),
        dims=(8, 16, 24, 32),
        num_classes=10,
        drop_path_rate=0.2,
        drop_rate=0.1,
        ls_init_value=1e-2,
        patch_size=2,
    )


def _timm_swin() -> nn.Module:
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        img_size=32,
        patch_size=2,
        window_size=4,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 4),
        mlp_ratio=2.0,
        num_classes=10,
        drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_path_rate=0.2,
    )


def _timm_deit_distilled() -> nn.Module:
    from timm.models.deit import VisionTransformerDistilled

    return VisionTransformerDistilled(**_TINY_VIT)


def _timm_resnet_dropblock() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(
        block=BasicBlock,
        layers=[1, 1, 1, 1],
        channels=(16, 32, 64, 128),
        stem_width=16,
        num_classes=10,
        drop_rate=0.1,
        drop_path_rate=0.2,
        drop_block_rate=0.2,
    )


def _timm_vit_patch_drop() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        **_TINY_VIT,
        pos_drop_rate=0.1,
        patch_drop_rate=0.25,  # a random subset of patch tokens per sample, drawn before the blocks
        proj_drop_rate=0.1,
        attn_drop_rate=0.1,
        init_values=1e-2,
        reg_tokens=2,
    )


def _timm_beit() -> nn.Module:
    from timm.models.beit import Beit

    return Beit(**_TINY_VIT, use_shared_rel_pos_bias=True, use_abs_pos_emb=False, init_values=0.1)


# ------------------------------------------------------------------------------ torchvision
def _tv_mobilenet_v3() -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=10, width_mult=0.5)


def _tv_densenet(memory_efficient: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from torchvision.models import DenseNet

        return DenseNet(
            growth_rate=8,
            block_config=(2, 2),
            num_init_features=16,
            bn_size=2,
            drop_rate=0.1,
            num_classes=10,
            memory_efficient=memory_efficient,
        )

    return build


def _tv_shufflenet() -> nn.Module:
    from torchvision.models import ShuffleNetV2

    return ShuffleNetV2([2, 2, 2], [8, 16, 32, 64, 128], num_classes=10)


def _tv_squeezenet() -> nn.Module:
    import torchvision

    return torchvision.models.squeezenet1_1(num_classes=10)


def _tv_efficientnet() -> nn.Module:
    from functools import partial

    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    conf = partial(MBConvConfig, width_mult=0.25, depth_mult=1.0)
    settings = [
        conf(1, 3, 1, 32, 16, 1),
        conf(6, 3, 2, 16, 24, 2),
        conf(6, 5, 2, 24, 40, 2),
    ]
    return EfficientNet(settings, dropout=0.2, stochastic_depth_prob=0.2, num_classes=10)


def _tv_googlenet() -> nn.Module:
    from torchvision.models import GoogLeNet

    return GoogLeNet(num_classes=10, aux_logits=True, init_weights=True, dropout=0.2)


ZOO: dict[str, RealModel] = {
    m.name: m
    for m in [
        # transformers
        RealModel("t5", _t5, _seq2seq, _seq2seq_loss, "*.block.*"),
        RealModel("bart", _bart(), _seq2seq, _seq2seq_loss, "model.*.layers.*"),
        RealModel("bart_layerdrop", _bart(0.3), _seq2seq, _seq2seq_loss, "model.*.layers.*"),
        RealModel("distilbert", _distilbert, _tokens, _lm, "distilbert.transformer.layer.*"),
        RealModel("mistral_sliding", _mistral, _tokens, _lm, "model.layers.*"),
        RealModel("qwen2_gqa", _qwen2, _tokens, _lm, "model.layers.*"),
        RealModel("gpt_neox", _gpt_neox, _tokens, _lm, "gpt_neox.layers.*"),
        RealModel("opt_layerdrop", _opt(0.3), _tokens, _lm, "model.decoder.layers.*"),
        RealModel("falcon", _falcon, _tokens, _lm, "transformer.h.*"),
        RealModel("mamba", _mamba, _tokens, _lm, "backbone.layers.*"),
        RealModel("deberta_v2", _deberta_v2, _tokens, _lm, "deberta.encoder.layer.*"),
        RealModel(
            "wav2vec2",
            _wav2vec2,
            _waveform,
            _audio_classify,
            "wav2vec2.*.*layers.*",  # the conv feature extractor and the encoder
        ),
        RealModel("whisper", _whisper, _mel, _whisper_loss, "model.*.layers.*"),
        RealModel("clip", _clip, _image_text, _clip_loss, "*.encoder.layers.*"),
        RealModel("hf_swin", _hf_swin, IMAGES, _hf_image_loss, "swin.encoder.layers.*.blocks.*"),
        RealModel(
            "hf_convnext",
            _hf_convnext,
            IMAGES,
            _hf_image_loss,
            "convnext.encoder.stages.*.layers.*",
        ),
        RealModel(
            "albert_shared_layer",
            _albert,
            _tokens,
            _lm,
            "albert.encoder.albert_layer_groups.0.albert_layers.0",
        ),
        RealModel("mixtral", _mixtral(False), _tokens, _lm, "model.layers.*"),
        RealModel("mixtral_router_logits", _mixtral(True), _tokens, _lm, "model.layers.*"),
        RealModel("switch_moe", _switch, _seq2seq, _seq2seq_loss, "*.block.*"),
        RealModel("bloom_alibi", _bloom, _tokens, _lm, "transformer.h.*"),
        RealModel("modernbert", _modernbert, _tokens, _lm, "model.layers.*"),
        RealModel("gemma2_softcap", _gemma2, _tokens, _lm, "model.layers.*"),
        RealModel("gpt_bigcode_mqa", _gpt_bigcode, _tokens, _lm, "transformer.h.*"),
        RealModel("xlnet", _xlnet, _tokens, _lm, "transformer.layer.*"),
        RealModel("funnel", _funnel, _tokens, _lm, "funnel.encoder.blocks.*.*"),
        RealModel("hf_beit_shared_bias", _hf_beit, IMAGES, _hf_image_loss, "beit.layers.*"),
        RealModel("dinov2", _dinov2, IMAGES, _hf_image_loss, "dinov2.encoder.layer.*"),
        # timm
        RealModel("timm_convnext", _timm_convnext, IMAGES, _classify, "stages.*.blocks.*"),
        RealModel("timm_efficientnet", _timm_efficientnet, IMAGES, _classify, "blocks.*.*"),
        RealModel(
            "timm_mobilenetv3",
            _timm("mobilenetv3_small_050", drop_rate=0.1, drop_path_rate=0.2),
            IMAGES,
            _classify,
            "blocks.*.*",
        ),
        RealModel("timm_regnet", _timm_regnet, IMAGES, _classify, "s[1-4].b*"),
        RealModel("timm_swin", _timm_swin, IMAGES, _classify, "layers.*.blocks.*"),
        RealModel("timm_deit_distilled", _timm_deit_distilled, IMAGES, _classify, "blocks.*"),
        RealModel("timm_vit_patch_drop", _timm_vit_patch_drop, IMAGES, _classify, "blocks.*"),
        RealModel("timm_beit_shared_bias", _timm_beit, IMAGES, _classify, "blocks.*"),
        RealModel("timm_resnet_dropblock", _timm_resnet_dropblock, IMAGES, _classify, "layer*.*"),
        # torchvision
        RealModel("tv_mobilenet_v3", _tv_mobilenet_v3, IMAGES, _classify, "features.*"),
        RealModel("tv_densenet", _tv_densenet(False), IMAGES, _classify, "features.denseblock*.*"),
        RealModel(
            "tv_densenet_memory_efficient",
            _tv_densenet(True),
            IMAGES,
            _classify,
            "features.denseblock*.*",
        ),
        RealModel("tv_shufflenet", _tv_shufflenet, IMAGES, _classify, "stage*.*"),
        RealModel("tv_squeezenet", _tv_squeezenet, IMAGES, _classify, "features.*"),
        RealModel("tv_efficientnet_sd", _tv_efficientnet, IMAGES, _classify, "features.[1-3].*"),
        RealModel("tv_googlenet_aux", _tv_googlenet, IMAGES, _googlenet_loss, "inception*"),
    ]
}


def seed_all(seed: int) -> None:
    """Seed every generator a model may draw from at forward: torch's, numpy's (SpecAugment
    masks) and Python's."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
