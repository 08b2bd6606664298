"""What the engine hands back: streaming deltas (``RequestOutput``) and,
for the offline ``LLM`` API, whole completions (``CompletionResult``) and
pooling results shaped as vLLM's (``EmbeddingRequestOutput``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_server.engine.sample.logprobs import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """One per (request, choice index) per step that produced something.

    Deltas only: ``new_token_ids``/``new_text``/``new_logprobs`` hold what
    is new since the previous output of this choice. ``new_text`` may lag
    the tokens by a few characters while a stop string could still be
    forming. ``arrival_time``, ``first_scheduled_time`` and
    ``first_token_time`` (``time.monotonic()`` seconds) let the server build
    queue-time and TTFT histograms; the time an output arrives gives
    inter-token latency. ``num_cached_tokens``: prompt tokens served from the
    prefix cache at the request's first admission (``usage.cached_tokens``).
    With ``SamplingParams.logprobs=N > 0``, ``new_top_logprobs`` holds each
    new token's ``N`` most likely alternatives ``(token id, logprob)``; with
    ``prompt_logprobs``, the first output of each choice carries
    ``prompt_logprobs``: one entry per prompt token, ``None`` for the first
    (nothing precedes it).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    arrival_time: float | None = None
    first_token_time: float | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cumulative_logprob: float | None = None  # beam search: the beam's summed log-probability
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    # What ended a "stop" finish (vLLM's stop_reason): the stop string, or the
    # stop_token_ids id; None for EOS and every other finish.
    stop_reason: int | str | None = None
    # A pooling request's result (a float32 CPU tensor), on its final output.
    pooled: Any = None


@dataclass(slots=True)
class CompletionChoice:
    """One finished choice of an offline completion. ``logprobs`` holds each
    token's log-probability; ``top_logprobs`` (with ``logprobs=N``) each
    position as vLLM shapes it: token id -> logprob for the token and its
    ``N`` most likely alternatives."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    error: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class CompletionResult:
    """Everything ``LLM.generate`` returns for one prompt; ``prompt_logprobs``
    (with ``SamplingParams.prompt_logprobs``) as vLLM: ``None`` for the first
    token, then token id -> logprob for the prompt token and its top ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionChoice] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's name)

    @property
    def finished(self) -> bool:
        """Every choice has a finish reason (as vLLM's ``RequestOutput.finished``)."""
        return all(c.finish_reason is not None for c in self.outputs)


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam: ``tokens`` are the prompt's and the beam's (as in
    vLLM), ``logprobs`` the log-probability of each generated token,
    ``cum_logprob`` their sum; ``text`` is the generated text."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    text: str
    finish_reason: str | None
    error: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """``LLM.beam_search``'s result for one prompt: the beams, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's ``PoolingOutput``: the pooled tensor as it came from the model."""

    data: Any


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: the class probabilities."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's ``ScoringOutput``: one relevance score."""

    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput`` and its typed kinds (the classes
    below): ``outputs`` is a ``PoolingOutput``, ``EmbeddingOutput``,
    ``ClassificationOutput`` or ``ScoringOutput``."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s result for one prompt (``outputs.embedding``)."""

    __slots__ = ()


class ClassificationRequestOutput(PoolingRequestOutput):
    """``LLM.classify``'s result for one prompt (``outputs.probs``)."""

    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s result for one pair (``outputs.score``)."""

    __slots__ = ()
