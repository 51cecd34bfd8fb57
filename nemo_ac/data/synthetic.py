"""A learnable synthetic sequence task for smoke training and parity runs.

A document is ``<bos> x1 .. xn <sep> f(x1 .. xn) <eos>`` with content tokens in ``[4, vocab_size)`` and
``f`` = reverse | copy | sort. The loss covers only the answer (the tokens after ``<sep>``, including ``<eos>``), which
a small model learns within a few dozen steps, so a falling loss proves the whole stack trains. Everything is drawn
from an explicit ``torch.Generator``: the same seed gives the same documents on every rank and every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ID = 0
BOS_ID = 1
SEP_ID = 2
EOS_ID = 3
FIRST_CONTENT_ID = 4

TASKS = ("reverse", "copy", "sort")


@dataclass
class Document:
    """Token ids of one document and the index of its first answer token (the token after ``<sep>``)."""

    tokens: list[int]
    answer_start: int


def make_document(content: list[int], task: str) -> Document:
    """``<bos> content <sep> f(content) <eos>``."""
    if task == "reverse":
        answer = content[::-1]
    elif task == "copy":
        answer = list(content)
    elif task == "sort":
        answer = sorted(content)
    else:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")
    return Document(tokens=[BOS_ID, *content, SEP_ID, *answer, EOS_ID], answer_start=len(content) + 2)


class SyntheticTask:
    """Samples documents with ``n`` content tokens, ``n`` uniform in [min_doc_tokens, max_doc_tokens]."""

    def __init__(self, task: str, *, vocab_size: int, min_doc_tokens: int, max_doc_tokens: int) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")
        if vocab_size <= FIRST_CONTENT_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_CONTENT_ID} (ids 0-3 are reserved), got {vocab_size}")
        if not 1 <= min_doc_tokens <= max_doc_tokens:
            raise ValueError(f"need 1 <= min_doc_tokens <= max_doc_tokens, got {min_doc_tokens}, {max_doc_tokens}")
        self.task = task
        self.vocab_size = vocab_size
        self.min_doc_tokens = min_doc_tokens
        self.max_doc_tokens = max_doc_tokens

    def sample(self, generator: torch.Generator) -> Document:
        n = int(torch.randint(self.min_doc_tokens, self.max_doc_tokens + 1, (1,), generator=generator))
        content = torch.randint(FIRST_CONTENT_ID, self.vocab_size, (n,), generator=generator).tolist()
        return make_document(content, self.task)
