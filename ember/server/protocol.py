"""The OpenAI API schema Ember serves, as pydantic models.

Field names, defaults and shapes follow OpenAI's API (`logit_bias` included, its keys token ids
written as strings) plus vLLM's sampling extensions (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `allowed_token_ids`, `bad_words`, ...), so the official clients work
unchanged. Unknown request fields are ignored, as vLLM does, because clients send parameters that
change nothing (`user`, `store`, `metadata`, ...). Known fields that would change the answer and that
Ember does not implement yet (`best_of` above `n`, `suffix`) are a 400 naming the field, never
silently dropped. Semantic range checks live in `SamplingParams`, the one place the engine trusts;
the models here bound every integer (so none can overflow the 64-bit ints of the core's messages
and tensors) and check types and shapes.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from ember.frontend.processor import GENERATION_FIELDS
from ember.sampling.params import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from ember.sampling.structured import StructuredOutputsParams, check_grammar

# OpenAI's own limit; a larger n would let one request allocate millions of sequences.
MAX_N = 128
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]  # token counts; the processor bounds them by the context
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the processor bounds it by the vocabulary
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
_TOKEN_ID_KEY = re.compile(r"[0-9]+")


def generation_defaults(request: BaseModel, defaults: SamplingParams) -> dict[str, Any]:
    """Each sampling field a model's generation_config.json may set (GENERATION_FIELDS) from the request
    when it sent one, else from `defaults` (the model's value, as in vLLM); an API without the field
    always gets the model's."""
    picked = {name: getattr(request, name, None) for name in GENERATION_FIELDS}
    return {name: getattr(defaults, name) if value is None else value for name, value in picked.items()}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat; None means "the model's generation_config default"."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    # The ranges SamplingParams enforces, stated here too so that /openapi.json describes what is accepted.
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # OpenAI's: token id (a JSON key, so a string) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, LogitBias] | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    # Known to OpenAI's API, not built yet: refused when it would change the answer (see `_unsupported`).
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises ValueError whose message starts with the offending field's name."""
        self._unsupported()

        return SamplingParams(
            n=self.n,
            **generation_defaults(self, defaults),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )

    def _unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of: not supported (best_of={self.best_of} with n={self.n}); send n alone, or best_of equal to n"
            )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids."""
        if not self.logit_bias:
            return None
        for key in self.logit_bias:
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids written as decimal integers, got {key!r}")
        return {int(key): value for key, value in self.logit_bias.items()}

    def constraint(self) -> StructuredOutputsParams | None:
        """`response_format` or `structured_outputs` as checked parameters; a ValueError naming the
        field (`response_format.json_schema.schema`, `structured_outputs.regex`, ...) when llguidance
        cannot compile it."""
        if self.response_format is not None and self.response_format.type != "text":
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs: give either response_format or structured_outputs, not both")
            if self.response_format.type == "json_object":
                params = StructuredOutputsParams(json_object=True)
            elif self.response_format.json_schema is None:
                raise ValueError("response_format.json_schema: required when type is 'json_schema'")
            else:
                params = StructuredOutputsParams(json=self.response_format.json_schema.schema_)
        elif self.structured_outputs is not None:
            so = self.structured_outputs
            params = StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object
            )
        else:
            return None
        check_grammar(params, self.constraint_field(params))
        return params

    def constraint_field(self, params: StructuredOutputsParams) -> str:
        """The request field that `params` (this request's constraint) came from, for error messages."""
        if self.response_format is None or self.response_format.type == "text":
            return f"structured_outputs.{params.kind}"
        return "response_format" if self.response_format.type == "json_object" else "response_format.json_schema.schema"


class CompletionRequest(_SamplingRequest):
    # Token-id prompts come before strings so `[1, 2]` is one token prompt, not an error.
    prompt: (
        Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
        | str
        | Annotated[list[str], Field(min_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = 16
    logprobs: LogprobCount | None = None
    echo: bool = False
    suffix: str | None = None  # not supported: refused when given (as vLLM does)

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix: not supported")
        # With echo, OpenAI's logprobs cover the prompt tokens too.
        return self._sampling_params(defaults, self.max_tokens, self.logprobs, self.logprobs if self.echo else None)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the size


class ImagePart(BaseModel):
    """OpenAI's image part; `image_url` may also be the URL alone, as vLLM accepts. Loaded by
    ember/multimodal/media.py (data:, http(s):// and, where allowed, file:// URLs)."""

    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id) are passed on to the chat template.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _readable_parts(cls, value: Any) -> Any:
        """Say plainly that an audio or file part is not read, rather than "Input should be a valid
        string" from the union's first member."""
        return refuse_unreadable(
            value,
            ("text", "image_url"),
            "content[{i}] is a {kind!r} part; Ember reads text and image_url parts "
            "(audio and files are not supported yet)",
        )


def refuse_unreadable(value: Any, readable: tuple[str, ...], message: str) -> Any:
    """A `before` validator's check of a list of typed parts (content parts, blocks, items, tools): the first
    whose `type` Ember cannot read is a ValueError saying so (`message` formatted with its index `i` and
    `kind`), where pydantic would only say that no member of a union matched."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in readable:
                raise ValueError(message.format(i=i, kind=kind))
    return value


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them (see `with_argument_mappings`)."""
    return with_argument_mappings([m.model_dump(exclude_none=True) for m in messages])


def with_argument_mappings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's tool-call arguments as a mapping (templates write them with `tojson`), as in vLLM
    and transformers; every chat-shaped API's messages pass through here."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text as it came
    return messages


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # None lets the answer run to the end of the context window, as vLLM does.
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool-choice grammar read them, unless tool_choice is none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(BaseModel):
    """Either `prompt` (raw text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # None: True for a raw prompt, False for messages (the template writes its own special tokens).
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Both the whole answer and, when streaming, each chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _drop_unset(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        out["function"] = self.function
        return out


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        # OpenAI sends only what changed: {"role": ...} first, then {"content": ...}, finally {}.
        return {
            k: v
            for k, v in (
                ("role", self.role),
                ("content", self.content),
                ("reasoning_content", self.reasoning_content),
                ("tool_calls", self.tool_calls),
            )
            if v is not None
        }


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"
    root: str  # the weights' path (an adapter's directory for a LoRA adapter)
    parent: str | None = None  # a LoRA adapter's base model id
    max_model_len: int


class LoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies; unloading needs no path)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = Field(default=None, max_length=4096)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
