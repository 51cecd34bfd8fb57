"""Saved bytes, recompute FLOPs and step time of one MoE decoder block: AC none vs full vs selective.

    python benchmarks/activation_checkpointing.py [--iters 30] [--seq-len 96] [--out PATH.json]
    GPU variant: python benchmarks/activation_checkpointing.py --device cuda --dtype bfloat16

One process, no process group. The block is ``nemo_ac.models.qwen3_moe.DecoderLayer`` (attention + MoE) built from
the tiny recipe's model config, wrapped as the trainer wraps blocks (``activation_checkpointing.wrap_block`` with
``make_selective_checkpoint_context_fn`` for selective: the default policy, which saves the matmuls worth 2048 FLOPs
per byte held (none at this width); ``selective_every_other`` its ``matmul_min_flops_per_byte: 0``, every other
matmul; ``selective_all_mm`` saves every matmul; ``benchmarks/sac_frontier.py`` compares them at the flagships'
width). Input: ``micro_batch_size`` rows of ``seq_len`` tokens packed with variable-length documents.

- saved bytes: activation storages held from forward to backward, each counted once, parameters excluded: what
  autograd packs (``torch.autograd.graph.saved_tensors_hooks`` around forward) plus the tensors in SAC's cache;
- forward FLOPs: ``FlopCounterMode`` over forward (the same in every mode);
- recompute FLOPs: backward FLOPs of the mode minus backward FLOPs of mode none (as tests/unit/distributed/activation_checkpointing/test_sac_flops.py);
- step time: forward + backward, median over ``--iters`` timed iterations after ``--warmup``, modes interleaved
  iteration by iteration so machine noise hits them alike; the ratio is against mode none.
Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import TINY_RECIPE, add_common_args, markdown_table, write_json
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.config.load import load_recipe
from nemo_ac.config.schema import ModelConfig, SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.models.init import init_weights
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.rope import RotaryEmbedding
from nemo_ac.models.qwen3_moe import DecoderLayer

MODES = ("none", "full", "selective", "selective_every_other", "selective_all_mm")
SELECTIVE = {
    "selective": SelectiveACConfig(),
    "selective_every_other": SelectiveACConfig(matmul_min_flops_per_byte=0),
    "selective_all_mm": SelectiveACConfig(save_every_other_mm=False),
}


def build(
    mode: str, *, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, nn.Module, list]:
    """(block, what forward calls, SAC caching modes appended at each forward) for one AC mode."""
    torch.manual_seed(0)
    block = DecoderLayer(cfg, layer_idx=0)
    init_weights(block, seed=0, init_std=cfg.init_std, family=cfg.family)
    block = block.to(device=device, dtype=dtype)
    caching_modes: list = []
    if mode == "none":
        return block, block, caching_modes
    context_fns = []
    if mode.startswith("selective"):
        factory = ac.make_selective_checkpoint_context_fn(config=SELECTIVE[mode], region="moe_block")

        def spying() -> tuple[Any, Any]:
            forward, recompute = factory()
            caching_modes.append(forward)
            return forward, recompute

        context_fns = [spying]
    return block, ac.wrap_block(block, context_fns=context_fns), caching_modes


def make_inputs(*, cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """Hidden states, rope and varlen attention metadata of ``batch`` rows packed with 6..24-token documents."""
    gen = torch.Generator().manual_seed(0)
    docs, positions = torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        start, doc = 0, 0
        while start < seq_len:
            length = min(int(torch.randint(6, 25, (1,), generator=gen)), seq_len - start)
            docs[row, start : start + length] = doc
            positions[row, start : start + length] = torch.arange(length)
            start, doc = start + length, doc + 1
    hidden = torch.randn(batch, seq_len, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor).to(device)
    return hidden, rope(positions.to(device), dtype=dtype), build_attention_inputs(docs.to(device))


def storage_bytes(tensors: list, *, exclude: set[int], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in exclude or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def sac_cached_tensors(caching_modes: list) -> list[torch.Tensor]:
    """Tensors in SAC's cache (torch private: storage[op][index] = pytree of _VersionWrapper or a sentinel)."""
    leaves = (
        leaf
        for mode in caching_modes
        for per_op in mode.storage.values()
        for entry in per_op.values()
        for leaf in torch.utils._pytree.tree_leaves(entry)
    )
    return [v for v in (getattr(leaf, "val", None) for leaf in leaves) if isinstance(v, torch.Tensor)]


