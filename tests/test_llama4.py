"""Llama 4's text model against transformers: Llama4ForCausalLM, and the language model of a
Llama4ForConditionalGeneration checkpoint (its vision tower skipped).

The tiny checkpoint (tests/conftest.py, "llama4") has three rope layers attending within chunks of 8
positions behind the weightless QK norm, one global NoPE layer with temperature-tuned queries, and MoE
layers (top-1 of 4 experts, a sigmoid gate on the expert's input, a shared expert) between dense ones;
prompts of 3 to 43 tokens plus 24 generated ones cross several chunks. Greedy tokens equal transformers'
in float32 with top-5 logprobs within 2e-3, batched, with chunked prefill and prefix-cache hits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, make_checkpoint
from test_hf_equality import assert_output_matches, hf_references
from test_kernels import INTERPRETED  # sets TRITON_INTERPRET before ember.kernels is imported
from test_new_archs import GREEDY, NUM_TOKENS, PROMPTS

from ember import LLM
from ember.model.hf_config import ModelConfig
from ember.model.llama4 import interleaved_to_halves
from ember.model.moe import SparseMoeBlock
from ember.model.sharding import ShardLayout
from ember.ops import registry


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama4") / "llama4", "llama4")


@pytest.fixture(scope="module")
def references(checkpoint) -> list[tuple[list[int], torch.Tensor]]:
    return hf_references({"llama4": checkpoint}, PROMPTS, NUM_TOKENS)["llama4"]


def _llm(path: Path, **kwargs) -> LLM:
    args = dict(block_size=8, max_num_batched_tokens=16, kv_cache_memory=0.02)
    return LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, **{**args, **kwargs})


def test_matches_transformers_batched_chunked_and_prefix_cached(checkpoint, references):
    """Six prompts at once, prefilled 16 tokens a step; the last three share a 20-token prefix, so the
    later ones start from cached blocks (mid-chunk: 16 cached positions of a chunk of 8 = two whole
    chunks), and a second round finds every prompt's full blocks cached."""
    llm = _llm(checkpoint)
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references):
            assert_output_matches(out.outputs[0], tokens, logprobs, prompt)
    assert llm.llm_engine.scheduler_stats().prefix_cache_hits > 0


def test_one_prompt_at_a_time_without_prefix_caching(checkpoint, references):
    llm = _llm(checkpoint, enable_prefix_caching=False, max_num_batched_tokens=256)
    for prompt, (tokens, logprobs) in zip(PROMPTS[2:4], references[2:4]):
        assert_output_matches(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0], tokens, logprobs, prompt)


def test_triton_path_matches_transformers(checkpoint, references, monkeypatch):
    """The GPU code path in the engine (on CPU: Triton's interpreter): chunked decode and prefill kernels,
    the fused rotary, weightless QK norm and store, the fused MoE kernels with sigmoid-input routing."""
    if not (INTERPRETED or torch.cuda.is_available()):
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET")
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    prompts = [PROMPTS[1], PROMPTS[5]]  # 11 and 43 tokens: prefilled over three steps beside the other's decodes
    outs = _llm(checkpoint, max_num_batched_tokens=24).generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(prompts, outs, [references[1], references[5]]):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def test_conditional_generation_checkpoint_loads_its_language_model(checkpoint, references, tmp_path):
    """Llama4ForConditionalGeneration with the causal checkpoint's weights as its language model: Ember
    loads the text model alone (the vision tower and projector skipped) and generates the same tokens."""
    from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration

    text = Llama4ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    vision = dict(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.config.to_dict(), vision_config=vision))
    model.language_model.load_state_dict(text.state_dict())
    path = tmp_path / "llama4-cg"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((checkpoint / name).read_bytes())
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]

    outs = _llm(path).generate(PROMPTS[:3], GREEDY, use_tqdm=False)

    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def test_config_follows_transformers_defaults():
    """Every 4th layer NoPE (global), the others chunked; MoE every `interleave_moe_layer_step`-th layer;
    a multimodal config's text_config read."""
    text = dict(num_hidden_layers=8, interleave_moe_layer_step=2, attention_chunk_size=16, hidden_size=64)
    cfg = ModelConfig.from_hf_config({"architectures": ["Llama4ForConditionalGeneration"], "text_config": text})
    assert cfg.nope_layers == (3, 7)
    assert [cfg.layer_chunk(i) for i in range(8)] == [16, 16, 16, None, 16, 16, 16, None]
    assert [cfg.layer_is_moe(i) for i in range(8)] == [False, True] * 4
    assert cfg.moe is not None and cfg.moe.routing == "sigmoid-input" and cfg.moe.shared_expert_intermediate_size
    assert cfg.attn_temperature == (8192.0, 0.1) and cfg.weightless_qk_norm
    assert cfg.intermediate_size == 16384 and cfg.moe.intermediate_size == 8192  # dense layers, experts
    unchunked = ModelConfig.from_hf_config(
        {"architectures": ["Llama4ForCausalLM"], **text, "attention_chunk_size": None}
    )
    assert all(unchunked.layer_chunk(i) is None for i in range(8))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config({"architectures": ["Llama4ForCausalLM"], **text, "hidden_act": "gelu"})


def test_interleaved_rows_become_halves():
    """Channel 2i of a head moves to i, 2i + 1 to D/2 + i: Ember's rotary then pairs what Llama 4's does."""
    w = torch.arange(2 * 8).float()[:, None]  # two heads of 8
    assert interleaved_to_halves(w, 8).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("triton", [False, True])
def test_moe_block_matches_transformers(monkeypatch, top_k: int, triton: bool):
    """Ember's MoE block (sigmoid-input routing, shared expert) against transformers' Llama4TextMoe, on
    the experts' PyTorch path and the fused MoE kernels (the interpreter, on CPU)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    if triton and not (INTERPRETED or torch.cuda.is_available()):
        pytest.skip("the fused MoE kernels need a GPU or TRITON_INTERPRET")
    monkeypatch.setattr(registry, "FORCE_TRITON", triton)
    hidden, inter, experts = 32, 16, 4
    text = dict(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    hf = Llama4TextMoe(Llama4TextConfig(**text))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    cfg = ModelConfig.from_hf_config({"architectures": ["Llama4ForCausalLM"], **text, "num_hidden_layers": 1})
    block = SparseMoeBlock(cfg, ShardLayout.of(cfg, 0, 1), layer=0)
    with torch.no_grad():
        block.gate.weight.copy_(hf.router.weight)
        assert block.shared_expert is not None
        block.shared_expert.gate_up_proj.weight.copy_(
            torch.cat([hf.shared_expert.gate_proj.weight, hf.shared_expert.up_proj.weight])
        )
        block.shared_expert.down_proj.weight.copy_(hf.shared_expert.down_proj.weight)
        block.experts.materialize()
        assert isinstance(block.experts.w13, torch.Tensor) and isinstance(block.experts.w2, torch.Tensor)
        block.experts.w13.copy_(hf.experts.gate_up_proj.transpose(1, 2))  # [E, H, 2I] -> gate rows, then up
        block.experts.w2.copy_(hf.experts.down_proj.transpose(1, 2))
    x = torch.randn(11, hidden)

    with torch.no_grad():
        expected = hf(x)[0]
        got = block.to(DEVICE)(x.to(DEVICE))

    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
