"""The selective policy: what it saves, that its decisions are per region, its debug log, and how contexts compose."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed.fsdp  # registers the fsdp:: ops
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from nemo_ac.config.schema import ActivationCheckpointingConfig, ModelConfig, SelectiveACConfig
from nemo_ac.diagnostics.sac_explain import SAC_DEBUG_ENV, reset_decision_log
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed.activation_checkpointing import PolicyRules, SelectivePolicy
from nemo_ac.distributed.activation_checkpointing.policy import matmul_flops_per_byte
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.layers.routing_replay import routing_replay_context

# Every test runs on a private copy of torch's SAC_IGNORED_OPS (the real set stays untouched).
pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("private_sac_ignored_ops")]

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _policy(**config) -> SelectivePolicy:
    return SelectivePolicy(rules=PolicyRules.build(SelectiveACConfig(**config)), region="r")


def _decisions(policy: SelectivePolicy, ops, *, is_recompute: bool = False) -> list[CheckpointPolicy]:
    return [policy.decide(op, is_recompute=is_recompute)[0] for op in ops]


def test_every_other_matmul_and_counters_restart_per_region():
    """``matmul_min_flops_per_byte: 0``: torchtitan's rule, every other matmul saved."""
    ops = [aten.mm.default, aten.relu.default, aten.addmm.default, aten.mm.default, aten.bmm.default]
    first = _decisions(_policy(matmul_min_flops_per_byte=0), ops)
    assert first == [SAVE, RECOMPUTE, RECOMPUTE, SAVE, RECOMPUTE]
    # A new region (the next block, the next micro batch) starts its own count: same ops, same decisions.
    assert _decisions(_policy(matmul_min_flops_per_byte=0), ops) == first
    assert _decisions(_policy(save_every_other_mm=False), ops) == [SAVE, RECOMPUTE, SAVE, SAVE, SAVE]


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


# (op, args, FLOPs per byte of output): 2 x contraction width / output element size.
MATMULS = [
    ("q projection, hidden 2048, bf16", aten.mm.default, (_meta(40, 2048), _meta(2048, 4096)), 2048),
    (
        "same in fp32",
        aten.mm.default,
        (_meta(40, 2048, dtype=torch.float32), _meta(2048, 4096, dtype=torch.float32)),
        1024,
    ),
    ("biased projection, hidden 4096", aten.addmm.default, (_meta(4096), _meta(40, 4096), _meta(4096, 256)), 4096),
    ("expert gate/up, hidden 2048", aten._grouped_mm.default, (_meta(48, 2048), _meta(4, 2048, 1024), None), 2048),
    ("expert down, expert width 512", aten._grouped_mm.default, (_meta(48, 512), _meta(4, 512, 2048), None), 512),
    ("batched, K 64", aten.bmm.default, (_meta(3, 40, 64), _meta(3, 64, 40)), 64),
]


@pytest.mark.parametrize(("what", "op", "args", "ratio"), MATMULS, ids=[m[0] for m in MATMULS])
def test_matmuls_saved_by_flops_per_byte_held(what, op, args, ratio):
    """The default saves a matmul when its recompute costs >= matmul_min_flops_per_byte (2048) FLOPs per byte held,
    whatever its position in the region; save_every_other_mm: false still saves every one."""
    assert matmul_flops_per_byte(op, args) == ratio
    decision, reason = _policy().decide(op, args=args)
    assert decision is (SAVE if ratio >= 2048 else RECOMPUTE), reason
    assert _policy(matmul_min_flops_per_byte=ratio + 1).decide(op, args=args)[0] is RECOMPUTE
    assert _policy(save_every_other_mm=False, matmul_min_flops_per_byte=ratio + 1).decide(op, args=args)[0] is SAVE
    # The same op twice in a row: the same decision (no counter), unlike the every-other rule.
    policy = _policy()
    assert policy.decide(op, args=args)[0] is policy.decide(op, args=args)[0]


def test_recompute_pass_counts_on_its_own():
    """Releases that call the policy in recompute too get the same sequence there (torch 2.13 does not call it)."""
    policy = _policy(matmul_min_flops_per_byte=0)
    ops = [aten.mm.default] * 3
    forward = _decisions(policy, ops)
    assert _decisions(policy, ops, is_recompute=True) == forward == [SAVE, RECOMPUTE, SAVE]


