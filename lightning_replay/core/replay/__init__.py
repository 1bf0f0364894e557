"""Layer 3: probe, restore and checks of one segment's replays, each taking narrow arguments (ports)."""
