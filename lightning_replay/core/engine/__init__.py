"""Layer 5: the engine, its installation on a model, its configuration and the planner."""
