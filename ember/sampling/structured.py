"""Structured output requests (vLLM's `StructuredOutputsParams`) and their llguidance grammars.

The parameters are plain data, so they travel to the engine core inside `SamplingParams`; the core
turns them into a grammar with `grammar_source` and compiles it once per distinct source. The front
end checks a grammar with `check_grammar` before a request is sent (llguidance validates without a
tokenizer), so a bad schema, regex or grammar is a 400 / ValueError naming the field and never
reaches the core. No torch here: the front end imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

# Compact JSON (no free whitespace between tokens): a model cannot stall in an endless run of spaces
# or newlines, which small models do under `whitespace_flexible`, and outputs close in fewer tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# A think block first (any text, up to the first </think>, which the lazy match stops at), then the
# constraint. Whitespace between the two is free: models put newlines there.
_THINK_FIRST = 'start: think WS? @answer\nthink[lazy]: /(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]+/\n'


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema (`json`, a dict or its text), any JSON object
    (`json_object`), a regular expression, a list of choices, or a Lark / GBNF grammar.

    `after_think` (Ember's): the constraint holds after a leading `<think>...</think>` block, which
    is free text; the server sets it for reasoning models (`--reasoning-parser`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    after_think: bool = False

    def __post_init__(self) -> None:
        set_fields = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_fields or 'none'}")
        kind = set_fields[0]
        value = getattr(self, kind)
        expected = {"json": (str, dict), "regex": str, "choice": list, "grammar": str, "json_object": bool}[kind]
        if not isinstance(value, expected):
            raise ValueError(f"structured_outputs.{kind}: wrong type {type(value).__name__}")
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for these parameters; a ValueError for a schema that is
    not a JSON object."""
    source = _constraint_source(params)
    if not params.after_think:
        return source
    # llguidance's sources are its JSON form, or Lark text as such (grammar_from_lark returns its input)
    grammars = json.loads(source)["grammars"] if source.lstrip().startswith("{") else [{"lark_grammar": source}]
    grammars[0]["name"] = "answer"
    return json.dumps({"grammars": [{"name": "think_first", "lark_grammar": _THINK_FIRST}, *grammars]})


def _constraint_source(params: StructuredOutputsParams) -> str:
    kind = params.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice))
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def check_grammar(params: StructuredOutputsParams, field: str | None = None) -> None:
    """A ValueError starting with `field` (default `structured_outputs.<kind>`) and llguidance's reason
    when the constraint cannot be compiled. Validated sources are remembered, so a schema sent again
    costs nothing."""
    field = field or f"structured_outputs.{params.kind}"
    try:
        source = grammar_source(params)
    except ValueError as e:
        raise ValueError(f"{field}: {str(e).split(': ', 1)[-1]}") from None
    problem = _validate(source)
    if problem:
        raise ValueError(f"{field}: {problem.strip()}")


@lru_cache(maxsize=1024)
def _validate(source: str) -> str:
    return llguidance.LLMatcher.validate_grammar(source)
