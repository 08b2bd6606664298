"""KV cache dtype accuracy: what an 8-bit cache changes in a model's outputs.

For each ``kv_cache_dtype`` (and ``int8`` / ``fp8`` with
``calculate_kv_scales``: static scales from the engine's calibration text,
which is not the perplexity text), against ``auto`` (the model dtype) on
the same model, weights and prompts:

- greedy agreement: share of ``max_tokens`` greedy tokens generated before
  the first token that differs from ``auto``'s (averaged over prompts);
- max |delta logprob| of the chosen tokens, over the positions before that
  first difference (same context on both sides, so only the cache differs);
- perplexity of a fixed English text (``pydoc_data.topics``, on every
  CPython) fed through a paged pool of that dtype in 64-token chunks, so
  every chunk after the first attends to 8-bit cached K/V (and within a
  chunk the keys are read back from the cache too).

Random-weight models give outputs whose sensitivity says little about a
trained checkpoint's; the numbers say what the cache does to *these* models.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_server.bench.kv_dtype_capacity import VARIANTS

CHUNK = 64


def fixed_text(num_chars: int = 3000) -> str:
    """The same English text on every machine: Python's own reference topics."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text[:num_chars]


@torch.inference_mode()
def perplexity(
    loaded: Any, token_ids: list[int], kv_cache_dtype: str, calculate_kv_scales: bool = False
) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]``, computed
    through a paged pool storing ``kv_cache_dtype`` (with the engine's
    calibrated static scales when ``calculate_kv_scales``)."""
    from paged_ref import PagedKVPool
    from paged_server.config import EngineConfig
    from paged_server.engine.pool_factory import calibrated_kv_scales

    cfg = loaded.config
    device = next(loaded.model.parameters()).device
    block_size = 16
    kv_scales = None
    if calculate_kv_scales:
        config = EngineConfig(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=True)
        scales = calibrated_kv_scales(config, loaded)
        kv_scales = (scales.k, scales.v)
    pool = PagedKVPool.from_model_config(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-len(token_ids) // block_size),
        block_size, loaded.dtype, device, enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
    )  # fmt: skip
    seq, _ = pool.allocate_sequence(token_ids)
    nll, count = 0.0, 0
    ids = torch.tensor(token_ids, device=device)
    for start in range(0, len(token_ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        view = pool.step_view([seq], [start], [chunk.shape[0]])
        positions = torch.arange(start, start + chunk.shape[0], device=device)
        logits = loaded.model(chunk, positions, view).float()
        view.advance()
        targets = ids[start + 1 : start + 1 + chunk.shape[0]]
        logp = torch.log_softmax(logits[: targets.shape[0]], dim=-1)
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        count += targets.shape[0]
    return float(torch.exp(torch.tensor(nll / max(count, 1))))


def greedy_runs(
    loaded: Any,
    prompts: list[list[int]],
    kv_cache_dtype: str,
    max_tokens: int,
    calculate_kv_scales: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each prompt's greedy continuation."""
    from paged_server.entrypoints.llm import LLM
    from paged_server.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens
    llm = LLM(loaded=loaded, kv_cache_dtype=kv_cache_dtype, max_model_len=longest + 1,
              calculate_kv_scales=calculate_kv_scales,
              max_batch_size=len(prompts), max_num_batched_tokens=max(256, longest),
              attention_backend="ref", device=str(next(loaded.model.parameters()).device))  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    results = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs or []) for r in results]


def compare(
    runs: list[tuple[list[int], list[float]]], base: list[tuple[list[int], list[float]]]
) -> tuple[float, float]:
    """(mean greedy agreement, max |delta logprob| before the first difference)."""
    agreements, delta = [], 0.0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(runs, base, strict=True):
        same = 0
        while same < len(tokens) and tokens[same] == ref_tokens[same]:
            same += 1
        agreements.append(same / max(1, len(ref_tokens)))
        for i in range(min(same, len(logprobs), len(ref_logprobs))):
            delta = max(delta, abs(logprobs[i] - ref_logprobs[i]))
    return sum(agreements) / max(1, len(agreements)), delta


def kv_accuracy_table(
    loaded: Any, model_name: str, *, num_prompts: int = 8, prompt_len: int = 32,
    max_tokens: int = 64, text_chars: int = 3000,
) -> dict[str, Any]:  # fmt: skip
    """The accuracy rows of one model, every ``VARIANTS`` row (``fp8_e4m3`` is ``fp8``)."""
    text_ids = loaded.tokenizer.encode(fixed_text(text_chars))
    prompts = [text_ids[i * prompt_len : (i + 1) * prompt_len] for i in range(num_prompts)]
    base = greedy_runs(loaded, prompts, "auto", max_tokens)
    rows = []
    for kv, calc in VARIANTS:
        runs = base if kv == "auto" else greedy_runs(loaded, prompts, kv, max_tokens, calc)
        agreement, delta = compare(runs, base)
        rows.append({
            "kv_cache_dtype": kv,
            "calculate_kv_scales": calc,
            "greedy_agreement": round(agreement, 4),
            "max_abs_delta_logprob": round(delta, 5),
            "perplexity": round(perplexity(loaded, text_ids, kv, calc), 4),
        })  # fmt: skip
    return {
        "kind": "kv_accuracy",
        "model": model_name,
        "model_dtype": str(loaded.dtype).removeprefix("torch."),
        "settings": {
            "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "text_tokens": len(text_ids), "chunk": CHUNK,
        },  # fmt: skip
        "rows": rows,
    }
