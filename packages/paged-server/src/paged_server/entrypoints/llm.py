"""Offline batch generation, shaped like vLLM's ``LLM`` class.

    llm = LLM(max_batch_size=8)            # embedded default model
    results = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=20))
    results[0].outputs[0].text
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=20))
    beams = llm.beam_search(["Hello"], BeamSearchParams(beam_width=4, max_tokens=20))
    beams[0].sequences[0].text
    LLM("embedder", runner="pooling").embed(["Hello"])[0].outputs.embedding
    LLM("base", enable_lora=True).generate(["Hi"], params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

``generate`` feeds the engine as fast as its queue takes requests and
steps it until every prompt is done; ``llm.engine`` gives metrics. It runs
on the caller's thread: build the ``LLM`` on the thread that calls
``generate`` (the model's load starts torch's thread pool on the building
thread; stepping on another starts a second pool, and with two pools a small
machine's steps get up to 2x slower, see docs/cpu.md). With
``tensor_parallel_size=N`` the engine runs N processes: ``llm.shutdown()``
(or ``with LLM(...) as llm:``) stops them; so does interpreter exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from paged_server.config import EngineConfig
from paged_server.engine.core.checks import check_priority
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.entrypoints import llm_pooling
from paged_server.errors import QueueFullError
from paged_server.lora_request import LoRARequest
from paged_server.models import LoadedModel
from paged_server.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionChoice,
    CompletionResult,
)
from paged_server.pooling_params import PoolingParams
from paged_server.sampling_params import BeamSearchParams, SamplingParams

log = logging.getLogger(__name__)

_DRAIN_STEPS = 8  # aborted requests are freed by the next step; a few more in case


class LLM:
    """A model and an engine for offline use; ``engine_config`` fields are
    ``EngineConfig``'s (``kv_cache_backend``, ``max_batch_size``, ...)."""

    def __init__(
        self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_config: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **_engine_kwargs(engine_config)), loaded)
        self._counter = 0
        self._built_on: int | None = threading.get_ident()  # whose torch pool loaded the model

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (if any)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(sampling_params=None)`` uses: the model's
        generation_config.json defaults (``generation_config="auto"``), as vLLM."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionResult]:
        """Complete every prompt; results come back in prompt order. A prompt
        is vLLM's: text, ``{"prompt": text}``, ``{"prompt_token_ids": ids}``
        (or a list of token ids), one or a list of them. One
        ``SamplingParams`` applies to all, or pass one per prompt; none: the
        model's defaults (``get_default_sampling_params``). A prompt whose
        parameters are invalid gets choices with ``finish_reason="error"``
        instead of stopping the whole batch. ``use_tqdm`` (default: when
        there is more than one prompt) shows progress. ``lora_request``
        (``enable_lora=True``): the LoRA adapter serving every prompt, or
        one per prompt (None: the base model), loaded when first named.
        ``priority`` (``scheduling_policy="priority"``, as vLLM's): one per
        prompt, lower runs earlier; a nonzero one under fcfs is refused."""
        inputs: list[str | list[int]]
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            inputs = [list(ids) for ids in prompt_token_ids]
        elif prompts is None:
            raise ValueError("pass prompts (text) or prompt_token_ids")
        else:
            inputs = _prompt_inputs(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(inputs))
        loras = _loras_per_prompt(lora_request, len(inputs))
        priorities = _priorities_per_prompt(priority, len(inputs), self.engine.config.scheduling_policy)
        self._check_thread()
        if use_tqdm is None:
            use_tqdm = len(inputs) > 1

        results: dict[str, CompletionResult] = {}
        order: list[str] = []
        for prompt, params in zip(inputs, params_list, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            order.append(request_id)
            results[request_id] = CompletionResult(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
                outputs=[
                    CompletionChoice(
                        index=i,
                        text="",
                        token_ids=[],
                        finish_reason=None,
                        logprobs=[] if params.logprobs is not None else None,
                        top_logprobs=[] if params.logprobs is not None else None,
                    )
                    for i in range(_num_choices(params))
                ],
            )

        pending = list(zip(order, inputs, params_list, loras, priorities, strict=True))
        unfinished: dict[str, int] = {}
        engine = self.engine
        with tqdm(total=len(order), disable=not use_tqdm, desc="generate", unit="req") as bar:
            try:
                while pending or engine.has_unfinished():
                    pending = self._submit(pending, results, unfinished, bar)
                    for out in engine.step():
                        result = results.get(out.request_id)
                        if result is None:  # left by an earlier call that raised
                            continue
                        choice = result.outputs[out.index]
                        choice.text += out.new_text
                        choice.token_ids += out.new_token_ids
                        _add_logprobs(result, choice, out)
                        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                        if out.finished:
                            choice.finish_reason, choice.error = out.finish_reason, out.error
                            choice.cumulative_logprob = out.cumulative_logprob
                            unfinished[out.request_id] -= 1
                            if unfinished[out.request_id] == 0:
                                bar.update(1)
            except BaseException:  # a failed step or Ctrl-C: leave the engine clean
                self._abandon(unfinished)
                raise
        return [results[r] for r in order]

    # -- pooling models (runner="pooling"): vLLM's offline calls --------------
    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[Any]:  # fmt: skip
        """One ``EmbeddingRequestOutput`` per prompt (``outputs.embedding``)."""
        return llm_pooling.embed(self.engine, _prompt_inputs(prompts), pooling_params, self._new_id)

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = False) -> list[Any]:  # fmt: skip
        """One ``ClassificationRequestOutput`` per prompt (``outputs.probs``)."""
        return llm_pooling.classify(self.engine, _prompt_inputs(prompts), pooling_params, self._new_id)

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None,
               use_tqdm: bool = False, *, pooling_task: str | None = None) -> list[Any]:  # fmt: skip
        """One ``PoolingRequestOutput`` per prompt (``outputs.data``: a tensor);
        ``pooling_task="token_embed"`` (or ``"token_classify"``): a row per prompt token."""
        return llm_pooling.encode(
            self.engine, _prompt_inputs(prompts), pooling_params, self._new_id, pooling_task or "encode"
        )

    def score(self, data_1: Any, data_2: Any, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[Any]:  # fmt: skip
        """One ``ScoringRequestOutput`` per pair (``outputs.score``): one
        ``data_1`` against each ``data_2``, or both lists pairwise."""
        return llm_pooling.score(self.engine, data_1, data_2, pooling_params, self._new_id)

    def _new_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter - 1}"

    def _abandon(self, unfinished: dict[str, int]) -> None:
        """Abort this call's requests and step until their blocks are free,
        so the next call neither waits on them nor sees their outputs."""
        engine = self.engine
        for request_id, remaining in unfinished.items():
            if remaining > 0:
                engine.abort_request(request_id)
        for _ in range(_DRAIN_STEPS):
            if not engine.has_unfinished():
                return
            try:
                engine.step()
            except Exception:  # the next call will meet the same error; don't mask this one
                log.exception("freeing the requests of a failed generate() call failed")
                return

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionResult]:
        """``generate`` over conversations rendered with the chat template
        (``chat_template``, else the model's), as vLLM's ``LLM.chat``: one
        conversation (a list of ``{"role", "content"}`` dicts) or a list of
        them; ``tools`` and ``chat_template_kwargs`` reach the template;
        ``continue_final_message`` leaves the last message open."""
        conversations: list[Sequence[dict[str, Any]]] = (
            [messages]  # type: ignore[list-item]  # one conversation
            if messages and isinstance(messages[0], dict)
            else list(messages)  # type: ignore[arg-type]
        )
        tokenizer = self.engine.tokenizer
        prompt_ids = [
            list(
                tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=add_generation_prompt, tokenize=True,
                    chat_template=chat_template, continue_final_message=continue_final_message,
                    tools=tools, **(chat_template_kwargs or {}),
                )
            )
            for c in conversations
        ]
        return self.generate(
            None, sampling_params, prompt_token_ids=prompt_ids, use_tqdm=use_tqdm, lora_request=lora_request
        )
    def beam_search(
        self,
        prompts: Sequence[str | Sequence[int] | Mapping[str, Any]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search of ``params.beam_width`` beams for each prompt (text,
        token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``);
        every prompt's beams come back best first. The beams of a prompt
        share its KV blocks and fork copy-on-write where they diverge.
        Raises ``ValueError`` for bad parameters."""
        sampling = params.to_sampling_params()
        sampling.validate(self.engine.config.max_model_len, self.engine.config.max_logprobs)
        tokenizer = self.engine.tokenizer
        token_ids = [_prompt_token_ids(p, tokenizer) for p in prompts]
        results = self.generate(
            prompt_token_ids=token_ids, sampling_params=sampling, use_tqdm=use_tqdm
        )
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=list(prompt) + c.token_ids,
                        logprobs=list(c.logprobs or []),
                        cum_logprob=c.cumulative_logprob if c.cumulative_logprob is not None else 0.0,
                        text=c.text,
                        finish_reason=c.finish_reason,
                        error=c.error,
                    )
                    for c in result.outputs
                ]
            )
            for prompt, result in zip(token_ids, results, strict=True)
        ]

    def _check_thread(self) -> None:
        if self._built_on is not None and threading.get_ident() != self._built_on:
            self._built_on = None  # said once
            log.warning(
                "LLM.generate runs on another thread than the one that built the LLM: torch "
                "now keeps a thread pool on each, and steps can be up to 2x slower on a small "
                "machine; build the LLM on the thread that calls generate"
            )

    def _submit(
        self,
        pending: list[_Pending],
        results: dict[str, CompletionResult],
        unfinished: dict[str, int],
        bar: tqdm,
    ) -> list[_Pending]:
        """Add requests until the engine's queue is full; returns the rest."""
        for i, (request_id, prompt, params, lora, priority) in enumerate(pending):
            result = results[request_id]
            try:
                if isinstance(prompt, str) and not result.prompt_token_ids:
                    try:
                        result.prompt_token_ids = self.engine.tokenizer.encode(prompt)
                    except Exception as exc:
                        raise ValueError(f"prompt: could not be tokenized: {exc}") from exc
                self.engine.add_request(request_id, result.prompt_token_ids, params, lora_request=lora,
                                        priority=priority)
            except QueueFullError:
                return pending[i:]
            except ValueError as exc:  # this prompt fails, the others go on
                for choice in result.outputs:
                    choice.finish_reason, choice.error = "error", str(exc)
                bar.update(1)
                continue
            unfinished[request_id] = params.n
        return []


# A prompt still to submit: request id, prompt, its parameters, its adapter, its priority.
_Pending = tuple[str, str | list[int], SamplingParams, LoRARequest | None, int]


def _loras_per_prompt(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """vLLM's ``lora_request``: one for every prompt, or a list of one per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"lora_request: {len(loras)} given for {count} prompts; pass one, or one per prompt")
    return loras


def _priorities_per_prompt(priority: Sequence[int] | None, count: int, policy: str) -> list[int]:
    """vLLM's ``priority``: one per prompt (None: all 0), checked before any runs."""
    if priority is None:
        return [0] * count
    if isinstance(priority, int) or len(priority) != count:
        given = "an integer" if isinstance(priority, int) else f"{len(priority)}"
        raise ValueError(f"priority: {given} given for {count} prompts; pass a list of one per prompt")
    for p in priority:
        check_priority(p, policy)
    return list(priority)


def _add_logprobs(result: CompletionResult, choice: CompletionChoice, out: Any) -> None:
    """Accumulate a delta's logprobs in vLLM's offline shapes."""
    if out.prompt_logprobs is not None and result.prompt_logprobs is None:
        result.prompt_logprobs = [p.as_dict() if p else None for p in out.prompt_logprobs]
    if out.new_logprobs is None or choice.logprobs is None or choice.top_logprobs is None:
        return
    tops = out.new_top_logprobs or [[] for _ in out.new_logprobs]
    for token, lp, top in zip(out.new_token_ids, out.new_logprobs, tops, strict=False):
        choice.top_logprobs.append({**dict(top), token: lp})
    choice.logprobs += out.new_logprobs
def _prompt_token_ids(prompt: str | Sequence[int] | Mapping[str, Any], tokenizer: Any) -> list[int]:
    """A beam-search prompt as token ids."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return list(tokenizer.encode(prompt["prompt"]))
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(prompt)


def _prompt_inputs(prompts: Any) -> list[str | list[int]]:
    """vLLM's prompt forms as text or token ids: a string, a dict with
    ``prompt`` or ``prompt_token_ids``, token ids, or a list of any of them."""
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    elif prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]  # one prompt of token ids
    inputs: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, Mapping):
            if "prompt_token_ids" in p:
                inputs.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                inputs.append(str(p["prompt"]))
            else:
                raise ValueError(
                    f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}"
                )
        else:
            inputs.append(p if isinstance(p, str) else list(p))
    return inputs


# vLLM's LLM(...) names for EngineConfig fields named differently here.
_VLLM_NAMES = {"max_num_seqs": "max_batch_size", "num_gpu_blocks_override": "num_gpu_blocks"}
# vLLM arguments with nothing to do here (this server runs no checkpoint code,
# logs no stats offline, reads safetensors).
_NO_OPS = {"trust_remote_code", "disable_log_stats", "load_format"}


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)`` as ``EngineConfig`` fields: vLLM's names mapped,
    unknown ones refused with what to use instead."""
    import dataclasses

    from paged_server.entrypoints.vllm_flags import FLAG_HINTS, REFUSED_FLAGS

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in _NO_OPS:
            if name == "load_format" and value not in ("auto", "safetensors"):
                raise ValueError(f"load_format: only safetensors checkpoints load, got {value!r}")
            continue
        target = _VLLM_NAMES.get(name, name)
        if target in fields:
            out[target] = value
            continue
        flag = "--" + name.replace("_", "-")
        hint = REFUSED_FLAGS.get(flag) or FLAG_HINTS.get(flag) or "not an engine setting here"
        raise TypeError(f"LLM() got an unexpected argument {name!r}: {hint}")
    return out


def _num_choices(params: SamplingParams) -> int:
    """Choices to report (one, carrying the error, when ``n`` itself is invalid)."""
    n = params.n
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(
            f"got {len(params)} SamplingParams for {n} prompts; pass one or one per prompt"
        )
    return params
