"""The functional core, in layers from bottom to top (docs/architecture.md). Never imports Lightning."""
