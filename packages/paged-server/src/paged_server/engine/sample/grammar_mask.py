"""Structured output: a grammar per sequence, applied as a token mask before sampling.

Built on llguidance: it reads the checkpoint's tokenizer.json as it is (the
same ``tokenizers`` object the engine decodes with), compiles a JSON schema
or Lark grammar lazily in about a millisecond (no per-schema precompilation,
so per-request schemas are cheap) and fills a packed bitmask per row.

Each constrained sequence owns one ``LLMatcher``. Choices of an ``n > 1``
request get copies of the prompt-state matcher, so each follows its own
tokens. A matcher advances only on tokens the sampler produced: a preempted
sequence that is recomputed reprocesses its history through the model but
never through the matcher again. When the grammar is complete the mask
allows only EOS, and the sequence finishes ("stop") as soon as its matcher
has nothing left to accept; running out of ``max_tokens`` first gives
"length" with a truncated document, as OpenAI does.

Logits are masked before the sampler sees them, as vLLM does, so penalties,
filters and reported log-probabilities all see the constrained distribution.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
from torch import Tensor

from paged_server.errors import describe_error
from paged_server.output_constraint import StructuredOutputsParams

# Compact JSON: no optional whitespace, so a model cannot pad forever.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
_ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_CACHE_SIZE = 128  # compiled grammars kept (schemas repeat across requests)
_BITS = torch.arange(32, dtype=torch.int32)


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text for ``spec``; ``ValueError`` naming the
    problem if it cannot be compiled (checked without a tokenizer)."""
    spec.validate()
    if spec.grammar is not None:
        grammar = spec.grammar
        if "::=" in grammar:  # GBNF (vLLM's xgrammar dialect) -> Lark
            try:
                grammar = gbnf_to_lark(grammar)
            except Exception as exc:
                raise ValueError(f"structured_outputs: invalid GBNF grammar: {_short(str(exc))}") from None
    elif spec.regex is not None:
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
    elif spec.choice is not None:
        grammar = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
    else:
        schema = _ANY_JSON_OBJECT if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: json is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs: a JSON schema must be an object, got {schema!r}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"structured_outputs: invalid JSON schema: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        kind = ("grammar" if spec.grammar is not None else "regex" if spec.regex is not None
                else "choice" if spec.choice is not None else "JSON schema")
        raise ValueError(f"structured_outputs: invalid {kind}: {_short(error)}")
    return grammar


def _short(error: str) -> str:
    """llguidance's message without the parser state it dumps after it."""
    return error.strip().split("\n", 1)[0].split("; try avoiding", 1)[0]


def _check_completable(prototype: llguidance.LLMatcher) -> None:
    """``ValueError`` if the output a grammar forces from its start never
    ends (a required property whose schema is the object itself): caught at
    submission instead of as a parser error mid-generation."""
    probe = prototype.deep_copy()
    probe.consume_tokens(probe.compute_ff_tokens())
    if probe.is_error():
        raise ValueError(
            "structured_outputs: no output can ever complete it: the text it forces never "
            "ends (does a required property refer back to its own object?); "
            f"{_short(probe.get_error())}"
        )


class StructuredOutput:
    """The engine's grammar side: compile, hand out matchers, mask, advance."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._ll_tokenizer

    def matchers(self, spec: StructuredOutputsParams | None, n: int) -> list[Any]:
        """One fresh matcher per choice (``None`` each when unconstrained);
        ``ValueError("structured_outputs: ...")`` for a bad constraint."""
        if spec is None:
            return [None] * n
        source = grammar_source(spec)
        prototype = self._compiled.get(source)
        if prototype is None:
            prototype = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0)
            if prototype.is_error():
                raise ValueError(f"structured_outputs: {_short(prototype.get_error())}")
            _check_completable(prototype)
            self._compiled[source] = prototype
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(source)
        return [prototype.deep_copy() for _ in range(n)]

    def allowed_now(self, matcher: Any) -> Tensor:
        """The tokens ``matcher`` accepts next, a bool mask over the vocabulary."""
        bitmask = allocate_token_bitmask(1, self.vocab_size)
        fill_next_token_bitmask(matcher, bitmask, 0)
        return ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[0, : self.vocab_size].bool()

    def mask_logits(self, logits: Tensor, matchers: Sequence[Any]) -> tuple[Tensor, list[str | None]]:
        """``logits`` with every token the row's grammar forbids at -inf, and
        per row the error of a matcher that raised (that row is then left
        unmasked: the engine fails its request, the others go on). Rows
        without a matcher are untouched (nothing is done when no row has one)."""
        errors: list[str | None] = [None] * len(matchers)
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits, errors
        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)
        masked = []
        for j, i in enumerate(rows):
            try:
                fill_next_token_bitmask(matchers[i], bitmask, j)
            except Exception as exc:
                errors[i] = f"structured output failed: {_describe(exc)}"
                continue
            masked.append((j, i))
        if not masked:
            return logits, errors
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, : logits.shape[-1]].bool()
        allowed = allowed[[j for j, _ in masked]]
        logits = logits.clone()
        index = torch.tensor([i for _, i in masked], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits, errors

    @staticmethod
    def accept(matcher: Any, token_id: int) -> tuple[bool, str | None]:
        """Advance ``matcher`` by a sampled token: ``(grammar complete, error)``."""
        try:
            if not matcher.consume_token(token_id):
                return False, f"structured output: token {token_id} rejected: {_short(matcher.get_error())}"
            return matcher.is_stopped(), None
        except Exception as exc:
            return False, f"structured output failed: {_describe(exc)}"


def _describe(exc: Exception) -> str:
    """``describe_error`` less the advice llguidance appends to its first line."""
    return describe_error(exc).split("; try avoiding", 1)[0]
