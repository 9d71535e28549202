"""OpenAI's Responses API schema (`/v1/responses`), as pydantic models, and its mapping onto a chat.

Request items follow OpenAI's shapes, so the `openai` client (`client.responses.create`) and agents
built on it work unchanged: messages with `input_text` / `output_text` parts (or a plain string),
`function_call`, `function_call_output` and `reasoning` items, `input_image` parts by URL. Unknown fields
are ignored as on the other endpoints; what the engine cannot do (files, hosted tools such as web search;
images on a text-only model) is a 400 naming the item, never silently dropped.

`chat_messages` writes a list of items as chat templates read it: an item's text parts joined, a
`reasoning` item as the next assistant turn's `reasoning_content`, consecutive `function_call`s as
one assistant turn's `tool_calls`, each `function_call_output` as a `tool` message.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, Discriminator, Field, RootModel, Tag, field_validator

from ember.sampling.params import INT32_MAX, MAX_LOGPROBS, SamplingParams
from ember.sampling.structured import StructuredOutputsParams, check_grammar
from ember.server.protocol import ChatTokenLogprob, generation_defaults, refuse_unreadable, with_argument_mappings

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items ---------------------------------------------------------------------------------


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(BaseModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(BaseModel):
    """An image by URL (`data:`, http(s)://, or file:// where allowed), read as chat's `image_url` part."""

    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


TextContent = Annotated[InputText | Refusal, Field(discriminator="type")]
MessageContent = Annotated[InputText | Refusal | InputImage, Field(discriminator="type")]
_READABLE_PARTS = ("input_text", "output_text", "refusal")


def _readable(parts: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        return refuse_unreadable(
            value,
            parts,
            "content[{i}] is a {kind!r} part; Ember reads " + ", ".join(parts) + " parts (audio and files are not "
            "supported yet)",
        )

    return check


def _message_parts(value: Any) -> Any:
    """`_readable`, and an image without a URL said plainly."""
    value = _readable((*_READABLE_PARTS, "input_image"))(value)
    for i, part in enumerate(value if isinstance(value, list) else ()):
        if isinstance(part, dict) and part.get("type") == "input_image" and not part.get("image_url"):
            raise ValueError(f"content[{i}]: an input_image needs image_url (file_id is not supported: no files here)")
    return value


def _text(content: str | list[TextContent]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, InputText) else p.refusal for p in content)


def _content(content: str | list[MessageContent]) -> str | list[dict[str, Any]]:
    """A message's text; with images, its parts in order as chat content parts (images as `image_url`)."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(cast(str | list[TextContent], content))
    return [
        {"type": "image_url", "image_url": {"url": p.image_url}}
        if isinstance(p, InputImage)
        else {"type": "text", "text": p.text if isinstance(p, InputText) else p.refusal}
        for p in content
    ]


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessageContent]
    id: str | None = None
    status: str | None = None

    _check_parts = field_validator("content", mode="before")(_message_parts)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    _check_parts = field_validator("output", mode="before")(_readable(_READABLE_PARTS))


class ReasoningText(BaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str:
    """A message item may leave out its `type` (OpenAI's "easy" input message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _ITEM_TYPES else "unsupported"


def _readable_items(value: Any) -> Any:
    """Unreadable items and message parts said plainly (the `input` union would only say "not a string")."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict) and _item_type(item) == "unsupported":
                raise ValueError(
                    f"input[{i}] is a {item.get('type')!r} item; Ember reads {', '.join(_ITEM_TYPES)} items"
                )
            if isinstance(item, dict) and _item_type(item) == "message":
                try:
                    _message_parts(item.get("content"))
                except ValueError as e:
                    raise ValueError(f"input[{i}].{e}") from None
    return value


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class InputItems(RootModel[list[InputItem]]):
    """A stored conversation's items (responses_store.py keeps them as this JSON)."""


def chat_messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat templates read it (see the module docstring)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, FunctionCallItem):
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            function = {"name": item.name, "arguments": item.arguments}
            last.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": function})
        else:
            out.append({"role": item.role, "content": _content(item.content)})
        if reasoning and out and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, ""
    return with_argument_mappings(out)


# ---- the request ---------------------------------------------------------------------------------


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON matching a schema (fields at this level, unlike
    chat's `response_format`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


def _function_tools_only(value: Any) -> Any:
    return refuse_unreadable(value, ("function",), "[{i}] is a {kind!r} tool; Ember runs function tools only")


class ResponsesRequest(BaseModel):
    """OpenAI's fields, plus vLLM's `ignore_eos` extension (as on the chat endpoint): generate
    `max_output_tokens` tokens whatever the model's end-of-sequence tokens say (benchmarks use it, so that
    every API generates the same lengths)."""

    # The engine's messages name its own fields; errors name this API's.
    param_aliases: ClassVar[dict[str, str]] = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    ignore_eos: bool = False

    _check_items = field_validator("input", mode="before")(_readable_items)
    _check_tools = field_validator("tools", mode="before")(_function_tools_only)

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.wants_logprobs else None
        return SamplingParams(
            **generation_defaults(self, defaults),
            max_tokens=self.max_output_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=self.constraint(),
        )

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def constraint(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif fmt.schema_ is None:
            raise ValueError("text.format.schema: required when type is 'json_schema'")
        else:
            params = StructuredOutputsParams(json=fmt.schema_)
        check_grammar(params, self.constraint_field(params))
        return params

    def constraint_field(self, params: StructuredOutputsParams) -> str:
        return "text.format.schema" if params.json is not None else "text.format"

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(include={"name", "description", "parameters"}, exclude_none=True) for t in self.tools]

    def tool_mode(self) -> tuple[str, str | None]:
        choice = self.tool_choice or "auto"
        return (choice, None) if isinstance(choice, str) else ("named", choice.name)

    def template_kwargs(self) -> dict[str, Any]:
        """`reasoning.effort` "none" as the `enable_thinking` switch of thinking models' templates (Qwen3)."""
        if self.reasoning is None or self.reasoning.effort is None:
            return {}
        return {"enable_thinking": self.reasoning.effort != "none"}


# ---- output items and the response ---------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText] = Field(default_factory=list)
    status: str = "completed"


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response, as created, streamed, stored and fetched."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "queued", "cancelled", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: TextConfig = Field(default_factory=lambda: TextConfig(format=TextFormat(type="text")))
    reasoning: ReasoningConfig | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    user: str | None = None

    @classmethod
    def for_request(cls, body: ResponsesRequest, model: str, params: SamplingParams) -> ResponseObject:
        return cls(
            model=model,
            instructions=body.instructions,
            tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls,
            temperature=params.temperature,
            top_p=params.top_p,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            text=body.text or TextConfig(format=TextFormat(type="text")),
            reasoning=body.reasoning,
            store=body.store,
            background=body.background,
            metadata=body.metadata or {},
            user=body.user,
            status="queued" if body.background else "in_progress",
        )


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ---- stream events -------------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int = 0  # set as the event is sent


class ResponseEvent(_Event):
    """response.created, .in_progress, .completed, .incomplete, .failed: the whole response so far."""

    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | OutputReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


class ResponseStreamEvent(
    RootModel[
        Annotated[
            ResponseEvent
            | OutputItemEvent
            | ContentPartEvent
            | TextDeltaEvent
            | TextDoneEvent
            | ArgumentsDeltaEvent
            | ArgumentsDoneEvent
            | ErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """Any event of a streamed response (the OpenAPI document's stream item)."""
