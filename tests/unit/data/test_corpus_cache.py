"""The tokenized-corpus cache (``data.corpus``, ``data.token_cache``, ``config.corpus_key``): built once, mapped by
every later source; keyed by what changes the tokens; a truncated, stale or half-written entry never used; one
builder among concurrent processes; a read-only cache directory named before any process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nemo_ac.config import ConfigError
from nemo_ac.config.corpus_key import ENV_CACHE_DIR, check_text_corpus, corpus_key, entry_name
from nemo_ac.config.schema import DataConfig
from nemo_ac.data import corpus as corpus_module
from nemo_ac.data import text_tokenizers
from nemo_ac.data.corpus import prepare_corpus
from nemo_ac.data.text import TextBatches
from nemo_ac.data.token_cache import FILES, build_once
from tests.chat_data import build_tokenizer, write_chat_file
from tests.launch import ROOT, child_env

CORPUS = ROOT / "data" / "tiny_corpus.jsonl"


def _data(path: Path, cache: Path, **cfg) -> DataConfig:
    return DataConfig(kind="text", path=str(path), seq_len=cfg.pop("seq_len", 64), cache_dir=str(cache), **cfg)


def _source(data: DataConfig) -> TextBatches:
    return TextBatches(data, vocab_size=1024, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)


def _rows(source: TextBatches, count: int = 6) -> list[torch.Tensor]:
    return [source.row(r)["input_ids"] for r in range(0, count * 7, 7)]


def _no_tokenizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a mapped entry was tokenized again")

    monkeypatch.setattr(corpus_module, "build_text_tokenizer", refuse)
    monkeypatch.setattr(corpus_module, "load_rows", refuse)


def test_a_relaunch_maps_the_entry_without_a_tokenizer_or_a_row_read(tmp_path, monkeypatch, capsys):
    tokenizer = build_tokenizer(tmp_path / "tok", "nemotron")
    chats = write_chat_file(tmp_path / "chat.jsonl", 40)
    data = _data(chats, tmp_path / "cache", messages_column="messages", tokenizer=str(tokenizer))
    first = _source(data)
    assert "data | tokenized 40 rows" in capsys.readouterr().err
    _no_tokenizing(monkeypatch)
    second = TextBatches(
        data, vocab_size=1024, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0, announce=True
    )
    said = capsys.readouterr().err
    assert "data | mapped" in said and "40 documents" in said and "tokenized" in said.split("data | mapped")[1]
    assert all(torch.equal(a, b) for a, b in zip(_rows(first), _rows(second)))
    entries = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and sorted(p.name for p in entries[0].iterdir()) == sorted([*FILES, "meta.json"])
    meta = json.loads((entries[0] / "meta.json").read_text())
    from transformers import AutoTokenizer

    assert meta["num_documents"] == 40 and meta["vocab_size"] == len(AutoTokenizer.from_pretrained(tokenizer))
    assert meta["key"] == corpus_key(data) and meta["skipped"] == []


def test_the_key_follows_the_dataset_the_tokenizer_and_its_template_not_the_row_length(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok", "chatml")
    chats = write_chat_file(tmp_path / "chat.jsonl", 20)
    data = _data(chats, tmp_path / "cache", messages_column="messages", tokenizer=str(tokenizer))
    key = corpus_key(data)
    assert (
        corpus_key(_data(chats, tmp_path / "other", messages_column="messages", tokenizer=str(tokenizer), seq_len=8))
        == key
    )
    write_chat_file(chats, 21)  # new content, size and mtime
    assert corpus_key(data)["dataset"] != key["dataset"]
    key = corpus_key(data)
    config = tokenizer / "chat_template.jinja"
    config.write_text(config.read_text().replace("You are a helpful assistant.", "You are terse."))
    assert corpus_key(data)["tokenizer"] != key["tokenizer"]
    plain = _data(chats, tmp_path / "cache", tokenizer=str(tokenizer), text_column="messages")
    assert corpus_key(plain)["rows"] == "text" and entry_name(plain, corpus_key(plain)) != entry_name(data, key)


@pytest.mark.parametrize("damage", ["truncated", "stale key", "no meta"])
def test_a_damaged_entry_is_named_rebuilt_and_never_used(damage, tmp_path):
    data = _data(CORPUS, tmp_path / "cache")
    want = _rows(_source(data))
    entry = tmp_path / "cache" / entry_name(data, corpus_key(data))
    if damage == "truncated":
        tokens = entry / "tokens.bin"
        tokens.write_bytes(tokens.read_bytes()[: tokens.stat().st_size // 2])
        said = r"is truncated: tokens.bin has [\d,]+ bytes, its meta.json says [\d,]+; tokenizing it again"
    elif damage == "stale key":
        meta = json.loads((entry / "meta.json").read_text())
        meta["key"]["column"] = "something else"
        (entry / "meta.json").write_text(json.dumps(meta))
        said = "was built for another corpus, tokenizer or format"
    else:
        (entry / "meta.json").unlink()
        said = "has no meta.json"
    with pytest.warns(UserWarning, match=said):
        rebuilt = _source(data)
    assert all(torch.equal(a, b) for a, b in zip(want, _rows(rebuilt)))
    assert (entry / "meta.json").is_file() and not list((tmp_path / "cache").glob("*.discarded-*"))


def test_a_dead_builders_lock_and_partial_are_taken_over(tmp_path):
    data = _data(CORPUS, tmp_path / "cache")
    entry = tmp_path / "cache" / entry_name(data, corpus_key(data))
    entry.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = entry.with_name(entry.name + ".lock")
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout), "started": 0}))
    partial = entry.with_name(entry.name + ".partial-elsewhere-1")
    partial.mkdir()
    (partial / "tokens.bin").write_bytes(b"\0" * 10)
    start = time.monotonic()
    source = _source(data)
    assert time.monotonic() - start < 30 and source.num_documents == 1500
    assert not lock.exists() and not partial.exists()  # released and cleaned by the builder that took over


_BUILDER = """
import sys, time
from nemo_ac.config.schema import DataConfig
from nemo_ac.data import corpus
from nemo_ac.data.corpus import prepare_corpus
slow = corpus.tokenize_into
def slowed(*args, **kwargs):
    time.sleep(1.5)  # every process is past its first look at the cache before the first build ends
    return slow(*args, **kwargs)
