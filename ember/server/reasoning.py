"""`--reasoning-parser`: split a chat answer's `<think>...</think>` part into `reasoning_content`.

One streaming state machine serves whole answers and streams alike: text arrives in deltas of any
size, and a tag split across tokens or chunks is held back until it is complete (or proven not to
be a tag), so neither field ever shows part of a tag.

* `qwen3`: the answer is content unless it opens with `<think>` (Qwen3 writes the tag itself;
  with `enable_thinking: false` it does not think at all).
* `deepseek_r1`: the template opens the think block in the prompt, so the answer is reasoning
  until `</think>` (a leading `<think>` the model repeats is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    starts_inside: bool  # the answer begins inside the think block


REASONING_PARSERS = {"qwen3": ReasoningFormat(starts_inside=False), "deepseek_r1": ReasoningFormat(starts_inside=True)}


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`: text to hold back, since
    the next delta may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed text deltas, get (reasoning, content) deltas; `finish` flushes what was held back."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._state = "opening"  # opening: the start may still be a <think>; then "thinking" or "answer"
        self._starts_inside = fmt.starts_inside
        self._buffer = ""
        self._after_end = False  # the newlines that follow </think> separate, they are not content
        self._after_think = False

    @property
    def thought(self) -> bool:
        """Whether the answer had a think block (so far)."""
        return self._state == "thinking" or (self._state == "answer" and self._after_think)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        reasoning = content = ""
        if self._state == "opening":
            stripped = self._buffer.lstrip()
            if stripped.startswith(START):
                self._buffer, self._state = stripped[len(START) :], "thinking"
            elif START.startswith(stripped):
                return "", ""  # may still become <think>
            else:
                self._state = "thinking" if self._starts_inside else "answer"
        if self._state == "thinking":
            end = self._buffer.find(END)
            if end < 0:
                cut = len(self._buffer) - partial_tag_length(self._buffer, END)
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(END) :], "answer"
            self._after_end = self._after_think = True
        content, self._buffer = self._buffer, ""
        if self._after_end:
            content = content.lstrip("\n")
            self._after_end = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back rest: a partial tag that never completed is text after all."""
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking" or (self._state == "opening" and self._starts_inside):
            return rest, ""
        return "", rest


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """A whole answer as (reasoning or None, content)."""
    parser = ReasoningParser(fmt)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning = r1 + r2
    return (reasoning if parser.thought or reasoning else None), c1 + c2
