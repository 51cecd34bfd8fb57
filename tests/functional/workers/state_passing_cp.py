"""torchrun worker (2 or 4 gloo ranks): state-passing ring CP of Gated DeltaNet and Mamba-2 against the full op.

Every rank builds the same full fp64 inputs from one seed and computes the single-process op
(``packed_gated_delta_rule`` / ``mamba2_ssm``) on the full rows with a random output weighting as the loss; then it
runs the ring op (``state_passing.ring_linear_attention`` / ``ring_ssm``) on its head-tail shard and compares its
outputs and input gradients at its positions, and the conv / bias / D / dt parameter gradients summed over ranks
(as FSDP sums them). Documents: row 0 has one crossing every slice boundary, one starting exactly at a slice start,
short ones and a padding run; row 1 is one document over the whole row (the state crosses every rank). Slices are
not a multiple of the chunk size (padded chunks inside the slices).

Prints ``rank R: <check> max_abs_diff=...`` per check; exits non-zero on the first difference above 1e-10.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.distributed as dist

from nemo_ac.distributed.context_parallel.sharding import ring_attention_inputs, shard_positions, shard_sequence
from nemo_ac.distributed.context_parallel.state_passing import ring_linear_attention, ring_ssm
from nemo_ac.models.kernels.gated_delta_rule import packed_gated_delta_rule
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, mamba2_ssm
from nemo_ac.runtime import destroy_distributed, exit_process

TOL = 1e-10
SLICE = 13  # tokens per slice; chunk size 5 pads every slice's last chunk
CHUNK = 5


def _document_ids(seq_len: int) -> torch.Tensor:
    """Row 0: [0..] crossing slices, a document starting exactly at the slice start 2*SLICE, a padding run; row 1:
    one document."""
    first = torch.empty(seq_len, dtype=torch.int64)
    bounds = [0, SLICE + 4, 2 * SLICE, 2 * SLICE + 3, 2 * SLICE + 5, seq_len - 6, seq_len]
    for doc, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        first[lo:hi] = doc
    first[seq_len - 6 :] = -1
    return torch.stack((first, torch.zeros(seq_len, dtype=torch.int64)))


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want).abs().max().item()
    print(f"rank {dist.get_rank()}: {name} max_abs_diff={diff:.3e}", flush=True)
    if not diff <= TOL:
        raise AssertionError(f"{name}: max abs diff {diff} > {TOL}")


def _leaves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone().requires_grad_() for k, t in tensors.items()}


def _check(name, full_op, ring_op, seq_inputs, params, docs, cp, rank, group) -> None:
    """``full_op(seq, params, attn)`` on the full rows vs ``ring_op`` on this rank's shard."""
    seq_len = docs.shape[1]
    gen = torch.Generator().manual_seed(7)
    full_seq, full_params = _leaves(seq_inputs), _leaves(params)
    out = full_op(full_seq, full_params, build_attention_inputs(docs))
    weight = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    (out * weight).sum().backward()

    positions = shard_positions(seq_len, cp_size=cp, cp_rank=rank, cp_type="ring")
    local_seq = _leaves({k: shard_sequence(t, positions) for k, t in seq_inputs.items()})
    local_params = _leaves(params)
    attn = build_attention_inputs(shard_sequence(docs, positions))
    attn.context_parallel = ring_attention_inputs(docs, cp_size=cp, cp_rank=rank)
    local_out = ring_op(local_seq, local_params, attn, group=group, cp_rank=rank, cp_size=cp)
    (local_out * shard_sequence(weight, positions)).sum().backward()

    _report(f"{name} out", local_out, shard_sequence(out, positions))
    for key, t in local_seq.items():
        _report(f"{name} grad {key}", t.grad, shard_sequence(full_seq[key].grad, positions))
    for key, t in local_params.items():
        summed = t.grad.clone()
        dist.all_reduce(summed, group=group)
        _report(f"{name} grad {key} (sum over ranks)", summed, full_params[key].grad)


def check_gated_deltanet(docs, cp, rank, group) -> None:
    b, s = docs.shape
    hk, hv, dk, dv, kernel = 2, 4, 6, 5, 4
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    seq = {
        "q": rand(b, s, hk, dk),
        "k": rand(b, s, hk, dk),
        "v": rand(b, s, hv, dv),
        "g": -torch.rand(b, s, hv, generator=gen, dtype=torch.float64) * 0.3,
        "beta": torch.rand(b, s, hv, generator=gen, dtype=torch.float64),
    }
    params = {"wq": rand(hk, dk, kernel, scale=0.5), "wk": rand(hk, dk, kernel, scale=0.5), "wv": rand(hv, dv, kernel)}

    def full(t, p, attn):
        conv = (p["wq"], p["wk"], p["wv"])
        return packed_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], conv, attn, chunk_size=CHUNK)

    def ring(t, p, attn, **kw):
        conv = (p["wq"], p["wk"], p["wv"])
        return ring_linear_attention(t["q"], t["k"], t["v"], t["g"], t["beta"], conv, attn, chunk_size=CHUNK, **kw)

    _check("gated_deltanet", full, ring, seq, params, docs, cp, rank, group)


def check_mamba2(docs, cp, rank, group) -> None:
    b, s = docs.shape
    nh, hd, groups, n, kernel = 4, 3, 2, 5, 4
    gen = torch.Generator().manual_seed(1)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    seq = {"x": rand(b, s, nh, hd), "B": rand(b, s, groups, n), "C": rand(b, s, groups, n), "dt": rand(b, s, nh)}
    params = {
        "wx": rand(nh, hd, kernel, scale=0.5),
        "bx": rand(nh, hd),
        "wb": rand(groups, n, kernel, scale=0.5),
        "bb": rand(groups, n),
        "wc": rand(groups, n, kernel, scale=0.5),
        "bc": rand(groups, n),
        "D": rand(nh),
        "dt_bias": rand(nh),
    }
    A = -torch.linspace(0.2, 1.5, nh, dtype=torch.float64)

    def core(p):
        return Mamba2CoreParams(
            conv_x_weight=p["wx"],
            conv_x_bias=p["bx"],
            conv_b_weight=p["wb"],
            conv_b_bias=p["bb"],
            conv_c_weight=p["wc"],
            conv_c_bias=p["bc"],
            A=A,
            D=p["D"],
            dt_bias=p["dt_bias"],
            chunk_size=CHUNK,
            dt_min=1e-3,
        )

    def full(t, p, attn):
        return mamba2_ssm(t["x"], t["B"], t["C"], t["dt"], core(p), attn)

    def ring(t, p, attn, **kw):
        return ring_ssm(t["x"], t["B"], t["C"], t["dt"], core(p), attn, **kw)

    _check("mamba2", full, ring, seq, params, docs, cp, rank, group)


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    docs = _document_ids(2 * cp * SLICE)
    try:
        check_gated_deltanet(docs, cp, rank, group)
        check_mamba2(docs, cp, rank, group)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        exit_process(1)
    destroy_distributed()


if __name__ == "__main__":
    main()
