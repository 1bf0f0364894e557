"""Demo models and the demo jobs (the way ``lightning.pytorch.demos`` ships its boring classes).

- :mod:`~lightning_replay.demos.hazards`: plain ``nn.Module`` blocks, each with one state hazard
  that ``torch.utils.checkpoint`` replays wrongly, and :data:`~lightning_replay.demos.hazards.HAZARDS`;
- :mod:`~lightning_replay.demos.hazard_net`: :class:`HazardNet`, a LightningModule with all of them;
- :mod:`~lightning_replay.demos.demo`: ``make demo`` (``python -m lightning_replay.demos.demo``);
- :mod:`~lightning_replay.demos.hazard_demo`: the hazard table
  (``python -m lightning_replay.demos.hazard_demo``).

Importing this package imports neither Lightning nor the demos' data: each module is imported
on its own.
"""
