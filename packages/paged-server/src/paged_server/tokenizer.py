"""The checkpoint's tokenizer: encode, decode, chat template, EOS ids.

Built on the ``tokenizers`` library (tokenizer.json) and jinja2 rather than
transformers' tokenizer classes: loading is fast, and what runs is exactly
the checkpoint's files. The chat template renders in a sandbox with the
helpers Hugging Face templates rely on (``raise_exception``, ``tojson``,
``strftime_now``), so templates written for transformers work unchanged.
The sandbox also refuses what would let one expression run away with the
process (``include``/``import``, a ``*`` or ``**`` with a huge result, an
output past ``MAX_RENDERED_CHARS``); bounding a render's time is the
caller's job (the server's ``chat_render.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from paged_server.errors import ModelFileNotFoundError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Longest text a chat template may render: far past any context window
# (a prompt that long is refused anyway), short of exhausting memory.
MAX_RENDERED_CHARS = 32 << 20
# Largest str/list/tuple a template's ``*`` may build, and the largest
# integer (in bits) its ``**`` may: one such expression otherwise allocates
# gigabytes or computes for minutes in a single step nothing can interrupt.
_MAX_PRODUCT_ITEMS = MAX_RENDERED_CHARS
_MAX_POWER_BITS = 1 << 16


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.hf = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template
        (chat_template.jinja, chat_template.json or tokenizer_config.json)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelFileNotFoundError(
                f"{file} not found: the model directory needs a fast-tokenizer tokenizer.json "
                "(save one with transformers: AutoTokenizer.from_pretrained(src).save_pretrained(dir))"
            )
        config = _read_json(path / "tokenizer_config.json")
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(
            HFTokenizer.from_file(str(file)),
            chat_template=_find_chat_template(path, config),
            special_tokens=special,
        )

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included."""
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` runs the checkpoint's
        post-processor (e.g. a BOS token in front)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Token ids of a sentence pair, joined as tokenizer.json's post-processor
        says (a cross-encoder's query and document)."""
        return list(self.hf.encode(text, pair).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, in one call (the library splits the work)."""
        encodings = self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``token_ids`` (invalid UTF-8 becomes U+FFFD)."""
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. ``"<|im_end|>"``), or None."""
        return self.hf.token_to_id(token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (skipped by ``decode`` by default)."""
        return frozenset(i for i, tok in self.hf.get_added_tokens_decoder().items() if tok.special)

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's ``eos_token``, if it names one."""
        eos = self.special_tokens.get("eos_token")
        return self.token_to_id(eos) if eos else None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_vars: Any,
    ) -> Any:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the
        checkpoint's chat template (or ``chat_template``); the prompt text, or
        its ids with ``tokenize=True`` (special tokens come from the template,
        none added). ``continue_final_message`` leaves the last message open
        (the text ends where its content ends), as transformers does, so the
        model continues it."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, variables=template_vars,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``, as ``apply_chat_template``; the
        template's variables come as one mapping, so a variable may have any
        name (``tokenize``, say) without clashing with an argument."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt; "
                "set add_generation_prompt to false"
            )
        if chat_template is not None:
            template = compile_chat_template(chat_template)
        elif self.chat_template is None:
            raise ValueError(
                "this model has no chat template (chat_template in tokenizer_config.json or "
                "chat_template.jinja); send a plain prompt to /v1/completions instead"
            )
        else:
            template = compile_chat_template(self.chat_template)
        # As transformers does: tools/documents are None (templates test
        # `is not none`), special token strings and caller variables visible.
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        context.update(variables or {})
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        text = _render(template, context)
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendered chat up to the end of the last message's content."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = "".join(p.get("text", "") for p in final if isinstance(p, Mapping))
    if not final or (end := text.rfind(final.strip())) < 0:
        raise ValueError(
            "continue_final_message: the final message's content is not in the rendered "
            "chat; send a final message with text content"
        )
    return text[: end + len(final.strip())]


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    with file.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _find_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in the sandbox (kept: the same few templates come
    back request after request); ``jinja2.TemplateSyntaxError`` if invalid."""
    return _jinja_env().from_string(source)


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """The template's text, refused once it passes ``MAX_RENDERED_CHARS``."""
    parts, size = [], 0
    for part in template.generate(**context):
        size += len(part)
        if size > MAX_RENDERED_CHARS:
            raise jinja2.exceptions.TemplateRuntimeError(
                f"the template's output passed {MAX_RENDERED_CHARS} characters, "
                "the most a chat template may render"
            )
        parts.append(part)
    return "".join(parts)


class _NoIncludes(jinja2.BaseLoader):
    """Chat templates are one file: ``include``, ``import`` and ``extends``
    would read the server's files (with no loader they raised a TypeError)."""

    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise jinja2.exceptions.TemplateNotFound(
            template,
            f"a chat template cannot include, import or extend another template ({template!r}); "
            "send it as one template",
        )


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, plus a bound on ``*`` and ``**`` results."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if (isinstance(seq, str | list | tuple) and isinstance(times, int)
                        and len(seq) * times > _MAX_PRODUCT_ITEMS):
                    raise jinja2.exceptions.SecurityError(
                        f"the chat template repeats a sequence of {len(seq)} items {times} "
                        f"times, past the limit of {_MAX_PRODUCT_ITEMS}"
                    )
        elif (isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
                and right * math.log2(abs(left)) > _MAX_POWER_BITS):
            raise jinja2.exceptions.SecurityError(
                f"the chat template raises {left} to the power {right}, an integer past "
                f"{_MAX_POWER_BITS} bits"
            )
        return super().call_binop(context, operator, left, right)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """A sandbox like transformers': chat templates from the Hub are untrusted code."""
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
        loader=_NoIncludes(),
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
