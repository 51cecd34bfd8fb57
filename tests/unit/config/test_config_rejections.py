"""Every way a recipe is rejected, with its message: one row per branch of every rule in ``validate.RULES`` and per
schema conversion error, plus a property test that no random recipe crashes loading or validation with anything
but ``ConfigError``.

``test_every_rule_has_a_row`` enumerates ``RULES``: a new rule fails the suite until it gets a row here.
"""

from __future__ import annotations

import inspect
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_ac.config import ConfigError, load_recipe, recipe_from_container, validate_recipe
from nemo_ac.config import validate as validation
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.distributed.plan.layout import layout_issues
from nemo_ac.preflight import preflight
from nemo_ac.trainer.checkpoint.files import check_checkpoint_paths

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"
MEDPIX = ["data.kind=medpix", "model.family=qwen3_5_moe", "data.path=some/dir"]


@dataclass(frozen=True)
class Rejection:
    """Overrides of the tiny recipe that ``rule`` rejects at ``world_size`` with ``key: <message matching regex>``."""

    rule: str
    overrides: tuple[str, ...]
    key: str
    message: str
    world_size: int = 2
    id: str = field(default="")


def row(rule: str, overrides: list[str], key: str, message: str, *, world_size: int = 2, id: str = "") -> Any:
    rejection = Rejection(rule, tuple(overrides), key, message, world_size, id)
    return pytest.param(rejection, id=f"{rule}-{id or key}")


