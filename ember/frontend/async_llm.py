"""`AsyncLLM`: the engine for asyncio programs (the HTTP server, or any user service).

The engine core runs in its own process by default (`engine_process=False` keeps it in a thread
of this one), so a step's compute never competes with the event loop. Requests are tokenized and
validated in the caller's task (errors surface there at once) and sent to the core. An output
thread receives each step's outputs, detokenizes them and checks stop strings (off the event
loop's thread), then wakes the streams that changed, one wake-up per event loop per step. A
stream's consumer builds its `RequestOutput` when it wakes, covering every step since it last
read: a slow reader gets fewer, larger deltas instead of a queue. Cancelling the consuming task
aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator

from ember import timeline
from ember.config import EngineArgs
from ember.frontend.core_client import EngineCoreClient, make_client
from ember.frontend.errors import EngineDeadError, QueueFullError, RequestFailedError
from ember.frontend.metrics import IterationStats, PrometheusStatLogger
from ember.frontend.output import OutputProcessor, RequestOutput, RequestState
from ember.frontend.processor import ModelFacts, Processor, PromptType, load_content_filter, needs_tokenizing
from ember.lora.request import LoRARequest
from ember.messages import (
    AbortRequests,
    CoreOutput,
    EngineCoreFailed,
    EngineCoreOutputs,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from ember.model.files import load_model_info
from ember.multimodal.media import MediaConnector
from ember.pooling.params import PoolingParams
from ember.pooling.score import ScoreConfig
from ember.sampling.params import SamplingParams

logger = logging.getLogger("ember")
# How often the output thread looks up from an idle core to check for shutdown, which waits for its next
# look: at 0.5 s an idle SIGTERM took 1.1-1.3 s on CPU, at 0.1 s (and the core skipping its interpreter
# teardown) 0.4-0.5 s, measured 2026-12-05; ten zmq polls a second cost nothing measurable.
_OUTPUT_POLL_S = 0.1


class _Stream:
    """A request's link to its consumer: the output thread sets `woken`, the consumer reads the state."""

    def __init__(self, state: RequestState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.loop = loop
        self.event = asyncio.Event()
        self.notified = False  # a wake-up is on its way or unread (guarded by AsyncLLM._lock)
        self.error: BaseException | None = None


class AsyncLLM(ModelFacts):
    def __init__(
        self,
        args: EngineArgs,
        max_waiting_requests: int | None = None,
        served_model_name: str | None = None,
        client: EngineCoreClient | None = None,
        processor: Processor | None = None,
    ) -> None:
        """Blocks until the engine core is ready. `client` is a core client started earlier (so that
        `ember serve` can load the model while it imports the web stack), and `processor` the input side
        of a front end already on it (`LLM.run_batch` drives the LLM's engine so), whose tokenizer,
        content filter and grammar checks are then shared instead of loaded again."""
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.client = client or make_client(args, args.engine_process is not False)
        try:
            self.processor = processor or _load_processor(args, self.client)
        except BaseException:  # the model cannot load here either: no point waiting for the core
            self.client.shutdown(timeout=0)
            raise
        self.ready = self.client.ready
        self.score_config = ScoreConfig.parse(args.score_config or ScoreConfig())  # /v1/score and /rerank
        self.served_model_name = served_model_name or args.served_model_name or str(args.model or "default")
        self.max_waiting_requests = max_waiting_requests
        self.metrics = PrometheusStatLogger(self.served_model_name)
        self.metrics_registry = self.metrics.registry
        self.scheduler_stats: SchedulerStats | None = None
        self.output_processor = OutputProcessor()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the output processor, the streams' flags and the client's socket
        self._num_sent = 0  # add-request messages sent to the core
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._accepting = True
        self._closing = False
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._run_output_thread, name="ember-output", daemon=True)
        self._thread.start()

    # ---- what front ends read -------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core stopped, once it has (its process died, or its loop failed)."""
        return self._dead

    @property
    def num_live_requests(self) -> int:
        """Requests this front end still tracks (streams and output states): 0 once every request has
        ended, however it ended."""
        with self._lock:
            return len(self._streams) + len(self.output_processor.requests)

    @property
    def num_waiting(self) -> int:
        """Requests the core has not started yet, as of its last stats, plus those sent that those stats
        had not yet counted (a step's outputs can arrive after later adds were sent)."""
        stats = self.scheduler_stats
        if stats is None:
            return self._num_sent
        return stats.num_waiting + self._num_sent - stats.num_requests_received

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput each time the request makes progress; the last has `finished=True`.
        With `pooling_params` it is an embedding request: one output, with `embedding` set."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._accepting:
            raise RuntimeError("the engine is shutting down and accepts no new requests")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting} requests are already waiting (--max-waiting-requests {self.max_waiting_requests})"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Tokenizing a long prompt, checking a new grammar or adapter, or loading and resizing images takes
        # milliseconds: off the event loop.
        if (
            needs_tokenizing(prompt)
            or (isinstance(prompt, dict) and prompt.get("multi_modal_data"))
            or (sampling_params is not None and sampling_params.structured_outputs)
            or lora_request is not None
        ):
            processed = await asyncio.to_thread(
                self.processor.process, request_id, prompt, sampling_params, None, lora_request, pooling_params
            )
        else:  # token ids need ~35 us of checks, far less than a thread hop and its GIL hand-offs
            processed = self.processor.process(request_id, prompt, sampling_params, pooling_params=pooling_params)
        stream = _Stream(processed.state, asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.output_processor.add(processed.state)
            self._streams[request_id] = stream
        finished = False
        try:  # from here on, however the request ends, `_end_stream` forgets it here and in the core
            with self._lock:
                for core_request in processed.core_requests:
                    self.client.send(core_request)
                    self._num_sent += 1
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                with self._lock:
                    stream.notified = False
                    if stream.error is not None:
                        finished = True
                        raise stream.error
                    out = stream.state.output()
                finished = out.finished
                if out.error is not None:
                    raise RequestFailedError(out.error)
                yield out
        finally:
            self._end_stream(request_id, aborted=not finished)

    def _end_stream(self, request_id: str, aborted: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            if not aborted:
                return
            stats = self._abort_locked(request_id)
        self.metrics.record_iteration(stats)

    async def abort(self, request_id: str) -> None:
        """End a request now; its stream ends with finish_reason "abort"."""
        with self._lock:
            stats = self._abort_locked(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                self._wake([stream])
        self.metrics.record_iteration(stats)

    def _abort_locked(self, request_id: str) -> IterationStats:
        """End a request here and in the core; the sequences it ended, for the metrics. Lock held."""
        _, running, stats = self.output_processor.abort(request_id, time.monotonic())
        if running and self._dead is None:
            self.client.send(AbortRequests(running))
        return stats

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    async def call_utility(self, method: str, *args: object) -> object:
        """Run `method` on the engine core between steps and return its result."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
            self.client.send(UtilityCall(call_id, method, list(args)))
        return await future

    async def shutdown(self, timeout: float = 30.0, stop_core: bool = True) -> None:
        """Stop accepting, let running requests finish for up to `timeout` seconds, abort the rest, stop
        (the core too, unless another front end still uses it: `stop_core=False`)."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:  # noqa: ASYNC110 - the output thread ends the streams; polling keeps shutdown's deadline simple
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            await self.abort(request_id)
        self._closing = True
        await asyncio.to_thread(self._thread.join, 5.0)
        if stop_core:
            await asyncio.to_thread(self.client.shutdown)

    # ---- output thread --------------------------------------------------------------------

    def _run_output_thread(self) -> None:
        while not self._closing and self._dead is None:
            messages = self.client.get_output(timeout=_OUTPUT_POLL_S)
            try:
                self._handle(messages)
            except Exception as e:  # a front-end bug: fail every stream rather than hang them
                logger.exception("output processing failed")
                self._fail_all(f"{type(e).__name__}: {e}")

    def _handle(self, messages: list[CoreOutput]) -> None:
        for message in messages:
            if isinstance(message, EngineCoreOutputs):
                self._on_outputs(message)
            elif isinstance(message, UtilityResult):
                self._on_result(message)
            elif isinstance(message, EngineCoreFailed):
                self._fail_all(message.message)

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            processed = self.output_processor.process(message)
            if processed.to_abort:
                self.client.send(AbortRequests(processed.to_abort))
            self.scheduler_stats = message.stats
            self._wake([s for state in processed.changed if (s := self._streams.get(state.request_id))])
        self.metrics.record_scheduler(message.stats)
        self.metrics.record_iteration(processed.stats)

    def _wake(self, streams: list[_Stream]) -> None:
        """One call into each event loop for all of its streams (hundreds per step at full batch).
        Call with the lock held."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Stream]] = {}
        for stream in streams:
            if not stream.notified:
                stream.notified = True
                by_loop.setdefault(stream.loop, []).append(stream)
        for loop, woken in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_events, woken)
            except RuntimeError:  # the consumer's event loop is closed; nobody is listening
                pass

    def _on_result(self, result: UtilityResult) -> None:
        with self._lock:
            caller = self._calls.pop(result.call_id, None)
        if caller is None:  # a call nobody waits for (the client's own shutdown call)
            return
        loop, future = caller
        error = None if result.error is None else RuntimeError(result.error)
        loop.call_soon_threadsafe(_settle, future, result.result, error)

    def _fail_all(self, message: str) -> None:
        logger.error("engine core failed: %s; failing every request", message)
        with self._lock:
            self._dead = message
            for stream in self._streams.values():
                stream.error = EngineDeadError(f"the engine stopped: {message}")
            self._wake(list(self._streams.values()))
            calls, self._calls = self._calls, {}
        for loop, future in calls.values():
            loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(message))


def _load_processor(args: EngineArgs, client: EngineCoreClient) -> Processor:
    content_filter = load_content_filter(args.blocked_words)
    info = load_model_info(args.load_config(), args.chat_template)
    timeline.mark("tokenizer loaded")
    ready = client.wait_ready()
    timeline.mark("core ready received")
    return Processor(info, ready, content_filter, MediaConnector.of(args))


def _set_events(streams: list[_Stream]) -> None:
    for stream in streams:
        stream.event.set()


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
