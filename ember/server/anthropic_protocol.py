"""Anthropic's Messages API schema (`POST /v1/messages`), as pydantic models, and its mapping onto a chat.

Field names and shapes follow Anthropic's API, so the `anthropic` SDK and agents built on it (Claude
Code with `ANTHROPIC_BASE_URL`) work unchanged. Unknown fields are ignored, as on the OpenAI
endpoints (clients send `cache_control`, `service_tier`, ...). Content the engine cannot read (documents,
server tools; images on a text-only model) is a 400 naming the block, never silently dropped.

`MessagesRequest.chat_messages` writes the conversation as chat templates read it: `system` first,
text blocks joined by blank lines (a user's message with images: its text and image blocks as content
parts, in order, images as `image_url` parts), an assistant's `thinking` as `reasoning_content` and its
`tool_use` blocks as `tool_calls`, each `tool_result` as a `tool` message.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel, field_validator, model_validator

from ember.sampling.params import INT32_MAX, SamplingParams
from ember.sampling.structured import StructuredOutputsParams, check_grammar
from ember.server.protocol import FunctionDefinition, generation_defaults, refuse_unreadable

# Anthropic's SDK rejects nothing here, but its API bounds temperature to [0, 1].
Temperature = Annotated[float, Field(ge=0, le=1)]
SCHEMA_FIELD = "output_config.format.schema"


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(BaseModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n\n".join(b.text for b in self.content)
        text = self.content or ""
        return f"Error: {text}" if self.is_error else text


class Base64ImageSource(BaseModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLImageSource(BaseModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(BaseModel):
    """A user's image: its bytes inline or a URL, read as the OpenAI endpoints read an `image_url` part."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]

    def image_url_part(self) -> dict[str, Any]:
        src = self.source
        url = src.url if isinstance(src, URLImageSource) else f"data:{src.media_type};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}}


ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]
_READABLE_BLOCKS = ("text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _readable_blocks(value: Any) -> Any:
    return refuse_unreadable(
        value,
        _READABLE_BLOCKS,
        "content[{i}] is a {kind!r} block; Ember reads "
        + ", ".join(_READABLE_BLOCKS)
        + " blocks (documents are not supported yet)",
    )


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    _check_blocks = field_validator("content", mode="before")(_readable_blocks)

    @model_validator(mode="after")
    def _images_from_the_user(self) -> InputMessage:
        if self.role == "assistant" and any(isinstance(b, ImageBlock) for b in self.content):
            raise ValueError("content: image blocks belong in user messages")
        return self


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (web search, code execution) carry a `type` and no schema."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None


class JsonOutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's structured outputs: `format` constrains the text to a JSON schema (through llguidance,
    as `response_format` does on the OpenAI endpoints). `effort` has no meaning here and is ignored."""

    format: JsonOutputFormat | None = None


class Metadata(BaseModel):
    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: a conversation without the sampling fields."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    _check_system = field_validator("system", mode="before")(_readable_blocks)

    def chat_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else _joined(self.system)
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            out.extend(_chat_messages(m))
        return out

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as function definitions (the chat template's and the tool grammar's form)."""
        if not self.tools:
            return None
        return [
            FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema).model_dump(
                exclude_none=True
            )
            for t in self.tools
        ]

    def tool_mode(self) -> tuple[str, str | None]:
        """(chat tool choice, forced function name): auto, any -> required, tool -> named, none."""
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto", None
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice.name: required when tool_choice.type is 'tool'")
            return "named", choice.name
        return ("required" if choice.type == "any" else "none"), None

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` as the `enable_thinking` switch that thinking models' templates read (Qwen3)."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return {}
        return {"enable_thinking": self.thinking.type == "enabled"}


class MessagesRequest(CountTokensRequest):
    """Anthropic's fields, plus vLLM's `ignore_eos` extension (as on the OpenAI endpoints): generate
    `max_tokens` tokens whatever the model's end-of-sequence tokens say (benchmarks use it, so that every
    API generates the same lengths)."""

    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    ignore_eos: bool = False

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """Anthropic's default temperature is 1.0; None falls back to the model's generation config, as the
        OpenAI endpoints do."""

        return SamplingParams(
            **generation_defaults(self, defaults),
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            ignore_eos=self.ignore_eos,
            structured_outputs=self._constraint(),
        )

    def _constraint(self) -> StructuredOutputsParams | None:
        if self.output_config is None or self.output_config.format is None:
            return None
        params = StructuredOutputsParams(json=self.output_config.format.schema_)
        check_grammar(params, SCHEMA_FIELD)
        return params

    def constraint_field(self, params: StructuredOutputsParams) -> str:
        return SCHEMA_FIELD


def _joined(blocks: list[TextBlock]) -> str:
    return "\n\n".join(b.text for b in blocks)


def _chat_messages(m: InputMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the user's
    text, as Anthropic requires them first), an assistant's blocks one message with tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    if m.role == "user":
        out: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in m.content
            if isinstance(b, ToolResultBlock)
        ]
        if any(isinstance(b, ImageBlock) for b in m.content):  # the blocks in order, as content parts
            parts = [
                b.image_url_part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                for b in m.content
                if isinstance(b, (ImageBlock, TextBlock))
            ]
            out.append({"role": "user", "content": parts})
        elif texts or not out:
            out.append({"role": "user", "content": "\n\n".join(texts)})
        return out
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in m.content
        if isinstance(b, ToolUseBlock)
    ]
    if calls:
        message["tool_calls"] = calls
    return [message]


# ---- responses -----------------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class ToolUseOutput(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class TextOutput(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOutput(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Ember signs nothing; the SDK's type wants the field


ContentOutput = TextOutput | ThinkingOutput | ToolUseOutput


class MessagesResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOutput]
    stop_reason: str | None = None  # end_turn, max_tokens, stop_sequence, tool_use or refusal
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as Anthropic's `input` object; a call cut off by max_tokens (or one
    whose arguments are not an object) gives what could be read: nothing."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---- stream events -------------------------------------------------------------------------------


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOutput


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: str | None
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body, on this endpoint's HTTP errors and as a stream's `error` event."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


class MessageStreamEvent(
    RootModel[
        Annotated[
            MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping,
            Field(discriminator="type"),
        ]
    ]
):
    """Any event of a streamed message (the OpenAPI document's stream item)."""
