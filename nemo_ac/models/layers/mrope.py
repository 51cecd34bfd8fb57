"""Multimodal rotary embedding (M-RoPE, interleaved) of Qwen3.5 / Qwen3.6 and the positions it reads.

Every token has three positions (temporal, height, width). Text tokens carry the same value in all three, so for
text M-RoPE equals ordinary (partial) rope. Image placeholder tokens carry ``start + (t, row, col)`` of their merged
patch, and the text after an image continues at ``start + max(rows, cols)`` instead of ``start + num_image_tokens``
(transformers' ``Qwen3_5MoeModel.get_rope_index``). Of the rotary_dim/2 frequencies, the interleaved layout gives
frequency ``j`` to the height position when ``j % 3 == 1 and j < 3 * mrope_section[1]``, to the width position when
``j % 3 == 2 and j < 3 * mrope_section[2]``, and to the temporal position otherwise.

``multimodal_position_ids`` needs the whole sequence (an image shifts everything after it in its document), so it
runs before context-parallel sharding, together with the vision tower; its [3, B, S] output is then sharded along
the last dim like any per-token tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_ac.models.layers.rope import compute_inv_freq


def mrope_axis_of_frequency(num_freqs: int, mrope_section: list[int]) -> torch.Tensor:
    """[num_freqs] int64: which position (0 = t, 1 = h, 2 = w) rotates each frequency (interleaved layout)."""
    axis = torch.zeros(num_freqs, dtype=torch.int64, device="cpu")
    if mrope_section:
        if len(mrope_section) != 3:
            raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {mrope_section}")
        axis[1 : 3 * mrope_section[1] : 3] = 1
        axis[2 : 3 * mrope_section[2] : 3] = 2
    return axis


class MRotaryEmbedding(nn.Module):
    """``(cos, sin)`` [B, S, rotary_dim] from position ids [B, S] (text) or [3, B, S] (t, h, w).

    Like ``RotaryEmbedding``, ``inv_freq`` and the frequency-to-axis map are plain CPU attributes (not buffers):
    outside the state dict and immune to meta-device construction and dtype casts.
    """

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float, mrope_section: list[int]) -> None:
        super().__init__()
        self.inv_freq = compute_inv_freq(head_dim, theta, partial_rotary_factor)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.axis = mrope_axis_of_frequency(self.inv_freq.numel(), list(mrope_section))

    @torch.no_grad()
    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        inv_freq = self.inv_freq.to(device=device, non_blocking=True)
        with torch.autocast(device_type=device.type, enabled=False):
            if position_ids.dim() == 2:
                pos = position_ids.to(torch.float32).unsqueeze(-1)
            elif position_ids.dim() == 3 and position_ids.shape[0] == 3:
                # [3, B, S] -> [B, S, num_freqs]: each frequency reads the position of its axis.
                pos = position_ids.permute(1, 2, 0).to(torch.float32)[..., self.axis.to(device)]
            else:
                raise ValueError(f"position_ids must be [B, S] or [3, B, S], got {tuple(position_ids.shape)}")
            freqs = pos * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype), sin.to(dtype)


def multimodal_position_ids(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, S] M-RoPE positions from the text positions [B, S] (restarting per packed document).

    Images are matched to runs of ``image_token_id`` in row-major order, ``t * (h/m) * (w/m)`` tokens each (the
    order of ``image_grid_thw`` rows and of the vision features). An image shifts the positions of the tokens after
    it in its own document only. Raises when the placeholders do not match ``image_grid_thw``.
    """
    pos = position_ids.unsqueeze(0).repeat(3, 1, 1)
    if image_grid_thw is None or image_grid_thw.numel() == 0:
        return pos
    s = input_ids.shape[1]
    flat_image_tokens = (input_ids == image_token_id).reshape(-1).nonzero().squeeze(-1).tolist()
    docs = document_ids if document_ids is not None else torch.zeros_like(input_ids)
    index = torch.arange(s, device=input_ids.device)
    cursor = 0
    m = spatial_merge_size
    for image, (t, h, w) in enumerate(image_grid_thw.tolist()):
        lt, lh, lw = int(t), int(h) // m, int(w) // m
        n = lt * lh * lw
        run = flat_image_tokens[cursor : cursor + n]
        if len(run) != n or run[-1] - run[0] != n - 1 or run[0] // s != run[-1] // s:
            raise ValueError(
                f"image placeholders do not match image_grid_thw: image {image} (grid {(t, h, w)}, merge {m}) needs "
                f"{n} consecutive image tokens in one row"
            )
        cursor += n
        row, first = divmod(run[0], s)
        start = pos[0, row, first]
        grid = torch.stack(
            torch.meshgrid(
                torch.arange(lt, device=pos.device),
                torch.arange(lh, device=pos.device),
                torch.arange(lw, device=pos.device),
                indexing="ij",
            )
        ).reshape(3, n)
        pos[:, row, first : first + n] = start + grid
        after = (index >= first + n) & (docs[row] == docs[row, first])
        pos[:, row] += after.to(pos.dtype) * (max(lh, lw) - n)
    if cursor != len(flat_image_tokens):
        raise ValueError(f"{len(flat_image_tokens)} image tokens in input_ids but image_grid_thw accounts for {cursor}")
    return pos
