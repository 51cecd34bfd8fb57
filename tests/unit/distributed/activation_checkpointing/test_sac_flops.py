"""What selective AC saves and recomputes on one MoE block, versus no AC and full AC (FlopCounterMode + bytes).

- forward FLOPs: the same in every mode;
- recompute FLOPs = backward FLOPs (which include the recompute) - backward FLOPs without AC;
- saved bytes: activation bytes held from forward to backward (parameters excluded, storages counted once):
  what autograd saves (no AC), the block input that checkpoint keeps (full AC), plus SAC's cache (selective).

Run ``pytest -s tests/unit/distributed/activation_checkpointing/test_sac_flops.py`` to see the table.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.config.schema import ModelConfig, MoEConfig, SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed.activation_checkpointing.policy import matmul_flops_per_byte
from nemo_ac.models.init import init_weights
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.rope import RotaryEmbedding
from nemo_ac.models.qwen3_moe import DecoderLayer

# Every test runs on a private copy of torch's SAC_IGNORED_OPS (the real set stays untouched).
pytestmark = pytest.mark.usefixtures("private_sac_ignored_ops")

# Sequence length 40 differs from every model dimension (64, 16, 32, 8, 4, 2).
CFG = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe=MoEConfig())
B, S = 2, 40
# The selective configs measured. The default saves a matmul from 2048 FLOPs per byte held (a bf16 projection out of
# a 2048-wide hidden state); at this block's width (fp32, hidden 64) its analogue is 32: the projections out of the
# hidden state are saved, the experts' down projections (contraction over the expert width, 32) recomputed.
SELECTIVE = {
    "selective": SelectiveACConfig(matmul_min_flops_per_byte=32),
    "selective_default": SelectiveACConfig(),
    "selective_every_other": SelectiveACConfig(matmul_min_flops_per_byte=0),
    "selective_all_mm": SelectiveACConfig(save_every_other_mm=False),
}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, CFG.hidden_size, generator=gen)
    docs = torch.cat([torch.zeros(B, 15, dtype=torch.long), torch.ones(B, S - 15, dtype=torch.long)], dim=1)
    positions = torch.cat([torch.arange(15), torch.arange(S - 15)]).expand(B, -1)
    rope = RotaryEmbedding(CFG.head_dim, CFG.rope_theta)(positions, dtype=hidden.dtype)
    return hidden, rope, build_attention_inputs(docs)


def _storage_bytes(tensors, *, exclude: set[int]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in exclude or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def _sac_cached_tensors(caching_modes) -> list[torch.Tensor]:
    """Tensors in SAC's storage (torch private: storage[op][index] = pytree of _VersionWrapper or a sentinel)."""
    out = []
    for mode in caching_modes:
        for per_op in mode.storage.values():
            for entry in per_op.values():
                for leaf in torch.utils._pytree.tree_leaves(entry):
                    value = getattr(leaf, "val", None)
                    if isinstance(value, torch.Tensor):
                        out.append(value)
    return out


def _cached_ops(caching_modes) -> set[str]:
    return {
        str(op[0] if isinstance(op, tuple) else op)
        for mode in caching_modes
        for op, per_op in mode.storage.items()
        if any(
            getattr(leaf, "val", None) is not None
            for e in per_op.values()
            for leaf in torch.utils._pytree.tree_leaves(e)
        )
    }


def measure(mode: str) -> dict:
    torch.manual_seed(0)
    block = DecoderLayer(CFG, layer_idx=0)
    init_weights(block, seed=0, init_std=0.02, family="qwen3_moe")
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    caching_modes = []
    if mode == "none":
        run = block
    else:
        own = []
        if mode.startswith("selective"):
            factory = ac.make_selective_checkpoint_context_fn(config=SELECTIVE[mode], region="moe_block")

            def spying():
                forward, recompute = factory()
                caching_modes.append(forward)
                return forward, recompute

            own = [spying]
        run = ac.wrap_block(block, context_fns=own)
    hidden, rope, attn = _inputs()
    x = hidden.clone().requires_grad_()
    packed = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    with FlopCounterMode(display=False) as forward_flops, keep:
        out, stats = run(x, rope=rope, attn=attn)
    loss = out.square().mean() + stats.prob_sum.square().sum() * 1e-3
    saved = _storage_bytes(packed, exclude=params) + _storage_bytes(_sac_cached_tensors(caching_modes), exclude=params)
    cached_ops = _cached_ops(caching_modes)  # before backward consumes the cache
    with FlopCounterMode(display=False) as backward_flops:
        loss.backward()
    return {
        "forward_flops": forward_flops.get_total_flops(),
        "backward_flops": backward_flops.get_total_flops(),
        "saved_bytes": saved,
        "cached_ops": cached_ops,
        "grads": {name: p.grad.clone() for name, p in block.named_parameters()},
    }


