"""nemo_ac.compat: install() is gated, idempotent and reversible; the region helpers work with plain torch
checkpointing and with checkpoint_wrapper on a real world-size-1 FSDP2 model.

Every test leaves torch's real SAC_IGNORED_OPS as it found it (checked by ``real_sac_set_untouched``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from nemo_ac import compat
from nemo_ac.diagnostics.sac_explain import SACDesyncError
from nemo_ac.doctor.isolation import on_thread, private_sac_ignored_ops
from nemo_ac.doctor.probes_sac import (
    PROFILER_DESYNC,
    NestedUnitNet,
    nested_unit_grads,
    save_matmuls,
    shard_nested_unit_net,
)
from nemo_ac.doctor.probes_thread import FORWARD_CONFIG, _read_config
from nemo_ac.workarounds.profiler_ops_in_sac import profiler_op_overloads
from tests.launch import ROOT, child_env

pytestmark = pytest.mark.workaround  # the torch-release regression subset (scripts/test_torch.sh)

CPU = torch.device("cpu")
PROFILER_OPS = set(profiler_op_overloads())


@pytest.fixture(autouse=True)
def real_sac_set_untouched():
    real = torch_checkpoint.SAC_IGNORED_OPS
    before = set(real)
    yield
    assert torch_checkpoint.SAC_IGNORED_OPS is real and real == before, "a test changed torch's SAC_IGNORED_OPS"


def test_importing_changes_no_torch_state():
    """A fresh interpreter: SAC_IGNORED_OPS and every Dynamo / compiler config value are the same after importing
    nemo_ac.compat, its Automodel helper and the doctor."""
    code = """
import json, torch, torch.utils.checkpoint as tc
def state():
    return {"sac": sorted(map(str, tc.SAC_IGNORED_OPS)),
            "dynamo": repr(sorted(torch._dynamo.config._get_dict().items())),
            "compiler": repr(sorted(torch.compiler.config._get_dict().items()))}
