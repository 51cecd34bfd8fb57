"""``data.kind: text``: sources (JSONL, parquet, save_to_disk), the packing contract, chat loss masks, resume, and
bad input named by its key."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.config.schema import DataConfig
from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.data.text import TextBatches
from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer
from tests.launch import RECIPES, ROOT

CORPUS = ROOT / "data" / "tiny_corpus.jsonl"
CHAT = ROOT / "data" / "tiny_chat.jsonl"


def batches(path, *, dp_rank: int = 0, dp_size: int = 1, mb: int = 2, seed: int = 0, **cfg) -> TextBatches:
    data = DataConfig(kind="text", path=str(path), seq_len=cfg.pop("seq_len", 64), **cfg)
    return TextBatches(
        data, vocab_size=262, global_batch_size=4, micro_batch_size=mb, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )


def test_rows_follow_the_packing_contract():
    source = batches(CORPUS)
    (first, second) = source.batches_for_step(0)
    assert first.input_ids.shape == (2, 64) and second.input_ids.shape == (2, 64)
    row = source.row(0)
    docs = row["document_ids"]
    assert docs[0] == 0 and bool((docs[1:] >= docs[:-1]).all())
    starts = torch.cat([torch.tensor([True]), docs[1:] != docs[:-1]])
    assert bool((row["position_ids"][starts] == 0).all())  # positions restart at every document
    # labels: the next token inside the same document, never across a boundary
    same = docs[1:] == docs[:-1]
    assert torch.equal(row["labels"][:-1][same], row["input_ids"][1:][same])
    assert bool((row["labels"][:-1][~same] == IGNORE_INDEX).all()) and row["labels"][-1] == IGNORE_INDEX
    text = TinyChatTokenizer().decode(row["input_ids"].tolist())
    assert "went to" in text or "had" in text


def test_layouts_read_the_same_global_rows_and_resume_reads_the_same_batches():
    one = batches(CORPUS, mb=2)
    ranks = [batches(CORPUS, mb=1, dp_rank=r, dp_size=2) for r in range(2)]
    for step in (0, 3):
        single = torch.cat([b.input_ids for b in one.batches_for_step(step)])
        # micro step k of rank r holds global rows (k * dp + r) * mb ...: interleave the ranks back
        parts = [[b.input_ids for b in ranks[r].batches_for_step(step)] for r in range(2)]
        assert torch.equal(single, torch.cat([parts[r][k] for k in range(2) for r in range(2)]))
    run = batches(CORPUS)
    expected = [next(run) for _ in range(5)]
    resumed = batches(CORPUS)
    resumed.load_state_dict({"next_step": 3})
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(next(resumed), expected[3]))
    # epochs: past the end of the corpus the rows continue in a new order, still deterministic
    far = run.rows_per_epoch * 2 + 5
    assert torch.equal(run.row(far)["input_ids"], batches(CORPUS).row(far)["input_ids"])


def test_parquet_and_save_to_disk_give_the_rows_of_the_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()[:200]]
    jsonl = tmp_path / "part.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "part.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    want = batches(jsonl).row(7)["input_ids"]
    for path in (tmp_path / "part.parquet", tmp_path / "saved"):
        assert torch.equal(batches(path).row(7)["input_ids"], want), path


def test_chat_rows_take_the_loss_on_assistant_tokens_only(tmp_path):
    tok = TinyChatTokenizer()
    source = batches(CHAT, messages_column="messages", text_column="unused", seq_len=512)
    row = source.row(0)
    targets = row["labels"][row["labels"] != IGNORE_INDEX].tolist()
    said = tok.decode(targets)
    assert "has" in said and "now." in said and "How many" not in said and "user" not in said
    # a chat without an assistant turn is skipped, counted, with a warning naming its row
    path = tmp_path / "chat.jsonl"
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()[:50]]
    rows.append({"messages": [{"role": "user", "content": "hello?"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"skipped rows of .*chat.jsonl.* no assistant turn: 1 row \(row 50: "):
        kept = batches(path, messages_column="messages")
    assert kept.num_documents == 50


def test_malformed_chat_rows_are_counted_skips_like_rows_without_an_assistant_turn(tmp_path):
    """One rule for every bad row (nemo_ac.config.text_rows): a turn without content used to stop the run with a
    bare ``KeyError: 'content'`` while a chat without an assistant turn was a counted skip."""
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},  # row 1: no content
        {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},  # row 2: no role
        {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},  # row 3
        {"messages": "user: hi"},  # row 4: not a list
        {"messages": [{"role": "user", "content": "hi"}]},  # row 5: no assistant turn
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"messages": good}, *bad, {"messages": good}]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = batches(path, messages_column="messages", seq_len=8)
    assert kept.num_documents == 2
    said = sorted(str(w.message).split("'messages'): ")[1] for w in caught)
    assert said == [
        "malformed turn: 3 rows (rows 1, 2, 3; row 1: turn 1 has no 'content' (its keys: role))",
        "messages is not a list: 1 row (row 4: a str, not a list of {role, content} turns)",
        "no assistant turn: 1 row (row 5: no turn has role 'assistant')",
    ]
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"data.messages_column: no usable rows in .*malformed turn: 3 rows"):
            batches(only_bad, messages_column="messages", seq_len=8)


def test_unreadable_lines_are_named_by_the_loader(tmp_path):
    """The datasets library says "DatasetGenerationError: An error occurred while generating the dataset" or a bare
    "UnicodeDecodeError: ... position 3"; the loader names the file and the line (past the preflight's head too)."""
    good = [json.dumps({"text": f"document {i}"}) for i in range(20)]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes("\n".join(good).encode() + b'\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"latin1.jsonl: line 21 is not UTF-8: byte 0xe9 at byte offset \d+"):
        batches(latin1, seq_len=8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*good[:6], '{"text": "unterminated}', *good[6:]]) + "\n")
    with pytest.raises(ConfigError, match=r"broken.jsonl: line 7 is not valid JSON \(Invalid control character"):
        batches(broken, seq_len=8)


