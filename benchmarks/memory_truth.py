"""Real peak memory vs the engine's figures, measured by an independent referee (CPU).

For each model: the real peak of a plain step (no recomputation), of the probe step, and of a
steady step under ``budget="min"`` beside the plan's predicted peak; then, under a byte budget
halfway between that steady step and a plain step, the probe step's and a steady step's real
peak against the budget. The referee is
``torch.profiler`` memory events (every CPU allocation and free), through
``lightning_replay.memory.StepPeak`` — code that shares nothing with the accountant.

    python benchmarks/memory_truth.py [--json OUT.json]

Models: the dense-queue ``QueueModel`` (16384 x 128, 2 blocks), HF GPT-2, Llama and BERT
(4 layers x 128, batch 4 x 64 tokens), torchvision resnet18 (batch 8, 64 x 64) and a timm ViT
with drop_path (4 blocks x 128, batch 8, 64 x 64 in 8 x 8 patches), each trained with SGD (the
queue model also with Adam, whose state the plan must count). The transformers are built from
configs (nothing downloaded) with dropout on, as they train.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import lightning_replay as lr  # noqa: E402
from lightning_replay.memory import StepPeak  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def queue_model():
    from lightning_replay.demos.hazards import QueueModel

    torch.manual_seed(0)
    m = QueueModel(rows=16384, dim=128, write_rows=256)
    return (
        m,
        "blocks.*",
        lambda s: (torch.randn(256, 128, generator=torch.Generator().manual_seed(s)),),
        lambda out: out.pow(2).mean(),
    )


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, use_cache=False
    )
    m = GPT2LMHeadModel(cfg)
    return (
        m,
        "transformer.h.*",
        lambda s: (torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(s)),),
        lambda out: out.logits.float().pow(2).mean(),
    )


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=344,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=128,
        attention_dropout=0.1,
        use_cache=False,
    )
    m = LlamaForCausalLM(cfg)
    return (
        m,
        "model.layers.*",
        lambda s: (torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(s)),),
        lambda out: out.logits.float().pow(2).mean(),
    )


def bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=512,
        num_attention_heads=4,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    m = BertForMaskedLM(cfg)
    return (
        m,
        "bert.encoder.layer.*",
        lambda s: (torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(s)),),
        lambda out: out.logits.float().pow(2).mean(),
    )


def vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(
        img_size=64,
        patch_size=8,
        embed_dim=128,
        depth=4,
        num_heads=4,
        num_classes=10,
        drop_path_rate=0.1,
    )
    return (
        m,
        "blocks.*",
        lambda s: (torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(s)),),
        lambda out: out.pow(2).mean(),
    )


def resnet18():
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=10)
    return (
        m,
        "layer*.*",
        lambda s: (torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(s)),),
        lambda out: out.pow(2).mean(),
    )


MODELS = {
    "queue": queue_model,
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "resnet18": resnet18,
    "vit_drop_path": vit,
}


def measure(build, opt_cls=torch.optim.SGD, steps: int = 12) -> dict:
    model, segs, make, loss_fn = build()
    model.train()
    plain = copy.deepcopy(model)

    def run(m, step, opt, referee=True):
        # The engine measures the first step of each plan with the profiler itself; the
        # referee (a profiler too) stays off on those steps and judges the others.
        meter = StepPeak(m) if referee else None
        if meter:
            meter.start()
        opt.zero_grad(set_to_none=True)
        loss_fn(m(*make(step))).backward()
        opt.step()
        return meter.stop() if meter else None

    opt = opt_cls(plain.parameters(), lr=1e-3)
    plain_peaks = [run(plain, s, opt) for s in range(3)]
    engine = lr.install(model, segs, budget="min", real_peak=True)
    engine.track_optimizer(opt := opt_cls(model.parameters(), lr=1e-3))
    peaks, predicted = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            peaks.append(run(model, s, opt, referee=s == 0 or s >= steps - 2))
            predicted.append(engine.plan.peak_memory if engine.plan else None)
    assert engine.last_real_peak is not None, "the engine measured no step"
    last_pred = next(p for p in reversed(predicted) if p is not None)
    # A byte budget halfway between the lowest-memory plan and a plain step: its probe step
    # keeps no activations (replayed probes), and every step must stay within it.
    budget = (peaks[-1] + plain_peaks[-1]) // 2
    model = copy.deepcopy(plain)
    engine = lr.install(model, segs, budget=budget, real_peak=True)
    engine.track_optimizer(opt := opt_cls(model.parameters(), lr=1e-3))
    budgeted = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            budgeted.append(run(model, s, opt, referee=s == 0 or s >= steps - 2))
    return {
        "plain_step": plain_peaks[-1],
        "probe_step": peaks[0],
        "probe_vs_plain": peaks[0] / plain_peaks[-1],
        "min_predicted": last_pred,
        "min_real": peaks[-1],
        "predicted_vs_real": last_pred / peaks[-1],
        "plan": engine.plan.choices if engine.plan else None,
        "budget": budget,
        "budgeted_probe_step": budgeted[0],
        "budgeted_probe_vs_budget": budgeted[0] / budget,
        "budgeted_steady_vs_budget": budgeted[-1] / budget,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    out = {}
    for name in args.models.split(","):
        out[name] = measure(MODELS[name])
        if name == "queue":
            out["queue_adam"] = measure(MODELS[name], torch.optim.Adam)
    mib = 2**20
    print(
        f"{'model':14} {'plain':>9} {'probe':>9} {'probe/plain':>11} {'min pred':>9} "
        f"{'min real':>9} {'pred/real':>9} {'budget':>9} {'probe/bud':>9} {'steady/bud':>10}"
    )
    for k, r in out.items():
        print(
            f"{k:14} {r['plain_step'] / mib:9.1f} {r['probe_step'] / mib:9.1f} "
            f"{r['probe_vs_plain']:11.3f} {r['min_predicted'] / mib:9.1f} "
            f"{r['min_real'] / mib:9.1f} {r['predicted_vs_real']:9.3f} "
            f"{r['budget'] / mib:9.1f} {r['budgeted_probe_vs_budget']:9.3f} "
            f"{r['budgeted_steady_vs_budget']:10.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
