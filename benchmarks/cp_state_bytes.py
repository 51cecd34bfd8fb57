"""Bytes ring CP moves per layer and rank: the recurrent mixers' state exchange against ring attention's K/V.

    python benchmarks/cp_state_bytes.py                 # flagship shapes, S = the recipe's and 32k, cp 2 / 4 / 8
    python benchmarks/cp_state_bytes.py --seq-lens 131072 --cp 8

State passing (``nemo_ac/distributed/context_parallel/state_passing.py``) all-gathers, per layer, each slice's final
state (and Gated DeltaNet's transition; Mamba-2's scalar decay) in fp32 plus the conv's K-1 halo tokens in the
activation dtype; its backward reduce-scatters the same sizes. A ring all-gather sends ``(cp-1)`` pieces per rank.
Ring attention sends the rank's K/V block (``S/cp`` tokens) ``cp-1`` times forward, and dK/dV the same way back.

"measured" runs the real ring op once per mixer at the flagship's head shapes on a 1-rank gloo group (the pieces a
rank contributes do not depend on cp or S) and sums the ``nbytes`` of what it hands to the all-gather; "formula" is
the closed form in the table header. Both must agree; the script fails otherwise. Writes
benchmarks/results/cp_state_bytes.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, markdown_table, write_json

from nemo_ac.config import load_recipe
from nemo_ac.distributed.context_parallel import state_passing
from nemo_ac.distributed.context_parallel.sharding import ring_attention_inputs
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams

ROOT = RESULTS_DIR.parents[1]
FLAGSHIPS = {
    "qwen3_6_35b_a3b": ROOT / "recipes" / "qwen3_6_35b_medpix_ep8cp2_4k.yaml",
    "nemotron_super_v3": ROOT / "recipes" / "nemotron_super_v3_te_deepep.yaml",
}
ACT_BYTES = 2  # bf16 activations (the flagships' param dtype)
MIB = 2**20


def _measure(op, *args) -> int:
    """Bytes this rank hands to the op's all-gathers (its own pieces), from the real tensors."""
    sent = []
    real = state_passing.funcol.all_gather_single_autograd

    def recording(x, *rest, **kw):
        sent.append(x.numel() * x.element_size())
        return real(x, *rest, **kw)

    state_passing.funcol.all_gather_single_autograd = recording
    try:
        with torch.no_grad():
            op(*args)
    finally:
        state_passing.funcol.all_gather_single_autograd = real
    return sum(sent)


def _attn(seq_len: int) -> object:
    docs = torch.zeros(1, seq_len, dtype=torch.int64)
    attn = build_attention_inputs(docs)
    attn.context_parallel = ring_attention_inputs(docs, cp_size=1, cp_rank=0)
    return attn


def gdn_piece(model, group) -> tuple[int, int, str]:
    la = model.linear_attention
    hk, hv, dk, dv, k = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel
    s = 2 * la.chunk_size
    dt = torch.bfloat16
    q, kk = torch.randn(1, s, hk, dk, dtype=dt), torch.randn(1, s, hk, dk, dtype=dt)
    v = torch.randn(1, s, hv, dv, dtype=dt)
    g, beta = -torch.rand(1, s, hv), torch.rand(1, s, hv, dtype=dt)
    w = (torch.randn(hk, dk, k, dtype=dt), torch.randn(hk, dk, k, dtype=dt), torch.randn(hv, dv, k, dtype=dt))
    op = functools.partial(state_passing.ring_linear_attention, group=group, cp_rank=0, cp_size=1)
    measured = _measure(op, q, kk, v, g, beta, w, _attn(s))
    channels = 2 * hk * dk + hv * dv
    formula = 2 * hv * dk * (dv + dk) * 4 + 2 * (k - 1) * channels * ACT_BYTES
    return measured, formula, f"2 Hv dk (dv+dk) 4 + 2 (K-1) C {ACT_BYTES}; Hv={hv} dk={dk} dv={dv} C={channels}"


