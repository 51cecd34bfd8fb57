"""Every bad data or weight input fails before any process group, naming the file, the line (or byte, or row) and
the key that chose it, with the fix: one test per case of the issue "Nothing lost, every bad input named", run
through ``nemo-ac validate`` (``nemo_ac.preflight``, the path ``nemo-ac train`` and the torchrun entry share).

Before (the same cases on the code without these checks): the data cases validated (exit 0) and failed after the
process group and the weight load with ``UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 3``,
``KeyError: 'content'``, ``DatasetGenerationError: An error occurred while generating the dataset`` and, for a
``data.path`` typo, ``ConnectionError: Couldn't reach 'data/tiny_corpsu.jsonl' on the Hub``; a truncated
safetensors file validated and failed in the load as ``SafetensorError: ... incomplete metadata, file not fully
covered``; ``data.num_workers=100000`` on text validated and was ignored; the override ``=3`` said ``unknown key.``
with an empty key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from nemo_ac.cli import main as cli
from nemo_ac.config import load_recipe
from nemo_ac.data.text import TextBatches
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.checkpoint.hf_safetensors import HFCheckpointError, export_hf_checkpoint, load_hf_checkpoint
from tests.launch import RECIPES, ROOT

safetensors_torch = pytest.importorskip("safetensors.torch", reason="HF checkpoints need safetensors")

RECIPE = """\
name: bad_input
model: {model}
parallel: {{dp_shard: -1}}
data: {{kind: text, path: {data}, seq_len: 32}}
train: {{steps: 2, global_batch_size: 4, micro_batch_size: 2, warmup_steps: 1}}
logging: {{run_dir: {run_dir}}}
"""
GOOD = [json.dumps({"text": f"document {i} says hello."}) for i in range(40)]
CHATS = [
    {"messages": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": f"a{i}."}]} for i in range(40)
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A tiny local ``model.pretrained`` directory (config.json + 4 safetensors shards + index), exported by
    nemo_ac from the tiny GLM recipe's architecture (vocab 262: the shipped byte tokenizer)."""
    model = build_model(load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml").model)
    materialize_and_init(model, device="cpu", seed=0)
    out = tmp_path_factory.mktemp("hf") / "tiny_glm"
    export_hf_checkpoint(model, out, max_shard_bytes=200_000)
    return out


def recipe(tmp_path: Path, *, data: str | Path, pretrained: Path | None = None) -> str:
    model = (
        f"{{pretrained: {pretrained}}}"
        if pretrained
        else "{family: qwen3_moe, vocab_size: 262, hidden_size: 32, num_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, head_dim: 16, moe: {num_experts: 2, num_experts_per_tok: 1, moe_intermediate_size: 16}}"
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(model=model, data=data, run_dir=tmp_path / "run"))
    return str(path)


def validate(capsys, path: str, *overrides: str, check_env: bool = False) -> tuple[int, str, str]:
    """(exit code, stdout, the first problem line of stderr) of ``nemo-ac validate``."""
    code = cli(["validate", path, "--world-size", "2", *(["--check-env"] if check_env else []), *overrides])
    out, err = capsys.readouterr()
    problems = [line.strip() for line in err.splitlines() if line.strip().startswith("- ")]
    return code, out, problems[0] if problems else err.strip()


def test_a_non_utf8_data_file_is_named_with_its_line_and_byte(tmp_path, capsys):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes("\n".join(GOOD[:2]).encode() + b'\n{"text": "caf\xe9"}\n' + "\n".join(GOOD).encode())
    code, _, first = validate(capsys, recipe(tmp_path, data=latin1))
    assert code == 2
    offset = len("\n".join(GOOD[:2]).encode()) + 1 + len('{"text": "caf')
    assert first == (
        f"- data.path: {latin1}: line 3 is not UTF-8: byte 0xe9 at byte offset {offset} (column 14); save the file "
        "as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 latin1.jsonl > fixed_latin1.jsonl)"
    )


def test_a_malformed_jsonl_line_is_named_by_its_line_number(tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*GOOD[:6], '{"text": "unterminated}', *GOOD[6:]]) + "\n")
    code, _, first = validate(capsys, recipe(tmp_path, data=broken))
    assert code == 2
    assert first.startswith(f"- data.path: {broken}: line 7 is not valid JSON (Invalid control character at column")


