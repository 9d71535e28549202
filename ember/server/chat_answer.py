"""A chat answer's text split into reasoning, content and tool calls, whole or delta by delta.

The reasoning parser (if any) runs first; the tool-call handling sees only what follows the think
block. Tool calls come from one of three places:

* `tool_choice: "auto"`: the `--tool-call-parser` format, read from the text (`ToolCallStream`);
* `tool_choice: "required"`: the answer is forced by a grammar to be a JSON list of
  `{"name": ..., "parameters": {...}}` matching the tools' schemas;
* a named function: the answer is forced to be that function's arguments, streamed as argument
  fragments right after a first delta with the call's id and name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ember.sampling.structured import StructuredOutputsParams
from ember.server.reasoning import ReasoningFormat, ReasoningParser
from ember.server.tool_parsers import ToolCall, ToolCallDelta, ToolCallStream, ToolFormat


@dataclass
class ToolMode:
    """How this request's answer carries tool calls: `auto` (a text format), `required`, `named`."""

    kind: str
    fmt: ToolFormat | None = None  # auto
    function: str | None = None  # named


def tool_constraint(tools: list[dict[str, Any]], mode: ToolMode, parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that enforces `required` or a named function (None for `auto`): arguments that
    validate against the tools' parameter schemas, even from a small model."""
    schemas = {t["name"]: t.get("parameters") or {"type": "object"} for t in tools}
    if mode.kind == "named":
        return StructuredOutputsParams(json=schemas[mode.function])
    if mode.kind != "required":
        return None
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


@dataclass
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: AnswerDelta) -> AnswerDelta:
        return AnswerDelta(
            self.reasoning + other.reasoning, self.content + other.content, self.tool_calls + other.tool_calls
        )


class AnswerParser:
    def __init__(self, reasoning: ReasoningFormat | None, tools: ToolMode | None) -> None:
        self._reasoning = ReasoningParser(reasoning) if reasoning else None
        self._mode = tools
        self._stream: ToolCallStream | None = None
        if tools is not None and tools.kind == "auto":
            assert tools.fmt is not None  # an auto mode always names its text format
            self._stream = ToolCallStream(tools.fmt)
        self._forced = ""  # the answer of a required / named call, after the reasoning
        self._named_call: ToolCall | None = None
        self._required: list[ToolCall] = []  # read when the answer ends

    @property
    def thought(self) -> bool:
        return self._reasoning is not None and self._reasoning.thought

    @property
    def calls(self) -> list[ToolCall]:
        if self._stream is not None:
            return self._stream.calls
        return [self._named_call] if self._named_call is not None else self._required

    def feed(self, text: str) -> AnswerDelta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return AnswerDelta(reasoning) + self._answer(content, final=False)

    def finish(self) -> AnswerDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return AnswerDelta(reasoning) + self._answer(content, final=True)

    def _answer(self, content: str, final: bool) -> AnswerDelta:
        mode = self._mode.kind if self._mode else None
        if mode is None:
            return AnswerDelta(content=content)
        if self._stream is not None:
            text, deltas = self._stream.feed(content) if content else ("", [])
            if final:
                more, more_deltas = self._stream.finish()
                text, deltas = text + more, deltas + more_deltas
            return AnswerDelta(content=text, tool_calls=deltas)
        self._forced += content
        if mode == "named":
            assert self._mode is not None and self._mode.function is not None  # a named mode names its function
            deltas = []
            if self._named_call is None and (content or final):
                self._named_call = ToolCall(self._mode.function, "")
                deltas.append(ToolCallDelta(0, id=self._named_call.id, name=self._named_call.name, arguments=""))
            if content:
                assert self._named_call is not None  # set above, on this call or an earlier one
                self._named_call.arguments += content
                deltas.append(ToolCallDelta(0, arguments=content))
            return AnswerDelta(tool_calls=deltas)
        if not final:
            return AnswerDelta()
        self._required = _required_calls(self._forced)
        return AnswerDelta(
            tool_calls=[
                d
                for i, call in enumerate(self._required)
                for d in (
                    ToolCallDelta(i, id=call.id, name=call.name, arguments=""),
                    ToolCallDelta(i, arguments=call.arguments),
                )
            ]
        )


def _required_calls(answer: str) -> list[ToolCall]:
    """The calls of a `required` answer: its grammar makes it a JSON list of {name, parameters}."""
    try:
        items = json.loads(answer) if answer else []
    except json.JSONDecodeError:  # cut off by max_tokens
        return []
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
