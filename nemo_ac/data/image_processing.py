"""Qwen2-VL / Qwen3-VL style image preprocessing without transformers: resize, normalize, patchify.

Produces exactly the layout the vision tower reads (``nemo_ac.models.layers.vision``): a [num_patches,
C * temporal_patch_size * patch_size**2] float32 matrix with patches in spatial-merge-block order, and the (t, h, w)
patch grid. A still image fills all ``temporal_patch_size`` frames of its one temporal patch. Matches transformers'
``Qwen2VLImageProcessorPil`` (tested), so tiny recipes and the model's own processor feed the tower the same way.
Pillow is imported lazily (the ``hf`` extra).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Qwen3-VL / Qwen3.5 processors normalize with mean = std = 0.5 per channel.
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides rounded to multiples of ``factor`` with the area in [min_pixels, max_pixels], aspect ratio ~kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be below 200, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(
    pixels: torch.Tensor, *, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[C, H, W] (H, W multiples of patch_size * merge_size) -> ([gh * gw, C * tp * p * p], (1, gh, gw))."""
    c, height, width = pixels.shape
    gh, gw = height // patch_size, width // patch_size
    m, p = merge_size, patch_size
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (block_row, block_col, in_row, in_col, C, py, px)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)
    return x.reshape(gh * gw, c * temporal_patch_size * p * p).contiguous(), (1, gh, gw)


class ImagePreprocessor:
    """PIL image -> (pixel_values, grid_thw); ``grid`` gives the grid from the size alone (no decode)."""

    def __init__(
        self,
        *,
        patch_size: int,
        temporal_patch_size: int,
        merge_size: int,
        min_pixels: int,
        max_pixels: int,
        mean: tuple[float, ...] = DEFAULT_MEAN,
        std: tuple[float, ...] = DEFAULT_STD,
    ) -> None:
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.factor = patch_size * merge_size
        self.min_pixels = max(min_pixels, self.factor**2)
        self.max_pixels = max_pixels
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"image max_pixels={max_pixels} is below min_pixels={self.min_pixels}")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after smart_resize."""
        return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the image becomes: (h / patch) * (w / patch) / merge**2."""
        h, w = self.resized_size(width, height)
        return (h // self.factor) * (w // self.factor)

    def __call__(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        from PIL import Image

        image = image.convert("RGB")
        h, w = self.resized_size(*image.size)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
        pixels = (pixels.to(torch.float32) / 255.0 - self.mean) / self.std
        return patchify(
            pixels, patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size
        )
