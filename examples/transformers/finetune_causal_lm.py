"""Fine-tune a tiny Hugging Face causal LM on generated text with ``strategy="replay"``.

The model (GPT-2 by default, or Llama) is built from a config in code and the text is made
up here, character by character, so nothing is downloaded. Each transformer layer is a replay
segment (found automatically); the budget caps the step's peak memory and the planner chooses,
per layer, what to keep and what to replay. ``ReplayCallback`` checks a sampled step's replays
against the layers' own gradients, bit for bit, and writes the records.

A derivative check keeps one replayed layer's graph beside its replay, so a checked step needs
room for one layer's activations twice. The default budget (16 MiB) leaves it: the plan
replays one of the four layers, and a checked step replays more of them for that step so the
check fits. Under a budget too tight for that (12 MiB for this model), the checks are skipped
and the summary says how many and why.

Run from the repository root (CPU, about a minute)::

    .venv/bin/python examples/transformers/finetune_causal_lm.py
    .venv/bin/python examples/transformers/finetune_causal_lm.py --model llama --budget 24MiB

``use_cache=False``: HF decoders pass a mutable cache object into every layer when the cache
is on, which a replay cannot keep exact; the strategy refuses it at the first step.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_replay  # noqa: E402,F401  (registers strategy="replay")
from lightning_replay import ReplayCallback, ReplayStrategy  # noqa: E402

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "finds", "follows", "draws", "remembers"]
OBJECTS = ["the moon", "a red ball", "the river", "an apple", "the quiet house", "a song"]


def generated_text(sentences: int, seed: int = 0) -> str:
    """Simple sentences from a tiny grammar: learnable in a minute by a tiny model."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
        for _ in range(sentences)
    )


class CharTokenizer:
    """Characters to ids (no vocabulary file to download)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def build_model(kind: str, vocab: int, context: int, eos: int) -> torch.nn.Module:
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=vocab,
                n_positions=context,
                n_embd=64,
                n_layer=4,
                n_head=4,
                bos_token_id=eos,
                eos_token_id=eos,
                use_cache=False,
            )
        )
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=context,
                bos_token_id=eos,
                eos_token_id=eos,
                pad_token_id=eos,
                use_cache=False,
            )
        )
    raise SystemExit(f"--model {kind!r}: use 'gpt2' or 'llama'")


class CausalLM(L.LightningModule):
    def __init__(self, kind: str, vocab: int, context: int, eos: int, lr: float) -> None:
        super().__init__()
        self.net = build_model(kind, vocab, context, eos)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument(
        "--budget",
        default="16MiB",
        help="peak-memory budget: bytes, '32MiB', a fraction such as 0.5, "
        "or 'min' for the lowest-memory plan",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--root", default="runs/transformers_replay")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    text = generated_text(4000)
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    n = (len(ids) - 1) // args.context
    windows = ids[: n * args.context].view(n, args.context)
    loader = DataLoader(TensorDataset(windows), batch_size=args.batch, shuffle=True, drop_last=True)

    model = CausalLM(args.model, len(tok.chars), args.context, eos=tok.index["."], lr=3e-3)
    budget = args.budget if not args.budget.replace(".", "", 1).isdigit() else float(args.budget)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        strategy=ReplayStrategy(budget=budget),
        callbacks=[ReplayCallback(check_every_n_steps=20)],
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(model, loader)

    engine = trainer.strategy.engine
    summary = engine.summary()
    records = engine.records.read()
    checks = [r for r in records if r.check in ("grad", "bytes")]
    result = {
        "grad_checks": sum(r.check == "grad" for r in checks),
        "byte_checks": sum(r.check == "bytes" for r in checks),
        "grad_checks_skipped": engine.checks_skipped,
        "loss": float(trainer.callback_metrics["loss"]),
        "plan": engine.plan.choices if engine.plan else None,
        "predicted_peak_bytes": engine.plan.peak_memory if engine.plan else None,
        "replays": {name: s["replays"] for name, s in summary.items()},
        "checks": len(checks),
        "not_match": sum(r.outcome != "match" for r in records),
    }
    model.eval()
    prompt = tok.encode("the cat ")[None]
    with torch.no_grad():
        out = model.net.generate(
            prompt, max_new_tokens=40, do_sample=False, pad_token_id=tok.index["."]
        )
    print(f"final loss {result['loss']:.3f}; plan {result['plan']}")
    verdict = "all match" if result["not_match"] == 0 else f"{result['not_match']} did not match"
    print(
        f"checks: {result['grad_checks']} derivative (gradients, bit for bit), "
        f"{result['byte_checks']} byte-level; {verdict}"
        + (
            f"; {result['grad_checks_skipped']} derivative checks skipped (see the summary)"
            if result["grad_checks_skipped"]
            else ""
        )
    )
    print("sample:", tok.decode(out[0]))
    return result


if __name__ == "__main__":
    main()
