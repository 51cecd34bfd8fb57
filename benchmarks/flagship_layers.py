"""Every flagship's decoder sub-blocks at the width one GPU rank runs, nemo_ac beside transformers, same process.

    python benchmarks/flagship_layers.py            # all three flagships, fp32 + bf16 (CPU: capped rows, < 10 min)
    python benchmarks/flagship_layers.py --quick    # fp32, one flagship's rows per kind, fewer repeats (< 3 min)
    python benchmarks/flagship_layers.py --device cuda   # the same table on a GPU, uncapped (memory caps only)

Rows come from the recipes themselves (``benchmarks/_flagship_shapes.py``: per-rank tokens after CP, heads / cp
under ulysses, local experts after EP and the rows each receives; caps printed where a row exceeds this machine's
budget). For each row and dtype, on the same weights and the same input:

- ``nemo_ac``: the sub-block with the recipe's activation checkpointing (selective or full) and the kernels the
  recipe's plan resolves on the device (``recipe_kernels``: ``experts_impl: auto`` -> grouped_mm, ``attention:
  auto`` -> the tiled packed op on CPU, FlexAttention on CUDA); ``nemo_ac no-AC``: the same without checkpointing
  (the like-for-like comparison with transformers, which has no selective AC); MoE rows add ``nemo_ac loop``, the
  experts loop; ``--sdpa-reference`` adds ``nemo_ac sdpa no-AC`` to the attention rows (the dense-mask reference);
- ``transformers``: the transformers 5.x module of the same family as a user's model runs it
  (``benchmarks/_flagship_peers.py`` says which attention / experts implementation);
- ``automodel``: NeMo Automodel 0.7.0's own layer (``benchmarks/_automodel_peers.py``), when it is installed
  (``pip install -c constraints.txt nemo-automodel==0.7.0``; not a dependency); rows where it does not run say why;
- ``nemo_ac compiled no-AC``: ``torch.compile`` (inductor) of the no-AC sub-block, timed after its compile (the
  compile's own time is in the JSON; ``--no-compile`` skips these rows). Not for the Gated DeltaNet / Mamba-2 rows
  unless ``--compile-recurrent``: their torch reference loops over chunks in Python and a cold compile at the row's
  length did not finish in 6 minutes here.

Per row: median step time (forward + backward) with its min-max spread, tracked peak memory (see
``benchmarks/_measure.py``), model FLOPs (FlopCounterMode, attention counted by visible causal pairs), executed
FLOPs, achieved FLOP/s and achieved / peak, where peak is ``torch.mm`` at the row's dominant GEMM shape measured in
this run, and nemo_ac / transformers ratios of time and memory. Held memory (``_measure.held_bytes``): the bytes
a forward leaves allocated for its backward (saved tensors, or what the recipe's activation checkpointing keeps)
plus the sub-block's input, which every stack keeps (a norm saves it, a checkpoint keeps it); not a peak.
``held / HF no-AC`` divides nemo_ac's (recipe AC, and no-AC) by transformers' without AC. Where nemo_ac is slower
than transformers, a profile line names the op that dominates its step. Writes
benchmarks/results/flagship_layers{,_quick}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _automodel_peers as automodel_peers
import _flagship_peers as peers
import torch
from _common import RESULTS_DIR, machine, write_json
from _flagship_report import caps_table, chart, render, table
from _flagship_shapes import Row, flagship_rows
from _measure import (
    count_flops,
    held_bytes,
    keep_freed_memory,
    matmul_peak,
    peak_bytes,
    release_free_memory,
    time_steps,
)

from nemo_ac.config.schema import SelectiveACConfig
from nemo_ac.distributed.activation_checkpointing import make_selective_checkpoint_context_fn
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.plan.kernels import choose_experts_impl
from nemo_ac.models import build_model
from nemo_ac.models.init import init_weights
from nemo_ac.models.layers.attention import set_attention_kernel
from nemo_ac.models.layers.experts import GroupedExperts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _build_layer(
    row: Row, *, experts_impl: str, dtype: torch.dtype, device: torch.device, attention: str = "sdpa"
) -> torch.nn.Module:
    cfg = dataclasses.replace(row.model, moe=dataclasses.replace(row.model.moe, experts_impl=experts_impl))
    model = build_model(cfg, device="meta")
    layer = decoder_layers(model)[row.layer_idx]
    used = peers.sub_block_children(row.kind)
    for name, _ in list(layer.named_children()):
        if name not in used:  # e.g. a mixer row's 128-expert MoE: never materialized (9 GB in fp32)
            setattr(layer, name, None)
    layer.to_empty(device=device)
    init_weights(layer, seed=0, init_std=0.02, family=cfg.family)
    layer.to(dtype)
    set_attention_kernel(layer, kernel=attention)  # backend.attention (the recipes' auto: flex / tiled)
    router = getattr(getattr(layer, "mlp", None), "gate", None)
    if router is not None and cfg.moe.router_dtype == "float32":
        router.float()  # the recipe keeps the router in fp32 (its own FSDP unit under bf16 params)
    return layer


def _with_ac(fn: Any, mode: str) -> Any:
    """The sub-block under the recipe's activation checkpointing (no FSDP here: one process, one sub-block)."""
    if mode == "none":
        return fn
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = make_selective_checkpoint_context_fn(config=SelectiveACConfig())
    return lambda x: torch.utils.checkpoint.checkpoint(fn, x, **kwargs)


