"""Mixtures of experts: Qwen3-MoE and Mixtral against transformers, split over two ranks, and as GGUF
files with quantized expert tensors.

The tiny checkpoints (tests/conftest.py) route each token to 2 or 3 of 8 experts, so a short decode
step leaves most experts without tokens; Qwen3-MoE's have dense layers among the sparse ones
(`mlp_only_layers`, `decoder_sparse_step`), Mixtral's attention slides over 8 keys. Greedy tokens equal
transformers' in float32 with top-5 logprobs within 2e-3, batched with chunked prefill and under
preemption.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import (
    DEVICE,
    add_bpe_vocab,
    assert_same_outputs,
    gguf_writer,
    inproc_core,
    make_checkpoint,
    write_gguf_and_twin,
)
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file
from test_hf_equality import assert_output_matches, hf_references
from test_new_archs import (
    GREEDY,
    NUM_TOKENS,
    PROMPTS,
    _llamacpp_permute,
    _llamacpp_unpermute,
)
from test_tensor_parallel import _assert_same

from ember import LLM, SamplingParams
from ember.model.hf_config import ModelConfig
from ember.model.moe import FusedExperts, SparseMoeBlock
from ember.model.sharding import ShardLayout
from ember.ops.moe import route
from ember.quant.experts import (
    QuantizedExperts,
    dequantize_experts,
    quantize_experts,
    stack_experts,
)
from ember.quant.quantize import quantize_int4

ARCHS = ("qwen3-moe", "qwen3-moe-step2", "mixtral")
MOE_LAYERS = {"qwen3-moe": [True, False, True], "qwen3-moe-step2": [False, True, False, True], "mixtral": [True, True]}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(moe_checkpoints) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    return hf_references({arch: moe_checkpoints[arch] for arch in ARCHS}, PROMPTS, NUM_TOKENS)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _block_bytes(cfg: dict, block_size: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4  # K+V, float32


SCENARIOS = {
    "batched-chunked": {"block_size": 8, "max_num_batched_tokens": 16},
    "preempted": {"block_size": 8, "max_model_len": 96, "enable_prefix_caching": False},
}


# (qwen3-moe-step2 differs from qwen3-moe in which layers are sparse and in top-3 renormalised routing,
# neither of which preemption touches: it runs batched only, to keep the file's CI time down)
@pytest.mark.parametrize(
    "arch,scenario",
    [
        (arch, scenario)
        for arch in ARCHS
        for scenario in SCENARIOS
        if (arch, scenario) != ("qwen3-moe-step2", "preempted")
    ],
)
def test_matches_transformers(moe_checkpoints, references, arch, scenario):
    path = moe_checkpoints[arch]
    args = dict(SCENARIOS[scenario])
    if scenario == "preempted":  # 14 blocks of 8 hold about two of these sequences at once
        args["kv_cache_memory"] = 14 * _block_bytes(_config(path), 8) / 2**30
    llm = LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, **{"kv_cache_memory": 0.02, **args})
    # transformers' rule: a layer is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    assert _moe_layers(llm) == MOE_LAYERS[arch]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if scenario == "preempted":
        assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references[arch]):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def _moe_layers(llm: LLM) -> list[bool]:
    return [isinstance(layer.mlp, SparseMoeBlock) for layer in inproc_core(llm).runner.model.model.layers]


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("use_sliding_window", True, "use_sliding_window is not supported"),
        ("shared_expert_intermediate_size", 64, "shared_expert_intermediate_size: shared experts are not supported"),
        ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
        ("num_experts_per_tok", 9, "num_experts_per_tok 9 must be between 1 and the number of experts"),
    ],
)
def test_unsupported_moe_variant_names_the_field(moe_checkpoints, tmp_path, key, value, message):
    d = shutil.copytree(moe_checkpoints["qwen3-moe"], tmp_path / "variant")
    (d / "config.json").write_text(json.dumps({**_config(d), key: value}))
    with pytest.raises(ValueError, match=message):
        LLM(str(d), device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.01)


# --- the grouped PyTorch path against a per-token reference ----------------------------------------


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Each token's experts one by one, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("kind", [None, "int8", "int4"])
@pytest.mark.parametrize("routing", ["random", "one-expert", "unused-experts"])
def test_grouped_experts_match_a_per_token_reference(kind, routing):
    torch.manual_seed(0)
    experts, hidden, inter, tokens, k = 8, 64, 128, 13, 2
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.1, torch.randn(experts, hidden, inter) * 0.1
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    if routing == "one-expert":  # every token's first choice is expert 5
        logits[:, 5] += 100
    if routing == "unused-experts":  # only experts 1, 2 and 6 receive tokens
        logits[:, [0, 3, 4, 5, 7]] -= 100
    weights, ids = route(logits, k, renormalize=True)
    module = FusedExperts(experts, hidden, _layout(inter), layer=0)
    module.materialize()
    module.w13.data.copy_(w13)
    module.w2.data.copy_(w2)
    if kind is not None:
        module.quantize(kind)
        assert isinstance(module.w13, QuantizedExperts) and isinstance(module.w2, QuantizedExperts)
        w13, w2 = dequantize_experts(module.w13), dequantize_experts(module.w2)
    got = module(x, weights, ids)
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    if routing == "unused-experts":
        assert set(ids.flatten().tolist()) == {1, 2, 6}


def _layout(inter: int, rank: int = 0, size: int = 1) -> ShardLayout:
    return ShardLayout(
        rank=rank,
        size=size,
        head_dim=16,
        num_heads=4,
        num_kv_heads=2,
        kv_head_start=0,
        intermediate_size=256,
        vocab_size=64,
        vocab_per_rank=64,
        moe_intermediate_size=inter // size,
    )


def _dense(w) -> torch.Tensor:
    return dequantize_experts(w) if isinstance(w, QuantizedExperts) else w.data


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
@pytest.mark.parametrize("form", ["per-expert", "stacked", "gate_up", "quantized", "quantized-mixed"])
def test_expert_tensors_load_in_every_form(form, rank, size):
    """Every layout a checkpoint may use lands in the same w13 / w2 (this rank's slice of each expert):
    stacked quantized gate and up of one format stay quantized, of two formats they are decoded."""
    torch.manual_seed(0)
    experts, hidden, inter = 4, 64, 64
    gate, up, down = (
        torch.randn(experts, inter, hidden),
        torch.randn(experts, inter, hidden),
        torch.randn(experts, hidden, inter),
    )
    name = "model.layers.0.mlp.experts."
    if form == "per-expert":
        tensors = {
            f"{name}{e}.{p}.weight": w[e]
            for e in range(experts)
            for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
        }
    elif form == "stacked":
        tensors = {name + "gate_proj.weight": gate, name + "up_proj.weight": up, name + "down_proj.weight": down}
    elif form == "gate_up":  # transformers' in-memory names
        tensors = {name + "gate_up_proj": torch.cat([gate, up], dim=1), name + "down_proj": down}
    else:
        # down in groups of 32 inputs, so that two ranks split it on group boundaries
        q = [
            quantize_experts(w, kind)
            for w, kind in zip((gate, up), ("int4", "int4" if form == "quantized" else "int8"))
        ]
        q.append(stack_experts([quantize_int4(w, group_size=32) for w in down]))
        gate, up, down = (dequantize_experts(w) for w in q)
        tensors = dict(zip((name + "gate_proj.weight", name + "up_proj.weight", name + "down_proj.weight"), q))
    module = FusedExperts(experts, hidden, _layout(inter, rank, size), layer=0)
    for n, t in tensors.items():
        module.load(n, t, "ckpt")
    module.finish_loading("ckpt")
    assert isinstance(module.w13, QuantizedExperts) == (form == "quantized")
    assert isinstance(module.w2, QuantizedExperts) == form.startswith("quantized")
    assert not any(p.is_meta for p in module.parameters())  # allocated where float data was written
    rows = slice(rank * inter // size, (rank + 1) * inter // size)
    torch.testing.assert_close(_dense(module.w13), torch.cat([gate[:, rows], up[:, rows]], dim=1))
    torch.testing.assert_close(_dense(module.w2), down[:, :, rows])


def test_missing_expert_is_named():
    module = FusedExperts(4, 64, _layout(32), layer=3)
    for e in (0, 1, 3):
        for p in ("gate_proj", "up_proj", "down_proj"):
            module.load(
                f"model.layers.3.mlp.experts.{e}.{p}.weight",
                torch.zeros(64 if p == "down_proj" else 32, 32 if p == "down_proj" else 64),
                "x",
            )
    with pytest.raises(ValueError, match=r"missing the gate projection of experts \[2\] in layer 3"):
        module.finish_loading("x")


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())  # = softmax of the chosen logits
    torch.testing.assert_close(weights, logits[:, :2].softmax(-1))


FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, logprobs=5)


def test_load_time_quantization_quantizes_the_experts(moe_checkpoints):
    """int8 experts (and linear layers; the router stays float): the first token of every prompt is the
    float model's, its top-5 logprobs within 0.25 (per-channel int8 with bf16 activations on CPU moved
    them by up to 0.11 when this was written)."""
    path = str(moe_checkpoints["mixtral"])
    outs = {}
    for q in (None, "int8"):
        llm = LLM(path, device=DEVICE, dtype="float32", engine_process=False, kv_cache_memory=0.02, quantization=q)
        moe = inproc_core(llm).runner.model.model.layers[0].mlp
        assert isinstance(moe.experts.w13, QuantizedExperts) == isinstance(moe.experts.w2, QuantizedExperts) == bool(q)
        assert moe.gate.weight.dtype == torch.float32
        outs[q] = [o.outputs[0] for o in llm.generate(PROMPTS, FIRST_TOKEN, use_tqdm=False)]
    for ref, got in zip(outs[None], outs["int8"]):
        assert got.token_ids[0] == ref.token_ids[0]
        assert {t: v.logprob for t, v in got.logprobs[0].items()} == pytest.approx(
            {t: v.logprob for t, v in ref.logprobs[0].items()}, abs=0.25
        )


def test_dummy_weights_run(moe_checkpoints):
    llm = LLM(
        str(moe_checkpoints["mixtral"]),
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        kv_cache_memory=0.01,
        load_format="dummy",
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params, use_tqdm=False)[1].outputs[0].token_ids) == 4


# --- tensor parallelism -----------------------------------------------------------------------


def test_tp2_matches_tp1(moe_checkpoints):
    """Each rank holds half of every expert's intermediate rows; the router is whole on both."""
    _assert_same(str(moe_checkpoints["qwen3-moe"]))


