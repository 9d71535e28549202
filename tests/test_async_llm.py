"""AsyncLLM: the engine in a background thread, per-request async streams, abort on cancel."""

from __future__ import annotations

import asyncio

import pytest
from test_server_robustness import wait_until

from ember import LLM, AsyncLLM, EngineArgs, SamplingParams
from ember.frontend.errors import QueueFullError, RequestFailedError
from ember.frontend.output import RequestState

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompt(i: int) -> dict:
    return {"prompt_token_ids": [5 + i, 17, 99, 203 - i, 40 + 3 * i]}


@pytest.fixture
def engine(llama_dir):
    eng = AsyncLLM(EngineArgs(model=str(llama_dir), kv_cache_memory=0.05), max_waiting_requests=64)
    yield eng
    asyncio.run(eng.shutdown(1.0))


async def _collect(eng: AsyncLLM, prompt, params=GREEDY, request_id=None):
    deltas, text, last = [], "", None
    async for out in eng.generate(prompt, params, request_id):
        deltas += out.outputs[0].delta_token_ids
        text += out.outputs[0].delta_text
        last = out
    return deltas, text, last


def test_concurrent_streams_match_offline(llama_dir, engine):
    offline = LLM(str(llama_dir), kv_cache_memory=0.05).generate(
        [_prompt(i) for i in range(10)], GREEDY, use_tqdm=False
    )

    async def main():
        return await asyncio.gather(*[_collect(engine, _prompt(i)) for i in range(10)])

    for (deltas, text, last), ref in zip(asyncio.run(main()), offline):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert deltas == last.outputs[0].token_ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text


def test_a_slow_consumer_gets_joined_deltas(llama_dir, engine):
    """While the consumer is busy the engine makes no new output for it, and the next one carries the
    deltas of every step since: fewer yields than tokens, exactly the same tokens and text."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(str(llama_dir), kv_cache_memory=0.05).generate([_prompt(3)], params, use_tqdm=False)[0].outputs[0]

    async def slow():
        deltas, text, yields = [], "", 0
        async for out in engine.generate(_prompt(3), params):
            yields += 1
            deltas += out.outputs[0].delta_token_ids
            text += out.outputs[0].delta_text
            await asyncio.sleep(0.05)
        return deltas, text, yields

    deltas, text, yields = asyncio.run(slow())
    assert deltas == ref.token_ids and text == ref.text
    assert yields < len(ref.token_ids)


def test_cancel_aborts_and_frees_blocks(engine):
    async def main():
        async def consume():
            async for _ in engine.generate(_prompt(1), SamplingParams(max_tokens=900, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        assert engine.scheduler_stats.kv_cache_usage > 0  # the core's stats, sent with every step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if engine.scheduler_stats.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.02)
        stats = await engine.call_utility("stats")  # asked, not pushed: the core's state now
        return stats

    stats = asyncio.run(main())
    assert engine.scheduler_stats.kv_cache_usage == 0 and engine.scheduler_stats.num_running == 0
    assert stats[2] == 0.0  # kv_cache_usage, third of SchedulerStats' fields on the wire


def test_validation_errors_raise_in_caller(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await _collect(engine, "")
        with pytest.raises(ValueError, match="maximum context length"):
            await _collect(engine, _prompt(0), SamplingParams(max_tokens=5000))

    asyncio.run(main())


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_full_queue_rejects(llama_dir):
    eng = AsyncLLM(EngineArgs(model=str(llama_dir), kv_cache_memory=0.05, max_num_seqs=1), max_waiting_requests=2)

    async def main():
        long = SamplingParams(max_tokens=1000, ignore_eos=True)
        tasks = [asyncio.create_task(_collect(eng, _prompt(0), long))]
        await _until(lambda: eng.scheduler_stats is not None and eng.scheduler_stats.num_running == 1)
        tasks += [asyncio.create_task(_collect(eng, _prompt(i), long)) for i in (1, 2)]
        await asyncio.sleep(0)  # both send their requests: the first runs (max_num_seqs=1), two wait,
        assert eng.num_waiting == 2  # counted at once, even if a step's stats from before they arrived come later
        with pytest.raises(QueueFullError):
            await _collect(eng, _prompt(9))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await eng.shutdown(1.0)

    asyncio.run(main())


def test_one_failing_request_does_not_stop_others(engine, monkeypatch):
    real = RequestState.update

    def flaky(self, seq, out, now, stats):
        if self.request_id == "bad" and len(seq.token_ids) >= 3:
            raise RuntimeError("boom in output processing")
        return real(self, seq, out, now, stats)

    monkeypatch.setattr(RequestState, "update", flaky)

    async def main():
        bad = asyncio.create_task(_collect(engine, _prompt(2), request_id="bad"))
        good = asyncio.create_task(_collect(engine, _prompt(3), request_id="good"))
        with pytest.raises(RequestFailedError, match="boom"):
            await bad
        deltas, _, last = await good
        assert last.outputs[0].finish_reason == "length" and len(deltas) == 16
        deltas, _, last = await _collect(engine, _prompt(4))
        assert len(deltas) == 16

    asyncio.run(main())
    wait_until(lambda: engine.scheduler_stats.kv_cache_usage == 0)


def test_shutdown_finishes_running_then_refuses(llama_dir):
    eng = AsyncLLM(EngineArgs(model=str(llama_dir), kv_cache_memory=0.05))

    async def main():
        running = asyncio.create_task(_collect(eng, _prompt(5), SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await eng.shutdown(timeout=30.0)
        deltas, _, last = await running
        assert last.outputs[0].finish_reason == "length" and len(deltas) == 40
        assert not eng.is_ready
        with pytest.raises(RuntimeError, match="shutting down"):
            await _collect(eng, _prompt(6))

    asyncio.run(main())


def test_metrics_follow_traffic(engine):
    from prometheus_client import generate_latest

    asyncio.run(_collect(engine, _prompt(7)))
    text = generate_latest(engine.metrics_registry).decode()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ember:") and "{" in line and "bucket" not in line and "reason" not in line
    }
    assert values["ember:generation_tokens_total"] == 16
    assert values["ember:prompt_tokens_total"] == 5
    assert values["ember:time_to_first_token_seconds_count"] == 1
    assert values["ember:inter_token_latency_seconds_count"] == 15
    assert values["ember:e2e_request_latency_seconds_count"] == 1
    assert 'ember:request_success_total{finished_reason="length"' in text
    for name in (
        "ember:num_requests_running",
        "ember:num_requests_waiting",
        "ember:kv_cache_usage_perc",
        "ember:prefix_cache_queries_total",
        "ember:prefix_cache_hits_total",
    ):
        assert name in values
