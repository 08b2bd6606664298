"""The engine core: requests, scheduling, the step's batch, the executor that reaches the workers, metrics."""
