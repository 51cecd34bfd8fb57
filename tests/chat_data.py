"""Real Hugging Face tokenizers with real chat templates, built offline inside the tests, and chat rows for them.

A byte-level BPE (the ``tokenizers`` library, as GPT-2 / Qwen / GLM / Nemotron tokenizers are) is trained on the
fly on the shipped chat corpus, given the special tokens of the model family's chat format, wrapped in transformers'
``PreTrainedTokenizerFast`` with that family's chat template and saved with ``save_pretrained``: what
``AutoTokenizer.from_pretrained`` loads is then a tokenizer of the same classes and code paths as the models' own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tests.launch import ROOT

TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
HF_CONFIGS = ROOT / "recipes" / "hf_configs"
CHAT = ROOT / "data" / "tiny_chat.jsonl"
VOCAB = 640  # BPE merges plus the special tokens; a tiny model's model.vocab_size


@dataclass(frozen=True)
class ChatFormat:
    template: Path
    special_tokens: tuple[str, ...]
    eos: str


FORMATS = {
    "chatml": ChatFormat(TEMPLATES / "chatml.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "chatml_generation": ChatFormat(
        TEMPLATES / "chatml_generation.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>"
    ),
    "glm4_5": ChatFormat(
        HF_CONFIGS / "zai-org" / "GLM-4.5-Air" / "chat_template.jinja",
        (
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<think>",
            "</think>",
        ),
        "<|endoftext|>",
    ),
    "nemotron": ChatFormat(
        HF_CONFIGS / "nvidia" / "NVIDIA-Nemotron-3-Super-120B-A12B-BF16" / "chat_template.jinja",
        ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        "<|im_end|>",
    ),
}


def chat_rows(count: int, *, seed: int = 0) -> list[dict]:
    """``count`` conversations of 2-4 turns (some with a system turn) from the shipped chat corpus's sentences."""
    pairs = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()]
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        messages = (
            [{"role": "system", "content": "You count things. Answer in one sentence."}] if index % 3 == 0 else []
        )
        for _ in range(1 + index % 2):
            messages += rng.choice(pairs)
        rows.append({"messages": messages})
    return rows


def write_chat_file(path: Path, count: int, *, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in chat_rows(count, seed=seed)))
    return path


def build_tokenizer(directory: Path, family: str, *, vocab: int = VOCAB) -> Path:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``family``'s special tokens and chat template, saved to
    ``directory``; ``vocab`` ids in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fmt = FORMATS[family]
    texts = [turn["content"] for row in chat_rows(400) for turn in row["messages"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(fmt.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=fmt.eos, pad_token=fmt.special_tokens[0])
    tokenizer.chat_template = fmt.template.read_text()
    tokenizer.save_pretrained(directory)
    return directory
