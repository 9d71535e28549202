"""A model's architecture as Ember runs it: `ModelConfig` from a Hugging Face config.json (GGUF
metadata is mapped onto the same keys), with each model family's rules: Gemma's defaults, rope
scaling (linear, llama3, yarn, longrope, partial rotary), sliding-window layer patterns, MoE shapes.

Kept apart from `ember/config.py` (the user's flags) so that a new family touches only this file.
No torch: the front end reads it too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: E gated experts, each token's MLP the weighted sum of its top-k."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # top-k softmax weights divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # dense-MLP layers (Qwen3-MoE: mlp_only_layers, decoder_sparse_step)
    bias: bool = False  # router and experts with biases (gpt-oss)
    # gpt-oss's clamped SwiGLU (alpha, limit): (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); None: silu(gate) * up
    swiglu: tuple[float, float] | None = None
    # "softmax": the top-k of a softmax over all experts weight the experts' outputs (Qwen3-MoE, Mixtral,
    # gpt-oss); "sigmoid-input" (Llama 4): sigmoid of the top-k logits, each scaling its expert's *input*
    routing: str = "softmax"
    grouped: GroupedRouting | None = None  # DeepSeek's routing, in place of `routing`'s
    # a dense SwiGLU of this width beside the routed experts that every token takes (Llama 4: one expert's
    # width; Qwen3-Next: its own; DeepSeek: its n_shared_experts as one); 0: none
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert scaled by sigmoid(shared_expert_gate(x))


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Qwen3-Next's Gated DeltaNet layers (ember/model/qwen3_next.py): `num_k_heads` query/key heads of
    `k_head_dim`, each serving num_v_heads / num_k_heads value heads of `v_head_dim`, and a causal
    depthwise convolution of `conv_kernel` taps over q, k and v."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing (ember.ops.moe.route_grouped): scores by softmax (V2) or sigmoid (V3, whose choice
    adds a per-expert correction bias, `noaux_tc`), the experts split into `n_group` groups of which each
    token keeps the `topk_group` best (a group's score: its best expert's for V2's group_limited_greedy,
    its best two's sum for V3), then the top k of the kept experts; the weights (renormalised where the
    config says so) multiplied by `scaling` (routed_scaling_factor)."""

    sigmoid: bool
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    score_bias: bool = False  # V3's e_score_correction_bias, added for the choice only


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention. Each token's keys and values are one latent of `kv_lora_rank`
    values (kv_a_proj_with_mqa then kv_a_layernorm) and one key of `qk_rope_head_dim` values shared by
    every head (rotated); the cache keeps those two side by side, `cache_dim` values a token per layer.
    kv_b_proj expands the latent into each head's unrotated key (qk_nope_head_dim) and value (v_head_dim).
    Queries come from q_proj, or through a low-rank q_a_proj, q_a_layernorm, q_b_proj (`q_lora_rank`).
    The rotated channels are paired as (0, 1), (2, 3), ... (DeepSeek's interleaved layout, transformers'
    `rope_interleave`); `softmax_scale` is qk_head_dim^-1/2 times YaRN's mscale(mscale_all_dim)^2."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


ENCODER_ARCHITECTURES = (
    "BertModel",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "NomicBertModel",
)


@dataclass(frozen=True)
class EncoderConfig:
    """A BERT-family encoder (ember/model/bert.py): bidirectional attention, learned absolute positions
    (RoBERTa's and XLM-R's numbered from pad_token_id + 1, so `position_offset`), token-type embeddings,
    LayerNorm after each block, biased projections. `num_labels` > 0: a sequence classifier on the first
    token (a cross-encoder reranker), BERT's pooler (dense, tanh) or RoBERTa's head (dense, tanh,
    out_proj) before the labels. `nomic`: nomic-bert (nomic-embed-text), whose differences are all of a
    piece: rotary positions (ModelConfig.rope_theta) instead of a learned table, no biases in the
    projections, a SwiGLU MLP."""

    layer_norm_eps: float
    type_vocab_size: int
    position_offset: int
    num_labels: int = 0
    roberta: bool = False  # RoBERTa / XLM-R names and classification head
    nomic: bool = False  # nomic-bert's rotary, bias-free, SwiGLU layers and checkpoint names


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower and its projector (Gemma 3: SigLIP, then average pooling to `tokens_per_image`,
    RMSNorm and a projection into the text model; ember/model/siglip.py). An image becomes
    `tokens_per_image` embeddings that replace as many `image_token_id` tokens of the prompt, written
    there by the front end in place of the model's placeholder, `boi_token_id` (Gemma 3's
    "<start_of_image>"), as `\\n\\n<boi> <image>*N <eoi>\\n\\n`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def bidirectional_images(self) -> bool:
        """An image's tokens attend to every token of their image (transformers' token_type_ids mask), so a
        prefill chunk holds all of an image it computes: the last token's keys must be cached or in the step."""
        return True


