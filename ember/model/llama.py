"""The decoder shared by Llama (2, 3, Mistral, SmolLM), Qwen2 (QKV bias), Qwen3 (QK norm), Phi-3
(fused checkpoint tensors, LongRoPE, partial rotary) and Gemma 2/3.

Gemma differs in config-driven details only: (1 + w) norms, a norm after attention and after the
MLP besides the usual two (the "sandwich"), embeddings scaled by sqrt(hidden), GELU-tanh, its own
attention scale, local (sliding-window) layers with their own rope, and soft-capped scores/logits.

Parameters keep Hugging Face's names except that q/k/v and gate/up are fused into one matmul
each; `load_weights` slices checkpoint tensors into the fused parameters (a checkpoint that is
fused already, as Phi-3's, is first cut into its parts so both kinds take one path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from ember.errors import ModelLoadError
from ember.model import gpt_oss, llama4
from ember.model.hf_config import LLAMA4_ARCHITECTURES, QWEN25_VL, ModelConfig, QwenVisionConfig
from ember.model.layers import Embedding, GatedMLP, GemmaRMSNorm, RMSNorm, RotaryEmbedding, WeightlessRMSNorm
from ember.model.linear import QuantEmbedding, QuantLinear, fp8_input_layout, quantize_module
from ember.model.mla import MLAttention
from ember.model.moe import FusedExperts, make_mlp, moe_tensor_name
from ember.model.qwen2_5_vl import Grid, Qwen25VisionTower
from ember.model.sharding import ShardLayout, WeightValue, read_shard
from ember.model.siglip import Gemma3Vision
from ember.ops import registry
from ember.ops.attention import AttentionMetadata, AttentionShape, Masking
from ember.quant.experts import QuantizedExperts
from ember.quant.formats import Fp8Activation, Fp8Layout, QuantizedWeight
from ember.quant.quantize import method_for


def _norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.gemma_norms or cfg.unit_offset_norms else RMSNorm)(size, cfg.rms_norm_eps)


class Attention(nn.Module):
    """This rank's query and KV heads; o_proj is row-parallel, so its partial sums are all-reduced."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        rotary: RotaryEmbedding | None,
        layer: int,
        input_size: int | None = None,
    ) -> None:
        """`rotary` None: a layer without positions in its keys (Llama 4's NoPE layers). `input_size`: the
        width qkv_proj reads where it is not the hidden size (an EAGLE-3 draft's layer attends over its
        token embedding and hidden state side by side, ember/model/eagle3.py)."""
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.layer_window(layer)
        self.attention_chunk = cfg.layer_chunk(layer)
        # Llama 4's NoPE layers: (floor_scale, attn_scale) of the queries' temperature tuning
        self.temperature = cfg.attn_temperature if layer in cfg.nope_layers else None
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.qkv_proj = nn.Linear(
            input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        # a row-parallel bias is added once: rank 0 holds it, the others zeros (see ShardLayout.summed_once)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: this rank's heads' sink logits, float32 whatever the model dtype (the kernels' operand)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)) if cfg.attention_sinks else None
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _norm(cfg, self.head_dim), _norm(cfg, self.head_dim)
        elif cfg.weightless_qk_norm and rotary is not None:
            # Llama 4 normalises after rotary, which is the same: a rotation keeps each head's norm
            self.q_norm = WeightlessRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = WeightlessRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self._target = registry.target(self.o_proj.weight.device, self.o_proj.weight.dtype)
        self._rope = None if rotary is None else rotary.implementation(self._target, self.head_dim)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # fp8 KV: stored = value / scale. 1.0 (as vLLM without calibration) keeps |k|, |v| <= 448 exact
        # to e4m3's 3-bit mantissa; larger values saturate.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """Set this layer's KV cache (None: released) and choose the kernels its dtype and shape take
        (ember/ops/attention.py; the fused native rotary and store, ember/ops/rotary.py)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        if k_cache is None:
            return
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        shape = AttentionShape(k_cache.dtype, self.num_heads, num_kv_heads, head_dim, block_size)
        self._attention = registry.attention_impl(self._target, shape)
        self._masking = Masking(self.sliding_window, self.logits_soft_cap, self.sinks, chunk=self.attention_chunk)
        self._rotary_store = registry.rotary_store_impl(
            self._target,
            k_cache.dtype,
            self.fused_rotary_tables(),
            None if self.q_norm is None else (self.q_norm, self.k_norm),
            self.num_heads,
            self.head_dim,
        )

    def fp8_input_layout(self, rows: int) -> Fp8Layout | None:
        """The layout in which `forward` takes `rows` rows already quantized (see QuantLinear.fp8_layout)."""
        return fp8_input_layout(self.qkv_proj, rows)

    @property
    def qkv_sizes(self) -> list[int]:
        """The rows of q, k and v in qkv_proj (a checkpoint's q_proj, k_proj and v_proj)."""
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Fp8Activation, meta: AttentionMetadata
    ) -> torch.Tensor:
        o = self.attend(positions, self.qkv_proj(x), meta)
        return all_reduce(self.o_proj(o.reshape(-1, self.q_size)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Queries, keys and values [T, q + 2 kv] -> the attention output per query head, before o_proj:
        QK norm and rotary applied, the keys and values stored in the cache."""
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None, "bind_cache sets the KV cache before any step"
        q = self._fused_rotary_store(positions, qkv, k_cache, v_cache, meta)
        if q is None:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            q, k = self._qk(positions, qk)
            self._attention.store(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if self.temperature is not None:
            q = _temperature_tuned(q, positions, *self.temperature)
        return self._attention(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale, self._masking)

    def _qk(self, positions: torch.Tensor, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys [T, H, D] from the fused projection's [T, Hq + Hk, D]: QK norm, then rotary."""
        if self.q_norm is None or self.k_norm is None:  # both or neither
            if self.rotary is None or self._rope is None:
                return qk[:, : self.num_heads], qk[:, self.num_heads :]
            return self._rope.rotate_qk(self.rotary, positions, qk, self.num_heads)
        q, k = self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])
        if self.rotary is None or self._rope is None:
            return q, k
        return self._rope(self.rotary, positions, q, k)

    def _fused_rotary_store(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The QK norm, rotary and the KV store in one kernel where the layer chose one (ember/ops/rotary.py:
        TritonRotaryStore, NativeRotaryStore): the queries [T, Hq, D], or None where the modules run."""
        return self._rotary_store(positions, qkv, k_cache, v_cache, meta.slot_mapping)

    def fused_rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos and signed sin tables the fused rotary and store kernels read, where one may compute this
        layer's: every channel rotated, an unscaled cache; else None."""
        unscaled = type(self.k_scale) is float and type(self.v_scale) is float and self.k_scale == self.v_scale == 1.0
        return self.rotary.full_tables(self.head_dim) if unscaled and self.rotary is not None else None


def _temperature_tuned(q: torch.Tensor, positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's NoPE-layer queries times log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1, in
    float32 and rounded back as transformers computes it."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales[:, None, None]).to(q.dtype)


class DecoderLayer(nn.Module):
    """Llama's two norms, or Gemma's four: there post_attention_layernorm normalises the attention
    output before it joins the residual stream, pre_feedforward_layernorm does what Llama's
    post_attention_layernorm does, and post_feedforward_layernorm normalises the MLP output."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        # DeepSeek's multi-head latent attention (ember/model/mla.py), or the usual kind
        self.self_attn = MLAttention(cfg, layout, rotary, layer) if cfg.mla else Attention(cfg, layout, rotary, layer)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.gemma_norms:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.sandwich = cfg.gemma_norms
        self.mlp = make_mlp(cfg, layout, layer)  # a dense MLP or a mixture of experts (ember/model/moe.py)
        self._target = self.self_attn._target
        self.choose_kernels()

    def choose_kernels(self) -> None:
        """The whole-layer native decode (ember/ops/decode_layer.py) where the layer, as loaded, is what
        it computes; asked again once the weights are loaded or quantized (CausalLM.choose_kernels)."""
        self._decode = registry.decode_layer_impl(self._target, self)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP output and the residual stream; the next norm adds them (fused)."""
        fused = self._native_decode(positions, h, residual, meta)
        if fused is not None:
            return fused
        # fp8 linears reading a norm's output alone take it quantized by the norm (None: as a tensor)
        rows = h.shape[0]
        attn_fp8 = self.self_attn.fp8_input_layout(rows)
        mlp_fp8 = self.mlp.fp8_input_layout(rows) if isinstance(self.mlp, GatedMLP) else None
        if residual is None:
            residual, h = h, self.input_layernorm(h, fp8=attn_fp8)
        else:
            h, residual = self.input_layernorm(h, residual, attn_fp8)
        h = self.self_attn(positions, h, meta)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(h, residual, mlp_fp8)
            return all_reduce(self.mlp(h)), residual  # down_proj is row-parallel
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual, mlp_fp8)
        return self.post_feedforward_layernorm(all_reduce(self.mlp(h))), residual

    def _native_decode(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step of the whole layer in one native call where the layer chose it; None where the
        modules run (prefill rows, other layers, other devices)."""
        return self._decode(positions, h, residual, meta)


class DecoderModel(nn.Module):
    embed_scale: torch.Tensor | None  # a buffer (register_buffer)

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, max_positions: int) -> None:
        super().__init__()
        self.layout = layout
        rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim, cfg.mrope_section
        )
        local = (
            rotary
            if cfg.rope_local_theta is None
            else RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.rope_local_theta, cfg.rope_local_scaling, cfg.rotary_dim
            )
        )
        self.embed_tokens = Embedding(layout.vocab_per_rank, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(
                cfg, layout, None if i in cfg.nope_layers else rotary if cfg.layer_window(i) is None else local, i
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = _norm(cfg, cfg.hidden_size)
        # Gemma: sqrt(hidden) rounded to the model dtype, as transformers' embedding scale is
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale if cfg.gemma_norms else None, persistent=False)
        # LoRA (ember/model/lora.py): adds each token's embedding-adapter delta to its embedding, in place
        self.embed_lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # CausalLM.set_aux_hidden_state_layers: the layers whose input `forward` keeps in aux_hidden_states
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        self.choose_kernels()

    @staticmethod
    def make_layer(cfg: ModelConfig, layout: ShardLayout, rotary: RotaryEmbedding | None, layer: int) -> nn.Module:
        """Layer `layer` (a model family with other layer kinds overrides it: ember/model/qwen3_next.py)."""
        return DecoderLayer(cfg, layout, rotary, layer)

    def choose_kernels(self) -> None:
        """Every layer's decode step in one native call (ember/ops/decode_layer.py) where each layer, as
        loaded, is what it computes; asked again with the layers' own choice (CausalLM.choose_kernels)."""
        layers = self.decoder_layers()
        self._decode = registry.decode_layers_impl(layers[0]._target, layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its rows and zeros the others; the sum over
        ranks is the embedding."""
        if self.layout.size == 1:
            h = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.layout.vocab_start
            mine = (local >= 0) & (local < self.layout.vocab_rows)
            h = self.embed_tokens(torch.where(mine, local, 0))
            h = all_reduce(h * mine.unsqueeze(-1).to(h.dtype))
        if self.embed_lora is not None:
            self.embed_lora(input_ids, h)
        return h if self.embed_scale is None else h * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        if images is not None:  # an image's embeddings, unscaled (as transformers scatters them)
            h[images.rows] = images.embeddings.to(h.dtype)
        fused = self._native_decode(positions, h, meta)
        if fused is not None:
            return self.norm(*fused)[0]
        residual = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:  # the residual stream entering layer i; the layers never write their inputs
                aux.append(h if residual is None else h + residual)
            h, residual = layer(positions, h, residual, meta)
        if aux:
            self.aux_hidden_states = torch.cat(aux, dim=-1)
        return self.norm(h, residual)[0]

    def _native_decode(
        self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step of every layer in one native call where the model chose it and keeps no layer's
        input (aux_layers); None where the layers run one by one."""
        return None if self.aux_layers else self._decode(positions, h, None, meta)

    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers` as what they are (nn.ModuleList types its items as nn.Module): built above, never replaced."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


# checkpoint name suffix -> (fused parameter suffix, shard index)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": (
        "shared_expert.gate_up_proj",
        0,
    ),  # Llama 4's, Qwen3-Next's and DeepSeek's shared expert(s)
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}
SHARDS_PER_FUSED = {"qkv_proj": 3, "gate_up_proj": 2}
# Gemma3ForConditionalGeneration: the language model's tensors under transformers < 5's and >= 5's names
_LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_QWEN_VISION_PREFIXES = ("visual.", "model.visual.")  # Qwen2.5-VL's tower, transformers < 5 and >= 5


def _vision_name(name: str) -> str | None:
    """The vision module's parameter for a multimodal checkpoint's vision tensor; None for the text model's."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return "vision." + name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.", 1)
    for prefix in _QWEN_VISION_PREFIXES:
        if name.startswith(prefix):
            return "vision." + name.removeprefix(prefix)
    return None


def _past_last_layer(name: str, num_layers: int) -> bool:
    """A `model.layers.{i}.` tensor with i >= num_layers."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def _copy_whole(params: dict[str, nn.Parameter], name: str, value: WeightValue, source: str) -> int:
    """Copy one unsharded checkpoint tensor into its parameter (shapes checked); returns 1."""
    param = params.get(name)
    tensor = read_shard(value, None)
    if param is None or not isinstance(tensor, torch.Tensor):
        raise ModelLoadError(source, f"unexpected tensor {name!r}")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
    return 1


def _language_model_name(name: str) -> str:
    """The text model's name for a multimodal checkpoint's text tensor."""
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


# fused checkpoint tensor (Phi-3) -> the parts it stacks, in order
_STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass
class ImageRows:
    """A step's image-token rows and their embeddings from the vision tower ([N] int64, [N, hidden])."""

    rows: torch.Tensor
    embeddings: torch.Tensor


class CausalLM(nn.Module):
    decoder_class: type[DecoderModel] = DecoderModel  # the layer stack (Qwen3-Next's hybrid one: its own)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.layout = ShardLayout.of(cfg, tp_rank(), tp_size())
        self.model = self.decoder_class(cfg, self.layout, max_positions)
        # the vision tower (Gemma 3's with its projector, Qwen2.5-VL's; whole on every rank); None: text only
        self.vision: Gemma3Vision | Qwen25VisionTower | None = None
        if isinstance(cfg.vision, QwenVisionConfig):
            self.vision = Qwen25VisionTower(cfg.vision)
        elif cfg.vision is not None:
            self.vision = Gemma3Vision(cfg.vision, cfg.hidden_size)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.layout.vocab_per_rank, bias=False)
        )
        # LoRA (ember/model/lora.py): adds the LM-head adapter's delta to logits of hidden rows under given slots
        self.lora_head: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, images)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed images [B, 3, S, S] -> [B, tokens_per_image, hidden]: what replaces their image tokens."""
        if not isinstance(self.vision, Gemma3Vision):
            raise ValueError(f"{self.config.architecture} has no fixed-size vision tower")
        return self.vision(pixels.to(self.model.norm.weight.dtype))

    def embed_patches(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Qwen2.5-VL: images' flattened patches [sum t*h*w, patch values] and their patch grids -> the rows
        that replace their image tokens, [sum t*h*w / merge^2, hidden], in image order."""
        if not isinstance(self.vision, Qwen25VisionTower):
            raise ValueError(f"{self.config.architecture} has no patch-grid vision tower")
        return self.vision(patches.to(self.model.norm.weight.dtype), grids)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Have every `forward` keep the residual stream entering each of `layers` (0: the embedding), for
        an EAGLE-3 draft (ember/model/eagle3.py), as vLLM's aux_hidden_state_layers. () stops it."""
        n = self.config.num_hidden_layers
        if len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers):
            raise ValueError(f"aux hidden state layers {layers}: expected distinct layer ids in [0, {n})")
        self.model.aux_layers = tuple(sorted(layers))
        self.model.aux_hidden_states = None

    @property
    def aux_hidden_states(self) -> torch.Tensor | None:
        """[T, len(layers) * hidden] from the last `forward`, the layers' states side by side in layer order;
        None until one ran with layers set. A replayed CUDA graph assigns nothing: each captured size's
        tensor is the one this held right after that capture, and its replays overwrite that tensor."""
        return self.model.aux_hidden_states

    def compute_logits(self, hidden: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits over the whole vocabulary on every rank (`head_logits`, widened)."""
        return self.head_logits(hidden, lora_slots).float()

    def head_logits(self, hidden: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank, in the head's dtype (float32 when soft-capped): what
        the one-pass GPU sampler reads, without a float32 copy of the whole [N, V] first (121 of 3,377 us a
        decode step at 256 rows of Qwen3's vocabulary on the H100). Each rank computes its rows' and the
        ranks' columns are gathered. Only the last rank can hold padding rows, so they end up past the
        vocabulary and are cut; a quantized head built from the file's rows alone is padded to the common
        width first. `lora_slots`: each row's LoRA slot, given when a row's adapter adapts the LM head."""
        logits = self.model.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        if lora_slots is not None and self.lora_head is not None:
            self.lora_head(hidden, logits, lora_slots)
        layout = self.layout
        if layout.size > 1:
            if logits.shape[-1] < layout.vocab_per_rank:
                logits = F.pad(logits, (0, layout.vocab_per_rank - logits.shape[-1]))
            logits = all_gather_last_dim(logits)[:, : layout.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits.float() / cap) * cap

    def token_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[N, K] float32 logits of row n's tokens `token_ids[n]` ([N, K]) only, as `compute_logits` gives them
        (a decoder reranker's yes/no pair): a plain head's K rows per hidden row, not the whole vocabulary.
        One rank only (the pooler runs on rank 0 alone); a quantized head computes every logit and picks."""
        assert self.layout.size == 1, "token_logits: one rank only (score requests are refused under TP)"
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        weight = getattr(head, "weight", None)
        if type(head) in (nn.Linear, Embedding) and isinstance(weight, torch.Tensor) and weight.is_floating_point():
            rows = weight[token_ids]  # [N, K, hidden]
            logits = torch.einsum("nh,nkh->nk", hidden.to(rows.dtype), rows).float()
            cap = self.config.final_logit_softcapping
            return logits if cap is None else torch.tanh(logits / cap) * cap
        return self.compute_logits(hidden).gather(1, token_ids)

    def greedy_tokens(self, hidden: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """compute_logits(hidden, lora_slots).argmax(-1); a quantized tied head finds it without every logit
        (with one rank: under tensor parallelism the other ranks take part in compute_logits' all-gather;
        not with an LM-head adapter). Not with a logit soft cap: tanh keeps the order but can round
        distinct logits to one value, and argmax then takes the first of them as transformers does."""
        if (
            lora_slots is None
            and self.layout.size == 1
            and isinstance(self.model.embed_tokens, QuantEmbedding)
            and self.lm_head is None
            and self.config.final_logit_softcapping is None
        ):
            return self.model.embed_tokens.argmax(hidden)
        return self.compute_logits(hidden, lora_slots).argmax(dim=-1)

    def quantize(self, kind: str) -> None:
        """Replace every linear layer, the embedding and the LM head by quantized forms, one at a time so
        only one float weight is ever held beside the quantized model; the LM head (or a tied embedding)
        takes the method ember.quant.quantize.method_for gives it."""
        dtype = self.model.norm.weight.dtype
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        vision = set() if self.vision is None else {id(m) for m in self.vision.modules()}
        for parent in [m for m in self.modules() if id(m) not in vision]:  # the vision tower stays as loaded
            for name, child in list(parent.named_children()):
                if isinstance(child, (nn.Linear, nn.Embedding)):
                    method = method_for(kind, lm_head=child is head)
                    setattr(parent, name, quantize_module(child, method, dtype, tied=self.lm_head is None))
        for experts in self._experts():
            experts.quantize(kind)
        self.choose_kernels()

    def choose_kernels(self) -> None:
        """Let the layers whose kernels depend on their loaded or quantized weights choose again."""
        for module in self.modules():
            if isinstance(module, (GatedMLP, DecoderLayer, DecoderModel)):
                module.choose_kernels()

    def _experts(self) -> list[FusedExperts]:
        return [m for m in self.modules() if isinstance(m, FusedExperts)]

    def _experts_of(self, name: str, source: str) -> FusedExperts:
        try:
            experts = self.get_submodule(FusedExperts.module_name(name))
        except AttributeError:
            experts = None
        if not isinstance(experts, FusedExperts):
            raise ModelLoadError(
                source, f"unexpected tensor {name!r} for {self.config.architecture} (no experts in that layer)"
            )
        return experts

    def attention_layers(self) -> Sequence[Attention | MLAttention]:
        return [layer.self_attn for layer in self.model.decoder_layers()]

    def _shard_sizes(self, fused: str) -> list[int]:
        """The parts' rows of a fused parameter (its name, its module's, or the module's attribute name)."""
        if "qkv_proj" in fused:
            attn = self.attention_layers()[0]
            assert isinstance(attn, Attention), "MLA layers fuse no q/k/v"
            return attn.qkv_sizes
        size = self.layout.shared_expert_size if "shared_expert." in fused else self.layout.intermediate_size
        return [size, size]

    def load_weights(self, weights: Iterable[tuple[str, WeightValue]], source: str) -> None:
        """Copy checkpoint tensors into parameters; every parameter must be filled exactly once.

        Quantized tensors (GGUF kept quantized) are collected per layer and replace that layer by its
        quantized form as soon as all of its parts have been read, so that the parts a layer no longer
        needs (the codes a native layout replaces, fused parts once concatenated) are freed as the load
        goes, not at its end: the default model's engine core peaked at 454 MiB instead of 524
        (2026-12-07). Under tensor parallelism each tensor is cut to this rank's slice as it is read."""
        params = {name: p for name, p in self.named_parameters() if not FusedExperts.owns(name)}
        filled: dict[str, int] = {}
        quantized: dict[str, dict[int, QuantizedWeight]] = {}
        if self.config.architecture == gpt_oss.ARCHITECTURE:
            weights = gpt_oss.checkpoint_tensors(weights, source)
        if self.config.architecture in LLAMA4_ARCHITECTURES:
            weights = llama4.checkpoint_tensors(weights, self.config, source)
        if self.config.mla is not None:  # DeepSeek's shared experts, fused into one: the blocks' shared_expert
            weights = ((name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), w) for name, w in weights)
        multimodal = self.config.architecture in ("Gemma3ForConditionalGeneration", QWEN25_VL)
        for ckpt_name, value in self._unstacked(weights, source):
            vision = _vision_name(ckpt_name) if multimodal else None
            if vision is not None:  # whole on every rank; skipped without a vision tower, as SigLIP's pooling
                if self.vision is not None and not vision.startswith("vision.vision_tower.head."):  # head (unused)
                    filled[vision] = filled.get(vision, 0) + _copy_whole(params, vision, value, source)
                continue
            name = _language_model_name(ckpt_name) if multimodal else ckpt_name
            if name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight"):
                continue
            name = moe_tensor_name(name)
            if self.config.mla is not None and _past_last_layer(name, self.config.num_hidden_layers):
                continue  # DeepSeek-V3's multi-token-prediction layer (model.layers.61), which transformers skips too
            if FusedExperts.owns(name):
                self._experts_of(name, source).load(name, value, source)
                continue
            tensor = read_shard(value, self.layout.shard(name))
            if isinstance(tensor, QuantizedExperts):
                raise ModelLoadError(source, f"unexpected stacked experts {name!r} for {self.config.architecture}")
            if self.layout.rank and ShardLayout.summed_once(name):
                assert isinstance(tensor, torch.Tensor), "biases are never quantized (a checkpoint's nor at load)"
                tensor = torch.zeros_like(tensor)
            target, offset, size, shard = name, 0, None, 0
            for ckpt, (fused, index) in FUSED.items():
                if f".{ckpt}." in name and name.replace(ckpt, fused) in params:  # (MLA's q_proj stays whole)
                    target, shard = name.replace(ckpt, fused), index
                    sizes = self._shard_sizes(target)
                    offset, size = sum(sizes[:shard]), sizes[shard]
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(source, f"unexpected tensor {name!r} for {self.config.architecture}")
            dest = param.data if size is None else param.data.narrow(0, offset, size)
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                param.data[self.layout.vocab_rows :].zero_()  # the last rank's padding rows
                dest = dest[: self.layout.vocab_rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(target, {})[shard] = tensor.to(dest.device)
            else:
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + 1
            if target in quantized and filled[target] == _shards(target):
                self._install_quantized(target, quantized.pop(target), param)
        for name in params:
            if filled.get(name, 0) != _shards(name):
                raise ModelLoadError(source, f"checkpoint is missing weights for {name!r}")
        for experts in self._experts():
            experts.finish_loading(source)
        self.choose_kernels()

    def _unstacked(self, weights: Iterable[tuple[str, WeightValue]], source: str) -> Iterable[tuple[str, WeightValue]]:
        """Checkpoint tensors with stacked q/k/v or gate/up (Phi-3's qkv_proj, gate_up_proj) cut into
        their parts, so tensor-parallel slicing and quantized shards see what separate tensors give.
        A lazily read safetensors part is read whole here (each rank then keeps its slice)."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
        for name, tensor in weights:
            stacked = next((s for s in _STACKED if f".{s}." in name), None)
            if stacked is None or isinstance(tensor, QuantizedExperts):  # stacked experts: load_weights refuses them
                yield name, tensor
                continue
            if tensor.shape[0] != sum(sizes[stacked]):
                raise ModelLoadError(
                    source,
                    f"tensor {name!r} has {tensor.shape[0]} rows, expected {' + '.join(map(str, sizes[stacked]))}",
                )
            offset = 0
            for part, size in zip(_STACKED[stacked], sizes[stacked]):
                yield name.replace(stacked, part), tensor.narrow(0, offset, size)
                offset += size

    def _install_quantized(self, param_name: str, shards: dict[int, QuantizedWeight], param: nn.Parameter) -> None:
        """Swap the layer owning `param_name` for its quantized form; shards that arrived dense (a GGUF
        file may store v_proj as F16 beside a Q4_K q_proj) stay dense parts of the fused layer."""
        module_name = param_name.rsplit(".", 1)[0]
        parent_name, attr = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
        parent = self.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantEmbedding(shards[0], param.dtype, tied=self.lm_head is None))
            return
        sizes = self._shard_sizes(module_name) if attr in SHARDS_PER_FUSED else [param.shape[0]]
        parts: list[QuantizedWeight | torch.Tensor] = []
        for i, size in enumerate(sizes):
            parts.append(shards[i] if i in shards else param.data.narrow(0, sum(sizes[:i]), size).clone())
        setattr(parent, attr, QuantLinear(parts, old.bias, param.dtype))

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for benchmarking an architecture without its checkpoint."""
        for experts in self._experts():
            experts.materialize()
        gen = None
        for name, param in self.named_parameters():
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
            if name.startswith("vision.") and ("layer_norm" in name or "layernorm" in name):
                param.data.fill_(1.0 if name.endswith("weight") else 0.0)  # LayerNorms: the identity
            elif name.endswith("norm.weight"):
                param.data.fill_(
                    0.0 if self.config.gemma_norms or self.config.unit_offset_norms else 1.0
                )  # the identity
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
        self.choose_kernels()


def _shards(param_name: str) -> int:
    """The checkpoint tensors that fill a parameter: a fused one's parts (e.g. "qkv_proj" in
    "...self_attn.qkv_proj.weight"), else one."""
    return SHARDS_PER_FUSED.get(param_name.rsplit(".", 2)[-2], 1)
