"""POST /v1/chat/completions, and `render_chat`, the chat template step that /tokenize shares.

A chat request renders its messages (and tools, and `chat_template_kwargs`) through the model's chat
template into one prompt, runs it on the engine through generation.py, and answers in OpenAI's chat
shape: whole messages, or a role chunk per choice, then deltas, then a finish chunk, when streaming.
With a reasoning parser or tools, each choice's text goes through an `AnswerParser` (chat_answer.py)
that splits it into reasoning, content and tool calls.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import CompletionOutput, Logprob, RequestOutput
from ember.sampling.params import SamplingParams
from ember.server.chat_answer import AnswerDelta, AnswerParser, ToolMode, tool_constraint
from ember.server.errors import bad_request, value_error
from ember.server.generation import Generation, answer, respond
from ember.server.openapi import GENERATION_ERRORS, route_docs
from ember.server.plumbing import (
    check_api_key,
    check_constraint,
    clamp_logprob,
    logprobs_since,
    read_body,
    ready_engine,
    require_tokenizer,
    sampling_params,
    token_text,
    usage,
)
from ember.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from ember.server.reasoning import REASONING_PARSERS
from ember.server.state import ServerState, get_state
from ember.server.tool_parsers import TOOL_PARSERS, parser_for_template
from ember.tokenizer import Tokenizer

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
    tokenizer = require_tokenizer(engine)
    mode = _tool_mode(body, state, tokenizer)
    tools = body.tool_dicts()
    if mode is not None and mode.kind != "auto":
        if params.structured_outputs is not None:
            raise bad_request(
                "tool_choice: a required or named tool cannot be combined with response_format or structured_outputs",
                "tool_choice",
            )
        assert tools is not None  # a tool mode implies tools (_tool_mode)
        params.structured_outputs = tool_constraint(tools, mode, body.parallel_tool_calls)
        assert params.structured_outputs is not None  # required and named modes always constrain
        await check_constraint(engine, params.structured_outputs, "tools", ChatCompletionRequest)
    extra = dict(body.chat_template_kwargs or {})
    if tools is not None:
        extra["tools"] = [{"type": "function", "function": t} for t in tools]
    prompt = await asyncio.to_thread(render_chat, tokenizer, body.template_messages(), True, False, extra)
    if state.settings.reasoning_parser and params.structured_outputs is not None and _will_think(prompt["prompt"]):
        params.structured_outputs = replace(params.structured_outputs, after_think=True)
    return _ChatCompletion(state, engine, body, params, tokenizer, prompt, mode)


def _will_think(prompt: str) -> bool:
    """Whether the answer starts with reasoning: unless the template closed the think block itself
    (Qwen3 with enable_thinking false writes an empty one), constraints hold after `</think>`."""
    return not prompt.rstrip().endswith("</think>")


def _tool_mode(body: ChatCompletionRequest, state: ServerState, tokenizer: Tokenizer) -> ToolMode | None:
    """How the answer carries tool calls; None when the request has no tools or tool_choice is none."""
    if body.tool_dicts() is None:
        return None
    choice = body.tool_choice or "auto"
    if choice == "required":
        return ToolMode("required")
    if choice != "auto":
        assert body.tools is not None and not isinstance(choice, str)  # tool_dicts() is None otherwise
        names = [t.function.name for t in body.tools]
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice: function {choice.function.name!r} is not among the tools {names}", "tool_choice"
            )
        return ToolMode("named", function=choice.function.name)
    parser = state.settings.tool_call_parser or parser_for_template(tokenizer.chat_template)
    if parser is None:
        raise bad_request(
            "tool_choice: 'auto' needs to know how this model writes tool calls, and its chat "
            "template does not say; start the server with --tool-call-parser, or use 'required' "
            "or a named function",
            "tool_choice",
        )
    return ToolMode("auto", fmt=TOOL_PARSERS[parser])


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    variables: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Template and tokenize off the event loop: a long conversation takes milliseconds. `variables`
    (tools, chat_template_kwargs) reach the template beside its standard ones."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, variables=variables)
    except ValueError as e:  # a bad role or content part, or the template itself refused
        error = value_error(e, ChatCompletionRequest)
        error.info.param = error.info.param or "messages"
        raise error from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


def _top_logprob(token_id: int, lp: Logprob, tokenizer: Tokenizer) -> TopLogprob:
    text = token_text(token_id, lp, tokenizer)
    return TopLogprob(token=text, logprob=clamp_logprob(lp.logprob), bytes=list(tokenizer.token_bytes(token_id)))


class _ChatCompletion:
    """One chat request's engine run, and how its outputs become chat choices or stream chunks."""

    def __init__(
        self,
        state: ServerState,
        engine: AsyncLLM,
        body: ChatCompletionRequest,
        params: SamplingParams,
        tokenizer: Tokenizer,
        prompt: dict[str, Any],
        tools: ToolMode | None,
    ) -> None:
        self.state = state
        self.body = body
        self.params = params
        self.tokenizer = tokenizer
        self.rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.gen = Generation(state, engine, self.rid, [prompt], params, ChatCompletionRequest)
        self.top_n = body.top_logprobs or 0
        self._sent_tokens = [0] * params.n  # per choice, the tokens already streamed
        self._done: set[int] = set()
        reasoning = state.settings.reasoning_parser
        fmt = REASONING_PARSERS[reasoning] if reasoning else None
        self._answers = [AnswerParser(fmt, tools) for _ in range(params.n)] if fmt or tools else None

    def logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for tid, entries in zip(token_ids, lps):
            top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= self.top_n), key=lambda e: e[1].rank)
            content.append(
                ChatTokenLogprob(
                    **_top_logprob(tid, entries[tid], self.tokenizer).model_dump(),
                    top_logprobs=[_top_logprob(t, lp, self.tokenizer) for t, lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def chunk(self, choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid, model=self.state.settings.model_name, choices=[choice] if choice else [], usage=usage
        )

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for idx in range(self.params.n):
            yield self.chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in self.gen.outputs():
            for o in out.outputs:
                for choice in self._chunk_choices(o):
                    yield self.chunk(choice)
        if self.body.include_usage:
            yield self.chunk(None, usage(cast(list[RequestOutput], self.gen.final)))  # all set once outputs() ends

    def _chunk_choices(self, o: CompletionOutput) -> Iterator[ChatChunkChoice]:
        """A content delta if the choice has new text or tokens, then a finish chunk if it ended."""
        if o.index in self._done:
            return
        if o.delta_text or (o.finish_reason is None and len(o.token_ids) > self._sent_tokens[o.index]):
            lps = self._unsent_logprobs(o)
            self._sent_tokens[o.index] = len(o.token_ids)
            delta = self._delta(o.index, o.delta_text, final=False)
            if delta is not None or lps is not None:
                yield ChatChunkChoice(index=o.index, delta=delta or DeltaMessage(content=""), logprobs=lps)
        if o.finish_reason is not None:
            self._done.add(o.index)
            tail = self._delta(o.index, "", final=True)
            if tail is not None:
                yield ChatChunkChoice(index=o.index, delta=tail)
            lps = self._unsent_logprobs(o)
            yield ChatChunkChoice(
                index=o.index,
                delta=DeltaMessage(),
                finish_reason=self._finish_reason(o),
                stop_reason=o.stop_reason,
                logprobs=lps if lps and lps.content else None,
            )

    def _delta(self, index: int, text: str, final: bool) -> DeltaMessage | None:
        """A choice's new text as a delta (None when it holds nothing to send)."""
        if self._answers is None:
            return None if final else DeltaMessage(content=text)
        answer = self._answers[index]
        d = (answer.feed(text) + answer.finish()) if final else answer.feed(text)
        if not (d.content or d.reasoning or d.tool_calls):
            return None
        calls = [
            DeltaToolCall(index=c.index, id=c.id, function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            for c in d.tool_calls
        ]
        return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)

    def _finish_reason(self, o: CompletionOutput) -> str | None:
        """`tool_calls` when a finished answer called tools, as OpenAI reports it."""
        if self._answers is not None and self._answers[o.index].calls and o.finish_reason == "stop":
            return "tool_calls"
        return o.finish_reason

    def _unsent_logprobs(self, o: CompletionOutput) -> ChatLogprobs | None:
        start = self._sent_tokens[o.index]
        return self.logprobs(o.token_ids[start:], logprobs_since(o, start))

    def _message(self, o: CompletionOutput) -> AssistantMessage:
        if self._answers is None:
            return AssistantMessage(content=o.text)
        answer = self._answers[o.index]
        d: AnswerDelta = answer.feed(o.text) + answer.finish()
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in answer.calls]
        return AssistantMessage(
            content=d.content if d.content or not calls else None,
            reasoning_content=d.reasoning if answer.thought or d.reasoning else None,
            tool_calls=calls or None,
        )

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        out = finals[0]
        choices = [
            ChatChoice(
                index=o.index,
                message=self._message(o),
                logprobs=self.logprobs(o.token_ids, o.logprobs),
                finish_reason=self._finish_reason(o),
                stop_reason=o.stop_reason,
            )
            for o in out.outputs
        ]
        return ChatCompletionResponse(
            id=self.rid, model=self.state.settings.model_name, choices=choices, usage=usage(finals)
        )