QWEN25_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower (ember/model/qwen2_5_vl.py): images of any size cut into `patch_size`
    patches over `temporal_patch_size` frames (a still image repeats its frame), a ViT of RMSNorm blocks
    with 2D rotary, window attention (`window_size` pixels a side) but in `fullatt_block_indexes`, and a
    merger of each `spatial_merge_size`^2 patches into one token of `out_hidden_size`. An image becomes
    grid_h * grid_w / merge^2 `image_token_id` tokens, written by the front end in place of one
    `<|image_pad|>` (the same id) between `<|vision_start|>` and `<|vision_end|>`."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    hidden_act: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    rope_theta: float = 10000.0

    @property
    def bidirectional_images(self) -> bool:
        """Image tokens attend causally, as text: a prefill chunk may end inside an image."""
        return False


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face `config.json` terms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # Gemma: (1 + w) norms, four norms per layer, embeddings scaled by sqrt(hidden), GELU-tanh MLP
    gemma_norms: bool = False
    unit_offset_norms: bool = False  # RMSNorms scale by (1 + w) without Gemma's other traits (Qwen3-Next)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default: head_dim)
    # "sliding_attention" / "full_attention" per layer; None: every layer attends to its whole context
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    # rope of the sliding layers where it differs from the global one (Gemma 3's local base)
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    o_proj_bias: bool = False  # gpt-oss: attention_bias covers the output projection too
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in every softmax denominator
    # Llama 4: "chunked_attention" layers see only keys of their query's chunk of this many positions
    attention_chunk_size: int | None = None
    nope_layers: tuple[int, ...] = ()  # Llama 4: layers without rotary (global NoPE layers)
    # Llama 4's NoPE layers scale queries by log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1:
    # (floor_scale, attn_scale); None: no temperature tuning
    attn_temperature: tuple[float, float] | None = None
    # Llama 4: a weightless RMSNorm of each query and key head (use_qk_norm), on the rope layers only
    weightless_qk_norm: bool = False

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of a Llama 4 local layer (keys at k // C == q // C, k <= q), else None."""
        if self.layer_types is None or self.layer_types[layer] != "chunked_attention":
            return None
        return self.attention_chunk_size

    partial_rotary_factor: float = 1.0  # the share of each head that is rotated (Phi-4-mini: 0.75)
    moe: MoeConfig | None = None  # mixture-of-experts models (Qwen3-MoE, Mixtral)
    encoder: EncoderConfig | None = None  # an encoder (BERT, XLM-R): pooling only, bidirectional attention
    vision: VisionConfig | QwenVisionConfig | None = None  # a vision tower (Gemma 3's SigLIP, Qwen2.5-VL's ViT)
    # M-RoPE (Qwen2.5-VL): the rotary channel pairs of each head split into sections rotated by a token's
    # temporal, height and width positions (text tokens: all three the same); None: plain rotary
    mrope_section: tuple[int, int, int] | None = None
    # Qwen3-Next: the "linear_attention" layers of layer_types; its full-attention layers gate their output
    linear_attention: LinearAttentionConfig | None = None

    def layer_is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer: a recurrent state per request instead of KV (ember/runner/linear_state.py)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    mla: MlaConfig | None = None  # DeepSeek's multi-head latent attention (ember/model/mla.py) in every layer

    def layer_is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch in ENCODER_ARCHITECTURES:
            return _encoder_config(arch, cfg)
        if arch in LLAMA4_ARCHITECTURES:
            return _llama4_config(arch, cfg)
        if arch in DEEPSEEK_ARCHITECTURES:
            return _deepseek_config(cls, arch, cfg)
        vision: VisionConfig | QwenVisionConfig | None = None
        mrope = None
        if arch == QWEN25_VL:
            vision, mrope, cfg = _qwen25_vl(cfg)
        if arch in _GEMMA_DEFAULTS:
            if arch == "Gemma3ForConditionalGeneration":
                vision = _gemma3_vision(cfg)
                cfg = cfg["text_config"]
            cfg = {**_GEMMA_DEFAULTS[arch], **cfg}
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope(cfg, "full_attention")
        gemma = arch in _GEMMA_DEFAULTS
        local_theta, local_scaling = None, None
        if arch in _GEMMA3:  # transformers' defaults: 1e6 for the global layers, 1e4 for the local ones
            rope_theta = rope_theta or 1_000_000.0
            local_theta, local_scaling = _rope(cfg, "sliding_attention")
            local_theta = local_theta or 10_000.0
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or _DEFAULT_THETA.get(arch, 10000.0)),
            rope_scaling=_resolve_yarn(_resolve_longrope(rope_scaling, cfg), cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch in ("Qwen2ForCausalLM", QWEN25_VL, _GPT_OSS))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", _QWEN3_NEXT, *_GEMMA3),
            gemma_norms=gemma,
            unit_offset_norms=arch == _QWEN3_NEXT,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
            layer_types=_layer_types(arch, cfg),
            sliding_window=cfg.get("sliding_window") if arch in _SLIDING else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            rope_local_scaling=local_scaling,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping, so Ember does too
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            partial_rotary_factor=_partial_rotary_factor(cfg, 0.25 if arch == _QWEN3_NEXT else 1.0),
            moe=_moe(arch, cfg),
            o_proj_bias=arch == _GPT_OSS and bool(cfg.get("attention_bias", True)),
            attention_sinks=arch == _GPT_OSS,
            vision=vision,
            mrope_section=mrope,
            linear_attention=_linear_attention(arch, cfg),
        )

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config with LongRoPE's factor set chosen for an engine whose sequences reach max_model_len.

        As vLLM and llama.cpp do, one set serves every position of every sequence: the long factors
        when sequences may outgrow original_max_position_embeddings, else the short ones. A token's
        cached keys then never depend on how long its sequence grows later. transformers instead
        rotates a sequence with the short factors until it passes that length and then recomputes its
        whole context with the long ones; the two agree on every token while max_model_len stays
        within the pre-training length, and otherwise on every token produced after the sequence
        has passed it (a prompt longer than the pre-training length: all of them)."""
        if self.rope_scaling is None or _rope_type(self.rope_scaling) != "longrope":
            return self
        use_long = max_model_len > self.rope_scaling["original_max_position_embeddings"]
        return dataclasses.replace(self, rope_scaling={**self.rope_scaling, "use_long_factors": use_long})

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates; the rest pass through (HF's rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)


LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")


def _llama4_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    """Llama 4's text model (of Llama4ForConditionalGeneration: `text_config`, the vision tower not
    loaded), transformers' Llama4TextConfig defaults where the file is silent. Layers with rope are
    local (chunked attention, QK L2 norm), the others global NoPE with temperature tuning; MoE layers
    every `interleave_moe_layer_step`-th (or those `moe_layers` lists), dense ones of
    `intermediate_size_mlp` between them."""
    if arch == "Llama4ForConditionalGeneration":
        cfg = cfg.get("text_config") or {}
    n = int(cfg.get("num_hidden_layers", 48))
    heads, hidden = int(cfg.get("num_attention_heads", 40)), int(cfg.get("hidden_size", 5120))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu only)")
    interval = int(cfg.get("no_rope_layer_interval", 4))
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]  # 1: rope
    chunk = cfg.get("attention_chunk_size", 8192)
    layer_types = cfg.get("layer_types") or [
        "chunked_attention" if rope and chunk is not None else "full_attention" for rope in uses_rope[:n]
    ]
    step = int(cfg.get("interleave_moe_layer_step", 1))
    moe_layers = cfg.get("moe_layers")
    moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
    num_experts, top_k = int(cfg.get("num_local_experts", 16)), int(cfg.get("num_experts_per_tok", 1))
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    rope_theta, rope_scaling = _rope(cfg, "full_attention")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg.get("vocab_size", 202048)),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size_mlp", 16384)),  # the dense layers'
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta or 500_000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096 * 32)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=False,
        weightless_qk_norm=bool(cfg.get("use_qk_norm", True)),
        layer_types=tuple(layer_types),
        attention_chunk_size=None if chunk is None else int(chunk),
        nope_layers=tuple(i for i in range(n) if not uses_rope[i]),
        attn_temperature=(
            (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
            if cfg.get("attn_temperature_tuning", True)
            else None
        ),
        moe=MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=int(cfg.get("intermediate_size", 8192)),
            renormalize=False,
            dense_layers=tuple(i for i in range(n) if i not in moe_layers),
            routing="sigmoid-input",
            shared_expert_intermediate_size=int(cfg.get("intermediate_size", 8192)),
        ),
    )


def _gemma3_vision(cfg: dict[str, Any]) -> VisionConfig | None:
    """Gemma 3's SigLIP tower (transformers' Gemma3Config / SiglipVisionConfig defaults where the file is
    silent); None for a checkpoint without `vision_config` (its text model alone)."""
    v = cfg.get("vision_config")
    if not v:
        return None
    return VisionConfig(
        hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_hidden_layers=int(v.get("num_hidden_layers", 27)),
        num_attention_heads=int(v.get("num_attention_heads", 16)),
        image_size=int(v.get("image_size", 896)),
        patch_size=int(v.get("patch_size", 14)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
        boi_token_id=int(cfg.get("boi_token_index", 255999)),
        eoi_token_id=int(cfg.get("eoi_token_index", 256000)),
    )


def _qwen25_vl(cfg: dict[str, Any]) -> tuple[QwenVisionConfig, tuple[int, int, int], dict[str, Any]]:
    """Qwen2.5-VL: its vision tower, its M-RoPE sections and its text model's keys (under `text_config` in
    transformers >= 5's configs, at the top level in the Hub's; mrope_section under `rope_parameters`
    or `rope_scaling`, whose type "mrope" / "default" is otherwise plain rotary)."""
    v = cfg.get("vision_config") or {}
    text = {**{k: x for k, x in cfg.items() if k != "vision_config"}, **(cfg.get("text_config") or {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"{QWEN25_VL}: rope_parameters.mrope_section must give three sections, got {section!r}")
    theta = rope.get("rope_theta") or text.get("rope_theta") or 1_000_000.0
    text = {**text, "rope_theta": theta, "rope_scaling": None, "rope_parameters": None}
    if (v.get("rope_parameters") or {}).get("rope_type", "axial") != "axial":
        raise ValueError(f"{QWEN25_VL}: vision rope_type {v['rope_parameters']['rope_type']!r} (axial only)")
    vision = QwenVisionConfig(
        depth=int(v.get("depth", 32)),
        hidden_size=int(v.get("hidden_size", 3584)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        num_heads=int(v.get("num_heads", 16)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        hidden_act=str(v.get("hidden_act", "silu")),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    )
    a, b, c = (int(x) for x in section)
    return vision, (a, b, c), text


def _encoder_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    """BERT's and RoBERTa's config.json keys. The context is max_position_embeddings less the positions
    RoBERTa skips (514 - 2 = 512 for XLM-R); a classifier's labels are id2label's (transformers' rule)."""
    nomic = arch == "NomicBertModel"
    if nomic:
        cfg = _nomic_keys(cfg)
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute only)")
    roberta = arch.startswith(("Roberta", "XLMRoberta"))
    offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    labels = len(cfg["id2label"]) if cfg.get("id2label") else int(cfg.get("num_labels", 2))
    encoder = EncoderConfig(
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        position_offset=offset,
        num_labels=labels if arch.endswith("ForSequenceClassification") else 0,
        roberta=roberta,
        nomic=nomic,
    )
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=encoder.layer_norm_eps,
        rope_theta=float(cfg.get("rope_theta", 0.0)),
        rope_scaling=None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - offset,
        tie_word_embeddings=False,
        attention_bias=not nomic,
        qk_norm=False,
        hidden_act=str(cfg.get("hidden_act", "gelu")),
        encoder=encoder,
    )


