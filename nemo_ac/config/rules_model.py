"""Rules about the model and its data: MoE sizes, shapes per family, the vision-language inputs, MedPix and freezing.

Same contract as every rule in ``validate.RULES``: ``rule(recipe, world_size) -> list[ConfigIssue]``, each issue
naming the key, the bad value and what would work.
"""

from __future__ import annotations

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.hf import family_rules
from nemo_ac.config.schema import RecipeConfig


def check_experts(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    moe = recipe.model.moe
    issues = []
    if moe.num_experts < 1:
        issues.append(ConfigIssue("model.moe.num_experts", f"must be >= 1, got {moe.num_experts}"))
        return issues
    if recipe.parallel.ep >= 1 and moe.num_experts % recipe.parallel.ep != 0:
        issues.append(
            ConfigIssue(
                "model.moe.num_experts",
                f"{moe.num_experts} experts cannot be split over parallel.ep={recipe.parallel.ep}; "
                "num_experts must be a multiple of ep",
            )
        )
    if not 1 <= moe.num_experts_per_tok <= moe.num_experts:
        issues.append(
            ConfigIssue(
                "model.moe.num_experts_per_tok",
                f"{moe.num_experts_per_tok} must be between 1 and num_experts={moe.num_experts}",
            )
        )
    if moe.n_group < 1 or moe.num_experts % moe.n_group != 0:
        issues.append(
            ConfigIssue("model.moe.n_group", f"{moe.n_group} must be >= 1 and divide num_experts={moe.num_experts}")
        )
    elif not 1 <= moe.topk_group <= moe.n_group:
        issues.append(ConfigIssue("model.moe.topk_group", f"{moe.topk_group} must be between 1 and n_group"))
    if moe.bias_update_rate < 0:
        issues.append(
            ConfigIssue("model.moe.bias_update_rate", f"must be >= 0 (0 disables), got {moe.bias_update_rate}")
        )
    elif moe.bias_update_rate > 0 and not moe.score_correction_bias:
        issues.append(
            ConfigIssue(
                "model.moe.bias_update_rate",
                f"{moe.bias_update_rate} updates each router's e_score_correction_bias, but "
                "model.moe.score_correction_bias is false; set it true or bias_update_rate: 0",
            )
        )
    issues += _grouped_mm_alignment(recipe)
    issues += _router_gemm(recipe)
    if recipe.parallel.ep > 1 and not moe.separate_fsdp_unit:
        issues.append(
            ConfigIssue(
                "model.moe.separate_fsdp_unit",
                "expert parallel shards experts on their own mesh; they must be a separate FSDP unit (set true)",
            )
        )
    return issues


# torch._grouped_mm needs 16-byte aligned rows: widths must be multiples of this many elements per compute dtype.
_GROUPED_MM_ALIGNMENT = {"float32": 4, "bfloat16": 8, "float16": 8}


def _grouped_mm_alignment(recipe: RecipeConfig) -> list[ConfigIssue]:
    """An explicit ``experts_impl: grouped_mm`` whose widths the kernel cannot take (``auto`` falls back to loop)."""
    moe = recipe.model.moe
    if moe.experts_impl != "grouped_mm":
        return []
    dtype = recipe.parallel.fsdp.param_dtype
    multiple = _GROUPED_MM_ALIGNMENT[dtype]
    widths = {
        "model.moe.latent_size" if moe.latent_size else "model.hidden_size": moe.latent_size or recipe.model.hidden_size
    }
    widths["model.moe.moe_intermediate_size"] = moe.moe_intermediate_size
    bad = {key: width for key, width in widths.items() if width % multiple}
    if not bad:
        return []
    listed = ", ".join(f"{key}={width}" for key, width in bad.items())
    return [
        ConfigIssue(
            "model.moe.experts_impl",
            f"grouped_mm needs expert widths that are multiples of {multiple} in {dtype} (16-byte rows), but "
            f"{listed}; set model.moe.experts_impl: auto (falls back to loop) or loop",
        )
    ]


def _router_gemm(recipe: RecipeConfig) -> list[ConfigIssue]:
    """An explicit ``router_gemm: bf16x3`` where no fp32 router multiplies bf16 hidden states."""
    moe = recipe.model.moe
    if moe.router_gemm != "bf16x3":
        return []
    if moe.router_dtype != "float32":
        why = "the router runs in the parameter dtype (model.moe.router_dtype: param), with no fp32 GEMM to split"
        fix = "set model.moe.router_dtype: float32 or router_gemm: auto"
    elif recipe.parallel.fsdp.param_dtype != "bfloat16":
        why = (f"it splits the fp32 weight for bf16 hidden states, and parallel.fsdp.param_dtype is "
               f"{recipe.parallel.fsdp.param_dtype}")  # fmt: skip
        fix = "set parallel.fsdp.param_dtype: bfloat16 or model.moe.router_gemm: auto"
    else:
        return []
    return [ConfigIssue("model.moe.router_gemm", f"bf16x3 does not apply: {why}; {fix}")]


def check_model_shape(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    m = recipe.model
    issues = []
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if getattr(m, name) < 1:
            issues.append(ConfigIssue(f"model.{name}", f"must be >= 1, got {getattr(m, name)}"))
    if issues:
        return issues
    if m.num_attention_heads % m.num_key_value_heads != 0:
        issues.append(
            ConfigIssue(
                "model.num_key_value_heads",
                f"{m.num_key_value_heads} must divide num_attention_heads={m.num_attention_heads} (GQA groups)",
            )
        )
    if not 0 <= m.first_k_dense_replace <= m.num_layers:
        issues.append(
            ConfigIssue("model.first_k_dense_replace", f"{m.first_k_dense_replace} must be in [0, num_layers]")
        )
    if not 0.0 < m.partial_rotary_factor <= 1.0:
        issues.append(ConfigIssue("model.partial_rotary_factor", f"{m.partial_rotary_factor} must be in (0, 1]"))
    allowed = set(family_rules(m.family).layer_pattern_chars)
    if m.layer_pattern:
        if not allowed:
            issues.append(ConfigIssue("model.layer_pattern", f"family {m.family!r} takes no layer_pattern"))
        elif set(m.layer_pattern) - allowed:
            issues.append(
                ConfigIssue(
                    "model.layer_pattern",
                    f"{m.layer_pattern!r} has characters {sorted(set(m.layer_pattern) - allowed)}; "
                    f"family {m.family} allows {sorted(allowed)}",
                )
            )
        elif len(m.layer_pattern) != m.num_layers:
            issues.append(
                ConfigIssue(
                    "model.layer_pattern",
                    f"has {len(m.layer_pattern)} layers but model.num_layers={m.num_layers}",
                )
            )
    return issues


def check_model_family(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """Settings the model family cannot build (its ``FamilyRules.problems``: the same rules the builder applies)."""
    return [
        ConfigIssue(problem.key, f"{problem.value!r}: {problem.reason}; {problem.fix()}")
        for problem in family_rules(recipe.model.family).problems(recipe.model)
    ]


def check_data(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    d, m = recipe.data, recipe.model
    issues = []
    if d.kind == "synthetic":
        if d.seq_len < 8:
            issues.append(ConfigIssue("data.seq_len", f"must be >= 8, got {d.seq_len}"))
        if not 1 <= d.min_doc_tokens <= d.max_doc_tokens:
            issues.append(
                ConfigIssue(
                    "data.min_doc_tokens",
                    f"need 1 <= min_doc_tokens ({d.min_doc_tokens}) <= max_doc_tokens ({d.max_doc_tokens})",
                )
            )
        if m.vocab_size < 8:
            issues.append(ConfigIssue("model.vocab_size", f"synthetic tasks need vocab_size >= 8, got {m.vocab_size}"))
        if not d.fixed_length and (d.pad_multiple < 1 or d.seq_len % d.pad_multiple != 0):
            issues.append(
                ConfigIssue("data.pad_multiple", f"{d.pad_multiple} must be >= 1 and divide seq_len={d.seq_len}")
            )
    elif d.kind == "medpix":
        if not family_rules(m.family).vision:
            issues.append(
                ConfigIssue(
                    "data.kind", f"medpix is a vision-language dataset; model.family {m.family!r} has no vision"
                )
            )
        if not d.path:
            issues.append(ConfigIssue("data.path", "medpix needs a local path or HF dataset id"))
        if d.tokenizer in (None, "tiny"):
            issues.extend(_tiny_tokenizer_issues(recipe))
    elif d.kind == "text":
        if not d.path:
            issues.append(
                ConfigIssue("data.path", "text needs a JSONL / parquet file, a save_to_disk dir or an HF dataset id")
            )
        if d.seq_len < 8:
            issues.append(ConfigIssue("data.seq_len", f"must be >= 8, got {d.seq_len}"))
        if d.tokenizer in (None, "tiny") and m.vocab_size < _TINY_TOKENIZER_VOCAB:
            issues.append(
                ConfigIssue(
                    "model.vocab_size",
                    f"{m.vocab_size} is smaller than the tiny tokenizer's {_TINY_TOKENIZER_VOCAB} ids (data.tokenizer: "
                    f"tiny); set model.vocab_size >= {_TINY_TOKENIZER_VOCAB}",
                )
            )
    return issues


# nemo_ac.data.tiny_tokenizer: 262 ids; image placeholder, vision start and vision end are ids 3, 1 and 2.
_TINY_TOKENIZER_VOCAB = 262

_TINY_TOKENIZER_VISION_IDS = (3, 1, 2)


def _tiny_tokenizer_issues(recipe: RecipeConfig) -> list[ConfigIssue]:
    """data.tokenizer: tiny (or null) encodes MedPix with the shipped byte-level tokenizer, whose ids the model's
    embedding table and image placeholder ids must match."""
    m, v = recipe.model, recipe.model.vision
    issues = []
    if m.vocab_size < _TINY_TOKENIZER_VOCAB:
        issues.append(
            ConfigIssue(
                "model.vocab_size",
                f"{m.vocab_size} is smaller than the tiny MedPix tokenizer's {_TINY_TOKENIZER_VOCAB} ids "
                f"(data.tokenizer: tiny); set model.vocab_size >= {_TINY_TOKENIZER_VOCAB}",
            )
        )
    ids = (v.image_token_id, v.vision_start_token_id, v.vision_end_token_id)
    if ids != _TINY_TOKENIZER_VISION_IDS:
        issues.append(
            ConfigIssue(
                "model.vision.image_token_id",
                f"(image, vision_start, vision_end) token ids {ids} differ from the tiny MedPix tokenizer's "
                f"{_TINY_TOKENIZER_VISION_IDS}; set model.vision.image_token_id: 3, vision_start_token_id: 1, "
                "vision_end_token_id: 2 (or use the model's own processor as data.tokenizer)",
            )
        )
    return issues


def check_vision_language(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """A family with a vision tower (Qwen3.5/3.6): M-RoPE sections and vision-tower shapes the builder needs, and
    a tower for image data. (The builder raises on the same problems, but only after the process group exists.)"""
    m, v, data = recipe.model, recipe.model.vision, recipe.data
    if not family_rules(m.family).vision:
        return []
    issues = []
    rotary_half = int(m.head_dim * m.partial_rotary_factor) // 2
    if m.mrope_section and (len(m.mrope_section) != 3 or sum(m.mrope_section) != rotary_half):
        issues.append(
            ConfigIssue(
                "model.mrope_section",
                f"{m.mrope_section} must be 3 numbers (temporal, height, width) summing to rotary_dim/2 = "
                f"{rotary_half} (model.head_dim {m.head_dim} * partial_rotary_factor {m.partial_rotary_factor} / 2)",
            )
        )
    if v.depth > 0 and not m.mrope_section:
        issues.append(
            ConfigIssue(
                "model.mrope_section",
                f"is required with a vision tower (model.vision.depth={v.depth}): image tokens rotate by their "
                f"temporal/height/width positions; give 3 numbers summing to {rotary_half} ([11, 11, 10] for Qwen3.6)",
            )
        )
    if v.depth > 0:
        head_dim = v.hidden_size // v.num_heads if v.num_heads > 0 else 0
        if v.num_heads < 1 or v.hidden_size % v.num_heads or head_dim < 4 or head_dim % 4:
            issues.append(
                ConfigIssue(
                    "model.vision.hidden_size",
                    f"{v.hidden_size} / num_heads {v.num_heads} must be a whole head size that is a multiple of 4 "
                    "(the ViT's 2D rotary embedding splits each head into row and column halves)",
                )
            )
        side = round(max(v.num_position_embeddings, 0) ** 0.5)
        if v.num_position_embeddings < 1 or side * side != v.num_position_embeddings:
            issues.append(
                ConfigIssue(
                    "model.vision.num_position_embeddings",
                    f"{v.num_position_embeddings} must be a perfect square (a square table of learned positions, "
                    "resampled to each image's patch grid), e.g. 2304 = 48 x 48",
                )
            )
    if data.kind == "medpix" and v.depth < 1:
        issues.append(
            ConfigIssue(
                "model.vision.depth",
                f"{v.depth}: data.kind medpix feeds images, which need a vision tower; set model.vision.depth >= 1",
            )
        )
    return issues


def check_freeze(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    f, m = recipe.train.freeze, recipe.model
    family_has_vision = family_rules(m.family).vision
    has_vision = family_has_vision and m.vision.depth > 0
    issues = []
    for group in ("vision_tower", "vision_merger"):
        if getattr(f, group) and not has_vision:
            fix = "; set model.vision.depth >= 1" if family_has_vision else ""
            issues.append(ConfigIssue(f"train.freeze.{group}", f"model has no vision tower (family {m.family}){fix}"))
    text_frozen = f.embeddings and f.language_model
    if text_frozen and (not has_vision or (f.vision_tower and f.vision_merger)):
        issues.append(
            ConfigIssue(
                "train.freeze.language_model",
                "freezing everything leaves nothing to train; leave at least one of train.freeze.* false",
            )
        )
    return issues
