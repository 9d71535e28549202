"""Structured output requests (vLLM's `StructuredOutputsParams`) and their llguidance grammars.

The parameters are plain data, so they travel to the engine core inside `SamplingParams`; the core
turns them into a grammar with `grammar_source` and compiles it once per distinct source. The front
end checks a grammar before a request is sent, so a bad schema, regex or grammar is a 400 /
ValueError naming the field and never reaches the core: `check_grammar` validates its syntax
(llguidance needs no vocabulary for that), and `GrammarCheck` compiles it against the model's
vocabulary and computes its first mask under llguidance's limits, which is where a grammar too big
for them shows (`a{1000000}` builds more lexer expressions than llguidance allows). No torch here:
the front end imports it.

llguidance itself is imported with the first grammar (each function imports it): 2.4 MiB of resident
memory and 20-40 ms of start-up per process otherwise (2026-12-05), which a server that gets no
structured-output request never needs, in either of its processes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from ember.tokenizer import Tokenizer

# Compact JSON (no free whitespace between tokens): a model cannot stall in an endless run of spaces
# or newlines, which small models do under `whitespace_flexible`, and outputs close in fewer tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# How the engine's error for a request whose grammar could not go on begins (a dead end, or a lexer
# limit hit mid-answer): the request's own constraint failed, which the server answers with a 400.
GRAMMAR_FAILED = "structured output failed"

# A think block first (any text, up to the first </think>, which the lazy match stops at), then the
# constraint. Whitespace between the two is free: models put newlines there.
_THINK_FIRST = "start: think WS? @answer\nthink[lazy]: /(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]+/\n"


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
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
                f"got {set_fields or 'none'}"
            )
        kind = set_fields[0]
        value = getattr(self, kind)
        types: dict[str, type | tuple[type, ...]] = {
            "json": (str, dict),
            "regex": str,
            "choice": list,
            "grammar": str,
            "json_object": bool,
        }
        expected = types[kind]
        if not isinstance(value, expected):
            raise ValueError(f"structured_outputs.{kind}: wrong type {type(value).__name__}")
        if kind == "choice" and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
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
    import llguidance

    kind = params.kind
    try:
        if kind == "json":
            assert params.json is not None  # kind names the one field that is set
            return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            assert params.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        assert params.grammar is not None
        from llguidance.gbnf_to_lark import any_to_lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises a bare Exception ("No 'root' rule found")
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def check_grammar(params: StructuredOutputsParams, field: str | None = None) -> str:
    """The constraint's llguidance source, validated; a ValueError starting with `field` (default
    `structured_outputs.<kind>`) and llguidance's reason when it cannot be compiled. Validated sources
    are remembered, so a schema sent again costs nothing."""
    field = field or f"structured_outputs.{params.kind}"
    try:
        source = grammar_source(params)
    except ValueError as e:
        raise ValueError(f"{field}: {str(e).split(': ', 1)[-1]}") from None
    problem = _validate(source)
    if problem:
        raise ValueError(f"{field}: {problem.strip()}")
    return source


@lru_cache(maxsize=1024)
def _validate(source: str) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(source)


def ll_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: the tokenizer's tokens over `vocab_size` logits."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_ids)


@lru_cache(maxsize=1)
def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with short error messages (verbose ones quote the whole grammar and
    the parser's state): the front end's check and the engine core's matchers compile under these."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def new_matcher(vocabulary: llguidance.LLTokenizer, source: str) -> llguidance.LLMatcher:
    """A matcher of `source` over `vocabulary`, under `parser_limits()`; in error when it cannot compile."""
    import llguidance

    return llguidance.LLMatcher(vocabulary, source, log_level=0, limits=parser_limits())


_MAX_CHECKED = 1024  # distinct grammars whose check is remembered


class GrammarCheck:
    """The front end's last check of a constraint before its request is accepted: compile it against
    the model's vocabulary and compute its first mask, as the core will. The vocabulary is built on
    first use (0.27 s for the default model's 49k tokens), and each distinct grammar is checked once
    (about 1 ms for a JSON schema); any thread may call it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._problems: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, params: StructuredOutputsParams, field: str | None = None) -> None:
        """A ValueError starting with `field` (default `structured_outputs.<kind>`) when the constraint
        cannot be compiled or its first mask not computed."""
        source = check_grammar(params, field)
        with self._lock:
            problem = self._problems.get(source)
            if problem is None:
                problem = self._problems[source] = self._problem(source)
                if len(self._problems) > _MAX_CHECKED:
                    self._problems.popitem(last=False)
        if problem:
            raise ValueError(f"{field or f'structured_outputs.{params.kind}'}: {problem}")

    def _problem(self, source: str) -> str:
        """What goes wrong compiling `source`, computing its first mask, or its mask after one allowed
        token: llguidance builds a regex's lexer lazily, and `a{1000000}` passes the first two (in 0.3 s)
        and fails only there, where the engine would have failed the request."""
        if self._vocabulary is None:
            self._vocabulary = ll_vocabulary(self._tokenizer, self._vocab_size)
        matcher = new_matcher(self._vocabulary, source)
        if not matcher.is_error():
            token = _first_allowed(matcher.compute_bitmask(), set(self._tokenizer.eos_token_ids))
            if token is not None and matcher.consume_token(token):
                matcher.compute_bitmask()
        return matcher_error(matcher) if matcher.is_error() else ""


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error text without the marker llguidance puts where verbose details would be."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _first_allowed(mask: bytes, skip: set[int]) -> int | None:
    """The lowest token id set in llguidance's bitmask (little-endian 32-bit words) and not in `skip`."""
    for i, byte in enumerate(mask):
        for bit in range(8) if byte else ():
            token = i * 8 + bit
            if byte >> bit & 1 and token not in skip:
                return token
    return None
