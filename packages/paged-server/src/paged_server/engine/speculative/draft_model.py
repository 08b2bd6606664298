"""Draft model (vLLM's ``{"model": DIR, "num_speculative_tokens": k}``): a
smaller model with the target's tokenizer drafts ``k`` greedy tokens.

The proposer owns a second engine of this project's own stack over the
draft checkpoint, with its own paged KV cache and prefix caching on. Each
step's ``propose_all`` submits every speculating sequence's history as a
prompt asking for ``k`` greedy tokens and runs that engine until all are
done: one batched prefill, in which the prefix cache serves each history's
full blocks from the step before, so only the tokens since (the accepted
ones, the bonus token, the last partial block) are computed; then ``k - 1``
batched decode steps. The draft requests finish inside the call, so no
per-sequence state outlives it but evictable cached blocks: nothing is left
to release when a target sequence ends. Drafts are point masses (the draft's
argmax), so ``verify.py`` keeps every answer the target's, greedy or sampled.

Memory: the draft's pool is sized to hold the target pool's tokens plus
``k`` drafts for every sequence (an explicit block count, logged at
start-up with its bytes). It is allocated after the target's pool: on CUDA
the draft's weights and KV come on top of the target's
``gpu_memory_utilization`` share (docs/serving.md).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Protocol

from paged_server.config import EngineConfig, RunConfig
from paged_server.engine.kv.pool_factory import PoolCapacity
from paged_server.errors import ModelLoadError
from paged_server.models.config import ModelConfig
from paged_server.outputs import RequestOutput
from paged_server.sampling_params import SamplingParams
from paged_server.speculative_config import SpeculativeConfig
from paged_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What this proposer reads of the target engine, and runs of its own
    (``LLMEngine``'s, named here so the engine that imports this need not be)."""

    config: RunConfig
    capacity: PoolCapacity
    tokenizer: Tokenizer
    model_config: ModelConfig
    eos_token_ids: frozenset[int]

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> int: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def shutdown(self) -> None: ...


class DraftModelProposer:
    """Greedy drafts from a second engine over the draft model."""

    def __init__(self, spec: SpeculativeConfig, target: Engine) -> None:
        assert spec.model is not None
        self.k = spec.num_speculative_tokens
        run, capacity = target.config, target.capacity
        block = run.block_size
        blocks_per_draft = -(-(self.k + 1) // block)  # a history's partial block and its drafts
        num_blocks = -(-capacity.tokens // block) + run.max_batch_size * blocks_per_draft + 1
        draft_len = spec.max_model_len or run.max_model_len
        config = EngineConfig(
            model=spec.model, quantization=spec.quantization, device=run.device,
            attention_backend=run.attention_backend, enforce_eager=run.enforce_eager,
            block_size=block, num_gpu_blocks=num_blocks, max_batch_size=run.max_batch_size,
            max_model_len=draft_len, max_num_batched_tokens=run.max_num_batched_tokens,
            enable_prefix_caching=True, generation_config="vllm", seed=run.seed,
        )  # fmt: skip
        # The target's class, so this module need not import the engine that imports it.
        try:
            self.engine: Engine = type(target)(config)  # type: ignore[call-arg]
        except (ValueError, ModelLoadError) as exc:  # say whose setting or files: the draft's
            why = str(exc)
            if "max_model_len" in why and spec.max_model_len is None:
                why += ' (the target\'s; set the draft\'s with "max_model_len")'
            raise type(exc)(f"speculative_config: draft model {spec.model}: {why}") from exc
        try:
            check_same_vocabulary(target, self.engine, spec.model)
        except BaseException:
            self.engine.shutdown()
            raise
        self.max_model_len = self.engine.config.max_model_len
        self._ids = itertools.count()
        draft_capacity = self.engine.capacity
        log.info(
            "draft model %s: KV cache %d tokens (%d blocks of %d, %.3f GiB), sized to the target's "
            "%d tokens plus %d drafts per sequence",
            spec.model, draft_capacity.tokens, draft_capacity.num_blocks, block,
            draft_capacity.kv_bytes / 2**30, capacity.tokens, self.k,
        )  # fmt: skip

    def propose_all(self, histories: Sequence[Sequence[int]], limits: Sequence[int]) -> list[list[int]]:
        """One greedy draft per history (at most ``limits[i]`` and ``k``
        tokens), all run as one batch on the draft engine."""
        engine = self.engine
        drafts: dict[str, list[int]] = {}
        order: list[str | None] = []
        for history, limit in zip(histories, limits, strict=True):
            n = min(limit, self.k, self.max_model_len - len(history))
            if n < 1:
                order.append(None)
                continue
            request_id = f"draft-{next(self._ids)}"
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
            engine.add_request(request_id, list(history), params)
            drafts[request_id] = []
            order.append(request_id)
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is None:
                    drafts[out.request_id] += out.new_token_ids
                else:  # a failed draft is no draft: the target decodes as usual
                    drafts[out.request_id] = []
                    log.warning("draft model request failed: %s", out.error)
        return [[] if rid is None else drafts[rid] for rid in order]

    def shutdown(self) -> None:
        """Stop the draft engine."""
        self.engine.shutdown()


def check_same_vocabulary(target: Engine, draft: Engine, draft_name: str) -> None:
    """Refuse a draft whose token ids mean something else: vocabulary size,
    tokenizer vocabulary and EOS ids must equal the target's."""
    target_name = target.config.model or "the target model"
    problem = None
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        problem = f"vocab_size {draft.model_config.vocab_size} against {target.model_config.vocab_size}"
    elif draft.tokenizer.hf.get_vocab(with_added_tokens=True) != target.tokenizer.hf.get_vocab(
        with_added_tokens=True
    ):
        problem = "a different tokenizer vocabulary (tokenizer.json)"
    elif draft.eos_token_ids != target.eos_token_ids:
        problem = f"EOS ids {sorted(draft.eos_token_ids)} against {sorted(target.eos_token_ids)}"
    if problem is not None:
        raise ValueError(
            f"speculative_config: draft model {draft_name} does not share the tokenizer of "
            f"{target_name}: {problem}; a draft model needs the target's tokenizer"
        )
