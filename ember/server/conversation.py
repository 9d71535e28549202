"""The one request path below HTTP for every chat-shaped API: chat completions, Responses, Messages.

Each endpoint module reads its own wire format into a `ChatInput` (template-ready messages, function
tools, a tool choice, sampling parameters) and writes `ChoiceEvent`s or `ChoiceAnswer`s back out in
its own shape. Everything between is here, once: the tool mode and the grammar a required or named
tool call runs under, the chat template, the constraint check, the reasoning parser, the tool-call
parser, the engine run (generation.py) with its disconnect handling, logprobs and usage. So tools,
reasoning, structured output, the content filter, logprobs and metrics behave the same on all three.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

from PIL import Image
from pydantic import BaseModel

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import CompletionOutput, Logprob, RequestOutput
from ember.lora.request import LoRARequest
from ember.multimodal.media import ImageSource
from ember.multimodal.parts import IMAGE_PARTS, NO_VISION, load_images, split_images
from ember.sampling.params import SamplingParams
from ember.server.chat_answer import AnswerDelta, AnswerParser, ToolMode, tool_constraint
from ember.server.errors import APIError, bad_request, value_error
from ember.server.generation import Generation
from ember.server.plumbing import (
    check_constraint,
    clamp_logprob,
    logprobs_since,
    require_tokenizer,
    token_text,
    usage,
)
from ember.server.protocol import ChatTokenLogprob, TopLogprob, UsageInfo
from ember.server.reasoning import REASONING_PARSERS
from ember.server.state import ServerState
from ember.server.tool_parsers import TOOL_PARSERS, ToolCall, parser_for_template
from ember.tokenizer import Tokenizer

TOOL_CHOICES = ("auto", "required", "none", "named")


@dataclass
class ChatInput:
    """A chat-shaped request in the one form the engine path reads, whichever API it came from."""

    messages: list[dict[str, Any]]  # as chat templates read them (see protocol.template_messages)
    params: SamplingParams
    request_model: type[BaseModel]  # the API's request model: error messages name its fields
    tools: list[dict[str, Any]] | None = None  # function definitions: name, description, parameters
    tool_choice: str = "auto"  # one of TOOL_CHOICES
    tool_name: str | None = None  # the function a "named" choice forces
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    top_logprobs: int = 0
    tool_choice_field: str = "tool_choice"  # the request field errors about the tool choice name
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names
    # The request field errors about images name: None when `messages` are the request's own, in order
    # (chat completions: `messages[i].content`); the API's field otherwise (`messages`, `input`).
    messages_field: str | None = None


@dataclass
class ChoiceEvent:
    """One choice's news since its previous event: parsed text (reasoning, content, tool-call deltas), the
    tokens that produced it and their logprobs. The last event of a choice has its finish reason set."""

    index: int
    delta: AnswerDelta
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # None unless the request asked for logprobs
    finish_reason: str | None = None  # "tool_calls" when a finished answer called tools
    stop_reason: int | str | None = None

    @property
    def has_text(self) -> bool:
        d = self.delta
        return bool(d.content or d.reasoning or d.tool_calls)


@dataclass
class ChoiceAnswer:
    """A finished choice, whole."""

    index: int
    reasoning: str | None  # None when the answer had no think block
    content: str | None  # None when the answer is only tool calls
    calls: list[ToolCall]
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


async def start_chat(state: ServerState, engine: AsyncLLM, chat: ChatInput, request_id: str) -> ChatRun:
    """Validate, template and submit: every 4xx a chat request can earn before the engine runs."""
    tokenizer = require_tokenizer(engine)
    params = chat.params
    mode = _tool_mode(chat, state, tokenizer)
    if mode is not None and mode.kind != "auto":
        if params.structured_outputs is not None:
            raise bad_request(
                f"{chat.tool_choice_field}: a required or named tool cannot be combined with a response format",
                chat.tool_choice_field,
            )
        assert chat.tools is not None  # a tool mode implies tools (_tool_mode)
        params.structured_outputs = tool_constraint(chat.tools, mode, chat.parallel_tool_calls)
        assert params.structured_outputs is not None  # required and named modes always constrain
        await check_constraint(engine, params.structured_outputs, "tools", chat.request_model)
    messages, images = await _load_images(engine, chat)
    prompt = await _render(chat, tokenizer, messages)
    if images:
        prompt["multi_modal_data"] = {"image": images}
    if state.settings.reasoning_parser and params.structured_outputs is not None and _will_think(prompt["prompt"]):
        params.structured_outputs = replace(params.structured_outputs, after_think=True)
    return ChatRun(state, engine, chat, request_id, prompt, mode, tokenizer)


async def count_prompt_tokens(state: ServerState, engine: AsyncLLM, chat: ChatInput) -> int:
    """The tokens `chat` would send to the model (Anthropic's count_tokens), tools included; the same
    400s as running it for a tool choice it could not run."""
    tokenizer = require_tokenizer(engine)
    _tool_mode(chat, state, tokenizer)
    messages, images = await _load_images(engine, chat)  # loaded: a Qwen2.5-VL image's tokens follow its size
    ids = (await _render(chat, tokenizer, messages))["prompt_token_ids"]
    if images:  # each placeholder becomes the image's tokens
        assert engine.processor.images is not None  # _split_images refused images to a text-only model
        ids = engine.processor.images.expand_ids(ids, images, tokenizer)
    return len(ids)


def _split_images(engine: AsyncLLM, chat: ChatInput) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The messages with `{"type": "image"}` placeholders, and the images' sources; 400s for a malformed
    image part, for images to a text-only model and for more images than a prompt may carry."""
    try:
        messages, sources = split_images(chat.messages)
        if sources and engine.processor.images is None:
            raise ValueError(NO_VISION)
        if sources:
            engine.processor.media.check_count(len(sources))
    except ValueError as e:
        raise _image_error(chat, e) from None
    return messages, sources


async def _load_images(engine: AsyncLLM, chat: ChatInput) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """`_split_images`, then the images loaded and decoded in a worker thread (a large one takes tens of
    milliseconds, a fetch up to its timeout: the event loop keeps serving other requests meanwhile)."""
    messages, sources = _split_images(engine, chat)
    if not sources:
        return messages, []
    try:
        return messages, await asyncio.to_thread(load_images, engine.processor.media, sources)
    except ValueError as e:
        raise _image_error(chat, e) from None


def _image_error(chat: ChatInput, e: ValueError) -> APIError:
    param = chat.messages_field
    if param is None:
        first = next((i for i, m in enumerate(chat.messages) if _has_image(m)), None)
        param = "messages" if first is None else f"messages[{first}].content"
    return bad_request(f"{param}: {e}", param)


def _has_image(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content)


async def _render(chat: ChatInput, tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    variables = dict(chat.template_kwargs)
    if chat.tools is not None and chat.tool_choice != "none":
        variables["tools"] = [{"type": "function", "function": t} for t in chat.tools]
    return await asyncio.to_thread(render_chat, tokenizer, messages, True, False, variables, chat.request_model)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    variables: dict[str, Any] | None,
    request_model: type[BaseModel],
) -> dict[str, Any]:
    """Template and tokenize off the event loop: a long conversation takes milliseconds. `variables`
    (tools, chat_template_kwargs) reach the template beside its standard ones."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, variables=variables)
    except ValueError as e:  # a bad role or content part, or the template itself refused
        error = value_error(e, request_model)
        error.info.param = error.info.param or "messages"
        raise error from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


def _will_think(prompt: str) -> bool:
    """Whether the answer starts with reasoning: unless the template closed the think block itself
    (Qwen3 with enable_thinking false writes an empty one), constraints hold after `</think>`."""
    return not prompt.rstrip().endswith("</think>")


def _tool_mode(chat: ChatInput, state: ServerState, tokenizer: Tokenizer) -> ToolMode | None:
    """How the answer carries tool calls; None when the request has no tools or its choice is none."""
    if not chat.tools or chat.tool_choice == "none":
        return None
    if chat.tool_choice == "required":
        return ToolMode("required")
    if chat.tool_choice == "named":
        names = [t["name"] for t in chat.tools]
        if chat.tool_name not in names:
            raise bad_request(
                f"{chat.tool_choice_field}: function {chat.tool_name!r} is not among the tools {names}",
                chat.tool_choice_field,
            )
        return ToolMode("named", function=chat.tool_name)
    parser = state.settings.tool_call_parser or parser_for_template(tokenizer.chat_template)
    if parser is None:
        raise bad_request(
            f"{chat.tool_choice_field}: 'auto' needs to know how this model writes tool calls, and its chat "
            "template does not say; start the server with --tool-call-parser, or require a tool or name one",
            chat.tool_choice_field,
        )
    return ToolMode("auto", fmt=TOOL_PARSERS[parser])


class ChatRun:
    """One chat request's engine run, and its outputs parsed into reasoning, content and tool calls."""

    def __init__(
        self,
        state: ServerState,
        engine: AsyncLLM,
        chat: ChatInput,
        request_id: str,
        prompt: dict[str, Any],
        tools: ToolMode | None,
        tokenizer: Tokenizer,
    ) -> None:
        self.params = chat.params
        self.top_logprobs = chat.top_logprobs
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt_tokens = len(prompt["prompt_token_ids"])
        self.gen = Generation(state, engine, request_id, [prompt], chat.params, chat.request_model, chat.lora_request)
        n = chat.params.n
        self._sent_tokens = [0] * n  # per choice, the tokens already reported
        self._done: set[int] = set()
        reasoning = state.settings.reasoning_parser
        fmt = REASONING_PARSERS[reasoning] if reasoning else None
        # Without a parser the text is all content, and every step's tokens are news (a progress event).
        self.parses = bool(fmt or tools)
        self._answers = [AnswerParser(fmt, tools) for _ in range(n)] if self.parses else None

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Per choice: an event for each output with new text or new tokens, then (text held back
        until the end flushed as its own event) a last one with the finish reason."""
        async for _, out in self.gen.outputs():
            for o in out.outputs:
                for event in self._choice_events(o):
                    yield event

    def _choice_events(self, o: CompletionOutput) -> list[ChoiceEvent]:
        if o.index in self._done:
            return []
        events = []
        if o.delta_text or (o.finish_reason is None and len(o.token_ids) > self._sent_tokens[o.index]):
            ids, lps = self._unsent(o)
            events.append(ChoiceEvent(o.index, self._feed(o.index, o.delta_text), ids, lps))
        if o.finish_reason is not None:
            self._done.add(o.index)
            tail = self._finish_text(o.index)
            if tail.content or tail.reasoning or tail.tool_calls:
                events.append(ChoiceEvent(o.index, tail, [], None))
            ids, lps = self._unsent(o)
            events.append(ChoiceEvent(o.index, AnswerDelta(), ids, lps, self._finish_reason(o), o.stop_reason))
        return events

    def _feed(self, index: int, text: str) -> AnswerDelta:
        return self._answers[index].feed(text) if self._answers is not None else AnswerDelta(content=text)

    def _finish_text(self, index: int) -> AnswerDelta:
        return self._answers[index].finish() if self._answers is not None else AnswerDelta()

    def _unsent(self, o: CompletionOutput) -> tuple[list[int], list[dict[int, Logprob]] | None]:
        start = self._sent_tokens[o.index]
        self._sent_tokens[o.index] = len(o.token_ids)
        return o.token_ids[start:], logprobs_since(o, start)

    def _finish_reason(self, o: CompletionOutput) -> str | None:
        """`tool_calls` when a finished answer called tools, as OpenAI reports it."""
        if self._answers is not None and self._answers[o.index].calls and o.finish_reason == "stop":
            return "tool_calls"
        return o.finish_reason

    def answers(self, finals: list[RequestOutput]) -> list[ChoiceAnswer]:
        """The finished choices, whole (the run was not streamed)."""
        return [self._answer(o) for o in finals[0].outputs]

    def _answer(self, o: CompletionOutput) -> ChoiceAnswer:
        if self._answers is None:
            return ChoiceAnswer(o.index, None, o.text, [], o.finish_reason, o.stop_reason, o.token_ids, o.logprobs)
        parser = self._answers[o.index]
        d = parser.feed(o.text) + parser.finish()
        calls = parser.calls
        return ChoiceAnswer(
            o.index,
            d.reasoning if parser.thought or d.reasoning else None,
            d.content if d.content or not calls else None,
            calls,
            self._finish_reason(o),
            o.stop_reason,
            o.token_ids,
            o.logprobs,
        )

    def usage(self) -> UsageInfo:
        """Token counts once the run has ended."""
        return usage(cast(list[RequestOutput], self.gen.final))

    def token_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]] | None) -> list[ChatTokenLogprob]:
        """Each token's logprob and its top `top_logprobs` alternatives, in OpenAI's chat shape (which the
        Responses API shares)."""
        if lps is None:
            return []
        out = []
        for tid, entries in zip(token_ids, lps):
            top = sorted((e for e in entries.items() if e[1].rank <= self.top_logprobs), key=lambda e: e[1].rank)
            out.append(
                ChatTokenLogprob(
                    **self._top_logprob(tid, entries[tid]).model_dump(),
                    top_logprobs=[self._top_logprob(t, lp) for t, lp in top],
                )
            )
        return out

    def _top_logprob(self, token_id: int, lp: Logprob) -> TopLogprob:
        text = token_text(token_id, lp, self.tokenizer)
        return TopLogprob(
            token=text, logprob=clamp_logprob(lp.logprob), bytes=list(self.tokenizer.token_bytes(token_id))
        )
