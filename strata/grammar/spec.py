"""`GrammarSpec`: what a request asks its output to match, as it crosses from frontend to engine.

The spec is data (a msgspec Struct inside `SamplingParams`); `grammar_text` turns it into the
llguidance grammar string that is compiled, which is also the key of the compile cache, so two
requests with the same schema share one compiled grammar.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
MAX_GRAMMAR_CHARS = 1_000_000  # larger schemas / grammars are refused before compiling
# JSON is generated compact, as `json.dumps` writes it ({"a": 1, "b": [2, 3]}): no free whitespace, which
# a weak model would otherwise fill until max_tokens. A schema's own "x-guidance" overrides this.
JSON_FORMAT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A constraint on the output text.

    kind: json_schema (source = the schema as JSON text), json_object (any JSON object; source
    ignored), regex (source = a regular expression the whole output must match), lark (source = a
    Lark grammar in llguidance's dialect, which also takes `%json {schema}` rules).
    start_after: token ids; the grammar is armed only once the output ends with them (reasoning
    models: the `</think>` tokens), and text before that is free. Empty: armed from the start.
    """

    kind: GrammarKind
    source: str = ""
    start_after: list[int] = msgspec.field(default_factory=list)

    def validate_shape(self) -> None:
        """Raise ValueError for a spec that cannot be a grammar at all (before any compiling)."""
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"the {self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}"
            )
        if self.kind in ("regex", "lark") and not self.source:
            raise ValueError(f"the {self.kind} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    "the JSON schema must be a JSON object (or true/false)"
                )

    def grammar_text(self) -> str:
        """The llguidance grammar this spec compiles to (deterministic: the compile cache key)."""
        from llguidance import LLMatcher  # the Rust extension; no torch

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_FORMAT
            )
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_FORMAT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


def json_schema_spec(
    schema: dict | bool, start_after: list[int] | None = None
) -> GrammarSpec:
    """A json_schema spec from a parsed schema, serialised compactly. Key order is kept: the grammar
    writes an object's properties in the order its schema lists them."""
    text = json.dumps(schema, separators=(",", ":"))
    return GrammarSpec(
        kind="json_schema", source=text, start_after=list(start_after or [])
    )
