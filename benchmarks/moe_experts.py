"""Routed experts at GLM-4.5-Air's MoE width: the loop before and after its backward fix, grouped_mm, transformers.

    python benchmarks/moe_experts.py            # 16 and 64 experts x 256 and 1024 tokens, fp32 (~10 min here)
    python benchmarks/moe_experts.py --quick    # 16 and 64 experts at 256 tokens

The slow references (the loop before the fix, transformers' eager loop) run at 16 experts and 256 tokens only.

The GLM-4.5-Air recipe's MoE FFN sub-block (post-attention norm, fp32 sigmoid router with correction bias, top-8,
one shared expert, hidden 4096, expert width 1408) with the expert count capped to 16 / 64 of 128 so it fits this
machine; top-k stays 8. Same weights and inputs for every stack, forward + backward:

- ``nemo_ac loop (before)``: the loop as it was, ``gate_up[e]`` / ``down[e]`` per expert (each select's backward
  writes a zero tensor the size of the whole [E, 2I, H] weight);
- ``nemo_ac loop``: the loop now (one ``unbind`` per forward); ``nemo_ac grouped_mm``: what recipes get by default;
- ``transformers eager`` / ``transformers grouped_mm``: ``Glm4MoeMoE`` with ``experts_implementation`` eager (its
  per-expert loop) and grouped_mm (what a model built with ``from_config`` uses in 5.18).

Reports median time (min-max), tracked peak memory, and for the loop rows the top ops by self time, so the
``aten::fill_`` of full-size weights is visible before and absent after. Writes benchmarks/results/moe_experts.*.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import _flagship_peers as peers
import torch
import torch.nn.functional as F
from _common import RESULTS_DIR, markdown_table, write_json
from _flagship_shapes import flagship_rows
from _measure import fixed_mmap_threshold
from flagship_layers import _build_layer, _measure, _top_op

from nemo_ac.models.layers.experts import GroupedExperts


def _old_forward_loop(self: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, gate_up: Any, down: Any) -> Any:
    """The loop before the fix (``weight[e]`` selects), kept here only to measure the difference."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        outs.append(F.linear(self._act(F.linear(rows, gate_up[e])), down[e]))
    return torch.cat(outs, dim=0)


# (experts, tokens) -> stacks run. The two slow references (the loop before its fix, transformers' eager loop) only
# where they are needed to show the difference: both pay experts x full weight per backward, whatever the tokens.
ALL_STACKS = (
    "nemo_ac loop (before)",
    "nemo_ac loop",
    "nemo_ac grouped_mm",
    "transformers eager",
    "transformers grouped_mm",
)
FAST_STACKS = ("nemo_ac loop", "nemo_ac grouped_mm", "transformers grouped_mm")


def run_case(experts: int, tokens: int, *, repeats: int, stacks: tuple[str, ...] = ALL_STACKS) -> list[dict[str, Any]]:
    (row,) = [r for r in flagship_rows(["glm_4_5_air"], budget_gflop=None) if r.kind == "glm_moe_ffn"]
    moe = dataclasses.replace(row.model.moe, num_experts=experts)
    row = dataclasses.replace(row, model=dataclasses.replace(row.model, moe=moe), tokens=tokens, caps=[])
    device, dtype = torch.device("cpu"), torch.float32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, row.model.hidden_size)
    grad = torch.randn_like(x)
    out = []
    reference = None
    impls = {
        "nemo_ac loop (before)": "loop",
        "nemo_ac loop": "loop",
        "nemo_ac grouped_mm": "grouped_mm",
        "transformers eager": "eager",
        "transformers grouped_mm": "grouped_mm",
    }
    for stack in stacks:
        impl = impls[stack]
        if stack.startswith("nemo_ac"):
            layer = _build_layer(row, experts_impl=impl, dtype=dtype, device=device)
            reference = reference or layer
            fn = peers.nemo_sub_block(
                row.kind, model_cfg=row.model, nemo_layer=layer, seq_len=tokens, dtype=dtype, device=device
            )
            params = list(layer.parameters())
        else:
            peer = peers.build_peer(
                row.kind,
                model_cfg=row.model,
                nemo_layer=reference,
                layer_idx=row.layer_idx,
                seq_len=tokens,
                dtype=dtype,
                device=device,
            )
            peer.module.mlp.experts.config._experts_implementation = impl
            fn, params = peer.run, list(peer.module.parameters())
        patched = stack.endswith("(before)")
        original = GroupedExperts._forward_loop
        if patched:
            GroupedExperts._forward_loop = _old_forward_loop
        try:
            m = _measure(fn, params, x, grad, device=device, repeats=repeats)
            profile = _top_op(m["step"]) if "loop" in stack else ""
            with torch.no_grad():
                value = fn(x)
        finally:
            GroupedExperts._forward_loop = original
        out.append(
            {
                "experts": experts,
                "tokens": tokens,
                "stack": stack,
                "median_s": statistics.median(m["times"]),
                "min_s": min(m["times"]),
                "max_s": max(m["times"]),
                "peak_gib": m["peak_bytes"] / 2**30,
                "top_ops": profile,
                "output": value,
            }
        )
        print(f"  E={experts} T={tokens} {stack}: {out[-1]['median_s']:.2f} s", file=sys.stderr, flush=True)
    base = next(r["output"] for r in out if r["stack"] == "nemo_ac loop")
    for r in out:
        r["max_abs_diff_vs_loop"] = (r.pop("output") - base).abs().max().item()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    fixed_mmap_threshold()
    cases = [((16, 256), ALL_STACKS), ((64, 256), FAST_STACKS)]
    if not args.quick:
        cases += [((16, 1024), FAST_STACKS), ((64, 1024), FAST_STACKS)]
    records = [
        r for (experts, tokens), stacks in cases for r in run_case(experts, tokens, repeats=args.repeats, stacks=stacks)
    ]
    rows = [
        [
            r["experts"],
            r["tokens"],
            r["stack"],
            f"{r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f})",
            f"{r['peak_gib']:.2f}",
            f"{r['max_abs_diff_vs_loop']:.1e}",
        ]
        for r in records
    ]
    table = markdown_table(
        headers=["experts", "tokens", "stack", "median s (min-max)", "peak GiB (tracked)", "max |out - loop|"],
        rows=rows,
    )
    profiles = "\n".join(
        f"- E={r['experts']} T={r['tokens']} {r['stack']}: {r['top_ops']}" for r in records if r["top_ops"]
    )
    text = f"{table}\n\nTop ops by self time (loop rows):\n{profiles}"
    print(text)
    out = RESULTS_DIR / ("moe_experts_quick.json" if args.quick else "moe_experts.json")
    out.with_suffix(".md").write_text(text + "\n")
    write_json(out, payload={"records": records}, table=text, wall_s=time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
