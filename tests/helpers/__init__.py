"""Shared test helpers, imported as ``tests.helpers.<module>``.

* :mod:`tests.helpers.compare` — train a model with and without recomputation and compare
  gradients and state bit for bit (thin layer over :mod:`lightning_replay.verify`).
* :mod:`tests.helpers.isolation` — the per-test reset of torch switches, RNGs, environment and
  wandb that ``tests/conftest.py`` applies.
* :mod:`tests.helpers.lit_hazards` — LightningModules with state hazards and Trainer helpers.
* :mod:`tests.helpers.wandb_reader` — read an offline wandb run's ``.wandb`` file back.
* :mod:`tests.helpers.torch_memory` — an independent memory referee (``torch.profiler``);
  ``tests/conftest.py`` gives a module's tests one :class:`StepReferee` as the ``referee`` fixture.
* :mod:`tests.helpers.noisy_kernels` — backward kernels with ulp-level noise from ``os.urandom``
  (GPU atomics' stand-in, issue 32).
* :mod:`tests.helpers.recipes` — the adversary recipe files' referee: plain PyTorch against
  ``install`` under several options, gradients compared bit for bit, and their base block ``Blk``.

``setup.cfg`` puts the repository root on ``sys.path`` (``pythonpath = .``), so both
``pytest`` and ``python -m pytest`` find this package under any import mode.
"""
