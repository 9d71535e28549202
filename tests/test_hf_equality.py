"""Greedy decoding must match Hugging Face transformers token for token, with close logprobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, DEVICE, default_gguf_path

from ember import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "def add(a, b):\n    return",
    "你好，世界",
    "Large language models generate text one token at a time. " * 6,
]
NUM_TOKENS = 64
TOP = 5


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    model.generation_config.eos_token_id = None  # the equivalent of ignore_eos
    ids = torch.tensor([prompt_ids], device=DEVICE)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).cpu()
    return tokens, logprobs


def hf_references(
    checkpoints: dict[str, Path], prompts: list[dict], num_tokens: int
) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """HF's greedy tokens and logprobs (float32) for every checkpoint and token-id prompt."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch, path in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(DEVICE)
        refs[arch] = [hf_greedy(hf, p["prompt_token_ids"], num_tokens) for p in prompts]
    return refs


def assert_matches_hf(llm: LLM, hf_model, prompts: list[str], chat: bool = False) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert_output_matches(out.outputs[0], *hf_greedy(hf_model, out.prompt_token_ids, NUM_TOKENS), prompt)


# Two candidates closer than this in transformers' logprobs are a tie: float32 sums in another order (another
# kernel, another device) may pick either. A random tiny DeepSeek-V2-Lite on an H100 met one 9.5e-7 apart,
# every logprob within 1.9e-6 of transformers' (2026-12-07).
TIE = 1e-5


def assert_output_matches(got, ref_tokens: list[int], ref_logprobs: torch.Tensor, prompt: object) -> None:
    """An Ember completion (greedy, logprobs=TOP) against hf_greedy's tokens and logprobs: the same tokens,
    or the same up to a step where transformers' pick and Ember's tie (TIE); top-TOP logprobs within 2e-3
    up to there."""
    assert len(got.token_ids) == len(ref_tokens) and got.finish_reason == "length"
    steps = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref_tokens)) if a != b), None)
    if steps is not None:
        gap = (ref_logprobs[steps][ref_tokens[steps]] - ref_logprobs[steps][got.token_ids[steps]]).item()
        assert gap < TIE, f"prompt {prompt!r} diverged from transformers at step {steps} (logprob gap {gap:.2e})"
    for step, (token, lp) in enumerate(zip(got.token_ids[: None if steps is None else steps + 1], got.logprobs)):
        ref_top = torch.topk(ref_logprobs[step], TOP)
        ours = {tid: v.logprob for tid, v in lp.items()}
        for tid, ref in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
            assert ours[tid] == pytest.approx(ref, abs=2e-3), f"step {step}"
        assert lp[token].rank == 1


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_checkpoints_match_transformers(checkpoints, arch):
    from transformers import AutoModelForCausalLM

    path = str(checkpoints[arch])
    llm = LLM(path, kv_cache_memory=0.05, max_num_batched_tokens=64, device=DEVICE, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    assert_matches_hf(llm, hf, PROMPTS)


def test_default_gguf_matches_transformers():
    """Dequantized to float32, as HF loads it, the default model matches HF token for token. (Kept
    quantized, the default, its int4 kernels round activations to bf16 on CPU: tests/test_quantization.py
    bounds that against this float model.)"""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    llm = LLM(kv_cache_memory=0.25, max_model_len=2048, device=DEVICE, dtype="float32", quantization="none")
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).to(DEVICE)
    tok = llm.get_tokenizer()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("What is the capital of France?", "Write a haiku about the sea.", "用中文介绍一下你自己。")
    ]
    assert_matches_hf(llm, hf, ["The history of the Roman Empire", "def fibonacci(n):"] + chats)


def test_prompt_logprobs_match_transformers(checkpoints):
    from transformers import AutoModelForCausalLM

    path = str(checkpoints["qwen2"])
    # A small token budget splits the prompt over several chunks; the repeat would hit the prefix cache.
    llm = LLM(path, kv_cache_memory=0.05, max_num_batched_tokens=16, device=DEVICE, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    prompt = {"prompt_token_ids": [(7 * i + 3) % 500 + 5 for i in range(45)]}
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    ids = prompt["prompt_token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids], device=DEVICE)).logits[0].float(), dim=-1).cpu()
    for out in (first, again):
        assert out.num_cached_tokens == 0
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=2e-3)
            assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
            top = torch.topk(ref[pos - 1], 3).indices.tolist()
            assert set(top) <= set(entry)