# --- GGUF: stacked 3-D expert tensors, quantized --------------------------------------------------

# llama.cpp's names (gguf-py's tensor_mapping); experts as ffn_*_exps [E, N, K], the router ffn_gate_inp
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
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_EXPERT_PARTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
# gate and up in one format (w13 stays quantized), down in another
_EXPERT_TYPES = {"ffn_gate_exps": QType.Q4_0, "ffn_up_exps": QType.Q4_0, "ffn_down_exps": QType.Q8_0}


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert checkpoint tensors -> {gguf name: [E, N, K]}; other tensors pass through by HF name."""
    stacks: dict[str, dict[int, np.ndarray]] = {}
    rest = {}
    for name, w in weights.items():
        parts = name.split(".")
        if "experts" not in parts:
            rest[name] = w
            continue
        layer, expert, proj = parts[2], int(parts[parts.index("experts") + 1]), parts[-2]
        stacks.setdefault(f"blk.{layer}.{_EXPERT_PARTS[proj]}.weight", {})[expert] = w
    return {**rest, **{n: np.stack([e[i] for i in sorted(e)]) for n, e in stacks.items()}}


def _write_moe_gguf(src: Path, path: Path, twin: Path) -> None:
    """The checkpoint at src as llama.cpp's converter writes it (qwen3moe, or llama with experts for
    Mixtral, whose q/k rows it permutes), experts quantized; at twin the safetensors checkpoint of what
    every tensor decodes to."""
    cfg = _config(src)
    mixtral = cfg["model_type"] == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    w = gguf_writer(path, arch, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if mixtral:
        w.add_sliding_window(cfg["sliding_window"])
    else:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    decoded = {}
    for name, weight in _stack_experts(load_file(src / "model.safetensors")).items():
        weight = weight.astype(np.float32)
        qtype = _EXPERT_TYPES.get(name.split(".")[-2])
        if name.startswith("blk."):  # stacked experts
            data = gguf.quants.quantize(weight, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
            value = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
            layer, proj = name.split(".")[1], "w1 w3 w2" if mixtral else "gate_proj up_proj down_proj"
            hf = dict(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), proj.split()))[name.split(".")[2]]
            prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
            decoded.update({f"{prefix}.{e}.{hf}.weight": value[e] for e in range(value.shape[0])})
            continue
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[rest.rsplit('.', 1)[0]]}.weight"
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(
            gguf_name.split(".")[-2]
        )
        stored = _llamacpp_permute(weight, heads) if mixtral and heads else weight
        w.add_tensor(gguf_name, stored)
        decoded[name] = _llamacpp_unpermute(stored, heads) if mixtral and heads else stored
    write_gguf_and_twin(w, src, twin, decoded)


@pytest.fixture(scope="module")
def gguf_twins(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Experts of 64 rows, so that two ranks each hold whole Q8_0 blocks (32 columns) of down_proj;
    llama.cpp always renormalises Qwen3-MoE's top-k weights, so the source checkpoint does too."""
    root = tmp_path_factory.mktemp("moe-gguf")
    twins = {}
    for arch, extra in (
        ("qwen3-moe", {"moe_intermediate_size": 64, "norm_topk_prob": True}),
        ("mixtral", {"intermediate_size": 64}),
    ):
        src = make_checkpoint(root / arch, arch, **extra)
        twins[arch] = root / f"{arch}.gguf", root / f"{arch}-twin"
        _write_moe_gguf(src, *twins[arch])
    return twins