ROWS = [
    # check_parallel_sizes
    row("check_parallel_sizes", ["parallel.dp_replicate=0"], "parallel.dp_replicate", r"must be >= 1, got 0"),
    row("check_parallel_sizes", ["parallel.cp=0"], "parallel.cp", r"must be >= 1, got 0"),
    row("check_parallel_sizes", ["parallel.ep=0"], "parallel.ep", r"must be >= 1, got 0"),
    row(
        "check_parallel_sizes", ["parallel.dp_shard=0"], "parallel.dp_shard", r"must be >= 1 or -1 \(the rest\), got 0"
    ),
    row("check_parallel_sizes", ["parallel.dp_shard=-2"], "parallel.dp_shard", r"got -2", id="below_minus_one"),
    row(
        "check_parallel_sizes",
        ["parallel.cp=2"],
        "parallel.dp_shard",
        r"world size 3 is not divisible by dp_replicate\*cp = 1\*2; launch a multiple of 2 processes",
        world_size=3,
        id="indivisible_world",
    ),
    row(
        "check_parallel_sizes",
        ["parallel.dp_shard=2", "parallel.cp=2"],
        "parallel",
        r"dp_replicate\*dp_shard\*cp = 1\*2\*2 = 4 must equal the world size 2: launch 4 processes for this layout, or "
        r"set parallel.dp_shard=-1",
    ),
    row(
        "check_parallel_sizes",
        ["parallel.ep=3", "model.moe.num_experts=6"],
        "parallel.ep",
        r"ep=3 must divide dp_shard\*cp = 2\*1 = 2 \(experts borrow their ranks from dp_shard x cp\)",
    ),
    # check_experts
    row("check_experts", ["model.moe.num_experts=0"], "model.moe.num_experts", r"must be >= 1, got 0"),
    row(
        "check_experts",
        ["parallel.ep=2", "model.moe.num_experts=3"],
        "model.moe.num_experts",
        r"3 experts cannot be split over parallel.ep=2; num_experts must be a multiple of ep",
        id="split",
    ),
    row(
        "check_experts",
        ["model.moe.num_experts_per_tok=5"],
        "model.moe.num_experts_per_tok",
        r"5 must be between 1 and num_experts=4",
    ),
    row(
        "check_experts",
        ["model.moe.num_experts_per_tok=0"],
        "model.moe.num_experts_per_tok",
        r"0 must be between 1",
        id="zero",
    ),
    row(
        "check_experts",
        ["model.moe.experts_impl=grouped_mm", "model.moe.moe_intermediate_size=30"],
        "model.moe.experts_impl",
        r"grouped_mm needs expert widths that are multiples of 4 in float32 .*moe_intermediate_size=30; set "
        r"model.moe.experts_impl: auto",
    ),
    row(
        "check_experts",
        ["model.moe.router_gemm=bf16x3"],  # qwen3_moe_tiny routes in the parameter dtype
        "model.moe.router_gemm",
        r"bf16x3 does not apply: the router runs in the parameter dtype .*; set model.moe.router_dtype: float32 or "
        r"router_gemm: auto",
        id="router_gemm_param_router",
    ),
    row(
        "check_experts",
        ["model.moe.router_gemm=bf16x3", "model.moe.router_dtype=float32"],
        "model.moe.router_gemm",
        r"bf16x3 does not apply: it splits the fp32 weight for bf16 hidden states, and parallel.fsdp.param_dtype is "
        r"float32; set parallel.fsdp.param_dtype: bfloat16 or model.moe.router_gemm: auto",
        id="router_gemm_fp32_compute",
    ),
    row("check_experts", ["model.moe.n_group=3"], "model.moe.n_group", r"3 must be >= 1 and divide num_experts=4"),
    row("check_experts", ["model.moe.n_group=0"], "model.moe.n_group", r"0 must be >= 1", id="zero_groups"),
    row(
        "check_experts",
        ["model.moe.n_group=2", "model.moe.topk_group=3"],
        "model.moe.topk_group",
        r"3 must be between 1 and n_group",
    ),
    row(
        "check_experts",
        ["parallel.ep=2", "model.moe.separate_fsdp_unit=false"],
        "model.moe.separate_fsdp_unit",
        r"expert parallel shards experts on their own mesh; they must be a separate FSDP unit \(set true\)",
    ),
    row(
        "check_experts",
        ["model.moe.bias_update_rate=-0.1"],
        "model.moe.bias_update_rate",
        r"must be >= 0 \(0 disables\), got -0.1",
    ),
    row(
        "check_experts",
        ["model.moe.bias_update_rate=0.001"],
        "model.moe.bias_update_rate",
        r"0.001 updates each router's e_score_correction_bias, but model.moe.score_correction_bias is false",
        id="bias_without_bias",
    ),
    # check_model_shape
    *[
        row("check_model_shape", [f"model.{name}=0"], f"model.{name}", r"must be >= 1, got 0")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    ],
    row(
        "check_model_shape",
        ["model.num_key_value_heads=3"],
        "model.num_key_value_heads",
        r"3 must divide num_attention_heads=4 \(GQA groups\)",
        id="gqa",
    ),
    row(
        "check_model_shape",
        ["model.first_k_dense_replace=3"],
        "model.first_k_dense_replace",
        r"3 must be in \[0, num_layers\]",
    ),
    row(
        "check_model_shape",
        ["model.partial_rotary_factor=0"],
        "model.partial_rotary_factor",
        r"0.0 must be in \(0, 1\]",
    ),
    row(
        "check_model_shape",
        ["model.layer_pattern=AA"],
        "model.layer_pattern",
        r"family 'qwen3_moe' takes no layer_pattern",
    ),
    row(
        "check_model_shape",
        ["model.family=nemotron_h", "model.layer_pattern=MX"],
        "model.layer_pattern",
        r"'MX' has characters \['X'\]; family nemotron_h allows",
        id="bad_chars",
    ),
    row(
        "check_model_shape",
        ["model.family=nemotron_h", "model.layer_pattern=M*E"],
        "model.layer_pattern",
        r"has 3 layers but model.num_layers=2",
        id="length",
    ),
    # check_model_family
    row(
        "check_model_family",
        ["model.family=glm4_moe"],
        "model.moe.score_func",
        r"'softmax': family glm4_moe: transformers' Glm4Moe router/experts have no other mode; set "
        r"model.moe.score_func: sigmoid",
    ),
    row(
        "check_model_family",
        ["model.family=glm4_moe", "model.moe.latent_size=8"],
        "model.moe.latent_size",
        r"8: not in glm4_moe; remove it",
    ),
    row(
        "check_model_family",
        ["model.family=nemotron_h"],
        "model.layer_pattern",
        r"family nemotron_h needs its hybrid_override_pattern",
    ),
    row(
        "check_model_family",
        ["model.family=nemotron_h", "model.layer_pattern=ME"],
        "model.qk_norm",
        r"True: family nemotron_h: transformers' NemotronH has no other mode; set model.qk_norm: False",
    ),
    row(
        "check_model_family",
        ["model.family=nemotron_h", "model.layer_pattern=ME", "model.moe.shared_expert_intermediate_size=0"],
        "model.moe.shared_expert_intermediate_size",
        r"Nemotron-H MoE layers always have shared experts",
    ),
    # check_context_parallel
    row(
        "check_context_parallel",
        ["parallel.cp=2", "model.num_attention_heads=3", "model.num_key_value_heads=1"],
        "parallel.cp",
        r"ulysses CP splits attention heads: num_attention_heads=3 must be divisible by cp=2",
        id="ulysses_heads",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=4", "model.num_attention_heads=12", "model.num_key_value_heads=3"],
        "parallel.cp",
        r"ulysses CP needs num_key_value_heads=3 divisible by cp=4 or cp divisible by it",
        world_size=4,
        id="ulysses_kv_heads",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "parallel.cp_type=ring", "backend.attention=te"],
        "backend.attention",
        r"te is not used under cp_type: ring \(the ring computes attention itself",
    ),
    row(
        "check_context_parallel",
        [
            "parallel.cp=2",
            "model.family=qwen3_5_moe",
            "model.linear_attention.num_key_heads=3",
            "model.linear_attention.num_value_heads=6",
        ],
        "parallel.cp",
        r"ulysses CP splits Gated DeltaNet heads: model.linear_attention.num_key_heads=3 and num_value_heads=6 must "
        r"both be divisible by cp=2",
        id="ulysses_linear_attention_heads",
    ),
    row(
        "check_context_parallel",
        [
            "parallel.cp=2",
            "model.family=qwen3_5_moe",
            "model.linear_attention.num_key_heads=1",
            "model.linear_attention.num_value_heads=3",
        ],
        "parallel.cp",
        r"num_key_heads=1 and num_value_heads=3 must both be divisible by cp=2",
        id="ulysses_linear_attention_value_heads",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "model.family=nemotron_h", "model.mamba.num_heads=3"],
        "parallel.cp",
        r"ulysses CP splits Mamba-2 heads: model.mamba.num_heads=3 must be divisible by cp=2",
        id="ulysses_mamba_heads",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "model.family=nemotron_h", "model.mamba.num_heads=6", "model.mamba.n_groups=3"],
        "parallel.cp",
        r"ulysses CP needs model.mamba.n_groups=3 divisible by cp=2 or cp divisible by it",
        id="ulysses_mamba_groups",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "data.seq_len=91"],
        "data.seq_len",
        r"91 must be divisible by 2 for cp=2 ulysses \(cp\)",
        id="seq_len_ulysses",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=4", "parallel.cp_type=ring", "model.family=nemotron_h", "data.seq_len=16"],
        "data.seq_len",
        r"16 gives ring CP slices of 2 tokens \(rows / 2\*cp=8\), fewer than the recurrent mixers' conv halo "
        r"\(3 = conv_kernel - 1 tokens from the previous slice\); use rows of at least 24 tokens",
        world_size=4,
        id="ring_slice_shorter_than_conv_halo",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "parallel.cp_type=ring", "data.seq_len=98"],
        "data.seq_len",
        r"98 must be divisible by 4 for cp=2 ring \(2\*cp: head-tail load balancing\)",
        id="seq_len_ring",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", "parallel.cp_type=ring", "data.fixed_length=false", "data.pad_multiple=6"],
        "data.pad_multiple",
        r"6 must be a multiple of 4 under CP",
    ),
    row(
        "check_context_parallel",
        ["parallel.cp=2", *MEDPIX, "data.max_length=4095"],
        "data.max_length",
        r"4095 must be divisible by 2 under CP",
    ),
    # check_batching
    row(
        "check_batching",
        ["train.micro_batch_size=0"],
        "train.global_batch_size",
        r"global_batch_size and micro_batch_size must be >= 1",
        id="zero_micro",
    ),
    row(
        "check_batching",
        ["train.global_batch_size=6"],
        "train.global_batch_size",
        r"6 must be divisible by dp\*micro_batch_size = 2\*2 \(dp = dp_replicate\*dp_shard at world size 2\)",
    ),
    row("check_batching", ["data.num_workers=-1"], "data.num_workers", r"-1 must be >= 0 \(0: no worker threads\)"),
    row(
        "check_batching",
        ["data.num_workers=100000"],
        "data.num_workers",
        r"100000 threads per rank is more than the 64 allowed; .* set it between 0 and 64",
        id="num_workers_above_64",
    ),
    # check_training
    row("check_training", ["train.steps=-1"], "train.steps", r"must be >= 0, got -1"),
    row(
        "check_training",
        ["train.steps=0"],
        "train.steps",
        r"0 trains nothing; it only converts weights .* with checkpoint.export_hf=true",
        id="zero_steps",
    ),
    row("check_training", ["train.lr=0"], "train.lr", r"must be a finite number > 0, got 0.0"),
    row("check_training", ["train.lr=.nan"], "train.lr", r"must be a finite number > 0, got nan"),
    row("check_training", ["train.lr=.inf"], "train.lr", r"must be a finite number > 0, got inf"),
    row("check_training", ["train.warmup_steps=50"], "train.warmup_steps", r"50 must be in \[0, train.steps=40\]"),
    row("check_training", ["train.betas=[0.9]"], "train.betas", r"\[0.9\] must be two numbers in \[0, 1\)"),
    row("check_training", ["train.betas=[0.9,1.0]"], "train.betas", r"must be two numbers in \[0, 1\)", id="beta_one"),
    row(
        "check_training",
        ["train.grad_clip=-1"],
        "train.grad_clip",
        r"must be a finite number >= 0 \(0 disables\), got -1.0",
    ),
    row(
        "check_training",
        ["train.optimizer_offload=states", "+train.optimizer._target_=torch.optim.SGD"],
        "train.optimizer_offload",
        r"'states' keeps the built-in AdamW's states on the host and cannot move the states of train.optimizer "
        r"\(torch.optim.SGD\); remove train.optimizer, set train.optimizer_offload=full \(any optimizer steps the host "
        r"shards\) or none",
    ),
    row(
        "check_training",
        [
            "train.master_dtype=bfloat16",
            "parallel.fsdp.param_dtype=bfloat16",
            "+train.optimizer._target_=torch.optim.SGD",
        ],
        "train.master_dtype",
        r"bfloat16 masters need the built-in AdamW's stochastically rounded update; train.optimizer \(torch.optim.SGD\) "
        r"would round each update to nearest .* Remove train.optimizer or set train.master_dtype=float32",
        id="master_dtype_custom_optimizer",
    ),
    row(
        "check_training",
        ["train.master_dtype=bfloat16", "parallel.fsdp.param_dtype=bfloat16", "train.optimizer_offload=states"],
        "train.master_dtype",
        r"bfloat16 masters are not updated by train.optimizer_offload=states .*; choose train.optimizer_offload=none "
        r"or full, or train.master_dtype=float32",
        id="master_dtype_host_states",
    ),
    row(
        "check_training",
        ["train.master_dtype=bfloat16", "parallel.fsdp.param_dtype=float32"],
        "train.master_dtype",
        r"bfloat16 masters are computed in parallel.fsdp.param_dtype=float32: set parallel.fsdp.param_dtype=bfloat16, "
        r"or train.master_dtype=float32",
        id="master_dtype_fp32_compute",
    ),
    row(
        "check_training",
        ["train.optimizer_state_dtype=float8", "+train.optimizer._target_=torch.optim.SGD"],
        "train.optimizer_state_dtype",
        r"float8 stores the built-in AdamW's moments and cannot change train.optimizer's \(torch.optim.SGD\); remove "
        r"train.optimizer or set train.optimizer_state_dtype=float32",
        id="fp8_states_custom_optimizer",
    ),
    row(
        "check_training",
        ["train.optimizer_state_dtype=float8", "train.optimizer_offload=states"],
        "train.optimizer_state_dtype",
        r"float8 moments are not kept on the host by train.optimizer_offload=states .*; choose one: "
        r"train.optimizer_state_dtype=float32, or train.optimizer_offload=none or full",
        id="fp8_states_host_states",
    ),
    row(
        "check_training",
        ["train.loss_chunk_tokens=-1"],
        "train.loss_chunk_tokens",
        r"must be >= 0 \(0: the whole micro batch's logits at once; 1024 is a good size\), got -1",
    ),
    row(
        "check_training",
        ["+train.optimizer.lr=0.1"],
        "train.optimizer._target_",
        r"missing; give a dotted path such as torch.optim.AdamW",
    ),
    row(
        "check_training",
        ["+train.optimizer._target_=os.system"],
        "train.optimizer._target_",
        r"'os.system' is outside the allowed module prefixes \['torch.optim.', 'nemo_ac.'\]",
        id="optimizer_allowlist",
    ),
    row(
        "check_training",
        ["+train.scheduler._target_=builtins.eval"],
        "train.scheduler._target_",
        r"'builtins.eval' is outside the allowed module prefixes",
    ),
    row(
        "check_training",
        ["+train.optimizer._target_=mypkg.optim.Lion", "extensions.allow=[otherpkg.]"],
        "train.optimizer._target_",
        r"'mypkg.optim.Lion' is outside .* or extensions.allow \['otherpkg.'\]; to import your own module, add its "
        r"prefix to extensions.allow \(e.g. extensions.allow: \['mypkg.'\]\)",
        id="optimizer_other_extension",
    ),
    row(
        "check_training",
        ["+train.scheduler._target_=mypkg.optimizers.Sched", "extensions.allow=[mypkg.optim]"],
        "train.scheduler._target_",
        r"'mypkg.optimizers.Sched' is outside .*add its prefix to extensions.allow",
        id="module_path_is_no_string_prefix",
    ),
    # check_extensions
    row("check_extensions", ["extensions.allow=['']"], "extensions.allow[0]", r"must not be empty"),
    row(
        "check_extensions",
        ["extensions.allow=[mypkg., my-pkg.]"],
        "extensions.allow[1]",
        r"'my-pkg.' is not a module prefix; give a dotted module path ending in '.'",
    ),
    row(
        "check_extensions",
        ["extensions.allow=[os.]"],
        "extensions.allow[0]",
        r"'os.' is in the Python standard library; extensions.allow is for your own modules",
    ),
    row(
        "check_extensions",
        ["+data.source._target_=mypkg.data.Batches"],
        "data.source._target_",
        r"'mypkg.data.Batches' is outside .*add its prefix to extensions.allow",
    ),
    row(
        "check_extensions",
        [*MEDPIX, "+data.source._target_=mypkg.data.Batches", "extensions.allow=[mypkg.]"],
        "data.kind",
        r"'medpix' with data.source: the source replaces data.kind",
    ),
    # check_data
    row("check_data", ["data.seq_len=4"], "data.seq_len", r"must be >= 8, got 4"),
    row(
        "check_data",
        ["data.min_doc_tokens=9"],
        "data.min_doc_tokens",
        r"need 1 <= min_doc_tokens \(9\) <= max_doc_tokens \(8\)",
    ),
    row("check_data", ["data.min_doc_tokens=0"], "data.min_doc_tokens", r"min_doc_tokens \(0\)", id="zero_doc"),
    row("check_data", ["model.vocab_size=4"], "model.vocab_size", r"synthetic tasks need vocab_size >= 8, got 4"),
    row(
        "check_data",
        ["data.fixed_length=false", "data.pad_multiple=7"],
        "data.pad_multiple",
        r"7 must be >= 1 and divide seq_len=96",
    ),
    row(
        "check_data",
        ["data.kind=medpix", "data.path=some/dir"],
        "data.kind",
        r"medpix is a vision-language dataset; model.family 'qwen3_moe' has no vision",
    ),
    row("check_data", [*MEDPIX[:2]], "data.path", r"medpix needs a local path or HF dataset id"),
    row(
        "check_data",
        [*MEDPIX],
        "model.vocab_size",
        r"64 is smaller than the tiny MedPix tokenizer's 262 ids \(data.tokenizer: tiny\); set model.vocab_size >= 262",
    ),
    row(
        "check_data",
        [*MEDPIX, "model.vision.image_token_id=5"],
        "model.vision.image_token_id",
        r"token ids \(5, 1, 2\) differ from the tiny MedPix tokenizer's \(3, 1, 2\); set model.vision.image_token_id: 3",
    ),
    # check_vision_language
    row(
        "check_vision_language",
        ["model.family=qwen3_5_moe", "model.mrope_section=[2,1,1]"],
        "model.mrope_section",
        r"\[2, 1, 1\] must be 3 numbers \(temporal, height, width\) summing to rotary_dim/2 = 8",
        id="mrope_sum",
    ),
    row(
        "check_vision_language",
        ["model.family=qwen3_5_moe", "model.vision.depth=1"],
        "model.mrope_section",
        r"is required with a vision tower \(model.vision.depth=1\)",
        id="mrope_required",
    ),
    row(
        "check_vision_language",
        [
            "model.family=qwen3_5_moe",
            "model.vision.depth=1",
            "model.mrope_section=[4,2,2]",
            "model.vision.hidden_size=30",
        ],
        "model.vision.hidden_size",
        r"30 / num_heads 2 must be a whole head size that is a multiple of 4",
    ),
    row(
        "check_vision_language",
        [
            "model.family=qwen3_5_moe",
            "model.vision.depth=1",
            "model.mrope_section=[4,2,2]",
            "model.vision.num_position_embeddings=15",
        ],
        "model.vision.num_position_embeddings",
        r"15 must be a perfect square",
    ),
    row(
        "check_vision_language",
        [*MEDPIX],
        "model.vision.depth",
        r"0: data.kind medpix feeds images, which need a vision tower; set model.vision.depth >= 1",
    ),
    # check_activation_checkpointing
    row(
        "check_activation_checkpointing",
        ["compile.enabled=true", "compile.recompile_limit=0"],
        "compile.recompile_limit",
        r"must be >= 1, got 0",
    ),
    row(
        "check_activation_checkpointing",
        ["activation_checkpointing.mode=none", "activation_checkpointing.placement=outside"],
        "activation_checkpointing.placement",
        r"'outside' needs mode full or selective, mode is none",
    ),
    row(
        "check_activation_checkpointing",
        ["activation_checkpointing.offload=true"],
        "activation_checkpointing.offload",
        r"true with selective AC \(mode or by_block\) would offload only the block inputs: .* Use "
        r"activation_checkpointing.mode: full",
    ),
    row(
        "check_activation_checkpointing",
        [
            "activation_checkpointing.offload=true",
            "activation_checkpointing.mode=full",
            "+activation_checkpointing.by_block.moe=selective",
        ],
        "activation_checkpointing.offload",
        r"true with selective AC \(mode or by_block\) would offload only the block inputs",
        id="offload_selective_by_block",
    ),
    row(
        "check_activation_checkpointing",
        ["activation_checkpointing.offload=true", "activation_checkpointing.mode=full", "compile.enabled=true"],
        "activation_checkpointing.offload",
        r"true with compile.enabled: .* not verified with torch.compile in nemo_ac; set compile.enabled=false",
        id="offload_compile",
    ),
    row(
        "check_activation_checkpointing",
        [
            "activation_checkpointing.offload=true",
            "activation_checkpointing.mode=full",
            "activation_checkpointing.offload_in_flight=0",
        ],
        "activation_checkpointing.offload_in_flight",
        r"must be >= 1 \(blocks whose offloaded tensors may be on the device at once, the running block included\), "
        r"got 0; 1 bounds the device memory most",
        id="offload_in_flight_zero",
    ),
    # check_compile (the layout rules that need the model: PLAN_ROWS)
    row(
        "check_compile",
        ["compile.enabled=true", "compile.dynamic=false", "data.fixed_length=false", "compile.recompile_limit=4"],
        "compile.dynamic",
        r"false compiles once per sequence length; data.fixed_length=false gives 7 lengths, more than "
        r"compile.recompile_limit=4",
    ),
    # check_freeze
    row(
        "check_freeze",
        ["train.freeze.vision_tower=true"],
        "train.freeze.vision_tower",
        r"model has no vision tower \(family qwen3_moe\)",
    ),
    row(
        "check_freeze",
        ["train.freeze.embeddings=true", "train.freeze.language_model=true"],
        "train.freeze.language_model",
        r"freezing everything leaves nothing to train",
    ),
    row(
        "check_freeze",
        ["train.freeze.vision_merger=true"],
        "train.freeze.vision_merger",
        r"model has no vision tower \(family qwen3_moe\)",
    ),
    row(
        "check_freeze",
        [
            "model.family=qwen3_5_moe",
            "model.vision.depth=1",
            "model.mrope_section=[4,2,2]",
            "train.freeze.vision_tower=true",
            "train.freeze.vision_merger=true",
            "train.freeze.embeddings=true",
            "train.freeze.language_model=true",
        ],
        "train.freeze.language_model",
        r"freezing everything leaves nothing to train; leave at least one of train.freeze.\* false",
        id="vision_language_all_frozen",
    ),
    # check_dist
    row(
        "check_dist",
        ["dist.backend=nccl", "dist.device=cpu"],
        "dist.backend",
        r"nccl needs CUDA devices; use gloo \(or auto\) with dist.device=cpu",
    ),
    row("check_dist", ["dist.timeout_s=0"], "dist.timeout_s", r"must be >= 1, got 0"),
    # check_deepep
    row(
        "check_deepep",
        ["backend.dispatcher=deepep"],
        "backend.dispatcher",
        r"deepep moves tokens between expert-parallel ranks but parallel.ep is 1; set parallel.ep > 1",
        id="deepep_without_ep",
    ),
    row(
        "check_deepep",
        ["backend.dispatcher=deepep", "parallel.ep=3", "parallel.fsdp.param_dtype=bfloat16"],
        "parallel.ep",
        r"3 is not an expert-parallel size DeepEP's kernels support: 2, 4, 8 ranks within one NVLink node, or 16, 32, "
        r"64, 128, 144, 160 across nodes of 8 GPUs \(RDMA, DeepEP built with NVSHMEM; also 24, 48, 96 with DeepEP "
        r"2.x\); set parallel.ep to one of those, or backend.dispatcher: torch",
        world_size=3,
    ),
    row(
        "check_deepep",
        ["backend.dispatcher=deepep", "parallel.ep=2", "parallel.fsdp.param_dtype=bfloat16", "dist.device=cpu"],
        "backend.dispatcher",
        r"deepep runs on CUDA only; use dispatcher: torch on CPU",
    ),
    row(
        "check_deepep",
        ["backend.dispatcher=deepep", "parallel.ep=2"],
        "parallel.fsdp.param_dtype",
        r"float32 with backend.dispatcher: deepep: the tokens DeepEP moves are in the compute dtype, and its combine "
        r"kernel \(also the backward of dispatch\) takes bfloat16 only; set parallel.fsdp.param_dtype: bfloat16, or "
        r"backend.dispatcher: torch",
    ),
    # check_mixer_kernels (config.mixer_kernels)
    row(
        "check_mixer_kernels",
        ["backend.linear_attention=fla", "dist.device=cpu"],
        "backend.linear_attention",
        r"fla runs Gated DeltaNet on CUDA only and dist.device is cpu; set backend.linear_attention: torch \(or auto\)",
    ),
    row(
        "check_mixer_kernels",
        ["backend.linear_attention=fla", "dist.backend=gloo"],
        "backend.linear_attention",
        r"fla runs Gated DeltaNet on CUDA only and dist.backend gloo puts dist.device auto on cpu",
        id="gloo",
    ),
    row(
        "check_mixer_kernels",
        ["backend.mamba=mamba_ssm", "parallel.cp=2", "parallel.cp_type=ring"],
        "backend.mamba",
        r"mamba_ssm is not used under parallel.cp_type: ring: ring CP passes the Mamba-2 state between ranks through "
        r"the torch op's initial / final state; set backend.mamba: torch \(or auto\), or parallel.cp_type: ulysses",
        id="ring",
    ),
    row(  # mamba-ssm cannot be installed without nvcc, so it never imports on the CPU test machines
        "check_mixer_kernels",
        ["backend.mamba=mamba_ssm"],
        "backend.mamba",
        r"mamba_ssm needs 'mamba_ssm' and 'causal_conv1d', which do not import on this machine .*pip install "
        r"--no-build-isolation causal-conv1d mamba-ssm",
        id="not_installed",
    ),
    # check_checkpoint
    row("check_checkpoint", ["checkpoint.every_n_steps=-1"], "checkpoint.every_n_steps", r"must be >= 0, got -1"),
    row("check_checkpoint", ["checkpoint.keep_last=0"], "checkpoint.keep_last", r"must be >= 1, got 0"),
    row("check_checkpoint", ["checkpoint.resume=' '"], "checkpoint.resume", r"use none, auto or a step_<N> directory"),
]


