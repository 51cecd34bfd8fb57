"""Chat rows through real Hugging Face tokenizers and the models' own chat templates (``data.text_tokenizers``).

For ChatML (Qwen), ChatML with ``{% generation %}`` markers, GLM-4.5-Air's and Nemotron 3 Super's templates, a
byte-level BPE tokenizer built in the test (``tests.chat_data``), through ``TextBatches`` and its cache:

- every document's tokens are exactly ``apply_chat_template(messages, tokenize=True)``'s;
- the loss targets are exactly each assistant turn's content plus the special token that closes the turn;
- one render and one encode per batch of conversations, whatever the number of turns.

Before: ``apply_chat_template`` returns a ``BatchEncoding`` in transformers 5, which the loader read as a list, so
every conversation became the two "tokens" ``['input_ids', 'attention_mask']`` and the first batch failed with
``ValueError: too many dimensions 'str'``; and each assistant turn rendered and encoded the prefix twice more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.data.text import TextBatches
from nemo_ac.data.text_tokenizers import TEMPLATE_REWRITES, HFTextTokenizer, assistant_spans
from tests.chat_data import FORMATS, build_tokenizer, chat_rows, write_chat_file

pytest.importorskip("transformers")

# The special token the template writes right after an assistant turn's content, learned as its end.
CLOSING = {"chatml": "<|im_end|>", "chatml_generation": "<|im_end|>", "glm4_5": "<|user|>", "nemotron": "<|im_end|>"}
ROWS = 60


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: build_tokenizer(root / family, family) for family in FORMATS}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    return write_chat_file(tmp_path_factory.mktemp("chat") / "chat.jsonl", ROWS)


def _source(path: Path, tokenizer: Path, **cfg) -> TextBatches:
    data = DataConfig(kind="text", path=str(path), messages_column="messages", tokenizer=str(tokenizer), **cfg)
    return TextBatches(data, vocab_size=1024, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)


def _target_runs(tokens: list[int], flags: list[bool]) -> list[list[int]]:
    runs, current = [], []
    for token, flag in zip(tokens, flags):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [*runs, current] if current else runs


@pytest.mark.parametrize("family", list(FORMATS))
def test_tokens_are_apply_chat_templates_and_targets_the_assistant_contents(family, tokenizers, chat_file):
    source = _source(chat_file, tokenizers[family], seq_len=256)
    tok = HFTextTokenizer(str(tokenizers[family]), chat=True).tok
    assert tok.is_fast and type(tok).__name__ != "TinyChatTokenizer"
    rows = chat_rows(ROWS)
    assert source.num_documents == ROWS
    closing = CLOSING[family]
    for index, row in enumerate(rows):
        tokens, flags = source.corpus.document(index)
        messages = row["messages"]
        reference = tok.apply_chat_template(messages, tokenize=True)
        assert tokens == list(reference["input_ids"]), index  # a BatchEncoding in transformers 5
        said = [tok.decode(run) for run in _target_runs(tokens, flags)]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        # GLM-4.5 closes a turn with the next turn's <|user|>: the conversation's last answer has none after it.
        expected = [a + closing if rendered.find(a + closing) >= 0 else a for a in answers]
        assert said == expected, (index, said, expected)
    # rows: labels are the next token where it is a target, within the document
    row = source.row(0)
    labels = row["labels"][row["labels"] != IGNORE_INDEX].tolist()
    text = tok.decode(labels)
    assert "now." in text and "How many" not in text and "system" not in text


def test_one_render_and_one_encode_per_batch_whatever_the_turns(tokenizers, tmp_path, monkeypatch):
    """The loader used to make 1 + 2 x (assistant turns) tokenizer calls per conversation."""
    chats = write_chat_file(tmp_path / "chat.jsonl", 40)
    tokenizer = HFTextTokenizer(str(tokenizers["nemotron"]), chat=True)
    calls = {"render": 0, "encode": 0}
    render, encode = type(tokenizer.tok).apply_chat_template, type(tokenizer.tok).__call__

    def counted_render(self, *args, **kwargs):
        calls["render"] += 1
        return render(self, *args, **kwargs)

    def counted_encode(self, *args, **kwargs):
        calls["encode"] += 1
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer.tok), "apply_chat_template", counted_render)
    monkeypatch.setattr(type(tokenizer.tok), "__call__", counted_encode)
    values = [row["messages"] for row in chat_rows(40)]
    docs = tokenizer.encode(values, chat=True)
    assert len(docs) == 40 and calls == {"render": 1, "encode": 1}
    del chats


def test_a_template_that_rewrites_the_turns_skips_rows_and_one_with_markers_marks_them(tokenizers, tmp_path):
    """Qwen3's template drops earlier turns' reasoning; here a template upper-cases the answers: their text is not
    in the rendered conversation, so the rows cannot be marked from offsets: counted skips, then a ConfigError when
    none is left. The same rows with a template that marks the turns ({% generation %}) train."""
    chats = write_chat_file(tmp_path / "chat.jsonl", 12)
    upper = tmp_path / "upper.jinja"
    upper.write_text(
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}"
    )
    from nemo_ac.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.messages_column: no usable rows .*the chat template rewrites a"):
        _source(chats, tokenizers["chatml"], chat_template=str(upper), seq_len=16)
    marked = tmp_path / "marked.jinja"
    marked.write_text(
        upper.read_text().replace(
            "{{ m.content | upper }}", "{% generation %}{{ m.content | upper }}{% endgeneration %}"
        )
    )
    source = _source(chats, tokenizers["chatml"], chat_template=str(marked), seq_len=16)
    assert source.num_documents == 12


def test_assistant_spans_are_found_in_order_so_an_answer_repeating_the_question_is_the_answer():
    text = "<u>say hi<a>hi</a><u>hi again<a>hi</a>"
    messages = [
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "hi again"},
        {"role": "assistant", "content": " hi "},  # the template strips it
    ]
    spans = assistant_spans(text, messages)
    assert [text[a:b] for a, b in spans] == ["hi", "hi"] and spans[0][0] == text.index("<a>") + 3
    assert spans[1][0] == text.rindex("<a>") + 3
    assert assistant_spans(text, [{"role": "assistant", "content": "HELLO"}])[0] == TEMPLATE_REWRITES


def test_a_tokenizer_without_a_chat_template_is_named_before_and_at_the_load(tokenizers, chat_file, tmp_path):
    from transformers import AutoTokenizer

    from nemo_ac.config import ConfigError, load_recipe
    from nemo_ac.preflight import preflight
    from tests.launch import RECIPES

    plain = tmp_path / "no_template"
    tok = AutoTokenizer.from_pretrained(tokenizers["chatml"])
    tok.chat_template = None
    tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*no_template' has no chat template"):
        _source(chat_file, plain, seq_len=16)
    overrides = [
        f"data.path={chat_file}",
        "data.messages_column=messages",
        f"data.tokenizer={plain}",
        "model.vocab_size=1024",
    ]
    assert load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml", overrides).data.tokenizer == str(plain)
    with pytest.raises(ConfigError) as info:
        preflight(str(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml"), overrides, world_size=2, check_env=False)
    assert "data.tokenizer" in info.value.keys and "has no chat template" in str(info.value)
