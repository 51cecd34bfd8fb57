"""GLM-4.5-Air and Nemotron 3 Super tiny recipes on real multi-process FSDP2 (gloo), as shipped.

- Each tiny recipe trains 5 steps with its parallel layout (Nemotron: EP2 on 2 ranks, selective AC, fp32 router;
  GLM: Ulysses CP2 on 2 ranks, full AC with activation offloading, fp32 router), the loss falls, and every step's
  loss and grad norm equal a world-size-1 run (no EP / CP / offloading) within 1e-5 relative (fp32). GLM's
  world-size-1 run computes the whole logits and keeps AdamW's states on the device; its 2-rank run, as the
  recipe sets, runs the LM head + loss in token chunks (under CP, full AC and offloading) and keeps the states in
  host memory.
- Both recipes train their router biases aux-loss-free: the exported ``e_score_correction_bias`` of the 2-rank run
  equals the 1-rank run's exactly and is not zero, so the updates used loads summed over ranks and micro batches.
- GLM's offloading did its work: each step moved one block input per layer and micro batch to host memory.
- Chat data with a real byte-level BPE tokenizer and each model's own chat template (``tests.chat_data``): the
  Nemotron parity runs above train on chats; GLM on chats resumes on the rows of the uninterrupted run and
  tokenizes once over three launches.
- HF round trip under FSDP2 + EP on 2 ranks: random weights written in the Hub layout -> the trainer with
  ``model.pretrained`` and ``train.steps=0`` -> ``checkpoint.export_hf`` -> byte-identical tensors. And a DCP
  checkpoint exported with ``train.steps=0 checkpoint.resume=...`` equals the export at the end of its run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_ac.config import load_recipe
from nemo_ac.config.hf import hf_config_dict
from tests.chat_data import build_tokenizer, write_chat_file
from tests.factories import assert_bytes_equal, read_dir, write_hub_checkpoint
from tests.launch import RECIPES, assert_close_rel, run_recipe

pytest.importorskip("safetensors.torch", reason="HF checkpoint IO needs safetensors")

pytestmark = pytest.mark.functional

NEMOTRON = "tiny/nemotron_super_v3_tiny.yaml"
GLM = "tiny/glm_4_5_air_tiny.yaml"
STEPS = 5
REL = 1e-5


def _export(path: Path) -> list[str]:
    return ["checkpoint.export_hf=true", f"checkpoint.export_hf_dir={path}"]


def _biases(export_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_dir(export_dir).items() if k.endswith("e_score_correction_bias")}


def _chat_overrides(tmp_path: Path, family: str) -> list[str]:
    """A chat file and a byte-level BPE tokenizer with ``family``'s own chat template (``tests.chat_data``)."""
    tokenizer = build_tokenizer(tmp_path / f"tokenizer_{family}", family)
    chats = write_chat_file(tmp_path / "chat.jsonl", 120)
    return [
        f"data.path={chats}",
        "data.messages_column=messages",
        f"data.tokenizer={tokenizer}",
        "model.vocab_size=512",
    ]


def _assert_same_training(parallel, single, tmp_path: Path) -> None:
    parallel.check()
    single.check()
    assert len(parallel.losses) == STEPS
    assert_close_rel(parallel.losses, single.losses, rel=REL)
    assert_close_rel([m["grad_norm"] for m in parallel.metrics], [m["grad_norm"] for m in single.metrics], rel=REL)
    assert parallel.losses[-1] < parallel.losses[0] - 0.1, parallel.losses
    biases, reference = _biases(tmp_path / "hf_parallel"), _biases(tmp_path / "hf_single")
    assert biases.keys() == reference.keys() and biases
    for key, value in reference.items():
        assert torch.equal(biases[key], value), key
        assert value.abs().sum() > 0, key  # the updates happened


def test_nemotron_tiny_ep2_trains_like_one_process(tmp_path: Path) -> None:
    """On chats: Nemotron 3 Super's own template (an empty system turn, ``<think></think>`` before every answer)
    and a real BPE tokenizer; the 2-rank and the 1-rank run map the one tokenized entry."""
    chat = _chat_overrides(tmp_path, "nemotron")
    common = [f"train.steps={STEPS}", *chat]
    parallel = run_recipe(
        NEMOTRON, nproc=2, run_dir=tmp_path / "ws2", overrides=[*common, *_export(tmp_path / "hf_parallel")]
    )
    # micro_batch_size * dp stays 4, so every micro step covers the same global rows.
    single = run_recipe(
        NEMOTRON,
        nproc=1,
        run_dir=tmp_path / "ws1",
        overrides=[
            *common,
            "parallel.ep=1",
            "train.micro_batch_size=4",
            *_export(tmp_path / "hf_single"),
            "checkpoint.enabled=true",
            f"checkpoint.dir={tmp_path / 'dcp'}",
        ],
    )
    _assert_same_training(parallel, single, tmp_path)
    print(f"\nnemotron tiny on chat: losses {[round(loss, 4) for loss in parallel.losses]}")
    assert "(ep 2)" in parallel.output
    # A DCP checkpoint converts to the same HF checkpoint: train.steps=0 resumes it and only exports.
    convert = [f"checkpoint.resume={tmp_path / 'dcp' / f'step_{STEPS}'}", *_export(tmp_path / "hf_from_dcp")]
    run_recipe(
        NEMOTRON, nproc=1, run_dir=tmp_path / "convert", overrides=["train.steps=0", "parallel.ep=1", *chat, *convert]
    ).check()
    assert_bytes_equal(read_dir(tmp_path / "hf_from_dcp"), read_dir(tmp_path / "hf_single"))


