"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: all-MiniLM, bge, e5, bge-m3, their cross-encoder
rerankers): an embedding sum (word, learned absolute position, token type) and LayerNorm, then blocks of
bidirectional attention and a GELU MLP, each followed by its residual add and LayerNorm (post-LN).

nomic-bert (nomic-embed-text v1 / v1.5) is the same network with three changes (`EncoderConfig.nomic`):
rotary positions on the queries and keys instead of a position table, no biases in any projection, and a
SwiGLU MLP, its gate and up projections fused as `intermediate.dense` (rows [0, I) gate, [I, 2I) up).

An encoder only pools: its output is every token's final hidden state (transformers' last_hidden_state,
what sentence-transformers pools), and a classifier (`*ForSequenceClassification`, a cross-encoder) scores
the first token's. Attention sees the whole prompt, so the scheduler gives an encoder whole prompts only
(`SchedulerConfig.chunked_prefill` off) and no prefix-cache hits: a block's keys depend on later tokens.

On CUDA the step's keys and values go through the paged cache and the Triton prefill kernel with its
causal mask off (`Masking.causal`). On CPU they never touch the cache: each prompt's queries attend to its
own keys straight from the projection, prompts of one length in one SDPA call (ember.ops.attention's
`bidirectional_attention`), since gathering them back from the cache would only copy them twice.

Parameters keep transformers' BERT names (without the "bert." / "roberta." prefix) except that query, key
and value are fused into one matmul, `attention.qkv`; nomic-bert's checkpoint names map onto the same
(`_NOMIC_NAMES`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.model.hf_config import EncoderConfig, ModelConfig
from ember.model.layers import RotaryEmbedding
from ember.model.sharding import ShardLayout, WeightValue, read_shard
from ember.ops import registry
from ember.ops.attention import AttentionMetadata, AttentionShape, Masking, bidirectional_attention
from ember.quant.formats import QuantizedWeight, dequantize

_BIDIRECTIONAL = Masking(causal=False)
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
# checkpoint tensors an encoder has no use for: the masked-LM head, position ids, and BERT's pooler
# where no classifier reads it (sentence-transformers pools the last hidden state instead)
_UNUSED = ("embeddings.position_ids", "cls.", "lm_head.")
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# nomic-bert's checkpoint names (nomic-ai's, which transformers' NomicBert also saves; llama.cpp's nomic-bert
# tensors are named back to them) -> (this model's parameter, shard of a fused one or None)
_NOMIC_NAMES = {
    "emb_ln.": ("embeddings.LayerNorm.", None),
    "attn.Wqkv.": ("attention.qkv.qkv.", None),  # q, k and v already stacked
    "attn.out_proj.": ("attention.output.dense.", None),
    "norm1.": ("attention.output.LayerNorm.", None),
    "mlp.fc12.": ("intermediate.dense.", 0),  # the gate (silu)
    "mlp.fc11.": ("intermediate.dense.", 1),  # the up projection
    "mlp.fc2.": ("output.dense.", None),
    "norm2.": ("output.LayerNorm.", None),
}
_Target = tuple[str, int | None]  # a parameter, and the shard of it a tensor fills (None: all of it)


class EncoderAttention(nn.Module):
    """Fused q/k/v, then each prompt attending to itself; `rotary` (nomic-bert) rotates queries and keys."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self._target = registry.target(self.qkv.weight.device, self.qkv.weight.dtype)
        self.rotary = rotary
        self._rope = None if rotary is None else rotary.implementation(self._target, self.head_dim)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        if k_cache is not None:
            _, block_size, num_kv_heads, head_dim = k_cache.shape
            shape = AttentionShape(k_cache.dtype, self.num_heads, num_kv_heads, head_dim, block_size)
            self._attention = registry.attention_impl(self._target, shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv(x).view(-1, 3 * self.num_heads, self.head_dim)
        if self._rope is None:
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : 2 * self.num_heads]
        else:
            q, k = self._rope.rotate_qk(self.rotary, positions, qkv[:, : 2 * self.num_heads], self.num_heads)
        v = qkv[:, 2 * self.num_heads :]
        if not self._target.triton:
            return bidirectional_attention(q, k, v, meta.query_start_host, self.scale).flatten(1)
        assert self.k_cache is not None and self.v_cache is not None, "bind_cache sets the KV cache before any step"
        self._attention.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, 1.0, 1.0)
        o = self._attention(q, self.k_cache, self.v_cache, meta, self.scale, 1.0, 1.0, _BIDIRECTIONAL)
        return o.flatten(1)


class DenseNorm(nn.Module):
    """A block's output projection, then LayerNorm of it plus the block's input (transformers' BertSelfOutput
    and BertOutput)."""

    def __init__(self, size_in: int, size_out: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, size_out, bias=bias)
        self.LayerNorm = nn.LayerNorm(size_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Dense(nn.Module):
    def __init__(self, size_in: int, size_out: int, bias: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, size_out, bias=bias)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.qkv = EncoderAttention(cfg, rotary)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, enc.layer_norm_eps, cfg.attention_bias)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        bias, gated = cfg.attention_bias, enc.nomic
        self.attention = SelfAttention(cfg, enc, rotary)
        self.intermediate = Dense(cfg.hidden_size, (2 if gated else 1) * cfg.intermediate_size, bias)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, enc.layer_norm_eps, bias)
        target = registry.target(self.output.dense.weight.device, self.output.dense.weight.dtype)
        # SwiGLU over the fused gate/up projection (ember/ops/activation.py), or BERT's GELU
        self._swiglu = registry.activation_impl(target, "silu", self.intermediate.dense) if gated else None
        if not gated and cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for encoders ({sorted(_ACTIVATIONS)})")
        self._gelu = _ACTIVATIONS.get(cfg.hidden_act, "none")

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.attention.output(self.attention.qkv(h, positions, meta), h)
        if self._swiglu is not None:
            return self.output(self._swiglu(self.intermediate.dense, h), h)
        return self.output(F.gelu(self.intermediate.dense(h), approximate=self._gelu), h)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = (
            None if enc.nomic else nn.Embedding(cfg.max_position_embeddings + enc.position_offset, cfg.hidden_size)
        )
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)
        self.offset = enc.position_offset

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        h = self.word_embeddings(ids)
        if self.position_embeddings is not None:  # nomic-bert's positions are rotary, in the attention
            h = h + self.position_embeddings(positions + self.offset)
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        return self.LayerNorm(h + types)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg, enc, rotary) for _ in range(cfg.num_hidden_layers))


class Classifier(nn.Module):
    """The first token's state -> the labels' logits: BERT's pooler (dense, tanh) then `classifier`, or
    RoBERTa's `classifier.dense`, tanh, `classifier.out_proj` (one layout, two sets of names)."""

    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_rows))).float()


