"""``extensions.allow``: a recipe's ``_target_`` (train.optimizer, train.scheduler, data.source) may name a user
module under a listed prefix; without the entry it is refused before anything is imported, naming the key.

The user module is a real package written to tmp_path and put on sys.path (PYTHONPATH for the training run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nemo_ac.config import ConfigError, load_recipe, validate_recipe
from nemo_ac.config.targets import resolve_target
from nemo_ac.data.batch import PackedBatch
from nemo_ac.data.sources import build_batches
from nemo_ac.trainer.metrics import step_records
from nemo_ac.trainer.optim import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
PKG = "nemo_ac_user_ext"  # no installed package has this name

USER_MODULE = '''
"""A user's optimizer, scheduler and batch source, as a recipe's _target_ entries name them."""

import torch

from nemo_ac.data.loader import SyntheticBatches


class ScaledSGD(torch.optim.SGD):
    """SGD whose lr is the recipe's train.lr times ``scale``."""

    def __init__(self, params, lr, scale=1.0, momentum=0.0):
        super().__init__(params, lr=lr * scale, momentum=momentum)
        self.scale = scale


def constant(optimizer, factor=1.0):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor)


class TaggedBatches(SyntheticBatches):
    """The synthetic stream, recording which steps the loop asked for in ``marker`` (one line per step)."""

    def __init__(self, data_cfg, *, tag, marker=None, **kwargs):
        super().__init__(data_cfg, **kwargs)
        self.tag, self.marker = tag, marker

    def batches_for_step(self, step):
        if self.marker:
            with open(self.marker, "a") as f:
                f.write(f"{self.tag} {step} {self.dp_rank}/{self.dp_size}\\n")
        return super().batches_for_step(step)


def not_a_source(data_cfg, **kwargs):
    return object()
'''

ALL_THREE = [
    f"+train.optimizer._target_={PKG}.parts.ScaledSGD",
    "+train.optimizer.scale=0.5",
    f"+train.scheduler._target_={PKG}.parts.constant",
    "+train.scheduler.factor=0.25",
    f"+data.source._target_={PKG}.parts.TaggedBatches",
    "+data.source.tag=user-data",
]
KEYS = ["train.optimizer._target_", "train.scheduler._target_", "data.source._target_"]


@pytest.fixture
def user_package(tmp_path, monkeypatch) -> Path:
    package = tmp_path / "site" / PKG
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "parts.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(package.parent))
    yield package.parent
    for name in [name for name in sys.modules if name.split(".")[0] == PKG]:
        del sys.modules[name]


def _batches(recipe, extensions):
    return build_batches(
        recipe.data,
        vocab_size=recipe.model.vocab_size,
        vision=recipe.model.vision,
        global_batch_size=recipe.train.global_batch_size,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=recipe.train.seed,
        extensions=extensions,
    )


@pytest.mark.parametrize("prefix", [f"{PKG}.", f"{PKG}.parts"], ids=["package_prefix", "module_path"])
def test_allowed_user_module_instantiates_optimizer_scheduler_and_dataset(user_package, prefix):
    recipe = load_recipe(TINY, [*ALL_THREE, f"extensions.allow=[{prefix}]"])
    validate_recipe(recipe, world_size=1)
    allow = recipe.extensions.allow
    assert allow == [prefix]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, recipe.train, device_type="cpu", extensions=allow)
    assert type(optimizer).__module__ == f"{PKG}.parts" and type(optimizer).__name__ == "ScaledSGD"
    # The parameter groups (decay / no decay) and train.lr arrive; the recipe's extra key too.
    assert [group["weight_decay"] for group in optimizer.param_groups] == [recipe.train.weight_decay, 0.0]
    assert optimizer.scale == 0.5
    scheduler = build_scheduler(optimizer, recipe.train, extensions=allow)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(recipe.train.lr * 0.5 * 0.25)
    data = _batches(recipe, allow)
    assert type(data).__name__ == "TaggedBatches" and data.tag == "user-data"
    micro_batches = next(data)
    assert data.next_step == 1 and data.state_dict() == {"next_step": 1}
    assert len(micro_batches) == recipe.train.global_batch_size // recipe.train.micro_batch_size
    assert isinstance(micro_batches[0], PackedBatch)
    assert micro_batches[0].input_ids.shape == (recipe.train.micro_batch_size, recipe.data.seq_len)


def test_user_module_is_refused_without_its_prefix_and_never_imported(user_package):
    recipe = load_recipe(TINY, ALL_THREE)
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe, world_size=1)
    refused = [issue for issue in info.value.issues if issue.key in KEYS]
    assert [issue.key for issue in refused] == KEYS
    for issue in refused:
        assert "is outside the allowed module prefixes ['torch.optim.', 'nemo_ac.']" in issue.message
        assert f"add its prefix to extensions.allow (e.g. extensions.allow: ['{PKG}.'])" in issue.message
    # The import site checks again (a caller that skipped validation), before importing anything.
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"train.optimizer._target_: .*add its prefix to extensions.allow"):
        build_optimizer(model, recipe.train, device_type="cpu")
    with pytest.raises(ConfigError, match=r"data.source._target_: .*add its prefix to extensions.allow"):
        _batches(recipe, [f"{PKG}.other"])
    assert PKG not in sys.modules


def test_module_path_prefix_is_not_a_string_prefix(user_package):
    with pytest.raises(ConfigError, match="outside the allowed module prefixes"):
        resolve_target(f"{PKG}.parts.ScaledSGD", key="k", allow=[f"{PKG}.par"])
    assert resolve_target(f"{PKG}.parts.ScaledSGD", key="k", allow=[f"{PKG}.parts"]).__name__ == "ScaledSGD"


def test_a_source_without_the_batch_interface_is_an_error_naming_the_key(user_package):
    recipe = load_recipe(TINY, [f"+data.source._target_={PKG}.parts.not_a_source", f"extensions.allow=[{PKG}.]"])
    validate_recipe(recipe, world_size=1)
    with pytest.raises(TypeError, match=r"data.source._target_: .* returned a object without batches_for_step"):
        _batches(recipe, recipe.extensions.allow)


def test_an_unimportable_allowed_module_names_the_key_and_pythonpath():
    with pytest.raises(ConfigError, match=r"data.source._target_: cannot import .*on PYTHONPATH on every node"):
        resolve_target("no_such_pkg_xyz.mod.Batches", key="data.source._target_", allow=["no_such_pkg_xyz."])


def test_training_runs_on_the_user_optimizer_scheduler_and_dataset(user_package, tmp_path):
    """The real entry (python -m nemo_ac.train, a world of one) trains two steps on the user's three extensions."""
    marker = tmp_path / "batches.txt"
    run_dir = tmp_path / "run"
    overrides = [
        *ALL_THREE,
        f"+data.source.marker={marker}",
        f"extensions.allow=[{PKG}.]",
        "train.steps=2",
        "train.warmup_steps=0",
        "activation_checkpointing.mode=none",
        f"logging.run_dir={run_dir}",
        "logging.progress_bar=never",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_package), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_ac.train", str(TINY), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker.read_text().splitlines() == ["user-data 0 0/1", "user-data 1 0/1"]
    records = step_records(run_dir / "metrics.jsonl")  # the run's step records, without its start marker
    assert len(records) == 2
    assert all(record["lr"] == pytest.approx(0.006 * 0.5 * 0.25) for record in records)
