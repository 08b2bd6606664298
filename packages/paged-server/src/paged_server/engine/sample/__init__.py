"""From logits to tokens: the sampler, its per-request edits and masks, logprobs, beam scoring."""
