"""Turning one (image, question, answer) sample into chat tokens, answer span and vision inputs.

Two encoders with one interface (``SampleEncoder``):

- ``TinySampleEncoder``: the byte-level ``TinyChatTokenizer`` and ``ImagePreprocessor`` with the recipe's vision
  geometry (tiny recipes, tests; fully offline).
- ``ProcessorSampleEncoder``: the model's own ``AutoProcessor`` (chat template, tokenizer, image-processor geometry
  and normalization), imported lazily; used by full-size recipes (``data.tokenizer: Qwen/Qwen3.6-35B-A3B``).

``num_tokens`` is cheap (text tokenization and the image size only, no pixel decode): the packing plan calls it for
every sample of every global row on every rank. ``encode`` does the full work (the one decode of the image) only for
this rank's rows and must agree with ``num_tokens`` (checked by the loader). Both may run on ``data.num_workers``
threads at once.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from nemo_ac.data.image_processing import ImagePreprocessor
from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer


@dataclass
class EncodedSample:
    """One chat document. Tokens [0, answer_start) are the prompt (with ``n`` image placeholders), the rest the
    answer with its end-of-turn token (where the loss is)."""

    input_ids: list[int]
    answer_start: int
    pixel_values: torch.Tensor  # [num_patches, C * temporal_patch * patch**2]
    grid_thw: tuple[int, int, int]


class SampleEncoder(Protocol):
    pad_id: int
    image_token_id: int

    def num_tokens(self, image: Any, question: str, answer: str) -> tuple[int, int]:
        """(total tokens, answer_start) without decoding pixels."""
        ...

    def encode(self, image: Any, question: str, answer: str) -> EncodedSample: ...


def open_image(value: Any, base_dir: Path | None = None) -> Any:
    """A PIL image from what a dataset cell holds: a PIL image, {"bytes", "path"} (datasets' Image storage) or a
    path (relative to the dataset directory). Opening is lazy: ``.size`` reads only the header."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            return Image.open(io.BytesIO(value["bytes"]))
        value = value.get("path")
    if isinstance(value, str | Path):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return Image.open(path)
    raise TypeError(f"cannot read an image from a {type(value).__name__} cell")


class TinySampleEncoder:
    """Byte-level chat tokens + Qwen-style pixels with the given vision geometry."""

    def __init__(self, images: ImagePreprocessor, tokenizer: TinyChatTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or TinyChatTokenizer()
        self.images = images
        self.pad_id = self.tokenizer.pad_id
        self.image_token_id = self.tokenizer.image_token_id
        self.vision_start_id = self.tokenizer.vision_start_id
        self.vision_end_id = self.tokenizer.vision_end_id

    def num_tokens(self, image: Any, question: str, answer: str) -> tuple[int, int]:
        prompt = len(self.tokenizer.chat_prompt(question, self.images.num_image_tokens(*image.size)))
        return prompt + len(self.tokenizer.chat_answer(answer)), prompt

    def encode(self, image: Any, question: str, answer: str) -> EncodedSample:
        pixel_values, grid = self.images(image)
        n_image = grid[0] * grid[1] * grid[2] // self.images.merge_size**2
        prompt = self.tokenizer.chat_prompt(question, n_image)
        return EncodedSample(prompt + self.tokenizer.chat_answer(answer), len(prompt), pixel_values, grid)


class ProcessorSampleEncoder:
    """The model's processor: its chat template and tokenizer for text, its image-processor settings for pixels.

    Pixels go through ``ImagePreprocessor`` configured from ``processor.image_processor`` (patch / merge / temporal
    sizes, pixel budget, mean / std), which reproduces the Qwen2-VL image processor exactly, so the token count is
    known from the image size alone. The prompt is the chat template up to the generation prompt; the answer is what
    the full conversation adds after it (for Qwen3.5 that includes the empty think block and ``<|im_end|>``).
    """

    def __init__(self, name_or_path: str, *, image_token_id: int, min_pixels: int = 0, max_pixels: int = 0) -> None:
        try:
            from transformers import AutoProcessor
        except ImportError as exc:
            raise ImportError(
                f"data.tokenizer={name_or_path!r} loads the model's processor with transformers: "
                "pip install 'nemo_ac[hf]' (or use data.tokenizer: tiny)"
            ) from exc
        self.processor = AutoProcessor.from_pretrained(name_or_path)
        self.tokenizer = self.processor.tokenizer
        ip = self.processor.image_processor
        size = dict(getattr(ip, "size", None) or {})
        self.images = ImagePreprocessor(
            patch_size=ip.patch_size,
            temporal_patch_size=ip.temporal_patch_size,
            merge_size=ip.merge_size,
            min_pixels=min_pixels or size.get("shortest_edge", 0),
            max_pixels=max_pixels or size.get("longest_edge", 0),
            mean=tuple(ip.image_mean),
            std=tuple(ip.image_std),
        )
        image_token = getattr(self.processor, "image_token", "<|image_pad|>")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id != image_token_id:
            raise ValueError(
                f"data.tokenizer={name_or_path!r}: {image_token} has id {self.image_token_id} but "
                f"model.vision.image_token_id={image_token_id}"
            )
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self._text_lock = threading.Lock()  # one tokenizer shared by data.num_workers threads

    def _texts(self, question: str, answer: str) -> tuple[list[int], list[int]]:
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        reply = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
        template = self.processor.apply_chat_template
        with self._text_lock:
            prompt = template([user], tokenize=False, add_generation_prompt=True)
            full = template([user, reply], tokenize=False)
            if not full.startswith(prompt):
                raise ValueError("the chat template's assistant turn does not extend its generation prompt")
            encode = self.tokenizer.encode
            return encode(prompt, add_special_tokens=False), encode(full[len(prompt) :], add_special_tokens=False)

    def num_tokens(self, image: Any, question: str, answer: str) -> tuple[int, int]:
        prompt, reply = self._texts(question, answer)
        n_prompt = len(prompt) - 1 + self.images.num_image_tokens(*image.size)
        return n_prompt + len(reply), n_prompt

    def encode(self, image: Any, question: str, answer: str) -> EncodedSample:
        prompt, reply = self._texts(question, answer)
        pixel_values, grid = self.images(image)
        n_image = grid[0] * grid[1] * grid[2] // self.images.merge_size**2
        at = prompt.index(self.image_token_id)
        prompt = prompt[:at] + [self.image_token_id] * n_image + prompt[at + 1 :]
        return EncodedSample(prompt + reply, len(prompt), pixel_values, grid)
