"""Per-request state the engine moves through a step: requests, their sequences, pooling answers."""