# The layout rules the plan judges on the model built on meta (``distributed.plan.layout.layout_issues``), reached
# through ``preflight`` as ``nemo-ac validate`` (without --check-env) and every run reach them: before any process
# group. ``rule`` names the rule of ``layout_issues``.
PLAN_ROWS = [
    row(
        "compile_outer_nested",
        ["compile.enabled=true", "compile.layout=compile_outer"],
        "compile.layout",
        r"compile_outer: MoE blocks hold a nested FSDP unit \(model.layers.0: experts\) .* Use compile.layout=auto "
        r"or ac_outer, or set model.moe.separate_fsdp_unit=false",
    ),
    row(
        "compile_outer_placement",
        [
            "compile.enabled=true",
            "compile.layout=compile_outer",
            "model.moe.separate_fsdp_unit=false",
            "activation_checkpointing.placement=outside",
        ],
        "compile.layout",
        r"compile_outer with activation_checkpointing.placement=outside .* Use compile.layout=auto",
    ),
    row(
        "fullgraph_nested",
        ["compile.enabled=true", "compile.fullgraph=true"],
        "compile.fullgraph",
        r"true fails on the graph breaks at the nested FSDP unit's hooks .* set compile.fullgraph=false",
    ),
    row(
        "compile_outer_untraceable",
        [
            "compile.enabled=true",
            "compile.layout=compile_outer",
            "model.moe.separate_fsdp_unit=false",
            "backend.linear=te",
        ],
        "compile.layout",
        r"compile_outer traces model.layers.0's checkpoint as one region, and its te.Linear x4 graph-break inside "
        r"it; Transformer Engine's forwards are Dynamo-disabled \(backend.linear: te\), .* use compile.layout=auto",
    ),
    row(
        "fullgraph_untraceable",
        ["compile.enabled=true", "compile.fullgraph=true", "model.moe.separate_fsdp_unit=false", "backend.rms_norm=te"],
        "compile.fullgraph",
        r"true fails at the graph breaks in model.layers.0 \(te.RMSNorm x4 are not traceable by Dynamo; Transformer "
        r"Engine's forwards are Dynamo-disabled \(backend.rms_norm: te\)\); set compile.fullgraph=false",
    ),
]


