"""One rank's worker: the model shard, its forward pass (eager, compiled, CUDA graphs) and its start-up warm-up."""
