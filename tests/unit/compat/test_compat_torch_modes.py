"""``compat.protect_fsdp_units`` with another trainer's SAC regions built from torch's own modes: the brackets
cannot take effect there, so it says so (a warning naming the fix) instead of doing nothing silently."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from nemo_ac import compat
from nemo_ac.doctor.probes_sac import NestedUnitNet, save_matmuls, shard_nested_unit_net, torch_sac_context_fn
from nemo_ac.workarounds import fsdp_hooks_in_sac

pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("world", "private_sac_ignored_ops")]


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(fsdp_hooks_in_sac, "_WARNED", [])


def _run(net: torch.nn.Module) -> None:
    net(torch.randn(5, 12)).square().mean().backward()


def test_a_checkpoint_call_with_torch_modes_is_reported_when_a_protected_unit_runs_inside_it():
    net = shard_nested_unit_net(NestedUnitNet(num_blocks=2, context_fn=torch_sac_context_fn()), device="cpu")
    compat.install()
    assert compat.protect_fsdp_units(net) == 3  # nothing to see yet: the regions are checkpoint() calls
    with pytest.warns(compat.UnprotectedFSDPUnitWarning, match=r"selective_checkpoint_context_fn\(policy="):
        _run(net)
    compat.unprotect_fsdp_units(net)


def test_the_same_policy_in_nemo_acs_modes_is_silent():
    context_fn = compat.selective_checkpoint_context_fn(policy=save_matmuls)
    net = shard_nested_unit_net(NestedUnitNet(num_blocks=2, context_fn=context_fn), device="cpu")
    compat.install()
    compat.protect_fsdp_units(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.UnprotectedFSDPUnitWarning)
        _run(net)
    compat.unprotect_fsdp_units(net)


class _Wrapped(torch.nn.Module):
    def __init__(self, context_fn) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            checkpoint_wrapper(
                torch.nn.Linear(8, 8),
                checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                checkpoint_fn=functools.partial(checkpoint, use_reentrant=False),
                context_fn=context_fn,
            )
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_checkpoint_wrappers_with_torch_modes_are_named_when_protecting():
    torch_modes = _Wrapped(functools.partial(create_selective_checkpoint_contexts, save_matmuls))
    for layer in torch_modes.layers:
        fully_shard(layer)
    fully_shard(torch_modes)
    assert compat.regions_with_torch_sac_modes(torch_modes) == ["layers.0", "layers.1"]
    with pytest.warns(compat.UnprotectedFSDPUnitWarning, match=r"checkpoint of layers\.0, layers\.1 builds"):
        compat.protect_fsdp_units(torch_modes)
    compat.unprotect_fsdp_units(torch_modes)

    ours = _Wrapped(compat.selective_checkpoint_context_fn(policy=save_matmuls))
    fully_shard(ours)
    assert compat.regions_with_torch_sac_modes(ours) == []


def test_the_compiled_region_wrapping_is_exposed():
    kwargs = compat.ac_outer_compile_kwargs({"backend": "inductor", "options": {"max_autotune": False}})
    assert kwargs["options"] == {"max_autotune": False, "wrap_inductor_compiled_regions": True}
    assert compat.ac_outer_compile_kwargs({"backend": "aot_eager"}) == {"backend": "aot_eager"}
