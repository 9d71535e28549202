"""Sliding-window models in the whole engine: the Triton kernels' path (the interpreter on CPU) against
transformers, and the early release of blocks in a model windowed in every layer."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE
from test_hf_equality import TOP, assert_output_matches, hf_greedy

from ember import LLM, SamplingParams
from ember.ops import registry as backend

WINDOW = 8  # tests/conftest.py's tiny sliding-window checkpoints


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral-sw"])
def test_triton_path_matches_transformers_beyond_the_window(checkpoints, arch, monkeypatch):
    """Prompts from under one window to several, in chunks (a 16-token budget) over blocks of 4: the
    kernels' window edges fall inside and across blocks and tiles; Gemma 2 adds the soft cap."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(11)
    prompts = [[rng.randint(5, 430) for _ in range(n)] for n in (9, 30)]
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype="float32").to(DEVICE)
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    llm = LLM(
        str(checkpoints[arch]),
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        kv_cache_memory=0.02,
        block_size=4,
        max_num_batched_tokens=16,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP),
        use_tqdm=False,
    )
    for prompt, out, (tokens, logprobs) in zip(prompts, outs, refs):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def peak_blocks_while_decoding(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One request stepped to its end: its tokens, and the most KV blocks in use after its prompt."""
    engine = llm.llm_engine
    engine.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    peak, tokens, steps = 0, [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        steps += 1
        if steps > 2:  # past the prompt's own step
            peak = max(peak, round(engine.scheduler_stats().kv_cache_usage * engine.ready.num_blocks))
    assert engine.scheduler_stats().kv_cache_usage == 0.0
    return tokens, peak


def test_blocks_that_leave_every_window_are_released(checkpoints):
    """Mistral windowed in every layer holds about its window's blocks however long it runs, with the
    tokens transformers gives; Gemma 3 (a global layer among sliding ones) must keep every block."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(5, 45))
    total_blocks = (len(prompt) + 40) // 4
    for arch, bound in (("mistral-sw", WINDOW // 4 + 2), ("gemma3", total_blocks)):
        llm = LLM(
            str(checkpoints[arch]),
            device=DEVICE,
            dtype="float32",
            engine_process=False,
            kv_cache_memory=0.02,
            block_size=4,
            enable_prefix_caching=False,
        )
        tokens, peak = peak_blocks_while_decoding(llm, prompt, 40)
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype="float32").to(DEVICE)
        assert tokens == hf_greedy(hf, prompt, 40)[0]
        assert peak <= bound
        if arch == "gemma3":
            assert peak == total_blocks
