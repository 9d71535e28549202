"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style layout).

Column-parallel (output features split): q/k/v, gate/up, the embedding and LM head rows (vocab).
Row-parallel (input features split, outputs summed across ranks): o_proj and down_proj. Experts of
a mixture-of-experts MLP split like a dense MLP, each one along its own intermediate dimension, so
every rank holds a slice of every expert (ember.model.moe cuts them); the router is whole. Query
heads split evenly; KV heads split too, or, with fewer KV heads than ranks, each rank keeps the one
KV head its query heads read (replicated). Norms and everything else are whole on every rank.

Each tensor is cut as it is read, so no rank ever holds more than one whole tensor at a time (and
for safetensors not even that: only the slice is read from the file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ember.model.hf_config import ModelConfig
from ember.quant.experts import QuantizedExperts
from ember.quant.formats import QuantizedWeight

# A checkpoint tensor's slice: (dimension, start, length)
Shard = tuple[int, int, int]


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (ember.model.loader's safetensors tensors): a tensor-parallel
    rank reads only its slice of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...  # the file's name for it, e.g. safetensors' "F8_E4M3"

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def load(self) -> torch.Tensor: ...


# One tensor of a checkpoint as the loader's weight iterator yields it and the model's `load_weights`
# takes it: dense, quantized (GGUF kept quantized, a pre-quantized checkpoint's modules, stacked experts),
# or not read yet. `read_shard` reads this rank's slice of any of them.
WeightValue = torch.Tensor | QuantizedWeight | QuantizedExperts | LazyTensor


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    size: int
    head_dim: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # first KV head (of the checkpoint's) this rank holds
    intermediate_size: int  # MLP width on this rank
    vocab_size: int  # the whole vocabulary
    vocab_per_rank: int  # embedding / LM head rows per rank (the last rank's may be partly padding)
    moe_intermediate_size: int = 0  # each expert's intermediate rows on this rank (0: no experts)
    shared_expert_size: int = 0  # the shared expert's intermediate rows on this rank (0: none)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_divisible(cfg, size)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if kv_heads >= size:
            local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
        else:
            local_kv, kv_start = 1, rank // (size // kv_heads)
        return cls(
            rank=rank,
            size=size,
            head_dim=cfg.head_dim,
            num_heads=heads // size,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate_size=cfg.intermediate_size // size,
            vocab_size=cfg.vocab_size,
            vocab_per_rank=-(-cfg.vocab_size // size),
            moe_intermediate_size=cfg.moe.intermediate_size // size if cfg.moe else 0,
            shared_expert_size=cfg.moe.shared_expert_intermediate_size // size if cfg.moe else 0,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (not padding) vocabulary rows on this rank."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    def shard(self, name: str) -> Shard | None:
        """This rank's slice of the checkpoint tensor `name` (HF naming), None when it is whole."""
        if self.size == 1:
            return None
        q, kv, inter = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        if ".self_attn.q_proj." in name:
            return 0, self.rank * q, q
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return 0, self.kv_head_start * self.head_dim, kv
        if self.summed_once(name):
            return None
        if ".self_attn.o_proj." in name:
            return 1, self.rank * q, q
        if name.endswith(".self_attn.sinks"):
            return 0, self.rank * self.num_heads, self.num_heads
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return 0, self.rank * inter, inter
        if ".mlp.down_proj." in name:
            return 1, self.rank * inter, inter
        shared = self.shared_expert_size
        if ".shared_expert.gate_proj." in name or ".shared_expert.up_proj." in name:
            return 0, self.rank * shared, shared
        if ".shared_expert.down_proj." in name:
            return 1, self.rank * shared, shared
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return 0, self.vocab_start, self.vocab_rows
        return None

    @staticmethod
    def summed_once(name: str) -> bool:
        """A row-parallel layer's bias (gpt-oss's o_proj): the ranks' outputs are summed, so only rank 0
        adds it and the others hold zeros."""
        return name.endswith(".self_attn.o_proj.bias")


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """A clear error, before any process starts, for a model that cannot be split `size` ways."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if cfg.mla is not None and size > 1:
        raise ValueError(f"tensor_parallel_size {size}: multi-head latent attention (DeepSeek) runs on one rank only")
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads})")
    if (kv_heads % size) if kv_heads >= size else (size % kv_heads):
        problems.append(f"num_key_value_heads ({kv_heads}; fewer KV heads than ranks must divide the ranks)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    if cfg.moe is not None and cfg.moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size ({cfg.moe.intermediate_size})")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide this model's " + ", ".join(problems))


def read_shard(tensor: WeightValue, shard: Shard | None) -> torch.Tensor | QuantizedWeight | QuantizedExperts:
    """The slice of a checkpoint tensor this rank keeps, read into memory."""
    if shard is not None:
        tensor = tensor.narrow(*shard)
    if isinstance(tensor, (torch.Tensor, QuantizedWeight, QuantizedExperts)):
        return tensor
    return tensor.load()
