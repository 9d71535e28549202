"""EAGLE-3 draft head: a one-layer model that proposes tokens for speculative decoding, read from the
checkpoint layout vLLM and SpecForge load.

Why: a draft this small proposes several tokens for about the cost of one target layer each, and the
target checks them all in one forward. EAGLE-3 conditions the draft on the target's own features:
the residual stream entering three of its layers (CausalLM.set_aux_hidden_state_layers; by default
layers 2, L // 2 and L - 3, as vLLM), concatenated and projected by `fc` to the draft's width. Later
draft steps feed back the draft's own pre-norm output instead.

The layer attends over [input_layernorm(token embedding), hidden_norm(hidden)] side by side (so its
qkv_proj reads twice the hidden size), through Ember's paged KV cache like the target's layers; the
rest is a Llama layer and final norm. The LM head covers a smaller draft vocabulary; `d2t` maps it
back (target id = draft id + d2t[draft id]). Checkpoints usually leave the token embedding out: the
target's is shared (`share_embedding`).

Checkpoint names: `fc.weight`, `midlayer.*` (SpecForge) or `layers.0.*` / `model.layers.0.*` (vLLM's),
`norm.weight`, `lm_head.weight`, `d2t`, optionally `embed_tokens.weight` and `t2d` (the inverse mask,
not needed here). q/k/v and gate/up are fused into one matmul each, as in ember.model.llama.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.distributed import tp_size
from ember.errors import ModelLoadError
from ember.model.files import read_config
from ember.model.hf_config import ModelConfig
from ember.model.layers import Embedding, GatedMLP, RMSNorm, RotaryEmbedding
from ember.model.llama import FUSED, SHARDS_PER_FUSED, Attention
from ember.model.loader import safetensors_weights
from ember.model.sharding import ShardLayout, WeightValue, read_shard
from ember.ops.attention import AttentionMetadata

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's (and SpecForge's training) choice: an early, a middle and a late layer of the target."""
    return 2, num_target_layers // 2, num_target_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    """A draft's config.json: its layer's shapes as a ModelConfig, and what ties it to its target."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target layers whose inputs `fc` reads, in layer order
    norm_before_residual: bool  # the residual stream starts from hidden_norm(hidden), not hidden

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], target: ModelConfig) -> Eagle3Config:
        """A ValueError (or KeyError) for a config that is not an EAGLE-3 draft of `target`."""
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not an EAGLE-3 draft (expected one of {ARCHITECTURES})")
        model = ModelConfig.from_hf_config({"num_hidden_layers": 1, **cfg})
        if model.vocab_size != target.vocab_size:
            raise ValueError(f"vocab_size {model.vocab_size} differs from the target's {target.vocab_size}")
        target_hidden = int(cfg.get("target_hidden_size") or model.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"target_hidden_size {target_hidden} differs from the target's {target.hidden_size}")
        draft_vocab = int(cfg.get("draft_vocab_size") or model.vocab_size)
        if not 0 < draft_vocab <= model.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab} must be in [1, vocab_size {model.vocab_size}]")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(ids) if ids else default_aux_layers(target.num_hidden_layers)
        if len(set(layers)) != 3 or not all(0 <= i < target.num_hidden_layers for i in layers):
            raise ValueError(
                f"aux hidden state layers {layers}: fc reads three distinct layers of the target's "
                f"{target.num_hidden_layers}"
            )
        return cls(
            model=dataclasses.replace(model, num_hidden_layers=1),
            draft_vocab_size=draft_vocab,
            target_hidden_size=target_hidden,
            aux_layers=tuple(sorted(layers)),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        )


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer ("midlayer"): a Llama layer whose attention reads the normed token
    embedding and the normed hidden state side by side."""

    def __init__(self, cfg: Eagle3Config, layout: ShardLayout, rotary: RotaryEmbedding) -> None:
        super().__init__()
        m = cfg.model
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.self_attn = Attention(m, layout, rotary, 0, input_size=2 * m.hidden_size)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.mlp = GatedMLP(m.hidden_size, m.intermediate_size, m.hidden_act)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP output and the residual stream; the model's final norm adds them (fused)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), normed], dim=-1), meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _param_name(name: str) -> str:
    """The draft's name for a checkpoint tensor: SpecForge's `midlayer.` and vLLM's `layers.0.` name the
    one layer; a `model.` prefix is dropped."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


