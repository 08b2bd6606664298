"""The same workload through transformers, same weights, same run.

Two peers: transformers' own continuous batching (the paged manager behind
``model.generate_batch``) and plain static ``model.generate`` in fixed
batches of 8. Both decode greedily with EOS disabled, so every request
produces exactly its ``max_tokens`` and throughput counts the same tokens
our engine produces.

``generate_batch`` takes one ``max_new_tokens`` for all prompts, so we drive
the manager it wraps (``continuous_batching_context_manager``) and add each
request with its own ``max_new_tokens``: same scheduler, same cache, same
kernels, per-request lengths.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from paged_server.bench.results import RunResult, TokenTimes, workload_result
from paged_server.bench.workloads import Workload


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint as transformers loads it (eval mode, CPU unless CUDA)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if torch.cuda.is_available():
        model = model.cuda()
    return model.eval()


class _StepClock:
    """A ``generate`` streamer that only notes when each step's tokens arrive
    (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _pad_id(model: Any) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def run_hf_static(
    model: Any, workload: Workload, *, batch_size: int = 8, model_name: str = ""
) -> RunResult:
    """Static batching: requests in arrival order, ``batch_size`` at a time,
    left-padded; each batch runs until its longest request is done (the
    waste continuous batching removes). Only requested tokens count."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    pad = _pad_id(model)
    reqs = workload.requests
    generated = 0
    start = time.perf_counter()
    clock = TokenTimes(start)
    with torch.no_grad():
        for b in range(0, len(reqs), batch_size):
            batch = reqs[b : b + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                n = len(r.prompt_token_ids)
                ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
                mask[i, width - n :] = 1
            steps = max(r.max_tokens for r in batch)
            gen_cfg = GenerationConfig(
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                eos_token_id=None,
                pad_token_id=pad,
            )
            streamer = _StepClock()
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gen_cfg,
                streamer=streamer,
            )
            generated += (out.shape[1] - width) * len(batch)
            step_times = streamer.times[1:]  # [0] is the prompt
            for r in batch:
                for t in step_times[: r.max_tokens]:
                    clock.record(r.request_id, 1, t)
    seconds = time.perf_counter() - start
    return workload_result(
        "transformers generate",
        "hf_static_generate",
        workload,
        model_name,
        workload.output_tokens,  # only requested tokens count (see docstring)
        seconds,
        clock,
        peak_running=min(batch_size, len(reqs)),
        settings={"batch_size": batch_size, "tokens_computed_incl_padding_waste": generated},
    )


def run_hf_continuous(
    model: Any,
    workload: Workload,
    *,
    kv_tokens: int,
    max_batch_size: int,
    max_batched_tokens: int,
    page_size: int = 16,
    model_name: str = "",
) -> RunResult:
    """transformers' continuous batching with a KV cache of ``kv_tokens``
    token slots (the same budget our engine gets), ``max_batch_size``
    requests and ``max_batched_tokens`` tokens per step."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    longest = workload.max_model_len
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in workload.requests),
        eos_token_id=-1,
        pad_token_id=_pad_id(model),
    )
    cb_cfg = _batching_config(
        ContinuousBatchingConfig,
        page_size,
        num_blocks=max(1, kv_tokens // page_size),
        max_batch_tokens=max_batched_tokens,
        max_requests_per_batch=max_batch_size,
        max_blocks_per_request=-(-longest // page_size),
        allow_block_sharing=False,
        seed=0,
    )
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        for r in workload.requests:
            manager.add_request(
                list(r.prompt_token_ids),
                request_id=r.request_id,
                max_new_tokens=r.max_tokens,
                eos_token_id=-1,
                record_timestamps=True,
            )
        while len(results) < len(workload.requests):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(
                        f"transformers continuous batching failed {out.request_id}: {out.error}"
                    )
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(
                    "transformers continuous batching stopped before finishing the workload"
                )
        seconds = time.perf_counter() - start
    clock = TokenTimes(start)
    produced = 0
    for rid, out in results.items():
        produced += len(out.generated_tokens)
        for t in out.timestamps or []:
            clock.record(rid, 1, t)
    return workload_result(
        "transformers",
        "hf_generate_batch",
        workload,
        model_name,
        produced,
        seconds,
        clock,
        settings={
            "page_size": page_size,
            "num_blocks": cb_cfg.num_blocks,
            "kv_tokens": kv_tokens,
            "max_requests_per_batch": max_batch_size,
            "max_batch_tokens": max_batched_tokens,
        },
    )


def _batching_config(cls: Any, page_size: int, **fields: Any) -> Any:
    """``ContinuousBatchingConfig`` under this transformers' field names: the
    block size was ``block_size`` (5.17) before ``page_size``, and ``seed``
    came later (greedy runs do not need it)."""
    names = {f.name for f in dataclasses.fields(cls)}
    fields["page_size" if "page_size" in names else "block_size"] = page_size
    return cls(**{k: v for k, v in fields.items() if k in names})