# nomic-ai's own config.json (for its remote code: GPT-2's key names) -> transformers' NomicBertConfig names
_NOMIC_KEYS = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "n_inner",
    "layer_norm_eps": "layer_norm_epsilon",
}
# the remote code's switches, at the values of nomic-embed-text v1 and v1.5 (what transformers' NomicBert
# and llama.cpp's nomic-bert run; its converter asserts the same); absent or null: that value
_NOMIC_FIXED: dict[str, Any] = {
    "activation_function": "swiglu",
    "prenorm": False,
    "causal": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,  # dynamic NTK scaling past the trained context
    "moe_every_n_layers": 0,  # nomic-embed-text-v2-moe's experts
}


def _nomic_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """A nomic-bert config in transformers' keys, from either its own or nomic-ai's. The context is the
    trained one where the file says (nomic-embed-text v1.5 claims n_positions 8192 but was trained on 2048,
    and reaches 8192 only with the dynamic NTK scaling refused here, as llama.cpp's converter does)."""
    for key, want in _NOMIC_FIXED.items():
        if cfg.get(key) not in (None, want):
            raise ValueError(f"{key} {cfg[key]!r} is not supported for NomicBertModel (only {want!r})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for NomicBertModel (silu only)")
    theta, scaling = _rope(cfg, "full_attention")
    if scaling is not None:
        raise ValueError(f"rope scaling {_rope_type(scaling)!r} is not supported for NomicBertModel")
    out = {**cfg, **{key: cfg[old] for key, old in _NOMIC_KEYS.items() if cfg.get(key) is None and old in cfg}}
    context = cfg.get("max_trained_positions") or cfg.get("max_position_embeddings") or cfg.get("n_positions")
    return {
        **out,
        "intermediate_size": out.get("intermediate_size") or 4 * out["hidden_size"],
        "max_position_embeddings": context or 2048,
        "hidden_act": "silu",
        "rope_theta": theta or cfg.get("rotary_emb_base") or 1000.0,  # transformers' default
    }


