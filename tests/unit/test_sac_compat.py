"""sac_compat: version gate and profiler-op ignore (installed by both SAC factories), on a private copy of torch's set.

Every test here runs against ``private_sac_ignored_ops`` (tests/conftest.py): a copy of ``torch.utils.checkpoint.SAC_IGNORED_OPS``
*without* the profiler ops, monkeypatched in for the test; afterwards the real set must be exactly what it was.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

from nemo_ac.config.schema import ActivationCheckpointingConfig, ModelConfig, MoEConfig, SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed import sac_compat
from nemo_ac.distributed.sac_compat import (
    ensure_profiler_ops_sac_ignored,
    profiler_op_overloads,
    torch_version_release,
)
from nemo_ac.models import build_model
from tests.factories import PROFILER_OPS


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.12.0", (2, 12, 0)),
        ("2.13.0a0+8145d630e8", (2, 13, 0)),
        ("2.13.0", (2, 13, 0)),
        ("2.13.0.dev20260101+cu128", (2, 13, 0)),
        ("2.14.1", (2, 14, 1)),
        ("2.14", (2, 14, 0)),
        ("not-a-version", (0, 0, 0)),
    ],
)
def test_torch_version_release(version, release):
    assert torch_version_release(version) == release


def test_profiler_overloads_are_all_resolved():
    assert set(profiler_op_overloads()) == PROFILER_OPS


@pytest.mark.parametrize(
    ("version", "installs"),
    [("2.12.0", False), ("2.13.0a0+8145d630e8", True), ("2.13.0", True), ("2.14.1", True)],
)
def test_version_gate(private_sac_ignored_ops, version, installs):
    before = set(private_sac_ignored_ops)
    added = ensure_profiler_ops_sac_ignored(torch_version=version)
    if installs:
        assert set(added) == PROFILER_OPS
        assert private_sac_ignored_ops == before | PROFILER_OPS
        assert ensure_profiler_ops_sac_ignored(torch_version=version) == ()  # idempotent
        assert private_sac_ignored_ops == before | PROFILER_OPS
    else:
        assert added == ()
        assert private_sac_ignored_ops == before


def test_noop_when_upstream_already_ignores_them(private_sac_ignored_ops):
    private_sac_ignored_ops.update(PROFILER_OPS)
    before = set(private_sac_ignored_ops)
    assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == ()
    assert private_sac_ignored_ops == before


def test_noop_when_the_set_is_missing(private_sac_ignored_ops):
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(torch_checkpoint, "SAC_IGNORED_OPS")
        assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == ()
    assert private_sac_ignored_ops.isdisjoint(PROFILER_OPS)


def test_noop_when_the_namespace_is_missing(private_sac_ignored_ops, monkeypatch):
    monkeypatch.setattr(sac_compat, "PROFILER_NAMESPACE", "nemo_ac_no_such_namespace")
    before = set(private_sac_ignored_ops)
    assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == ()
    assert private_sac_ignored_ops == before


def test_missing_ops_are_skipped(private_sac_ignored_ops, monkeypatch):
    monkeypatch.setattr(sac_compat, "PROFILER_OP_NAMES", ("_record_function_enter_new", "_no_such_op"))
    assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == (
        torch.ops.profiler._record_function_enter_new.default,
    )


def _moe_model(*, first_k_dense_replace: int) -> torch.nn.Module:
    cfg = ModelConfig(num_layers=3, first_k_dense_replace=first_k_dense_replace, moe=MoEConfig(num_experts=4))
    return build_model(cfg)


def test_generic_factory_installs_the_ignore(private_sac_ignored_ops):
    ac.make_selective_checkpoint_context_fn(config=SelectiveACConfig(), region="r")
    assert private_sac_ignored_ops >= PROFILER_OPS


def test_moe_block_factory_installs_the_ignore(private_sac_ignored_ops):
    ac.make_moe_block_context_fn(config=SelectiveACConfig(), region="model.layers.0")
    assert private_sac_ignored_ops >= PROFILER_OPS


def test_apply_ac_takes_the_moe_path_for_blocks_with_nested_units(private_sac_ignored_ops, monkeypatch):
    """Blocks whose experts are a separate FSDP unit go through make_moe_block_context_fn; dense blocks do not."""
    moe_regions, generic_regions = [], []
    moe_factory, generic_factory = ac.make_moe_block_context_fn, ac.make_selective_checkpoint_context_fn

    def spy_moe(**kwargs):
        moe_regions.append(kwargs["region"])
        return moe_factory(**kwargs)

    def spy_generic(**kwargs):
        generic_regions.append(kwargs["region"])
        return generic_factory(**kwargs)

    monkeypatch.setattr(ac, "make_moe_block_context_fn", spy_moe)
    monkeypatch.setattr(ac, "make_selective_checkpoint_context_fn", spy_generic)
    model = _moe_model(first_k_dense_replace=1)
    config = ActivationCheckpointingConfig(mode="selective")
    ac.apply_ac(model, config=config, moe=model.config.moe)
    assert moe_regions == ["model.layers.1", "model.layers.2"]
    assert generic_regions[0] == "model.layers.0"  # (the MoE factory builds on the generic one after its install)
    assert private_sac_ignored_ops >= PROFILER_OPS


def test_workarounds_off_installs_nothing(private_sac_ignored_ops):
    before = set(private_sac_ignored_ops)
    model = _moe_model(first_k_dense_replace=0)
    config = ActivationCheckpointingConfig(mode="selective", workarounds=False)
    ac.apply_ac(model, config=config, moe=model.config.moe)
    ac.make_selective_checkpoint_context_fn(workarounds=False)
    assert private_sac_ignored_ops == before


def test_full_and_none_modes_do_not_touch_the_set(private_sac_ignored_ops):
    before = set(private_sac_ignored_ops)
    for mode in ("none", "full"):
        model = _moe_model(first_k_dense_replace=0)
        ac.apply_ac(model, config=ActivationCheckpointingConfig(mode=mode), moe=model.config.moe)
    assert private_sac_ignored_ops == before


@pytest.mark.parametrize(("version", "supported"), [("2.11.0", False), ("2.12.0", True), ("2.13.0a0+abc", True)])
def test_fsdp_hook_bracket_gate(version, supported):
    assert sac_compat.fsdp_hooks_outside_sac_supported(torch_version=version) is supported