@pytest.mark.parametrize(
    "op",
    [aten.copy_.default, aten.scatter_.src, aten.index_put_.default, aten.split_with_sizes_copy.out, aten.add_.Tensor],
)
def test_mutating_ops_are_never_saved(op):
    """A cached replay would return the old output without mutating the recomputed input (e.g. FSDP's copy-out
    filling unsharded params, inverse_permutation's scatter_)."""
    assert _policy().decide(op)[0] is RECOMPUTE


@pytest.mark.parametrize(
    "op",
    [
        torch.ops.fsdp.all_gather_copy_in.default,
        torch.ops.c10d._allgather_base_.default,
        torch.ops.profiler._record_function_enter_new.default,
    ],
)
def test_fsdp_and_profiler_ops_are_never_cached(op):
    decision, reason = _policy().decide(op)
    assert decision is RECOMPUTE and "never cached" in reason


NEVER_CACHED = [
    aten.copy_.default,
    aten.scatter_.src,
    aten.index_put_.default,
    aten.split_with_sizes_copy.out,
    aten.add_.Tensor,
    torch.ops.fsdp.all_gather_copy_in.default,
    torch.ops.fsdp.split_with_sizes_copy.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
]


@pytest.mark.parametrize("op", NEVER_CACHED, ids=str)
def test_ops_nemo_ac_never_caches_carry_no_ordered_effect_torch_would_cache_anyway(op):
    """torch 2.15's eager SAC turns PREFER_RECOMPUTE into MUST_SAVE for an op with an ordered effect (registered
    through torch.library or inferred from TorchBind arguments; c10d excepted): "An ordered effect cannot be replayed
    safely". nemo_ac's "never cached" decisions above rest on those ops being recomputed, so none of them may carry
    such an effect (c10d ops do, and torch exempts them). Measured on 2.15.0 besides: no op that reaches the
    override in the SAC, EP, CP, VL and compile unit tests has one."""
    effects = pytest.importorskip("torch._higher_order_ops.effects")
    assert _policy().decide(op)[0] is RECOMPUTE
    assert not effects.has_effects(op), f"{op} has an ordered effect: torch >= 2.15 would cache it"


def test_router_outputs_are_saved_unless_disabled():
    for op in (aten.topk.default, aten.sort.stable, aten.sort.default):
        assert _policy().decide(op)[0] is SAVE
        assert _policy(save_router=False).decide(op)[0] is RECOMPUTE


def test_policy_reads_the_plans_selective_decision():
    """The plan's ``SelectiveACPlan`` is what the policy reads (no config rebuilt from it): a switch set in the recipe
    reaches the policy through the plan, and the recipe section, the plan record and the policy's protocol name the
    same switches (a switch added to one and not the others fails here)."""
    import dataclasses
    import typing

    from nemo_ac.distributed.activation_checkpointing.policy import SelectiveChoices
    from nemo_ac.distributed.plan import SelectiveACPlan

    switches = {"save_router": False, "save_communication": False, "matmul_min_flops_per_byte": 0}
    config = ActivationCheckpointingConfig(mode="selective", selective=SelectiveACConfig(**switches))
    plan = decide_plan(build_model(ModelConfig()), activation_checkpointing=config)
    rules = PolicyRules.build(plan.selective)
    assert {name: getattr(rules, name) for name in switches} == switches
    protocol = set(typing.get_type_hints(SelectiveChoices)) | {
        name for name, value in vars(SelectiveChoices).items() if isinstance(value, property)
    }
    assert {f.name for f in dataclasses.fields(SelectiveACPlan)} == protocol
    assert {f.name for f in dataclasses.fields(SelectiveACConfig)} == protocol


def test_collective_outputs_are_saved_unless_disabled():
    for op in (
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional_autograd.all_to_all_single.default,
    ):
        assert _policy().decide(op)[0] is SAVE
        assert _policy(save_communication=False).decide(op)[0] is RECOMPUTE


