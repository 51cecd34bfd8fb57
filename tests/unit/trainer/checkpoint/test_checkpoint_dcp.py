"""DCP save/load of the real tiny model under FSDP2 in one process (a real gloo world of one).

Proves, cheaply and in-process, what the functional tests prove across processes: a resumed run is bitwise the
uninterrupted one (model, AdamW state, LR schedule, data position, RNG), keys carry no wrapper prefixes (a
checkpoint saved with activation checkpointing loads without it), an interrupted save is skipped with a warning,
and corrupt or incompatible checkpoints fail naming the file and the mismatch, DCP's own BaseException included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from nemo_ac.config import load_recipe, to_dict, validate_recipe
from nemo_ac.config.schema import CheckpointConfig
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from nemo_ac.trainer.checkpoint import files
from nemo_ac.trainer.checkpoint.dcp import (
    DCP_ERRORS,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    TrainingState,
    describe_dcp_error,
)
from nemo_ac.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[4]
TINY = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
SMALL = ["data.seq_len=40", "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=4"]
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("world")


@dataclass
class Run:
    trainer: Trainer
    state: TrainingState
    checkpointer: Checkpointer

    def train_to(self, step: int) -> list[float]:
        losses = []
        while self.trainer.step < step:
            losses.append(self.trainer.train_step().loss)
        return losses

    def restore(self) -> int:
        self.trainer.step = self.checkpointer.restore(self.state)
        return self.trainer.step


def build(ckpt_dir: Path, *overrides: str) -> Run:
    """The same construction as nemo_ac.train.run, at world size 1."""
    recipe = load_recipe(TINY, [*SMALL, f"checkpoint.dir={ckpt_dir}", "checkpoint.enabled=true", *overrides])
    layout = validate_recipe(recipe, world_size=1)
    setup = build_training(recipe, layout, device=CPU)
    trainer = build_trainer(setup, logger=quiet_logger(recipe))
    checkpointer = Checkpointer(
        config=recipe.checkpoint, total_steps=recipe.train.steps, recipe=to_dict(recipe), device=CPU
    )
    state = TrainingState(model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler, data=setup.data)
    return Run(trainer=trainer, state=state, checkpointer=checkpointer)


def full_params(run: Run) -> dict[str, torch.Tensor]:
    return {
        name.replace("._checkpoint_wrapped_module", ""): p.full_tensor().clone()
        for name, p in run.state.model.named_parameters()
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Four uninterrupted steps with activation checkpointing: the reference curve and final weights."""
    run = build(tmp_path_factory.mktemp("straight"), "activation_checkpointing.mode=full")
    return run.train_to(4), full_params(run)