@pytest.mark.parametrize("rejection", PLAN_ROWS)
def test_rejected_by_the_plan(rejection: Rejection):
    """The plan's rule reports the key and message through ``preflight`` (no process group, no --check-env); the
    unmodified recipe passes; the recipe-only rules no longer judge it (one judge)."""
    with pytest.raises(ConfigError) as info:
        preflight(str(TINY), list(rejection.overrides), world_size=rejection.world_size, check_env=False)
    assert matching(info.value.issues, rejection.key, rejection.message), [str(i) for i in info.value.issues]
    assert "invalid recipe in" in str(info.value)
    checked = preflight(str(TINY), [], world_size=rejection.world_size, check_env=False)
    assert checked.plan is not None
    validate_recipe(load(*rejection.overrides), world_size=rejection.world_size)


def test_every_plan_rule_has_a_row():
    """Each rule ``layout_issues`` can report has a row in PLAN_ROWS."""
    rules = set(re.findall(r'issues\["(\w+)"\] = ConfigIssue\(', inspect.getsource(layout_issues)))
    assert rules and rules == {param.values[0].rule for param in PLAN_ROWS}


def load(*overrides: str) -> RecipeConfig:
    return load_recipe(TINY, list(overrides))


def matching(issues, key: str, message: str) -> list:
    return [issue for issue in issues if issue.key == key and re.search(message, issue.message)]