before = state()
import nemo_ac.compat, nemo_ac.compat.automodel, nemo_ac.doctor.runner
print(json.dumps({"same": before == state(), "sac": len(before["sac"])}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["same"] is True


def test_install_is_gated_idempotent_and_reversible():
    with private_sac_ignored_ops(upstream_only=True) as ignored:
        base = set(ignored)
        assert compat.status().profiler_ops == "missing"
        assert compat.install(torch_version="2.12.0").profiler_ops == "not_needed"
        assert ignored == base
        first = compat.install()
        assert first.profiler_ops == "added" and len(first.added_ops) == len(PROFILER_OPS) == 4
        assert ignored == base | PROFILER_OPS
        again = compat.install()
        assert again.profiler_ops == "installed" and again.added_ops == ()
        assert compat.uninstall() == 4 and ignored == base
        assert compat.uninstall() == 0


def test_installed_restores_the_exact_set_even_after_others_added_to_it():
    sentinel = torch.ops.aten.sin.default
    with private_sac_ignored_ops(upstream_only=True) as ignored:
        base = set(ignored)
        with compat.installed() as state:
            assert state.profiler_ops == "added" and ignored >= PROFILER_OPS
            ignored.add(sentinel)  # e.g. another library's SAC factory
        assert ignored == base


def test_installed_on_the_real_set():
    with compat.installed() as state:
        assert PROFILER_OPS <= torch_checkpoint.SAC_IGNORED_OPS
        assert state.fsdp_units_need_protection and state.recompute_needs_thread_context
    # real_sac_set_untouched checks the restore


def _wrapped_net(context_fn, *, protect: bool) -> NestedUnitNet:
    """checkpoint_wrapper (torchtitan style) around each block instead of NestedUnitNet's own checkpoint call."""
    net = NestedUnitNet(num_blocks=2)
    for index, block in enumerate(net.layers):
        net.layers[index] = checkpoint_wrapper(block, context_fn=context_fn)
    shard_nested_unit_net(net, device=CPU)
    if protect:
        assert compat.protect_fsdp_units(net) == 3  # two nested units and the root
        assert compat.protect_fsdp_units(net) == 0
    return net


@pytest.mark.parametrize("policy", ["user_policy", "policy_factory", "nemo_default_policy"])
def test_selective_context_fn_with_checkpoint_wrapper(world, policy):
    """Without install() and without protection the nested unit desyncs (as SACDesyncError naming the region);
    protect_fsdp_units alone fixes the world-size-1 case for these modes; gradients equal no-AC exactly."""
    expected = nested_unit_grads(shard_nested_unit_net(NestedUnitNet(num_blocks=2), device=CPU), device=CPU)
    kwargs = {
        "user_policy": {"policy": save_matmuls},
        "policy_factory": {"policy_factory": lambda: save_matmuls},
        "nemo_default_policy": {},
    }[policy]
    context_fn = compat.selective_checkpoint_context_fn(region="block", **kwargs)
    with private_sac_ignored_ops(upstream_only=True):
        with pytest.raises(SACDesyncError, match="region 'block'") as info:
            nested_unit_grads(_wrapped_net(context_fn, protect=False), device=CPU)
        assert PROFILER_DESYNC.search(str(info.value.__cause__))
        got = nested_unit_grads(_wrapped_net(context_fn, protect=True), device=CPU)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_protect_before_fully_shard_raises_and_unprotect_restores():
    net = NestedUnitNet(num_blocks=1)
    with pytest.raises(RuntimeError, match="after fully_shard"):
        compat.protect_fsdp_units(net)
    assert compat.protect_fsdp_units(net, torch_version="2.11.0") == 0  # below the verified releases: no-op


def test_protect_then_unprotect(world):
    net = shard_nested_unit_net(NestedUnitNet(num_blocks=1), device=CPU)
    assert compat.protect_fsdp_units(net) == 2
    assert compat.unprotect_fsdp_units(net) == 2
    assert compat.protect_fsdp_units(net) == 2


def test_policy_and_policy_factory_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        compat.selective_checkpoint_context_fn(policy=save_matmuls, policy_factory=lambda: save_matmuls)


class _Reader(torch.nn.Module):
    """Records the compile config of the thread running its forward (forward and recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_read_config())
        return self.linear(x).sin()


@pytest.mark.parametrize("added", [False, True], ids=["wrapper_only", "add_recompute_context"])
def test_add_recompute_context_reaches_a_wrapper_built_elsewhere(added):
    """A trainer's own checkpoint_wrapper with its SAC context: add_recompute_context composes the forward-thread
    context in, so the recompute on another thread sees the forward thread's Dynamo config."""
    reader = _Reader()
    model = torch.nn.Sequential(checkpoint_wrapper(reader, context_fn=compat.selective_checkpoint_context_fn()))
    if added:
        assert compat.add_recompute_context(model) == 1
    with torch._dynamo.config.patch(**FORWARD_CONFIG):
        out = model(torch.randn(3, 4, requires_grad=True))
    on_thread(out.sum().backward)
    forward, recompute = reader.seen
    assert recompute[0] != forward[0]
    assert (recompute[1:] == forward[1:]) is added


def test_with_forward_thread_compile_context_is_a_mode_pair_under_compile():
    """compile(checkpoint(...)): torch requires a TorchDispatchMode pair; the composed factory gives the SAC pair."""
    torch._dynamo.reset()

    def f(x, w):
        return torch.tanh(torch.tanh(x @ w) @ w)

    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))
    context_fn = compat.selective_checkpoint_context_fn(policy=save_matmuls, compile_context=True)
    compiled = torch.compile(
        lambda x, w: torch_checkpoint.checkpoint(f, x, w, use_reentrant=False, context_fn=context_fn),
        backend="aot_eager",
    )
    torch.testing.assert_close(torch.autograd.grad(compiled(x, w).sum(), (x, w)), expected)
    torch._dynamo.reset()
