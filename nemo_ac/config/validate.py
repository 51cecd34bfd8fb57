"""Cross-field rules: impossible combinations fail here, before any process group starts.

Each rule is a small function ``rule(recipe, world_size) -> list[ConfigIssue]`` in ``RULES``; every message names
the key, the bad value and what would work. ``validate_recipe`` runs them all and resolves the parallel layout.
The model and data rules live in ``rules_model``, the ``_target_`` allowlist and ``extensions.allow`` in
``rules_extensions``, DeepEP's in ``deepep``, the mixer kernels' in ``mixer_kernels``; what differs by model family
is what the family declares (``config.families.FamilyRules``, asked through ``config.hf.family_rules``);
``environment.check_environment`` separately verifies that the optional extras a recipe asks for are importable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from nemo_ac.config.deepep import check_deepep
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.hf import family_rules
from nemo_ac.config.mixer_kernels import check_mixer_kernels
from nemo_ac.config.rules_data import check_data_workers
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


@dataclass(frozen=True)
class ParallelLayout:
    """The resolved degrees. Dense params shard over dp_shard*cp; experts over ep x ep_shard."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_shard(self) -> int:
        """FSDP degree of expert params: what is left of dp_shard*cp after ep."""
        return self.dp_shard * self.cp // self.ep


Rule = Callable[[RecipeConfig, int], list[ConfigIssue]]


def resolve_dp_shard(recipe: RecipeConfig, world_size: int) -> int:
    par = recipe.parallel
    if par.dp_shard != -1:
        return par.dp_shard
    denominator = max(par.dp_replicate, 1) * max(par.cp, 1)
    return world_size // denominator if world_size % denominator == 0 else -1