def _moe(arch: str, cfg: dict[str, Any]) -> MoeConfig | None:
    """Qwen3-MoE and Mixtral route each token to its top-k experts by a softmax over all of them.
    What they do not share is refused by name: shared experts (Qwen2-MoE's), other activations, and
    Qwen3-MoE's sliding window (off in every released checkpoint)."""
    if arch == _GPT_OSS:
        return _gpt_oss_moe(cfg)
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", _QWEN3_NEXT):
        return None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == _QWEN3_NEXT else 0
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key) and arch != _QWEN3_NEXT:
            raise ValueError(f"{key}: shared experts are not supported for {arch}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} experts (silu only)")
    dense: tuple[int, ...]
    if arch == "MixtralForCausalLM":
        num_experts, inter, renormalize, dense = cfg["num_local_experts"], cfg["intermediate_size"], True, ()
    else:
        if cfg.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window is not supported for {arch}")
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        inter, renormalize = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        dense = tuple(
            i for i in range(cfg["num_hidden_layers"]) if i in only or num_experts == 0 or (i + 1) % step
        )  # transformers' rule
    top_k = cfg["num_experts_per_tok"]
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=inter,
        renormalize=renormalize,
        dense_layers=dense,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=bool(shared),
    )


DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


def _deepseek_config(cls: type[ModelConfig], arch: str, cfg: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2 / V2-Lite / V3: the Llama-like rest read as any decoder's, with `head_dim` the rotated
    width (the rotary tables' width, as transformers sets it) and one KV "head" (the latent); then MLA and
    the MoE. Where config.json is silent, transformers' DeepseekV2Config / DeepseekV3Config defaults."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{key}: biases are not supported for {arch}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu only)")
    heads, rope_dim = cfg["num_attention_heads"], int(cfg.get("qk_rope_head_dim", 64))
    plain = {**cfg, "architectures": [], "head_dim": rope_dim, "num_key_value_heads": heads}
    base = cls.from_hf_config(plain)
    v3 = arch == _DEEPSEEK_V3
    nope = int(cfg.get("qk_nope_head_dim", 128))
    scale = (nope + rope_dim) ** -0.5
    raw_scaling = _rope(cfg, "full_attention")[1] or {}
    if base.rope_scaling is not None and raw_scaling.get("mscale_all_dim"):
        # transformers' yarn_apply_mscale: every logit, not only the rotated channels' share, is scaled
        factor = base.rope_scaling.get("factor") or raw_scaling["factor"]
        m = _yarn_mscale(float(factor), float(raw_scaling["mscale_all_dim"]))
        scale *= m * m
    q_lora = cfg.get("q_lora_rank", 1536)
    mla = MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg.get("v_head_dim", 128)),
        softmax_scale=scale,
        # transformers' V2 always pairs adjacent channels (complex multiplication); V3 unless told not to
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )
    return dataclasses.replace(base, architecture=arch, mla=mla, moe=_deepseek_moe(arch, cfg))


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _deepseek_moe(arch: str, cfg: dict[str, Any]) -> MoeConfig:
    """Routed experts behind `first_k_dense_replace` dense layers, shared experts beside them.

    transformers' DeepseekV2 router ignores norm_topk_prob; Ember applies it as DeepSeek's own code and
    vLLM do (every released V2 and V2-Lite config sets it false, where both agree)."""
    v3 = arch == _DEEPSEEK_V3
    num_experts, top_k = int(cfg.get("n_routed_experts", 256 if v3 else 64)), cfg.get("num_experts_per_tok")
    if top_k is None or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise ValueError(f"topk_method {method!r} is not supported for {arch}")
    grouped = v3 or method == "group_limited_greedy"
    n_group = int(cfg.get("n_group") or (8 if v3 else 1)) if grouped else 1
    topk_group = int(cfg.get("topk_group") or (4 if v3 else 1)) if grouped else 1
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {num_experts} experts")
    if v3 and num_experts // n_group < 2:
        raise ValueError(f"n_group {n_group}: noaux_tc scores a group by its best two experts")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"num_experts_per_tok {top_k} exceeds the experts of topk_group {topk_group} groups")
    inter = int(cfg.get("moe_intermediate_size", 2048 if v3 else 1407))
    first_dense = int(cfg.get("first_k_dense_replace", 3 if v3 else 0))
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(top_k),
        intermediate_size=inter,
        renormalize=bool(cfg.get("norm_topk_prob", v3)),
        dense_layers=tuple(range(min(first_dense, cfg["num_hidden_layers"]))),
        shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts", 1 if v3 else 2) or 0),
        grouped=GroupedRouting(
            sigmoid=v3,
            n_group=n_group,
            topk_group=topk_group,
            scaling=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            score_bias=v3,
        ),
    )


