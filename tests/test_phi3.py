"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): greedy tokens identical to transformers in float32
and top-5 logprobs within 2e-3, alone, batched with chunked prefill, from the prefix cache and under
preemption. The LongRoPE variants (original_max_position_embeddings 32) run past the pre-training
length with the long factors, and within it (max_model_len 32) with the short ones. The same models
as GGUF files (llama.cpp's `phi3` layout) give the tokens of their safetensors twins."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from conftest import DEVICE, add_bpe_vocab, gguf_writer, inproc_core, make_checkpoint, write_gguf_and_twin
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file
from test_hf_equality import PROMPTS, TOP, assert_output_matches, hf_greedy

from ember import LLM, SamplingParams
from ember.model.gguf import load_gguf
from ember.model.linear import QuantLinear
from ember.ops import linear_native

# Phi-3-mini-4k-instruct's template (tokenizer_config.json)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
NUM_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)
ORIGINAL_MAX = 32  # the LongRoPE variants' original_max_position_embeddings (tests/conftest.py)
SHORT_PROMPTS = PROMPTS[:4]  # each under ORIGINAL_MAX - SHORT_TOKENS tokens (test_prompt_lengths)
SHORT_TOKENS = 10
# longer than ORIGINAL_MAX: transformers rotates them with the long factors throughout, as Ember does
LONG_PROMPTS = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(4)]


@pytest.fixture(scope="module", params=["phi3-longrope", "phi4-mini"])
def phi(request, tmp_path_factory) -> tuple[str, Path, list[dict], list]:
    """(variant, checkpoint, token-id prompts, HF's greedy tokens and logprobs for each)."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "hf", request.param)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PHI3_TEMPLATE}))
    prompts = _ids(path, LONG_PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    refs = [hf_greedy(hf, p["prompt_token_ids"], NUM_TOKENS) for p in prompts]
    return request.param, path, prompts, refs


def _ids(path: Path, texts: list[str]) -> list[dict]:
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    return [{"prompt_token_ids": tok.encode(t).ids} for t in texts]


def assert_outputs_match(outputs, refs: list[tuple[list[int], torch.Tensor]]) -> None:
    assert len(outputs) == len(refs)
    for out, (tokens, logprobs) in zip(outputs, refs):
        assert_output_matches(out.outputs[0], tokens, logprobs, out.prompt_token_ids)


def _llm(path: Path | str, **kwargs) -> LLM:
    return LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, **kwargs)


def test_prompt_lengths(phi):
    _, path, prompts, _ = phi
    assert min(len(p["prompt_token_ids"]) for p in prompts) > ORIGINAL_MAX
    assert max(len(p["prompt_token_ids"]) for p in _ids(path, SHORT_PROMPTS)) <= ORIGINAL_MAX - SHORT_TOKENS


@pytest.mark.parametrize("variant", ["phi3-longrope", "phi4-mini"])
def test_longrope_within_the_original_length(tmp_path, variant):
    """max_model_len <= original_max_position_embeddings: the short factors, as transformers uses them
    for a sequence that never outgrows the pre-training length (chunked prefill included)."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / variant, variant)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    prompts = _ids(path, SHORT_PROMPTS)
    refs = [hf_greedy(hf, p["prompt_token_ids"], SHORT_TOKENS) for p in prompts]
    llm = _llm(path, kv_cache_memory=0.01, max_model_len=ORIGINAL_MAX, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=SHORT_TOKENS, ignore_eos=True, logprobs=TOP)
    assert_outputs_match(llm.generate(prompts, params, use_tqdm=False), refs)


def test_alone_then_from_prefix_cache(phi):
    _, path, prompts, refs = phi
    llm = _llm(path, kv_cache_memory=0.05)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert_outputs_match(alone, refs)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(out.num_cached_tokens for out in again) > 0
    assert_outputs_match(again, refs)


def test_batched_with_chunked_prefill_and_preemption(phi):
    """A 16-token budget splits every prompt over several steps beside other decodes, and 16 KV blocks
    hold about one sequence, so the scheduler preempts and recomputes."""
    _, path, prompts, refs = phi
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    llm = _llm(
        path,
        kv_cache_memory=16 * block_bytes / 2**30,
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert_outputs_match(llm.generate(prompts, GREEDY, use_tqdm=False), refs)
    stats = llm.llm_engine.scheduler_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0


def test_chat_template_renders_like_transformers(phi):
    from transformers import AutoTokenizer

    _, path, _, _ = phi
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ref = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = _llm(path, kv_cache_memory=0.01).get_tokenizer()
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == ref


def test_bad_longrope_factors_name_the_field(tmp_path):
    path = make_checkpoint(tmp_path / "bad", "phi3-longrope")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["long_factor"] = [1.0, 2.0]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="long_factor has 2 values, expected rotary_dim / 2 = 8"):
        _llm(path, kv_cache_memory=0.01)


