"""Per-request sampling settings, named and bounded as in vLLM / the OpenAI API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_server.output_constraint import StructuredOutputsParams

if TYPE_CHECKING:
    from paged_server.engine.sample.bad_words import BadWords

# Temperatures below this sample greedily (as vLLM does): so close to 0 the
# distribution is the argmax anyway, and far smaller ones (1e-40) overflow
# logits / temperature to inf, which leaves no distribution to draw from.
GREEDY_TEMPERATURE = 1e-5
# Most top alternatives a request may ask for per token (vLLM's default
# ``max_logprobs``); each costs a top-k over the vocabulary.
MAX_LOGPROBS = 20
# top_k is a 64-bit integer downstream; any k above the vocabulary means "off".
MAX_TOP_K = 2**63 - 1
# Most ``bad_words`` one request may send: far more than any real list
# (profanity lists run to a few thousand), few enough that indexing them
# stays a fraction of a second. vLLM sets no bound.
MAX_BAD_WORDS = 10_000
# OpenAI's and vLLM's bound on one ``logit_bias`` entry.
MAX_LOGIT_BIAS = 100.0
# Bound on beam search's |length_penalty|: useful values lie within +-3
# (transformers' examples use 0.6-2); beyond 10, length ** penalty only
# saturates the float range (the scorer clamps it; 1024 overflowed).
MAX_LENGTH_PENALTY = 10.0


@dataclass(slots=True)
class SamplingParams:
    """How to pick each token of one request and when to stop.

    ``temperature=0`` is greedy, and so is any temperature below
    ``GREEDY_TEMPERATURE`` (1e-5; far smaller ones would overflow
    ``logits / temperature``). ``top_k=0`` and ``top_p=1`` and ``min_p=0``
    switch those filters off. Penalties follow vLLM: the repetition penalty
    applies to tokens seen in the prompt or output, presence/frequency
    penalties to output tokens. ``seed`` makes a request reproducible on its
    own, whatever else is in the batch. ``logprobs=N`` returns the
    model's log-probability (before bias, penalties and temperature) of each
    chosen token and of the ``N`` most likely tokens (0: the chosen one
    only); ``prompt_logprobs=N`` does the same for every prompt token
    (the first has none), as vLLM. ``logit_bias`` adds a bias in
    [-100, 100] to a token id's logit; ``min_tokens`` masks EOS and
    ``stop_token_ids`` until that many tokens are generated. ``stop`` strings are cut from the text; ``stop_token_ids``
    (and EOS unless ``ignore_eos``) end the request with their token kept in
    ``token_ids`` but not in the text. ``structured_outputs`` constrains
    the output to a JSON schema or grammar (a token mask before sampling).

    ``use_beam_search=True`` (vLLM's extra parameter) replaces sampling by a
    deterministic beam search of width ``best_of`` (default ``n``) that
    returns its ``n`` best finished beams; ``length_penalty`` (within
    +-``MAX_LENGTH_PENALTY``) and ``early_stopping`` (``True``, ``False`` or
    ``"never"``) mean what they mean in transformers'
    ``generate(num_beams=...)``. EOS and ``stop_token_ids`` end a beam;
    ``logit_bias`` and ``min_tokens`` edit the logits the beams are scored
    on, and ``logprobs`` are that edited distribution's, with ``N`` top
    alternatives per token; the sampling knobs (temperature, top-k/p, min-p,
    seed) do not apply, and penalties and stop strings are refused.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len (the engine fills it in)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False
    # vLLM's output and token-set controls:
    skip_special_tokens: bool = True  # False: special tokens' text is in the output
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    # Accepted as vLLM with a fast tokenizer (tokenizer.json), which ignores it:
    # special tokens join the text as the tokenizer decodes them.
    spaces_between_special_tokens: bool = True
    bad_words: list[str] = field(default_factory=list)  # never generated (vLLM's rule)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens
    # bad_words as token ids, indexed at submission (the API or the engine)
    bad_words_index: BadWords | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI allows a single string
            self.stop = [self.stop]
        if self.top_k == -1:  # vLLM's "off"
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax: ``temperature < GREEDY_TEMPERATURE``."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def beam_width(self) -> int:
        """Beams a beam search keeps (``best_of``, else ``n``); 1 without one."""
        if not self.use_beam_search:
            return 1
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for the request: ``n`` choices, or the beams."""
        return self.beam_width if self.use_beam_search else self.n

    def validate(self, max_model_len: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise ``ValueError("<field>: what is wrong")`` for the first bad
        field; ``max_logprobs`` is the engine's (-1: any number, and -1 asks
        for the whole vocabulary)."""
        _int_in("n", self.n, 1, None)
        max_tokens = max_model_len if self.max_tokens is None else self.max_tokens
        _int_in("max_tokens", max_tokens, 1, max_model_len, high_is=" (max_model_len)")
        _int_in("min_tokens", self.min_tokens, 0, max_tokens, high_is=" (max_tokens)")
        if self.min_tokens and self.structured_outputs is not None:
            # The grammar allows only EOS once its document is complete.
            raise ValueError(
                "min_tokens: cannot be combined with a structured output (response_format "
                "json_object / json_schema, a forced tool_choice): the output ends when the "
                "grammar is complete; send min_tokens 0"
            )
        _int_in("top_k", self.top_k, 0, MAX_TOP_K, hint=" (0 or -1 = off)")
        _float_in("temperature", self.temperature, 0.0, None)
        _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids: must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value == -1 and max_logprobs == -1 and not isinstance(value, bool):
                continue  # the whole vocabulary, as vLLM with max_logprobs -1
            if value is not None:
                _int_in(name, value, 0, max_logprobs if max_logprobs >= 0 else None,
                        hint=" (top alternatives; 0 = the token only; -1 = all, with "
                        "--max-logprobs -1)", high_is=" (the server's --max-logprobs)")
        _check_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        self._validate_token_sets()
        for name in ("ignore_eos", "use_beam_search", "include_stop_str_in_output",
                     "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:  # a stop string is found in the text
            raise ValueError("stop: stop strings are only supported when detokenize is True")
        self._validate_beam_search()

    def _validate_token_sets(self) -> None:
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError(f"bad_words: must be a list of non-empty strings, got {self.bad_words!r}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words: {len(self.bad_words)} words, more than {MAX_BAD_WORDS}, the most one "
                "request may ban; send fewer"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list) or not allowed or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise ValueError(
                f"allowed_token_ids: must be a non-empty list of token ids (integers >= 0), got {allowed!r}"
            )
        if self.truncate_prompt_tokens is not None:
            _int_in("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None)

    def _validate_beam_search(self) -> None:
        if self.best_of is not None:
            _int_in("best_of", self.best_of, 1, None)
        if not self.use_beam_search:
            if self.best_of is not None and self.best_of != self.n:
                raise ValueError(
                    f"best_of: must equal n or be omitted without beam search, got best_of "
                    f"{self.best_of} with n {self.n} (use_beam_search=True searches best_of beams)"
                )
            return
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(
                f"best_of: the beam width must be >= n, got best_of {self.best_of} with n {self.n}"
            )
        _float_in("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f'early_stopping: must be true, false or "never", got {self.early_stopping!r}'
            )
        if self.stop:
            raise ValueError("stop: stop strings are not supported with beam search; use stop_token_ids")
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs: not supported with beam search (beams would need forked grammar states)")
        for name, neutral in (
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
        ):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}: must be {neutral} with beam search (scores are raw log-probabilities)")


@dataclass(slots=True)
class BeamSearchParams:
    """``LLM.beam_search`` settings, named as in vLLM, plus transformers'
    ``early_stopping``. Beam search here is deterministic: ``temperature``
    must stay 0. ``include_stop_str_in_output`` keeps the text of the EOS /
    stop token that ended a beam."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop_token_ids: list[int] = field(default_factory=list)

    def to_sampling_params(self) -> SamplingParams:
        """The engine's parameters for this search (all beams returned)."""
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature: beam search is deterministic here; only 0.0 is supported, "
                f"got {self.temperature}"
            )
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=0,
        )


def _check_logit_bias(bias: object) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias: must map token ids to numbers, got {bias!r}")
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias: the bias of token {token} must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(
    name: str, value: object, low: int, high: int | None, hint: str = "", high_is: str = ""
) -> None:
    if not _is_int(value):
        raise ValueError(f"{name}: must be an integer{hint}, got {value!r}")
    assert isinstance(value, int)
    if value < low:
        raise ValueError(f"{name}: must be >= {low}{hint}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}{high_is or hint}, got {value}")


def _float_in(
    name: str, value: object, low: float, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low:
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")
