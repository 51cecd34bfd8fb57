"""Qwen3.5 / Qwen3.6 vision tower: patch embedding, ViT blocks with 2D rotary embedding, patch merger.

Parameter names equal transformers' ``Qwen3_5MoeVisionModel`` (patch_embed.proj, pos_embed, blocks.N.{norm1, norm2,
attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2}, merger.{norm, linear_fc1, linear_fc2}).

Input layout (what the Qwen2-VL image processor and ``nemo_ac.data.medpix`` produce): ``pixel_values`` is
[num_patches, C * temporal_patch_size * patch_size**2] with every image's patches in spatial-merge-block order
(row of merge blocks, column of merge blocks, then the merge_size x merge_size patches inside a block), and
``grid_thw`` [num_images, 3] holds each image's (t, h, w) patch grid. The merger concatenates each block's
merge_size**2 consecutive patches, so the output has ``t * h * w / merge_size**2`` rows per image -- one per image
placeholder token -- projected to the text hidden size.

Attention is bidirectional within one frame of one image and never across images. Grid bookkeeping (positions,
segment lengths) uses Python ints from ``grid_thw``: the tower runs once per micro batch on the full sequence,
before context-parallel sharding and outside the compiled decoder blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nemo_ac.config.schema import VisionConfig
from nemo_ac.models.layers.rope import rotate_half

VisionAttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention inside each segment. q/k/v: [N, heads, hd]; lengths sum to N. Returns [N, heads, hd].

    One SDPA call per segment keeps memory linear in the number of images (a block-diagonal mask would be N x N).
    """
    outs = [
        F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)).transpose(0, 1)
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat(outs, dim=0)


def patch_positions(grid_thw: list[list[int]], merge: int, device: torch.device) -> torch.Tensor:
    """(row, col) patch coordinates [N, 2] in spatial-merge-block order, repeated for every frame."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
        rows, cols = (x.permute(0, 2, 1, 3).reshape(-1) for x in (rows, cols))
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (eps 1e-6) whose init hook gives ones / zeros (the default rule would draw the scale)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, eps=1e-6)

    def initial_parameter(self, name: str, generator: torch.Generator) -> torch.Tensor | None:
        return torch.ones(self.normalized_shape) if name == "weight" else torch.zeros(self.normalized_shape)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2D rope: head_dim/4 frequencies for the row and as many for the column, each half rotated together.

    ``inv_freq`` is a plain CPU attribute (not a buffer) for the same reasons as ``RotaryEmbedding``.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] -> (cos, sin) [N, head_dim] in fp32."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)  # [N, 2, hd/4]
        freqs = freqs.flatten(1)  # [row freqs | col freqs]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == (temporal_patch, patch, patch): a linear map of each flattened patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        # Same math as the conv (kernel covers the whole patch), without a 5D reshape round trip.
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.attn_op: VisionAttentionOp = segment_attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = (t.unsqueeze(1) for t in rope)
        # Rotation in fp32 (as transformers does), back to the activation dtype for attention.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = self.attn_op(q, k, v, lengths)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size)
        self.norm2 = LayerNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, concatenate each merge block's patches, two-layer GELU MLP into ``out_size``."""

    def __init__(self, cfg: VisionConfig, out_size: int) -> None:
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = LayerNorm(cfg.hidden_size)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """``forward(pixel_values, grid_thw) -> [sum_i t_i*h_i*w_i / merge**2, out_size]`` image-token features."""

    def __init__(self, cfg: VisionConfig, out_size: int) -> None:
        super().__init__()
        side = round(cfg.num_position_embeddings**0.5)
        if side * side != cfg.num_position_embeddings:
            raise ValueError(f"vision.num_position_embeddings={cfg.num_position_embeddings} must be a perfect square")
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4:
            raise ValueError(
                f"vision.hidden_size={cfg.hidden_size} / num_heads={cfg.num_heads} must be a multiple of 4 "
                "(2D rotary embedding)"
            )
        self.spatial_merge_size = cfg.spatial_merge_size
        self.num_grid_per_side = side
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary_pos_emb = VisionRotaryEmbedding(cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, out_size)

    def position_embeddings(self, grid: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        """The learned square table bilinearly resampled (align_corners) to each image's grid: [N, hidden]."""
        side = self.num_grid_per_side
        sizes = torch.tensor([[h, w] for t, h, w in grid for _ in range(t * h * w)], device=positions.device)
        src_rows = positions[:, 0].to(torch.float32) * (side - 1) / (sizes[:, 0] - 1).clamp(min=1)
        src_cols = positions[:, 1].to(torch.float32) * (side - 1) / (sizes[:, 1] - 1).clamp(min=1)
        row_taps, row_w = _taps(src_rows, side)
        col_taps, col_w = _taps(src_cols, side)
        index = (row_taps.unsqueeze(-1) * side + col_taps.unsqueeze(-2)).flatten(1)  # [N, 4]
        weight = (row_w.unsqueeze(-1) * col_w.unsqueeze(-2)).flatten(1)
        table = self.pos_embed.weight
        return (table[index] * weight.unsqueeze(-1).to(table.dtype)).sum(dim=1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [[int(x) for x in row] for row in grid_thw.tolist()]
        x = self.patch_embed(pixel_values)
        positions = patch_positions(grid, self.spatial_merge_size, x.device)
        if positions.shape[0] != x.shape[0]:
            raise ValueError(f"image_grid_thw describes {positions.shape[0]} patches, pixel_values has {x.shape[0]}")
        x = x + self.position_embeddings(grid, positions).to(x.dtype)
        rope = self.rotary_pos_emb(positions)
        lengths = [h * w for t, h, w in grid for _ in range(t)]  # one attention segment per frame
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)


def _taps(src: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Floor / floor+1 indices (clamped to the table) and linear weights for fractional source coordinates."""
    floor = src.floor()
    taps = torch.stack((floor, floor + 1), dim=-1).long().clamp(0, side - 1)
    frac = (src - floor).unsqueeze(-1)
    return taps, torch.cat((1 - frac, frac), dim=-1)