class Eagle3Draft(nn.Module):
    """forward -> (h_normed, h_prenorm): h_normed gives the draft's logits (`compute_logits`,
    `draft_tokens`), h_prenorm is the next draft step's `hidden_states`."""

    d2t: torch.Tensor  # a buffer (register_buffer): draft id -> target id minus draft id

    def __init__(self, cfg: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        if tp_size() != 1:
            raise ValueError("EAGLE-3 drafts run on one rank; tensor-parallel drafting is not supported")
        m = cfg.model
        self.config = cfg
        self.layout = ShardLayout.of(m, 0, 1)
        rotary = RotaryEmbedding(m.head_dim, max_positions, m.rope_theta, m.rope_scaling, m.rotary_dim)
        # the checkpoint's own (made by load_weights), or the target's (share_embedding)
        self.embed_tokens: nn.Module | None = None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, m.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg, self.layout, rotary)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = nn.Linear(m.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def share_embedding(self, embedding: nn.Module) -> None:
        """Embed tokens with the target's embedding (a module mapping ids to [T, hidden]) where the
        checkpoint brought none of its own, the usual EAGLE-3 layout; a draft with its own keeps it."""
        if self.embed_tokens is None:
            self.embed_tokens = embedding

    def attention_layers(self) -> list[Attention]:
        """The layers that need KV cache (ember.runner.kv_cache.KVCache): the one."""
        return [self.midlayer.self_attn]

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """What to pass to the target's CausalLM.set_aux_hidden_state_layers."""
        return self.config.aux_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states`: the target's aux hidden states [T, 3 * target_hidden] (first draft step, put
        through `fc`) or the draft's own h_prenorm [T, hidden] (later steps)."""
        assert self.embed_tokens is not None, "the checkpoint has no embedding: share_embedding(target's) first"
        if hidden_states.shape[-1] != self.config.model.hidden_size:
            hidden_states = self.fc(hidden_states)
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden_states, meta)
        return self.norm(x, residual)

    def compute_logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        """[N, vocab_size] float32 over the target's vocabulary: -inf for tokens the draft cannot propose."""
        logits = self.lm_head(h_normed).float()
        out = logits.new_full((logits.shape[0], self.config.model.vocab_size), float("-inf"))
        return out.index_copy_(1, self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device), logits)

    def draft_tokens(self, h_normed: torch.Tensor) -> torch.Tensor:
        """[N] int64: the target ids of the draft's greedy tokens."""
        ids = self.lm_head(h_normed).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, WeightValue]], source: str) -> None:
        """Copy checkpoint tensors into parameters; every one must be filled exactly once, but for the
        embedding (the target's may be shared) and d2t where the draft vocabulary is the target's."""
        params: dict[str, torch.Tensor] = {
            name: p for name, p in self.named_parameters() if not name.startswith("embed_tokens.")
        }
        filled: dict[str, int] = {}
        for ckpt_name, value in weights:
            name = _param_name(ckpt_name)
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            tensor = read_shard(value, None)
            if not isinstance(tensor, torch.Tensor):
                raise ModelLoadError(source, f"tensor {ckpt_name!r} is quantized; EAGLE-3 drafts load dense weights")
            if name == "d2t":
                self._load_d2t(tensor, source)
                filled[name] = filled.get(name, 0) + 1
                continue
            if name == "embed_tokens.weight":
                w = self.fc.weight
                own = Embedding(
                    self.config.model.vocab_size, self.config.model.hidden_size, device=w.device, dtype=w.dtype
                )
                self.embed_tokens, params[name] = own, own.weight
            target, offset, size = name, 0, None
            for part, (fused, index) in FUSED.items():
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    sizes = self._fused_sizes(fused)
                    offset, size = sum(sizes[:index]), sizes[index]
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(source, f"unexpected tensor {ckpt_name!r} for an EAGLE-3 draft")
            dest = param.data if size is None else param.data.narrow(0, offset, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    source, f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + 1
        wrong = [n for n in params if filled.get(n, 0) != SHARDS_PER_FUSED.get(n.rsplit(".", 2)[-2], 1)]
        if filled.get("d2t", 0) != 1 and self.config.draft_vocab_size != self.config.model.vocab_size:
            wrong.append("d2t")
        if wrong:
            raise ModelLoadError(
                source, f"checkpoint is missing (or repeats) weights for {', '.join(map(repr, wrong))}"
            )
        self.midlayer.mlp.choose_kernels()

    def init_dummy_weights(self, std: float = 0.02) -> None:
        """Random weights (norms at one, the identity vocabulary map), with the target's embedding."""
        for name, p in self.named_parameters():
            if name.startswith("embed_tokens."):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        self.d2t.zero_()
        self.midlayer.mlp.choose_kernels()

    def _fused_sizes(self, fused: str) -> list[int]:
        if fused.endswith("qkv_proj"):
            attn = self.midlayer.self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.model.intermediate_size] * 2

    def _load_d2t(self, d2t: torch.Tensor, source: str) -> None:
        n, vocab = self.config.draft_vocab_size, self.config.model.vocab_size
        if tuple(d2t.shape) != (n,):
            raise ModelLoadError(source, f"tensor 'd2t' has shape {tuple(d2t.shape)}, expected ({n},)")
        target_ids = d2t.long() + torch.arange(n, device=d2t.device)
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise ModelLoadError(source, f"d2t maps draft ids outside the target's vocabulary of {vocab}")
        self.d2t.copy_(d2t)


def load_eagle3(
    path: str,
    target_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int | None = None,
    random_weights: bool = False,
) -> Eagle3Draft:
    """The draft in directory `path` (config.json + *.safetensors) for a target of `target_config`, its
    weights in `dtype` on `device`. `max_positions` sizes the rotary tables (default: the larger of the
    two configs' max_position_embeddings; pass the engine's max_model_len where it is larger).
    Without an embedding in the checkpoint, call `share_embedding` before the first forward."""
    config_file = os.path.join(path, "config.json")
    try:
        cfg = Eagle3Config.from_hf_config(read_config(path), target_config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(config_file, f"not an EAGLE-3 draft of this model ({e})") from e
    positions = max_positions or max(cfg.model.max_position_embeddings, target_config.max_position_embeddings)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = Eagle3Draft(cfg, positions)
    finally:
        torch.set_default_dtype(saved)
    with torch.no_grad():
        if random_weights:  # --load-format dummy: config.json alone, for benchmarks of a head's shape
            draft.init_dummy_weights()
        else:
            draft.load_weights(safetensors_weights(path)(), path)
    return draft.eval()
