"""``LLMEngine``: continuous batching over a KV cache pool, one ``step()`` at a time.

Each step, in order (design documents: retire -> free -> admit):
1. take new requests and aborts (``add_request``/``abort_request`` may be
   called from other threads; they only touch a locked inbox);
2. retire finished sequences and free their slots;
3. admit waiting sequences FCFS within ``max_batch_size`` and the free KV
   capacity (keeping a reserve for growth); admission claims the prompt's
   blocks, reusing prefix-cache hits;
4. decode: every running sequence past its prefill gets one token; if the
   pool cannot grow them all, preempt the newest sequence (free it, requeue
   it for recompute) until it can;
5. prefill chunks within ``max_num_batched_tokens`` minus the decode tokens;
6. sample (one batched call), detokenize, check stops, stream deltas.

A request never fails because the pool is full: it waits or is recomputed.
Errors that belong to one request (NaN logits, detokenizer) fail that
request only; a failing forward pass fails the sequences in that pass.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from paged_server.cache_pool import build_cache_pool
from paged_server.config import (
    EngineConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from paged_server.detokenize import IncrementalDetokenizer
from paged_server.engine_checks import audit_engine, check_prompt
from paged_server.engine_metrics import EngineCounters
from paged_server.errors import QueueFullError
from paged_server.models import LoadedModel, load_model
from paged_server.output_processor import append_token, take_output
from paged_server.outputs import RequestOutput
from paged_server.runner import ModelRunner
from paged_server.sampler import SamplingRow, sample
from paged_server.sampling_params import SamplingParams
from paged_server.scheduler import Scheduler
from paged_server.sequence import Request, Sequence, SequenceStatus

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads per-choice seeds of one request


class LLMEngine:
    """Continuous-batching engine over one model and one KV cache pool."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        if loaded is None:
            device = resolve_device(config)
            loaded = load_model(_model_path(config), resolve_dtype(config, device), device)
        device = next(loaded.model.parameters()).device
        self.attention_backend = resolve_attention_backend(config, device)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        if config.max_seq_len > loaded.config.max_position_embeddings:
            # RoPE is computed on the fly, so this runs, but past the trained length
            # a real checkpoint's quality degrades.
            log.warning(
                "max_seq_len %d exceeds the model's max_position_embeddings %d",
                config.max_seq_len,
                loaded.config.max_position_embeddings,
            )
        self.pool, self.capacity = build_cache_pool(
            config, loaded.config, loaded.dtype, device, self.attention_backend
        )
        self.runner = ModelRunner(loaded.model, self.pool, device)
        self.scheduler = Scheduler(
            config.max_batch_size, config.block_size, config.enable_chunked_prefill
        )
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Request] = {}  # submitted and not fully reported
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._touched: list[Sequence] = []
        self.counters = EngineCounters()

    # -- submission (any thread) -----------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> int:
        """Queue a request; returns its prompt token count.

        Raises ``ValueError`` for bad parameters, an empty or unusable
        prompt, a prompt that can never fit the cache, or a duplicate id;
        ``QueueFullError`` when ``max_queue_len`` requests already wait.
        """
        params.validate(self.config.max_seq_len)
        if isinstance(prompt, str):
            try:
                token_ids = self.tokenizer.encode(prompt)
            except Exception as exc:
                raise ValueError(f"prompt: could not be tokenized: {exc}") from exc
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        check_prompt(token_ids, params, self.config.max_seq_len, self.model_config, self.capacity, self.config.max_batch_size)
        request = self._new_request(request_id, text, token_ids, params)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if waiting >= self.config.max_queue_len:
                raise QueueFullError(
                    f"{waiting} requests are already waiting (max_queue_len "
                    f"{self.config.max_queue_len}); retry later"
                )
            self._requests[request_id] = request
            self._inbox.append(request)
        return len(token_ids)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed in the next ``step()``.
        Unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        """Whether ``step()`` still has anything to do (including freeing
        the slots of sequences that finished in the last step)."""
        with self._lock:
            return bool(self._inbox) or bool(self._aborts) or self.scheduler.has_work()

    # -- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every running request by at most one token; returns the
        new output of each (request, choice) that produced something."""
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        self._touched = []
        for request in new:
            self.scheduler.add(request.seqs[0])
        for request_id in aborts:
            self._abort(request_id)

        for seq in self.scheduler.retire():
            self._release(seq)
        self.scheduler.admit(self.pool.free_token_capacity(), self._allocate)
        decode = self._make_room_for_decode(self.scheduler.decode_sequences())
        chunks = self.scheduler.schedule_prefill(self.config.max_num_batched_tokens - len(decode))

        to_sample: list[tuple[Sequence, Tensor]] = []
        if decode:
            logits = self._forward(self.runner.decode, decode, [s for s in decode])
            if logits is not None:
                to_sample += zip(decode, logits, strict=True)
        if chunks:
            logits = self._forward(self.runner.prefill, chunks, [s for s, _ in chunks])
            if logits is not None:
                for (seq, _), row in zip(chunks, logits, strict=True):
                    if not seq.is_prefilling:  # prompt complete: sample its first token
                        to_sample += self._start_choices(seq, row)
        self._sample(to_sample)
        return self._collect_outputs()

    # -- step parts -------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.WAITING:
                self.scheduler.remove_waiting(seq)
            self._finish(seq, "abort")  # running ones are freed by retire() just below

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.pool.free_slot(seq.slot)
            seq.slot = None

    def _allocate(self, seq: Sequence) -> bool:
        """Claim a slot for ``seq``'s tokens (prefix hits become computed tokens)."""
        if not self.pool.can_allocate_sequence(seq.token_ids):
            return False
        seq.slot, cached = self.pool.allocate_sequence(seq.token_ids)
        assert cached < len(seq.token_ids), "a prefix hit must leave the last token to compute"
        seq.num_computed = cached
        self.counters.prefix_queries += len(seq.token_ids)
        self.counters.prefix_hits += cached
        if not seq.request.admitted:
            seq.request.admitted = True
            self.counters.prompt_tokens += seq.num_prompt_tokens
        return True

    def _make_room_for_decode(self, decode: list[Sequence]) -> list[Sequence]:
        """Preempt newest-first until every decoding sequence can grow by one
        token, then reserve that token for each."""
        while decode and not self.pool.can_append([s.slot for s in decode if s.slot is not None]):
            victim = self.scheduler.preempt_newest()
            if victim is None:
                break
            self._release(victim)
            self.counters.preemptions += 1
            if victim in decode:
                decode.remove(victim)
        for seq in decode:
            assert seq.slot is not None
            self.pool.append_token(seq.slot, seq.token_ids[-1])
        return decode

    def _forward(
        self, fn: Callable[[Any], Tensor], arg: Any, seqs: list[Sequence]
    ) -> Tensor | None:
        """Run one forward pass; if it raises, fail only the sequences in it."""
        try:
            return fn(arg)
        except Exception as exc:
            log.exception("forward pass failed for %d sequences", len(seqs))
            for seq in seqs:
                self._fail(seq, f"model forward pass failed: {type(exc).__name__}: {exc}")
            return None

    def _start_choices(self, seq: Sequence, row: Tensor) -> list[tuple[Sequence, Tensor]]:
        """The prompt of ``seq`` is computed: choice 0 of an ``n > 1`` request
        forks the other choices from it (shared blocks) before sampling, and all
        sample from the same logits with their own generators."""
        request = seq.request
        rows = [(seq, row)]
        if seq.index != 0 or request.forked or request.params.n == 1:
            return rows
        request.forked = True
        assert seq.slot is not None
        for child in request.seqs[1:]:
            if child.is_finished:
                continue
            child.token_ids = list(seq.token_ids)
            try:
                child.slot = self.pool.fork_slot(seq.slot)
            except RuntimeError:  # no slot free (contiguous pool): recompute it later
                child.slot = None
            if child.slot is None:
                self.scheduler.requeue_front(child)
            else:
                child.num_computed = child.prefill_len = seq.num_computed
                self.scheduler.add_running(child)
            rows.append((child, row))
        return rows

    def _sample(self, rows: list[tuple[Sequence, Tensor]]) -> None:
        if not rows:
            return
        logits = torch.stack([row for _, row in rows])
        result = sample(
            logits,
            [
                SamplingRow(s.request.params, s.generator, s.token_ids, s.num_prompt_tokens)
                for s, _ in rows
            ],
        )
        now = time.monotonic()
        for (seq, _), token, logprob, error in zip(
            rows, result.token_ids, result.logprobs, result.errors, strict=True
        ):
            if error is not None:
                self._fail(seq, error)
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            self.counters.generation_tokens += 1
            self._touched.append(seq)
            try:
                append_token(seq, token, logprob, self.eos_token_ids, self.config.max_seq_len)
            except Exception as exc:
                self._fail(seq, f"detokenization failed: {type(exc).__name__}: {exc}")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish ``seq``; choices that were waiting to fork from it finish too."""
        seq.finish(reason, error)
        self._touched.append(seq)
        if seq.index == 0 and not seq.request.forked:
            for child in seq.request.seqs[1:]:
                if not child.is_finished:
                    child.finish(reason, error)
                    self._touched.append(child)

    def _fail(self, seq: Sequence, message: str) -> None:
        self._finish(seq, "error", message)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        seen: set[int] = set()
        done: list[str] = []
        for seq in self._touched:
            if id(seq) in seen:
                continue
            seen.add(id(seq))
            out = take_output(seq)
            if out is not None:
                outputs.append(out)
            if seq.request.finished and all(s.finish_reported for s in seq.request.seqs):
                done.append(seq.request.request_id)
        self._touched = []
        if done:
            with self._lock:
                for request_id in done:
                    self._requests.pop(request_id, None)
        return outputs

    # -- submission helpers -----------------------------------------------------
    def _new_request(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams
    ) -> Request:
        request = Request(request_id, text, token_ids, params, time.monotonic())
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        for index in range(params.n):
            generator = torch.Generator().manual_seed((base_seed + index * _GOLDEN) % 2**64)
            request.seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request=request,
                    index=index,
                    token_ids=list(token_ids),
                    generator=generator,
                    text_stream=IncrementalDetokenizer(self.tokenizer, context_ids=token_ids),
                    status=SequenceStatus.WAITING if index == 0 else SequenceStatus.PENDING_FORK,
                )
            )
        return request

    # -- observability ------------------------------------------------------------
    def free_token_capacity(self) -> int | None:
        """Tokens the free KV capacity can still hold (``None``: contiguous pool)."""
        return self.pool.free_token_capacity()

    def metrics(self) -> dict[str, float]:
        """Gauges and counters for operators (names in docs/contracts.md)."""
        running = {id(s.request) for s in self.scheduler.running if not s.is_finished}
        with self._lock:
            waiting = {id(s.request) for s in self.scheduler.waiting} - running
            num_waiting = len(waiting) + len(self._inbox)
        return self.counters.snapshot(self.pool, self.capacity, len(running), num_waiting)

    def audit(self) -> list[str]:
        """Inconsistencies between the engine and its pool (empty when healthy);
        when idle, any KV capacity still held is reported as a leak."""
        return audit_engine(
            self.pool, self.scheduler, self.capacity, idle=not self.has_unfinished()
        )


def _model_path(config: EngineConfig) -> str:
    """The configured model directory, or the embedded default model."""
    if config.model is not None:
        return config.model
    from paged_server.default_model import ensure_default_model

    return str(ensure_default_model())
