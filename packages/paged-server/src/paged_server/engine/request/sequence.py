"""Per-request state: a ``Request`` (one prompt, ``n`` choices) owns one
``Sequence`` per choice; the scheduler moves sequences, not requests.

Token bookkeeping of a sequence (the one place it is kept):
- ``token_ids``: prompt + generated tokens; ``num_tokens`` is their count.
- ``num_computed_tokens``: tokens whose K/V are committed to the cache.
Each step computes some of the ``num_tokens - num_computed_tokens`` tokens
still missing: a prompt chunk, the last sampled token (decode), or the
whole history after a preemption (recompute). When a step brings
``num_computed_tokens`` up to ``num_tokens``, the next token is sampled.
With ``--async-scheduling`` the next step is planned while one is in
flight: ``num_inflight_tokens`` are being computed and ``num_pending_samples``
tokens will be appended when it is processed (``scheduled_upto`` and
``planned_tokens`` count them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from paged_server.engine.request.pooling import PoolingState
    from paged_server.engine.sample.beam_scorer import BeamScorer
    from paged_server.engine.sample.logprobs import TokenLogprobs
    from paged_server.engine.sample.sampling_row import SamplingRow
    from paged_server.sampling_params import SamplingParams


class TextStream(Protocol):
    """Incremental detokenizer of one choice (``IncrementalDetokenizer``, or
    ``NoText`` with ``detokenize=False``)."""

    def add(self, token_ids: int) -> str:
        """Text completed by a new token (may be empty)."""
        ...

    def flush(self) -> str:
        """Text held back at the end of the stream."""
        ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's queue (new or preempted)
    RUNNING = "running"  # in the running set, holding KV in the pool
    PENDING_FORK = "pending_fork"  # choice > 0 of n: created when choice 0's prompt is done
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One submitted prompt; its choices share the prompt (and its blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    forked: bool = False  # choices 1..n-1 started (from choice 0's prompt)
    admitted: bool = False  # held KV at least once (prompt tokens counted)
    # Scored prompt positions (params.prompt_logprobs): entry p is token p's.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens are still to be scored (so none may come
        from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )
    @property
    def skips_prefix_cache(self) -> bool:
        """Whether its prompt must be computed, not read from the prefix
        cache: prompt tokens to score, or mean/CLS pooling's rows."""
        pooling = self.pooling
        return self.needs_prompt_logprobs or (pooling is not None and pooling.skips_prefix_cache)

    beam: BeamScorer | None = None  # a beam search's scorer (its seqs are the beams)
    # Beams' last logits, kept until every running beam has its row.
    beam_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prefix-cache hits at its first admission
    first_scheduled_time: float | None = None  # left the queue (first admission)
    pooling: PoolingState | None = None  # a pooling request's pool (prompt only, no sampling)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    lora_key: bytes | None = None  # the adapter's prefix-cache key (engine/core/lora_requests.py)
    priority: int = 0  # --scheduling-policy priority: lower runs earlier (vLLM's)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of a request, as scheduled, computed and streamed."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    generator: torch.Generator
    text_stream: TextStream
    status: SequenceStatus = SequenceStatus.WAITING
    pool_seq_id: int | None = None  # the pool's seq_id while it holds KV
    num_computed_tokens: int = 0
    # --async-scheduling: tokens of a step launched and not yet committed,
    # and tokens that step will sample (appended once it is processed); the
    # scheduler plans the next step past both. 0 between synchronous steps.
    num_inflight_tokens: int = 0
    num_pending_samples: int = 0
    num_preemptions: int = 0  # a step's results for a sequence preempted since its launch are dropped
    # Speculative decoding: tokens proposed after the last one, which this
    # step's pass checks (the scheduler may give it fewer); [] between steps.
    draft: list[int] = field(default_factory=list)
    # speculative/acceptance_gate.py: its drafts' recent acceptance (None: none checked yet),
    # and steps between its probes while they are not paying (0: the gate's first interval)
    draft_acceptance: float | None = None
    probe_every: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    output_text: str = ""
    emitted_text_len: int = 0
    logprobs: list[float] = field(default_factory=list)
    grammar: Any = None  # llguidance matcher when the output is constrained
    cumulative_logprob: float | None = None  # a finished beam's summed log-probability
    # Not yet streamed (cleared by the engine after each RequestOutput).
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    new_text: str = ""
    finish_reported: bool = False
    prompt_logprobs_reported: bool = False
    sampling_row: SamplingRow | None = None  # the sampler's view of it, kept by the engine
    num_prompt_tokens: int = field(init=False)  # read every step: kept, not recounted

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.request.prompt_token_ids)  # a prompt never changes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def scheduled_upto(self) -> int:
        """Tokens computed or being computed: where the next step starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def planned_tokens(self) -> int:
        """Tokens known or being sampled: what the next step may compute up to."""
        return len(self.token_ids) + self.num_pending_samples

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def running_places_needed(self) -> int:
        """Running-set places this sequence takes when admitted: all ``n``
        choices (or beams) for a first admission of choice 0 (its forks
        follow it)."""
        if self.index == 0 and not self.request.forked:
            return len(self.request.seqs)
        return 1

    @property
    def forks_choices(self) -> bool:
        """Choice 0 of an ``n > 1`` request whose other choices are not yet
        forked from it (they are, once its prompt is computed)."""
        return self.index == 0 and not self.request.forked and self.request.params.n > 1

    @property
    def moves_with_siblings(self) -> bool:
        """A beam of a forked beam search: its beams advance in lock step (each
        waits for every other's logits), so the scheduler admits, preempts and
        readmits them together, as one unit. Any other sequence is a unit of
        its own: the choices of ``n > 1`` never wait for each other."""
        return self.request.beam is not None and self.request.forked

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