TWIN_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_gguf_with_quantized_experts_matches_its_dequantized_twin(gguf_twins, arch):
    path, twin = gguf_twins[arch]
    outputs = []
    for model in (path, twin):
        llm = LLM(
            str(model),
            device=DEVICE,
            dtype="float32",
            engine_process=False,
            kv_cache_memory=0.02,
            block_size=8,
            max_num_batched_tokens=16,
        )
        runner = inproc_core(llm).runner
        twin_config = ModelConfig.from_hf_config(_config(twin))
        assert (runner.model.config.architecture, runner.model.config.moe) == (
            twin_config.architecture,
            twin_config.moe,
        )
        assert _moe_layers(llm) == MOE_LAYERS[arch]
        experts = runner.model.model.layers[0].mlp.experts
        assert isinstance(experts.w13, QuantizedExperts) == (model == path)
        assert not any(p.is_meta for p in runner.model.parameters())  # no expert left unallocated
        if model == path:
            assert (experts.w13.kind, experts.w2.kind, experts.w2.group_size) == ("int4", "int8", 32)
        outputs.append(llm.generate(PROMPTS[::2], TWIN_PARAMS, use_tqdm=False))
    for gguf_out, twin_out in zip(*outputs):
        assert gguf_out.outputs[0].token_ids == twin_out.outputs[0].token_ids
        for a, b in zip(gguf_out.outputs[0].logprobs, twin_out.outputs[0].logprobs):
            assert {t: v.logprob for t, v in a.items()} == pytest.approx({t: v.logprob for t, v in b.items()}, abs=1e-5)


