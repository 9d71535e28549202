"""POST /v1/completions: OpenAI's legacy text completions, one or many prompts per request.

Each prompt (text or token ids) becomes one engine request; choice `i * n + j` is prompt `i`'s
`j`-th sample. With `echo` the prompt's text, and its logprobs, lead each choice; streamed chunks
carry a choice's new text and the logprobs of its new tokens, with text offsets running on.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import CompletionOutput, Logprob, RequestOutput
from ember.sampling.params import SamplingParams
from ember.server.errors import bad_request
from ember.server.generation import Generation, answer, respond
from ember.server.openapi import GENERATION_ERRORS, route_docs
from ember.server.plumbing import (
    check_api_key,
    clamp_logprob,
    logprobs_since,
    read_body,
    ready_engine,
    require_tokenizer,
    sampling_params,
    token_text,
    usage,
)
from ember.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from ember.server.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post(
    "/v1/completions",
    **route_docs(
        body=CompletionRequest, response=CompletionResponse, stream_chunk=CompletionResponse, errors=GENERATION_ERRORS
    ),
)
async def create_completion(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, CompletionRequest)
    completion = await _start(get_state(request), engine, body)
    return await respond(request, completion.gen, body.stream, completion.chunks, completion.response)


async def complete(state: ServerState, engine: AsyncLLM, body: CompletionRequest) -> CompletionResponse:
    """A validated non-streaming request's whole answer, without HTTP (`ember run-batch`)."""
    completion = await _start(state, engine, body)
    return await answer(completion.gen, completion.response)


async def _start(state: ServerState, engine: AsyncLLM, body: CompletionRequest) -> _Completion:
    return _Completion(state, engine, body, await sampling_params(body, engine), _prompts(body))


def _prompts(body: CompletionRequest) -> list[Any]:
    """The request's prompts: one text or token-id list, or a list of them."""
    prompt = body.prompt
    prompts: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


class _Completion:
    """One completion request's engine run, and how its outputs become choices or stream chunks."""

    def __init__(
        self, state: ServerState, engine: AsyncLLM, body: CompletionRequest, params: SamplingParams, prompts: list[Any]
    ) -> None:
        self.state = state
        self.engine = engine
        self.body = body
        self.params = params
        self.tokenizer = engine.tokenizer
        self.rid = f"cmpl-{uuid.uuid4().hex}"
        self.gen = Generation(state, engine, self.rid, prompts, params, CompletionRequest, state.lora_for(body.model))
        # Per choice index while streaming: tokens sent, text offset reached, and whether it finished.
        self._sent_tokens: dict[int, int] = {}
        self._offsets: dict[int, int] = {}
        self._done: set[int] = set()

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tokenizer = require_tokenizer(self.engine)
        return tokenizer.decode(out.prompt_token_ids, skip_special_tokens=self.params.skip_special_tokens)

    def logprobs(
        self,
        token_ids: list[int],
        lps: Sequence[dict[int, Logprob] | None] | None,
        offset: int,
        result: CompletionLogprobs | None = None,
    ) -> tuple[CompletionLogprobs | None, int]:
        """Append these tokens' logprobs to `result` (a new one if None); return it and the next text offset."""
        if lps is None:
            return result, offset
        result = result or CompletionLogprobs()
        for tid, entries in zip(token_ids, lps):
            text = self._add_token(result, tid, entries)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
        return result, offset

    def _add_token(self, result: CompletionLogprobs, tid: int, entries: dict[int, Logprob] | None) -> str:
        """Append one token's logprob and top logprobs to `result`; return the token's text."""
        if entries is None:  # the first prompt token has no logprob
            text = token_text(tid, Logprob(0.0, 0), self.tokenizer)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            return text
        text = token_text(tid, entries[tid], self.tokenizer)
        result.token_logprobs.append(clamp_logprob(entries[tid].logprob))
        top: dict[str, float] = {}
        for t, lp in entries.items():  # sampled token first, then by rank: a text seen twice keeps the first
            top.setdefault(token_text(t, lp, self.tokenizer), clamp_logprob(lp.logprob))
        result.top_logprobs.append(top)
        return text

    def echoed_logprobs(self, out: RequestOutput) -> tuple[CompletionLogprobs | None, int]:
        """With echo and logprobs, the prompt's tokens lead the logprobs (offsets from 0)."""
        if not self.body.echo:
            return None, 0
        return self.logprobs(out.prompt_token_ids, out.prompt_logprobs, 0)

    async def chunks(self) -> AsyncIterator[CompletionResponse]:
        async for i, out in self.gen.outputs():
            for o in out.outputs:
                choice = self._chunk_choice(i * self.params.n + o.index, out, o)
                if choice is not None:
                    yield CompletionResponse(
                        id=self.rid, model=self.state.served_model(self.body.model), choices=[choice]
                    )
        if self.body.include_usage:
            yield CompletionResponse(
                id=self.rid,
                model=self.state.served_model(self.body.model),
                choices=[],
                usage=usage(cast(list[RequestOutput], self.gen.final)),
            )  # all set by now

    def _chunk_choice(self, idx: int, out: RequestOutput, o: CompletionOutput) -> CompletionChoice | None:
        """Choice `idx`'s news since its last chunk, or None if there is none."""
        if idx in self._done:
            return None
        text = o.delta_text
        prompt_lps = None
        if idx not in self._sent_tokens:
            prefix = self.prompt_text(out) if self.body.echo else ""
            text = prefix + text
            prompt_lps, _ = self.echoed_logprobs(out)
            self._offsets[idx] = len(prefix)
        if not text and o.finish_reason is None and len(o.token_ids) == self._sent_tokens.get(idx, 0):
            return None  # nothing new: a chunked prefill step
        # Tokens whose text is held back (an unfinished character, a possible stop string, no
        # tokenizer) still get a chunk, as in vLLM, so clients see progress token by token.
        start = self._sent_tokens.get(idx, 0)
        lps, self._offsets[idx] = self.logprobs(
            o.token_ids[start:], logprobs_since(o, start), self._offsets[idx], prompt_lps
        )
        self._sent_tokens[idx] = len(o.token_ids)
        if o.finish_reason is not None:
            self._done.add(idx)
        return CompletionChoice(
            index=idx, text=text, logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason
        )

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.prompt_text(out) if self.body.echo else ""
            for o in out.outputs:
                lps, _ = self.logprobs(o.token_ids, o.logprobs, len(prefix), self.echoed_logprobs(out)[0])
                choices.append(
                    CompletionChoice(
                        index=i * self.params.n + o.index,
                        text=prefix + o.text,
                        logprobs=lps,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
        return CompletionResponse(
            id=self.rid, model=self.state.served_model(self.body.model), choices=choices, usage=usage(finals)
        )
