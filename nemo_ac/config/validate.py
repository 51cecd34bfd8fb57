"""Cross-field rules: impossible combinations fail here, before any process group starts.

Each rule is a small function ``rule(recipe, world_size) -> list[ConfigIssue]`` in ``RULES``; every message names
the key, the bad value and what would work. ``validate_recipe`` runs them all and resolves the parallel layout
(``config.layout``: the layout, its sizes, context-parallel and batching rules). The model and data rules live in
``rules_model``, the ``_target_`` allowlist and ``extensions.allow`` in ``rules_extensions``, DeepEP's in
``deepep``, the mixer kernels' in ``mixer_kernels``; what differs by model family is what the family declares
(``config.families.FamilyRules``, asked through ``config.hf.family_rules``);
``environment.check_environment`` separately verifies that the optional extras a recipe asks for are importable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nemo_ac.config.deepep import check_deepep
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.layout import (
    ParallelLayout,
    check_batching,
    check_context_parallel,
    check_parallel_sizes,
    resolve_layout,
)
from nemo_ac.config.mixer_kernels import check_mixer_kernels
from nemo_ac.config.rules_extensions import check_extensions, check_target
from nemo_ac.config.rules_model import (
    check_data,
    check_experts,
    check_freeze,
    check_model_family,
    check_model_shape,
    check_vision_language,
)
from nemo_ac.config.schema import RecipeConfig

Rule = Callable[[RecipeConfig, int], list[ConfigIssue]]


def _bf16_master_issues(recipe: RecipeConfig) -> list[ConfigIssue]:
    """``train.master_dtype: bfloat16`` needs an update that rounds stochastically (the built-in AdamW, on the
    device or with every shard on the host) and bf16 compute (FSDP would otherwise gather the bf16 masters into a
    wider dtype: no precision gained, the memory the masters saved spent on every gathered block)."""
    t, issues = recipe.train, []
    if t.optimizer is not None:
        issues.append(
            ConfigIssue(
                "train.master_dtype",
                f"bfloat16 masters need the built-in AdamW's stochastically rounded update; train.optimizer "
                f"({t.optimizer.get('_target_')}) would round each update to nearest and lose every step below half a "
                "bf16 step. Remove train.optimizer or set train.master_dtype=float32",
            )
        )
    if t.optimizer_offload == "states":
        issues.append(
            ConfigIssue(
                "train.master_dtype",
                "bfloat16 masters are not updated by train.optimizer_offload=states (that optimizer writes fp32 "
                "parameters); choose train.optimizer_offload=none or full, or train.master_dtype=float32",
            )
        )
    if recipe.parallel.fsdp.param_dtype != "bfloat16":
        issues.append(
            ConfigIssue(
                "train.master_dtype",
                f"bfloat16 masters are computed in parallel.fsdp.param_dtype={recipe.parallel.fsdp.param_dtype}: "
                "set parallel.fsdp.param_dtype=bfloat16, or train.master_dtype=float32",
            )
        )
    return issues


def check_training(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    t = recipe.train
    issues = []
    if t.steps < 0:
        issues.append(ConfigIssue("train.steps", f"must be >= 0, got {t.steps}"))
    elif t.steps == 0 and not recipe.checkpoint.export_hf:
        issues.append(
            ConfigIssue(
                "train.steps",
                "0 trains nothing; it only converts weights (model.pretrained or checkpoint.resume -> HF safetensors) "
                "with checkpoint.export_hf=true. Set train.steps >= 1 to train",
            )
        )
    if not math.isfinite(t.lr) or t.lr <= 0:
        issues.append(ConfigIssue("train.lr", f"must be a finite number > 0, got {t.lr}"))
    if t.steps > 0 and not 0 <= t.warmup_steps <= t.steps:
        issues.append(ConfigIssue("train.warmup_steps", f"{t.warmup_steps} must be in [0, train.steps={t.steps}]"))
    if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
        issues.append(ConfigIssue("train.betas", f"{t.betas} must be two numbers in [0, 1)"))
    if not math.isfinite(t.grad_clip) or t.grad_clip < 0:
        issues.append(ConfigIssue("train.grad_clip", f"must be a finite number >= 0 (0 disables), got {t.grad_clip}"))
    if t.optimizer_offload == "states" and t.optimizer is not None:
        issues.append(
            ConfigIssue(
                "train.optimizer_offload",
                f"{t.optimizer_offload!r} keeps the built-in AdamW's states on the host and cannot move the states "
                f"of train.optimizer ({t.optimizer.get('_target_')}); remove train.optimizer, set "
                "train.optimizer_offload=full (any optimizer steps the host shards) or none",
            )
        )
    if t.optimizer_state_dtype != "float32" and t.optimizer is not None:
        issues.append(
            ConfigIssue(
                "train.optimizer_state_dtype",
                f"{t.optimizer_state_dtype} stores the built-in AdamW's moments and cannot change train.optimizer's "
                f"({t.optimizer.get('_target_')}); remove train.optimizer or set train.optimizer_state_dtype=float32",
            )
        )
    if t.optimizer_state_dtype != "float32" and t.optimizer_offload == "states":
        issues.append(
            ConfigIssue(
                "train.optimizer_state_dtype",
                f"{t.optimizer_state_dtype} moments are not kept on the host by train.optimizer_offload=states (that "
                "optimizer stores fp32 moments); choose one: train.optimizer_state_dtype=float32, or "
                f"train.optimizer_offload=none or full (full steps the {t.optimizer_state_dtype} moments on the host)",
            )
        )
    if t.master_dtype == "bfloat16":
        issues.extend(_bf16_master_issues(recipe))
    if t.loss_chunk_tokens < 0:
        issues.append(
            ConfigIssue(
                "train.loss_chunk_tokens",
                f"must be >= 0 (0: the whole micro batch's logits at once; 1024 is a good size), got "
                f"{t.loss_chunk_tokens}",
            )
        )
    if not math.isfinite(t.stop_deadline_s) or t.stop_deadline_s <= 0:
        issues.append(
            ConfigIssue(
                "train.stop_deadline_s",
                f"must be a finite number of seconds > 0 (default 20, under torchrun's 30 s grace before SIGKILL), "
                f"got {t.stop_deadline_s}",
            )
        )
    for key, spec in (("train.optimizer", t.optimizer), ("train.scheduler", t.scheduler)):
        issues.extend(check_target(key, spec, recipe.extensions.allow))
    return issues


def check_activation_checkpointing(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    ac, comp = recipe.activation_checkpointing, recipe.compile
    modes = {ac.mode, *ac.by_block.values()}  # the modes some block may run (by_block's keys: the plan's to judge)
    issues = []
    if comp.enabled and comp.recompile_limit < 1:
        issues.append(ConfigIssue("compile.recompile_limit", f"must be >= 1, got {comp.recompile_limit}"))
    if modes == {"none"} and ac.placement == "outside":
        issues.append(
            ConfigIssue("activation_checkpointing.placement", "'outside' needs mode full or selective, mode is none")
        )
    if ac.offload and "selective" in modes:
        issues.append(
            ConfigIssue(
                "activation_checkpointing.offload",
                "true with selective AC (mode or by_block) would offload only the block inputs: selective AC keeps "
                "the op outputs its policy saves in torch's SAC cache, which saved-tensor hooks never see, so they "
                "would stay on the device. Use activation_checkpointing.mode: full (offload moves the one activation per block "
                "full AC keeps) or mode: none (offload moves everything a block saves), or offload: false",
            )
        )
    if ac.offload_in_flight < 1:
        issues.append(
            ConfigIssue(
                "activation_checkpointing.offload_in_flight",
                f"must be >= 1 (blocks whose offloaded tensors may be on the device at once, the running block "
                f"included), got {ac.offload_in_flight}; 1 bounds the device memory most, 2 (the default) overlaps "
                "each block's copies with the next block",
            )
        )
    if ac.offload and comp.enabled:
        issues.append(
            ConfigIssue(
                "activation_checkpointing.offload",
                "true with compile.enabled: compiled blocks save their activations inside the compiled autograd "
                "function, and offloading them through saved-tensor hooks is not verified with torch.compile in "
                "nemo_ac; set compile.enabled=false or activation_checkpointing.offload=false",
            )
        )
    return issues


def check_compile(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """A compile setting that would run blocks eagerly after too many recompiles. The layout rules (compile_outer /
    fullgraph over nested FSDP units, AC placed outside fully_shard, Transformer Engine or other untraceable
    modules) need the model: the plan judges them (``distributed.plan.layout``), run by ``preflight`` on the model
    built on the meta device, before any process group."""
    comp, data = recipe.compile, recipe.data
    if not comp.enabled:
        return []
    issues = []
    if comp.dynamic is False and data.kind == "synthetic" and not data.fixed_length and data.pad_multiple >= 1:
        lowest = -(-(data.seq_len // 2) // data.pad_multiple) * data.pad_multiple
        lengths = len(range(max(lowest, data.pad_multiple), data.seq_len + 1, data.pad_multiple))
        if lengths > comp.recompile_limit:
            issues.append(
                ConfigIssue(
                    "compile.dynamic",
                    f"false compiles once per sequence length; data.fixed_length=false gives {lengths} lengths, more "
                    f"than compile.recompile_limit={comp.recompile_limit}, after which blocks run eagerly. Use "
                    "compile.dynamic=null or true, or raise compile.recompile_limit",
                )
            )
    return issues


def check_dist(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    d = recipe.dist
    issues = []
    if d.backend == "nccl" and d.device == "cpu":
        issues.append(ConfigIssue("dist.backend", "nccl needs CUDA devices; use gloo (or auto) with dist.device=cpu"))
    if d.timeout_s < 1:
        issues.append(ConfigIssue("dist.timeout_s", f"must be >= 1, got {d.timeout_s}"))
    return issues


def check_checkpoint(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    c = recipe.checkpoint
    issues = []
    if c.every_n_steps < 0:
        issues.append(ConfigIssue("checkpoint.every_n_steps", f"must be >= 0, got {c.every_n_steps}"))
    if c.keep_last < 1:
        issues.append(ConfigIssue("checkpoint.keep_last", f"must be >= 1, got {c.keep_last}"))
    if c.resume not in ("none", "auto") and not c.resume.strip():
        issues.append(ConfigIssue("checkpoint.resume", "use none, auto or a step_<N> directory"))
    return issues


RULES: list[Rule] = [
    check_parallel_sizes,
    check_experts,
    check_model_shape,
    check_model_family,
    check_context_parallel,
    check_batching,
    check_training,
    check_data,
    check_vision_language,
    check_activation_checkpointing,
    check_compile,
    check_freeze,
    check_dist,
    check_deepep,
    check_mixer_kernels,
    check_checkpoint,
    check_extensions,
]


def validate_recipe(recipe: RecipeConfig, *, world_size: int, source: str | None = None) -> ParallelLayout:
    """Run every rule; raise one ``ConfigError`` listing all problems, else return the resolved layout."""
    if world_size < 1:
        raise ConfigError(ConfigIssue("--world-size", f"must be >= 1, got {world_size}"), source=source)
    issues = [issue for rule in RULES for issue in rule(recipe, world_size)]
    if issues:
        raise ConfigError(issues, source=source)
    return resolve_layout(recipe, world_size)