@pytest.mark.parametrize("rejection", ROWS)
def test_rejected_recipe(rejection: Rejection):
    """The named rule reports the key and message; the unmodified recipe does not (the overrides cause it); and
    ``validate_recipe`` raises one ConfigError that carries it."""
    rule = getattr(validation, rejection.rule)
    recipe = load(*rejection.overrides)
    issues = rule(recipe, rejection.world_size)
    assert matching(issues, rejection.key, rejection.message), [str(i) for i in issues]
    assert not matching(rule(load(), rejection.world_size), rejection.key, rejection.message)
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe, world_size=rejection.world_size, source="tiny.yaml")
    assert matching(info.value.issues, rejection.key, rejection.message)
    assert "invalid recipe in tiny.yaml" in str(info.value)


def test_every_rule_has_a_row():
    """Each rule in RULES needs at least as many rows as it has ``ConfigIssue(`` sites (one per rejected case)."""
    rows_per_rule = Counter(param.values[0].rule for param in ROWS)
    short = {}
    for rule in validation.RULES:
        sites = inspect.getsource(rule).count("ConfigIssue(")
        if rows_per_rule[rule.__name__] < max(sites, 1):
            short[rule.__name__] = f"{rows_per_rule[rule.__name__]} row(s) for {sites} ConfigIssue site(s)"
    assert not short, f"validation rules without enough rows in {__file__}: {short}; add one per rejected case"
    stale = set(rows_per_rule) - {rule.__name__ for rule in validation.RULES}
    assert not stale, f"rows name rules that are not in RULES: {sorted(stale)}"


