"""The engine: scheduler, runner, sampler, sequences and the pool factory behind `LLMEngine`."""