def test_glm_tiny_cp2_ulysses_with_offloading_trains_like_one_process(tmp_path: Path) -> None:
    common = [f"train.steps={STEPS}"]
    parallel = run_recipe(
        GLM, nproc=2, run_dir=tmp_path / "ws2", overrides=[*common, *_export(tmp_path / "hf_parallel")]
    )
    single = run_recipe(
        GLM,
        nproc=1,
        run_dir=tmp_path / "ws1",
        overrides=[
            *common,
            "parallel.cp=1",
            "activation_checkpointing.offload=false",
            # The whole logits and FSDP's shards, gradients and AdamW on the device: the recipe's chunked LM head +
            # loss and its optimizer offload (FSDP2's CPUOffloadPolicy) match them.
            "train.loss_chunk_tokens=0",
            "train.optimizer_offload=none",
            *_export(tmp_path / "hf_single"),
        ],
    )
    _assert_same_training(parallel, single, tmp_path)
    recipe = load_recipe(RECIPES / GLM)
    micro_batches = recipe.train.global_batch_size // recipe.train.micro_batch_size  # dp = 1 under cp 2
    per_step = recipe.model.num_layers * micro_batches  # full AC keeps one input per block and micro batch
    local_tokens = recipe.train.micro_batch_size * recipe.data.seq_len // recipe.parallel.cp
    assert [m["offload_tensors"] for m in parallel.metrics] == [per_step * (k + 1) for k in range(STEPS)]
    mib = per_step * local_tokens * recipe.model.hidden_size * 4 / 2**20
    assert parallel.metrics[0]["offload_mib"] == pytest.approx(mib, abs=1e-3)
    assert "offload_tensors" not in single.metrics[0]


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [(NEMOTRON, []), (GLM, ["parallel.ep=2"])],  # GLM: EP2 across the CP pair, FSDP2 over the same 2 ranks
    ids=["nemotron_ep2", "glm_cp2_ep2"],
)
def test_hf_round_trip_under_fsdp2_and_ep_is_byte_identical(recipe: str, overrides: list[str], tmp_path: Path) -> None:
    model_config = load_recipe(RECIPES / recipe, overrides).model
    source = tmp_path / "hub"
    written = write_hub_checkpoint(model_config, source, dtype=torch.float32)  # two shards + index
    (source / "config.json").write_text(json.dumps(hf_config_dict(model_config)))
    out = tmp_path / "export"
    run = run_recipe(
        recipe,
        nproc=2,
        run_dir=tmp_path / "run",
        overrides=[*overrides, "train.steps=0", f"model.pretrained={source}", *_export(out)],
    ).check()
    assert f"weights from {source}" in run.output and "(ep 2)" in run.output
    assert_bytes_equal(read_dir(out), written)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_config.family


def test_glm_tiny_on_chat_resumes_on_the_rows_of_the_uninterrupted_run(tmp_path: Path) -> None:
    """GLM-4.5-Air's chat template and a real BPE tokenizer (data.kind text, messages_column): 6 steps straight vs
    3, killed, resumed (auto), 3 more: the same per-step losses, because a step's rows are a function of the step
    alone (nemo_ac/data/text.py). The first launch tokenizes the chats once; the two later launches map the entry.
    Before: ``ValueError: too many dimensions 'str'`` in step 1 (a ``BatchEncoding`` read as a token list)."""
    common = [
        *_chat_overrides(tmp_path, "glm4_5"),
        "train.steps=6",
        "checkpoint.enabled=true",
        "checkpoint.every_n_steps=3",
        "checkpoint.resume=auto",
    ]
    straight = run_recipe(
        GLM, nproc=2, run_dir=tmp_path / "straight", overrides=[*common, f"checkpoint.dir={tmp_path / 'a'}"]
    ).check()
    assert straight.output.count("data | tokenized 120 rows") == 1, straight.output
    stopped_overrides = [*common, f"checkpoint.dir={tmp_path / 'b'}"]
    stopped = run_recipe(
        GLM, nproc=2, run_dir=tmp_path / "stopped", overrides=[*stopped_overrides, "train.fail_after_step=3"]
    )
    assert stopped.returncode != 0 and stopped.losses == straight.losses[:3]
    resumed = run_recipe(GLM, nproc=2, run_dir=tmp_path / "stopped", overrides=stopped_overrides).check()
    assert "data | tokenized" not in resumed.output and "data | mapped" in resumed.output
    print(f"\nglm tiny on chat: first loss {straight.losses[0]:.4f}, final {straight.losses[-1]:.4f}")
    assert resumed.losses == straight.losses
    assert straight.losses[-1] < straight.losses[0] - 0.1, straight.losses
