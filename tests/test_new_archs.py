"""Gemma 3, Gemma 2 and Mistral with a sliding window against transformers, and their GGUF twins.

Every context here outgrows the 8-key windows of tests/conftest.py's tiny checkpoints: alone, in a
batch with chunked prefill, from the prefix cache and after preemption, greedy tokens equal
transformers' in float32 with top-5 logprobs within 2e-3. The same models written as GGUF files
(llama.cpp's names and layouts, mixed F32/F16/Q8_0) give the same tokens as their safetensors twins.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import (
    DEVICE,
    WINDOWED_ARCHS,
    add_bpe_vocab,
    gguf_writer,
    llama3_rope_freqs,
    make_checkpoint,
    write_gguf_and_twin,
)
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file, save_file
from test_hf_equality import TOP, assert_output_matches, hf_greedy, hf_references

from ember import LLM, SamplingParams
from ember.ops.attention import AttentionMetadata
from ember.ops.functional import paged_attention

ARCHS = tuple(WINDOWED_ARCHS)
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)


def _prompts() -> list[dict]:
    """Lengths from below one window to several; the last three share a 20-token prefix."""
    rng = random.Random(3)
    shared = [rng.randint(5, 430) for _ in range(20)]
    prompts = [[rng.randint(5, 430) for _ in range(n)] for n in (3, 11, 37)]
    prompts += [shared + [rng.randint(5, 430) for _ in range(n)] for n in (1, 6, 23)]
    return [{"prompt_token_ids": p} for p in prompts]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    return hf_references({arch: checkpoints[arch] for arch in ARCHS}, PROMPTS, NUM_TOKENS)


def _block_bytes(arch: str, block_size: int) -> int:
    layers = 3 if arch == "gemma3" else 2
    return 2 * layers * block_size * 2 * 16 * 4  # K+V, layers, block, KV heads, head_dim, float32


# scenario -> engine arguments; block sizes of 4 and 8 put window edges inside and across blocks
SCENARIOS = {
    "alone": dict(max_num_seqs=1, block_size=4),
    "batched-chunked": dict(block_size=8, max_num_batched_tokens=16),
    "prefix-cached": dict(block_size=4, max_num_batched_tokens=32),
    "preempted": dict(block_size=8, max_model_len=96, enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_beyond_the_window(checkpoints, references, arch, scenario):
    args = dict(SCENARIOS[scenario])
    if scenario == "preempted":  # 14 blocks of 8 hold about two of these sequences at once
        args["kv_cache_memory"] = 14 * _block_bytes(arch, 8) / 2**30
    llm = LLM(
        str(checkpoints[arch]),
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        **{"kv_cache_memory": 0.02, **args},
    )
    assert_scenario_matches(llm, scenario, references[arch])


def assert_scenario_matches(llm: LLM, scenario: str, references: list) -> None:
    """PROMPTS through `llm` as the scenario runs them (one at a time, batched, twice for the prefix
    cache), its mechanism seen to act, and every output equal to the references."""
    if scenario == "alone":
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    else:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if scenario == "prefix-cached":  # again: the prompts' full blocks now come from the cache
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 4 * ((len(p["prompt_token_ids"]) - 1) // 4) for o, p in zip(outs, PROMPTS))
        assert max(o.num_cached_tokens for o in outs) >= 36
    if scenario == "preempted":
        assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def test_the_window_changes_the_output(checkpoints, references, tmp_path):
    """The references above depend on the window: without it, Mistral's continuations differ."""
    d = shutil.copytree(checkpoints["mistral-sw"], tmp_path / "no-window")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    llm = LLM(str(d), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != [tokens for tokens, _ in references["mistral-sw"]]


# --- Gemma3ForConditionalGeneration: the language model of a multimodal checkpoint -----------------


def test_gemma3_multimodal_checkpoint_loads_its_language_model(checkpoints, tmp_path):
    import transformers

    text = json.loads((checkpoints["gemma3"] / "config.json").read_text())
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    causal = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["gemma3"]), dtype=torch.float32)
    # the tiny text checkpoint's weights; transformers' own loader ties lm_head to the embedding here
    missing, _ = model.model.language_model.load_state_dict(causal.model.state_dict(), strict=False)
    assert not missing
    model.lm_head.weight = torch.nn.Parameter(causal.lm_head.weight.detach().clone())
    model.config.text_config.tie_word_embeddings = model.config.tie_word_embeddings = False
    new = tmp_path / "gemma3-mm"
    model.save_pretrained(new)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["gemma3"] / name, new / name)
    names = load_file(new / "model.safetensors").keys()  # transformers saves the Hub's layout
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.layers.") for n in names)

    prompts = PROMPTS[2:4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [hf_greedy(causal, p["prompt_token_ids"], 16)[0] for p in prompts]
    got = LLM(
        str(new), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02, block_size=4
    ).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == reference

    # the same model under transformers' in-memory names (model.language_model.*, model.vision_tower.*)
    other = shutil.copytree(new, tmp_path / "gemma3-mm-renamed")
    weights = load_file(other / "model.safetensors")
    renamed = {}
    for name, weight in weights.items():
        for old, now in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(old):
                name = now + name[len(old) :]
                break
        renamed[name] = weight
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    got = LLM(
        str(other), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02, block_size=4
    ).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == reference


# --- GGUF twins ---------------------------------------------------------------------------------

# llama.cpp's layer tensor names (gguf-py's tensor_mapping) for the HF ones; Gemma's extra norms
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GEMMA_LAYER = {
    **_GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_TYPES = {
    "token_embd": QType.Q8_0,
    "attn_q": QType.F16,
    "attn_v": QType.Q8_0,
    "ffn_down": QType.Q8_0,
    "ffn_up": QType.F16,
}
# What llama.cpp cannot express is fixed there: Gemma's attention scale is head_dim (but for the 27B
# models), Gemma 3's local rope base is 10000 and every 6th layer is global. The twins follow suit.
_GGUF_COMPATIBLE = {
    # Llama 3.1's rope: llama.cpp writes it as the rope_freqs tensor (the file has no rope scaling keys)
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
    ),
    "mistral-sw": {},
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(
        query_pre_attn_scalar=16,
        num_hidden_layers=6,
        layer_types=None,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(kind: str, w: np.ndarray) -> tuple[np.ndarray, QType | None, np.ndarray]:
    """(data to write, its type, the float32 weight it decodes to)."""
    qtype = _TYPES.get(kind)
    if qtype is None:
        return w, None, w
    if qtype == QType.F16:
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype)


def _write_gguf_twin(src: Path, path: Path, twin: Path) -> None:
    """Write the checkpoint at src as llama.cpp's converter would (Gemma norms stored as 1 + w, llama's
    q/k rows permuted), and at twin the safetensors checkpoint holding what each tensor decodes to."""
    cfg = json.loads((src / "config.json").read_text())
    gemma = cfg["model_type"].startswith("gemma")
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}.get(cfg["model_type"], "llama")
    w = gguf_writer(path, arch, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window") is not None:
        w.add_sliding_window(cfg["sliding_window"])
    rope = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
    w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, cfg["head_dim"]))
    if cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(GEMMA2_TEMPLATE if arch == "gemma2" else GEMMA3_TEMPLATE)

    layer_names = _GGUF_GEMMA_LAYER if gemma else _GGUF_LAYER
    decoded = {}
    for name, weight in load_file(src / "model.safetensors").items():
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest.rsplit('.', 1)[0]]}.weight"
        kind = gguf_name.split(".")[-2]
        weight = weight.astype(np.float32)
        if gemma and gguf_name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)  # what Gemma's converters store; Ember subtracts it back
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(kind)
        if not gemma and heads is not None:
            weight = _llamacpp_permute(weight, heads)
        data, qtype, value = _stored(kind, weight)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
        if gemma and gguf_name.endswith("norm.weight"):
            value = weight - np.float32(1.0)
        if not gemma and heads is not None:
            value = _llamacpp_unpermute(value, heads)
        decoded[name] = value
    write_gguf_and_twin(w, src, twin, decoded)