def test_tiny_recipe_is_valid_at_the_world_sizes_the_rows_use():
    for world_size in (1, 2, 4):
        validate_recipe(load(), world_size=world_size)


def test_world_size_below_one():
    with pytest.raises(ConfigError, match=r"--world-size: must be >= 1, got 0"):
        validate_recipe(load(), world_size=0)


# --------------------------------------------------------------------------------------------------------------
# schema conversion (config.load): the key, the bad value, what is expected

CONVERSIONS = [
    (["model.num_layer=3"], r"model.num_layer: unknown key\. Did you mean 'model.num_layers'\? Valid keys in 'model'"),
    (["trian.steps=3"], r"trian: unknown key\. Did you mean 'train'\? Valid keys in the recipe root"),
    (["train.steps=ten"], r"train.steps: expected an integer, got 'ten' \(str\)"),
    (["model.num_layers=true"], r"model.num_layers: expected an integer, got True \(bool\)"),
    (["train.lr=fast"], r"train.lr: expected a number, got 'fast' \(str\)"),
    (["compile.enabled=maybe"], r"compile.enabled: expected true or false, got 'maybe' \(str\)"),
    (["checkpoint.dir=5"], r"checkpoint.dir: expected a string, got 5 \(int\)"),
    (["model.pretrained=5"], r"model.pretrained: expected a string, got 5 \(int\)"),
    (
        ["activation_checkpointing.mode=selectve"],
        r"activation_checkpointing.mode: 'selectve' is not valid; choose one of \['none', 'full', 'selective'\]\. "
        r"Did you mean 'selective'\?",
    ),
    (["train.betas=0.9"], r"train.betas: expected a list, got 0.9"),
    (["train.betas=[0.9,x]"], r"train.betas\[1\]: expected a number, got 'x' \(str\)"),
    (["train.optimizer=adam"], r"train.optimizer: expected a mapping, got 'adam'"),
    (["model.moe=3"], r"model.moe: expected a mapping \(section\), got 3"),
    (["train.steps"], r"train.steps: override must look like 'section.key=value'"),
    (["=3"], r"override '=3' has no key; write section.key=value"),
    (["+=3"], r"override '\+=3' has no key; write section.key=value"),
    (["train.steps=${nope"], r"cannot apply overrides \['train.steps=\$\{nope'\]"),
    (["train.steps=[1"], r"cannot apply overrides \['train.steps=\[1'\]"),
    (["[=3"], r"cannot apply overrides \['\[=3'\]"),
    (["train.steps=${nope}"], r"cannot resolve interpolations"),
]


