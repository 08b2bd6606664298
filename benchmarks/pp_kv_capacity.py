"""KV tokens per rank at pipeline_parallel_size 1, 2 and 4, from the pools.

    python benchmarks/pp_kv_capacity.py

Builds each stage's pool exactly as a rank does (``build_cache_pool`` with
its ``PipelineStage``) at the same byte budget per rank
(``--kv-cache-memory-bytes``, 1 GiB, bfloat16 KV, blocks of 16), on the
meta device (shapes and byte counts only, no memory), for the layouts of
Llama 3.2 1B (16 layers, 8 KV heads of 64) and Gemma 3 1B (26 layers:
4 global + 22 sliding, 1 KV head of 256), the latter with the hybrid KV
cache and without it. Prints tokens and bytes per rank, read from the
pools. A count, not a timing.
"""

from __future__ import annotations

import torch

from paged_server.config import EngineConfig
from paged_server.engine.kv.pool_factory import build_cache_pool
from paged_server.models.config import ModelConfig
from paged_server.models.pipeline_parallel import PipelineStage, stage_layers

BUDGET = 1 << 30
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 8192}  # fmt: skip
GEMMA = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
         "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 8192,
         "sliding_window": 512, "query_pre_attn_scalar": 256,
         "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(26)]}  # fmt: skip


def per_rank(hf: dict, stages: int, hybrid: bool) -> list[tuple[int, int, int]]:
    """(layers, KV tokens, pool bytes) of each stage's pool."""
    mc = ModelConfig.from_hf(hf, hf["architectures"][0])
    config = EngineConfig(device="cpu", kv_cache_memory_bytes=BUDGET, block_size=16,
                          max_model_len=8192, disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
    out = []
    for rank in range(stages):
        pool, capacity = build_cache_pool(
            config, mc, torch.bfloat16, torch.device("meta"), "ref", pp=PipelineStage(rank, stages)
        )
        layers = len(stage_layers(mc.num_layers, rank, stages))
        out.append((layers, capacity.tokens, pool.kv_bytes()))  # type: ignore[attr-defined]
    return out


def main() -> None:
    print(f"KV cache per rank at {BUDGET >> 20} MiB per rank (bfloat16, blocks of 16)")
    for name, hf, hybrid in (("Llama 3.2 1B", LLAMA, False), ("Gemma 3 1B, hybrid", GEMMA, True),
                             ("Gemma 3 1B, one group", GEMMA, False)):  # fmt: skip
        base = per_rank(hf, 1, hybrid)[0][1]
        for stages in (1, 2, 4):
            ranks = per_rank(hf, stages, hybrid)
            tokens = {t for _, t, _ in ranks}
            assert len(tokens) == 1, "every stage must have the same blocks"
            (t,) = tokens
            layers = "+".join(str(n) for n, _, _ in ranks)
            used = max(b for _, _, b in ranks) >> 20
            print(f"{name:24s} PP={stages}: layers {layers:12s} {t:9d} tokens per rank "
                  f"({t / base:.2f}x PP=1), at most {used} MiB of the budget used")


if __name__ == "__main__":
    main()
