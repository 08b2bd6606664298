"""Request and response bodies of the OpenAI-compatible API (pydantic).

Static limits live here so the OpenAPI schema states them; limits that depend
on the loaded model (``max_tokens`` against ``max_model_len``, token ids against
the vocabulary) are checked by the handlers. Chosen limits, all documented in
the schema:

- ``n``: 1..16 choices; ``prompt``: at most 16 prompts per completion request.
- ``stop``: at most 4 strings (OpenAI's limit), each 1..256 characters.
- ``logprobs``: completions ``logprobs: N`` and chat ``top_logprobs: N``
  return up to ``MAX_LOGPROBS`` (20, vLLM's default) alternatives per token;
  chat's ``top_logprobs`` needs ``logprobs: true``. Completions ``echo``
  returns the prompt (and, with ``logprobs``, its logprobs; the first
  token's is null); ``max_tokens: 0`` is allowed with ``echo`` only.
- ``logit_bias``: token id (a JSON string key) -> bias in [-100, 100].
- ``response_format`` (``text``, ``json_object``, ``json_schema``) on both
  endpoints and ``tools`` / ``tool_choice`` on chat are enforced by a grammar
  (see ``response_format.py`` and ``tool_calls.py``).
- Fields OpenAI has that this server cannot honour (``suffix``,
  ``best_of`` other than ``n`` without beam search, non-text content) are
  rejected with a 400 naming the field, never ignored; so are vLLM's in
  ``REFUSED_FIELDS``. vLLM's fields in ``IGNORED_FIELDS`` are accepted and
  ignored, each for the reason given there (vLLM ignores them too by default).
  Null means the default for vLLM's optional fields (``n``, ``stream``, ...),
  and ``seed: -1`` means no seed, as in vLLM.
- ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
  chunk carries its choice's usage so far, as vLLM.
- Beam search (vLLM's extra parameters): ``use_beam_search: true`` with
  ``best_of`` beams (default ``n``) returns the ``n`` best; with
  ``length_penalty`` and ``early_stopping``. Not with ``stream: true``.
  Unknown fields are ignored, like vLLM.

Types are strict: ``"max_tokens": "5"`` is a 400, not coerced.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paged_server.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

MAX_PROMPTS = 16
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 64
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """``stream_options`` (only with ``stream: true``); null means false, as in vLLM."""

    include_usage: bool | None = Field(
        False, description="Send one extra chunk before [DONE] with the request's token usage."
    )
    continuous_usage_stats: bool | None = Field(
        False, description="With include_usage: every chunk also carries its choice's usage so "
        "far (vLLM's extension; guidellm and vLLM's benchmarks send it)."
    )


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the output must match."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormatParam(_Strict):
    """``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormatParam:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Strict):
    """``structured_outputs`` (vLLM): exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # BaseModel has .json()
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="Lark (llguidance) or GBNF.")
    json_object: bool | None = None
    disable_fallback: bool = Field(False, description="Accepted: there is one backend, no fallback.")
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _check_supported(self) -> StructuredOutputsRequest:
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported; send false")
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported; send null")
        return self


# vLLM request fields this server cannot honour: a 400 naming the field
# unless it is absent, null or empty (never silently ignored). Each is one vLLM
# itself refuses by default, or one whose silent loss would change the answer
# or its safety (cache_salt's isolation, logprob_token_ids' scores).
REFUSED_FIELDS = {
    "prompt_embeds": "not supported: send text or token ids (vLLM too needs --enable-prompt-embeds)",
    "mm_processor_kwargs": "not supported: text-only models (vLLM too refuses it without "
    "--trust-request-mm-kwargs)",
    "media_io_kwargs": "not supported: text-only models (vLLM too refuses it without "
    "--trust-request-mm-kwargs)",
    "guided_decoding_backend": "not supported: structured outputs always use llguidance; send null",
    "guided_whitespace_pattern": "not supported; send null",
    "structural_tag": "not supported; constrain with response_format, guided_* or tools",
    "logits_processors": "not supported: this server runs no custom code",
    "cache_salt": "not supported yet: the prefix cache is shared by every request",
    "logprob_token_ids": "not supported yet: ask for the top alternatives with logprobs / "
    "top_logprobs instead",
}

# vLLM request fields accepted and ignored, each for the reason given (the
# same reason vLLM ignores them in the default configuration, or a hint
# that does not change the answer). Kept as data so docs and tests read it.
IGNORED_FIELDS = {
    "kv_transfer_params": "no KV connector (as vLLM without --kv-transfer-config)",
    "ec_transfer_params": "no encoder-cache connector (as vLLM without one configured)",
    "vllm_xargs": "no custom extension reads them (as vLLM without plugins)",
    "session_id": "one engine: there is no session routing to pin",
    "routed_experts_prompt_start": "no routed-expert data is returned (as vLLM without "
    "--enable-return-routed-experts)",
    "return_token_offsets": "only the render endpoints use it, in vLLM too",
    "return_mm_kwargs": "only the render endpoints use it, in vLLM too",
    "stream_interval": "every engine step streams its tokens (the interval is 1, which vLLM "
    "clamps a smaller request value up to)",
    "repetition_detection": "no repetition detector: generation ends at a stop, EOS or max_tokens",
}

# vLLM's optional fields: null means the default, as there.
_NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs", "top_logprobs", "frequency_penalty",
                    "presence_penalty", "parallel_tool_calls", "include_reasoning")


class RepetitionDetection(_Strict):
    """vLLM's ``repetition_detection`` (accepted, see ``IGNORED_FIELDS``)."""

    max_pattern_size: int = Field(0, ge=0)
    min_pattern_size: int = Field(0, ge=0)
    min_count: int = Field(0, ge=0)


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(
        None, description="Must name the served model (GET /v1/models); omitted = the served model."
    )
    # n and best_of as vLLM: no ceiling here; the engine refuses more than max_num_seqs.
    n: int = Field(1, ge=1, description="Choices to generate per prompt.")
    # Unset (null): the model's generation_config.json value, else the neutral one.
    temperature: FiniteFloat | None = Field(
        None, ge=0.0, description="0 (or below 1e-5) = greedy; null = the model's default, else 1."
    )
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0, description="null = the model's default, else 1.")
    top_k: int | None = Field(
        None, ge=-1, le=INT64_MAX, description="0 or -1 = off; null = the model's default (vLLM extension)."
    )
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0, description="vLLM extension; null = the model's default.")
    repetition_penalty: FiniteFloat | None = Field(
        None, gt=0.0, description="vLLM extension; null = the model's default, else 1."
    )
    presence_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP} strings of 1..{MAX_STOP_LEN} characters."
    )
    stop_token_ids: list[int] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS (vLLM extension).")
    min_tokens: int = Field(
        0, ge=0, description="EOS and stop_token_ids are masked until this many tokens (vLLM)."
    )
    logit_bias: dict[str, FiniteFloat] | None = Field(
        None,
        description=f"Token id (as a string) -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
        "added to its logit.",
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS
            },
        },
    )
    use_beam_search: bool = Field(
        False, description="Beam search of best_of beams, returning the n best (vLLM extension)."
    )
    best_of: int | None = Field(
        None, ge=1, description="Beam width with use_beam_search; else null or n."
    )
    length_penalty: FiniteFloat = Field(
        1.0, description="Beam search: scores are divided by length ** length_penalty."
    )
    early_stopping: bool | str = Field(
        False, description='Beam search: true, false or "never", as in transformers.'
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormatParam | None = Field(
        None, description="text, json_object, or json_schema (enforced by a grammar)."
    )
    # vLLM's extra sampling parameters
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string / token's text.")
    skip_special_tokens: bool = Field(True, description="false: special tokens' text is in the output.")
    spaces_between_special_tokens: bool = Field(
        True, description="Accepted; special tokens join the text as the fast tokenizer decodes "
        "them (as vLLM with tokenizer.json)."
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep N of the prompt's tokens (see truncation_side); -1: as many "
        "as fit beside max_tokens (vLLM)."
    )
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="Only these may be sampled.")
    bad_words: list[str] | None = Field(None, description="Words that are never generated.")
    prompt_logprobs: int | None = Field(
        None, ge=-1, description="Logprobs of each prompt token and its N alternatives (not with stream)."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Output matches this JSON schema.")
    guided_regex: str | None = Field(None, description="Output matches this regular expression.")
    guided_choice: list[str] | None = Field(None, min_length=1, description="Output is one of these.")
    guided_grammar: str | None = Field(None, description="Output matches this Lark or GBNF grammar.")
    structured_outputs: StructuredOutputsRequest | None = None
    request_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
        description="The response id's suffix (default: random).",
    )
    priority: int = Field(0, description="With --scheduling-policy priority: lower runs earlier "
                          "(ties by arrival), and may preempt running requests of a higher value; "
                          "under fcfs (the default) only 0 (vLLM).")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Logprob tokens as 'token_id:N' strings."
    )
    return_token_ids: bool | None = Field(
        None, description="Each choice's token_ids (and prompt_token_ids; when streaming, in "
        "a choice's first chunk) beside the text (vLLM)."
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="With truncate_prompt_tokens: left (default) keeps the prompt's last "
        "N tokens, right its first N (vLLM)."
    )
    thinking_token_budget: int | None = Field(
        None, ge=-1, description="Not supported: only null or -1 (unlimited), as vLLM without "
        "a reasoning config."
    )
    watermarking: bool | None = Field(None, description="Not supported: only null or false.")
    # Accepted and ignored: see IGNORED_FIELDS for why.
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    session_id: str | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool | None = None
    stream_interval: int | None = Field(None, ge=1)
    repetition_detection: RepetitionDetection | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in REFUSED_FIELDS.items():
                if data.get(name) not in (None, "", [], {}):
                    raise ValueError(f"{name}: {reason}")
            if data.get("thinking_token_budget") not in (None, -1):
                raise ValueError(
                    "thinking_token_budget: not supported: reasoning runs unbudgeted (vLLM too "
                    "needs a reasoning config for it); send null or -1"
                )
            if data.get("watermarking") not in (None, False):
                raise ValueError("watermarking: not supported: no watermark; send null or false")
            data = {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
            if data.get("seed") == -1:  # vLLM: -1 is "no seed"
                data["seed"] = None
        return data

    @model_validator(mode="after")
    def _check_constraints(self) -> _SamplingFields:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: one output constraint per request; {given[0]} is set too")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as vLLM)")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: 0 would leave an empty prompt; send at least "
                             "1, or -1 for as many as fit")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise ValueError(
                    f"each stop string must have 1..{MAX_STOP_LEN} characters, got {len(s)}"
                )
        return v

    @field_validator("early_stopping")
    @classmethod
    def _check_early_stopping(cls, v: bool | str) -> bool | str:
        if not isinstance(v, bool) and v != "never":
            raise ValueError(f'must be true, false or "never", got {v!r}')
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit() too
                raise ValueError(f"keys must be token ids (digit strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias}"
                )
        return v

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        # vLLM refuses a non-empty stream_options without streaming ({} passes)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _check_beam_search(self) -> _SamplingFields:
        if self.use_beam_search and self.stream:
            raise ValueError(
                "use_beam_search: beam search returns whole beams only; send stream=false"
            )
        if self.use_beam_search:
            if self.best_of is not None and self.best_of < self.n:
                raise ValueError(
                    f"best_of: the beam width must be >= n, got best_of {self.best_of} with n {self.n}"
                )
        elif self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of: must equal n or be omitted, got best_of {self.best_of} with n "
                f"{self.n} (picking the best of extra samples needs use_beam_search=true)"
            )
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """``continuous_usage_stats``, which counts only with ``include_usage`` (vLLM's rule)."""
        return self.include_usage() and bool(self.stream_options and
                                             self.stream_options.continuous_usage_stats)


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: PromptType = Field(
        description=f"Text, token ids, or a list of up to {MAX_PROMPTS} of either."
    )
    max_tokens: int | None = Field(
        16, ge=0, description="Tokens to generate (default 16); 0 only with echo."
    )
    logprobs: int | None = Field(
        None,
        ge=-1,
        description="Each token's log-probability and the N most likely alternatives "
        f"(0 = the token's only; at most the server's --max-logprobs, default {MAX_LOGPROBS}; "
        "-1 = the whole vocabulary when the server runs with --max-logprobs -1).",
    )
    echo: bool = Field(
        False, description="Return the prompt before the completion (with logprobs: its logprobs)."
    )
    suffix: str | None = Field(None, description="Not supported: must be null.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: PromptType) -> PromptType:
        prompts = normalize_prompt(v)
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for p in prompts:
            if len(p) == 0:
                raise ValueError("must not be empty")
            if isinstance(p, list) and min(p) < 0:
                raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo=true (to score the prompt)")
        if self.suffix:
            raise ValueError("suffix: not supported; send no suffix")
        return self


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where the first string of a request holding a lone UTF-16 surrogate
    is (``"messages[0].content"``), else ``None``. JSON's ``"\\ud800"``
    escape parses to one, but it is not text: no tokenizer can take it."""
    if isinstance(value, str):
        return None if value.isascii() or _encodable(value) else path or "body"
    if isinstance(value, BaseModel):
        fields = type(value).model_fields.items()
        items: Any = ((f.alias or k, getattr(value, k)) for k, f in fields)
        value = dict(items)
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _encodable(key):
                return path or "body"
            if (found := lone_surrogate_path(item, inner)) is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, int | float) or item is None:
                continue  # token ids: a 2k-token prompt paid ~3 ms for paths built per id
            if (found := lone_surrogate_path(item, f"{path}[{i}]")) is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalize_prompt(v: PromptType) -> list[str | list[int]]:
    """The list of prompts in a completion request (each text or token ids)."""
    if isinstance(v, str):
        return [v]
    if not v:
        return [[]]  # an empty list is an empty prompt, reported by the validator
    if all(isinstance(x, int) for x in v):
        return [list(v)]  # type: ignore[arg-type]
    return list(v)  # type: ignore[arg-type]


class TextContentPart(_Strict):
    type: Literal["text"] = Field(description="Only text content parts are supported.")
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str = Field(description="JSON text, as the API returned it.")


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (sent back in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description="Default: the rest of the context (max_model_len - prompt)."
    )
    max_completion_tokens: int | None = Field(None, ge=1, description="Same as max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None,
        ge=-1,
        description="Most likely alternatives per token (needs logprobs: true; at most the "
        f"server's --max-logprobs, default {MAX_LOGPROBS}; -1 = all with --max-logprobs -1).",
    )
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool = True
    # vLLM's chat extras
    echo: bool = Field(False, description="Start the reply with the last message when it has the reply's role.")
    continue_final_message: bool = Field(
        False, description="Continue the last message (needs add_generation_prompt false)."
    )
    add_special_tokens: bool = Field(False, description="Add special tokens on top of the template's.")
    documents: list[dict[str, str]] | None = Field(None, description="For RAG chat templates.")
    chat_template: str | None = Field(None, description="A Jinja chat template for this request.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra template variables (e.g. enable_thinking)."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Passed to the chat template (with enable_thinking, as vLLM, unless "
        "chat_template_kwargs sets it)."
    )
    return_prompt_text: bool | None = Field(
        None, description="The rendered prompt as prompt_text (streaming: in the first chunk)."
    )
    include_reasoning: bool = Field(True, description="false: drop reasoning_content.")

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt; "
                "set add_generation_prompt to false"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice: function '{choice.function.name}' is not among tools ({names or 'none given'})"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a forced tool_choice")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        None, description="The stop string or stop_token_ids id that ended the choice (vLLM); "
        "null for EOS, max_tokens and the rest."
    )
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatLogprobToken(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = Field("assistant", description="assistant, or the server's --response-role")
    content: str | None
    reasoning_content: str | None = Field(
        None, description="The model's thought, with --reasoning-parser (else absent)."
    )
    tool_calls: list[MessageToolCall] = []


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        None, description="The stop string or stop_token_ids id that ended the choice (vLLM)."
    )
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_text: str | None = Field(None, description="With return_prompt_text.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "paged"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
