"""A byte-level chat tokenizer shipped with the package, for tiny vision-language recipes and tests.

Real recipes tokenize with the model's own processor; tiny ones need something that works offline, is stable across
versions and encodes any text. Bytes do: every UTF-8 byte is one token, after six special tokens whose ids match the
``VisionConfig`` defaults (vision_start 1, vision_end 2, image placeholder 3). Vocabulary size 262, so a tiny model
needs ``model.vocab_size >= 262``.

The chat layout mirrors Qwen's ChatML: ``<|im_start|>user\\n<|vision_start|><|image_pad|>*n<|vision_end|>question
<|im_end|>\\n<|im_start|>assistant\\n`` followed by ``answer<|im_end|>``.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<|pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_start|>", "<|im_end|>")


class TinyChatTokenizer:
    """Byte-level tokenizer with ChatML special tokens. ``encode``/``decode`` round-trip any string."""

    pad_id = 0
    vision_start_id = 1
    vision_end_id = 2
    image_token_id = 3
    im_start_id = 4
    im_end_id = 5
    byte_offset = len(SPECIAL_TOKENS)
    vocab_size = byte_offset + 256

    def encode(self, text: str) -> list[int]:
        return [self.byte_offset + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            if i >= self.byte_offset:
                pending.append(i - self.byte_offset)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(SPECIAL_TOKENS[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def chat_prompt(self, question: str, num_image_tokens: int) -> list[int]:
        """User turn with one image then the question, and the assistant header (the part without loss)."""
        return [
            self.im_start_id,
            *self.encode("user\n"),
            self.vision_start_id,
            *([self.image_token_id] * num_image_tokens),
            self.vision_end_id,
            *self.encode(question),
            self.im_end_id,
            *self.encode("\n"),
            self.im_start_id,
            *self.encode("assistant\n"),
        ]

    def chat_answer(self, answer: str) -> list[int]:
        """The assistant's reply, ending with ``<|im_end|>`` so the model learns to stop (the part with loss)."""
        return [*self.encode(answer), self.im_end_id]