def test_attention_and_compute_intensive_ops_are_saved_cheap_ops_recomputed():
    policy = _policy()
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default, aten.convolution.default):
        assert policy.decide(op)[0] is SAVE, op
    for op in (aten.silu.default, aten.add.Tensor, aten._softmax.default, aten.index_select.default):
        assert policy.decide(op)[0] is RECOMPUTE, op


def test_extra_save_ops():
    rules = PolicyRules.build(SelectiveACConfig(), extra_save_ops=[aten.silu.default])
    assert SelectivePolicy(rules=rules).decide(aten.silu.default)[0] is SAVE


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    return (h @ w).sin().sum(dim=-1, keepdim=True) * h.topk(2, dim=-1).values


def _grads(context_fn=None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, 8, generator=gen, requires_grad=True)
    if context_fn is None:
        out = _fn(x, w)
    else:
        out = torch.utils.checkpoint.checkpoint(_fn, x, w, use_reentrant=False, context_fn=context_fn)
    out.square().sum().backward()
    return [x.grad, w.grad]


def test_debug_env_logs_each_decision_once(monkeypatch, caplog):
    monkeypatch.setenv(SAC_DEBUG_ENV, "1")
    reset_decision_log()
    caplog.set_level(logging.INFO, logger="nemo_ac.sac")
    context_fn = ac.make_selective_checkpoint_context_fn(region="model.layers.7")
    for _ in range(3):  # three regions, same ops
        _grads(context_fn)
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_ac.sac"]
    assert len(lines) == len(set(lines)), lines
    # _fn's fp32 [6, 8] x [8, 8] matmuls: 2 x 8 / 4 bytes = 4 FLOPs per byte held, under the default 2048.
    assert any("aten.mm.default -> PREFER_RECOMPUTE (matmul: 4 FLOP per byte held < 2048" in line for line in lines)
    assert any("aten.topk.default -> MUST_SAVE" in line and "model.layers.7" in line for line in lines), lines
    reset_decision_log()


def test_debug_log_silent_by_default(monkeypatch, caplog):
    monkeypatch.delenv(SAC_DEBUG_ENV, raising=False)
    reset_decision_log()
    caplog.set_level(logging.INFO, logger="nemo_ac.sac")
    _grads(ac.make_selective_checkpoint_context_fn())
    assert not [r for r in caplog.records if r.name == "nemo_ac.sac"]


class _Recording:
    """An extra recompute context (what the compile concern passes): records when each side is entered."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self):
        @contextlib.contextmanager
        def side(name):
            self.events.append(name)
            yield

        return side("forward"), side("recompute")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_extra_context_composes_with_both_modes(mode):
    expected = _grads()
    extra = _Recording()
    own = [ac.make_selective_checkpoint_context_fn()] if mode == "selective" else []
    got = _grads(ac.compose_context_fns([*own, extra]))
    assert extra.events == ["forward", "recompute"]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_apply_ac_wraps_blocks_per_mode(mode):
    model = build_model(ModelConfig(num_layers=2))
    plan = decide_plan(model, activation_checkpointing=ActivationCheckpointingConfig(mode=mode))
    ac.apply_ac(model, plan=plan)
    layers = model.model.layers
    wrapped = [hasattr(layer, "_checkpoint_wrapped_module") for layer in layers]
    assert wrapped == [mode != "none"] * 2
    if mode == "full":  # full AC of an uncompiled MoE block composes routing replay alone
        assert plan.decoder_blocks()[0].recompute_contexts == ("routing_replay",)
        forward, recompute = layers[0].checkpoint_fn.keywords["context_fn"]()
        assert (type(forward), type(recompute)) == (type(routing_replay_context()[0]),) * 2
    if mode == "selective":
        forward, recompute = layers[0].checkpoint_fn.keywords["context_fn"]()
        assert isinstance(forward, contextlib.AbstractContextManager)
        assert isinstance(recompute, contextlib.AbstractContextManager)
    assert ("fsdp_hooks_in_sac" in plan.workarounds) == (mode == "selective")
    assert not ac.install_sac_fsdp_workarounds(nn.Linear(2, 2), plan=plan)  # no FSDP unit: nothing to bracket