def _gpt_oss_moe(cfg: dict[str, Any]) -> MoeConfig:
    """gpt-oss takes the softmax of the top-k router logits, which is the softmax over all experts
    renormalised over the top k; its config's hidden_act is unused (the experts' clamped SwiGLU is fixed)."""
    num_experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=cfg["intermediate_size"],
        renormalize=True,
        bias=True,
        swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
    )


def _resolve_yarn(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """YaRN (gpt-oss) with its defaults resolved as transformers' `_compute_yarn_parameters` resolves
    them: factor from the two lengths when absent, beta_fast 32 / beta_slow 1, truncate on, and the
    cos/sin scale (attention_factor) from mscale / mscale_all_dim, else 0.1 ln(factor) + 1."""
    if scaling is None or _rope_type(scaling) != "yarn":
        return scaling
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: yarn needs original_max_position_embeddings")
    factor = float(scaling.get("factor") or cfg["max_position_embeddings"] / original)

    mscale = _yarn_mscale
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _partial_rotary_factor(cfg: dict[str, Any], default: float = 1.0) -> float:
    """Top level in config.json (Phi-4-mini), inside `rope_parameters` in transformers >= 5's; `default`
    where neither gives it (Qwen3-Next's is 0.25)."""
    params = cfg.get("rope_parameters")
    return float(
        cfg.get("partial_rotary_factor")
        or (params if isinstance(params, dict) else {}).get("partial_rotary_factor")
        or default
    )


def _resolve_longrope(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """LongRoPE (Phi-3, also under its old name 'su') with every default resolved the way transformers'
    `_compute_longrope_parameters` resolves it, so the rotary table needs nothing but this dict: the
    pre-training length may sit beside the factors or at the top of config.json, `factor` defaults to
    max_position_embeddings / original_max_position_embeddings, and the cos/sin scale to
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 when factor <= 1)."""
    if scaling is None or _rope_type(scaling) not in ("longrope", "su"):
        return scaling
    # transformers lets the top-level value win where both are given
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    original = int(original)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {
        "rope_type": "longrope",
        "short_factor": list(scaling["short_factor"]),
        "long_factor": list(scaling["long_factor"]),
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "attention_factor": float(attention_factor),
    }


_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' config defaults for keys that Gemma configs on the Hub leave out (Gemma 3's
# multimodal configs give little more than the sizes under `text_config`)
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
}
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "vocab_size": 256_000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 2,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    **dict.fromkeys(_GEMMA3, _GEMMA3_DEFAULTS),
}
_GPT_OSS = "GptOssForCausalLM"
_QWEN3_NEXT = "Qwen3NextForCausalLM"
_DEFAULT_THETA = {_GPT_OSS: 150_000.0}  # transformers' config defaults where config.json gives none
# architectures whose `sliding_window` is used (Qwen2 configs carry one that is off unless use_sliding_window)
_SLIDING = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", _GPT_OSS, *_GEMMA_DEFAULTS)


