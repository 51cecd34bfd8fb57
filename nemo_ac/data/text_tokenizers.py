"""``data.kind: text`` tokenizers: a batch of rows in, per row one document (token ids and loss-target flags) or
the reason it cannot be one.

A chat is rendered by the model's own chat template once and encoded once (O(turns), whatever its length): the
tokens are those ``tokenizer.apply_chat_template(messages, tokenize=True)`` gives, which renders the same text and
encodes it with ``add_special_tokens=False``. The loss targets come from

- the template's ``{% generation %}`` markers where it has them: transformers' own
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``, one call per batch of conversations;
- otherwise the rendered text itself: every turn's content is found in order (as written, or stripped, as the GLM
  and Nemotron templates write it), and a token is a target when it starts inside an assistant turn's content, or
  is the special token that closes that turn right after it (``<|im_end|>`` in ChatML and Nemotron, ``<|user|>`` in
  GLM-4.5, whose generation stops there), through the fast tokenizer's offset mapping. A template that rewrites a
  turn so that its content cannot be found (Qwen3's drops earlier turns' reasoning) makes that row a counted skip
  ("the chat template rewrites a turn"); a template with ``{% generation %}`` markers (``data.chat_template``)
  marks those rows too.

The path this replaces rendered and encoded the prefix of the conversation twice per assistant turn (O(turns^2)
tokenizer calls) and read ``apply_chat_template``'s result as a list, while transformers 5 returns a
``BatchEncoding``: every conversation became the two "tokens" ``['input_ids', 'attention_mask']`` and step 1 failed
with ``ValueError: too many dimensions 'str'``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_REWRITES = "the chat template rewrites a turn"
TEMPLATE_REFUSES = "the chat template refuses the conversation"
NOTHING_MARKED = "no assistant token marked"


@dataclass
class TokenizedDocument:
    tokens: list[int]
    targets: bytearray  # 1 where token t is a loss target (predicted from t - 1), else 0


Encoded = TokenizedDocument | tuple[str, str]  # a document, or (skip reason, detail)


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, values: Sequence[Any], *, chat: bool) -> list[Encoded]: ...


def _all(flag: int, count: int) -> bytearray:
    return bytearray([flag]) * count


class TinyTextTokenizer:
    """The shipped byte-level tokenizer: plain text ends with ``<|im_end|>``; chat turns in its ChatML layout, the
    assistant's content and its ``<|im_end|>`` the targets."""

    # A change to the layout below changes the tokens: bump config.corpus_key.TINY_TOKENIZER_VERSION with it.

    def __init__(self) -> None:
        self.tok = TinyChatTokenizer()
        self.vocab_size = self.tok.vocab_size

    def _plain(self, text: str) -> TokenizedDocument:
        tokens = [*self.tok.encode(text), self.tok.im_end_id]
        return TokenizedDocument(tokens, _all(1, len(tokens)))

    def _chat(self, messages: Sequence[Mapping[str, str]]) -> TokenizedDocument:
        tokens: list[int] = []
        targets = bytearray()
        for message in messages:
            head = [self.tok.im_start_id, *self.tok.encode(f"{message['role']}\n")]
            body = [*self.tok.encode(message["content"]), self.tok.im_end_id]
            tokens += head + body + self.tok.encode("\n")
            targets += _all(0, len(head)) + _all(int(message["role"] == "assistant"), len(body)) + b"\x00"
        return TokenizedDocument(tokens, targets)

    def encode(self, values: Sequence[Any], *, chat: bool) -> list[Encoded]:
        return [self._chat(v) if chat else self._plain(v) for v in values]


def _field(out: Any, name: str) -> Any:
    """``out[name]`` for a dict or a ``BatchEncoding`` (a ``UserDict``, no ``dict``), or the attribute."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        return out[name]
    return getattr(out, name)


def _find(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Where ``content`` is rendered in ``text`` at or after ``cursor``: as written, else stripped."""
    stripped = content.strip()
    if not stripped:
        return cursor, cursor
    for candidate in (content, stripped):
        at = text.find(candidate, cursor)
        if at >= 0:
            return at, at + len(candidate)
    return None


def assistant_spans(text: str, messages: Sequence[Mapping[str, str]]) -> list[tuple[int, int]] | tuple[str, str]:
    """Character spans of the assistant turns' contents in ``text`` (the rendered conversation), found turn by
    turn in order so that an answer repeating the question is found in the answer; (reason, detail) when a turn's
    content is not in the text."""
    cursor, spans = 0, []
    for index, message in enumerate(messages):
        found = _find(text, message["content"], cursor)
        if found is None:
            return TEMPLATE_REWRITES, f"turn {index} ({message['role']}) is not in the rendered text as written"
        cursor = found[1]
        if message["role"] == "assistant":
            spans.append(found)
    return spans


