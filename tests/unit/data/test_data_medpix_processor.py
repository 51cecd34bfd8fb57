"""``ProcessorSampleEncoder`` against a locally built HF processor (a byte-level ``tokenizers`` tokenizer with a
ChatML template and transformers' Qwen2-VL image processor): no downloads, the same calls as a hub processor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("PIL", reason="needs pillow")
transformers = pytest.importorskip("transformers", reason="needs transformers")
tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers")

from nemo_ac.data.medpix_encoding import ProcessorSampleEncoder  # noqa: E402
from nemo_ac.data.medpix_sample import synthetic_medpix_records  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _processor():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=64,
        max_pixels=1024,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )

    def apply_chat_template(messages, tokenize=False, add_generation_prompt=False):
        return tok.apply_chat_template(
            messages, chat_template=CHATML, tokenize=tokenize, add_generation_prompt=add_generation_prompt
        )

    return SimpleNamespace(
        tokenizer=tok,
        image_processor=image_processor,
        image_token="<|image_pad|>",
        apply_chat_template=apply_chat_template,
    )


def test_processor_encoder_expands_placeholders_and_marks_the_reply(monkeypatch) -> None:
    processor = _processor()
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", staticmethod(lambda name: processor))
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    encoder = ProcessorSampleEncoder("local/qwen-like", image_token_id=image_id)
    record = synthetic_medpix_records(1, seed=2)[0]
    image, question, answer = record["image_id"], record["question"], record["answer"]
    sample = encoder.encode(image, question, answer)
    assert encoder.num_tokens(image, question, answer) == (len(sample.input_ids), sample.answer_start)
    n_image = sample.grid_thw[1] * sample.grid_thw[2] // 4
    assert sample.input_ids.count(image_id) == n_image == sample.pixel_values.shape[0] // 4
    ref = processor.image_processor(images=[image], return_tensors="pt")
    torch.testing.assert_close(sample.pixel_values, ref["pixel_values"], atol=1e-6, rtol=0)
    decode = processor.tokenizer.decode
    assert decode(sample.input_ids[: sample.answer_start]).endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    assert decode(sample.input_ids[sample.answer_start :]) == f"{answer}<|im_end|>\n"
    with pytest.raises(ValueError, match=r"model\.vision\.image_token_id=3"):
        ProcessorSampleEncoder("local/qwen-like", image_token_id=3)