def test_a_chat_turn_without_content_is_a_counted_skip_named_by_its_row(tmp_path, capsys):
    """One rule for every bad row: skipped and counted like a chat without an assistant turn (before: ``KeyError:
    'content'`` after the weight load, the whole run lost for one row)."""
    chats = list(CHATS)
    chats[3] = {"messages": [{"role": "user", "content": "q?"}, {"role": "assistant"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    code, out, _ = validate(capsys, recipe(tmp_path, data=path), "data.messages_column=messages")
    assert code == 0
    assert (
        f"note | data.path: 1 of the first 40 rows of {path} will be skipped (counted, data.messages_column "
        "'messages'): malformed turn: 1 row (row 3: line 4: turn 1 has no 'content' (its keys: role))"
    ) in out
    data = load_recipe(recipe(tmp_path, data=path), ["data.messages_column=messages"]).data
    with pytest.warns(UserWarning, match=r"chat.jsonl' \(data.messages_column 'messages'\): malformed turn: 1 row"):
        source = TextBatches(
            data, vocab_size=262, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0
        )
    assert source.num_documents == 39
    # a head without any usable row is an error (the column holds something else), named like the loader names it
    path.write_text("".join(json.dumps({"messages": [{"from": "human", "value": "hi"}]}) + "\n" for _ in range(5)))
    code, _, first = validate(capsys, recipe(tmp_path, data=path), "data.messages_column=messages")
    assert code == 2
    assert first.startswith("- data.messages_column: none of the first 5 rows of")
    assert "turn 0 has no 'role' (its keys: from, value)" in first


def test_a_data_path_typo_is_named_with_the_file_it_meant_and_a_hub_id_is_not_read(tmp_path, capsys, monkeypatch):
    """Before: ``ConnectionError: Couldn't reach 'data/tiny_corpsu.jsonl' on the Hub`` after the weight load. A Hub
    dataset id passes through unread: the preflight makes no network call."""
    monkeypatch.chdir(ROOT)
    code, _, first = validate(capsys, recipe(tmp_path, data="data/tiny_corpsu.jsonl"))
    assert code == 2
    assert first == (
        f"- data.path: 'data/tiny_corpsu.jsonl' does not exist (relative to the working directory {ROOT}). Did you "
        "mean 'data/tiny_corpus.jsonl'? Point data.path at an existing file or directory (or a Hub dataset id, "
        "org/name)"
    )

    def no_network(*args, **kwargs):
        raise AssertionError("the preflight opened a network connection")

    monkeypatch.setattr("socket.socket.connect", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = validate(capsys, recipe(tmp_path, data="HuggingFaceH4/ultrachat_200k"))
    assert code == 0, err
    assert "OK at world size 2" in out


def test_a_truncated_or_damaged_safetensors_file_is_named_before_the_weight_load(tmp_path, capsys, pretrained):
    """Only the 8-byte length and the JSON header are read (before: ``SafetensorError: Error while deserializing
    header: incomplete metadata, file not fully covered``, after the process group, naming no file)."""
    cut = tmp_path / "cut"
    cut.mkdir()
    for file in pretrained.iterdir():
        (cut / file.name).write_bytes(file.read_bytes())
    shard = cut / "model-00002-of-00004.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    code, _, first = validate(capsys, recipe(tmp_path, data=ROOT / "data" / "tiny_corpus.jsonl", pretrained=cut))
    assert code == 2
    assert first == (
        f"- model.pretrained: {shard} is truncated: its header describes {size:,} bytes, the file has {size // 2:,} "
        "(a download or copy that stopped early); download or copy the file again"
    )
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\x00" * 64)
    path = recipe(tmp_path, data=ROOT / "data" / "tiny_corpus.jsonl", pretrained=cut)
    code, _, first = validate(capsys, path)
    assert code == 2 and first.startswith(f"- model.pretrained: {shard}: its JSON header (bytes 8 to 24) is damaged")
    # the loader plans from the same headers: the same words if the preflight was skipped
    model = build_model(load_recipe(path).model)
    model.to_empty(device="cpu")
    with pytest.raises(HFCheckpointError, match=r"model-00002-of-00004.safetensors: its JSON header .* is damaged"):
        load_hf_checkpoint(model, cut)


def test_tensors_that_do_not_fit_the_model_are_named_by_the_environment_check(tmp_path, capsys, pretrained):
    """With the environment check (every run; ``--check-env`` for validate) each header tensor is compared with the
    model built on meta by the loader's own plan: shape, dtype, missing and unexpected keys."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in pretrained.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"]["model.norm.weight"]
    tensors = safetensors_torch.load_file(str(shard))
    tensors["model.norm.weight"] = torch.ones(65)
    other = next(key for key in sorted(tensors) if key != "model.norm.weight")
    tensors[other] = tensors[other].to(torch.float8_e4m3fn)
    safetensors_torch.save_file(tensors, str(shard))
    path = recipe(tmp_path, data=ROOT / "data" / "tiny_corpus.jsonl", pretrained=bad)
    assert validate(capsys, path)[0] == 0  # headers read: only the environment check builds the model
    code = cli(["validate", path, "--world-size", "2", "--check-env"])
    problems = [line.strip() for line in capsys.readouterr().err.splitlines() if line.strip().startswith("- ")]
    assert code == 2
    assert sorted(problems[:2]) == [
        f"- model.pretrained: dtype of {other!r} in {shard.name} is F8_E4M3, model tensor {other!r} needs one of "
        "BF16, F16, F32, F64 (a quantized checkpoint needs dequantizing first)",
        f"- model.pretrained: shape of 'model.norm.weight' in {shard.name} is [65], model expects [64]",
    ]
    assert problems[2:] == [
        f"- model.pretrained: the safetensors in {bad} do not fit the model its config.json describes: export the "
        "checkpoint again, or point model.pretrained at one whose weights match its config.json",
    ]


def test_an_empty_key_override_says_so(tmp_path, capsys):
    code, _, first = validate(capsys, recipe(tmp_path, data=ROOT / "data" / "tiny_corpus.jsonl"), "=3")
    assert (code, first) == (2, "- override '=3' has no key; write section.key=value")


def test_data_num_workers_is_bounded_and_read_by_text(tmp_path, capsys):
    path = recipe(tmp_path, data=ROOT / "data" / "tiny_corpus.jsonl")
    code, _, first = validate(capsys, path, "data.num_workers=100000")
    assert code == 2
    assert first.startswith("- data.num_workers: 100000 threads per rank is more than the 64 allowed")
    data = load_recipe(path, ["data.num_workers=2"]).data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source = TextBatches(
            data, vocab_size=262, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0
        )
    try:
        assert source.num_workers == 2 and source._pool is not None  # text reads it (before: silently ignored)
    finally:
        source.close()


def test_train_fails_in_the_preflight_before_torchrun_and_the_recipe_checks_import_no_torch(
    tmp_path, capsys, monkeypatch
):
    """``nemo-ac train`` stops before it becomes torchrun (no process group, no weight load), and the recipe and
    data checks stay free of torch (a subprocess: this one has it); ``preflight``'s plan step, which builds the
    model on meta, is the part that imports torch."""
    launched = []
    monkeypatch.setattr("os.execvpe", lambda file, command, env: launched.append(command))
    path = recipe(tmp_path, data=tmp_path / "corpsu.jsonl")
    assert cli(["train", path, "--nproc-per-node", "2"]) == 2 and not launched
    assert f"data.path: '{tmp_path / 'corpsu.jsonl'}' does not exist" in capsys.readouterr().err
    probe = (
        "import sys; from nemo_ac.config import load_recipe, validate_recipe\n"
        "from nemo_ac.config.data_files import check_data_files\n"
        f"r = load_recipe({path!r}); validate_recipe(r, world_size=2)\n"
        "print(check_data_files(r, [])[0].key)\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.split() == ["data.path", "False"]