def mamba_piece(model, group) -> tuple[int, int, str]:
    m = model.mamba
    nh, hd, g, n, k = m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel
    s = 2 * m.chunk_size
    dt = torch.bfloat16
    params = Mamba2CoreParams(
        conv_x_weight=torch.randn(nh, hd, k, dtype=dt),
        conv_x_bias=None,
        conv_b_weight=torch.randn(g, n, k, dtype=dt),
        conv_b_bias=None,
        conv_c_weight=torch.randn(g, n, k, dtype=dt),
        conv_c_bias=None,
        A=-torch.rand(nh),
        D=torch.ones(nh),
        dt_bias=torch.zeros(nh),
        chunk_size=m.chunk_size,
    )
    x = torch.randn(1, s, nh, hd, dtype=dt)
    b, c = torch.randn(1, s, g, n, dtype=dt), torch.randn(1, s, g, n, dtype=dt)
    op = functools.partial(state_passing.ring_ssm, group=group, cp_rank=0, cp_size=1)
    measured = _measure(op, x, b, c, torch.randn(1, s, nh, dtype=dt), params, _attn(s))
    channels = nh * hd + 2 * g * n
    formula = 2 * nh * (hd * n + 1) * 4 + 2 * (k - 1) * channels * ACT_BYTES
    return measured, formula, f"2 nh (hd N + 1) 4 + 2 (K-1) C {ACT_BYTES}; nh={nh} hd={hd} N={n} C={channels}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="recipe,32768", help="comma list; 'recipe' = the recipe's own length")
    parser.add_argument("--cp", default="2,4,8")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD
    rows, records = [], []
    for name, path in FLAGSHIPS.items():
        recipe = load_recipe(str(path))
        model = recipe.model
        data = recipe.data
        own = data.max_length if data.kind == "medpix" else data.seq_len
        measured, formula, text = (gdn_piece if model.family == "qwen3_5_moe" else mamba_piece)(model, group)
        if measured != formula:
            raise SystemExit(f"{name}: measured {measured} B != formula {formula} B ({text})")
        mixer = "Gated DeltaNet" if model.family == "qwen3_5_moe" else "Mamba-2"
        kv_token = 2 * model.num_key_value_heads * model.head_dim * ACT_BYTES  # K and V of one token
        lengths = [own if v == "recipe" else int(v) for v in args.seq_lens.split(",")]
        for seq, cp in ((seq, int(c)) for seq in lengths for c in args.cp.split(",")):
            state = (cp - 1) * measured
            ring = (cp - 1) * (seq // cp) * kv_token
            record = {
                "flagship": name,
                "mixer": mixer,
                "seq_len": seq,
                "cp": cp,
                "piece_bytes": measured,
                "state_bytes_fwd": state,
                "ring_kv_bytes_fwd": ring,
                "formula": text,
            }
            records.append(record)
            rows.append(
                [
                    name,
                    mixer,
                    f"{seq}",
                    f"{cp}",
                    f"{measured / MIB:.2f}",
                    f"{state / MIB:.2f}",
                    f"{ring / MIB:.2f}",
                    f"{state / ring:.2f}",
                ]
            )
    header = [
        "flagship",
        "recurrent mixer",
        "S",
        "cp",
        "own pieces (MiB, measured = formula)",
        "state exchange sent / rank / layer, fwd (MiB)",
        "ring attention K/V sent / rank / layer, fwd (MiB)",
        "state / K/V",
    ]
    text = markdown_table(headers=header, rows=rows)
    formulas = dict.fromkeys((r["flagship"], r["formula"]) for r in records)  # one line per flagship
    notes = "\n".join(f"- {flagship}: {formula}" for flagship, formula in formulas)
    text += (
        "\n\nBackward moves the same again in both columns (reduce-scatter of the state gradients; dK/dV around the"
        f" ring). State pieces are fp32 (exact carry), halo and K/V bf16; B = 1 row per micro batch.\n{notes}"
    )
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "cp_state_bytes.md").write_text(text + "\n")
    write_json(RESULTS_DIR / "cp_state_bytes.json", payload={"records": records}, table=text, wall_s=0.0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