@pytest.mark.parametrize("arch", tuple(_GGUF_COMPATIBLE))  # Phi-3's twin: tests/test_phi3.py
def test_gguf_twin_gives_the_same_tokens(tmp_path, arch):
    src = make_checkpoint(tmp_path / "hf", arch, **_GGUF_COMPATIBLE[arch])
    path, twin = tmp_path / f"{arch}.gguf", tmp_path / "twin"
    _write_gguf_twin(src, path, twin)
    outputs, chats = [], []
    for model in (path, twin):
        llm = LLM(
            str(model),
            device=DEVICE,
            dtype="float32",
            engine_process=False,
            kv_cache_memory=0.02,
            block_size=8,
            max_num_batched_tokens=16,
            quantization="none",
        )
        outputs.append(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        # the GGUF file's own chat template; the twin is given the same one
        template = None if model == path else GEMMA2_TEMPLATE if arch == "gemma2" else GEMMA3_TEMPLATE
        chats.append(
            llm.chat(
                [{"role": "user", "content": "Hi"}],
                SamplingParams(max_tokens=2),
                use_tqdm=False,
                chat_template=template,
            )[0]
        )
    assert chats[0].prompt == chats[1].prompt and chats[0].prompt_token_ids == chats[1].prompt_token_ids
    assert chats[0].prompt_token_ids.count(1) == 1 and chats[0].prompt_token_ids[0] == 1  # one BOS, the template's
    for gguf_out, twin_out in zip(*outputs):
        assert gguf_out.outputs[0].token_ids == twin_out.outputs[0].token_ids
        for a, b in zip(gguf_out.outputs[0].logprobs, twin_out.outputs[0].logprobs):
            assert {t: v.logprob for t, v in a.items()} == pytest.approx({t: v.logprob for t, v in b.items()}, abs=1e-5)


# --- the PyTorch attention path against a dense reference ----------------------------------------


def _dense_reference(q, k, v, pos, scale, window, cap):
    """One query against its sequence's keys 0..pos, in float64."""
    keys = torch.arange(pos + 1)
    if window is not None:
        keys = keys[keys > pos - window]
    kk, vv = k[keys].double(), v[keys].double()  # [S, Hk, D]
    group = q.shape[0] // k.shape[1]
    scores = torch.einsum("hd,shd->hs", q.double(), kk.repeat_interleave(group, dim=1)) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    return torch.einsum("hs,shd->hd", scores.softmax(-1), vv.repeat_interleave(group, dim=1))


@pytest.mark.parametrize("native", ["1", "0"])  # EMBER_CPU_NATIVE: the decode rows in the native kernel or not
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0), (6, 2.5), (40, 3.0)])
@pytest.mark.parametrize("decode_lens", [[23, 23], [3, 17, 30]])
def test_torch_paged_attention_window_and_soft_cap(window, cap, decode_lens, native, monkeypatch):
    monkeypatch.setenv("EMBER_CPU_NATIVE", native)
    torch.manual_seed(0)
    block_size, hq, hk, d = 4, 4, 2, 8
    # decodes first, then prefill chunks: (query tokens, context length including them)
    prefills = [(6, 6), (5, 19), (1, 9)]
    lens = decode_lens + [n for _, n in prefills]
    q_lens = [1] * len(decode_lens) + [q for q, _ in prefills]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(blocks_per_seq) + 3).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor(ids[start : start + nb])
        start += nb
    k_cache = torch.randn(len(ids), block_size, hk, d)
    v_cache = torch.randn(len(ids), block_size, hk, d)
    q = torch.randn(sum(q_lens), hq, d) * 2
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(q),), -1),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=len(decode_lens),
        max_query_len=max(q for q, _ in prefills),
        max_seq_len=max(lens),
        seq_lens_host=lens,
        query_start_host=starts,
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.3, sliding_window=window, logits_soft_cap=cap)
    for i, n in enumerate(lens):
        k = k_cache[tables[i, : blocks_per_seq[i]].long()].flatten(0, 1)
        v = v_cache[tables[i, : blocks_per_seq[i]].long()].flatten(0, 1)
        for row in range(starts[i], starts[i + 1]):
            pos = n - (starts[i + 1] - row)
            ref = _dense_reference(q[row], k, v, pos, 0.3, window, cap)
            torch.testing.assert_close(out[row].double(), ref, atol=1e-5, rtol=1e-5)
    if window is not None and window < 10 and native == "0":  # PyTorch's gather takes only blocks near the window
        assert meta.cpu_decode[window, None][1] < max(decode_lens)  # keyed by (window, chunk)