class EncoderModel(nn.Module):
    """An encoder and, for a cross-encoder, its classifier; one rank (tensor parallelism is refused)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        assert cfg.encoder is not None, "EncoderModel is built for encoder configs only (model_class)"
        self.config, enc = cfg, cfg.encoder
        self.layout = ShardLayout.of(cfg, 0, 1)
        self.embeddings = Embeddings(cfg, enc)
        # nomic-bert's one table of cos/sin rows for the engine's context, shared by every layer
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, None) if enc.nomic else None
        self.encoder = Encoder(cfg, enc, rotary)
        self.classifier = Classifier(cfg.hidden_size, enc.num_labels) if enc.num_labels else None
        self._names = _CheckpointNames(enc)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's last hidden state; `token_types` None: all type 0 (one text)."""
        h = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            h = layer(h, positions, meta)
        return h

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token states -> [N, num_labels] float32 logits."""
        if self.classifier is None:
            raise ValueError(f"{self.config.architecture} has no classifier (a *ForSequenceClassification model has)")
        return self.classifier(first_rows)

    def attention_layers(self) -> list[EncoderAttention]:
        return [cast(EncoderLayer, layer).attention.qkv for layer in self.encoder.layer]

    def quantize(self, kind: str) -> None:
        raise ValueError(f"quantization {kind!r}: encoder models run unquantized")

    def load_weights(self, weights: Iterable[tuple[str, WeightValue]], source: str) -> None:
        """Copy checkpoint tensors into parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for ckpt_name, value in weights:
            target = self._names.target(ckpt_name, classifier=self.classifier is not None)
            if target is None:
                continue
            name, shard = target
            parts = self._names.parts(name)
            param = params.get(name)
            if param is None:
                raise ModelLoadError(source, f"unexpected tensor {ckpt_name!r} for {self.config.architecture}")
            tensor = read_shard(value, None)
            if isinstance(tensor, QuantizedWeight):  # a GGUF file's quantized matrices, dequantized once
                tensor = dequantize(tensor, param.dtype)
            if not isinstance(tensor, torch.Tensor):
                raise ModelLoadError(source, f"unexpected stacked experts {ckpt_name!r} for an encoder")
            dest = param.data if shard is None else param.data.chunk(parts)[shard]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    source, f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + 1
        for name in params:
            if filled.get(name, 0) != self._names.parts(name):
                raise ModelLoadError(source, f"checkpoint is missing weights for {name!r}")

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for benchmarking an architecture without its checkpoint (LayerNorms the identity)."""
        gen = torch.Generator(device=self.embeddings.LayerNorm.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.data.fill_(1.0)
                module.bias.data.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(0.0, 0.02, generator=gen)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.data.zero_()


class _CheckpointNames:
    """transformers' tensor names -> (this model's parameter, shard or None); None: not used."""

    def __init__(self, enc: EncoderConfig) -> None:
        self.nomic = enc.nomic
        self.prefixes = (
            ("roberta.", "bert.") if enc.roberta else ("nomic_bert.", "bert.") if enc.nomic else ("bert.", "roberta.")
        )
        # BERT's classifier is the pooler's dense and `classifier`; RoBERTa's `classifier.dense` and `.out_proj`
        self.head = (
            {"classifier.dense.": "classifier.dense.", "classifier.out_proj.": "classifier.out_proj."}
            if enc.roberta
            else {"pooler.dense.": "classifier.dense.", "classifier.": "classifier.out_proj."}
        )

    def parts(self, name: str) -> int:
        """How many checkpoint tensors fill parameter `name`: BERT's separate q, k and v, nomic-bert's gate and
        up; one for every other (nomic-bert's q, k and v come stacked)."""
        if ".qkv." in name and not self.nomic:
            return 3
        return 2 if self.nomic and ".intermediate." in name else 1

    def target(self, name: str, classifier: bool) -> _Target | None:
        for prefix in self.prefixes:
            name = name.removeprefix(prefix)
        if name.startswith(_UNUSED):
            return None
        for ckpt, ours in self.head.items():
            if name.startswith(ckpt):
                return (ours + name[len(ckpt) :], None) if classifier else None
        if name.startswith("pooler."):  # BERT's pooler: used by a classifier only
            return None
        if self.nomic:
            name = name.replace("encoder.layers.", "encoder.layer.", 1)
            for ckpt, (ours, shard) in _NOMIC_NAMES.items():
                if f".{ckpt}" in f".{name}":
                    return name.replace(ckpt, ours, 1), shard
            return name, None
        for part, shard in _QKV.items():
            if f".{part}." in name:
                return name.replace(part, "attention.qkv.qkv"), shard
        return name, None
