"""POST /v1/chat/completions: OpenAI's chat completions.

The request becomes a `ChatInput` and runs on the path every chat-shaped API shares
(conversation.py: template, tools, reasoning, engine run); this module writes the result in OpenAI's
chat shape: whole messages, or a role chunk per choice, then deltas, then a finish chunk, when streaming.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import Logprob, RequestOutput
from ember.server.chat_answer import AnswerDelta
from ember.server.conversation import ChatInput, ChatRun, ChoiceAnswer, ChoiceEvent, start_chat
from ember.server.generation import answer, respond
from ember.server.openapi import GENERATION_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine, sampling_params, usage
from ember.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    UsageInfo,
)
from ember.server.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post(
    "/v1/chat/completions",
    **route_docs(
        body=ChatCompletionRequest,
        response=ChatCompletionResponse,
        stream_chunk=ChatCompletionChunk,
        errors=GENERATION_ERRORS,
    ),
)
async def create_chat_completion(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    chat = await _start(get_state(request), engine, body)
    return await respond(request, chat.gen, body.stream, chat.chunks, chat.response)


async def complete_chat(state: ServerState, engine: AsyncLLM, body: ChatCompletionRequest) -> ChatCompletionResponse:
    """A validated non-streaming request's whole answer, without HTTP (`ember run-batch`)."""
    chat = await _start(state, engine, body)
    return await answer(chat.gen, chat.response)


async def _start(state: ServerState, engine: AsyncLLM, body: ChatCompletionRequest) -> _ChatCompletion:
    params = await sampling_params(body, engine)
    choice = body.tool_choice or "auto"
    chat = ChatInput(
        messages=body.template_messages(),
        params=params,
        request_model=ChatCompletionRequest,
        tools=[t.function.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=choice if isinstance(choice, str) else "named",
        tool_name=None if isinstance(choice, str) else choice.function.name,
        parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        top_logprobs=body.top_logprobs or 0,
        lora_request=state.lora_for(body.model),
    )
    run = await start_chat(state, engine, chat, f"chatcmpl-{uuid.uuid4().hex}")
    return _ChatCompletion(state, body, run)


def _delta_message(d: AnswerDelta) -> DeltaMessage:
    calls = [
        DeltaToolCall(index=c.index, id=c.id, function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
        for c in d.tool_calls
    ]
    return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)


def _message(a: ChoiceAnswer) -> AssistantMessage:
    calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in a.calls]
    return AssistantMessage(content=a.content, reasoning_content=a.reasoning, tool_calls=calls or None)


class _ChatCompletion:
    """A chat run's events as chat choices or stream chunks (OpenAI's chat completion shape)."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, run: ChatRun) -> None:
        self.model = state.served_model(body.model)
        self.body = body
        self.run = run
        self.gen = run.gen
        self.rid = run.request_id

    def logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        return None if lps is None else ChatLogprobs(content=self.run.token_logprobs(token_ids, lps))

    def chunk(self, choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, model=self.model, choices=[choice] if choice else [], usage=usage)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for idx in range(self.run.params.n):
            yield self.chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content="")))
        async for event in self.run.events():
            choice = self._chunk_choice(event)
            if choice is not None:
                yield self.chunk(choice)
        if self.body.include_usage:
            yield self.chunk(None, self.run.usage())

    def _chunk_choice(self, e: ChoiceEvent) -> ChatChunkChoice | None:
        """A content delta (also an empty one, for progress, without a parser), or the finish chunk."""
        lps = self.logprobs(e.token_ids, e.logprobs)
        if e.finish_reason is not None:
            return ChatChunkChoice(
                index=e.index,
                delta=DeltaMessage(),
                finish_reason=e.finish_reason,
                stop_reason=e.stop_reason,
                logprobs=lps if lps and lps.content else None,
            )
        delta = _delta_message(e.delta) if e.has_text or not self.run.parses else None
        if delta is None and lps is None:
            return None
        return ChatChunkChoice(index=e.index, delta=delta or DeltaMessage(content=""), logprobs=lps)

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=a.index,
                message=_message(a),
                logprobs=self.logprobs(a.token_ids, a.logprobs),
                finish_reason=a.finish_reason,
                stop_reason=a.stop_reason,
            )
            for a in self.run.answers(finals)
        ]
        return ChatCompletionResponse(id=self.rid, model=self.model, choices=choices, usage=usage(finals))