# --- chat templates -----------------------------------------------------------------------------

# Gemma 2's and Gemma 3's templates as their tokenizer_config.json (and llama.cpp's GGUF files) carry
# them: Gemma 2 refuses a system message, Gemma 3 folds it into the first user turn; both insist on
# alternating roles through raise_exception and print bos_token themselves.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "  Hi there \n"}],
    "three turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "not alternating": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}],
}


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("template", [GEMMA2_TEMPLATE, GEMMA3_TEMPLATE], ids=["gemma2", "gemma3"])
def test_gemma_chat_templates_render_as_transformers(checkpoints, template, conversation):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    from ember.model.files import load_hf_tokenizer

    path = str(checkpoints["gemma3"])
    messages = CONVERSATIONS[conversation]
    ours = load_hf_tokenizer(path, [])
    # Ember hands templates OpenAI text parts joined into one string (Gemma 2's template would print the list)
    flat = [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(part["text"] for part in m["content"]),
        }
        for m in messages
    ]
    try:
        expected = AutoTokenizer.from_pretrained(path).apply_chat_template(
            flat, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as e:
        with pytest.raises(ValueError, match=f"chat template failed: {e}"):
            ours.apply_chat_template(messages, chat_template=template)
        assert conversation == "not alternating" or template == GEMMA2_TEMPLATE
        return
    assert ours.apply_chat_template(messages, chat_template=template) == expected
    assert expected.startswith("<s><start_of_turn>user\n") and expected.endswith("<start_of_turn>model\n")


# --- configs in older transformers' format -------------------------------------------------------


def test_gemma3_config_in_transformers_4_format_gives_the_same_model(checkpoints, references, tmp_path):
    """transformers < 5 wrote rope_theta + rope_scaling (global layers), rope_local_base_freq and
    sliding_window_pattern instead of rope_parameters per layer type and layer_types."""
    d = shutil.copytree(checkpoints["gemma3"], tmp_path / "gemma3-v4")
    cfg = json.loads((d / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        cfg.pop(key)
    cfg.update(
        rope_theta=50000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=1000.0,
        sliding_window_pattern=2,
    )
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(d), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02, block_size=8)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in references["gemma3"]]


def test_gemma3_multimodal_config_takes_transformers_defaults():
    """The Hub's Gemma 3 4B config.json gives little more than sizes under text_config."""
    from ember.model.hf_config import ModelConfig

    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"hidden_size": 1152},
        }
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings and cfg.qk_norm and cfg.gemma_norms
    assert cfg.layer_types == tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(34))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta, cfg.rope_local_scaling) == (
        1_000_000.0,
        {"factor": 8.0, "rope_type": "linear"},
        10_000.0,
        None,
    )
    assert [cfg.layer_window(i) for i in (0, 5)] == [1024, None]
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