@pytest.mark.parametrize(("overrides", "message"), CONVERSIONS, ids=[c[0][0] for c in CONVERSIONS])
def test_conversion_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(*overrides)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: [1\n", r"cannot parse .*bad.yaml"),
        ("- 1\n- 2\n", r"a recipe must be a mapping of sections"),
        ("model: 3\n", r"model: expected a mapping \(section\), got 3"),
    ],
    ids=["yaml_syntax", "not_a_mapping", "section_scalar"],
)
def test_recipe_file_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe(path)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe file '.*nope.yaml' does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_root_that_is_not_a_mapping():
    with pytest.raises(ConfigError, match=r"<root>: expected a mapping \(section\), got \[1\]"):
        recipe_from_container([1])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------------
# property: random recipes never crash load/validate with anything but ConfigError

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=9),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        ["auto", "none", "ring", "ulysses", "full", "selective", "qwen3_moe", "nemotron_h", "medpix", "${x}", ""]
    ),
    st.text(max_size=8),
)
_JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _typed(tp: Any) -> st.SearchStrategy:
    """Values of the field's own type, edge values often (0, -1, 1: where divisions and ranges go wrong)."""
    origin = get_origin(tp)
    if is_dataclass(tp):
        return _section(tp, junk=False)
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if origin in (Union, UnionType):
        return st.one_of([st.none() if arg is type(None) else _typed(arg) for arg in get_args(tp)])
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.sampled_from([-1, 0, 1, 2, 4]), st.integers(min_value=-2, max_value=16))
    if tp is float:
        return st.one_of(st.sampled_from([0.0, 1.0, -1.0]), st.floats(min_value=-1.0, max_value=2.0))
    if tp is str:
        return st.one_of(st.sampled_from(["none", "auto", "", " ", "runs/x"]), st.text(max_size=8))
    if origin is list:
        return st.lists(_typed(get_args(tp)[0]), max_size=3)
    if origin is dict:
        targets = st.sampled_from(["torch.optim.SGD", "os.system", "", 3])
        return st.dictionaries(st.sampled_from(["_target_", "lr"]), targets, max_size=2)
    return _JUNK


