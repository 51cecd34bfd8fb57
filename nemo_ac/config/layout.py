"""The parallel layout: the resolved degrees of a recipe at a world size, and the rules that make it possible.

``ParallelLayout`` is resolved from the recipe and the world size alone, before any process group, so it lives
beside the recipe rather than with the device mesh (``distributed/mesh.py`` needs torch.distributed and builds the
mesh from it). The rules here are the ones a layout answers: the sizes multiply to the world size, experts borrow
their ranks from ``dp_shard x cp``, context parallel splits heads and rows evenly (the recurrent mixers as their
family declares them), and the global batch divides over the data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.hf import family_rules
from nemo_ac.config.rules_data import check_data_workers
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


def resolve_dp_shard(recipe: RecipeConfig, world_size: int) -> int:
    par = recipe.parallel
    if par.dp_shard != -1:
        return par.dp_shard
    denominator = max(par.dp_replicate, 1) * max(par.cp, 1)
    return world_size // denominator if world_size % denominator == 0 else -1


def resolve_layout(recipe: RecipeConfig, world_size: int) -> ParallelLayout:
    """The degrees of a recipe that passed the rules below at ``world_size``."""
    par = recipe.parallel
    return ParallelLayout(
        world_size=world_size,
        dp_replicate=par.dp_replicate,
        dp_shard=resolve_dp_shard(recipe, world_size),
        cp=par.cp,
        ep=par.ep,
    )


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
