"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes a `ChatInput` and runs on the path the OpenAI chat endpoint uses (conversation.py);
this module writes the answer as Anthropic does: content blocks (`thinking`, `text`, `tool_use`), a
`stop_reason`, and, when streaming, `message_start`, then per block `content_block_start`, its deltas
and `content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`. Every
error on these routes, 401s included, is in Anthropic's shape (`{"type": "error", "error": {...}}`);
the key may come as `x-api-key` (Anthropic's header) or as a bearer token.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import RequestOutput
from ember.sampling.params import SamplingParams
from ember.server.anthropic_protocol import (
    AnthropicError,
    AnthropicErrorInfo,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOutput,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    MessageDelta,
    MessagesRequest,
    MessagesResponse,
    MessageStart,
    MessageStop,
    MessageStreamEvent,
    OutputUsage,
    Ping,
    StopDelta,
    TextDelta,
    TextOutput,
    ThinkingDelta,
    ThinkingOutput,
    ToolUseOutput,
    Usage,
    tool_input,
)
from ember.server.chat_answer import AnswerDelta
from ember.server.conversation import ChatInput, ChatRun, ChoiceAnswer, count_prompt_tokens, start_chat
from ember.server.errors import APIError, use_error_body, value_error
from ember.server.generation import EventFormat, respond
from ember.server.openapi import BODY_ERRORS, GENERATION_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine, sampling_params
from ember.server.state import ServerState, get_state

# Anthropic's error type for each status the server answers.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(e: APIError) -> BaseModel:
    return AnthropicError(error=AnthropicErrorInfo(type=_ERROR_TYPES.get(e.status, "api_error"), message=str(e)))


EVENTS = EventFormat(named=True, done=None, error=anthropic_error_body)
router = APIRouter(dependencies=[Depends(use_error_body(anthropic_error_body)), Depends(check_api_key)])


@router.post(
    "/v1/messages",
    **route_docs(
        body=MessagesRequest,
        response=MessagesResponse,
        stream_chunk=MessageStreamEvent,
        errors=GENERATION_ERRORS,
        error_model=AnthropicError,
        stream_done=False,
    ),
)
async def create_message(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, MessagesRequest)
    message = await _start(get_state(request), engine, body)
    return await respond(request, message.run.gen, body.stream, message.events, message.response, EVENTS)


@router.post(
    "/v1/messages/count_tokens",
    **route_docs(body=CountTokensRequest, response=CountTokensResponse, errors=BODY_ERRORS, error_model=AnthropicError),
)
async def count_tokens(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> CountTokensResponse:
    body = await read_body(request, CountTokensRequest)
    return CountTokensResponse(
        input_tokens=await count_prompt_tokens(get_state(request), engine, _chat_input(body, SamplingParams()))
    )


def _chat_input(body: CountTokensRequest, params: SamplingParams) -> ChatInput:
    try:
        choice, name = body.tool_mode()
    except ValueError as e:
        raise value_error(e, CountTokensRequest) from None
    parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
    return ChatInput(
        messages=body.chat_messages(),
        params=params,
        request_model=type(body),
        tools=body.tool_definitions(),
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        template_kwargs=body.template_kwargs(),
        messages_field="messages",
    )


async def _start(state: ServerState, engine: AsyncLLM, body: MessagesRequest) -> _Message:
    params = await sampling_params(body, engine)
    chat = replace(_chat_input(body, params), lora_request=state.lora_for(body.model))
    run = await start_chat(state, engine, chat, f"msg_{uuid.uuid4().hex}")
    return _Message(state.served_model(body.model), body, run)


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _blocks(a: ChoiceAnswer) -> list[ContentOutput]:
    blocks: list[ContentOutput] = []
    if a.reasoning:
        blocks.append(ThinkingOutput(thinking=a.reasoning))
    if a.content or not a.calls:
        blocks.append(TextOutput(text=a.content or ""))
    blocks.extend(ToolUseOutput(id=c.id, name=c.name, input=tool_input(c.arguments)) for c in a.calls)
    return blocks


class _Message:
    """A chat run written as an Anthropic message, whole or as its stream of events."""

    def __init__(self, model: str, body: MessagesRequest, run: ChatRun) -> None:
        self.model = model
        self.body = body
        self.run = run
        self.rid = run.request_id
        self._block = -1  # index of the open content block (-1: none yet)
        self._open: str | None = None  # its type: "thinking", "text" or "tool_use"; None once closed

    def response(self, finals: list[RequestOutput]) -> MessagesResponse:
        a = self.run.answers(finals)[0]
        reason, sequence = stop_reason(a.finish_reason, a.stop_reason)
        u = self.run.usage()
        return MessagesResponse(
            id=self.rid,
            model=self.model,
            content=_blocks(a),
            stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens),
        )

    async def events(self) -> AsyncIterator[BaseModel]:
        start = MessagesResponse(
            id=self.rid, model=self.model, content=[], usage=Usage(input_tokens=self.run.prompt_tokens, output_tokens=0)
        )
        yield MessageStart(message=start)
        yield Ping()
        async for e in self.run.events():
            for event in self._deltas(e.delta):
                yield event
            if e.finish_reason is not None:
                for event in self._close():
                    yield event
                reason, sequence = stop_reason(e.finish_reason, e.stop_reason)
                yield MessageDelta(
                    delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                    usage=OutputUsage(output_tokens=self.run.usage().completion_tokens),
                )
                yield MessageStop()

    def _deltas(self, d: AnswerDelta) -> list[BaseModel]:
        """A parsed delta as block events: reasoning, content and tool calls come in that order."""
        out: list[BaseModel] = []
        if d.reasoning:
            out += self._open_block("thinking", ThinkingOutput(thinking=""))
            out.append(ContentBlockDelta(index=self._block, delta=ThinkingDelta(thinking=d.reasoning)))
        if d.content:
            out += self._open_block("text", TextOutput(text=""))
            out.append(ContentBlockDelta(index=self._block, delta=TextDelta(text=d.content)))
        for call in d.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                out += self._open_block("tool_use", ToolUseOutput(id=call.id, name=call.name or "", input={}))
            if call.arguments:
                out.append(ContentBlockDelta(index=self._block, delta=InputJsonDelta(partial_json=call.arguments)))
        return out

    def _open_block(self, kind: str, block: ContentOutput) -> list[BaseModel]:
        """Close the open block and start `block`, unless it continues the open one (a tool call never does)."""
        if self._open == kind and kind != "tool_use":
            return []
        out = self._close()
        self._block += 1
        self._open = kind
        return [*out, ContentBlockStart(index=self._block, content_block=block)]

    def _close(self) -> list[BaseModel]:
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStop(index=self._block)]
