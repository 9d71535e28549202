"""Qwen2.5-VL's vision tower, as transformers' `Qwen2_5_VisionTransformerPretrainedModel` computes it.

An image arrives as the front end cut it (ember/multimodal/qwen2_vl.py): [grid_t * grid_h * grid_w,
3 * temporal_patch_size * patch_size^2] flattened patches, each `spatial_merge_size`^2 patches that merge
into one language-model token adjacent. The patch embedding is a Conv3d whose kernel is its input, so
a matmul; the blocks are pre-RMSNorm ViT blocks with a SwiGLU MLP (biased) and 2D rotary (a patch's
row and column rotate half the channels each). Every block but `fullatt_block_indexes` attends within
windows of `window_size` pixels a side: the patches are put in window order first (a window's merge
groups in a row) so that each window is one contiguous run, and the merger's output is put back in
image order at the end. Attention is one SDPA call per run length, the runs of equal length side by
side (an image's whole windows are one batch), each run's keys its own.

Parameters keep transformers' names under `visual.` (read as `vision.`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.model.hf_config import QwenVisionConfig

Grid = tuple[int, int, int]  # an image's patches: (frames / temporal_patch_size, rows, columns)


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2RMSNorm (eps 1e-6 in the tower): the weight times x normalized in float32."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(3, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], runs: list[int]) -> torch.Tensor:
        n, size = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [N, heads, head_dim] each
        cos, sin = rope
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        if len(set(runs)) == 1:  # runs of one length back to back (same-size images, whole windows): no gather
            qb, kb, vb = (t.view(len(runs), runs[0], self.heads, -1).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb)
            return self.proj(o.transpose(1, 2).reshape(n, size))
        out = torch.empty_like(q)
        for length, starts in _runs_by_length(runs).items():
            idx = (torch.tensor(starts, device=x.device)[:, None] + torch.arange(length, device=x.device)).flatten()
            qb, kb, vb = (t[idx].view(len(starts), length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb)  # [runs, heads, length, head_dim]
            out[idx] = o.transpose(1, 2).reshape(-1, self.heads, o.shape[-1])
        return self.proj(out.reshape(n, size))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision: in float32, rotate-half, back to x's dtype."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


def _runs_by_length(runs: list[int]) -> dict[int, list[int]]:
    """Run lengths -> the first rows of the runs of that length."""
    out: dict[int, list[int]] = {}
    start = 0
    for length in runs:
        if length:
            out.setdefault(length, []).append(start)
        start += length
    return out


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], runs: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge group's patches (adjacent rows) side by side, through RMSNorm (ln_q) first and a GELU MLP."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.group = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(cfg.hidden_size)
        out = cfg.out_hidden_size
        self.mlp = nn.Sequential(nn.Linear(self.group, self.group), nn.GELU(), nn.Linear(self.group, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group))


class Qwen25VisionTower(nn.Module):
    """Images' patches -> the language model's image-token embeddings, one row per image token, in image
    order then each image's row-major merged grid."""

    inv_freq: torch.Tensor  # a buffer (register_buffer): the rotary frequencies of one axis

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        quarter = head_dim // 2  # transformers' spatial_dim: each axis rotates half of the head's pairs
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """patches [sum t*h*w, 3 * temporal_patch_size * patch_size^2] -> [sum t*h*w / merge^2, out_hidden]."""
        order, windows = self._window_order(grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        unit = self.config.spatial_merge_size**2
        x = _permute(self.patch_embed(patches), order, unit)
        rope = tuple(_permute(r, order, unit) for r in self._rope(grids))
        cos, sin = rope[0], rope[1]
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), frames if i in self.config.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(order)]

    def _rope(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's cos and sin [N, head_dim]: its row's angles, then its column's, twice (rotate-half)."""
        m = self.config.spatial_merge_size
        rows = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            blocks = (h // m, m, w // m, m)  # merge groups' patches adjacent, as the front end lays them out
            hw = torch.stack([p.reshape(blocks).transpose(1, 2).flatten() for p in (hh, ww)], dim=-1)
            rows.append(hw.repeat(t, 1))
        pos = torch.cat(rows).to(self.inv_freq.device)
        freqs = pos[..., None].float() * self.inv_freq  # [N, 2, quarter / 2]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _window_order(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """The merge groups in window order (transformers' window_index) and each window's patch count."""
        m = self.config.spatial_merge_size
        side = self.config.window_size // m // self.config.patch_size  # a window's side in merge groups
        order, windows, first = [], [], 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            ph, pw = -gh % side, -gw % side
            padded = F.pad(index, (0, pw, 0, ph), value=-1)
            nh, nw = (gh + ph) // side, (gw + pw) // side
            padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
            windows += ((padded >= 0).sum(-1).flatten() * m * m).tolist()
            order.append(padded[padded >= 0] + first)
            first += t * gh * gw
        return torch.cat(order).to(self.inv_freq.device), windows


def _permute(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows in groups of `unit` (a merge group's patches), the groups taken in `order`."""
    return x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
