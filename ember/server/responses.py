"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST .../{id}/cancel.

A request's items (after the stored conversation of `previous_response_id`, when given) become a
`ChatInput` and run on the path the chat endpoint uses (conversation.py); this module writes the result
as output items: `reasoning`, a `message` with one `output_text` part, a `function_call` per tool call.
Streamed, each item opens with `response.output_item.added`, carries its deltas and closes with its
`.done` events, between `response.created` / `response.in_progress` and `response.completed` (whose
status is `incomplete` when `max_output_tokens` or the content filter cut it), every event numbered by
`sequence_number`. With `store` (the default, as OpenAI's) the response and its conversation go to the
response store (responses_store.py) under the caller's API key; `background` runs it detached, to be
polled with GET and stopped with cancel.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ember.frontend.async_llm import AsyncLLM
from ember.frontend.output import RequestOutput
from ember.server.chat_answer import AnswerDelta
from ember.server.conversation import ChatInput, ChatRun, ChoiceAnswer, ChoiceEvent, start_chat
from ember.server.errors import APIError, bad_request
from ember.server.generation import EventFormat, answer, respond
from ember.server.openapi import ENGINE_ERRORS, GENERATION_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine, sampling_params
from ember.server.protocol import ChatTokenLogprob
from ember.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    IncompleteDetails,
    InputItems,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    chat_messages,
)
from ember.server.responses_store import StoredResponse
from ember.server.state import ServerState, get_state

