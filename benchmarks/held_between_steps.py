"""What the process holds between steps under replay, against torch checkpoint on the same blocks,
and what is still alive after ``engine.uninstall()`` (CPU; issue 31).

torchvision ResNet-50, batch 16 at 64 px, AdamW, every bottleneck block a segment. Each arm
(torch checkpoint, then replay) trains a copy of one model alone in the process, with the
cyclic garbage collector off; after each step the whole process's live tensor bytes are read by a
walk of the garbage collector's objects (each storage once). Then the replay arm is uninstalled,
its model and optimizer dropped, and the bytes still alive are read, without and with
``gc.collect()``.

    python benchmarks/held_between_steps.py [--budget min] [--steps 4] [--batch 16] [--px 64]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import lightning_replay as lr  # noqa: E402
from lightning_replay.verify import torch_checkpoint  # noqa: E402

MiB = 2**20


def live_bytes() -> int:
    """The process's live CPU tensor bytes, each storage once (a walk of the collector's
    objects)."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if (
                issubclass(type(obj), torch.Tensor)
                and obj.device.type == "cpu"
                and not obj.is_sparse
            ):
                try:
                    s = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if s.data_ptr():
                    seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run(proto, names, batches, replay: dict | None) -> dict:
    model = copy.deepcopy(proto)
    gc.collect()
    base = live_bytes()
    gc.disable()
    try:
        engine = lr.install(model, names, **replay) if replay is not None else None
        if engine is None:
            torch_checkpoint(model, names)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        held = []
        for x in batches:
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            held.append(live_bytes() - base)
        out = {"held": held}
        if engine is not None:
            engine.uninstall()
            del model, opt
            out["alive_after_uninstall"] = live_bytes() - base + _model_bytes(proto)
            gc.collect()
            out["alive_after_uninstall_and_collect"] = live_bytes() - base + _model_bytes(proto)
    finally:
        gc.enable()
        gc.collect()
    return out


def _model_bytes(proto) -> int:
    # the copy's parameters and buffers were in the base: a dead copy reads as minus them
    return sum(
        t.untyped_storage().nbytes() for t in list(proto.parameters()) + list(proto.buffers())
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default=None, help="install(budget=...): none, or e.g. min")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--px", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torchvision

    torch.manual_seed(0)
    proto = torchvision.models.resnet50(num_classes=10)
    names = [n for n, _ in proto.named_modules() if n.startswith("layer") and n.count(".") == 1]
    batches = [
        torch.randn(args.batch, 3, args.px, args.px, generator=torch.Generator().manual_seed(i))
        for i in range(args.steps)
    ]
    ref = run(proto, names, batches, None)
    rep = run(proto, names, batches, {"budget": args.budget, "calibration_steps": 1})
    over = [(r - t) / MiB for r, t in zip(rep["held"], ref["held"])]
    result = {
        "held_beyond_torch_checkpoint_MiB": [round(o, 2) for o in over],
        "alive_after_uninstall_MiB": round(rep["alive_after_uninstall"] / MiB, 2),
        "alive_after_uninstall_and_collect_MiB": round(
            rep["alive_after_uninstall_and_collect"] / MiB, 2
        ),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
