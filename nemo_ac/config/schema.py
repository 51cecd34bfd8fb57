"""Typed recipe schema.

Every recipe key lives in one of these dataclasses. ``config.load`` turns the merged omegaconf tree into these
objects key by key, so a typo, a wrong type or a value outside a ``Literal`` fails with the dotted key, the bad
value and the valid choices before any process group exists. Cross-field rules live in ``config.validate``.

This module imports neither torch nor anything else from nemo_ac: a recipe validates on a login node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["qwen3_moe", "glm4_moe", "nemotron_h", "qwen3_5_moe"]
DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass
class MoEConfig:
    """Routed experts. Names follow the Hugging Face configs where one exists."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    # Shared expert(s) that every token visits; 0 disables. GLM's n_shared_experts multiplies this width.
    shared_expert_intermediate_size: int = 0
    # Qwen3.5/3.6: a sigmoid gate scales the shared expert's output.
    shared_expert_gate: bool = False
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    # Grouped top-k (DeepSeek-V3 / GLM-4.5): experts in n_group groups, tokens pick topk_group groups first.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # GLM / DeepSeek e_score_correction_bias: added to scores for selection only.
    score_correction_bias: bool = False
    # Aux-loss-free load balancing: bias += rate * sign(mean_load - load) after each optimizer step. 0 disables.
    bias_update_rate: float = 0.0
    aux_loss_coef: float = 0.001
    activation: Literal["silu", "relu2"] = "silu"
    # Nemotron-H latent MoE: tokens are projected to this width before the experts; 0 disables.
    latent_size: int = 0
    # Keep the router weight and its math in fp32 (its own nested FSDP unit when param dtype differs).
    router_dtype: Literal["float32", "param"] = "param"
    # Experts as a separate (nested) FSDP unit inside the block: the layout that exposes the SAC desync.
    separate_fsdp_unit: bool = True