def targets_from_offsets(
    ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], closing: set[int]
) -> bytearray:
    """Target flags: tokens starting inside a span, and a ``closing`` special token starting right at its end."""
    starts = [start for start, _ in offsets]
    targets = bytearray(len(ids))
    for begin, end in spans:
        first, stop = bisect.bisect_left(starts, begin), bisect.bisect_left(starts, end)
        targets[first:stop] = _all(1, stop - first)
        if stop < len(ids) and starts[stop] == end and ids[stop] in closing:
            targets[stop] = 1
    return targets


class HFTextTokenizer:
    """A Hugging Face tokenizer (``data.tokenizer``: a Hub id or a directory) and its chat template, or the one in
    ``data.chat_template``."""

    def __init__(self, name: str, *, chat: bool, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.name = name
        self.tok = AutoTokenizer.from_pretrained(name)
        self.vocab_size = len(self.tok)
        self.template = Path(chat_template).read_text() if chat_template else _own_template(self.tok)
        self.markers = bool(self.template and GENERATION_MARKER.search(self.template))
        if chat:
            self._check_chat(chat_template)
        # Special tokens that may close an assistant turn (the offsets path); never ordinary text.
        self.closing = {i for i, added in self.tok.added_tokens_decoder.items() if getattr(added, "special", False)}

    def _check_chat(self, chat_template: str | None) -> None:
        if not self.template:
            raise ConfigError(
                ConfigIssue(
                    "data.tokenizer",
                    f"{self.name!r} has no chat template, which data.messages_column needs to render the chats: set "
                    "data.chat_template to a Jinja file with the model's chat format, or use the model's own tokenizer",
                )
            )
        if not self.markers and not self.tok.is_fast:
            raise ConfigError(
                ConfigIssue(
                    "data.tokenizer",
                    f"{self.name!r} is a slow (Python) tokenizer and its chat template has no {{% generation %}} "
                    "markers: the assistant turns are found through a fast tokenizer's offsets. Use the model's fast "
                    "tokenizer (a tokenizer.json), or set data.chat_template to a template with {% generation %} "
                    "markers around each assistant turn",
                )
            )

    def _plain(self, texts: Sequence[str]) -> list[Encoded]:
        out = self.tok(list(texts), add_special_tokens=True)
        eos = self.tok.eos_token_id
        docs: list[Encoded] = []
        for ids in _field(out, "input_ids"):
            tokens = [*ids, eos] if eos is not None else list(ids)
            docs.append(TokenizedDocument(tokens, _all(1, len(tokens))))
        return docs

    def _render(self, conversations: list[list[dict[str, str]]], **kwargs: Any) -> Any:
        return self.tok.apply_chat_template(conversations, chat_template=self.template, **kwargs)

    def _chat_batch(self, conversations: list[list[dict[str, str]]]) -> list[Encoded]:
        if self.markers:
            out = self._render(conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            docs: list[Encoded] = []
            for ids, mask in zip(_field(out, "input_ids"), _field(out, "assistant_masks")):
                docs.append(_document(list(ids), bytearray(mask)))
            return docs
        texts = self._render(conversations, tokenize=False)
        encoded = self.tok(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        docs = []
        for text, messages, ids, offsets in zip(
            texts, conversations, _field(encoded, "input_ids"), _field(encoded, "offset_mapping")
        ):
            spans = assistant_spans(text, messages)
            if isinstance(spans, tuple):
                docs.append(spans)
                continue
            docs.append(_document(list(ids), targets_from_offsets(ids, offsets, spans, self.closing)))
        return docs

    def _chat(self, values: Sequence[Any]) -> list[Encoded]:
        conversations = [[{"role": t["role"], "content": t["content"]} for t in value] for value in values]
        try:
            return self._chat_batch(conversations)
        except Exception:  # a template's raise_exception (e.g. roles must alternate): find the row, skip it
            if len(conversations) == 1:
                raise
        docs: list[Encoded] = []
        for conversation in conversations:
            try:
                docs += self._chat_batch([conversation])
            except Exception as exc:
                docs.append((TEMPLATE_REFUSES, f"{type(exc).__name__}: {exc}"))
        return docs

    def encode(self, values: Sequence[Any], *, chat: bool) -> list[Encoded]:
        return self._chat(values) if chat else self._plain(values)


def _document(ids: list[int], targets: bytearray) -> Encoded:
    if not any(targets):
        return NOTHING_MARKED, "the chat template marks no assistant token of this conversation"
    return TokenizedDocument(ids, targets)


def _own_template(tok: Any) -> str | None:
    """The tokenizer's default chat template (a dict of named templates: its ``default``)."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def build_text_tokenizer(name: str | None, *, chat: bool, chat_template: str | None = None) -> TextTokenizer:
    """``data.tokenizer`` None / "tiny": the shipped byte-level tokenizer (vocab 262); else an HF id or dir."""
    if name in (None, "tiny"):
        if chat_template:
            raise ConfigError(
                ConfigIssue(
                    "data.chat_template",
                    "the tiny tokenizer has its own ChatML layout and takes no chat template; set data.tokenizer to "
                    "a Hugging Face tokenizer, or remove data.chat_template",
                )
            )
        return TinyTextTokenizer()
    return HFTextTokenizer(name, chat=chat, chat_template=chat_template)