def _linear_attention(arch: str, cfg: dict[str, Any]) -> LinearAttentionConfig | None:
    """Qwen3-Next's Gated DeltaNet shapes (transformers' Qwen3NextConfig defaults where the file is silent)."""
    if arch != _QWEN3_NEXT:
        return None
    la = LinearAttentionConfig(
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if la.num_v_heads % la.num_k_heads:
        raise ValueError(
            f"linear_num_value_heads ({la.num_v_heads}) must be a multiple of linear_num_key_heads ({la.num_k_heads})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu only)")
    return la


def _layer_types(arch: str, cfg: dict[str, Any]) -> tuple[str, ...] | None:
    """transformers 5 configs list each layer's type; older ones give a period where every
    `sliding_window_pattern`-th layer is global (Gemma), or make every layer slide (Mistral). Qwen3-Next:
    "linear_attention" or "full_attention", every `full_attention_interval`-th layer full by default."""
    if arch == _QWEN3_NEXT:
        if cfg.get("layer_types"):
            return tuple(cfg["layer_types"])
        interval = int(cfg.get("full_attention_interval", 4))
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])
        )
    if arch not in _SLIDING or cfg.get("sliding_window") is None:
        return None
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    period = cfg.get("sliding_window_pattern") if arch in _GEMMA_DEFAULTS else 2 if arch == _GPT_OSS else None
    return tuple(
        "sliding_attention" if period is None or (i + 1) % period else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    )


def _rope(cfg: dict[str, Any], layer_type: str) -> tuple[float | None, dict[str, Any] | None]:
    """(theta, scaling) of one layer type. transformers >= 5 puts them under `rope_parameters`, one dict
    for all layers or one per layer type (Gemma 3); older configs give `rope_theta` and `rope_scaling`
    (Gemma 3: for the global layers; the local ones use `rope_local_base_freq`, unscaled)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if not isinstance(params, dict) or not ({"rope_theta", "rope_type"} & params.keys()):
        params = {}
    scaling = params if params.get("rope_type", "default") != "default" else None
    if layer_type == "sliding_attention":
        return params.get("rope_theta", cfg.get("rope_local_base_freq")), scaling
    return cfg.get("rope_theta") or params.get("rope_theta"), cfg.get("rope_scaling") or scaling
