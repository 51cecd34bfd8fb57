"""The SAC frontier at width: held bytes vs recompute FLOPs of each AC policy on every flagship's mixer and MoE blocks.

    python benchmarks/sac_frontier.py [--tokens 512] [--flagships qwen3_6,glm_4_5_air,nemotron_super_v3]

Rows are the sub-blocks one GPU rank of each flagship recipe runs (``benchmarks/_flagship_shapes.py``: real hidden
size, heads / cp under ulysses, the rank's local experts with the recipe's top-k and expert width, uncapped), over
``--tokens`` tokens of one document instead of the recipe's row: held bytes and the FLOPs of every op except the
attention core scale linearly with the token count, so the trade between them is the same at any length; the
attention core's FLOPs grow with the square, and every policy here except full AC saves it. Everything runs under
``FakeTensorMode``: no weight or activation is allocated, so the real width fits on any machine.

Kernels are the ones a CUDA node resolves for the recipe, in bf16 (the recipes' ``param_dtype``): grouped-GEMM
experts (``torch._grouped_mm``), the Gated DeltaNet / Mamba-2 GPU kernels' custom ops (``nemo_ac::fla_gated_delta_rule``,
``nemo_ac::mamba_chunk_scan``) through their fake implementations, the router in fp32; the tiled packed-attention op
stands in for FlexAttention (both one op that every policy saves) and torch modules for Transformer Engine's; the eager
op stream is measured (``compile`` off, as ``nemo-ac plan`` does). Policies, each on the same block:

- ``none`` / ``full``: no checkpoint / torch's checkpoint of the whole sub-block;
- ``torchtitan`` / ``automodel``: their rules over nemo_ac's op stream (``benchmarks/_sac_peer_policies.py``);
- ``nemo_ac before``: nemo_ac's previous default (every other matmul, grouped GEMMs on the same counter);
- ``nemo_ac``: nemo_ac's default policy (``SelectiveACConfig()``); ``save every matmul``: its
  ``save_every_other_mm: false``.

Counted per policy, from one forward + backward (torch's tools only):

- held bytes: activation storages alive from forward to backward, each counted once, parameters excluded: what
  autograd saves (``torch.autograd.graph.saved_tensors_hooks`` around forward) plus the outputs in SAC's cache;
- recompute FLOPs: ``FlopCounterMode`` over backward minus the same for ``none`` (grouped GEMMs and nemo_ac's custom
  ops counted with their registered formulas, ``nemo_ac.models.kernels.op_flops``).

The judgement (``on or below``): nemo_ac's point must not lie above the straight line through Automodel's point and
``save every matmul``'s, i.e. recompute no more FLOPs for its held bytes than that line gives. Writes
benchmarks/results/sac_frontier.{md,json,png}. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import _flagship_peers as peers
import _sac_peer_policies as peer_policies
import torch
from _common import RESULTS_DIR, markdown_table, write_json
from _flagship_shapes import FLAGSHIPS, Row, flagship_rows
from _sac_chart import frontier_chart
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed.activation_checkpointing.contexts import sac_region_context_fn
from nemo_ac.distributed.activation_checkpointing.policy import PolicyRules, SelectivePolicy
from nemo_ac.distributed.activation_checkpointing.wrapping import checkpoint_kwargs
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.models import build_model
from nemo_ac.models.layers.attention import set_attention_kernel
from nemo_ac.models.mixer_kernels import set_mixer_kernels
from nemo_ac.workarounds.fake_world import RealWhereAllReal, fake_tensor_mode

POLICIES = ("none", "full", "torchtitan", "automodel", "nemo_ac before", "nemo_ac", "save every matmul")
KINDS = ("mixer", "moe")  # the sub-block kinds the frontier covers (glm's layer-0 dense FFN: --all-kinds)


def build_layer(row: Row, *, dtype: torch.dtype, fake: Any) -> nn.Module:
    """The row's decoder layer with only the sub-block's children, as fake tensors, with a CUDA node's kernels."""
    cfg = dataclasses.replace(row.model, moe=dataclasses.replace(row.model.moe, experts_impl="grouped_mm"))
    layer = decoder_layers(build_model(cfg, device="meta"))[row.layer_idx]
    used = peers.sub_block_children(row.kind)
    for name, _ in list(layer.named_children()):
        if name not in used:
            setattr(layer, name, None)
    layer.to(dtype)  # on meta: the dtypes first, then fake storage
    router = getattr(getattr(layer, "mlp", None) or getattr(layer, "mixer", None), "gate", None)
    if router is not None and cfg.moe.router_dtype == "float32":
        router.float()
    with fake:
        layer.to_empty(device="cpu")
    set_attention_kernel(layer, kernel="tiled")  # FlexAttention's stand-in: one op, saved by every policy
    set_mixer_kernels(layer, linear_attention="fla", mamba="mamba_ssm")
    return layer