def check_parallel_sizes(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    par = recipe.parallel
    issues = []
    for name in ("dp_replicate", "cp", "ep"):
        if getattr(par, name) < 1:
            issues.append(ConfigIssue(f"parallel.{name}", f"must be >= 1, got {getattr(par, name)}"))
    if par.dp_shard == 0 or par.dp_shard < -1:
        issues.append(ConfigIssue("parallel.dp_shard", f"must be >= 1 or -1 (the rest), got {par.dp_shard}"))
    if issues:
        return issues
    dp_shard = resolve_dp_shard(recipe, world_size)
    if dp_shard == -1:
        return [
            ConfigIssue(
                "parallel.dp_shard",
                f"world size {world_size} is not divisible by dp_replicate*cp = {par.dp_replicate}*{par.cp}; "
                f"launch a multiple of {par.dp_replicate * par.cp} processes or change parallel.cp/dp_replicate",
            )
        ]
    product = par.dp_replicate * dp_shard * par.cp
    if product != world_size:
        return [
            ConfigIssue(
                "parallel",
                f"dp_replicate*dp_shard*cp = {par.dp_replicate}*{dp_shard}*{par.cp} = {product} must equal the world "
                f"size {world_size}: launch {product} processes for this layout, or set parallel.dp_shard=-1 to use the "
                "rest",
            )
        ]
    if (dp_shard * par.cp) % par.ep != 0:
        return [
            ConfigIssue(
                "parallel.ep",
                f"ep={par.ep} must divide dp_shard*cp = {dp_shard}*{par.cp} = {dp_shard * par.cp} "
                "(experts borrow their ranks from dp_shard x cp)",
            )
        ]
    return []


def check_context_parallel(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    par, m, data = recipe.parallel, recipe.model, recipe.data
    if par.cp <= 1:
        return []
    issues = []
    if par.cp_type == "ulysses":
        if m.num_attention_heads % par.cp != 0:
            issues.append(
                ConfigIssue(
                    "parallel.cp",
                    f"ulysses CP splits attention heads: num_attention_heads={m.num_attention_heads} must be "
                    f"divisible by cp={par.cp}",
                )
            )
        kv = m.num_key_value_heads
        if kv % par.cp != 0 and par.cp % kv != 0:
            issues.append(
                ConfigIssue(
                    "parallel.cp",
                    f"ulysses CP needs num_key_value_heads={kv} divisible by cp={par.cp} or cp divisible by it "
                    "(kv heads are replicated when fewer than cp)",
                )
            )
        issues.extend(_ulysses_recurrent_mixer_issues(recipe))
    else:
        if recipe.backend.attention == "te":
            issues.append(
                ConfigIssue(
                    "backend.attention",
                    "te is not used under cp_type: ring (the ring computes attention itself, block by block); set "
                    "backend.attention: sdpa or parallel.cp_type: ulysses (which runs the te op on its head shards)",
                )
            )
        issues.extend(_ring_recurrent_mixer_issues(recipe))
    divisor = 2 * par.cp if par.cp_type == "ring" else par.cp
    if data.kind in ("synthetic", "text"):
        if data.seq_len % divisor != 0:
            issues.append(
                ConfigIssue(
                    "data.seq_len",
                    f"{data.seq_len} must be divisible by {divisor} for cp={par.cp} {par.cp_type} "
                    f"({'2*cp: head-tail load balancing' if par.cp_type == 'ring' else 'cp'})",
                )
            )
        if not data.fixed_length and data.pad_multiple % divisor != 0:
            issues.append(
                ConfigIssue("data.pad_multiple", f"{data.pad_multiple} must be a multiple of {divisor} under CP")
            )
    elif data.max_length % divisor != 0:
        issues.append(ConfigIssue("data.max_length", f"{data.max_length} must be divisible by {divisor} under CP"))
    return issues


def _ring_recurrent_mixer_issues(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Ring CP passes the recurrent state between slices (``context_parallel.state_passing``); the conv's
    ``conv_kernel - 1`` halo tokens must come from the previous slice alone, so a slice (``S / (2 cp)`` of the
    shortest row) must hold at least that many tokens. The mixers are what the family declares."""
    par, data = recipe.parallel, recipe.data
    mixers = family_rules(recipe.model.family).recurrent_mixers(recipe.model)
    if not mixers or data.kind not in ("synthetic", "text"):
        return []
    kernel = max(mixer.conv_kernel for mixer in mixers)
    key, shortest = ("data.seq_len", data.seq_len) if data.fixed_length else ("data.pad_multiple", data.pad_multiple)
    if shortest // (2 * par.cp) >= kernel - 1:
        return []
    return [
        ConfigIssue(
            key,
            f"{shortest} gives ring CP slices of {shortest // (2 * par.cp)} tokens (rows / 2*cp={2 * par.cp}), fewer "
            f"than the recurrent mixers' conv halo ({kernel - 1} = conv_kernel - 1 tokens from the previous slice); "
            f"use rows of at least {2 * par.cp * (kernel - 1)} tokens, fewer CP ranks, or cp_type: ulysses",
        )
    ]


def _ulysses_recurrent_mixer_issues(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Ulysses also splits the heads of recurrent mixers (Gated DeltaNet key/value heads, Mamba-2 heads and B/C
    groups, as the family declares them): each rank runs whole heads over the whole sequence, so they must divide
    evenly over cp, or, for groups replicated when fewer than cp, cp must divide evenly over them."""
    cp = recipe.parallel.cp
    issues = []
    for mixer in family_rules(recipe.model.family).recurrent_mixers(recipe.model):
        split = [group for group in mixer.head_groups if group.replicated_when_fewer is None]
        if any(group.count % cp != 0 for group in split):
            section = split[0].key.split(".")[0] + "."
            named = " and ".join(
                f"{group.key if i == 0 else group.key.removeprefix(section)}={group.count}"
                for i, group in enumerate(split)
            )
            both = "both " if len(split) == 2 else "all " if len(split) > 2 else ""
            issues.append(
                ConfigIssue(
                    "parallel.cp",
                    f"ulysses CP splits {mixer.name} heads: model.{named} must {both}be divisible by cp={cp}",
                )
            )
        for group in mixer.head_groups:
            replicated = group.replicated_when_fewer
            if replicated is not None and group.count % cp != 0 and cp % group.count != 0:
                issues.append(
                    ConfigIssue(
                        "parallel.cp",
                        f"ulysses CP needs model.{group.key}={group.count} divisible by cp={cp} or cp divisible "
                        f"by it ({replicated} are replicated when fewer than cp)",
                    )
                )
    return issues


def check_batching(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    t, par = recipe.train, recipe.parallel
    issues = check_data_workers(recipe.data)
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        return [ConfigIssue("train.global_batch_size", "global_batch_size and micro_batch_size must be >= 1")]
    dp_shard = resolve_dp_shard(recipe, world_size)
    if dp_shard < 1 or par.dp_replicate < 1:
        return issues  # reported by check_parallel_sizes (dp_replicate=0 would divide by zero below)
    dp = par.dp_replicate * dp_shard
    if t.global_batch_size % (dp * t.micro_batch_size) != 0:
        issues.append(
            ConfigIssue(
                "train.global_batch_size",
                f"{t.global_batch_size} must be divisible by dp*micro_batch_size = {dp}*{t.micro_batch_size} "
                f"(dp = dp_replicate*dp_shard at world size {world_size})",
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
    if t.optimizer_state_dtype == "bfloat16" and t.optimizer is not None:
        issues.append(
            ConfigIssue(
                "train.optimizer_state_dtype",
                f"bfloat16 stores the built-in AdamW's moments and cannot change train.optimizer's "
                f"({t.optimizer.get('_target_')}); remove train.optimizer or set train.optimizer_state_dtype=float32",
            )
        )
    if t.optimizer_state_dtype == "bfloat16" and t.optimizer_offload == "states":
        issues.append(
            ConfigIssue(
                "train.optimizer_state_dtype",
                "bfloat16 moments are not kept on the host by train.optimizer_offload=states (that optimizer stores "
                "fp32 moments); choose one: train.optimizer_state_dtype=float32, or train.optimizer_offload=none or "
                "full (full steps the bf16 moments on the host)",
            )
        )
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
    issues = []
    if comp.enabled and comp.recompile_limit < 1:
        issues.append(ConfigIssue("compile.recompile_limit", f"must be >= 1, got {comp.recompile_limit}"))
    if ac.mode == "none" and ac.placement == "outside":
        issues.append(
            ConfigIssue("activation_checkpointing.placement", "'outside' needs mode full or selective, mode is none")
        )
    if ac.offload and ac.mode == "selective":
        issues.append(
            ConfigIssue(
                "activation_checkpointing.offload",
                "true with mode: selective would offload only the block inputs: selective AC keeps the op outputs "
                "its policy saves in torch's SAC cache, which saved-tensor hooks never see, so they would stay on "
                "the device. Use activation_checkpointing.mode: full (offload moves the one activation per block "
                "full AC keeps) or mode: none (offload moves everything a block saves), or offload: false",
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
    par = recipe.parallel
    return ParallelLayout(
        world_size=world_size,
        dp_replicate=par.dp_replicate,
        dp_shard=resolve_dp_shard(recipe, world_size),
        cp=par.cp,
        ep=par.ep,
    )
