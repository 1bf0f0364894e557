"""Does recomputation free activations under FSDP2? One process (gloo), four batch-norm blocks
each its own ``fully_shard`` unit (``reshard_after_forward=True``), 256 wide, batch 512: the peak
of the bytes a forward allocates (what it keeps for backward; profiler allocation events, the
referee of tests/helpers/torch_memory.py) for plain FSDP, ``torch.utils.checkpoint`` on the blocks, and
``lr.install(preservation="whole")`` after its probe and calibration.

    python benchmarks/fsdp_forward_memory.py

2026-12-03, CPU: plain 6412 KiB, torch checkpoint 2844 KiB, replay (whole) 2844 KiB.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import lightning_replay as lr  # noqa: E402
from helpers.torch_memory import allocation_peak  # noqa: E402
from lightning_replay.demos.hazards import BNBlock  # noqa: E402

D, B = 256, 512


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(BNBlock(D) for _ in range(4))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(mode: str, mesh) -> nn.Module:
    m = Net()
    for b in m.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=True)
    fully_shard(m, mesh=mesh)
    if mode == "checkpoint":
        for b in m.blocks:
            b.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(b.forward)
    elif mode != "plain":
        lr.install(m, "blocks.*", preservation=mode, budget=1 << 40)
    return m


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(B, D)
    warnings.simplefilter("ignore")
    for mode in ["plain", "checkpoint", "whole"] * 2:
        m = build(mode, mesh)
        for _ in range(10):  # past the probe and the calibration
            m(x).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
        box = {}

        def forward():
            box["out"] = m(x).pow(2).mean()

        print(
            f"{mode:10} forward allocation peak: {allocation_peak(forward) // 1024} KiB",
            flush=True,
        )
        box.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
