"""Layer 2: discovery and preservation mechanisms: what a forward reads and writes, how state is kept, captured, guarded, measured."""
