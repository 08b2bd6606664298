"""Peak KV blocks of a beam search against ``k`` independent sequences.

    python benchmarks/beam_search_blocks.py

Runs ``LLM.beam_search``-equivalent requests (embedded model, CPU, reference
attention, block size 16, prompt 64 tokens, 32 generated, EOS ignored) one
at a time, audits the pool after every step, and prints the most blocks held
at once next to ``k * ceil((prompt + generated - 1) / block_size)``, what
``k`` sequences that share nothing would hold. A count, not a timing.
"""

from __future__ import annotations

import math

import torch

from paged_server import LLM
from paged_server.sampling_params import BeamSearchParams

PROMPT, GENERATED, BLOCK = 64, 32, 16


def main() -> None:
    llm = LLM(device="cpu", attention_backend="ref", max_model_len=256, block_size=BLOCK,
              num_gpu_blocks=512, max_batch_size=8)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    for k in (2, 4, 8):
        prompt = torch.randint(3, 500, (PROMPT,), generator=gen).tolist()
        params = BeamSearchParams(beam_width=k, max_tokens=GENERATED, ignore_eos=True)
        engine.add_request(f"beam-{k}", prompt, params.to_sampling_params())
        peak = 0
        while engine.has_unfinished():
            engine.step()
            assert engine.audit() == [], engine.audit()
            peak = max(peak, int(engine.kv_manager.stats()["blocks_used"]))
        independent = k * math.ceil((PROMPT + GENERATED - 1) / BLOCK)
        print(f"beam_width {k}: peak {peak} blocks, {independent} for {k} independent "
              f"sequences ({peak / independent:.2f}x)")


if __name__ == "__main__":
    main()
