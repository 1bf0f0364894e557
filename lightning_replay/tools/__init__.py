"""Framework-free tools above the engine: ``lr.diagnose`` and the exactness helpers."""
