"""GGUF `qwen3next` files: the tiny Qwen3-Next checkpoint of tests/test_qwen3_next.py written as llama.cpp's
converter writes it (convert_hf_to_gguf.py's Qwen3NextModel: in_proj_qkvz split into attn_qkv and
attn_gate, A_log as -exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed, the (1 + w) norms
stored as 1 + w, experts stacked), read back to the checkpoint's tensors and run to transformers'
greedy tokens. The checkpoint's one dense layer (mlp_only_layers) takes llama's ffn_gate/up/down names:
the released models have none, and llama.cpp's qwen3next lists no such tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import DEVICE, add_bpe_vocab, gguf_writer
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file
from test_hf_equality import assert_output_matches, hf_greedy
from test_new_archs import NUM_TOKENS
from test_qwen3_next import CONFIG, PROMPTS, _make_checkpoint

from ember import LLM, SamplingParams
from ember.model.gguf import load_gguf

_QUANTIZED = (".attn_qkv.weight", ".attn_gate.weight", ".ssm_out.weight")
_DENSE = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _converted(name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One checkpoint tensor as the converter stores it, under HF names still (in_proj_qkvz: two)."""
    if name.endswith(".A_log"):
        return [(name, -np.exp(w))]
    if name.endswith(".dt_bias"):
        return [(name.replace(".dt_bias", ".dt_proj.bias"), w)]
    if "conv1d" in name:
        return [(name, w.squeeze())]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, w + np.float32(1.0))]
    if name.endswith("in_proj_qkvz.weight"):
        hk, dk = CONFIG["linear_num_key_heads"], CONFIG["linear_key_head_dim"]
        per_k = CONFIG["linear_num_value_heads"] // hk * CONFIG["linear_value_head_dim"]
        q, k, v, z = np.split(w.reshape(hk, -1, w.shape[-1]), np.cumsum([dk, dk, per_k]), axis=1)
        flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
        return [
            (name.replace("in_proj_qkvz", "attn_qkv"), np.concatenate(flat[:3])),
            (name.replace("in_proj_qkvz", "attn_gate"), flat[3]),
        ]
    return [(name, w)]


def _write(src: Path, path: Path, qtype: QType | None = None) -> dict[str, np.ndarray]:
    """The file at path (with qtype: the DeltaNet's matrices quantized to it); returns the checkpoint's
    tensors (experts stacked) the load must give back, for float files."""
    import json

    cfg = json.loads((src / "config.json").read_text())
    w = gguf_writer(path, "qwen3next", cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(4)
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, cfg["num_hidden_layers"])
    weights = load_file(src / "model.safetensors")
    experts: dict[str, dict[int, np.ndarray]] = {}
    expected = {}
    for name, t in weights.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.proj.weight -> mlp.experts.proj [E, N, K]
            stacked = ".".join(parts[:5] + parts[6:])
            experts.setdefault(stacked, {})[int(parts[5])] = t
            continue
        expected[name] = t
        for hf, data in _converted(name, t):
            stem, _, suffix = hf.rpartition(".")
            rest = stem.split(".", 3)[-1]
            new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if rest in _DENSE:
                new = f"blk.{parts[2]}.{_DENSE[rest]}.weight"
            elif rest.startswith("linear_attn.attn_"):
                new = f"blk.{parts[2]}.{rest.split('.')[-1]}.weight"
            assert new is not None, hf
            if qtype is not None and new.endswith(_QUANTIZED):
                w.add_tensor(new, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(new, data)
    for stacked, by_expert in experts.items():
        data = np.stack([by_expert[e] for e in sorted(by_expert)])
        new = names.get_name(stacked, try_suffixes=(".weight",))
        assert new is not None, stacked
        w.add_tensor(new, data)
        expected[stacked] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("qwen3next-gguf")
    src = _make_checkpoint(root / "hf")
    path = root / "tiny-qwen3next.gguf"
    return src, path, _write(src, path)


def test_tensors_and_config_equal_the_checkpoint(converted):
    src, path, expected = converted
    model = load_gguf(str(path))
    cfg = model.hf_config
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        assert cfg[key] == CONFIG[key], key
    assert cfg["partial_rotary_factor"] == 0.25 and cfg["full_attention_interval"] == 4
    assert cfg["mlp_only_layers"] == [1] and cfg["shared_expert_intermediate_size"] == 32
    loaded = dict(model.tensors())
    assert loaded.keys() == expected.keys()
    for name, want in expected.items():
        got = loaded[name]
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            want = (want + np.float32(1.0)) - np.float32(1.0)  # the file holds 1 + w, rounded
        assert isinstance(got, np.ndarray) and got.shape == want.shape, name
        # A_log comes back through log(exp(.)): within float32 rounding; the rest exactly
        np.testing.assert_allclose(got, want, rtol=1e-6 if name.endswith("A_log") else 0, atol=0, err_msg=name)


def test_quantized_halves_are_regrouped_as_floats(converted, tmp_path):
    """With --quantization gguf the halves of in_proj_qkvz are decoded (their rows are regrouped) and merged;
    out_proj stays quantized, and decodes to what the file holds."""
    from ember.quant.formats import QuantizedWeight

    src, _, _ = converted
    path = tmp_path / "q8.gguf"
    _write(src, path, QType.Q8_0)
    floats = dict(load_gguf(str(path)).tensors())
    kept = dict(load_gguf(str(path)).tensors(keep_quantized=True))
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert isinstance(kept[qkvz], np.ndarray)
    np.testing.assert_array_equal(kept[qkvz], floats[qkvz])
    want = load_file(src / "model.safetensors")[qkvz]
    np.testing.assert_allclose(floats[qkvz], want, atol=0.01)  # Q8_0's rounding, in the right rows
    assert isinstance(kept["model.layers.0.linear_attn.out_proj.weight"], QuantizedWeight)


def test_greedy_tokens_equal_transformers(converted):
    from transformers import AutoModelForCausalLM

    src, path, _ = converted
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(DEVICE)
    prompts = PROMPTS[:4]
    refs = [hf_greedy(hf, p["prompt_token_ids"], NUM_TOKENS) for p in prompts]
    llm = LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(prompts, outs, refs):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)
