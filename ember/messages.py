"""The engine core's whole interface: the messages a front end and an `EngineCore` exchange.

The core sees token ids, never text; the front end sees these structs, never tensors or engine
objects. Each is a msgspec Struct sent as msgpack with its fields by position (`array_like`), so
the same types serve the in-process client (passed as objects) and the core process (bytes over
ZMQ). Tagged unions let one socket carry every kind of message in each direction.

Front end -> core: `EngineCoreRequest`, `AbortRequests`, `UtilityCall`.
Core -> front end: `EngineCoreReady` once, then `EngineCoreOutputs` per step (with the scheduler's
stats) and `UtilityResult`s; `EngineCoreFailed` when the core cannot start or stops on an error.
A core in its own process also sends an `EngineCoreHeartbeat` every second once ready; `MPClient`
consumes them (its hang detection), so front ends never see one.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from typing import IO, Any

import msgspec

from ember.config import EngineConfig
from ember.lora.peft import LoRAShapes
from ember.lora.request import LoRARequest
from ember.multimodal.inputs import ImageInput, VisionFacts
from ember.pooling.params import PoolingParams
from ember.sampling.params import SamplingParams


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every message: fields by position on the wire, the class name as the tag."""


class EngineCoreRequest(_Message):
    """One sequence to generate. A prompt with `n > 1` reaches the core as n requests."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # text-only fields (stop strings) stripped by the front end
    max_tokens: int  # resolved: the request's own, or what the context window leaves
    eos_token_ids: list[int]
    arrival_time: float  # time.monotonic() of the front end (one clock per machine)
    lora_request: LoRARequest | None = None  # the adapter to run under (None: the base model)
    # set: an embedding request; its prompt is computed, never sampled from, and it ends with the pooled vector
    pooling_params: PoolingParams | None = None
    images: list[ImageInput] = []  # the prompt's images, in prompt order (a vision model's)


class AbortRequests(_Message):
    """End these requests now and free their KV blocks (client gone, stop string found, ...)."""

    request_ids: list[str]


class UtilityCall(_Message):
    """A call outside the request flow; answered by a `UtilityResult` with the same `call_id`."""

    call_id: int
    method: str  # see EngineCore.UTILITIES
    args: list[Any] = []


class Logprobs(_Message):
    """Logprobs of consecutive positions as flat lists: per position the chosen token (sampled, or
    the prompt's next token) first, then the top-N by logprob; and the chosen token's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(_Message):
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None  # one row per new token, when the request asked for logprobs
    # the prompt positions computed this step (prompt token i's logprob for i = 1, 2, ..., continuing
    # where the previous message left off), when the request asked for prompt logprobs
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended the request
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    error: str | None = None  # the request failed inside the core (finish_reason is then "abort")
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step
    num_accepted_tokens: int = 0  # of which the model accepted
    embedding: list[float] | None = None  # a pooling request's vector, in its finishing output


class SpecDecodeStats(_Message):
    """Speculative decoding's counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int  # draft runs verified: a request's drafts in one step
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]  # accepted at draft position 0, 1, ...


class SchedulerStats(_Message):
    """The core's state after a step; counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0 to 1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_steps: int  # steps that ran the model
    num_requests_received: int = 0  # add-request messages taken in, rejected ones too
    gpu_busy_s: float = 0.0  # CUDA: time the GPU spent in steps' work
    gpu_idle_s: float = 0.0  # CUDA: time the GPU waited for the host between steps
    gpu_mask_wait_s: float = 0.0  # CUDA: time the GPU waited inside steps for grammar masks
    num_requests: int = 0  # requests the core holds in any state (0 when idle: nothing left behind)
    num_encoded_images: int = 0  # images run through the vision tower (one whose output was cached runs none)
    num_pinned_images: int = 0  # tower outputs kept for requests that have computed part of the image
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding


class EngineCoreOutputs(_Message):
    """One step's outputs; a message with no outputs carries fresh stats (after aborts, when idle)."""

    outputs: list[EngineCoreOutput]
    timestamp: float  # time.monotonic() when the step's tokens were known
    stats: SchedulerStats


class UtilityResult(_Message):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreReady(_Message):
    """Facts fixed for the core's lifetime, sent once when it is ready for requests."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    device: str
    dtype: str
    kv_cache_dtype: str
    quantization: str
    weight_bytes: int
    bytes_per_block: int
    cuda_graphs: bool
    async_scheduling: bool
    tensor_parallel_size: int
    description: str  # the one start-up log line
    hidden_size: int = 0  # the length of a pooled vector (`dimensions` may ask for fewer)
    pooling_type: str = "LAST"  # how pooling requests are pooled (PoolerConfig.pooling_type)
    runner: str = "generate"  # "pooling": embeddings and scores only (an encoder, or --runner pooling)
    encoder: bool = False  # an encoder model (BERT, XLM-R): whole prompts, pooling only
    num_labels: int = 0  # an encoder's classifier labels (1: a cross-encoder reranker); 0: none
    lora: LoRAShapes | None = None  # with --enable-lora: what an adapter must fit (the front end checks it)
    vision: VisionFacts | None = None  # a vision model's placeholder and image size (the front end expands them)
    # the core process's start-up moments (ember.timeline), added by ember.core.process when it sends this
    timeline: list[tuple[str, float]] = []

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class EngineCoreFailed(_Message):
    """The core could not start, or its loop stopped on an error: no request can run any more."""

    message: str  # the exception, as `Type: text`


class EngineCoreHeartbeat(_Message):
    """The core process is alive and where its loop stands; sent by a thread of its own about once a
    second after `EngineCoreReady` (never by an in-process core)."""

    iteration: int  # the number of the CoreLoop's current iteration (it counts up from 1)
    step_s: float = 0.0  # how long that iteration has been working; 0 while the loop waits for input


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall
CoreOutput = EngineCoreOutputs | UtilityResult | EngineCoreReady | EngineCoreFailed | EngineCoreHeartbeat

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: CoreInput | CoreOutput) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes | memoryview) -> CoreInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes | memoryview) -> CoreOutput:
    return _output_decoder.decode(data)


# ---- the client a front end holds ----------------------------------------------------------------


class EngineCoreClient(ABC):
    """How a front end talks to its core, wherever the core runs: `ember.frontend.core_client.MPClient`
    (its own process) or `ember.core.inproc_client.InprocClient` (this process)."""

    ready: EngineCoreReady
    failure: str | None = None  # set once the core has stopped on an error

    @abstractmethod
    def wait_ready(self, timeout: float | None = None) -> EngineCoreReady:
        """The core's fixed facts once it is ready; EngineStartError when it could not start."""

    @abstractmethod
    def send(self, message: CoreInput) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> list[CoreOutput]:
        """The core's next outputs, or [] when none came within `timeout` seconds (None: no limit
        while the core has work; an idle in-process core returns at once)."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """End the core (and its tensor-parallel ranks). Idempotent."""

    @property
    def is_alive(self) -> bool:
        return self.failure is None


# ---- start-up of a core process -------------------------------------------------------------------

BOOTSTRAP_LENGTH = struct.Struct("<I")


class CoreBootstrap(msgspec.Struct):
    """What a core process reads from its stdin first (length-prefixed msgpack)."""

    config: EngineConfig  # the core's part of the user's flags (`EngineArgs.engine_config`)
    input_address: str  # the front end's PUSH socket, bound
    output_address: str  # the front end's PULL socket, bound
    heartbeat_interval: float = 1.0  # seconds between heartbeats once ready; 0: none

    def write(self, stream: IO[bytes]) -> None:
        data = msgspec.msgpack.encode(self)
        stream.write(BOOTSTRAP_LENGTH.pack(len(data)) + data)
        stream.flush()