def router_shapes(layer: nn.Module) -> frozenset[tuple[int, int]]:
    """``(in, out)`` of every router gate weight (torchtitan recomputes an mm of that shape)."""
    shapes = set()
    for name, param in layer.named_parameters():
        if name.split(".")[-2:] == ["gate", "weight"] and param.dim() == 2:  # the router's, not shared_expert_gate
            shapes.add((param.shape[1], param.shape[0]))
    return frozenset(shapes)


def previous_default() -> Callable[[], SelectivePolicy]:
    """nemo_ac's default before the FLOP-per-byte rule: every other matmul, grouped ones included, on one counter."""
    rules = PolicyRules.build(SelectiveACConfig(matmul_min_flops_per_byte=0))
    return lambda: SelectivePolicy(rules=rules, region="before")


def context_fn_for(policy: str, layer: nn.Module) -> Callable[[], Any] | None:
    if policy == "nemo_ac":
        return ac.make_selective_checkpoint_context_fn(config=SelectiveACConfig(), region=policy)
    if policy.startswith("nemo_ac min "):  # nemo_ac's policy at another matmul_min_flops_per_byte (--policies)
        config = SelectiveACConfig(matmul_min_flops_per_byte=int(policy.split()[-1]))
        return ac.make_selective_checkpoint_context_fn(config=config, region=policy)
    if policy == "save every matmul":
        return ac.make_selective_checkpoint_context_fn(config=SelectiveACConfig(save_every_other_mm=False))
    factories = {
        "torchtitan": lambda: peer_policies.torchtitan_policy(router_weight_shapes=router_shapes(layer)),
        "automodel": peer_policies.automodel_policy,
        "nemo_ac before": previous_default,
    }
    return sac_region_context_fn(factories[policy](), region=policy) if policy in factories else None


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def held_bytes(tensors: list[Any], *, exclude: set[int]) -> int:
    seen, total = set(exclude), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def sac_cache(caching_modes: list[Any]) -> list[torch.Tensor]:
    """Tensors in SAC's cache (torch private: storage[op][index] = pytree of _VersionWrapper or a sentinel; read the
    same way by benchmarks/activation_checkpointing.py)."""
    leaves = (
        leaf
        for mode in caching_modes
        for per_op in mode.storage.values()
        for entry in per_op.values()
        for leaf in torch.utils._pytree.tree_leaves(entry)
    )
    return [v for v in (getattr(leaf, "val", None) for leaf in leaves) if isinstance(v, torch.Tensor)]


