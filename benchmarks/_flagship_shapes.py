"""What one GPU rank of each flagship recipe computes per decoder sub-block, read from the recipe itself.

Not a benchmark by itself: ``flagship_layers.py`` times the rows this module describes. Per-rank shapes follow the
recipe's layout:

- sequence: ``data.max_length`` (MedPix) or ``data.seq_len``, one row per micro batch (``micro_batch_size`` 1);
- mixer rows (attention, Gated DeltaNet, Mamba-2) under ulysses CP run over the FULL row with heads / cp (what the
  rank computes between its two all-to-alls; the projections cost the same as full heads over S / cp tokens);
- FFN rows run over the rank's S / cp tokens; routed experts are the rank's ``num_experts / ep`` local experts and
  each receives ``tokens x top_k / local experts`` rows (balanced routing: a rank's experts receive as many rows in
  total as its tokens send out, whatever ep is).

Where a row does not fit this machine's budget (memory, or ``budget_gflop`` of counted FLOPs per forward +
backward), it is capped and the cap is printed: first the parallel unit (local experts, keeping rows per expert by
scaling top-k with them; heads, keeping the sequence and head_dim), then tokens. fp32 and bf16 use the same caps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.config.schema import ModelConfig, RecipeConfig
from nemo_ac.distributed.plan.kernels import recipe_kernels

ROOT = Path(__file__).resolve().parents[1]

# Flagship recipe -> the world size its header documents (nemo-ac validate ... --world-size N).
FLAGSHIPS = {
    "qwen3_6": (ROOT / "recipes" / "qwen3_6_35b_medpix_ep8cp2_4k.yaml", 8),
    "glm_4_5_air": (ROOT / "recipes" / "glm_4_5_air_cp4_ulysses.yaml", 8),
    "nemotron_super_v3": (ROOT / "recipes" / "nemotron_super_v3_te_deepep.yaml", 64),
}

# Sub-block kinds per family: (kind, label). Kinds are benchmarks._flagship_peers.KINDS.
FAMILY_ROWS = {
    "qwen3_5_moe": [
        ("qwen_linear_mixer", "L: Gated DeltaNet"),
        ("qwen_attention_mixer", "A: gated attention"),
        ("qwen_moe_ffn", "MoE FFN"),
    ],
    "glm4_moe": [
        ("glm_attention_mixer", "attention"),
        ("glm_dense_ffn", "dense FFN (layer 0)"),
        ("glm_moe_ffn", "MoE FFN"),
    ],
    "nemotron_h": [
        ("nemotron_mamba", "M: Mamba-2"),
        ("nemotron_attention", "*: attention"),
        ("nemotron_moe", "E: latent MoE"),
    ],
}
_MIXERS = {"qwen_linear_mixer", "qwen_attention_mixer", "glm_attention_mixer", "nemotron_mamba", "nemotron_attention"}
_MOE = {"qwen_moe_ffn", "glm_moe_ffn", "nemotron_moe"}


@dataclass
class Row:
    """One sub-block as one rank runs it, possibly capped."""

    flagship: str
    recipe: str
    kind: str
    label: str
    model: ModelConfig  # the (per-rank, capped) architecture the row is built from
    layer_idx: int
    tokens: int  # sequence length of the row's one micro batch
    ac_mode: str  # activation_checkpointing.mode of the recipe
    real: dict[str, int]  # the uncapped per-rank numbers
    caps: list[str] = field(default_factory=list)
    # The recipe's KernelPlan on the benchmark's device (nemo_ac.distributed.plan.kernels.recipe_kernels): the
    # attention op nemo_ac's stacks run, and the plan's start-up line.
    attention_kernel: str = "sdpa"
    kernels: str = ""

    @property
    def name(self) -> str:
        return f"{self.flagship} {self.label}"

    def cap_text(self) -> str:
        return "; ".join(self.caps) if self.caps else "none (real per-rank shape)"


def recipe_sequence(recipe: RecipeConfig) -> int:
    return recipe.data.max_length if recipe.data.kind == "medpix" else recipe.data.seq_len


def _layer_for(model: ModelConfig, kind: str) -> tuple[ModelConfig, int]:
    """A 2-3 layer architecture holding ``kind`` at the returned index (tiny vocab: embeddings are not timed)."""
    small = {"vocab_size": 512, "tie_word_embeddings": False}
    if model.family == "qwen3_5_moe":
        vision = dataclasses.replace(model.vision, depth=0)
        cfg = dataclasses.replace(model, num_layers=2, layer_pattern="LA", vision=vision, **small)
        return cfg, 1 if kind == "qwen_attention_mixer" else 0
    if model.family == "glm4_moe":
        cfg = dataclasses.replace(model, num_layers=2, first_k_dense_replace=1, **small)
        return cfg, 0 if kind == "glm_dense_ffn" else 1
    cfg = dataclasses.replace(model, num_layers=3, layer_pattern="M*E", **small)
    return cfg, {"nemotron_mamba": 0, "nemotron_attention": 1, "nemotron_moe": 2}[kind]


def _heads_over_cp(model: ModelConfig, cp: int) -> ModelConfig:
    """Ulysses: each rank holds heads / cp of every mixer (attention, GDN, Mamba-2 heads and groups)."""
    if cp == 1:
        return model
    lin = model.linear_attention
    mamba = model.mamba
    return dataclasses.replace(
        model,
        num_attention_heads=model.num_attention_heads // cp,
        num_key_value_heads=max(1, model.num_key_value_heads // cp),
        linear_attention=dataclasses.replace(
            lin, num_key_heads=lin.num_key_heads // cp, num_value_heads=lin.num_value_heads // cp
        ),
        mamba=dataclasses.replace(mamba, num_heads=mamba.num_heads // cp, n_groups=max(1, mamba.n_groups // cp)),
    )


def gflop_estimate(row: Row) -> float:
    """Matmul FLOPs of forward + backward (3x forward) with causal attention pairs: what the caps are sized by
    (the benchmark reports FlopCounterMode's count, not this)."""
    m, t = row.model, row.tokens
    h = m.hidden_size
    if row.kind in ("qwen_attention_mixer", "glm_attention_mixer", "nemotron_attention"):
        q = m.num_attention_heads * m.head_dim * (2 if m.attn_output_gate else 1)
        kv = 2 * m.num_key_value_heads * m.head_dim
        proj = 2 * t * h * (q + kv + m.num_attention_heads * m.head_dim)
        core = 4 * (t * (t + 1) // 2) * m.num_attention_heads * m.head_dim
        fwd = proj + core
    elif row.kind == "qwen_linear_mixer":
        la = m.linear_attention
        key, value = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        proj = 2 * t * h * (2 * key + 2 * value + 2 * la.num_value_heads + value)
        core = (
            2 * t * la.num_value_heads * (3 * la.chunk_size * la.key_head_dim + 2 * la.key_head_dim * la.value_head_dim)
        )
        fwd = proj + core
    elif row.kind == "nemotron_mamba":
        mb = m.mamba
        inner = mb.num_heads * mb.head_dim
        proj = 2 * t * h * (2 * inner + 2 * mb.n_groups * mb.state_size + mb.num_heads + inner)
        core = 2 * t * mb.num_heads * (2 * mb.chunk_size * mb.head_dim + 3 * mb.head_dim * mb.state_size)
        fwd = proj + core
    elif row.kind == "glm_dense_ffn":
        fwd = 2 * t * h * 3 * m.intermediate_size
    else:
        moe = m.moe
        width = moe.latent_size or h
        per_row = 2 * width * moe.moe_intermediate_size * (3 if moe.activation == "silu" else 2)
        shared_mult = 3 if moe.activation == "silu" else 2
        shared = 2 * t * h * moe.shared_expert_intermediate_size * shared_mult
        latent = 4 * t * h * moe.latent_size
        fwd = t * moe.num_experts_per_tok * per_row + shared + latent + 2 * t * h * moe.num_experts
    return 3 * fwd / 1e9


def parameter_bytes(row: Row, *, bytes_per_param: int = 4) -> int:
    """Weights + gradients of the row's routed experts (the part that can exceed memory)."""
    if row.kind not in _MOE:
        return 0
    moe = row.model.moe
    width = moe.latent_size or row.model.hidden_size
    rows_in = 2 * moe.moe_intermediate_size if moe.activation == "silu" else moe.moe_intermediate_size
    return 2 * bytes_per_param * moe.num_experts * (rows_in + moe.moe_intermediate_size) * width


def _halve_unit(row: Row, *, floor: bool = True) -> bool:
    """Halve the row's parallel unit (experts, heads, dense FFN width); False when at its minimum. With ``floor``
    MoE rows keep at least ``local_experts / top_k`` experts (and 4), where top-k 1 still gives each expert its
    real rows."""
    m = row.model
    if row.kind == "glm_dense_ffn":
        if m.intermediate_size <= (row.real["ffn_width"] // 8 if floor else 128) or m.intermediate_size % 2:
            return False
        row.model = dataclasses.replace(m, intermediate_size=m.intermediate_size // 2)
        return True
    if row.kind in _MOE:
        moe = m.moe
        # at least 4: transformers' grouped router takes a top-2 inside each group
        least = max(4, -(-row.real["local_experts"] // row.real["top_k"])) if floor else 4
        if moe.num_experts <= least or moe.num_experts % 2:
            return False
        experts = moe.num_experts // 2
        top_k = min(experts, max(1, round(row.real["top_k"] * experts / row.real["local_experts"])))
        row.model = dataclasses.replace(m, moe=dataclasses.replace(moe, num_experts=experts, num_experts_per_tok=top_k))
        return True
    if row.kind in ("qwen_attention_mixer", "glm_attention_mixer", "nemotron_attention"):
        if m.num_attention_heads <= 1 or m.num_attention_heads % 2:
            return False
        heads = m.num_attention_heads // 2
        kv = max(1, min(m.num_key_value_heads, heads * row.real["kv_heads"] // row.real["heads"]))
        while heads % kv:
            kv -= 1
        row.model = dataclasses.replace(m, num_attention_heads=heads, num_key_value_heads=kv)
        return True
    if row.kind == "qwen_linear_mixer":
        la = m.linear_attention
        if la.num_key_heads <= 1:
            return False
        la = dataclasses.replace(la, num_key_heads=la.num_key_heads // 2, num_value_heads=la.num_value_heads // 2)
        row.model = dataclasses.replace(m, linear_attention=la)
        return True
    if row.kind == "nemotron_mamba":
        mb = m.mamba
        if mb.num_heads <= 1 or mb.num_heads % 2:
            return False
        heads = mb.num_heads // 2
        groups = max(1, mb.n_groups // 2) if mb.n_groups > 1 else 1
        row.model = dataclasses.replace(m, mamba=dataclasses.replace(mb, num_heads=heads, n_groups=groups))
        return True
    return False


def _describe_caps(row: Row) -> list[str]:
    m, real, caps = row.model, row.real, []
    if row.kind in _MOE:
        rows_real = real["tokens"] * real["top_k"] // real["local_experts"]
        rows_now = row.tokens * m.moe.num_experts_per_tok // m.moe.num_experts
        if (m.moe.num_experts, m.moe.num_experts_per_tok, rows_now) != (
            real["local_experts"],
            real["top_k"],
            rows_real,
        ):
            caps.append(
                f"experts {m.moe.num_experts} of {real['local_experts']} local, top-k {m.moe.num_experts_per_tok} "
                f"of {real['top_k']}, rows/expert {rows_now} of {rows_real}"
            )
    if row.kind == "glm_dense_ffn" and m.intermediate_size != real["ffn_width"]:
        caps.append(f"FFN width {m.intermediate_size} of {real['ffn_width']}")
    attention = row.kind in ("qwen_attention_mixer", "glm_attention_mixer", "nemotron_attention")
    if attention and m.num_attention_heads != real["heads"]:
        caps.append(f"heads {m.num_attention_heads}/{m.num_key_value_heads} of {real['heads']}/{real['kv_heads']}")
    if row.kind == "qwen_linear_mixer" and m.linear_attention.num_value_heads != real["heads"]:
        caps.append(f"value heads {m.linear_attention.num_value_heads} of {real['heads']}")
    if row.kind == "nemotron_mamba" and m.mamba.num_heads != real["heads"]:
        caps.append(f"heads {m.mamba.num_heads} of {real['heads']} (groups {m.mamba.n_groups})")
    if row.tokens != real["tokens"]:
        caps.append(f"tokens {row.tokens} of {real['tokens']}")
    return caps


def flagship_rows(
    names: list[str] | None = None,
    *,
    budget_gflop: float | None,
    max_param_bytes: int = 6 << 30,
    device_type: str = "cpu",
) -> list[Row]:
    """Every sub-block row of the named flagships (all by default), capped to ``budget_gflop`` (None: uncapped
    except for memory) and ``max_param_bytes`` of expert weights + gradients; kernels as the recipe's plan
    resolves them on ``device_type``."""
    rows = []
    for flagship in names or list(FLAGSHIPS):
        path, world_size = FLAGSHIPS[flagship]
        recipe = load_recipe(path)
        layout = validate_recipe(recipe, world_size=world_size, source=str(path))
        kernels = recipe_kernels(recipe, device_type=device_type)
        seq, cp = recipe_sequence(recipe), layout.cp
        if cp > 1 and recipe.parallel.cp_type != "ulysses":
            raise NotImplementedError(f"{flagship}: per-rank rows for cp_type={recipe.parallel.cp_type}")
        for kind, label in FAMILY_ROWS[recipe.model.family]:
            base, layer_idx = _layer_for(recipe.model, kind)
            mixer = kind in _MIXERS
            model = _heads_over_cp(base, cp) if mixer else base
            tokens = seq if mixer else seq // cp
            local_experts = base.moe.num_experts // layout.ep
            if kind in _MOE:  # the router picks among the local experts (at most all of them per token)
                top_k = min(base.moe.num_experts_per_tok, local_experts)
                local = dataclasses.replace(model.moe, num_experts=local_experts, num_experts_per_tok=top_k)
                model = dataclasses.replace(model, moe=local)
            heads = {
                "qwen_linear_mixer": model.linear_attention.num_value_heads,
                "nemotron_mamba": model.mamba.num_heads,
            }.get(kind, model.num_attention_heads)
            real = {
                "tokens": tokens,
                "local_experts": local_experts,
                "top_k": base.moe.num_experts_per_tok,
                "heads": heads,
                "kv_heads": model.num_key_value_heads,
                "ffn_width": model.intermediate_size,
            }
            row = Row(
                flagship=recipe.name,
                recipe=str(path.relative_to(ROOT)),
                kind=kind,
                label=label,
                model=model,
                layer_idx=layer_idx,
                tokens=tokens,
                ac_mode=recipe.activation_checkpointing.mode,
                real=real,
                attention_kernel=kernels.attention.value,
                kernels=kernels.summary_line(),
            )
            while parameter_bytes(row) > max_param_bytes and _halve_unit(row):
                pass
            while budget_gflop is not None and gflop_estimate(row) > budget_gflop:
                if _halve_unit(row):  # first the unit, down to its floor
                    continue
                if row.tokens > 256:  # then tokens
                    row.tokens //= 2
                elif not _halve_unit(row, floor=False):  # then the unit below its floor
                    break
            row.caps = _describe_caps(row)
            rows.append(row)
    return rows
