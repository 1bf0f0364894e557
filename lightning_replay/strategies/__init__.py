"""Lightning strategies. Importing this registers ``"replay"``, its launcher variants and
``"replay_fsdp"``."""

from lightning_replay.strategies.replay import (
    STRATEGY_NAMES,
    ReplayStrategy,
    default_segments,
    register,
)
from lightning_replay.strategies.replay_fsdp import ReplayFSDPStrategy, register as _register_fsdp

register()
_register_fsdp()

__all__ = ["STRATEGY_NAMES", "ReplayFSDPStrategy", "ReplayStrategy", "default_segments", "register"]