def test_partial_rotary_through_the_triton_kernel_matches_torch(monkeypatch):
    """The GPU path rotates the leading 3/4 of each head with the Triton kernel (here through its
    interpreter); the rest passes through untouched."""
    from ember.model.layers import RotaryEmbedding
    from ember.ops import registry as backend

    scaling = {**_longrope_scaling(12), "use_long_factors": True}
    rotary = RotaryEmbedding(16, 64, 10000.0, scaling, rotary_dim=12)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    positions = torch.tensor([0, 3, 31, 32, 63])
    ref_q, ref_k = rotary(positions, q, k)
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    got_q, got_k = rotary(positions, q, k)
    torch.testing.assert_close(got_q, ref_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k, rtol=0, atol=1e-6)
    assert torch.equal(got_q[..., 12:], q[..., 12:]) and not torch.allclose(got_q[..., :12], q[..., :12])


def _longrope_scaling(rotary_dim: int) -> dict:
    return {
        "rope_type": "longrope",
        "original_max_position_embeddings": ORIGINAL_MAX,
        "attention_factor": 1.3,
        "short_factor": [1.0 + 0.1 * i for i in range(rotary_dim // 2)],
        "long_factor": [2.0 + i for i in range(rotary_dim // 2)],
    }


# --- the same models as llama.cpp GGUF files -----------------------------------------------------

# llama.cpp's names for the HF tensors Phi-3 checkpoints hold (no q/k row permutation for this arch).
_GGUF_NAMES = {
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# A mix of what llama-quantize writes: Q8_0 and F16 matrices, F32 vectors.
_TYPES = {
    "attn_qkv": QType.Q8_0,
    "ffn_up": QType.Q8_0,
    "ffn_down": QType.F16,
    "attn_output": QType.F16,
    "token_embd": QType.Q8_0,
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _write_gguf(hf_dir: Path, gguf_path: Path, twin_dir: Path) -> None:
    """Write hf_dir as llama.cpp's converter would (then quantized), and its dequantized safetensors twin."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf_writer(gguf_path, "phi3", cfg)
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(0)
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_bpe_vocab(w, hf_dir, pad_to=cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(PHI3_TEMPLATE)
    twin = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        gname = _gguf_name(name)
        qtype = _TYPES.get(gname.split(".")[-2], QType.F32)
        values = tensor.numpy().astype(np.float32)
        stored = values if qtype == QType.F32 else gguf.quants.quantize(values, qtype)
        w.add_tensor(gname, stored, raw_dtype=None if qtype == QType.F32 else qtype)
        twin[name] = np.array(gguf.quants.dequantize(stored, qtype) if qtype != QType.F32 else values)
    write_gguf_and_twin(w, hf_dir, twin_dir, twin)


# Phi-3-mini-like dequantized to float32; Phi-4-mini-like with its Q8_0 tensors kept quantized (int8).
@pytest.mark.parametrize("variant,quantization", [("phi3", "none"), ("phi4-mini", None)])
def test_gguf_matches_its_safetensors_twin(tmp_path, monkeypatch, variant, quantization):
    monkeypatch.setattr(linear_native, "CPU_INT8_BF16", False)  # float32 arithmetic, as the float32 twin
    hf_dir = make_checkpoint(tmp_path / "hf", variant)
    gguf_path, twin_dir = tmp_path / "phi.gguf", tmp_path / "twin"
    _write_gguf(hf_dir, gguf_path, twin_dir)
    config = load_gguf(str(gguf_path)).hf_config
    rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    assert config["partial_rotary_factor"] == rope["partial_rotary_factor"] and config["sliding_window"] is None
    assert (config["rope_scaling"] or {}).get("long_factor") == rope.get("long_factor")
    prompts = _ids(hf_dir, LONG_PROMPTS[:2] + SHORT_PROMPTS[:2])
    twin = _llm(twin_dir, kv_cache_memory=0.02).generate(prompts, GREEDY, use_tqdm=False)
    refs = [(out.outputs[0].token_ids, _dense_logprobs(out)) for out in twin]
    llm = _llm(gguf_path, kv_cache_memory=0.02, max_num_batched_tokens=16, quantization=quantization)
    qkv = inproc_core(llm).runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) == (quantization is None)
    assert_outputs_match(llm.generate(prompts, GREEDY, use_tqdm=False), refs)
    messages = [{"role": "user", "content": "Hi!"}]
    assert (
        llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == "<|user|>\nHi!<|end|>\n<|assistant|>\n"
    )


def _dense_logprobs(out) -> torch.Tensor:
    """An output's top-TOP logprobs per step as rows over the vocabulary (-inf elsewhere), the shape
    assert_outputs_match takes as a reference."""
    rows = torch.full((len(out.outputs[0].logprobs), 512), -torch.inf)
    for step, lp in enumerate(out.outputs[0].logprobs):
        for tid, v in lp.items():
            rows[step, tid] = v.logprob
    return rows


def test_tensor_parallel_2_matches_1(tmp_path):
    """Fused checkpoint tensors are cut into q/k/v and gate/up before each rank takes its slice, here
    from a GGUF file whose fused Q8_0 tensors stay quantized (the slower of the two paths; safetensors
    take the same one, read lazily)."""
    from test_tensor_parallel import BF16_INT8_TOL, _assert_same

    hf_dir = make_checkpoint(tmp_path / "hf", "phi4-mini")
    _write_gguf(hf_dir, tmp_path / "phi.gguf", tmp_path / "twin")
    _assert_same(str(tmp_path / "phi.gguf"), BF16_INT8_TOL)