def _section(cls: type, *, junk: bool) -> st.SearchStrategy:
    """A random subset of the section's keys. ``junk``: also wrong types and unknown keys (conversion errors);
    otherwise every value has its field's type, so the recipe converts and the cross-field rules run."""
    hints = get_type_hints(cls)
    known = {}
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            known[f.name] = _section(tp, junk=junk)
        else:
            known[f.name] = st.one_of(_typed(tp), _typed(tp), _typed(tp), _JUNK) if junk else _typed(tp)
    section = st.fixed_dictionaries({}, optional=known)
    if not junk:
        return section
    unknown = st.dictionaries(st.text(min_size=1, max_size=6), _JUNK, max_size=1)
    return section.flatmap(lambda d: unknown.map(lambda extra: {**extra, **d}))


_RECIPES = st.one_of(_section(RecipeConfig, junk=False), _section(RecipeConfig, junk=True), _JUNK)
_OVERRIDE = st.one_of(
    st.text(max_size=12),
    st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(["train.steps", "parallel.cp", "model.moe.num_experts", "x.y", "+a", "train.betas"]),
        st.one_of(st.text(max_size=6), st.sampled_from(["[1", "${x", "${x}", "[0.9]", "0", "-1"])),
    ),
)
# Usually none (a bad override stops loading before the rules run), sometimes several.
_OVERRIDES = st.one_of(st.just([]), st.just([]), st.lists(_OVERRIDE, min_size=1, max_size=3))
_WORLD_SIZES = st.one_of(st.sampled_from([1, 2, 4, 8]), st.integers(min_value=-1, max_value=17))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=_RECIPES, overrides=_OVERRIDES, world_size=_WORLD_SIZES)
def test_random_recipes_fail_only_with_config_error(data, overrides, world_size):
    """Through the real entry (a YAML file, dotlist overrides), then every rule and the pre-launch resume check."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random.yaml"
        try:
            path.write_text(yaml.safe_dump(data))
        except (yaml.YAMLError, UnicodeEncodeError):
            return  # not representable as a recipe file at all
        try:
            recipe = load_recipe(path, overrides)
            validate_recipe(recipe, world_size=world_size)
            check_checkpoint_paths(recipe.checkpoint)
        except ConfigError as exc:
            assert exc.issues and all(isinstance(issue.message, str) for issue in exc.issues)
