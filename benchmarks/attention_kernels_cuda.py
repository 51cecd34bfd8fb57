"""CUDA check of the packed-document attention kernels (run by gpu_check.sh; not used by tests or CI).

FlexAttention (compiled, forward + backward) and the tiled op against the dense SDPA reference on one packed row of
documents with padding, fp32 and bf16: prints the largest output / gradient differences and each kernel's time.
"""

from __future__ import annotations

import time

import torch

from nemo_ac.models.layers.attention import (
    build_attention_inputs,
    flex_packed_attention_op,
    packed_causal_attention,
    tiled_packed_attention,
)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.manual_seed(0)
    lengths = [300, 900, 17, 1500, 1000, 300]  # 4017 tokens, then 79 of padding: one 4096-token row
    docs = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * (4096 - sum(lengths)))
    attn = build_attention_inputs(docs.unsqueeze(0).cuda())
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 4096, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(1, 4096, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(1, 4096, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
        grad = torch.randn_like(q)
        results = {}
        for name, op in (
            ("sdpa", packed_causal_attention),
            ("tiled", tiled_packed_attention),
            ("flex", flex_packed_attention_op),
        ):
            for _ in range(2):  # warm-up (flex compiles)
                out = op(q, k, v, attn)
                grads = torch.autograd.grad(out, (q, k, v), grad)
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = op(q, k, v, attn)
            grads = torch.autograd.grad(out, (q, k, v), grad)
            torch.cuda.synchronize()
            results[name] = (out.float(), [g.float() for g in grads], time.perf_counter() - started)
        ref_out, ref_grads, _ = results["sdpa"]
        for name, (out, grads, seconds) in results.items():
            worst = max(
                [(out - ref_out).abs().max().item()] + [(g - r).abs().max().item() for g, r in zip(grads, ref_grads)]
            )
            print(f"{dtype} {name:5} {seconds * 1e3:8.2f} ms  max |diff| vs sdpa {worst:.2e}")


if __name__ == "__main__":
    main()
