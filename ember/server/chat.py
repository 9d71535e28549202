"""POST /v1/chat/completions, and `render_chat`, the chat template step that /tokenize shares.

A chat request renders its messages through the model's chat template into one prompt, runs it on
the engine through generation.py, and answers in OpenAI's chat shape: whole messages, or a role chunk
per choice, then content deltas, then a finish chunk, when streaming.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ember.engine.async_llm import AsyncLLM
from ember.engine.output import CompletionOutput, RequestOutput
from ember.engine.output import Logprob
from ember.sampling.params import SamplingParams
from ember.server.errors import value_error
from ember.server.generation import Generation, answer, respond
from ember.server.plumbing import (check_api_key, clamp_logprob, logprobs_since, read_body, ready_engine,
                                   require_tokenizer, sampling_params, token_text, usage)
from ember.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
                                   DeltaMessage, TopLogprob, UsageInfo)
from ember.server.state import ServerState, get_state
from ember.tokenizer import Tokenizer

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    chat = await _start(get_state(request), engine, body)
    return await respond(request, chat.gen, body.stream, chat.chunks, chat.response)


async def complete_chat(state: ServerState, engine: AsyncLLM, body: ChatCompletionRequest) -> ChatCompletionResponse:
    """A validated non-streaming request's whole answer, without HTTP (`ember run-batch`)."""
    chat = await _start(state, engine, body)
    return await answer(chat.gen, chat.response)


async def _start(state: ServerState, engine: AsyncLLM, body: ChatCompletionRequest) -> _ChatCompletion:
    params = sampling_params(body, engine)
    tokenizer = require_tokenizer(engine)
    prompt = await asyncio.to_thread(render_chat, tokenizer, body.template_messages(), True, False)
    return _ChatCompletion(state, engine, body, params, tokenizer, prompt)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                add_special_tokens: bool) -> dict[str, Any]:
    """Template and tokenize off the event loop: a long conversation takes milliseconds."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
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

    def __init__(self, state: ServerState, engine: AsyncLLM, body: ChatCompletionRequest, params: SamplingParams,
                 tokenizer: Tokenizer, prompt: dict[str, Any]) -> None:
        self.state = state
        self.body = body
        self.params = params
        self.tokenizer = tokenizer
        self.rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.gen = Generation(state, engine, self.rid, [prompt], params, ChatCompletionRequest)
        self.top_n = body.top_logprobs or 0
        self._sent_tokens = [0] * params.n  # per choice, the tokens already streamed
        self._done: set[int] = set()

    def logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for tid, entries in zip(token_ids, lps):
            top = sorted(((t, lp) for t, lp in entries.items() if lp.rank <= self.top_n), key=lambda e: e[1].rank)
            content.append(ChatTokenLogprob(
                **_top_logprob(tid, entries[tid], self.tokenizer).model_dump(),
                top_logprobs=[_top_logprob(t, lp, self.tokenizer) for t, lp in top]))
        return ChatLogprobs(content=content)

    def chunk(self, choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, model=self.state.settings.model_name,
                                   choices=[choice] if choice else [], usage=usage)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for idx in range(self.params.n):
            yield self.chunk(ChatChunkChoice(index=idx, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in self.gen.outputs():
            for o in out.outputs:
                for choice in self._chunk_choices(o):
                    yield self.chunk(choice)
        if self.body.include_usage:
            yield self.chunk(None, usage(self.gen.final))

    def _chunk_choices(self, o: CompletionOutput) -> Iterator[ChatChunkChoice]:
        """A content delta if the choice has new text or tokens, then a finish chunk if it ended."""
        if o.index in self._done:
            return
        if o.delta_text or (o.finish_reason is None and len(o.token_ids) > self._sent_tokens[o.index]):
            lps = self._unsent_logprobs(o)
            self._sent_tokens[o.index] = len(o.token_ids)
            yield ChatChunkChoice(index=o.index, delta=DeltaMessage(content=o.delta_text), logprobs=lps)
        if o.finish_reason is not None:
            self._done.add(o.index)
            lps = self._unsent_logprobs(o)
            yield ChatChunkChoice(index=o.index, delta=DeltaMessage(), finish_reason=o.finish_reason,
                                  stop_reason=o.stop_reason, logprobs=lps if lps and lps.content else None)

    def _unsent_logprobs(self, o: CompletionOutput) -> ChatLogprobs | None:
        start = self._sent_tokens[o.index]
        return self.logprobs(o.token_ids[start:], logprobs_since(o, start))

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        out = finals[0]
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self.logprobs(o.token_ids, o.logprobs), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason) for o in out.outputs]
        return ChatCompletionResponse(id=self.rid, model=self.state.settings.model_name, choices=choices,
                                      usage=usage(finals))