corpus.tokenize_into = slowed
data = DataConfig(kind="text", path=sys.argv[1], cache_dir=sys.argv[2])
mapped = prepare_corpus(data, vocab_size=262, announce=False)
print("tokens", mapped.total_tokens, int(mapped.tokens[:1000].to(int).sum()))
"""


def test_concurrent_processes_tokenize_once_and_map_the_same_bytes(tmp_path):
    """Like the ranks of a node (or the nodes on shared storage): one builds while the others wait on its lock."""
    env = child_env({ENV_CACHE_DIR: str(tmp_path / "unused")})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(CORPUS), str(tmp_path / "cache")],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    errs = "".join(err for _, err in outputs)
    assert errs.count("data | tokenized 1,500 rows") == 1, errs
    assert errs.count("data | waiting for") == 1, errs
    assert len({out for out, _ in outputs}) == 1


def test_build_once_waits_for_a_live_holder_and_runs_only_once(tmp_path):
    final = tmp_path / "entry"
    lock = final.with_name("entry.lock")
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "started": 0}))
    waits, builds = [], []

    # A live holder (this process) that never finishes: the waiter keeps waiting until the entry appears.
    def finish_later() -> None:
        time.sleep(0.5)
        final.mkdir()
        lock.unlink()

    threading.Thread(target=finish_later).start()
    built = build_once(
        final, is_complete=final.exists, build=lambda: builds.append(1), waiting=waits.append, poll_s=0.05
    )
    assert built is False and builds == [] and len(waits) == 1 and waits[0].pid == os.getpid()


def test_an_unwritable_cache_dir_is_named_before_any_process_group_and_at_the_load(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    data = _data(CORPUS, blocker / "cache")
    from nemo_ac.config import load_recipe
    from tests.launch import RECIPES

    recipe = load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml", [f"data.cache_dir={blocker / 'cache'}"])
    issues = check_text_corpus(recipe)
    assert [i.key for i in issues] == ["data.cache_dir"] and "cannot be written" in issues[0].message
    with pytest.raises(ConfigError, match=r"data.cache_dir: .*cannot be written .*nemo-ac tokenize RECIPE"):
        _source(data)
    # a complete entry there is mapped whatever the directory's permissions: built elsewhere, copied in
    good = _data(CORPUS, tmp_path / "built")
    prepare_corpus(good, announce=False)
    recipe_ok = load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml", [f"data.cache_dir={tmp_path / 'built'}"])
    assert check_text_corpus(recipe_ok) == []


def test_the_builder_reads_shards_and_logs_progress_where_there_is_no_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus_module, "SHARD_ROWS", 100)
    monkeypatch.setattr(corpus_module, "LOG_EVERY_S", 0.0)
    seen = []

    original = text_tokenizers.TinyTextTokenizer.encode

    def spy(self, values, *, chat):
        seen.append(len(values))
        return original(self, values, chat=chat)

    monkeypatch.setattr(text_tokenizers.TinyTextTokenizer, "encode", spy)
    prepare_corpus(_data(CORPUS, tmp_path / "cache"), announce=False)
    assert max(seen) == 100 and sum(seen) == 1500  # 15 shards: never the whole corpus in memory
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data | tokenizing")]
    assert lines and all("rows/s, ETA" in line for line in lines)
    assert lines[-1].split(": ")[1].startswith("1,500 / 1,500 rows")
