"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request: a JSON schema (``json``), any JSON
object (``json_object``), a regular expression (``regex``), one of a list of
strings (``choice``), or a grammar in llguidance's Lark dialect (``grammar``;
the tool-call formats use it; a GBNF grammar, as vLLM's xgrammar takes, is
converted). The engine turns it into a
token mask applied before sampling (``engine/sample/grammar_mask.py``), so the
output matches even when the model would rather say something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One output constraint; ``json`` is a schema dict or its JSON text."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None

    def validate(self) -> None:
        """Raise ``ValueError("structured_outputs: ...")`` unless exactly one is set."""
        given = [name for name, on in (("json", self.json is not None),
                                       ("json_object", self.json_object),
                                       ("grammar", self.grammar is not None),
                                       ("regex", self.regex is not None),
                                       ("choice", self.choice is not None)) if on]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, grammar, regex, "
                f"choice; got {given or 'none'}"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs: regex must be a string")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(f"structured_outputs: json must be a schema object, got {self.json!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs: grammar must be a string")
