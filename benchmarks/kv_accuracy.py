"""KV cache dtype accuracy: what an 8- or 4-bit cache changes in a model's outputs.

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
On the trained evaluation model (``default_model.trained``) the text is its
held-out text, scored in ``window``-token sequences (the length it was
trained on), and int4 gets a row per block size (its key groups span
``min(block_size, 64)`` tokens): ``trained_kv_accuracy_table``.
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
    loaded: Any, token_ids: list[int], kv_cache_dtype: str, calculate_kv_scales: bool = False,
    *, window: int | None = None, block_size: int = 16, chunk: int = CHUNK,
) -> float:  # fmt: skip
    """exp(mean negative log-likelihood) of ``token_ids[1:]``, computed
    through a paged pool storing ``kv_cache_dtype`` (with the engine's
    calibrated static scales when ``calculate_kv_scales``), ``chunk`` tokens
    a forward pass. ``window``: score consecutive sequences of that many
    tokens, each from an empty cache, instead of one long sequence."""
    if window is not None:
        pieces = [token_ids[s : s + window + 1] for s in range(0, len(token_ids) - 1, window)]
        nll = count = 0.0
        for piece in (p for p in pieces if len(p) > 1):
            ppl = perplexity(loaded, piece, kv_cache_dtype, calculate_kv_scales,
                             block_size=block_size, chunk=chunk)  # fmt: skip
            nll += float(torch.log(torch.tensor(ppl))) * (len(piece) - 1)
            count += len(piece) - 1
        return float(torch.exp(torch.tensor(nll / max(count, 1))))
    from paged_ref import PagedKVPool
    from paged_server.config import EngineConfig
    from paged_server.engine.kv.kv_calibration import calibrated_kv_scales

    cfg = loaded.config
    device = next(loaded.model.parameters()).device
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
    for start in range(0, len(token_ids), chunk):
        part = ids[start : start + chunk]
        view = pool.step_view([seq], [start], [part.shape[0]])
        positions = torch.arange(start, start + part.shape[0], device=device)
        logits = loaded.model(part, positions, view).float()
        view.advance()
        targets = ids[start + 1 : start + 1 + part.shape[0]]
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
    block_size: int = 16,
) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each prompt's greedy continuation."""
    from paged_server.entrypoints.llm import LLM
    from paged_server.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens
    llm = LLM(loaded=loaded, kv_cache_dtype=kv_cache_dtype, max_model_len=longest + 1,
              block_size=block_size,
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


def heldout_text() -> str:
    """The trained model's held-out text (``default_model.corpus.split_texts``)."""
    from paged_server.default_model.corpus import split_texts

    return "\n\n".join(split_texts()[1])


def trained_kv_accuracy_table(
    loaded: Any, model_name: str, *, num_prompts: int = 64, prompt_len: int = 32,
    max_tokens: int = 64, text_tokens: int | None = None, window: int = 128, chunk: int = 32,
    int4_block_sizes: tuple[int, ...] = (16, 64), kv_cache_dtypes: tuple[str, ...] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The accuracy rows on a trained model and its held-out text: the model
    dtype (``auto``), int8 / fp8 (per-token scales and calculated ones), and
    int4 at each of ``int4_block_sizes``. Perplexity over ``window``-token
    sequences of the held-out text (``text_tokens``: only its first that
    many), ``chunk`` tokens a forward pass, so later chunks read their
    context back from the cache; greedy agreement and logprob deltas of
    ``num_prompts`` held-out prompts x ``max_tokens`` tokens. ``ppl_vs_auto``
    is each row's perplexity over ``auto``'s (the target for int4: <= 1.05).
    ``kv_cache_dtypes``: only these rows (``auto`` always comes first)."""
    ids = loaded.tokenizer.encode(heldout_text())
    text_ids = ids[:text_tokens] if text_tokens else ids
    stride = max(prompt_len, len(ids) // max(num_prompts, 1))
    prompts = [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]
    if any(len(p) < prompt_len for p in prompts):
        raise ValueError(f"{num_prompts} prompts of {prompt_len} tokens do not fit the held-out text")
    base = greedy_runs(loaded, prompts, "auto", max_tokens)
    rows = []
    variants = [(kv, calc, 16) for kv, calc in VARIANTS if kv != "int4"]
    variants += [("int4", False, bs) for bs in int4_block_sizes]
    if kv_cache_dtypes is not None:
        variants = [v for v in variants if v[0] == "auto" or v[0] in kv_cache_dtypes]
    base_ppl = None
    for kv, calc, bs in variants:
        runs = base if kv == "auto" else greedy_runs(loaded, prompts, kv, max_tokens, calc, bs)
        agreement, delta = compare(runs, base)
        ppl = perplexity(loaded, text_ids, kv, calc, window=window, block_size=bs, chunk=chunk)
        base_ppl = base_ppl or ppl
        rows.append({
            "kv_cache_dtype": kv, "calculate_kv_scales": calc, "block_size": bs,
            "greedy_agreement": round(agreement, 4), "max_abs_delta_logprob": round(delta, 5),
            "perplexity": round(ppl, 4), "ppl_vs_auto": round(ppl / base_ppl, 4),
        })  # fmt: skip
    return {
        "kind": "kv_accuracy_trained",
        "model": model_name,
        "model_dtype": str(loaded.dtype).removeprefix("torch."),
        "settings": {
            "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "text_tokens": len(text_ids), "window": window, "chunk": chunk,
        },  # fmt: skip
        "rows": rows,
    }
