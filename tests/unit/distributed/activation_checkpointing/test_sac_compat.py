"""workarounds.profiler_ops_in_sac / fsdp_hooks_in_sac: version gates and the profiler-op ignore (installed by the
SAC context factory), on a private copy of torch's set.

Every test here runs against ``private_sac_ignored_ops`` (tests/conftest.py): a copy of ``torch.utils.checkpoint.SAC_IGNORED_OPS``
*without* the profiler ops, monkeypatched in for the test; afterwards the real set must be exactly what it was.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

from nemo_ac import compat
from nemo_ac.config.schema import ActivationCheckpointingConfig, ModelConfig, MoEConfig, SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed.activation_checkpointing import wrapping
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.workarounds import fsdp_hooks_in_sac, profiler_ops_in_sac
from nemo_ac.workarounds.gates import torch_version_release
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored, profiler_op_overloads
from tests.factories import PROFILER_OPS, unfixed_selective_context_fn

pytestmark = pytest.mark.workaround  # the torch-release regression subset (scripts/test_torch.sh)


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
    [("2.12.0", False), ("2.13.0a0+8145d630e8", True), ("2.13.0", True), ("2.14.1", True), ("2.15.0", True)],
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
    monkeypatch.setattr(profiler_ops_in_sac, "PROFILER_NAMESPACE", "nemo_ac_no_such_namespace")
    before = set(private_sac_ignored_ops)
    assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == ()
    assert private_sac_ignored_ops == before


def test_missing_ops_are_skipped(private_sac_ignored_ops, monkeypatch):
    monkeypatch.setattr(profiler_ops_in_sac, "PROFILER_OP_NAMES", ("_record_function_enter_new", "_no_such_op"))
    assert ensure_profiler_ops_sac_ignored(torch_version="2.13.0") == (
        torch.ops.profiler._record_function_enter_new.default,
    )


def _moe_model(*, first_k_dense_replace: int) -> torch.nn.Module:
    cfg = ModelConfig(num_layers=3, first_k_dense_replace=first_k_dense_replace, moe=MoEConfig(num_experts=4))
    return build_model(cfg)


def test_factory_installs_the_ignore(private_sac_ignored_ops):
    ac.make_selective_checkpoint_context_fn(config=SelectiveACConfig(), region="r")
    assert private_sac_ignored_ops >= PROFILER_OPS


def _apply_ac(model: torch.nn.Module, config: ActivationCheckpointingConfig):
    plan = decide_plan(model, activation_checkpointing=config)
    ac.apply_ac(model, plan=plan)
    return plan


def test_apply_ac_gives_every_block_one_factory_and_moe_blocks_their_nested_units(private_sac_ignored_ops, monkeypatch):
    """One SAC context factory for every block, each region named by its path; the plan marks the MoE blocks whose
    experts are their own FSDP unit (the layout whose FSDP2 hooks run inside the region), and apply_ac installs the
    profiler-op ignore the plan switches on."""
    regions = []
    factory = wrapping.sac_region_context_fn

    def spy(policy_factory, **kwargs):
        regions.append(kwargs["region"])
        return factory(policy_factory, **kwargs)

    monkeypatch.setattr(wrapping, "sac_region_context_fn", spy)
    model = _moe_model(first_k_dense_replace=1)
    plan = _apply_ac(model, ActivationCheckpointingConfig(mode="selective"))
    assert regions == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert [b.nested_units for b in plan.decoder_blocks()] == [(), ("experts",), ("experts",)]
    assert private_sac_ignored_ops >= PROFILER_OPS


def test_two_factories_and_no_failure_switch_in_production():
    """nemo_ac's factory takes its policy config and a region name; compat's takes another trainer's policy. Neither
    can switch the fix off: the un-fixed context that shows the torch failure is a test helper."""
    assert list(inspect.signature(ac.make_selective_checkpoint_context_fn).parameters) == ["config", "region"]
    compat_parameters = inspect.signature(compat.selective_checkpoint_context_fn).parameters
    assert list(compat_parameters) == ["policy", "policy_factory", "config", "region", "compile_context"]


def test_workarounds_off_installs_nothing(private_sac_ignored_ops):
    before = set(private_sac_ignored_ops)
    model = _moe_model(first_k_dense_replace=0)
    config = ActivationCheckpointingConfig(mode="selective", workarounds=False)
    _apply_ac(model, config)
    unfixed_selective_context_fn()
    assert private_sac_ignored_ops == before


def test_full_and_none_modes_do_not_touch_the_set(private_sac_ignored_ops):
    before = set(private_sac_ignored_ops)
    for mode in ("none", "full"):
        model = _moe_model(first_k_dense_replace=0)
        _apply_ac(model, ActivationCheckpointingConfig(mode=mode))
    assert private_sac_ignored_ops == before


@pytest.mark.parametrize(
    ("version", "supported"),
    [("2.11.0", False), ("2.12.1", False), ("2.13.0a0+abc", True), ("2.14.1", True), ("2.15.0", True)],
)
def test_fsdp_hook_bracket_gate(version, supported):
    """On from 2.13, where SAC replays the recompute by invocation index (2.12.1: not affected, doctor)."""
    assert fsdp_hooks_in_sac.fsdp_hooks_outside_sac_supported(torch_version=version) is supported