def loss_of(run: nn.Module, inputs: tuple) -> torch.Tensor:
    hidden, rope, attn = inputs
    out, stats = run(hidden.detach().requires_grad_(), rope=rope, attn=attn)
    return out.float().square().mean() + stats.prob_sum.float().square().sum() * 1e-3


def measure(mode: str, *, cfg: ModelConfig, inputs: tuple, device: torch.device, dtype: torch.dtype) -> dict:
    """Forward / backward FLOPs and saved bytes of one forward + backward."""
    block, run, caching_modes = build(mode, cfg=cfg, device=device, dtype=dtype)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    packed: list[torch.Tensor] = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    with FlopCounterMode(display=False) as forward_flops, keep:
        loss = loss_of(run, inputs)
    seen: set[int] = set()
    saved = storage_bytes(packed, exclude=params, seen=seen)
    saved += storage_bytes(sac_cached_tensors(caching_modes), exclude=params, seen=seen)
    with FlopCounterMode(display=False) as backward_flops:
        loss.backward()
    return {
        "forward_flops": forward_flops.get_total_flops(),
        "backward_flops": backward_flops.get_total_flops(),
        "saved_bytes": saved,
    }


def time_steps(
    runs: dict[str, Callable[[], None]], *, iters: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each callable, interleaved: warmup rounds, then ``iters`` timed rounds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + iters):
        for name, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the recipe's data.seq_len")
    parser.add_argument("--batch", type=int, default=None, help="default: the recipe's train.micro_batch_size")
    parser.add_argument("--modes", default=",".join(MODES))
    add_common_args(parser, default_out="activation_checkpointing.json")
    args = parser.parse_args()
    started = time.perf_counter()
    recipe = load_recipe(TINY_RECIPE)
    cfg = recipe.model
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batch, seq_len = args.batch or recipe.train.micro_batch_size, args.seq_len or recipe.data.seq_len
    inputs = make_inputs(cfg=cfg, batch=batch, seq_len=seq_len, device=device, dtype=dtype)
    modes = args.modes.split(",")
    results = {mode: measure(mode, cfg=cfg, inputs=inputs, device=device, dtype=dtype) for mode in modes}

    def step_fn(mode: str) -> Callable[[], None]:
        block, run, _ = build(mode, cfg=cfg, device=device, dtype=dtype)

        def step() -> None:
            loss_of(run, inputs).backward()
            block.zero_grad(set_to_none=True)

        return step

    times = time_steps({mode: step_fn(mode) for mode in modes}, iters=args.iters, warmup=args.warmup, device=device)
    base = results.get("none")
    base_ms = 1000 * statistics.median(times["none"]) if "none" in times else None
    rows = []
    for mode, r in results.items():
        r["recompute_flops"] = r["backward_flops"] - base["backward_flops"] if base else None
        r["step_ms_median"] = 1000 * statistics.median(times[mode])
        r["step_ms_min"] = 1000 * min(times[mode])
        r["step_time_ratio_vs_none"] = r["step_ms_median"] / base_ms if base_ms else None
        rows.append(
            [
                mode,
                r["saved_bytes"] / 1024,
                f"{r['saved_bytes'] / base['saved_bytes']:.2f}" if base else None,
                r["forward_flops"] / 1e6,
                None if r["recompute_flops"] is None else r["recompute_flops"] / 1e6,
                f"{r['recompute_flops'] / r['forward_flops']:.2f}" if base else None,
                f"{r['step_ms_median']:.2f}",
                f"{r['step_time_ratio_vs_none']:.2f}" if base_ms else None,
            ]
        )
    headers = [
        "AC mode",
        "saved KiB",
        "saved vs none",
        "fwd MFLOP",
        "recompute MFLOP",
        "recompute / fwd",
        "fwd+bwd median (ms)",
        "step time vs none",
    ]
    table = markdown_table(headers=headers, rows=rows)
    moe = cfg.moe
    title = (
        f"one qwen3_moe decoder block (H={cfg.hidden_size}, {moe.num_experts} experts top-{moe.num_experts_per_tok}, "
        f"B={batch}, S={seq_len}, packed docs), {args.device} {args.dtype}, median of {args.iters} after {args.warmup}"
    )
    print(title)
    print(table)
    write_json(args.out, payload={"title": title, "modes": results}, table=table, wall_s=time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