def test_tp2_gguf_quantized_experts(gguf_twins):
    """Quantized experts split: gate/up by rows, down by whole Q8_0 blocks of columns."""
    _assert_same(str(gguf_twins["qwen3-moe"][0]))


# --- the GPU path (fused Triton MoE kernels; through the interpreter on CPU) ------------------------


@pytest.mark.parametrize("model", ["dense", "gguf-quantized"])
def test_triton_path_matches_torch_path(moe_checkpoints, gguf_twins, monkeypatch, model):
    """The engine with every Triton kernel (the fused MoE's routing and grouped GEMMs included) gives
    the PyTorch path's tokens and logprobs, with dense experts and with the GGUF file's Q4_0 / Q8_0
    experts (its other tensors float32, so both paths see the same weights)."""
    pytest.importorskip("ember.kernels.fused_moe", reason="the fused MoE kernels come with the kernels branch")
    from ember.ops import registry as backend

    path = moe_checkpoints["qwen3-moe-step2"] if model == "dense" else gguf_twins["qwen3-moe"][0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)

    def run() -> list:
        llm = LLM(
            str(path),
            device=DEVICE,
            dtype="float32",
            engine_process=False,
            kv_cache_memory=0.01,
            max_num_batched_tokens=16,
        )
        return llm.generate(PROMPTS[1:2], params, use_tqdm=False)

    torch_outs = run()
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    assert_same_outputs(torch_outs, run(), abs=1e-3)
