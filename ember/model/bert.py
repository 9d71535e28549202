"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: all-MiniLM, bge, e5, bge-m3, their cross-encoder
rerankers): an embedding sum (word, learned absolute position, token type) and LayerNorm, then blocks of
bidirectional attention and a GELU MLP, each followed by its residual add and LayerNorm (post-LN).

An encoder only pools: its output is every token's final hidden state (transformers' last_hidden_state,
what sentence-transformers pools), and a classifier (`*ForSequenceClassification`, a cross-encoder) scores
the first token's. Attention sees the whole prompt, so the scheduler gives an encoder whole prompts only
(`SchedulerConfig.chunked_prefill` off) and no prefix-cache hits: a block's keys depend on later tokens.

On CUDA the step's keys and values go through the paged cache and the Triton prefill kernel with its
causal mask off (`Masking.causal`). On CPU they never touch the cache: each prompt's queries attend to its
own keys straight from the projection, prompts of one length in one SDPA call (ember.ops.attention's
`bidirectional_attention`), since gathering them back from the cache would only copy them twice.

Parameters keep transformers' names (without the "bert." / "roberta." prefix) except that query, key
and value are fused into one matmul, `attention.qkv`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.model.hf_config import EncoderConfig, ModelConfig
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


class EncoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self._target = registry.target(self.qkv.weight.device, self.qkv.weight.dtype)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        if k_cache is not None:
            _, block_size, num_kv_heads, head_dim = k_cache.shape
            shape = AttentionShape(k_cache.dtype, self.num_heads, num_kv_heads, head_dim, block_size)
            self._attention = registry.attention_impl(self._target, shape)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        if not self._target.triton:
            return bidirectional_attention(q, k, v, meta.query_start_host, self.scale).flatten(1)
        assert self.k_cache is not None and self.v_cache is not None, "bind_cache sets the KV cache before any step"
        self._attention.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, 1.0, 1.0)
        o = self._attention(q, self.k_cache, self.v_cache, meta, self.scale, 1.0, 1.0, _BIDIRECTIONAL)
        return o.flatten(1)


class DenseNorm(nn.Module):
    """A block's output projection, then LayerNorm of it plus the block's input (transformers' BertSelfOutput
    and BertOutput)."""

    def __init__(self, size_in: int, size_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, size_out)
        self.LayerNorm = nn.LayerNorm(size_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Dense(nn.Module):
    def __init__(self, size_in: int, size_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, size_out)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.qkv = EncoderAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, enc.layer_norm_eps)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg, enc)
        self.intermediate = Dense(cfg.hidden_size, cfg.intermediate_size)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, enc.layer_norm_eps)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for encoders ({sorted(_ACTIVATIONS)})")
        self._gelu = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.attention.output(self.attention.qkv(h, meta), h)
        return self.output(F.gelu(self.intermediate.dense(h), approximate=self._gelu), h)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + enc.position_offset, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)
        self.offset = enc.position_offset

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        h = self.word_embeddings(ids) + self.position_embeddings(positions + self.offset)
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        return self.LayerNorm(h + types)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg, enc) for _ in range(cfg.num_hidden_layers))


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
        self.encoder = Encoder(cfg, enc)
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
            h = layer(h, meta)
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
            param = params.get(name)
            if param is None:
                raise ModelLoadError(source, f"unexpected tensor {ckpt_name!r} for {self.config.architecture}")
            tensor = read_shard(value, None)
            if isinstance(tensor, QuantizedWeight):  # a GGUF file's quantized matrices, dequantized once
                tensor = dequantize(tensor, param.dtype)
            if not isinstance(tensor, torch.Tensor):
                raise ModelLoadError(source, f"unexpected stacked experts {ckpt_name!r} for an encoder")
            dest = param.data if shard is None else param.data.chunk(3)[shard]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    source, f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + 1
        for name in params:
            if filled.get(name, 0) != (3 if ".qkv." in name else 1):
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
    """transformers' tensor names -> (this model's parameter, q/k/v shard or None); None: not used."""

    def __init__(self, enc: EncoderConfig) -> None:
        self.prefixes = ("roberta.", "bert.") if enc.roberta else ("bert.", "roberta.")
        # BERT's classifier is the pooler's dense and `classifier`; RoBERTa's `classifier.dense` and `.out_proj`
        self.head = (
            {"classifier.dense.": "classifier.dense.", "classifier.out_proj.": "classifier.out_proj."}
            if enc.roberta
            else {"pooler.dense.": "classifier.dense.", "classifier.": "classifier.out_proj."}
        )

    def target(self, name: str, classifier: bool) -> tuple[str, int | None] | None:
        for prefix in self.prefixes:
            name = name.removeprefix(prefix)
        if name.startswith(_UNUSED):
            return None
        for ckpt, ours in self.head.items():
            if name.startswith(ckpt):
                return (ours + name[len(ckpt) :], None) if classifier else None
        if name.startswith("pooler."):  # BERT's pooler: used by a classifier only
            return None
        for part, shard in _QKV.items():
            if f".{part}." in name:
                return name.replace(part, "attention.qkv.qkv"), shard
        return name, None
