"""The whole GPU code path (Triton kernels for norms, rotary, KV store, paged decode and chunked-prefill
attention) inside the real engine, checked against the PyTorch path token for token.

On a machine without a GPU the kernels run through Triton's interpreter on CPU tensors."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE

from ember import LLM, SamplingParams
from ember.ops import registry as backend


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setattr(backend, "FORCE_TRITON", True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_matches_torch_engine(checkpoints, arch, monkeypatch):
    rng = random.Random(5)
    # Mixed lengths, a shared prefix (prefix-cache hits) and a small budget (chunked prefill + decodes).
    shared = [rng.randint(5, 500) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared + [rng.randint(5, 500) for _ in range(n)]} for n in (1, 9, 30)]
    prompts += [{"prompt_token_ids": [rng.randint(5, 500) for _ in range(n)]} for n in (3, 70)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run() -> list:
        llm = LLM(
            str(checkpoints[arch]), kv_cache_memory=0.02, max_num_batched_tokens=48, dtype="float32", device=DEVICE
        )
        return llm.generate(prompts, params, use_tqdm=False)

    torch_outs = run()
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    triton_outs = run()
    for a, b in zip(torch_outs, triton_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid, lp in la.items():
                assert lb[tid].logprob == pytest.approx(lp.logprob, abs=1e-3)