def test_bad_input_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.text_column: column 'body' is not in .* set data.text_column"):
        batches(CORPUS, text_column="body")
    (tmp_path / "nothing.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.path: .* is an empty file"):
        batches(tmp_path / "nothing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"data.text_column: no usable rows"):
            batches(empty)
    with pytest.raises(ConfigError, match=r"data.seq_len: 10000000 is longer than all of"):
        batches(CORPUS, seq_len=10_000_000)
    data = DataConfig(kind="text", path=str(CORPUS))
    with pytest.raises(ConfigError, match=r"model.vocab_size: 64 is smaller than data.tokenizer's 262 tokens"):
        TextBatches(data, vocab_size=64, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)


def test_recipe_validation_before_any_process_group():
    recipe = load_recipe(RECIPES / "tiny" / "qwen3_moe_tiny.yaml", ["data.kind=text"])
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe, world_size=1)
    assert {"data.path", "model.vocab_size"} <= set(info.value.keys)
    ok = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, path=str(CORPUS)))
    ok = dataclasses.replace(ok, model=dataclasses.replace(ok.model, vocab_size=262))
    validate_recipe(ok, world_size=1)


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_num_workers_gives_the_batches_of_no_workers_and_resumes(source, tmp_path):
    """``data.num_workers`` used to be read by MedPix alone (text and synthetic ignored it silently); every source
    now builds the next step in that many threads (``StepBatches``), with the batches of no workers, across epoch
    ends (text: 12 rows per epoch, 4 micro batches per step built in parallel) and after a resume."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i} is here."}) + "\n" for i in range(30)))

    def make(num_workers: int, dp_rank: int = 1):
        if source == "text":
            data = DataConfig(kind="text", path=str(path), seq_len=64, num_workers=num_workers)
            return TextBatches(
                data, vocab_size=262, global_batch_size=8, micro_batch_size=1, dp_rank=dp_rank, dp_size=2, seed=3
            )
        data = DataConfig(seq_len=40, fixed_length=False, num_workers=num_workers)
        return SyntheticBatches(
            data, vocab_size=32, global_batch_size=8, micro_batch_size=1, dp_rank=dp_rank, dp_size=2, seed=3
        )

    plain, threaded = make(0), make(3)
    assert threaded._pool is not None and plain._pool is None
    try:
        expected = [next(plain) for _ in range(8)]
        if source == "text":
            assert plain.rows_per_epoch < 8 * 8 // 2  # the steps cross epoch ends
        for want, got in zip(expected, [next(threaded) for _ in range(8)]):
            assert len(got) == len(want) == 4
            for a, b in zip(want, got):
                assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "labels", "document_ids"))
        assert 8 in threaded._prefetched  # step 8 is being built ahead
        state = threaded.state_dict()
        resumed = make(2)
        next(resumed)  # prefetches step 1, which the resume must drop
        resumed.load_state_dict({"next_step": 5})
        assert not resumed._prefetched
        assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(next(resumed), expected[5]))
        assert state == {"next_step": 8}
        resumed.close()
    finally:
        threaded.close()
