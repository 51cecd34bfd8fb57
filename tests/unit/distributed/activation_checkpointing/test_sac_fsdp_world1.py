"""The torch 2.13 SAC desync in one process (gloo world size 1, a real process group): observed, then fixed.

A block with a nested ``fully_shard`` unit whose output is NOT the block output (an op follows it), SAC-checkpointed,
root unit outside: FSDP2's pre-backward hook for the nested unit has not fired when the block recomputes, so its
hooks run inside the recompute with another profiler-op count than in forward.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.diagnostics.sac_explain import SACDesyncError
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.doctor.probes_sac import NestedUnitNet, shard_nested_unit_net
from nemo_ac.models.init import canonical_name, materialize_and_init
from nemo_ac.trainer.build import build_parallel_model
from nemo_ac.trainer.loop import run_backward
from nemo_ac.workarounds.fsdp_hooks_in_sac import (
    fsdp_hook_running,
    install_fsdp_hooks_outside_sac,
    remove_fsdp_hooks_outside_sac,
)
from nemo_ac.workarounds.profiler_ops_in_sac import ensure_profiler_ops_sac_ignored
from tests.factories import PROFILER_OPS, unfixed_selective_context_fn
from tests.launch import RECIPES

# Every test runs on a private copy of torch's SAC_IGNORED_OPS (the real set stays untouched).
pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("world", "private_sac_ignored_ops")]

DOCUMENTED = re.compile(
    r"profiler\._record_function_enter_new\.default invocation index \d+ encountered during backward "
    r"but not found in storage"
)


def _sharded(context_fn=None) -> NestedUnitNet:
    """The doctor's nested-unit model (nemo_ac.doctor.probes_sac): nested units, then the root, no block units."""
    return shard_nested_unit_net(NestedUnitNet(num_blocks=2, context_fn=context_fn), device=torch.device("cpu"))


def _grads(net: NestedUnitNet, *, on_thread: bool = False) -> dict[str, torch.Tensor]:
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    run_backward(net(x).square().mean(), on_thread=on_thread)
    return {name: p.grad.full_tensor().clone() for name, p in net.named_parameters()}


def _save_mm(ctx, op, *args, **kwargs):
    return (
        torch_checkpoint.CheckpointPolicy.MUST_SAVE
        if op is torch.ops.aten.mm.default
        else (torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)
    )


def test_torch_raises_the_documented_error():
    """Plain torch SAC (no nemo_ac code at all): the failure this project exists for."""
    net = _sharded(functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _save_mm))
    with pytest.raises(RuntimeError, match=DOCUMENTED):
        _grads(net)


def test_workarounds_off_raises_the_documented_error_explained():
    net = _sharded(unfixed_selective_context_fn(region="blocks"))
    with pytest.raises(SACDesyncError) as info:
        _grads(net)
    assert DOCUMENTED.search(str(info.value.__cause__)), info.value.__cause__
    assert info.value.op == "profiler._record_function_enter_new.default"
    assert info.value.origin.kind == "profiler" and "profiler op: True" in str(info.value)
    assert "region 'blocks'" in str(info.value) and torch.__version__ in str(info.value)


@pytest.mark.parametrize("on_thread", [False, True], ids=["same_thread", "backward_thread"])
def test_workarounds_on_backward_succeeds_and_matches_no_ac(on_thread):
    expected = _grads(_sharded())
    net = _sharded(ac.make_selective_checkpoint_context_fn(region="blocks"))
    assert install_fsdp_hooks_outside_sac(net) == 3  # two nested units and the root
    got = _grads(net, on_thread=on_thread)
    assert torch_checkpoint.SAC_IGNORED_OPS >= PROFILER_OPS
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fix", ["profiler_ignore_only", "fsdp_hooks_outside_only"])
def test_each_workaround_alone_fixes_the_world1_case(fix):
    """At world size 1 the mismatch is only the profiler ops, so either mechanism suffices (with explicit
    prefetch on 2 ranks only the FSDP-hook bracket does: tests/functional/test_sac_layouts.py)."""
    net = _sharded(unfixed_selective_context_fn(region="blocks"))
    if fix == "profiler_ignore_only":
        ensure_profiler_ops_sac_ignored()
    else:
        install_fsdp_hooks_outside_sac(net)
    _grads(net)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((str(func), fsdp_hook_running()))
        return func(*args, **(kwargs or {}))


def test_brackets_enclose_exactly_fsdps_hooks():
    """Every op dispatched by FSDP2's forward hooks (its record_function ranges, its copy-in) is inside a bracket;
    every op of the model's own forward (the linears) is outside. Removing the brackets restores plain FSDP."""
    net = _sharded()
    install_fsdp_hooks_outside_sac(net)
    assert install_fsdp_hooks_outside_sac(net) == 0  # idempotent
    recorder = _Recorder()
    with recorder:
        net(torch.randn(5, 12))
    profiler = [inside for op, inside in recorder.seen if op.startswith("profiler.")]
    model_ops = [inside for op, inside in recorder.seen if op in ("aten.addmm.default", "aten.relu.default")]
    assert profiler and all(profiler), recorder.seen
    assert len(model_ops) == 8 and not any(model_ops), recorder.seen  # 2 blocks x (3 linears + relu)
    assert not fsdp_hook_running()
    assert remove_fsdp_hooks_outside_sac(net) == 3
    recorder = _Recorder()
    with recorder:
        net(torch.randn(5, 12))
    assert not any(inside for _, inside in recorder.seen)


def _tiny_model(overrides: list[str]):
    recipe = load_recipe(str(RECIPES / "tiny" / "qwen3_moe_tiny.yaml"), ["data.seq_len=40", *overrides])
    layout = validate_recipe(recipe, world_size=1)
    model, _, _ = build_parallel_model(recipe, layout, device=torch.device("cpu"))
    materialize_and_init(model, device="cpu", seed=3)
    return model


def _model_grads(model) -> dict[str, torch.Tensor]:
    from nemo_ac.models.layers.attention import build_attention_inputs

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 40), generator=gen)
    docs = torch.cat([torch.zeros(2, 17, dtype=torch.long), torch.ones(2, 23, dtype=torch.long)], dim=1)
    positions = torch.cat([torch.arange(17), torch.arange(23)]).expand(2, -1)
    out = model(ids, position_ids=positions, attn=build_attention_inputs(docs))
    (out.logits.float().square().mean() + sum(s.prob_sum.sum() for s in out.router_stats) * 1e-3).backward()
    return {canonical_name(n): p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_tiny_qwen3_moe_through_parallelize():
    """The production path (parallelize: selective AC, nested expert unit, then FSDP + brackets) at world size 1:
    workarounds off -> the documented error, explained with the block name; on -> grads equal to no AC."""
    expected = _model_grads(_tiny_model(["activation_checkpointing.mode=none"]))
    broken = _tiny_model(["activation_checkpointing.mode=selective", "activation_checkpointing.workarounds=false"])
    with pytest.raises(SACDesyncError) as info:
        _model_grads(broken)
    assert DOCUMENTED.search(str(info.value.__cause__)) and info.value.region.startswith("model.layers.")
    assert torch_checkpoint.SAC_IGNORED_OPS.isdisjoint(PROFILER_OPS)
    fixed = _model_grads(_tiny_model(["activation_checkpointing.mode=selective"]))
    assert fixed.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(fixed[name], grad, rtol=0, atol=0, msg=name)