def measure(row: Row, policy: str, *, tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    fake = fake_tensor_mode()
    layer = build_layer(row, dtype=dtype, fake=fake)
    block = peers.nemo_sub_block(
        row.kind, model_cfg=row.model, nemo_layer=layer, seq_len=tokens, dtype=dtype, device=torch.device("cpu")
    )
    params = {_storage_key(p) for p in layer.parameters()}
    caching_modes: list[Any] = []
    context_fn = context_fn_for(policy, layer)

    def spying() -> tuple[Any, Any]:
        forward, recompute = context_fn()
        caching_modes.append(forward)
        return forward, recompute

    def run(h: torch.Tensor) -> torch.Tensor:
        if policy == "none":
            return block(h)
        extra = {"context_fn": spying} if context_fn is not None else {}
        return torch.utils.checkpoint.checkpoint(block, h, **checkpoint_kwargs(), **extra)

    packed: list[torch.Tensor] = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    with fake, RealWhereAllReal():
        h = torch.empty(1, tokens, row.model.hidden_size, dtype=dtype).requires_grad_()
        with FlopCounterMode(display=False) as forward_flops, keep:
            out = run(h)
        held = held_bytes([*packed, *sac_cache(caching_modes)], exclude=params)
        grad = torch.empty_like(out)
        with FlopCounterMode(display=False) as backward_flops:
            out.backward(grad)
    return {
        "forward_flops": forward_flops.get_total_flops(),
        "backward_flops": backward_flops.get_total_flops(),
        "held_bytes": held,
    }


def line_flops(point_bytes: float, *, a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Recompute FLOPs on the straight line through points ``a`` and ``b`` at ``point_bytes`` held."""
    if a["held_bytes"] == b["held_bytes"]:
        return None
    slope = (b["recompute_flops"] - a["recompute_flops"]) / (b["held_bytes"] - a["held_bytes"])
    return a["recompute_flops"] + slope * (point_bytes - a["held_bytes"])


def judge(results: dict[str, dict[str, Any]], policy: str) -> dict[str, Any]:
    """Where ``policy``'s point lies against the Automodel - save-every-matmul line (module docstring); no line
    (``on_or_below`` None) where Automodel's rule already saves every matmul of the block."""
    point, a, s = results[policy], results["automodel"], results["save every matmul"]
    on_line = line_flops(point["held_bytes"], a=a, b=s)
    if on_line is None:
        return {"line_flops": None, "on_or_below": None, "excess_flops": None}
    excess = point["recompute_flops"] - on_line
    return {"line_flops": on_line, "on_or_below": excess <= 1e-6 * max(1.0, abs(on_line)), "excess_flops": excess}


def mixer_heads(row: Row) -> str:
    m = row.model
    if row.kind == "qwen_linear_mixer":
        la = m.linear_attention
        return f"{la.num_key_heads} key / {la.num_value_heads} value"
    if row.kind == "nemotron_mamba":
        return f"{m.mamba.num_heads} x {m.mamba.head_dim}, {m.mamba.n_groups} groups"
    if sub_block_kind(row) == "mixer":
        return f"{m.num_attention_heads} / {m.num_key_value_heads} kv x {m.head_dim}"
    return ""


def sub_block_kind(row: Row) -> str:
    return "moe" if row.kind.endswith(("moe_ffn", "_moe")) else ("dense" if "dense" in row.kind else "mixer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per row (module docstring: why 512 is enough)")
    parser.add_argument("--flagships", default=",".join(FLAGSHIPS))
    parser.add_argument("--all-kinds", action="store_true", help="also glm's layer-0 dense FFN")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default=str(RESULTS_DIR / "sac_frontier.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    dtype = torch.bfloat16
    policies = args.policies.split(",")
    records = []
    for row in flagship_rows(args.flagships.split(","), budget_gflop=None, max_param_bytes=1 << 62):
        if sub_block_kind(row) not in KINDS and not args.all_kinds:
            continue
        tokens = min(args.tokens, row.tokens)
        results = {policy: measure(row, policy, tokens=tokens, dtype=dtype) for policy in policies}
        base = results["none"]["backward_flops"]
        for r in results.values():
            r["recompute_flops"] = r["backward_flops"] - base
        verdicts = {p: judge(results, p) for p in ("nemo_ac before", "nemo_ac") if p in results}
        m = row.model
        records.append(
            {
                "flagship": row.flagship,
                "recipe": row.recipe,
                "sub_block": row.label,
                "kind": row.kind,
                "tokens": tokens,
                "recipe_tokens": row.tokens,
                "hidden": m.hidden_size,
                "experts": m.moe.num_experts if sub_block_kind(row) == "moe" else None,
                "top_k": m.moe.num_experts_per_tok if sub_block_kind(row) == "moe" else None,
                "expert_width": m.moe.moe_intermediate_size,
                "heads": mixer_heads(row),
                "recipe_ac": row.ac_mode,
                "policies": results,
                "judgement": verdicts,
            }
        )
        print(f"{row.name}: " + ", ".join(f"{p} {judge_text(v)}" for p, v in verdicts.items()), file=sys.stderr)
    table = render(records)
    print(table)
    out = args.out if str(args.out).endswith(".json") else f"{args.out}.json"
    title = f"SAC frontier at width, bf16, {args.tokens} tokens per row, FakeTensorMode"
    write_json(out, payload={"title": title, "rows": records}, table=table, wall_s=time.perf_counter() - started)
    md = out[: -len(".json")] + ".md"
    with open(md, "w") as f:
        f.write(
            f"# {title}\n\nCommand: `python benchmarks/sac_frontier.py --tokens {args.tokens}` (module docstring: "
            f"what is counted and how each policy is modelled).\n\nRows, one GPU rank of each recipe:\n\n"
            f"{shapes_table(records)}\n\n![frontier](sac_frontier.png)\n\n{table}\n"
        )
    frontier_chart(records, out[: -len(".json")] + ".png")
    return 0


def judge_text(verdict: dict[str, Any]) -> str:
    if verdict["on_or_below"] is None:
        return "no line: Automodel saves every matmul here"
    if verdict["on_or_below"]:
        return "on or below the line"
    return f"ABOVE the line by {verdict['excess_flops'] / 1e9:.2f} GFLOP"


def shapes_table(records: list[dict[str, Any]]) -> str:
    rows = [
        [
            rec["flagship"],
            rec["sub_block"],
            rec["hidden"],
            ""
            if rec["experts"] is None
            else f"{rec['experts']} local, top-{rec['top_k']}, width {rec['expert_width']}",
            rec["heads"],
            f"{rec['tokens']} of {rec['recipe_tokens']}",
            rec["recipe_ac"],
        ]
        for rec in records
    ]
    headers = ["flagship", "sub-block", "hidden", "experts", "mixer heads (per rank)", "tokens", "recipe AC"]
    return markdown_table(headers=headers, rows=rows)


def render(records: list[dict[str, Any]]) -> str:
    """One table: a row per (sub-block, policy), MiB held and GFLOP recomputed, the verdicts on nemo_ac's rows."""
    headers = [
        "flagship",
        "sub-block",
        "tokens",
        "policy",
        "held MiB",
        "held / none",
        "recompute GFLOP",
        "recompute / fwd",
        "vs Automodel - save-all line",
    ]
    rows = []
    for rec in records:
        res = rec["policies"]
        none = res.get("none")
        for policy, r in res.items():
            verdict = rec["judgement"].get(policy)
            line = ""
            if verdict is not None:
                at = verdict["line_flops"]
                line = judge_text(verdict) + ("" if at is None else f" (line at its bytes: {at / 1e9:.2f})")
            rows.append(
                [
                    rec["flagship"],
                    rec["sub_block"],
                    rec["tokens"],
                    policy,
                    f"{r['held_bytes'] / 2**20:.1f}",
                    f"{r['held_bytes'] / none['held_bytes']:.2f}" if none else "",
                    f"{r['recompute_flops'] / 1e9:.2f}",
                    f"{r['recompute_flops'] / r['forward_flops']:.2f}" if r["forward_flops"] else "",
                    line,
                ]
            )
    return markdown_table(headers=headers, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