@dataclass
class MambaConfig:
    """Mamba-2 mixer of Nemotron-H (used only by family nemotron_h)."""

    num_heads: int = 4
    head_dim: int = 8
    state_size: int = 16
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 16
    expand: int = 2


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet linear attention of Qwen3.5/3.6 (used only by family qwen3_5_moe)."""

    num_key_heads: int = 2
    num_value_heads: int = 4
    key_head_dim: int = 16
    value_head_dim: int = 16
    conv_kernel: int = 4
    chunk_size: int = 16


@dataclass
class VisionConfig:
    """Vision tower of Qwen3.5/3.6 (family qwen3_5_moe). depth 0 means text only."""

    depth: int = 0
    hidden_size: int = 32
    num_heads: int = 2
    intermediate_size: int = 64
    patch_size: int = 4
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    in_channels: int = 3
    image_token_id: int = 3
    vision_start_token_id: int = 1
    vision_end_token_id: int = 2


@dataclass
class ModelConfig:
    family: Family = "qwen3_moe"
    # Optional: Hugging Face model id or local dir whose safetensors are loaded after parallelization.
    pretrained: str | None = None
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    # Dense MLP width for layers that are not MoE (first_k_dense_replace / hybrid patterns).
    intermediate_size: int = 128
    # Layers [0, first_k_dense_replace) use a dense MLP instead of MoE.
    first_k_dense_replace: int = 0
    rope_theta: float = 10000.0
    # Fraction of head_dim that gets rotary embedding (GLM uses 0.5).
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = True
    # Qwen3.5/3.6 gated attention: an output gate on attention heads.
    attn_output_gate: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    # Hybrid layer pattern (nemotron_h: "M*E..." ; qwen3_5_moe: layer types). Empty = all attention+MoE.
    layer_pattern: str = ""
    moe: MoEConfig = field(default_factory=MoEConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)


@dataclass
class BackendConfig:
    """Kernel backends. te / deepep need their optional extras and CUDA."""

    attention: Literal["sdpa", "te"] = "sdpa"
    linear: Literal["torch", "te"] = "torch"
    rms_norm: Literal["torch", "te"] = "torch"
    dispatcher: Literal["torch", "deepep"] = "torch"


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = True
    param_dtype: DTypeName = "float32"
    reduce_dtype: DTypeName = "float32"
    # none: FSDP2's implicit order. explicit: each block prefetches the next block and its expert/router units.
    forward_prefetch: Literal["none", "explicit"] = "none"
    backward_prefetch: Literal["default", "explicit"] = "default"


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    # -1: whatever is left of the world size after dp_replicate and cp.
    dp_shard: int = -1
    cp: int = 1
    cp_type: Literal["ulysses", "ring"] = "ulysses"
    # Expert parallel degree, borrowed from dp_shard * cp.
    ep: int = 1
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class SelectiveACConfig:
    # Save every other matmul's output (torchtitan's policy); False saves every matmul.
    save_every_other_mm: bool = True
    # Save outputs of collectives (all-to-all, reduce-scatter) so recompute does not communicate again.
    save_communication: bool = True


@dataclass
class ActivationCheckpointingConfig:
    mode: Literal["none", "full", "selective"] = "none"
    # Move saved activations to CPU during forward and back for backward.
    offload: bool = False
    # Where AC sits relative to a block's fully_shard: inside = fully_shard(AC(block)) (torchtitan's layout; only
    # nested expert/router units run their FSDP hooks inside the checkpoint); outside = AC(fully_shard(block))
    # (the block's own FSDP hooks run inside the checkpoint too).
    placement: Literal["inside", "outside"] = "inside"
    selective: SelectiveACConfig = field(default_factory=SelectiveACConfig)
    # Test/diagnostic switch: disable nemo_ac's SAC workarounds to observe the torch failure they prevent.
    workarounds: bool = True


@dataclass
class CompileConfig:
    enabled: bool = False
    backend: str = "inductor"
    fullgraph: bool = False
    # compile_outer: compile(AC(block)); ac_outer: AC(compile(block)); auto: ac_outer for blocks holding a nested
    # FSDP unit, compile_outer otherwise.
    layout: Literal["auto", "compile_outer", "ac_outer"] = "auto"
    recompile_limit: int = 64
    capture_scalar_outputs: bool = True
    # Make per-micro-batch ints (max_seqlen, ring slices) symbolic from the first compile.
    dynamic_ints: bool = True
    # Re-apply the forward thread's Dynamo settings when a checkpoint recomputes on another thread.
    forward_thread_context: bool = True


@dataclass
class DataConfig:
    kind: Literal["synthetic", "medpix"] = "synthetic"
    # Synthetic task: documents "<bos> x1..xn <sep> f(x)" where f is reverse or copy.
    task: Literal["reverse", "copy", "sort"] = "reverse"
    seq_len: int = 64
    min_doc_tokens: int = 4
    max_doc_tokens: int = 12
    # Every micro batch packs to exactly seq_len (True) or to a varying multiple of pad_multiple (False).
    fixed_length: bool = True
    pad_multiple: int = 8
    # medpix: local path or HF id, tokenizer / processor name or path.
    path: str | None = None
    tokenizer: str | None = None
    max_length: int = 4096
    packing: bool = True
    num_workers: int = 0


@dataclass
class FreezeConfig:
    vision_tower: bool = False
    embeddings: bool = False
    language_model: bool = False


@dataclass
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 2
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    # Debug: run backward on a worker thread, emulating the CUDA autograd device thread on CPU.
    backward_on_thread: bool = False
    # Extension points: {"_target_": "torch.optim.AdamW", ...}; None uses the built-in choice.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    # Stop (for fault-injection tests) by raising after this step; 0 disables.
    fail_after_step: int = 0


@dataclass
class CheckpointConfig:
    enabled: bool = False
    dir: str = "runs/checkpoints"
    every_n_steps: int = 0
    keep_last: int = 2
    resume: str = "none"  # none | auto | path to a step_<N> directory
    export_hf: bool = False


@dataclass
class LoggingConfig:
    run_dir: str = "runs/latest"
    log_every: int = 1
    # "auto": a progress bar when stdout is a terminal (YAML reads on/off as booleans, hence always/never).
    progress_bar: Literal["auto", "always", "never"] = "auto"
    jsonl: bool = True


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: int = 300
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class RecipeConfig:
    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
