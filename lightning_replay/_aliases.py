"""Old module paths that still import: each is the moved module itself.

The core moved into folders that show its layers (``docs/architecture.md``). Code and pickles
that name a module by its old path keep working: a pickled installed model names
``lightning_replay.installation._new_plain`` (older ones ``lightning_replay.engine._new_plain``),
a pickled plan ``lightning_replay.planner.Plan``. Importing an old path gives the new module, the
same object under both names in ``sys.modules``, so an attribute set through one
(``monkeypatch.setattr``) is seen through the other. Nothing is imported until an old path is.

Example:
    >>> import importlib, lightning_replay
    >>> old = importlib.import_module("lightning_replay.restore")
    >>> old is importlib.import_module("lightning_replay.core.replay.restore")
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

#: old module path -> where it lives now (a module moved, never a name inside one)
MOVED: dict[str, str] = {
    "lightning_replay.accounting": "lightning_replay.core.mechanisms.accounting",
    "lightning_replay.arguments": "lightning_replay.core.mechanisms.arguments",
    "lightning_replay.budget": "lightning_replay.core.base.budget",
    "lightning_replay.checks": "lightning_replay.core.replay.checks",
    "lightning_replay.config": "lightning_replay.core.engine.config",
    "lightning_replay.contract": "lightning_replay.core.base.contract",
    "lightning_replay.costs": "lightning_replay.core.mechanisms.costs",
    "lightning_replay.discovery": "lightning_replay.core.mechanisms.discovery",
    "lightning_replay.doctor": "lightning_replay.tools.doctor",
    "lightning_replay.doctor_report": "lightning_replay.tools.doctor_report",
    "lightning_replay.engine": "lightning_replay.core.engine.engine",
    "lightning_replay.guards": "lightning_replay.core.mechanisms.guards",
    "lightning_replay.host_rng": "lightning_replay.core.mechanisms.host_rng",
    "lightning_replay.installation": "lightning_replay.core.engine.installation",
    "lightning_replay.kernel_noise": "lightning_replay.core.mechanisms.kernel_noise",
    "lightning_replay.memory": "lightning_replay.core.mechanisms.memory",
    "lightning_replay.module_globals": "lightning_replay.core.mechanisms.module_globals",
    "lightning_replay.planner": "lightning_replay.core.engine.planner",
    "lightning_replay.preservation": "lightning_replay.core.mechanisms.preservation",
    "lightning_replay.probe": "lightning_replay.core.replay.probe",
    "lightning_replay.probe_replay": "lightning_replay.core.replay.probe_replay",
    "lightning_replay.records": "lightning_replay.core.base.records",
    "lightning_replay.replan": "lightning_replay.core.engine.replan",
    "lightning_replay.restore": "lightning_replay.core.replay.restore",
    "lightning_replay.runtime": "lightning_replay.core.runtime",
    "lightning_replay.segments": "lightning_replay.core.engine.segments",
    "lightning_replay.selective": "lightning_replay.core.mechanisms.selective",
    "lightning_replay.slot_restore": "lightning_replay.core.mechanisms.slot_restore",
    "lightning_replay.slots": "lightning_replay.core.mechanisms.slots",
    "lightning_replay.state": "lightning_replay.core.base.state",
    "lightning_replay.verify": "lightning_replay.tools.verify",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module that lives at the new one."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: object = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the old path's spec on the module; give it its own back
        module.__spec__ = self._spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Make the old paths importable (once per process; the package does it on import)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