def test_selective_saves_less_than_none_and_recomputes_less_than_full():
    results = {mode: measure(mode) for mode in ("none", "full", *SELECTIVE)}
    base = results["none"]
    print("\nMoE block (H=64, 8 experts top-2, B=2, S=40), fp32, CPU")
    print(f"{'mode':18s} {'fwd GFLOP':>10s} {'bwd GFLOP':>10s} {'recompute GFLOP':>16s} {'saved KiB':>10s}")
    for mode, r in results.items():
        r["recompute_flops"] = r["backward_flops"] - base["backward_flops"]
        print(
            f"{mode:18s} {r['forward_flops'] / 1e9:10.6f} {r['backward_flops'] / 1e9:10.6f} "
            f"{r['recompute_flops'] / 1e9:16.6f} {r['saved_bytes'] / 1024:10.1f}"
        )
    none, full, sel, sel_all = (results[m] for m in ("none", "full", "selective", "selective_all_mm"))
    assert len({r["forward_flops"] for r in results.values()}) == 1
    # Full AC recomputes the forward's matmuls/attention (early stop may skip the last ones); selective only the
    # matmuls it chose not to save; saving every matmul and attention recomputes no FLOPs at all.
    assert 0 < sel["recompute_flops"] < full["recompute_flops"] <= full["forward_flops"]
    assert full["recompute_flops"] >= 0.5 * full["forward_flops"]
    assert sel_all["recompute_flops"] == 0
    # Memory: the block input only for full (checkpoint saves its inputs), plus SAC's cache for selective, every
    # saved tensor for none.
    assert full["saved_bytes"] == B * S * CFG.hidden_size * 4
    assert 0 < sel["saved_bytes"] < sel_all["saved_bytes"] < none["saved_bytes"]
    # The router's choice (one op, nemo_ac::select_experts) and the expert-ordering sort are cached: routing is
    # replayed, not recomputed.
    assert {"nemo_ac.select_experts.default", "aten.sort.stable"} <= sel["cached_ops"], sel["cached_ops"]
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in sel["cached_ops"]
    # At this width no matmul reaches the default's 2048 FLOPs per byte: it holds less than the rule that saves
    # some, for more recompute. The FLOP-per-byte rule lies below the line from the every-other rule's point to
    # saving every matmul: fewer recompute FLOPs for the bytes it holds (benchmarks/sac_frontier.py, at width).
    default, every_other = results["selective_default"], results["selective_every_other"]
    assert default["saved_bytes"] < sel["saved_bytes"] and default["recompute_flops"] > sel["recompute_flops"]
    slope = (sel_all["recompute_flops"] - every_other["recompute_flops"]) / (
        sel_all["saved_bytes"] - every_other["saved_bytes"]
    )
    on_line = every_other["recompute_flops"] + slope * (sel["saved_bytes"] - every_other["saved_bytes"])
    assert sel["recompute_flops"] < on_line
    for mode in ("full", *SELECTIVE):
        for name, grad in none["grads"].items():
            torch.testing.assert_close(results[mode]["grads"][name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")


def _matmul_decisions(config: SelectiveACConfig, *, experts_impl: str) -> list[tuple[str, str, float | None]]:
    """(op, decision, FLOPs per byte held) of every matmul of the block's forward, in order."""
    decisions = []
    policy_cls = ac.SelectivePolicy

    class Spy(policy_cls):
        def __call__(self, ctx, func, *args, **kwargs):
            decision = super().__call__(ctx, func, *args, **kwargs)
            if getattr(func, "overloadpacket", None) in self.rules.matmuls:
                decisions.append((str(func), decision.name, matmul_flops_per_byte(func, args)))
            return decision

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ac.contexts, "SelectivePolicy", Spy)  # where the SAC context factory builds its policy
        torch.manual_seed(0)
        cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, experts_impl=experts_impl))
        block = DecoderLayer(cfg, layer_idx=0)
        init_weights(block, seed=0, init_std=0.02, family="qwen3_moe")
        factory = ac.make_selective_checkpoint_context_fn(config=config)
        hidden, rope, attn = _inputs()
        ac.wrap_block(block, context_fns=[factory])(hidden.requires_grad_(), rope=rope, attn=attn)
    return decisions


@pytest.mark.parametrize("experts_impl", ["loop", "grouped_mm"])
def test_matmuls_saved_where_worth_their_bytes_within_the_block(experts_impl):
    """At a threshold of 32 FLOPs per byte (fp32: contraction >= 64 = hidden): the projections out of the hidden
    state (q, k, v, router, expert gate/up) and o_proj (4 x 16 heads) are saved, the expert down projections
    (contraction 32, the expert width) recomputed, in the loop and in the grouped GEMM alike."""
    found = _matmul_decisions(SelectiveACConfig(matmul_min_flops_per_byte=32), experts_impl=experts_impl)
    for op, decision, ratio in found:
        assert decision == ("MUST_SAVE" if ratio >= 32 else "PREFER_RECOMPUTE"), (op, decision, ratio)
    assert [ratio for _, _, ratio in found[:5]] == [32] * 5  # q, k, v, o, router (fp32)
    downs = [d for _, d, ratio in found if ratio == 16]
    assert downs and set(downs) == {"PREFER_RECOMPUTE"}
    # At the default (2048) nothing this narrow is worth its bytes: every matmul is recomputed.
    assert {d for _, d, _ in _matmul_decisions(SelectiveACConfig(), experts_impl=experts_impl)} == {"PREFER_RECOMPUTE"}


@pytest.mark.parametrize("experts_impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("save_every_other_mm", [True, False])
def test_matmul_decisions_alternate_within_the_block(save_every_other_mm, experts_impl):
    """``matmul_min_flops_per_byte: 0`` (torchtitan's rule): every matmul of the block (attention projections,
    router, the experts' linears: two per expert in the loop, two grouped GEMMs for all experts with grouped_mm) in
    order: saved, recomputed, saved, ... (or all saved)."""
    config = SelectiveACConfig(save_every_other_mm=save_every_other_mm, matmul_min_flops_per_byte=0)
    decisions = [decision for _, decision, _ in _matmul_decisions(config, experts_impl=experts_impl)]
    # 4 attention projections + router + 2 per expert (8 experts; empty ones still run a [0, H] matmul) or 2 in all.
    assert len(decisions) == 4 + 1 + (2 * CFG.moe.num_experts if experts_impl == "loop" else 2)
    if save_every_other_mm:
        assert decisions == ["MUST_SAVE", "PREFER_RECOMPUTE"] * (len(decisions) // 2) + ["MUST_SAVE"]
    else:
        assert set(decisions) == {"MUST_SAVE"}
