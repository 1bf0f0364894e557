"""Layer 1: state and contract types, the records sink, the clock, the narrow interfaces (ports) lower layers take."""
