"""Gemma 3's vision side: the SigLIP tower (a ViT: patches, learned positions, pre-LN blocks of
bidirectional attention and a GELU-tanh MLP, a final LayerNorm) and the projector that turns its
patches into the language model's image tokens (average pooling to `tokens_per_image`, Gemma's
(1 + w) RMSNorm, one projection), as transformers computes them.

Images arrive preprocessed (the front end's `ember.multimodal.gemma3`: resized to `image_size`,
scaled to [-1, 1]) and all of one size, so attention is one SDPA call over the batch: no paging, no
cache. Parameters keep transformers' names under `vision_tower.` (checkpoints written by transformers 4
put them under `vision_tower.vision_model.`; ember.model.llama reads both) and `multi_modal_projector.`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.model.hf_config import VisionConfig
from ember.model.layers import GemmaRMSNorm

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        size = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(size, size) for _ in range(3))
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, size = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, size))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported ({sorted(_ACTIVATIONS)})")
        self.approximate = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class Projector(nn.Module):
    """[B, patches, vision hidden] -> [B, tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(cfg.hidden_size, text_hidden))
        self.text_hidden = text_hidden
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.side = cfg.patches_per_side
        self.kernel = cfg.patches_per_side // int(cfg.tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        b, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(b, hidden, self.side, self.side)
        pooled = (
            F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2).reshape(-1, hidden).contiguous()
        )
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).view(b, -1, self.text_hidden)


class Gemma3Vision(nn.Module):
    """Images -> the language model's image-token embeddings, one row per image token."""

    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        side = cfg.patches_per_side
        per_side = int(cfg.tokens_per_image**0.5)
        if per_side**2 != cfg.tokens_per_image or side % per_side:
            raise ValueError(
                f"mm_tokens_per_image {cfg.tokens_per_image} must be a square whose side divides the "
                f"{side} patches per side"
            )
        self.config = cfg
        self.vision_tower = VisionTransformer(cfg)
        self.multi_modal_projector = Projector(cfg, text_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, image_size, image_size] -> [B, tokens_per_image, text hidden]."""
        return self.multi_modal_projector(self.vision_tower(pixels))
