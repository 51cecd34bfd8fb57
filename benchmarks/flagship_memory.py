"""One flagship row's memory only: tracked peak and held bytes of transformers, nemo_ac no-AC and nemo_ac under the
recipe's activation checkpointing, on the same weights and input (no timing, no FLOP counting: minutes where the
full ``flagship_layers.py`` row takes many on a loaded machine).

    python benchmarks/flagship_memory.py qwen3_6 qwen_linear_mixer bfloat16

Peak: ``_measure.peak_bytes`` (profiler allocation events on CPU), the second of two steps. Held:
``_measure.held_bytes`` plus the input, as in ``flagship_layers.py``. Prints one line per stack with the ratios to
transformers (peak) and to transformers without AC (held).
"""

from __future__ import annotations

import argparse
import sys

import _flagship_peers as peers
import flagship_layers as fl
import torch
from _flagship_shapes import flagship_rows
from _measure import held_bytes, keep_freed_memory, peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flagship")
    parser.add_argument("kind")
    parser.add_argument("dtype", choices=sorted(fl.DTYPES))
    parser.add_argument("--budget-gflop", type=float, default=120.0, help="the caps of flagship_layers.py's rows")
    args = parser.parse_args(argv)
    keep_freed_memory()
    dtype, device = fl.DTYPES[args.dtype], torch.device("cpu")
    (row,) = [r for r in flagship_rows([args.flagship], budget_gflop=args.budget_gflop) if r.kind == args.kind]
    torch.manual_seed(0)
    x = torch.randn(1, row.tokens, row.model.hidden_size, dtype=dtype)
    grad = torch.randn_like(x)
    found: dict[str, tuple[int, int]] = {}

    def measure(name: str, fn: object, params: list[torch.nn.Parameter]) -> None:
        def step() -> None:
            fn(x.detach().requires_grad_()).backward(grad)
            for p in params:
                p.grad = None

        peak_bytes(step, device=device)  # warm-up
        held = held_bytes(lambda: fn(x.detach().requires_grad_()), device=device) + x.nbytes
        found[name] = (peak_bytes(step, device=device), held)

    reference, peer = fl.reference_and_peer(row, dtype=dtype, device=device)
    measure("transformers", peer.run, list(peer.module.parameters()))
    del peer, reference
    for name, ac in (("nemo_ac no-AC", "none"), (f"nemo_ac {row.ac_mode} AC", row.ac_mode)):
        layer = fl._build_layer(row, experts_impl="auto", dtype=dtype, device=device, attention=row.attention_kernel)
        fn = peers.nemo_sub_block(
            row.kind, model_cfg=row.model, nemo_layer=layer, seq_len=row.tokens, dtype=dtype, device=device
        )
        measure(name, fl._with_ac(fn, ac), list(layer.parameters()))
    hf_peak, hf_held = found["transformers"]
    for name, (peak, held) in found.items():
        print(
            f"{row.name} {args.dtype} {name}: peak {peak / 2**20:.1f} MiB ({peak / hf_peak:.2f}x transformers), "
            f"held {held / 2**20:.1f} MiB ({held / hf_held:.2f}x transformers no-AC)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
