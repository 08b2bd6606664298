"""``LLMEngine``: the engine core. Continuous batching over a KV cache, one ``step()`` at a time.

The core keeps requests, scheduling, the scheduler's side of the KV cache
(``kv_manager``: page tables, prefix cache, the audit), sampling and
outputs; the weights, KV tensors and forward pass are its workers'
(``engine/worker/worker.py``), one per rank, reached through an executor
(``engine/core/executor.py``; with one rank a plain call, rank 0's worker in
this process either way).

Each step, in order:
1. retire finished sequences and free their seq_ids;
2. schedule (``Scheduler.schedule``): one token budget shared by every
   running sequence's missing tokens (decodes, prompt chunks, recomputes),
   oldest first, preempting the newest when the cache is full, then FCFS
   admissions into what is left (prefix-cache hits count as computed);
3. one flat forward pass over every scheduled token on every rank
   (``step_batch.lay_out``, the manager's ``StepLayout``, ``Worker.execute``);
4. commit: each sequence's computed tokens, and with them the prefix-cache
   entries of its now-complete blocks; a pass that raises commits nothing
   and fails only the sequences in it;
5. sample the sequences whose tokens are all computed (one batched call),
   detokenize, check stops, stream deltas.

A request never fails because the cache is full: it waits or is recomputed.
After the forward pass each request's work (prompt logprobs, a beam step,
grammar mask and match, sampling and logprobs, detokenizing) runs isolated:
an exception there (or NaN logits) fails that request only, with
``"<stage> failed: <error>"``, and the step goes on for the others. With
``tensor_parallel_size > 1`` or ``pipeline_parallel_size > 1`` a failed
pass is fatal (``EngineFailedError``), since the ranks' caches may then
disagree. The engine is single-threaded: the HTTP server drives it from
one thread (``entrypoints/openai/async_engine.py``), ``LLM`` from the caller's.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paged_server.config import EngineConfig, RunConfig
from paged_server.engine.core.beam_forks import (
    advance_beams,
    finish_beams,
    new_beam_search,
    ready_rows,
)
from paged_server.engine.core.checks import audit_engine, check_pool, check_priority, check_prompt
from paged_server.engine.core.executor import Executor, UniProcExecutor
from paged_server.engine.core.lora_requests import LoRARequests
from paged_server.engine.core.metrics import EngineCounters, RateLimitedLog
from paged_server.engine.core.scheduler import Scheduler, SchedulerOutput
from paged_server.engine.core.step_batch import (
    PromptScores,
    StepBatch,
    StepLogits,
    lay_out,
    run_step,
    split_logits,
)
from paged_server.engine.kv.kv_tiers import attach_tiers
from paged_server.engine.kv.pool_factory import build_kv_manager, pool_capacity
from paged_server.engine.output.detokenize import IncrementalDetokenizer, NoText
from paged_server.engine.output.output_processor import add_token_text, commit_token, take_output
from paged_server.engine.request.pooling import pooling_request
from paged_server.engine.request.sequence import Request, Sequence, SequenceStatus
from paged_server.engine.sample.grammar_mask import StructuredOutput
from paged_server.engine.sample.logprobs import TokenLogprobs, token_logprobs
from paged_server.engine.sample.sampler import SamplerOutput, SamplingRow, row_max, sample
from paged_server.engine.sample.token_sets import check_first_token, resolve_token_sets
from paged_server.engine.speculative.acceptance_gate import AcceptanceGate
from paged_server.engine.speculative.draft_model import with_cpu_default
from paged_server.engine.speculative.proposer import build_proposer
from paged_server.engine.speculative.step_cost import StepCost
from paged_server.engine.speculative.verify import StepChecks, Verified, verify
from paged_server.engine.worker.worker import Worker, WorkerStep
from paged_server.errors import EngineFailedError, QueueFullError, describe_error
from paged_server.generation_defaults import generation_defaults
from paged_server.lora_request import LoRARequest
from paged_server.model_dir import resolve_model_dir
from paged_server.models import LoadedModel
from paged_server.models.loader import checkpoint_dtype, read_model_config
from paged_server.models.quantization import weights_summary
from paged_server.outputs import RequestOutput
from paged_server.pooling_params import PoolingParams
from paged_server.sampling_params import SamplingParams
from paged_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads per-choice seeds of one request


class LLMEngine:
    """Continuous-batching engine over one model and one KV cache pool."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size: an LLMEngine is one replica, got {config.data_parallel_size}; "
                "`paged-server serve --data-parallel-size N` runs N of them behind one server "
                "(paged_server.data_parallel.DataParallelEngine)"
            )
        path = model_path(config) if loaded is None or config.model is not None else None
        if loaded is not None:  # the model's device and dtype are the ones run
            device = next(loaded.model.parameters()).device
            run = config.resolve(loaded.config, device, loaded.dtype)
        else:
            assert path is not None
            run = config.resolve(read_model_config(path), checkpoint_dtype=checkpoint_dtype(path))
        self.config = run  # the config as run, checked before loading: all the engine reads
        # Sampling defaults a request leaves unset (vLLM's --generation-config).
        self.default_sampling = generation_defaults(
            path, run.generation_config, run.override_generation_config
        )
        self.failed: str | None = None  # set when the engine can no longer step
        if run.world_size > 1 and loaded is not None:
            raise ValueError(
                "tensor_parallel_size or pipeline_parallel_size > 1 loads the model in every "
                "rank: pass the model directory (model=...), not a LoadedModel"
            )
        self.executor: Executor = self._executor(run, loaded, path)
        try:
            self._init(path)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _executor(config: RunConfig, loaded: LoadedModel | None, path: str | None) -> Executor:
        """One rank: the driver worker here. Several: the other ranks'
        processes too (``paged_server.parallel``), started now."""
        if config.world_size == 1:
            return UniProcExecutor(Worker(config, loaded=loaded))
        from paged_server.parallel.executor import MultiprocExecutor

        assert path is not None
        return MultiprocExecutor(config, path)

    def _init(self, path: str | None) -> None:
        """Every rank's worker loads, calibrates, sizes, builds and warms up
        its cache, in step (``Worker``'s module doc); this process keeps the
        scheduler's side: the KV cache manager over the blocks every rank holds."""
        config, executor = self.config, self.executor
        executor.collective_rpc("load_model", path, handshake=True)
        worker = self.worker = executor.driver
        loaded = self.loaded = worker.loaded
        assert loaded is not None
        self.tokenizer = loaded.tokenizer
        if config.tokenizer is not None:  # vLLM's --tokenizer: another directory's
            self.tokenizer = Tokenizer.from_dir(resolve_model_dir(config.tokenizer))
        self.model_config = loaded.config
        self.pooler = loaded.pooler  # a pooling model's (--runner pooling), else None
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        kv_scales = executor.collective_rpc("calibrate", handshake=True)
        num_blocks, sized_by = executor.collective_rpc("available_blocks", handshake=True)
        executor.collective_rpc("init_cache", num_blocks, handshake=True)
        spec = worker.kv_spec()
        self.kv_heads_per_rank = spec.num_kv_heads
        self.capacity = pool_capacity(config, spec, num_blocks, sized_by, kv_scales, worker.stage_spec())
        self.kv_manager = build_kv_manager(config, spec, num_blocks)
        self.tiers = attach_tiers(config, spec, self.kv_manager, executor)
        log.info("%s", weights_summary(loaded.model, loaded.dtype, loaded.quantization))
        log.info(
            "KV cache: %d tokens (%d blocks of %d), sized by %s%s",
            self.capacity.tokens,
            self.capacity.num_blocks,
            self.capacity.block_size,
            self.capacity.sized_by,
            f"; {self.capacity.groups}" if self.capacity.groups else "",
        )
        if (short := check_pool(self.capacity, config.max_model_len)) is not None:
            log.warning("%s", short)
        if executor.world_size > 1:
            log.info("%s", self.parallel_summary())
        executor.collective_rpc("warm_up", self.capacity.longest_prompt, handshake=True)
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_batch_size,
            config.max_num_batched_tokens,
            config.block_size,
            config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_loras=config.max_loras if config.enable_lora else None,
            policy=config.scheduling_policy,
        )
        self.loras = LoRARequests(config.enable_lora, worker.check_lora)  # --enable-lora
        self._requests: dict[str, Request] = {}  # submitted and not fully reported
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._touched: list[Sequence] = []
        # --async-output-proc: tokens sampled last step whose text waits for
        # this step's forward pass to be launched, and the outputs made then.
        self._untexted: list[tuple[Sequence, int]] = []
        self._made: list[RequestOutput] = []
        self._defer_text = config.async_output_proc and not config.async_scheduling
        self._inflight: _Inflight | None = None  # --async-scheduling: the step launched last
        spec = config.speculative  # parsed once
        if spec is not None:
            spec = with_cpu_default(spec, config.torch_device.type)
        self._spec = spec
        self._proposer = None if spec is None else build_proposer(spec, self)
        self._gate = AcceptanceGate(spec.min_acceptance if spec is not None else 0.0)
        self._step_cost = StepCost()  # measured step times: whether drafts pay at this batch
        self._drafted: list[Sequence] = []  # sequences holding drafts this step
        self.counters = EngineCounters()
        self._preemption_log = RateLimitedLog(log)
        self.structured_output = StructuredOutput(
            self.tokenizer.hf.to_str(), loaded.config.vocab_size, self.eos_token_ids
        )
        log.info("engine config as run: %s", config.summary())  # once, when it runs

    # -- submission ------------------------------------------------------------
    def _whole_vocab_logprobs(self, params: SamplingParams) -> SamplingParams:
        """``logprobs`` / ``prompt_logprobs`` of -1 (vLLM: every token) as the vocabulary size."""
        if -1 not in (params.logprobs, params.prompt_logprobs) or self.config.max_logprobs != -1:
            return params
        vocab = self.model_config.vocab_size
        return dataclasses.replace(
            params,
            logprobs=vocab if params.logprobs == -1 else params.logprobs,
            prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs,
        )

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
        *, lora_request: LoRARequest | None = None, priority: int = 0,
    ) -> int:  # fmt: skip
        """Queue a request; returns its prompt token count. ``PoolingParams``:
        a pooling request (``--runner pooling``), whose final output carries ``pooled``.
        ``lora_request``: the LoRA adapter serving it (``--enable-lora``),
        loaded now if it is new (None: the base model). ``priority``
        (``scheduling_policy="priority"`` only, as vLLM): lower runs earlier.

        Raises ``ValueError`` for bad parameters, an empty or unusable
        prompt, a prompt that can never fit the cache, or a duplicate id;
        ``QueueFullError`` when ``max_queue_len`` requests already wait.
        """
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        check_priority(priority, self.config.scheduling_policy)
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = pooling_request(
                params, self.pooler, self.config.max_model_len, self.config.model or "default"
            )
        elif self.pooler is not None:
            raise ValueError(
                f"this engine runs a pooling model ({self.pooler.head}, --runner pooling): it "
                "embeds, classifies and scores, it does not generate"
            )
        params = self._whole_vocab_logprobs(params)
        params.validate(self.config.max_model_len, self.config.max_logprobs)
        if isinstance(prompt, str):
            try:
                token_ids = self.tokenizer.encode(prompt)
            except Exception as exc:
                raise ValueError(f"prompt: could not be tokenized: {exc}") from exc
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the prompt's end
            token_ids, text = token_ids[-params.truncate_prompt_tokens:], None
        if params.max_tokens is None:  # vLLM: as many as the context leaves
            room = max(1, self.config.max_model_len - len(token_ids))
            params = dataclasses.replace(params, max_tokens=room)
        params = resolve_token_sets(params, self.tokenizer, self.model_config.vocab_size)
        check_prompt(
            token_ids,
            params,
            self.config.max_model_len,
            self.model_config,
            self.capacity,
            self.config.max_batch_size,
        )
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        waiting = len(self.scheduler.waiting)
        if waiting >= self.config.max_queue_len:
            raise QueueFullError(
                f"{waiting} requests are already waiting (max_queue_len "
                f"{self.config.max_queue_len}); retry later"
            )
        lora = self.loras.for_request(lora_request)
        request = self._new_request(request_id, text, token_ids, params)
        request.pooling = pooling
        request.lora_name, request.lora_key = lora, self.loras.key(lora)
        request.priority = priority
        # one matcher per sequence: n choices, or best_of beams
        grammars = self.structured_output.matchers(params.structured_outputs, len(request.seqs))
        narrowed = grammars[0] is not None and (params.allowed_token_ids or params.bad_words)
        first = self.structured_output.allowed_now(grammars[0]) if narrowed else None
        check_first_token(params, self.model_config.vocab_size, self.eos_token_ids, first)
        for seq, grammar in zip(request.seqs, grammars, strict=True):
            seq.grammar = grammar
        self._requests[request_id] = request
        self.scheduler.add(request.seqs[0])
        if self.tiers is not None:
            self.tiers.note_prompt(token_ids)
        return len(token_ids)

    # -- LoRA adapters (vLLM's engine calls) ----------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serve an adapter (read and checked now; every rank loads it before
        the next step); False when it is served already. ``ValueError``: a
        bad adapter, a name in use, or no ``--enable-lora``."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora: str | int) -> bool:
        """Stop serving an adapter (by name or ``lora_int_id``): new requests
        for it are refused now, its weights freed once its requests finish.
        False when no such adapter is served."""
        name = next((n for n, r in self.loras.served.items() if lora in (n, r.lora_int_id)), None)
        if name is None:
            return False
        self.loras.remove(name)
        return True

    def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every adapter served (vLLM's)."""
        return {r.lora_int_id for r in self.loras.served.values()}

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """The adapters served, by name (``/v1/models`` lists them)."""
        return self.loras.served

    def _step_loras(self, step: WorkerStep, scheduled: list[tuple[Sequence, int]]) -> WorkerStep:
        """``step`` with its sequences' adapters (in flat-batch order: the
        one-token ones first) and the adapter commands due; untouched while
        no adapter is loaded."""
        loras = self.loras
        if not loras.active:
            return step
        names = [s.request.lora_name for s, n in scheduled if n == 1]
        names += [s.request.lora_name for s, n in scheduled if n != 1]
        step.loras = names if any(n is not None for n in names) else None
        step.lora_ops = loras.take_ops(lambda: (r.lora_name for r in self._requests.values()))
        return step

    def abort_request(self, request_id: str) -> None:
        """Cancel a request now: its final outputs come with the next
        ``step()``, which frees its blocks first. Unknown or finished ids are
        ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.WAITING:
                self.scheduler.remove_waiting(seq)
            self._finish(seq, "abort")  # running ones are freed by retire()

    def has_unfinished(self) -> bool:
        """Whether ``step()`` still has anything to do (including reporting and
        freeing sequences that finished or were aborted since the last step)."""
        if self.failed is not None:
            return False
        return (
            self.scheduler.has_work()
            or self._inflight is not None
            or bool(self._touched or self._untexted or self._made)
        )

    # -- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by its tokens for this step; returns
        the new output of each (request, choice) that produced something.
        Raises ``EngineFailedError`` once the engine cannot go on."""
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        if self.config.async_scheduling:
            return self._step_overlapped()
        if self.tiers is not None:  # disk blocks of new prompts into host memory, checked
            self.tiers.prefetch(self.kv_manager.block_manager.block_pool.lookup)
        start = time.perf_counter()
        plan = self._plan()
        if plan.scheduled:
            drafted = bool(self._drafted)
            self._run(plan.scheduled)
            if self._proposer is not None:  # timed by the rows it computed (prompt chunks too)
                rows = sum(n for _, n in plan.scheduled)
                # less a draft model's backlog: what drafting every step would not pay again
                backlog = self._proposer.backlog_seconds if drafted else 0.0
                self._step_cost.record(rows, drafted, time.perf_counter() - start - backlog)
        else:  # no forward pass to overlap with
            self._text_of_last_step()
        return self._collect_outputs()

    def _plan(self) -> SchedulerOutput:
        """Retire, propose drafts (speculative decoding), schedule, fail what
        can never run, count."""
        self.scheduler.retire()
        if self._proposer is not None:
            self._propose()
        plan = self.scheduler.schedule()
        for seq, reason in plan.refused:  # the progress guarantee: fail, never wait forever
            if not seq.is_finished:
                log.error("%s", reason)
                self._fail(seq, reason)
        self._count(plan)
        return plan

    def _step_overlapped(self) -> list[RequestOutput]:
        """``--async-scheduling`` (vLLM's): while step N's pass runs on the
        launch thread, plan step N+1 (the scheduler counts N's tokens as
        computed and the tokens N samples as known, ``Sequence.scheduled_upto``
        / ``planned_tokens``); then wait for N's logits and sample them,
        launch N+1 with the sampled tokens filled in, and only then commit
        N, append its tokens (grammar, stop checks, text) and make its outputs,
        while N+1 runs. Same tokens as without: each row samples from the
        same logits with its own generator, after the tokens before it.
        A step holding a beam search or choices still to fork is processed
        whole before the next is planned (its processing rearranges sequences)."""
        inflight = self._inflight
        if inflight is not None and not inflight.overlaps:
            self._inflight = None
            self._finish_inflight(inflight)
            inflight = None
        plan = self._plan()  # with N in flight: planned, laid out and launched behind its pass
        launched = self._launch(plan.scheduled, inflight) if plan.scheduled else None
        drawn = None
        try:
            drawn = self._draw_inflight(inflight) if inflight is not None else None
        finally:
            if launched is not None:  # its rows waiting for N's samples get them (or 0s)
                launched.fill.provide(drawn)
        self._inflight = launched
        if inflight is not None and drawn is not None:  # while N+1 runs (None: N's pass failed)
            self._commit(inflight.scheduled, None, inflight)
            self._accept(drawn)
        return self._collect_outputs()

    # -- step parts -------------------------------------------------------------
    def _count(self, plan: SchedulerOutput) -> None:
        """Preemptions and prompt tokens, counted here only (prefix-cache
        counters are the pool's). A request's first admission records its
        prefix-cache hits and when it left the queue."""
        counters = self.counters
        counters.preemptions += len(plan.preempted)
        # Under priority scheduling a request may also make way for a higher one.
        why = "KV cache full" if self.config.scheduling_policy == "fcfs" else (
            "KV cache full or a higher-priority request waiting"
        )
        for seq in plan.preempted:
            self._preemption_log.warning(
                "preempted sequence %d (request %s, priority %d) at %d tokens: %s, %s; "
                "it will be recomputed",
                seq.seq_id,
                seq.request.request_id,
                seq.request.priority,
                seq.num_tokens,
                why,
                self._free_kv_text(),
            )
        now = time.monotonic()
        for seq in plan.admitted:
            request = seq.request
            if not request.admitted:
                request.admitted = True
                request.num_cached_tokens = seq.num_computed_tokens  # hits, before this step
                request.first_scheduled_time = now
                counters.prompt_tokens += seq.num_prompt_tokens

    def _free_kv_text(self) -> str:
        free_tokens = self.kv_manager.free_token_capacity()
        if free_tokens is None:  # contiguous pool: rows, not blocks
            return f"{self.kv_manager.free_seq_count()} free seq_ids"
        return f"{free_tokens // self.config.block_size} free blocks"

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Forward, commit, then sample. A pass that raises commits nothing
        and fails only the sequences in it."""
        try:
            step = self._forward(scheduled)
        except Exception as exc:
            self._forward_failed(scheduled, exc)
            self._text_of_last_step()
            return
        # On CUDA the pass is still running: last step's text is made meanwhile,
        # and a stop string found there finishes its sequence before this
        # step's token is appended (the rows below skip finished sequences).
        self._text_of_last_step()
        self._commit(scheduled, step)
        self._accept(self._draw(self._rows(scheduled, step), step.logits))
        self._check_drafts(scheduled, step)

    # -- speculative decoding --------------------------------------------------------
    def _propose(self) -> None:
        """Drafts for every running sequence that may speculate: decoding
        (past its first token, its last token the only one to compute), no grammar, no beam search,
        no choices still to fork, its recent drafts paying or probing
        (``AcceptanceGate``), not while ``disable_by_batch_size`` or more run;
        of those whose drafts pay, as many as the measured step times say
        raise tokens per second (``StepCost``)."""
        spec, proposer, gate = self._spec, self._proposer, self._gate
        assert spec is not None and proposer is not None
        running = [s for s in self.scheduler.running if not s.is_finished]
        proposer.retain([s.seq_id for s in running])  # a draft model's KV of the others goes
        if not spec.speculates(len(running)):
            return
        gate.begin_step()
        paying: list[tuple[Sequence, int]] = []
        probing: list[tuple[Sequence, int]] = []
        for seq in running:
            token_ids = seq.token_ids
            if (
                seq.num_computed_tokens != len(token_ids) - 1
                or len(token_ids) == seq.num_prompt_tokens  # still in its prompt (or pooling)
                or seq.num_inflight_tokens or seq.num_pending_samples
                or seq.grammar is not None or seq.request.beam is not None or seq.forks_choices
                or seq.pool_seq_id is None
            ) or not gate.allows(seq):  # fmt: skip
                continue
            params = seq.request.params
            # no draft past the last token max_tokens / max_model_len allow
            room = min(
                params.max_tokens - (len(token_ids) - seq.num_prompt_tokens),  # type: ignore[operator]
                self.config.max_model_len - len(token_ids),
            ) - 1
            if room > 0:
                (paying if gate.paying(seq) else probing).append((seq, room))
        # adaptive (ours): 0 drafts for all, as vLLM does; --async-scheduling's steps are not timed
        if gate.min_acceptance > 0 and not self.config.async_scheduling:
            paying.sort(key=lambda item: -gate.acceptance(item[0]))
            k = spec.num_speculative_tokens
            offers = [(gate.acceptance(seq), min(k, room)) for seq, room in paying]
            paying = paying[: self._step_cost.choose(len(running), offers, gate.step)]
        chosen = paying + gate.sample_probes(probing, len(running))
        eligible = [seq for seq, _ in chosen]
        drafts = proposer.propose_all(
            [s.seq_id for s in eligible], [s.token_ids for s in eligible], [room for _, room in chosen]
        )
        for seq, draft in zip(eligible, drafts, strict=True):
            if draft:
                seq.draft = draft
                self._drafted.append(seq)

    def _speculating(self) -> bool:
        """Whether the running sequences speculate now (``disable_by_batch_size``)."""
        spec = self._spec
        return spec is not None and spec.speculates(len(self.scheduler.running))

    def _check_drafts(self, scheduled: list[tuple[Sequence, int]], step: StepLogits) -> None:
        """Each checked sequence: the kept drafts and one more token appended;
        its KV committed through the last kept draft, the room reserved for
        rejected ones given back (no prefix-cache entry ever holds them)."""
        drafted, self._drafted = self._drafted, []
        checks = StepChecks.of(step.verified_rows) if step.verified_rows is not None else None
        first = 0
        for i, logits in step.verified:
            seq, n = scheduled[i]
            drafts, at = seq.draft[: n - 1], first
            first += logits.shape[0]
            if seq.is_finished or seq.pool_seq_id is None:
                continue
            with self._isolated(seq, "speculative decoding"):
                verdict = verify(logits, drafts, self._sampling_row(seq), checks, at)
                self._apply_verdict(seq, drafts, verdict)
        for seq in drafted:
            seq.draft = []

    def _apply_verdict(self, seq: Sequence, drafts: list[int], verdict: Verified) -> None:
        if verdict.error is not None:
            self._fail(seq, verdict.error)
            return
        seq_id, length = seq.pool_seq_id, len(seq.token_ids)
        assert seq_id is not None
        kept = verdict.num_accepted
        for position, token in enumerate(drafts[:kept], start=length):
            self.kv_manager.set_token(seq_id, position, token)
        seq.num_computed_tokens = length + kept  # its last token and the kept drafts
        self.kv_manager.mark_computed(seq_id, seq.num_computed_tokens)
        self.kv_manager.truncate(seq_id, seq.num_computed_tokens)
        self.counters.count_drafts(len(drafts), kept)
        self._gate.record(seq, len(drafts), kept)
        now = time.monotonic()
        for token, logprob in zip(verdict.tokens, verdict.logprobs, strict=True):
            self._append(seq, token, logprob, now)
            if seq.is_finished:  # a stop among the kept tokens: the rest are past it
                break

    def _forward_failed(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> None:
        """A pass that raised: fatal with several ranks (their caches may now
        disagree), else it fails only its sequences."""
        if self.executor.world_size > 1:
            raise self._fail_engine(self.executor.describe_failure(exc)) from exc
        log.exception("forward pass failed for %d sequences", len(scheduled))
        for seq, _ in scheduled:
            self._fail(seq, f"model forward pass failed: {type(exc).__name__}: {exc}")

    def _commit(
        self, scheduled: list[tuple[Sequence, int]], step: StepLogits | None = None,
        inflight: _Inflight | None = None,
    ) -> None:  # fmt: skip
        """Each sequence's computed tokens, and with them the prefix-cache
        entries of its now-complete blocks; a sequence whose drafts were
        checked is committed with its verdict (``_check_drafts``). For a step
        launched ahead (``inflight``): its tokens leave ``num_inflight_tokens``,
        its samples ``num_pending_samples``; a sequence preempted or finished
        since its launch is skipped (its KV was freed, or will be)."""
        mark_computed = self.kv_manager.mark_computed  # once per sequence: bound once
        checked = {i for i, _ in step.verified} if step is not None and step.verified else ()
        if inflight is None:
            for i, (seq, n) in enumerate(scheduled):
                if i in checked:
                    continue
                seq.num_computed_tokens += n
                assert seq.pool_seq_id is not None
                mark_computed(seq.pool_seq_id, seq.num_computed_tokens)
            return
        for i, ((seq, n), epoch) in enumerate(zip(scheduled, inflight.epochs, strict=True)):
            if seq.num_preemptions != epoch or seq.pool_seq_id is None:
                continue
            seq.num_inflight_tokens -= n
            if i in checked:
                continue
            seq.num_computed_tokens += n
            mark_computed(seq.pool_seq_id, seq.num_computed_tokens)
        for i in inflight.batch.sampled:
            seq = scheduled[i][0]
            if seq.num_preemptions == inflight.epochs[i]:
                seq.num_pending_samples -= 1

    def _rows(self, scheduled: list[tuple[Sequence, int]], step: StepLogits) -> list[tuple[Sequence, int]]:
        """The rows of ``step.logits`` to sample, by sequence. Prompt logprobs
        and beam steps are done here; choice 0 of an ``n > 1`` request forks
        the others first. From here on, each request's work is its own: an
        exception fails that request (``_isolated``), never the step or its
        neighbours."""
        for scores in step.prompt_scores:
            seq = scheduled[scores.index][0]
            with self._isolated(seq, "prompt logprobs"):
                self._score_prompt(seq, scores)
        for pooled in step.pooled:
            seq = scheduled[pooled.index][0]
            with self._isolated(seq, "pooling"):
                assert seq.request.pooling is not None
                seq.request.pooling.add(pooled.first, pooled.logits)
        rows: list[tuple[Sequence, int]] = []  # (sequence, its row of step.logits)
        for j, i in enumerate(step.sampled):
            seq = scheduled[i][0]
            if seq.is_finished:  # failed above
                continue
            if seq.request.pooling is not None:  # prompt done: its answer, no token
                with self._isolated(seq, "pooling"):
                    seq.request.pooling.finish(step.logits[j])
                    self._finish(seq, "stop")
            elif seq.request.beam is not None:
                with self._isolated(seq, "beam search"):
                    self._beam_row(seq, step.logits[j])
            elif seq.forks_choices:
                with self._isolated(seq, "starting choices"):
                    rows += self._start_choices(seq, j)
            else:  # most rows: one choice, sampled alone
                rows.append((seq, j))
        return rows

    # -- --async-scheduling: a step in flight -------------------------------------
    def _launch(self, scheduled: list[tuple[Sequence, int]], prev: _Inflight | None) -> _Inflight:
        """Lay the step out, build rank 0's metadata and hand it to the launch
        thread, where it runs after the step in flight (``prev``); its rows
        whose token ``prev`` samples get it there (``_Fill``). Its tokens count
        as in flight from now on."""
        batch = lay_out(scheduled)
        layout = self.kv_manager.step_layout(batch.seq_ids, batch.starts, batch.lens)
        meta = self.worker.tensors.build(layout)  # reads no block: safe beside prev's pass
        plain = all(self._plain_greedy(seq) for _, seq in batch.fills)
        fill = _Fill(batch.fills, prev if plain else None)
        num_sampled = len(batch.sampled)

        def with_row_max(logits: Tensor | None) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
            # The sampler's first pass over the logits, beside the pass (a device kernel on a GPU).
            top = row_max(logits[:num_sampled]) if logits is not None and num_sampled else None
            return logits, top

        step = self._step_loras(WorkerStep(batch.ids, layout, batch.rows, batch.every_row), scheduled)
        future = self.executor.launch(step, then=with_row_max, meta=meta, before=fill.apply)
        for seq, n in scheduled:
            seq.num_inflight_tokens += n
        for i in batch.sampled:
            scheduled[i][0].num_pending_samples += 1
        # Drafts need the token before them: while sequences speculate, a step
        # is processed whole before the next is planned.
        overlaps = not self._speculating() and not any(
            s.request.beam is not None or s.forks_choices for s, _ in scheduled
        )
        return _Inflight(
            scheduled, batch, future, [s.num_preemptions for s, _ in scheduled], overlaps, fill
        )

    def _plain_greedy(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next token is its logits' row max (greedy, no
        edits, no grammar): then the launch thread fills it in without the
        engine (``_Fill``)."""
        row = self._sampling_row(seq)
        return row.greedy and not row.edits_logits and seq.grammar is None

    def _wait(self, inflight: _Inflight) -> tuple[StepLogits, tuple[Tensor, Tensor] | None] | None:
        """The launched step's logits, split, and the sampled rows' maxima;
        None if its pass raised (its sequences then failed, as in ``_run``)."""
        try:
            logits, top = inflight.future.result()
        except Exception as exc:
            self._forward_failed(inflight.scheduled, exc)
            return None
        assert logits is not None  # the driver's
        batch = inflight.batch
        return split_logits(
            logits, batch.sampled, batch.scored, len(batch.ids), batch.pooled, batch.verified
        ), top

    def _draw_inflight(self, inflight: _Inflight) -> _Drawn | None:
        """Wait for the step in flight and sample it (its rows of sequences
        preempted or finished since it was launched are dropped); None when
        its pass raised: nothing of it is committed."""
        waited = self._wait(inflight)
        if waited is None:
            return None
        step, top = waited
        scheduled, epochs = inflight.scheduled, inflight.epochs
        for scores in step.prompt_scores:
            seq = scheduled[scores.index][0]
            if seq.num_preemptions == epochs[scores.index]:
                with self._isolated(seq, "prompt logprobs"):
                    self._score_prompt(seq, scores)
        rows = [
            (scheduled[i][0], j)
            for j, i in enumerate(step.sampled)
            if not scheduled[i][0].is_finished and scheduled[i][0].num_preemptions == epochs[i]
        ]
        return self._draw(rows, step.logits, top)

    def _finish_inflight(self, inflight: _Inflight) -> None:
        """Process the step in flight whole before planning the next (a beam
        search or choices to fork: its processing rearranges sequences)."""
        waited = self._wait(inflight)
        if waited is not None:
            step, top = waited
            self._commit(inflight.scheduled, step, inflight)
            self._accept(self._draw(self._rows(inflight.scheduled, step), step.logits, top))
            self._check_drafts(inflight.scheduled, step)

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """The step's flat batch through every rank's worker; its logits split
        into the sampled rows and the prompt rows scored."""
        return run_step(self.executor, self.kv_manager, scheduled, lambda step: self._step_loras(step, scheduled))

    def _isolated(self, seq: Sequence, stage: str) -> _Isolated:
        """Run one request's post-forward work: if it raises, log the
        traceback and fail that request (every beam of a beam search) with
        ``"<stage> failed: <error>"``; the step goes on."""
        return _Isolated(self, seq, stage)

    def _fail_isolated(self, seq: Sequence, stage: str, exc: Exception) -> None:
        """What ``_isolated`` does with an exception raised in ``stage``."""
        log.exception("%s failed for request %s", stage, seq.request.request_id, exc_info=exc)
        self._fail(seq, f"{stage} failed: {describe_error(exc)}")

    def _score_prompt(self, seq: Sequence, scores: PromptScores) -> None:
        """Append the prompt logprobs this step computed to the request's."""
        request = seq.request
        assert scores.first == len(request.prompt_logprobs), "prompt scored out of order"
        targets = request.prompt_token_ids[scores.first : scores.first + scores.logits.shape[0]]
        num_top = request.params.prompt_logprobs or 0
        request.prompt_logprobs += token_logprobs(
            scores.logits,
            torch.tensor(targets, dtype=torch.long, device=scores.logits.device),
            [num_top] * len(targets),
        )
    def _beam_row(self, seq: Sequence, row: Tensor) -> None:
        """Keep a beam's logits; once every beam of its request has its row,
        take one beam step (forks, frees) or finish the search."""
        request = seq.request
        if seq.is_finished:
            return
        request.beam_rows[seq.index] = row
        rows = ready_rows(request)
        if rows is None:
            return
        if not all(bool(torch.isfinite(r).all()) for r in rows):
            self._fail(seq, "model produced non-finite logits (NaN or inf)")
            return
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        self.counters.generation_tokens += len(rows)
        if advance_beams(request, rows, self.kv_manager, self.scheduler, self.eos_token_ids):
            self._touched += finish_beams(request)

    def _start_choices(self, seq: Sequence, row: int) -> list[tuple[Sequence, int]]:
        """Rows to sample for ``seq`` (``forks_choices``: choice 0 of an ``n > 1``
        request that has computed its prompt): it forks the other choices
        (shared blocks) first, and all sample from the same logits with their
        own generators."""
        request = seq.request
        rows = [(seq, row)]
        request.forked = True
        assert seq.pool_seq_id is not None
        for child in request.seqs[1:]:
            if child.is_finished:
                continue
            child.token_ids = list(seq.token_ids)
            try:
                child.pool_seq_id = self.kv_manager.fork_seq(seq.pool_seq_id)
            except RuntimeError:  # no seq_id free (contiguous pool): recompute it later
                child.pool_seq_id = None
            if child.pool_seq_id is None:
                self.scheduler.requeue_front(child)
            else:
                child.num_computed_tokens = seq.num_computed_tokens
                self.scheduler.add_running(child)
            rows.append((child, row))
        return rows

    def _draw(
        self, rows: list[tuple[Sequence, int]], step_logits: Tensor,
        top: tuple[Tensor, Tensor] | None = None,
    ) -> _Drawn:  # fmt: skip
        """Mask and sample one token per ``(sequence, row of step_logits)``,
        batched, errors reported per row; nothing appended yet (``_accept``).
        ``top``: each row's max, taken beside the pass (no grammar mask on them)."""
        if not rows:
            return _Drawn(rows, None, [])
        try:
            index = [row for _, row in rows]
            # Usually every row, once and in order: no copy of [batch, vocab].
            if index == list(range(step_logits.shape[0])):
                logits = step_logits
            else:
                picked = torch.tensor(index, device=step_logits.device)
                logits = step_logits[picked]
                top = None if top is None else (top[0][picked], top[1][picked])
            grammars = [s.grammar for s, _ in rows]
            logits, mask_errors = self.structured_output.mask_logits(logits, grammars)
            if any(g is not None for g in grammars):  # masked: the maxima moved
                top = None
            return _Drawn(rows, sample(logits, [self._sampling_row(s) for s, _ in rows], top), mask_errors)
        except Exception as exc:  # not one row's fault (each is isolated inside): a bug
            log.exception("sampling failed for a batch of %d rows", len(rows))
            return _Drawn(rows, None, [f"sampling failed: {describe_error(exc)}"] * len(rows))

    def _accept(self, drawn: _Drawn) -> None:
        """Append each drawn token (grammar, stop checks, text); a row that
        failed fails its request only."""
        result = drawn.result
        if result is None:
            for (seq, _), error in zip(drawn.rows, drawn.mask_errors, strict=True):
                self._fail(seq, error or "")
            return
        now = time.monotonic()
        for (seq, _), token, logprob, error, mask_error in zip(
            drawn.rows, result.token_ids, result.logprobs, result.errors, drawn.mask_errors, strict=True
        ):
            if seq.is_finished:  # a neighbour's beam or choice finished it meanwhile
                continue
            if mask_error is not None or error is not None:
                self._fail(seq, mask_error or error or "")
                continue
            try:  # as ``_isolated``, without a context object per row
                self._append(seq, token, logprob, now)
            except Exception as exc:
                self._fail_isolated(seq, "detokenization", exc)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sampler's view of ``seq``, built once: of its fields only
        ``token_ids`` changes, in place (a fork or a beam that replaces the
        list gets a new row)."""
        row = seq.sampling_row
        if row is None or row.token_ids is not seq.token_ids:
            row = seq.sampling_row = SamplingRow(
                seq.request.params,
                seq.generator,
                seq.token_ids,
                seq.num_prompt_tokens,
                self.eos_token_ids,
            )
        return row

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, now: float) -> None:
        """One sampled token: advance the grammar and the stop checks on ids;
        then its text, now or (``async_output_proc``) during the next pass."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        self.counters.generation_tokens += 1
        complete = False
        if seq.grammar is not None:
            complete, error = self.structured_output.accept(seq.grammar, token)
            if error is not None:
                self._fail(seq, error)
                return
        commit_token(seq, token, logprob, self.eos_token_ids, self.config.max_model_len)
        if seq.num_inflight_tokens and seq.pool_seq_id is not None:  # reserved by the step in flight
            self.kv_manager.set_token(seq.pool_seq_id, len(seq.token_ids) - 1, token)
        if complete and not seq.is_finished:  # the grammar admits nothing more
            seq.finish("stop")
        if self._defer_text:
            self._untexted.append((seq, token))
            return
        self._touched.append(seq)
        add_token_text(seq, token, self.eos_token_ids)

    def _text_of_last_step(self) -> None:
        """``async_output_proc``: the text of the tokens sampled last step, and
        their outputs, taken now, before this step's tokens join them."""
        if not self._untexted:
            return
        untexted, self._untexted = self._untexted, []
        for seq, token in untexted:
            try:
                add_token_text(seq, token, self.eos_token_ids)
            except Exception as exc:
                self._fail_isolated(seq, "detokenization", exc)
        self._made += self._take_outputs(seq for seq, _ in untexted)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish ``seq``; choices that were waiting to fork from it finish too,
        and so does every beam of a beam search."""
        seq.finish(reason, error)
        self._touched.append(seq)
        if seq.request.beam is not None:
            for beam in seq.request.seqs:
                if not beam.is_finished:
                    beam.finish(reason, error)
                    self._touched.append(beam)
            return
        if seq.index == 0 and not seq.request.forked:
            for child in seq.request.seqs[1:]:
                if not child.is_finished:
                    child.finish(reason, error)
                    self._touched.append(child)

    def _fail(self, seq: Sequence, message: str) -> None:
        self._finish(seq, "error", message)

    def _fail_engine(self, reason: str) -> EngineFailedError:
        """Stop for good: stop every rank; the caller raises the returned error."""
        self.failed = f"{getattr(self.executor, 'kind', 'parallel')} engine stopped: {reason}"
        log.error("%s", self.failed)
        self.executor.shutdown(reason)
        return EngineFailedError(self.failed)

    # -- lifecycle ----------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the other ranks' workers (nothing to do with one rank).
        Idempotent; the engine cannot step afterwards if it had workers."""
        inflight, self._inflight = getattr(self, "_inflight", None), None
        if inflight is not None:  # let the launch thread finish its step
            inflight.future.exception()
        proposer, self._proposer = getattr(self, "_proposer", None), None
        if proposer is not None:  # a draft model's engine
            proposer.shutdown()
        executor = getattr(self, "executor", None)
        if executor is None:
            return
        if getattr(self, "tiers", None) is not None and self.failed is None:
            self.tiers.flush()  # the last steps' blocks onto disk, for a warm start
        executor.shutdown()
        if executor.world_size > 1:
            self.failed = self.failed or "the engine was shut down"

    def parallel_summary(self) -> str | None:
        """One line on how tensor and pipeline parallelism split the KV cache
        (None without them)."""
        n, stages = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if n == stages == 1:
            return None
        parts = []
        if n > 1:
            total, local = self.model_config.num_kv_heads, self.kv_heads_per_rank
            gain = total / local
            how = (
                f"at equal per-device memory the pool holds {gain:g}x the tokens of one device"
                if gain > 1
                else "KV heads are replicated (fewer KV heads than ranks), so no capacity gain"
            )
            parts.append(
                f"tensor_parallel_size={n}: each rank holds {local} of {total} KV heads per layer; "
                f"{how}"
            )
        if stages > 1:
            from paged_server.models.pipeline_parallel import stage_layers

            layers = self.model_config.num_layers
            split = [len(stage_layers(layers, r, stages)) for r in range(stages)]
            parts.append(
                f"pipeline_parallel_size={stages}: layers split {'+'.join(map(str, split))} over "
                f"the stages; each rank's KV pool holds its stage's layers "
                f"({self.capacity.kv_bytes} bytes on rank 0 for {self.capacity.tokens} tokens)"
            )
        return "; ".join(parts)
    def _collect_outputs(self) -> list[RequestOutput]:
        """This step's outputs: those made while its pass ran, then every
        sequence touched since (one whose text is still to come waits for it)."""
        touched, self._touched = self._touched, []
        if self._untexted and touched:  # (a decode touches none: its outputs were made)
            waiting = {id(seq) for seq, _ in self._untexted}
            self._touched = [seq for seq in touched if id(seq) in waiting]
            touched = [seq for seq in touched if id(seq) not in waiting]
        outputs, self._made = self._made + self._take_outputs(touched), []
        return outputs

    def _take_outputs(self, seqs: Iterable[Sequence]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for seq in dict.fromkeys(seqs):  # each once, in order (hashed by identity)
            request = seq.request
            out = take_output(seq)
            if out is not None and out.index < request.params.n:  # not a dropped beam
                outputs.append(out)
            done = seq.is_finished and request.finished  # request.finished: every choice
            if done and all(s.finish_reported for s in request.seqs):
                self._requests.pop(request.request_id, None)
        return outputs

    # -- submission helpers -----------------------------------------------------
    def _new_request(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams
    ) -> Request:
        request = Request(request_id, text, token_ids, params, time.monotonic())
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if params.use_beam_search:
            request.beam = new_beam_search(request, self.eos_token_ids, self.config.max_model_len)
        for index in range(params.num_seqs):
            generator = torch.Generator().manual_seed((base_seed + index * _GOLDEN) % 2**64)
            request.seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request=request,
                    index=index,
                    token_ids=list(token_ids),
                    generator=generator,
                    text_stream=IncrementalDetokenizer(
                        self.tokenizer,
                        skip_special_tokens=params.skip_special_tokens,
                        context_ids=token_ids,
                    )
                    if params.detokenize
                    else NoText(),
                    status=SequenceStatus.WAITING if index == 0 else SequenceStatus.PENDING_FORK,
                )
            )
        return request

    # -- observability ------------------------------------------------------------
    def free_token_capacity(self) -> int | None:
        """Tokens the free KV capacity can still hold (``None``: contiguous pool)."""
        return self.kv_manager.free_token_capacity()

    def metrics(self) -> dict[str, float]:
        """Gauges and counters for operators (names in docs/contracts.md)."""
        running = {id(s.request) for s in self.scheduler.running if not s.is_finished}
        waiting = {id(s.request) for s in self.scheduler.waiting} - running
        out = self.counters.snapshot(self.kv_manager, self.capacity, len(running), len(waiting))
        if self.tiers is not None:
            out.update(self.tiers.metrics(self.worker))
        if self.config.enable_lora:  # vLLM's lora_requests_info: adapters with requests running/waiting
            out["max_lora"] = self.config.max_loras
            for state, seqs in (("running", self.scheduler.running), ("waiting", self.scheduler.waiting)):
                for seq in seqs:
                    if seq.request.lora_name is not None and not seq.is_finished:
                        key = f"lora_{state}:{seq.request.lora_name}"
                        out[key] = out.get(key, 0) + 1
        return out

    def audit(self) -> list[str]:
        """Inconsistencies between the engine and its pool (empty when healthy);
        when idle, any KV capacity still held is reported as a leak. The
        number found is exported (``kv_audit_problems``)."""
        problems = self.executor.health()
        problems += audit_engine(
            self.kv_manager, self.scheduler, self.capacity, idle=not self.has_unfinished()
        )
        self.counters.audits += 1
        self.counters.audit_problems = len(problems)
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Operator action after an audit reported leaked blocks: free every
        block that no live sequence's page table holds. Returns their ids
        (always empty for the contiguous pool, which has no blocks)."""
        reclaimed = self.kv_manager.reclaim_leaked()
        if reclaimed:
            log.warning("reclaimed %d leaked KV blocks: %s", len(reclaimed), reclaimed)
        return reclaimed


def model_path(config: EngineConfig) -> str:
    """The configured model directory, the trained evaluation model
    (``trained-default``, trained and cached on first use), or the embedded
    default model."""
    from paged_server.default_model.trained import TRAINED_MODEL_ALIAS, ensure_trained_model

    if config.model == TRAINED_MODEL_ALIAS:
        return str(ensure_trained_model())
    if config.model is not None:
        return resolve_model_dir(config.model)
    from paged_server.default_model import ensure_default_model

    return str(ensure_default_model())


class _Isolated:
    """``LLMEngine._isolated``'s context manager: a class, not a generator,
    because it wraps every sequence's work twice per step (a generator-based
    one cost ~10 us each)."""

    __slots__ = ("engine", "seq", "stage")

    def __init__(self, engine: LLMEngine, seq: Sequence, stage: str) -> None:
        self.engine, self.seq, self.stage = engine, seq, stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self.engine._fail_isolated(self.seq, self.stage, exc)
        return True


@dataclass(slots=True)
class _Inflight:
    """A step launched on the launch thread and not yet processed
    (``--async-scheduling``): what it computes, its layout, its logits to
    come, each sequence's ``num_preemptions`` at launch (a result for one
    preempted since is dropped), and whether the next step may be planned
    before it is processed."""

    scheduled: list[tuple[Sequence, int]]
    batch: StepBatch
    future: Future[Any]
    epochs: list[int]
    overlaps: bool
    fill: _Fill


class _Fill:
    """Where a launched step's rows get the tokens the step before it (in
    flight at its launch) samples. Its ``apply`` runs on the launch thread,
    right before the pass: when every such row is greedy and unedited
    (``plain``, the step before is then given), the tokens are that step's
    row maxima, taken beside its pass, so the launch waits for nothing on
    the engine thread; otherwise it waits for the engine's samples
    (``provide``). A row whose token failed runs a 0: its result is dropped."""

    def __init__(self, rows: list[tuple[int, Sequence]], plain: _Inflight | None) -> None:
        self.rows = rows
        self.plain = plain
        self.index: dict[int, int] = {}  # sequence (by id) -> its row of the step before's maxima
        if plain is not None and rows:
            before = plain.scheduled
            self.index = {id(before[i][0]): j for j, i in enumerate(plain.batch.sampled)}
        self._samples: Future[dict[int, int]] = Future()

    def provide(self, drawn: _Drawn | None) -> None:
        """The engine's samples of the step before (None: its pass failed)."""
        self._samples.set_result({} if drawn is None else drawn.tokens())

    def apply(self, step: WorkerStep) -> None:
        if not self.rows:
            return
        ids = step.input_ids
        if self.plain is None:
            tokens = self._samples.result()
            for row, seq in self.rows:
                ids[row] = tokens.get(id(seq), 0)
            return
        try:
            maxima = self.plain.future.result()[1][1].tolist()  # done: it ran just before
        except Exception:  # its pass failed: these rows' results are dropped
            maxima = None
        for row, seq in self.rows:
            j = self.index.get(id(seq))
            ids[row] = maxima[j] if maxima is not None and j is not None else 0


@dataclass(slots=True)
class _Drawn:
    """Sampled rows not yet appended: ``result`` None when the batch failed
    (``mask_errors`` then holds each row's error)."""

    rows: list[tuple[Sequence, int]]
    result: SamplerOutput | None
    mask_errors: list[str | None]

    def tokens(self) -> dict[int, int]:
        """Sequence (by id) -> its token, for the rows that drew one."""
        if self.result is None:
            return {}
        return {
            id(seq): token
            for (seq, _), token, error, mask_error in zip(
                self.rows, self.result.token_ids, self.result.errors, self.mask_errors, strict=True
            )
            if error is None and mask_error is None
        }
