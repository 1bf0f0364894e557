"""Lightning strategies. Importing this registers ``"replay"`` and its launcher variants."""
from lightning_replay.strategies.replay import (STRATEGY_NAMES, ReplayStrategy, default_segments,
                                                register)

register()

__all__ = ["STRATEGY_NAMES", "ReplayStrategy", "default_segments", "register"]
