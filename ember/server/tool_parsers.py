"""`--tool-call-parser`: find the tool calls in a chat answer, whole or streamed.

Each format says where calls start (`marker`) and how to read the calls in the text from there:

* `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated.
* `llama3_json` (Llama 3.1+): `{"name": ..., "parameters": {...}}` as the whole answer (optionally after
  `<|python_tag|>`), several separated by `;`.
* `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call (v11 templates).
* `pythonic` (Llama 3.2/4, ToolACE): `[get_weather(city="Paris"), f(x=1)]` as the whole answer, read
  with Python's own parser, never evaluated.

`ToolCallStream` turns text deltas into content deltas and tool-call deltas in OpenAI's shape: text
before the marker streams as content (a marker split across chunks is held back), each call is sent
as soon as it is complete: its id and name first, then its arguments.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ember.server.reasoning import partial_tag_length


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> tuple[list[Any], str]:
    """The complete JSON values in `text` (separated by whitespace, `,` or `;`) and the unread rest."""
    values: list[Any]
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append(value)


def _calls_from_objects(values: list[Any]) -> list[ToolCall] | None:
    """Objects with a name and arguments (or parameters) as calls; None if any value is not one."""
    calls = []
    for value in values:
        for obj in value if isinstance(value, list) else [value]:
            call = (
                _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
            )
            if call is None:
                return None
            calls.append(call)
    return calls


class ToolFormat:
    name = ""
    marker = ""
    at_start_only = False  # the marker counts only at the start of the answer (after whitespace)
    prefix = ""  # a tag that may come before an at-start marker, dropped

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        """The calls complete in `region` (which starts at the marker); with `final`, all of them, or
        None when the region does not read as tool calls."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name, marker = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        bodies = self._CALL.findall(region)
        tail = region[region.rfind("</tool_call>") + len("</tool_call>") :] if bodies else region
        if final and tail.strip().startswith(self.marker):  # the model stopped before closing its last call
            bodies.append(tail.strip()[len(self.marker) :])
        calls = []
        for body in bodies:
            values, rest = _json_values(body)
            parsed = _calls_from_objects(values) if len(values) == 1 and not rest.strip() else None
            if parsed is None:
                return None
            calls += parsed
        return calls if calls or not final else None


class Llama3JsonFormat(ToolFormat):
    name, marker, at_start_only, prefix = "llama3_json", "{", True, "<|python_tag|>"

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        values, rest = _json_values(region)
        if final and rest.strip():
            return None
        calls = _calls_from_objects(values)
        return calls if calls or not final else None


class MistralFormat(ToolFormat):
    name, marker = "mistral", "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z_][\w.-]*)\[ARGS\]")

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        body = region[len(self.marker) :]
        calls: list[ToolCall] = []
        for part in body.split(self.marker):  # v11: [TOOL_CALLS]name[ARGS]{...} per call
            named = self._NAMED.match(part)
            values, rest = _json_values(part[named.end() :] if named else part)
            if named:
                call = _call(named.group(1), values[0]) if values and isinstance(values[0], dict) else None
                parsed = [call] if call is not None else None
            else:
                parsed = _calls_from_objects(values)
            if parsed is None or (final and rest.strip()):
                return None if final else calls
            calls += parsed
        return calls if calls or not final else None


class PythonicFormat(ToolFormat):
    name, marker, at_start_only = "pythonic", "[", True

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        if not final:
            return []  # a list of calls reads only when it is whole
        try:
            tree = ast.parse(region.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls: list[ToolCall] = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            call = _call(node.func.id, args)
            if call is None:
                return None
            calls.append(call)
        return calls


TOOL_PARSERS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), PythonicFormat())
}


def parser_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, when the flag does not say."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template or "[func_name(" in template:
        return "pythonic"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallStream:
    """Text deltas in; (content delta, tool-call deltas) out. `calls` holds every call sent so far."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._seen = ""  # all text so far, for at-start markers
        self._region: str | None = None  # the text from the marker on, once found
        self._pending = ""  # content held back: it may be the start of the marker

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._region is not None:
            self._region += delta
            return "", self._new_calls(self.fmt.calls(self._region, final=False) or [])
        text = self._pending + delta
        self._seen += delta
        if self.fmt.at_start_only:
            stripped = self._seen.lstrip().removeprefix(self.fmt.prefix).lstrip()
            if not stripped:
                self._pending = text
                return "", []
            if stripped.startswith(self.fmt.marker):
                self._pending, self._region = "", stripped
                return "", self._new_calls(self.fmt.calls(stripped, final=False) or [])
            self._pending = ""
            return text, []
        at = text.find(self.fmt.marker)
        if at >= 0:
            self._pending, self._region = "", text[at:]
            return text[:at], self._new_calls(self.fmt.calls(self._region, final=False) or [])
        keep = partial_tag_length(text, self.fmt.marker)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest at the end of the answer: remaining calls, or the held text as content when what
        followed the marker does not read as tool calls."""
        pending, self._pending = self._pending, ""
        if self._region is None:
            return pending, []
        calls = self.fmt.calls(self._region, final=True)
        if calls is None:
            return ("" if self.calls else self._region), []
        return "", self._new_calls(calls)

    def _new_calls(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        deltas = []
        for call in calls[len(self.calls) :]:
            index = len(self.calls)
            self.calls.append(call)
            deltas += [
                ToolCallDelta(index, id=call.id, name=call.name, arguments=""),
                ToolCallDelta(index, arguments=call.arguments),
            ]
        return deltas


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer as (content, calls)."""
    stream = ToolCallStream(fmt)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    return content + rest, stream.calls
