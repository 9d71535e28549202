"""The bf16-screened greedy argmax picks exactly the float32 head's token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import DEVICE, inproc_core

from ember import LLM, SamplingParams
from ember.ops.screened_argmax import ScreenedArgmax


def test_screen_matches_float32_argmax_on_near_ties() -> None:
    """Rows that differ from the best only below bf16's resolution: the screen cannot tell them
    apart, so the float32 recomputation must."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 256, generator=gen) * 0.05
    x = torch.randn(64, 256, generator=gen) * 10
    best = F.linear(x, weight).argmax(dim=1)
    for token in best.tolist():
        twin = (token * 7 + 1) % weight.shape[0]
        weight[twin] = weight[token] + 1e-5 * torch.randn(256, generator=gen)
    screened = ScreenedArgmax(weight)
    assert torch.equal(screened(x), F.linear(x, weight).argmax(dim=1))
    assert torch.equal(screened(x[:1]), F.linear(x[:1], weight).argmax(dim=1))


def test_screen_keeps_the_first_of_exact_ties() -> None:
    weight = torch.randn(100, 32, generator=torch.Generator().manual_seed(1))
    weight[70] = weight[40] = weight[F.linear(torch.ones(1, 32), weight).argmax()]
    assert ScreenedArgmax(weight)(torch.ones(1, 32)).item() == F.linear(torch.ones(1, 32), weight).argmax().item()


def test_default_model_greedy_tokens_match_full_logits(monkeypatch) -> None:
    """Plain greedy requests take the screen; asking for logprobs forces every float32 logit
    through the sampler. Both must choose the same tokens. The screen serves the PyTorch path, the
    one without the native CPU kernels (which compute the head's logits exactly, tests/test_cpu_native.py)."""
    monkeypatch.setenv("EMBER_CPU_NATIVE", "0")
    default_llm = LLM(kv_cache_memory=0.05, max_model_len=256, device=DEVICE, dtype="float32", engine_process=False)
    head = inproc_core(default_llm).runner.model.model.embed_tokens
    assert head.screen is not None
    prompts = ["What is the capital of France?", "The history of the Roman Empire"] * 2
    plain = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    full = default_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in full]
