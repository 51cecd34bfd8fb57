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
    # Routed-expert GEMMs. grouped_mm: one torch._grouped_mm per projection over expert-sorted rows, offsets on the
    # device (no host sync); needs fp32/bf16/fp16 and widths that are multiples of 16 bytes. loop: one matmul pair
    # per local expert (the reference; syncs on the per-expert counts). auto: grouped_mm where the device and the
    # compute dtype (parallel.fsdp.param_dtype) support it, loop elsewhere; the run prints its choice.
    experts_impl: Literal["auto", "loop", "grouped_mm"] = "auto"


@dataclass
class MambaConfig:
    """Mamba-2 mixer of Nemotron-H (used only by family nemotron_h). HF names in comments."""

    num_heads: int = 4  # mamba_num_heads
    head_dim: int = 8  # mamba_head_dim; the mixer width is num_heads * head_dim
    state_size: int = 16  # ssm_state_size
    n_groups: int = 1  # n_groups (B/C groups; also the gated norm's groups)
    conv_kernel: int = 4  # conv_kernel
    chunk_size: int = 16  # chunk_size of the SSD scan (math is exact for any value; it trades memory for speed)
    # Informational only: transformers' NemotronH sizes the mixer by num_heads * head_dim, not expand * hidden.
    expand: int = 2
    conv_bias: bool = True  # use_conv_bias
    proj_bias: bool = False  # use_bias (in_proj / out_proj)
    # dt = softplus(dt + dt_bias) is clamped to >= time_step_min (transformers 5.18 uses (time_step_min, inf)).
    time_step_min: float = 0.001
    # dt_bias init: inverse softplus of dt ~ logU(time_step_min, time_step_max), floored at time_step_floor.
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4


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
    # Learned absolute position table (a square grid, bilinearly resampled to each image's patch grid).
    num_position_embeddings: int = 16
    # Theta of the ViT's 2D (row, column) rotary embedding.
    rope_theta: float = 10000.0
    image_token_id: int = 3
    vision_start_token_id: int = 1
    vision_end_token_id: int = 2


@dataclass
class ModelConfig:
    family: Family = "qwen3_moe"
    # Optional: Hugging Face model id or local dir whose safetensors are loaded after parallelization (random init
    # otherwise). The architecture is built from the fields below; a local dir's config.json must agree with them
    # (checked before any process group starts; a Hub id is checked after download, before loading).
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
    # Biases on dense MLPs, shared experts and MoE latent projections (nemotron_h's mlp_bias).
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    # Hybrid layer pattern (nemotron_h: "M*E..." ; qwen3_5_moe: layer types). Empty = all attention+MoE.
    # qwen3_5_moe: one character per layer, L = Gated DeltaNet linear attention, A = gated full attention; empty =
    # the HF default (every 4th layer full attention: "LLLA" repeated).
    layer_pattern: str = ""
    # qwen3_5_moe multimodal rope (HF rope_parameters.mrope_section, interleaved): how many of the rotary_dim/2
    # frequencies rotate by the temporal / height / width position. Must sum to rotary_dim/2 when vision.depth > 0.
    mrope_section: list[int] = field(default_factory=list)
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
    # Gradient reduction during accumulation. every_micro_batch: reduce-scatter (HSDP: and all-reduce) after every
    # micro batch's backward, holding only sharded gradients. last_micro_batch: accumulate unsharded gradients locally
    # and reduce once per step (FSDP2 set_requires_gradient_sync): fewer collectives, but every FSDP unit keeps a full
    # unsharded gradient from the first micro batch's backward until the last one's (model size x grad dtype bytes
    # per rank instead of 1/dp_shard of it).
    reduce_grads: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"


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
    # Save router top-k / sort outputs so recompute routes every token to the same experts.
    save_router: bool = True


@dataclass
class ActivationCheckpointingConfig:
    mode: Literal["none", "full", "selective"] = "none"
    # Move what decoder blocks save for backward to host memory during forward and back for backward (pinned
    # memory + a side stream on CUDA; nemo_ac/distributed/offload.py). With mode: full that is each block's input.
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
    # torch.compile(dynamic=): null = Dynamo's automatic dynamic shapes (static first compile, dynamic once a size
    # changes); true = every input size symbolic from the first compile (one compile instead of two when
    # data.fixed_length=false); false = always specialize (a recompile per distinct sequence length).
    dynamic: bool | None = None


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
    # medpix: local path (a save_to_disk dir, a dir of parquet/json files, or one such file), HF dataset id, or
    # "synthetic[:N]" (N generated MedPix-shaped samples, nemo_ac.data.medpix_sample; default 48).
    path: str | None = None
    split: str = "train"
    # medpix: None or "tiny" = the byte-level chat tokenizer shipped in nemo_ac.data.tiny_tokenizer (tiny recipes);
    # otherwise an HF model id or dir whose AutoProcessor formats the chat, tokenizes and preprocesses images.
    tokenizer: str | None = None
    max_length: int = 4096
    # medpix: pack several samples per row (document_ids/positions restart) or one sample per row, padded.
    packing: bool = True
    num_workers: int = 0
    # medpix columns. "auto": "image" if the dataset has it, else "image_id" (mmoukouba/MedPix-VQA keeps the image
    # itself in image_id).
    image_column: str = "auto"
    question_column: str = "question"
    answer_column: str = "answer"
    # medpix image budget (Qwen smart_resize: sides become multiples of patch_size * spatial_merge_size with the
    # pixel count in [min, max]); 0 keeps the processor's own setting (tiny tokenizer: one merged token .. 32*32).
    image_min_pixels: int = 0
    image_max_pixels: int = 0


@dataclass
class FreezeConfig:
    """requires_grad=False groups (nemo_ac.models.freeze): frozen parameters get no grads and no optimizer state."""

    # ViT: patch embedding, position table and blocks (model.visual.* except the merger).
    vision_tower: bool = False
    # The patch merger (the projector into the text hidden size); trainable by default so it can adapt the frozen
    # tower's features to the task, as in Qwen-VL finetuning.
    vision_merger: bool = False
    # Token embedding table (and lm_head when tied to it).
    embeddings: bool = False
    # Decoder layers, final norm and an untied lm_head.
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
    """DCP checkpoints under ``dir``/step_<N>/ (see nemo_ac/trainer/checkpoint.py and README "Checkpoints")."""

    # Save (every_n_steps and at the last step). Resuming works whether or not this run saves.
    enabled: bool = False
    dir: str = "runs/checkpoints"
    # 0: save only at the end.
    every_n_steps: int = 0
    # Complete checkpoints to keep; older ones are deleted after a new one is published.
    keep_last: int = 2
    resume: str = "none"  # none | auto (newest complete checkpoint under dir) | path to a step_<N> directory
    # Check every file's sha256 against the manifest before loading (sizes are always checked).
    verify: bool = True
    # At the end of training, write the model as a consolidated Hugging Face checkpoint (config.json + safetensors,
    # per-expert keys) that transformers' from_pretrained and model.pretrained load. Works with train.steps=0 to
    # convert model.pretrained / checkpoint.resume weights without training.
    export_hf: bool = False
    # Where export_hf writes (replaced atomically); null = <checkpoint.dir>/hf.
    export_hf_dir: str | None = None
    # dtype of exported floating-point parameters; null = as trained (the fp32 master weights by default).
    export_dtype: DTypeName | None = None


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