def test_resume_is_bitwise_and_loads_across_ac_layouts(tmp_path, straight):
    """Saved with AC (wrapped block names), resumed without it: same keys, bitwise the same curve and weights."""
    first = build(tmp_path, "activation_checkpointing.mode=full")
    losses = first.train_to(2)
    first.checkpointer.save(2, first.state)
    keys = FileSystemReader(str(tmp_path / "step_2")).read_metadata().state_dict_metadata
    assert not [k for k in keys if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
    assert "model.model.layers.0.mlp.experts.gate_up_proj" in keys  # HF names, as in an unwrapped model
    assert "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in keys

    torch.manual_seed(999)  # resume must restore the RNG, not keep this
    resumed = build(tmp_path, "activation_checkpointing.mode=none", "checkpoint.resume=auto")
    assert resumed.restore() == 2
    assert resumed.state.data.state_dict() == {"next_step": 2}
    assert resumed.state.scheduler.last_epoch == 2
    losses += resumed.train_to(4)
    reference_losses, reference_params = straight
    assert losses == reference_losses  # bitwise, fp32 on CPU
    final = full_params(resumed)
    assert final.keys() == reference_params.keys()
    for name, tensor in final.items():
        assert torch.equal(tensor, reference_params[name]), name


def test_rng_states_are_restored(tmp_path):
    run = build(tmp_path)
    torch.manual_seed(7)
    run.checkpointer.save(0, run.state)
    expected = torch.rand(4)
    torch.manual_seed(8)
    fresh = build(tmp_path, "checkpoint.resume=auto")
    fresh.restore()
    assert torch.equal(torch.rand(4), expected)


def test_interrupted_save_is_skipped_with_a_warning(tmp_path, monkeypatch):
    """A save that dies after writing shards but before DCP's metadata: never visible, never loaded."""
    run = build(tmp_path, "checkpoint.keep_last=5")
    run.train_to(1)
    run.checkpointer.save(1, run.state)
    run.train_to(2)

    def crash(self, metadata, results):
        raise RuntimeError("simulated crash during checkpoint save")

    with monkeypatch.context() as patch:
        patch.setattr(FileSystemWriter, "finish", crash)
        with pytest.raises(
            CheckpointError, match=r"save of step 2 into .*\.step_2\.partial failed: rank 0: .*simulated crash"
        ):
            run.checkpointer.save(2, run.state)
    partial = files.partial_dir(tmp_path, 2)
    assert any(p.suffix == ".distcp" for p in partial.iterdir())
    assert not (tmp_path / "step_2").exists()
    assert files.read_latest(tmp_path) == "step_1"

    resumed = build(tmp_path, "checkpoint.resume=auto")
    with pytest.warns(CheckpointWarning, match=r"\.step_2\.partial: a save that never finished"):
        assert resumed.restore() == 1

    run.checkpointer.save(2, run.state)  # the next good save of the step replaces the leftover
    assert not partial.exists() and files.read_latest(tmp_path) == "step_2"


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run = build(tmp_path, "checkpoint.keep_last=2", "checkpoint.every_n_steps=1")
    for step in range(1, 4):
        run.train_to(step)
        run.checkpointer.on_step_end(step, run.state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]


def test_save_cadence():
    config = CheckpointConfig(enabled=True, every_n_steps=3, dir="unused")  # nothing is written here
    ckpt = Checkpointer(config=config, total_steps=8, recipe={}, device=CPU)
    assert [s for s in range(1, 9) if ckpt.should_save(s)] == [3, 6, 8]
    config.every_n_steps = 0
    assert [s for s in range(1, 9) if ckpt.should_save(s)] == [8]
    config.enabled = False
    assert not any(ckpt.should_save(s) for s in range(1, 9))


@pytest.fixture
def saved(tmp_path) -> Path:
    run = build(tmp_path)
    run.train_to(1)
    return run.checkpointer.save(1, run.state)


def test_corrupt_shard_fails_naming_the_file(saved):
    shard = sorted(saved.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside tensor bytes: DCP itself would load it silently
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"is corrupt:\n  - {shard}: sha256 .* does not match"):
        build(saved.parent, "checkpoint.resume=auto").restore()


def test_corrupt_metadata_fails_naming_the_file(saved):
    meta = saved / files.DCP_METADATA
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{meta}: 100 bytes, the manifest says"):
        build(saved.parent, "checkpoint.resume=auto", "checkpoint.verify=false").restore()


def test_incompatible_model_fails_naming_key_shapes_and_recipe_change(saved):
    with pytest.raises(CheckpointError) as info:
        build(saved.parent, "checkpoint.resume=auto", "model.hidden_size=32").restore()
    message = str(info.value)
    assert f"checkpoint {saved} does not fit this model/optimizer ({saved / files.DCP_METADATA} vs recipe)" in message
    assert "'model.model.embed_tokens.weight': checkpoint shape (64, 64), model shape (64, 32)" in message
    assert "model.hidden_size: checkpoint 64, recipe 32" in message


def test_fewer_layers_is_incompatible_too(saved):
    with pytest.raises(CheckpointError, match=r"'model\.model\.layers\.1\.[^']*' is in the checkpoint but not in this"):
        build(saved.parent, "checkpoint.resume=auto", "model.num_layers=1").restore()


def test_save_refuses_a_data_position_that_disagrees_with_the_step(tmp_path):
    run = build(tmp_path)
    run.train_to(1)
    with pytest.raises(CheckpointError, match=r"next_step=1 disagrees with the completed step 2"):
        run.checkpointer.save(2, run.state)
    assert not (tmp_path / "step_2").exists()


def test_dcp_errors_are_caught_and_one_line(tmp_path) -> None:
    """DCP's CheckpointException is a BaseException: ``except Exception`` let it escape as a traceback."""
    dcp.save({"w": torch.zeros(262, 32)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(64, 32)}, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert not isinstance(caught.value, Exception) and isinstance(caught.value, DCP_ERRORS)
    text = describe_dcp_error(caught.value)
    assert "\n" not in text and text.startswith("rank 0: ") and "Size mismatch" in text, text
    assert describe_dcp_error(ValueError("a\n  b")) == "ValueError: a b"