def _dominant_gemm(row: Row) -> tuple[int, int, int]:
    m, t = row.model, row.tokens
    if row.kind.endswith("moe_ffn") or row.kind == "nemotron_moe":
        moe = m.moe
        rows = max(1, t * moe.num_experts_per_tok // moe.num_experts)
        width = moe.latent_size or m.hidden_size
        gated = 2 if moe.activation == "silu" else 1
        routed = (rows, width, moe.moe_intermediate_size * gated)
        shared = (t, m.hidden_size, moe.shared_expert_intermediate_size * gated)
        # the GEMM shape with the most FLOPs in the row: a routed expert's (times all experts) or the shared one
        routed_flops = moe.num_experts * rows * width * moe.moe_intermediate_size
        return routed if routed_flops > t * m.hidden_size * moe.shared_expert_intermediate_size else shared
    if row.kind == "qwen_linear_mixer":
        la = m.linear_attention
        return t, m.hidden_size, 2 * la.num_key_heads * la.key_head_dim + 2 * la.num_value_heads * la.value_head_dim
    if row.kind == "nemotron_mamba":
        mb = m.mamba
        return t, m.hidden_size, 2 * mb.num_heads * mb.head_dim + 2 * mb.n_groups * mb.state_size + mb.num_heads
    if row.kind == "glm_dense_ffn":
        return t, m.hidden_size, 2 * m.intermediate_size
    q_out = m.num_attention_heads * m.head_dim * (2 if m.attn_output_gate else 1)
    # the attention core's Q K^T per head ([S, d] x [d, S], half visible) when it outweighs the projections
    core = m.num_attention_heads * t * t * m.head_dim // 2
    return (t, m.head_dim, t) if core > t * m.hidden_size * 2 * q_out else (t, m.hidden_size, q_out)


def _top_op(step: Any) -> str:
    """The op with the largest self time in one step, with its share: where the time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(e.self_cpu_time_total for e in events) or 1
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:3]
    return ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.0f}%" for e in top)


def _measure(
    fn: Any,
    params: list[torch.nn.Parameter],
    x: torch.Tensor,
    grad: torch.Tensor,
    *,
    device: torch.device,
    repeats: int,
    count_executed: bool = True,
    held: bool = False,
) -> dict[str, Any]:
    def step() -> None:
        inp = x.detach().requires_grad_()
        fn(inp).backward(grad)
        for p in params:
            p.grad = None

    peak = peak_bytes(step, device=device)  # also the warm-up step
    # Plus the input: every sub-block keeps it for backward (its first norm saves it; a checkpoint keeps it), and it
    # exists before the forward, so held_bytes does not see it.
    kept = held_bytes(lambda: fn(x.detach().requires_grad_()), device=device) + x.nbytes if held else None
    # Not for Automodel: its torch.compile(fullgraph=True) expert activations refuse FlopCounterMode's dispatch mode
    # ("non-infra torch dispatch mode present"), and the failed frame then stays skipped for the timed steps.
    executed = count_flops(step, visible_fraction=None) if count_executed else None
    times = time_steps(step, device=device, warmup=0, repeats=repeats)
    return {"step": step, "times": times, "peak_bytes": peak, "held_bytes": kept, "executed_flops": executed}


# The torch reference Gated DeltaNet / Mamba-2 loop over chunks in Python: inductor unrolls the loop, and a cold
# compile of one such layer at the flagship row's length did not finish in 6 minutes here (first run, 2 cores).
RECURRENT = ("qwen_linear_mixer", "nemotron_mamba")


ATTENTION_KINDS = ("qwen_attention_mixer", "glm_attention_mixer", "nemotron_attention")
SKIPPED: list[str] = []  # rows a peer stack could not run, with the reason


def reference_and_peer(row: Row, *, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The row's nemo_ac layer holding the weights every stack starts from, and transformers' layer copying them."""
    reference = _build_layer(row, experts_impl="auto", dtype=dtype, device=device)
    peer = peers.build_peer(
        row.kind,
        model_cfg=row.model,
        nemo_layer=reference,
        layer_idx=row.layer_idx,
        seq_len=row.tokens,
        dtype=dtype,
        device=device,
    )
    return reference, peer


def run_row(
    row: Row,
    *,
    dtype_name: str,
    device: torch.device,
    repeats: int,
    compile_: bool,
    compile_recurrent: bool = False,
    sdpa_reference: bool = False,
) -> list[dict[str, Any]]:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    x = torch.randn(1, row.tokens, row.model.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    visible = (row.tokens + 1) / (2 * row.tokens)  # one causal document per row
    results: list[dict[str, Any]] = []
    skipped = SKIPPED
    stacks: list[tuple[str, str, str]] = [("nemo_ac", "auto", row.ac_mode), ("nemo_ac no-AC", "auto", "none")]
    if row.kind in ("qwen_moe_ffn", "glm_moe_ffn", "nemotron_moe"):
        stacks.append(("nemo_ac loop no-AC", "loop", "none"))
    if compile_ and (row.kind not in RECURRENT or compile_recurrent):
        stacks.append(("nemo_ac compiled no-AC", "auto", "none"))
    if sdpa_reference and row.kind in ATTENTION_KINDS and row.attention_kernel != "sdpa":
        stacks.append(("nemo_ac sdpa no-AC", "auto", "none"))  # the dense-mask reference beside the recipe's kernel
    peak = matmul_peak(*_dominant_gemm(row), dtype=dtype, device=device)
    # The weights every stack starts from (peers copy them); each stack's own module is dropped once measured, so
    # at most two copies of the row's weights are alive.
    reference, peer = reference_and_peer(row, dtype=dtype, device=device)
    peer_params = list(peer.module.parameters())
    measured = _measure(peer.run, peer_params, x, grad, device=device, repeats=repeats, held=True)
    measured.update(stack="transformers", ac="none", impl=peer.impl, compile_s=None, profile="")
    del peer, peer_params
    results.append(measured)
    hf_time = statistics.median(measured["times"])
    if automodel_peers.automodel_available():
        am = automodel_peers.build_automodel_peer(
            row.kind,
            model_cfg=row.model,
            nemo_layer=reference,
            layer_idx=row.layer_idx,
            seq_len=row.tokens,
            dtype=dtype,
            device=device,
        )
        if am is None:
            skipped.append(f"{row.name} {dtype_name}: {automodel_peers.UNSUPPORTED.get(row.kind, 'unsupported')}")
        else:
            params = list(am.module.parameters())
            measured = _measure(am.run, params, x, grad, device=device, repeats=repeats, count_executed=False)
            measured.update(stack="automodel", ac="none", impl=am.impl, compile_s=None, profile="")
            results.append(measured)
        del am
    model_flops = None
    for stack, experts_impl, ac_mode in stacks:
        attention = "sdpa" if "sdpa" in stack else row.attention_kernel  # the recipe's plan (Row.kernels)
        layer = _build_layer(row, experts_impl=experts_impl, dtype=dtype, device=device, attention=attention)
        fn = peers.nemo_sub_block(
            row.kind, model_cfg=row.model, nemo_layer=layer, seq_len=row.tokens, dtype=dtype, device=device
        )
        compile_s = None
        if stack.startswith("nemo_ac compiled"):
            fn = torch.compile(fn, backend="inductor")
            started = time.perf_counter()
            inp = x.detach().requires_grad_()
            fn(inp).backward(grad)
            compile_s = time.perf_counter() - started
        fn = _with_ac(fn, ac_mode)
        params = list(layer.parameters())
        held = stack in ("nemo_ac", "nemo_ac no-AC")
        measured = _measure(fn, params, x, grad, device=device, repeats=repeats, held=held)
        if model_flops is None and ac_mode == "none":  # what the layer must compute: no recompute counted
            model_flops = count_flops(measured["step"], visible_fraction=visible)
        slower = stack == "nemo_ac no-AC" and statistics.median(measured["times"]) > 1.05 * hf_time
        measured.update(
            stack=stack,
            ac=ac_mode,
            impl=f"experts_impl={layer_impl(layer, device=device)}"
            + (f", attention={attention}" if row.kind in ATTENTION_KINDS else ""),
            compile_s=compile_s,
            profile=_top_op(measured["step"]) if slower else "",
        )
        del layer, fn, params
        measured.pop("step")
        results.append(measured)
    for r in results:
        r.pop("step", None)
    del reference
    hf_peak = next(r["peak_bytes"] for r in results if r["stack"] == "transformers")
    hf_held = next(r["held_bytes"] for r in results if r["stack"] == "transformers")
    out = []
    for r in results:
        median = statistics.median(r["times"])
        achieved = model_flops / median
        out.append(
            {
                "flagship": row.flagship,
                "sub_block": row.label,
                "kind": row.kind,
                "stack": r["stack"],
                "impl": r["impl"],
                "ac": r["ac"],
                "dtype": dtype_name,
                "tokens": row.tokens,
                "caps": row.cap_text(),
                "median_ms": 1000 * median,
                "min_ms": 1000 * min(r["times"]),
                "max_ms": 1000 * max(r["times"]),
                "peak_mib": r["peak_bytes"] / 2**20,
                "model_gflop": model_flops / 1e9,
                "executed_gflop": None if r["executed_flops"] is None else r["executed_flops"] / 1e9,
                "achieved_gflops": achieved / 1e9,
                "peak_gflops": peak / 1e9,
                "achieved_over_peak": achieved / peak,
                "time_vs_transformers": median / hf_time,
                "memory_vs_transformers": r["peak_bytes"] / hf_peak if hf_peak else None,
                "held_mib": None if r["held_bytes"] is None else r["held_bytes"] / 2**20,
                "held_vs_transformers_no_ac": None if r["held_bytes"] is None else r["held_bytes"] / hf_held,
                "compile_s": r["compile_s"],
                "dominant_ops": r["profile"],
            }
        )
    return out


def layer_impl(layer: torch.nn.Module, *, device: torch.device) -> str:
    """The experts kernel a recipe gets for this layer (``auto`` resolved as the trainer resolves it)."""
    experts = [m for m in layer.modules() if isinstance(m, GroupedExperts)]
    if not experts:
        return "-"
    e = experts[0]
    chosen = choose_experts_impl(
        e.impl,
        device_type=device.type,
        dtype=e.down_proj.dtype,
        hidden_size=e.hidden_size,
        intermediate_size=e.intermediate_size,
    )
    return f"{e.impl} -> {chosen}" if e.impl == "auto" else chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp32, one flagship, 2 repeats, half the budget")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default=None, help="comma list (default float32,bfloat16; --quick float32)")
    parser.add_argument("--flagships", default=None, help="comma list of qwen3_6, glm_4_5_air, nemotron_super_v3")
    parser.add_argument("--kinds", default=None, help="comma list of sub-block kinds (_flagship_peers.KINDS)")
    parser.add_argument("--budget-gflop", type=float, default=None, help="CPU cap per row (default 120; cuda: none)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="skip the nemo_ac compiled (inductor) rows")
    parser.add_argument(
        "--compile-recurrent", action="store_true", help="also compile the Gated DeltaNet / Mamba-2 rows (slow)"
    )
    parser.add_argument(
        "--sdpa-reference", action="store_true", help="attention rows: also the dense-mask sdpa op, no AC"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="re-render the .md / .png of a results JSON")
    args = parser.parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        automodel = data.get("automodel", "")
        args.render.with_suffix(".md").write_text(render(data["rows"], data["records"], automodel=automodel) + "\n")
        chart(data["records"], args.render.with_suffix(".png"))
        return 0
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cpu":
        keep_freed_memory()
    dtypes = (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")
    names = args.flagships.split(",") if args.flagships else (["glm_4_5_air"] if args.quick else None)
    budget = args.budget_gflop if args.budget_gflop is not None else (None if device.type == "cuda" else 120.0)
    if args.quick and device.type == "cpu":
        budget = budget / 4
    repeats = args.repeats or (2 if args.quick else 3)
    rows = flagship_rows(names, budget_gflop=budget, device_type=device.type)
    if args.kinds:
        rows = [r for r in rows if r.kind in args.kinds.split(",")]
    print(caps_table([dataclasses.asdict(r) | {"caps": r.cap_text()} for r in rows]), flush=True)
    records = []
    for row in rows:
        for dtype in dtypes:
            row_started = time.perf_counter()
            got = run_row(
                row,
                dtype_name=dtype,
                device=device,
                repeats=repeats,
                compile_=not args.no_compile,
                compile_recurrent=args.compile_recurrent,
                sdpa_reference=args.sdpa_reference,
            )
            records += got
            release_free_memory()  # the next row starts from a trimmed heap (keep_freed_memory keeps it otherwise)
            print(f"  {row.name} {dtype}: {time.perf_counter() - row_started:.0f} s", file=sys.stderr, flush=True)
            print(table(got), flush=True)
    automodel = (
        ("does not run for " + "; ".join(SKIPPED))
        if SKIPPED
        else "every row ran"
        if automodel_peers.automodel_available()
        else "not installed (pip install -c constraints.txt nemo-automodel==0.7.0 adds its rows)"
    )
    row_info = [dataclasses.asdict(r) | {"caps": r.cap_text(), "name": r.name} for r in rows]
    text = render(row_info, records, automodel=automodel)
    print(text)
    stem = "flagship_layers" + ("_quick" if args.quick else "") + ("_cuda" if device.type == "cuda" else "")
    out = args.out or RESULTS_DIR / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    chart(records, out.with_suffix(".png"))
    payload = {"rows": row_info, "records": records, "automodel": automodel}
    payload["machine_detail"] = machine()
    write_json(out, payload=payload, table=text, wall_s=time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