logger = logging.getLogger("ember")
EVENTS = EventFormat(named=True, done=None)
TextDeltaKind = Literal["response.output_text.delta", "response.reasoning_text.delta"]
TextDoneKind = Literal["response.output_text.done", "response.reasoning_text.done"]
PartKind = Literal["response.content_part.added", "response.content_part.done"]
router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post(
    "/v1/responses",
    **route_docs(
        body=ResponsesRequest,
        response=ResponseObject,
        stream_chunk=ResponseStreamEvent,
        errors=GENERATION_ERRORS,
        stream_done=False,
    ),
)
async def create_response(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> Response:
    body = await read_body(request, ResponsesRequest)
    state, owner = get_state(request), request.state.key_owner
    made = await _start(state, engine, body, owner)
    if body.background:
        state.background_responses[made.obj.id] = asyncio.create_task(made.in_background())
        return _json(made.obj)
    return await respond(request, made.run.gen, body.stream, made.events, made.response, EVENTS)


@router.get("/v1/responses/{response_id}", **route_docs(response=ResponseObject, errors=(*ENGINE_ERRORS, 404)))
async def get_response(response_id: str, request: Request) -> Response:
    entry = await _stored(get_state(request), request.state.key_owner, response_id)
    return Response(entry.response, media_type="application/json")


@router.delete("/v1/responses/{response_id}", **route_docs(response=DeletedResponse, errors=(*ENGINE_ERRORS, 404)))
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    state = get_state(request)
    if not await asyncio.to_thread(state.response_store.delete, request.state.key_owner, response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)


@router.post(
    "/v1/responses/{response_id}/cancel", **route_docs(response=ResponseObject, errors=(*ENGINE_ERRORS, 400, 404))
)
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stops a background response (its engine request is aborted) and answers it as it then stands;
    one that already ended is answered as it is."""
    state, owner = get_state(request), request.state.key_owner
    entry = await _stored(state, owner, response_id)
    if not json.loads(entry.response).get("background"):
        raise bad_request("Only a response created with background: true can be cancelled", "response_id")
    task = state.background_responses.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.wait({task})
        entry = await _stored(state, owner, response_id)
    return Response(entry.response, media_type="application/json")


async def _stored(state: ServerState, owner: str, response_id: str) -> StoredResponse:
    entry = await asyncio.to_thread(state.response_store.get, owner, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id {response_id!r} is stored", "not_found_error", param, "not_found")


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def _history(state: ServerState, owner: str, body: ResponsesRequest) -> list[Any]:
    """The conversation before this request's input: the previous response's own history, then its
    output items (which read as input items)."""
    if body.previous_response_id is None:
        return []
    entry = await asyncio.to_thread(state.response_store.get, owner, body.previous_response_id)
    if entry is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    return [*json.loads(entry.items), *json.loads(entry.response)["output"]]


async def _start(state: ServerState, engine: AsyncLLM, body: ResponsesRequest, owner: str) -> _Response:
    if body.background and not body.store:
        raise bad_request("background: a background response must be stored (store: true)", "background")
    if body.background and body.stream:
        raise bad_request("background: streaming a background response is not supported", "background")
    items = InputItems.model_validate([*await _history(state, owner, body), *body.input_items()]).root
    params = await sampling_params(body, engine)
    choice, name = body.tool_mode()
    chat = ChatInput(
        messages=chat_messages(items, body.instructions),
        params=params,
        request_model=ResponsesRequest,
        tools=body.tool_definitions(),
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=body.template_kwargs(),
        top_logprobs=body.top_logprobs or 0,
        lora_request=state.lora_for(body.model),
        messages_field="input",
    )
    obj = ResponseObject.for_request(body, state.served_model(body.model), params)
    run = await start_chat(state, engine, chat, obj.id)
    made = _Response(state, owner, body, run, obj, InputItems(items).model_dump_json())
    if body.background:
        made.store()
    return made


class _Response:
    """A chat run written as a Response: its output items, whole or as numbered stream events, stored
    once it ends when the request asked for that."""

    def __init__(
        self, state: ServerState, owner: str, body: ResponsesRequest, run: ChatRun, obj: ResponseObject, items: str
    ) -> None:
        self.state = state
        self.owner = owner
        self.body = body
        self.run = run
        self.obj = obj
        self.items = items  # the conversation up to this response, as stored for the next one
        self._seq = 0
        self._open: OutputItem | None = None  # the item being streamed

    def store(self) -> None:
        """Synchronous on purpose: the store commits without an fsync (WAL, synchronous=NORMAL), tens of
        microseconds, and the next request may name this response as soon as it is answered."""
        if not self.body.store:
            return
        try:
            self.state.response_store.put(
                self.owner, self.obj.id, StoredResponse(self.obj.model_dump_json(), self.items)
            )
        except ValueError as e:  # larger than the whole store: answered all the same, just not kept
            logger.warning("response %s not stored: %s", self.obj.id, e)

    def _finish(self, finish_reason: str | None, finals: list[RequestOutput]) -> ResponseObject:
        u = self.run.usage()
        self.obj.usage = ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=finals[0].num_cached_tokens),
            output_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
        )
        if finish_reason in ("length", "content_filter"):
            self.obj.status = "incomplete"
            self.obj.incomplete_details = IncompleteDetails(
                reason="max_output_tokens" if finish_reason == "length" else "content_filter"
            )
        else:
            self.obj.status = "completed"
        self.store()
        return self.obj

    # ---- whole -----------------------------------------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> ResponseObject:
        a = self.run.answers(finals)[0]
        self.obj.output = self._items(a)
        return self._finish(a.finish_reason, finals)

    def _items(self, a: ChoiceAnswer) -> list[OutputItem]:
        items: list[OutputItem] = []
        if a.reasoning:
            items.append(OutputReasoning(content=[OutputReasoningText(text=a.reasoning)]))
        if a.content or not a.calls:
            lps = self._logprobs(a.token_ids, a.logprobs)
            items.append(OutputMessage(content=[OutputText(text=a.content or "", logprobs=lps)]))
        items.extend(OutputFunctionCall(call_id=c.id, name=c.name, arguments=c.arguments) for c in a.calls)
        return items

    def _logprobs(self, token_ids: list[int], lps: Any) -> list[ChatTokenLogprob] | None:
        return self.run.token_logprobs(token_ids, lps) if self.body.wants_logprobs else None

    async def in_background(self) -> None:
        """Run to the end detached from any connection; the store holds each state it reaches."""
        self.obj.status = "in_progress"
        try:
            await answer(self.run.gen, self.response)
        except asyncio.CancelledError:
            self.obj.status = "cancelled"
            self.store()
            raise
        except APIError as e:
            self.obj.status = "failed"
            self.obj.error = ResponseError(code=e.info.code or e.info.type, message=str(e))
            self.store()
        finally:
            self.state.background_responses.pop(self.obj.id, None)

    # ---- streamed --------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[BaseModel]:
        try:
            yield self._number(ResponseEvent(type="response.created", response=self.obj))
            yield self._number(ResponseEvent(type="response.in_progress", response=self.obj))
            async for e in self.run.events():
                for event in self._event_items(e):
                    yield self._number(event)
        except APIError as e:  # the status is already 200: the error travels as the stream's last event
            yield self._number(ErrorEvent(code=e.info.code or e.info.type, message=str(e), param=e.info.param))

    def _number(self, event: Any) -> BaseModel:
        event.sequence_number = self._seq
        self._seq += 1
        return event

    def _event_items(self, e: ChoiceEvent) -> list[BaseModel]:
        out = self._deltas(e.delta, self._logprobs(e.token_ids, e.logprobs) or [])
        if e.finish_reason is not None:
            out += self._close()
            obj = self._finish(e.finish_reason, [o for o in self.run.gen.final if o is not None])
            # Also for an incomplete one (its status says so), as vLLM does: the openai client's stream
            # helper waits for this event alone.
            out.append(ResponseEvent(type="response.completed", response=obj))
        return out

    def _deltas(self, d: AnswerDelta, logprobs: list[ChatTokenLogprob]) -> list[BaseModel]:
        """A parsed delta as item events: reasoning, content and tool calls come in that order."""
        out: list[BaseModel] = []
        if d.reasoning:
            out += self._open_item(OutputReasoning(status="in_progress"))
            item = self._open
            assert isinstance(item, OutputReasoning)  # just opened, or already open
            item.content[0].text += d.reasoning
            out.append(self._text_delta("response.reasoning_text.delta", item.id, d.reasoning, []))
        if d.content:
            out += self._open_item(OutputMessage(status="in_progress"))
            item = self._open
            assert isinstance(item, OutputMessage)
            part = item.content[0]
            part.text += d.content
            if part.logprobs is not None:
                part.logprobs += logprobs
            out.append(self._text_delta("response.output_text.delta", item.id, d.content, logprobs))
        for call in d.tool_calls:
            if call.id is not None:  # a new call: its id and name come first
                out += self._open_item(
                    OutputFunctionCall(call_id=call.id, name=call.name or "", arguments="", status="in_progress")
                )
            if call.arguments:
                fc = self._open
                assert isinstance(fc, OutputFunctionCall)
                fc.arguments += call.arguments
                out.append(ArgumentsDeltaEvent(item_id=fc.id, output_index=self._index, delta=call.arguments))
        return out

    @property
    def _index(self) -> int:
        return len(self.obj.output) - 1

    def _text_delta(self, kind: TextDeltaKind, item_id: str, text: str, logprobs: list[ChatTokenLogprob]) -> BaseModel:
        return TextDeltaEvent(
            type=kind, item_id=item_id, output_index=self._index, content_index=0, delta=text, logprobs=logprobs
        )

    def _open_item(self, item: OutputItem) -> list[BaseModel]:
        """Close the open item and start `item`, unless it continues the open one (a tool call never does)."""
        if self._open is not None and self._open.type == item.type and item.type != "function_call":
            return []
        out = self._close()
        self._open = item
        self.obj.output.append(item)
        added = item.model_copy(deep=True)
        out.append(OutputItemEvent(type="response.output_item.added", output_index=self._index, item=added))
        if isinstance(item, OutputMessage):
            item.content.append(OutputText(text="", logprobs=[] if self.body.wants_logprobs else None))
            out.append(self._part_event("response.content_part.added", item.id, item.content[0]))
        elif isinstance(item, OutputReasoning):
            item.content.append(OutputReasoningText(text=""))
            out.append(self._part_event("response.content_part.added", item.id, item.content[0]))
        return out

    def _part_event(self, kind: PartKind, item_id: str, part: OutputText | OutputReasoningText) -> BaseModel:
        return ContentPartEvent(
            type=kind, item_id=item_id, output_index=self._index, content_index=0, part=part.model_copy()
        )

    def _close(self) -> list[BaseModel]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = "completed"
        out: list[BaseModel] = []
        if isinstance(item, OutputFunctionCall):
            out.append(
                ArgumentsDoneEvent(item_id=item.id, output_index=self._index, name=item.name, arguments=item.arguments)
            )
        else:
            part = item.content[0]
            kind: TextDoneKind = (
                "response.output_text.done" if isinstance(item, OutputMessage) else "response.reasoning_text.done"
            )
            lps = (part.logprobs or []) if isinstance(part, OutputText) else []
            out.append(
                TextDoneEvent(
                    type=kind, item_id=item.id, output_index=self._index, content_index=0, text=part.text, logprobs=lps
                )
            )
            out.append(self._part_event("response.content_part.done", item.id, part))
        out.append(OutputItemEvent(type="response.output_item.done", output_index=self._index, item=item))
        return out
