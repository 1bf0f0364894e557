"""Applications built on lightning_replay: the dense-queue (MoCo-style) study and its tools.

* :mod:`lightning_replay.apps.cifar_synth` — CIFAR-100 on disk, real or synthetic.
* :mod:`lightning_replay.apps.dense_queue` — the LightningModule and LightningDataModule.
* :mod:`lightning_replay.apps.torch_recompute` — the state-unaware baselines
  (``torch.utils.checkpoint`` and torch's selective activation checkpointing).
* :mod:`lightning_replay.apps.telemetry` — per-step time, memory and plan, for every method.
* :mod:`lightning_replay.apps.study` — the seven-method comparison (``run_study``), over
  ``study_config`` (methods, settings, the packaged demo config), ``study_run`` (one run, the
  cost measurement), ``study_compare`` (runs against their reference) and ``study_output``
  (the result files).
* :mod:`lightning_replay.apps.report` — the HTML report.
* :mod:`lightning_replay.apps.sparse_write` — the sparse-write workload.
"""
