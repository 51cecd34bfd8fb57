"""Backward time of the MoE combine and the fp32 router (nemo_ac's ``autograd.Function`` forms, which keep the bf16
tensors for backward and cast inside) against the plain autograd forms, at one flagship MoE row's shape.

    python benchmarks/moe_combine_backward.py                          # qwen3_6's MoE FFN row, bf16
    python benchmarks/moe_combine_backward.py --flagship glm_4_5_air --repeats 41

Same process, same inputs, the stacks interleaved per repeat; only ``.backward()`` is timed (its forward runs
outside the timer), freed memory kept in the process (``_measure.keep_freed_memory``). Prints median ms with the min-max spread and the ratio to the autograd form. Wall times on a
shared CPU are noisy: compare the ratios of one run, and run it more than once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _flagship_shapes import flagship_rows
from _measure import keep_freed_memory

from nemo_ac.models.kernels.dispatch import _weighted_sum_fp32, _WeightedCombine
from nemo_ac.models.layers.router import _Float32Linear


def _autograd_router(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.float32), weight.to(torch.float32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flagship", default="qwen3_6")
    parser.add_argument("--kind", default="qwen_moe_ffn")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the other benchmarks: no fresh mmap (page faults) per large temporary
    (row,) = [r for r in flagship_rows([args.flagship], budget_gflop=120.0) if r.kind == args.kind]
    dtype = getattr(torch, args.dtype)
    t, k, h, e = row.tokens, row.model.moe.num_experts_per_tok, row.model.hidden_size, row.model.moe.num_experts
    print(f"{row.name} {args.dtype}: {t} tokens, top-{k}, hidden {h}, {e} experts (row caps), {args.repeats} repeats")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(t * k, h, generator=gen).to(dtype)
    scores = torch.rand(t, k, generator=gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weight = torch.randn(e, h, generator=gen, requires_grad=True)
    grad_out, grad_logits = torch.randn(t, h, generator=gen).to(dtype), torch.randn(t, e, generator=gen)
    stacks: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
        "autograd": (_weighted_sum_fp32, _autograd_router),  # the combine's autograd form: what compiled graphs trace
        "nemo_ac": (_WeightedCombine.apply, _Float32Linear.apply),
    }
    times: dict[tuple[str, str], list[float]] = {(s, p): [] for s in stacks for p in ("combine", "router")}

    def backward_s(out: torch.Tensor, grad: torch.Tensor) -> float:
        started = time.perf_counter()
        out.backward(grad)
        return time.perf_counter() - started

    for _ in range(args.repeats + 2):  # the first two are warm-up
        for name, (combine, router) in stacks.items():
            out = combine(rows.clone().requires_grad_(), scores.clone().requires_grad_())
            times[name, "combine"].append(backward_s(out, grad_out))
            times[name, "router"].append(backward_s(router(x.clone().requires_grad_(), weight), grad_logits))
            weight.grad = None
    median = {key: statistics.median(v[2:]) for key, v in times.items()}
    for name in stacks:
        parts = []
        for part in ("combine", "router"):
            v = times[name, part][2:]
            ratio = median[name, part] / median["autograd", part]
            parts.append(
                f"{part} {median[name, part] * 1e3:.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}) {ratio:.2f}x"
            )
        total = sum(median[name, p] for p in ("combine", "router")) / sum(
            median["autograd", p] for p in ("combine", "router")
        )
        print(f"{name:9s} " + "; ".join(parts) + f"; both {total:.2f}x autograd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
