"""lightning_replay: state-aware activation recomputation for PyTorch and PyTorch Lightning.

Example:
    >>> import torch, lightning_replay as lr
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> engine = lr.install(model, segments=["0"])
    >>> model(torch.randn(2, 4)).sum().backward()
    >>> sorted(engine.contracts)
    ['0']
"""

# Old module paths (``lightning_replay.engine``, ``lightning_replay.planner``, ...) import the
# modules that moved into the layer folders (docs/architecture.md); first, so that every
# import below may use them.
from lightning_replay import _aliases

_aliases.install()

from lightning_replay.core.base.budget import Budget, format_bytes, parse_budget
from lightning_replay.core.engine.config import ReplanSettings, ReplayConfig
from lightning_replay.core.base.contract import SCHEMA_VERSION, ReplayContract, StateEntry
from lightning_replay.tools.doctor import diagnose
from lightning_replay.core.engine.engine import ReplayEngine
from lightning_replay.errors import (
    ContractSchemaError,
    ContractViolation,
    RecordsError,
    ReplayConfigError,
    ReplayError,
    SavedTensorModified,
    SegmentError,
)
from lightning_replay.core.engine.installation import install, install_config
from lightning_replay.core.engine.planner import InfeasibleBudget
from lightning_replay.core.base.records import Record, RecordStore

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "ContractSchemaError",
    "ContractViolation",
    "InfeasibleBudget",
    "Record",
    "RecordStore",
    "RecordsError",
    "ReplanSettings",
    "ReplayConfig",
    "ReplayConfigError",
    "ReplayContract",
    "ReplayEngine",
    "ReplayError",
    "SCHEMA_VERSION",
    "SavedTensorModified",
    "SegmentError",
    "StateEntry",
    "diagnose",
    "format_bytes",
    "install",
    "install_config",
    "parse_budget",
]

# Lightning shells: importing them registers Trainer(strategy="replay") and its launcher variants
# (Lightning resolves strategy names before any entry point could). The core above never imports
# Lightning; without Lightning installed the framework-free API still works.
try:
    import lightning.pytorch as _lightning_pytorch  # noqa: F401
except ImportError:  # pragma: no cover - lightning is a dependency
    pass
else:
    from lightning_replay.callbacks import ReplayCallback
    from lightning_replay.strategies import ReplayFSDPStrategy, ReplayStrategy

    __all__ += ["ReplayCallback", "ReplayFSDPStrategy", "ReplayStrategy"]
