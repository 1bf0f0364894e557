"""Lightning callbacks."""

from lightning_replay.callbacks.replay import CHECKS, REPLAN_ON, ReplayCallback

__all__ = ["CHECKS", "REPLAN_ON", "ReplayCallback"]
