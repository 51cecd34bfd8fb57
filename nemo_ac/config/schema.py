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

    num_experts: int = 8  # routed experts per MoE layer (divisible by parallel.ep)
    num_experts_per_tok: int = 2  # top-k: routed experts each token visits
    moe_intermediate_size: int = 32  # hidden width of each routed expert's FFN
    # Shared expert(s) that every token visits; 0 disables. GLM's n_shared_experts multiplies this width.
    shared_expert_intermediate_size: int = 0
    # Qwen3.5/3.6: a sigmoid gate scales the shared expert's output.
    shared_expert_gate: bool = False
    # Router scores from its logits: softmax over experts (Qwen3) or per-expert sigmoid (GLM-4.5, Nemotron-H).
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalize the k selected scores to sum to 1
    # Grouped top-k (DeepSeek-V3 / GLM-4.5): experts in n_group groups, tokens pick topk_group groups first.
    n_group: int = 1
    topk_group: int = 1  # groups each token keeps (with n_group > 1); experts are chosen only inside them
    routed_scaling_factor: float = 1.0  # multiplies the selected experts' weights (after norm_topk_prob)
    # GLM / DeepSeek e_score_correction_bias: added to scores for selection only.
    score_correction_bias: bool = False
    # Aux-loss-free load balancing: bias += rate * sign(mean_load - load) after each optimizer step, with the step's
    # loads summed over micro batches and ranks; needs score_correction_bias: true. 0 disables.
    bias_update_rate: float = 0.0
    # Weight of the Switch-style load-balancing loss (E * sum_e f_e * P_e, loads all-reduced globally); 0 disables.
    aux_loss_coef: float = 0.001
    # Expert FFN: silu = SwiGLU (gate_up_proj [E, 2I, H]); relu2 = relu(x)^2 without a gate (Nemotron-H).
    activation: Literal["silu", "relu2"] = "silu"
    # Nemotron-H latent MoE: tokens are projected to this width before the experts; 0 disables.
    latent_size: int = 0
    # Keep the router weight and its math in fp32 (its own nested FSDP unit when param dtype differs).
    router_dtype: Literal["float32", "param"] = "param"
    # How an fp32 router (router_dtype: float32) multiplies bf16 hidden states by its fp32 weight. float32: one fp32
    # GEMM (CUDA cores on a GPU). bf16x3: the weight as the exact sum of three bf16 pieces, three bf16 tensor-core
    # GEMMs with fp32 accumulation, the fp32 GEMM's result up to the order of additions (needs
    # parallel.fsdp.param_dtype: bfloat16). auto: bf16x3 on CUDA with bf16 compute, float32 elsewhere; the plan
    # prints its choice. docs/experts.md.
    router_gemm: Literal["auto", "float32", "bf16x3"] = "auto"
    # Experts as a separate (nested) FSDP unit inside the block: the layout that exposes the SAC desync.
    separate_fsdp_unit: bool = True
    # Routed-expert GEMMs. grouped_mm: one torch._grouped_mm per projection over expert-sorted rows, offsets on the
    # device (no host sync); needs fp32/bf16/fp16 and widths that are multiples of 16 bytes. loop: one matmul pair
    # per local expert (the reference; syncs on the per-expert counts). auto: grouped_mm where the device and the
    # compute dtype (parallel.fsdp.param_dtype) support it, loop elsewhere; the run prints its choice. docs/experts.md.
    experts_impl: Literal["auto", "loop", "grouped_mm"] = "auto"
    # Benchmarks and dry-run checks only: each token's k slots go round robin over the experts (token t, slot j ->
    # expert (t*k + j) mod num_experts), ignoring the router's scores for the choice (they still weight the outputs);
    # Megatron-Core's moe_router_force_load_balancing. Every expert then gets the same rows, the assumption
    # `nemo-ac plan` makes by default, so a real run and its dry run move the same bytes. Never for training.
    force_balanced_routing: bool = False


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
    time_step_floor: float = 1e-4  # lower bound of the initial dt (see time_step_max)


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet linear attention of Qwen3.5/3.6 (used only by family qwen3_5_moe)."""

    num_key_heads: int = 2  # linear_num_key_heads: query/key heads (divisible by parallel.cp)
    num_value_heads: int = 4  # linear_num_value_heads: a multiple of num_key_heads (divisible by parallel.cp)
    key_head_dim: int = 16  # linear_key_head_dim
    value_head_dim: int = 16  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim: width of the causal depthwise conv over q, k, v
    chunk_size: int = 16  # chunk length of the chunked gated delta rule (same math for any value; memory vs speed)


@dataclass
class VisionConfig:
    """Vision tower of Qwen3.5/3.6 (family qwen3_5_moe). depth 0 means text only."""

    depth: int = 0  # ViT blocks; 0 = no vision tower (text only; data.kind medpix needs >= 1)
    hidden_size: int = 32  # ViT width
    num_heads: int = 2  # ViT attention heads; hidden_size / num_heads must be a multiple of 4
    intermediate_size: int = 64  # ViT MLP width
    patch_size: int = 4  # patch side in pixels
    temporal_patch_size: int = 1  # frames per patch (the patch embedding is a Conv3d over time x height x width)
    # The merger concatenates spatial_merge_size x spatial_merge_size neighbouring patches into one text token.
    spatial_merge_size: int = 2
    in_channels: int = 3  # image channels
    # Learned absolute position table (a square grid, bilinearly resampled to each image's patch grid).
    num_position_embeddings: int = 16
    # Theta of the ViT's 2D (row, column) rotary embedding.
    rope_theta: float = 10000.0
    # Token id of the image placeholders that the vision features replace (and that place M-RoPE positions).
    image_token_id: int = 3
    # Token id that opens each image's run of placeholders, as the tokenizer writes it (exported to config.json;
    # with data.tokenizer tiny the three ids must be the tiny tokenizer's 3 / 1 / 2, checked in validation).
    vision_start_token_id: int = 1
    vision_end_token_id: int = 2  # token id that closes each image's run of placeholders


@dataclass
class ModelConfig:
    """The architecture: built on the meta device from these fields (names follow transformers' configs)."""

    # Model builder and HF architecture: qwen3_moe (Qwen3-MoE), glm4_moe (GLM-4.5 / -Air), nemotron_h (Nemotron-H /
    # Nemotron 3), qwen3_5_moe (Qwen3.5/3.6 vision-language MoE). Validation rejects options a family lacks.
    family: Family = "qwen3_moe"
    # Optional: Hugging Face model id or local dir whose safetensors are loaded after parallelization (random init
    # otherwise). Its config.json fills every architecture field below that the recipe does not set (a Hub id's from
    # recipes/hf_configs/, the HF cache or a download); a recipe key that overrides it is noted, and rejected when it
    # changes a weight's shape or the math. A Hub id's downloaded config.json is checked again before loading.
    pretrained: str | None = None
    vocab_size: int = 128  # token embedding rows (and lm_head outputs)
    hidden_size: int = 64  # residual stream width
    num_layers: int = 2  # decoder layers (equal to len(layer_pattern) when a pattern is given)
    num_attention_heads: int = 4  # query heads of the attention layers
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention; replicated when fewer than parallel.cp)
    head_dim: int = 16  # per-head width (need not be hidden_size / num_attention_heads)
    # Dense MLP width for layers that are not MoE (first_k_dense_replace / hybrid patterns).
    intermediate_size: int = 128
    # Layers [0, first_k_dense_replace) use a dense MLP instead of MoE.
    first_k_dense_replace: int = 0
    rope_theta: float = 10000.0  # base of the rotary position embedding's frequencies
    # Fraction of head_dim that gets rotary embedding (GLM uses 0.5).
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    attention_bias: bool = False  # biases on the q/k/v projections (and o_proj, except GLM)
    qk_norm: bool = True  # RMSNorm over each head's q and k before rotary (Qwen3)
    # Qwen3.5/3.6 gated attention: an output gate on attention heads.
    attn_output_gate: bool = False
    tie_word_embeddings: bool = False  # lm_head shares the token embedding's weight
    # Biases on dense MLPs, shared experts and MoE latent projections (nemotron_h's mlp_bias).
    mlp_bias: bool = False
    # Written to the exported config.json only: rotary positions are computed for any length, so it bounds nothing.
    max_position_embeddings: int = 4096
    # Std of the normal random init of linear, embedding, expert and router weights (unused with pretrained weights).
    init_std: float = 0.02
    # Hybrid layer pattern, one character per layer (length num_layers); other families take none.
    # nemotron_h (required, its hybrid_override_pattern): M = Mamba-2, * = attention, E = MoE, - = dense MLP.
    # qwen3_5_moe: L = Gated DeltaNet linear attention, A = gated full attention; empty = the HF default (every 4th
    # layer full attention: "LLLA" repeated).
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
    """Kernel backends. te needs its optional extra and CUDA; deepep needs DeepEP built from source and CUDA."""

    # Attention core over packed rows. tiled = nemo_ac's tiled custom op: no [S, S] tensor, only tiles holding
    # visible (same-document, causal) pairs computed, runs everywhere; flex = FlexAttention with a document block
    # mask (CUDA); sdpa = torch SDPA with a dense [B, 1, S, S] document mask (the reference: memory and work grow
    # with S^2); te = Transformer Engine DotProductAttention (CUDA, nemo_ac[te]; rejected with ring CP). auto = flex
    # on CUDA, tiled elsewhere; the run prints its choice. Ring CP runs each step on the same kernel (sdpa / te: dense
    # blocks).
    attention: Literal["auto", "tiled", "flex", "sdpa", "te"] = "auto"
    linear: Literal["torch", "te"] = "torch"  # the decoder blocks' nn.Linear, or te.Linear (CUDA, nemo_ac[te])
    rms_norm: Literal["torch", "te"] = "torch"  # the decoder blocks' RMSNorms, or te.RMSNorm (CUDA, nemo_ac[te])
    # Expert-parallel token exchange: torch = all_to_all_single with uneven splits; deepep = DeepEP's Buffer kernels
    # as custom ops that selective AC saves (CUDA only; parallel.ep 2, 4, 8 in a node or 16, 32, 64, 128, 144, 160
    # across nodes, also 24, 48, 96 with DeepEP 2.x; parallel.fsdp.param_dtype bfloat16; DeepEP built from source,
    # README "The DeepEP backend").
    dispatcher: Literal["torch", "deepep"] = "torch"
    # Gated DeltaNet core (conv1d + gated delta rule, qwen3_5_moe): torch = nemo_ac's chunked torch op (runs
    # everywhere, the reference); fla = flash-linear-attention's Triton kernels (causal_conv1d and
    # chunk_gated_delta_rule with cu_seqlens; CUDA, nemo_ac[fla]); auto = fla where CUDA and fla are present, torch
    # elsewhere and under parallel.cp_type: ring. The plan prints the choice per block.
    linear_attention: Literal["auto", "torch", "fla"] = "auto"
    # Mamba-2 core (conv1d + SSD scan, nemotron_h): torch = nemo_ac's chunked torch op; mamba_ssm = mamba-ssm's
    # Triton chunk scan and causal-conv1d's conv, both with seq_idx (CUDA; built from source, README "Mixer
    # kernels"); auto = mamba_ssm where CUDA and both packages are present, torch elsewhere and under ring CP.
    mamba: Literal["auto", "torch", "mamba_ssm"] = "auto"


@dataclass
class FSDPConfig:
    """FSDP2 (fully_shard) of nested expert/router units, then each block, then the root."""

    # Free each unit's unsharded parameters after its forward and all-gather them again for backward (the root
    # unit always keeps them); false holds them from forward to backward: more memory, fewer all-gathers.
    reshard_after_forward: bool = True
    # MixedPrecisionPolicy.param_dtype: the dtype parameters are all-gathered and computed in (the sharded
    # parameters keep their own dtype). An fp32 router (model.moe.router_dtype) keeps float32 in its own unit.
    param_dtype: DTypeName = "float32"
    reduce_dtype: DTypeName = "float32"  # MixedPrecisionPolicy.reduce_dtype: dtype of the gradient reductions
    # none: FSDP2's implicit order. explicit: each block prefetches the next block and its expert/router units.
    forward_prefetch: Literal["none", "explicit"] = "none"
    # default: FSDP2's implicit order. explicit: each block prefetches the previous block and its expert/router units.
    backward_prefetch: Literal["default", "explicit"] = "default"
    # Gradient reduction during accumulation. every_micro_batch: reduce-scatter (HSDP: and all-reduce) after every
    # micro batch's backward, holding only sharded gradients. last_micro_batch: accumulate unsharded gradients locally
    # and reduce once per step (FSDP2 set_requires_gradient_sync): fewer collectives, but every FSDP unit keeps a full
    # unsharded gradient from the first micro batch's backward until the last one's (model size x grad dtype bytes
    # per rank instead of 1/dp_shard of it).
    reduce_grads: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"


@dataclass
class ParallelConfig:
    """The device mesh: world size = dp_replicate * dp_shard * cp; experts borrow ep from dp_shard * cp."""

    dp_replicate: int = 1  # HSDP replica groups: parameters replicated across them, gradients all-reduced
    # -1: whatever is left of the world size after dp_replicate and cp.
    dp_shard: int = -1
    cp: int = 1  # context-parallel degree: each row's tokens are split over cp ranks
    # ulysses: all-to-all from sequence shards to head shards (heads divisible by cp). ring: K/V travel around the
    # ring with head-tail sharding (seq_len divisible by 2 * cp; attention-only families).
    cp_type: Literal["ulysses", "ring"] = "ulysses"
    # Expert parallel degree, borrowed from dp_shard * cp.
    ep: int = 1
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class SelectiveACConfig:
    """What the selective (SAC) policy saves in forward instead of recomputing; attention is always saved."""

    # False saves every matmul's output. True saves the matmuls worth their bytes (matmul_min_flops_per_byte) or,
    # with that at 0, every other matmul (torchtitan's rule).
    save_every_other_mm: bool = True
    # Save a matmul's output when recomputing it costs at least this many FLOPs per byte held: 2 x contraction width /
    # output element size (a bf16 projection out of a 2048-wide hidden state: 2048; an expert's down projection: its
    # expert width). 0: every other matmul. docs/sac.md has the frontier this default was chosen on.
    matmul_min_flops_per_byte: int = 2048
    # Save outputs of collectives (all-to-all, reduce-scatter) so recompute does not communicate again.
    save_communication: bool = True
    # Save router top-k / sort outputs so recompute routes every token to the same experts.
    save_router: bool = True


@dataclass
class ActivationCheckpointingConfig:
    """Activation checkpointing of decoder (and vision) blocks: nemo_ac/distributed/activation_checkpointing/."""

    # none: keep every activation. full: save each block's input and recompute the whole block in backward.
    # selective: save the op outputs the selective policy picks and recompute the rest (SAC).
    mode: Literal["none", "full", "selective"] = "none"
    # The mode of the blocks of one kind, overriding mode for them. The key is the first two fields of the plan's
    # block line joined by "+", without "dense" / "no mixer": the block's mixer kinds, plus "moe" where it routes
    # experts ("ssm", "moe", "softmax_attention+moe"; "mlp" for neither; "vision" for vision blocks). E.g.
    # {softmax_attention: none} keeps every activation of Nemotron-H's attention blocks while the others recompute.
    # A key no block of the model has is refused, naming the model's kinds.
    by_block: dict[str, Literal["none", "full", "selective"]] = field(default_factory=dict)
    # Move what decoder blocks save for backward to host memory during forward and back for backward (pinned
    # memory + a side stream on CUDA; nemo_ac/distributed/offload.py). With mode: full that is each block's input.
    # Rejected with mode: selective and with compile.enabled (docs/offload.md).
    offload: bool = False
    # With offload: the most decoder blocks whose offloaded tensors are on the device at once (N). Forward: block i
    # starts once the copies of block i-N to the host are done, and their device memory is released then. Backward:
    # the copies back of the N-1 blocks before the running one are prefetched on a side stream. 1: no overlap
    # across blocks (each block's tensors come back on the compute stream when autograd asks). docs/offload.md.
    offload_in_flight: int = 2
    # Where AC sits relative to a block's fully_shard: inside = fully_shard(AC(block)) (torchtitan's layout; only
    # nested expert/router units run their FSDP hooks inside the checkpoint); outside = AC(fully_shard(block))
    # (the block's own FSDP hooks run inside the checkpoint too).
    placement: Literal["inside", "outside"] = "inside"
    selective: SelectiveACConfig = field(default_factory=SelectiveACConfig)
    # Test/diagnostic switch: disable nemo_ac's SAC workarounds to observe the torch failure they prevent.
    workarounds: bool = True
    # The recompute of a checkpointed MoE block reuses the forward's expert choice instead of routing again, so
    # dispatch and split sizes in the recompute equal the forward's (nemo_ac/models/layers/routing_replay.py).
    # false re-routes in the recompute (only to observe the CheckpointError / wrong gradients that prevents).
    replay_routing: bool = True


@dataclass
class CompileConfig:
    """torch.compile of every decoder block in place (nemo_ac/distributed/compile/)."""

    enabled: bool = False  # compile each decoder block's forward (vision blocks are never compiled)
    backend: str = "inductor"  # a registered torch.compile backend (inductor, aot_eager, eager, ...)
    # torch.compile(fullgraph=True): a graph break is an error; rejected over blocks holding a nested FSDP unit.
    fullgraph: bool = False
    # compile_outer: compile(AC(block)); ac_outer: AC(compile(block)); auto: ac_outer for blocks holding a nested
    # FSDP unit, compile_outer otherwise.
    layout: Literal["auto", "compile_outer", "ac_outer"] = "auto"
    # Dynamo's recompile_limit for the compiled blocks (torch's default 8 is hit by packed variable-length rows),
    # applied thread-locally around each block.
    recompile_limit: int = 64
    # Dynamo's capture_scalar_outputs in the compiled blocks: trace .tolist() / .item() (the experts loop's
    # tokens_per_expert.tolist()) into the graph instead of breaking it.
    capture_scalar_outputs: bool = True
    # Make per-micro-batch ints (max_seqlen, ring slices) symbolic from the first compile.
    dynamic_ints: bool = True
    # Re-apply the forward thread's Dynamo settings when a checkpoint recomputes on another thread (false only to
    # observe the torch failure it prevents; docs/compile.md).
    forward_thread_context: bool = True
    # torch.compile(dynamic=): null = Dynamo's automatic dynamic shapes (static first compile, dynamic once a size
    # changes; with data.fixed_length=false the plan marks the blocks' token dims dynamic from the first compile,
    # so rows of varying length compile once); true = every input size symbolic from the first compile (weights'
    # dims too); false = always specialize (a recompile per distinct sequence length).
    dynamic: bool | None = None
    # backend inductor: one compile per graph per node. Each graph's compile holds a file lock in inductor's cache
    # dir (TORCHINDUCTOR_CACHE_DIR, shared by a node's ranks): the first rank compiles, the others wait and load its
    # artifacts from the cache instead of compiling the same graph at the same time. The CP ops' and the torch EP
    # dispatcher's collectives then address their group by its mesh dim (nemo_ac:cp, nemo_ac:ep) instead of the
    # group's own rank-specific name, so ranks in different EP / CP groups share those graphs too (docs/compile.md).
    node_shared_cache: bool = True


@dataclass
class DataConfig:
    """Packed rows with document ids: a synthetic task or MedPix-VQA (nemo_ac/data/)."""

    # synthetic: generated toy-task documents packed into rows; medpix: (image, question, answer) rows for
    # family qwen3_5_moe with a vision tower; text: plain-text or chat documents from data.path, packed into rows
    # of seq_len (nemo_ac/data/text.py).
    kind: Literal["synthetic", "medpix", "text"] = "synthetic"
    # Synthetic task: documents "<bos> x1..xn <sep> f(x)" where f is reverse or copy.
    task: Literal["reverse", "copy", "sort"] = "reverse"
    # Synthetic and text: tokens per row (synthetic: the longest row when fixed_length is false); divisible by cp
    # (ring: by 2 * cp).
    seq_len: int = 64
    min_doc_tokens: int = 4  # synthetic: fewest content tokens of a document (drawn uniformly up to max_doc_tokens)
    max_doc_tokens: int = 12  # synthetic: most content tokens of a document
    # Every micro batch packs to exactly seq_len (True) or to a varying multiple of pad_multiple (False).
    fixed_length: bool = True
    pad_multiple: int = 8  # synthetic, fixed_length false: row lengths are multiples of this in [seq_len/2, seq_len]
    # medpix and text: local path (a save_to_disk dir, a dir of parquet/json files, or one such file) or HF dataset
    # id; medpix also "synthetic[:N]" (N generated MedPix-shaped samples, nemo_ac.data.medpix_sample; default 48).
    path: str | None = None
    split: str = "train"  # medpix and text: the dataset split to read
    # medpix and text: None or "tiny" = the byte-level chat tokenizer shipped in nemo_ac.data.tiny_tokenizer (262
    # tokens; tiny recipes); otherwise an HF model id or dir (medpix: its AutoProcessor, which also preprocesses
    # images; text: its AutoTokenizer and chat template).
    tokenizer: str | None = None
    text_column: str = "text"  # text: the column with plain text (each row one document, EOS appended)
    # text: the column with chat messages ([{"role", "content"}, ...]); when set, rows are chats and the loss covers
    # only the assistant turns. Rows that are no usable chat (not a list of {role, content} string turns, or no
    # assistant turn) are skipped, counted, with a warning naming their rows (nemo_ac/config/text_rows.py).
    messages_column: str | None = None
    # text, chat rows: a Jinja file that replaces data.tokenizer's own chat template (one with {% generation %}
    # markers around the assistant turns marks exactly what they enclose as the loss targets); None: its own.
    chat_template: str | None = None
    # text: where the tokenized corpus is cached, memory-mapped by every rank and restart (nemo_ac/data/corpus.py);
    # shared storage: tokenized once per job, node-local disk: once per node. None: $NEMO_AC_DATA_CACHE, else
    # ~/.cache/nemo_ac/tokenized.
    cache_dir: str | None = None
    max_length: int = 4096  # medpix: tokens per row (every row exactly this long); divisible by cp
    # medpix: pack several samples per row (document_ids/positions restart) or one sample per row, padded.
    packing: bool = True
    # Background threads per rank that build the next step's batches while the current one trains (medpix: decode
    # and preprocess its images; text, synthetic: its micro batches); 0: on the training thread when a step's
    # batches are asked for. Same batches for every value; at most 64.
    num_workers: int = 0
    # medpix columns. "auto": "image" if the dataset has it, else "image_id" (mmoukouba/MedPix-VQA keeps the image
    # itself in image_id).
    image_column: str = "auto"
    question_column: str = "question"  # medpix: column with the question text
    answer_column: str = "answer"  # medpix: column with the answer text (the only tokens with labels)
    # medpix image budget (Qwen smart_resize: sides become multiples of patch_size * spatial_merge_size with the
    # pixel count in [min, max]); 0 keeps the processor's own setting (tiny tokenizer: one merged token .. 32*32).
    image_min_pixels: int = 0
    image_max_pixels: int = 0  # medpix: upper pixel budget of an image (see image_min_pixels); 0 keeps the default
    # Your own batch source: {"_target_": "mypkg.data.MyBatches", ...} (a _target_ under nemo_ac. or a prefix in
    # extensions.allow), called with data_cfg, vocab_size, global_batch_size, micro_batch_size, dp_rank, dp_size and
    # seed (the mapping's other keys override or add keyword arguments). It returns what SyntheticBatches is: an
    # iterator of per-step micro-batch lists with next_step, batches_for_step(step) and state_dict /
    # load_state_dict (checkpoints). Replaces data.kind's source (keep kind synthetic); None uses data.kind.
    source: dict[str, Any] | None = None


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
    """The loop: AdamW with warmup + cosine LR by default, gradient accumulation over micro batches."""

    steps: int = 20  # optimizer steps; 0 with checkpoint.export_hf: load (and export) without training
    # Rows per optimizer step over all data-parallel ranks; divisible by dp * micro_batch_size, the quotient being
    # the micro batches each rank accumulates per step.
    global_batch_size: int = 8
    micro_batch_size: int = 2  # rows per rank per forward/backward
    lr: float = 3e-3  # peak learning rate (reached after warmup_steps)
    min_lr_ratio: float = 0.1  # built-in scheduler: the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 2  # built-in scheduler: linear warmup steps
    # AdamW weight decay of parameters with >= 2 dims (norm weights, biases and router correction biases get none).
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # built-in AdamW betas
    eps: float = 1e-8  # built-in AdamW eps
    grad_clip: float = 1.0  # max global L2 gradient norm (over every mesh); 0 disables clipping (the norm is logged)
    # Where the built-in AdamW keeps its moment states (exp_avg, exp_avg_sq: 8 bytes per trainable parameter)
    # between steps: none = on the device; states = in (pinned) host memory, copied to the device bucket by bucket
    # for the update and back (trainer/host_optimizer_states.py; bitwise the same update, DCP checkpoints unchanged);
    # full = the sharded parameters (train.master_dtype), gradients and every optimizer state in host memory (FSDP2's
    # CPUOffloadPolicy: each unit's shard is copied to the device for its all-gather, each reduced gradient back) and
    # the optimizer step on the host: 16 bytes per parameter leave the device (8 with bf16 masters and moments), any
    # train.optimizer works.
    optimizer_offload: Literal["none", "states", "full"] = "none"
    # The dtype the built-in AdamW stores its two moments in between steps: float32 (torch's AdamW, 8 bytes per
    # trainable parameter), bfloat16 (4 bytes; each update still computes in fp32, and the moments are written back
    # with stochastic rounding, trainer/adamw_low_precision.py) or float8 (2.06 bytes: e4m3 codes with an fp32 scale
    # per 128 elements of a row, exp_avg_sq kept as its square root, stochastically rounded,
    # trainer/adamw_fp8_states.py; one-dim parameters keep fp32 moments). DCP resume stays bitwise.
    optimizer_state_dtype: Literal["float32", "bfloat16", "float8"] = "float32"
    # The dtype of the trainable parameters FSDP shards and the optimizer updates (the master weights), and so of
    # their gradients: float32 (4 + 4 bytes per parameter) or bfloat16 (2 + 2; NeMo Automodel's benchmarks train so).
    # With bfloat16 the built-in AdamW computes each update in fp32 and writes the parameter back with stochastic
    # rounding (trainer/adamw_low_precision.py): plain AdamW on bf16 weights loses every step smaller than half a bf16
    # step.
    # Modules the model keeps in fp32 (the router with model.moe.router_dtype=float32) keep fp32 masters. Needs
    # parallel.fsdp.param_dtype=bfloat16 and the built-in AdamW.
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # The LM head and the cross entropy over this many tokens at a time (models/kernels/chunked_cross_entropy.py):
    # no [tokens, vocab] logits in forward or backward, one extra LM-head matmul per token (backward recomputes each
    # chunk). 0 computes the whole micro batch's logits at once.
    loss_chunk_tokens: int = 0
    # Seeds torch, the per-tensor weight init (seed, parameter name) and the data streams.
    seed: int = 1234
    # Debug: run backward on a worker thread, emulating the CUDA autograd device thread on CPU.
    backward_on_thread: bool = False
    # Extension points: {"_target_": "torch.optim.AdamW", ...} (a _target_ under torch.optim., nemo_ac. or a prefix
    # in extensions.allow), called with the parameter groups and lr; None uses the built-in AdamW (betas, eps).
    optimizer: dict[str, Any] | None = None
    # {"_target_": "torch.optim.lr_scheduler....", ...}, called with the optimizer (same _target_ rule as
    # optimizer); None uses warmup + cosine (warmup_steps, min_lr_ratio).
    scheduler: dict[str, Any] | None = None
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    # Stop (for fault-injection tests) by raising after this step; 0 disables.
    fail_after_step: int = 0
    # Seconds a SIGTERM / SIGINT may take to reach the next step boundary (where the step is saved and the run exits
    # 0); past it (a first step still compiling, a slow save) rank 0 prints which checkpoint stands and the ranks
    # exit 128 + signum. Keep it under the launcher's grace before SIGKILL (torchrun: 30 s).
    stop_deadline_s: float = 20.0


@dataclass
class CheckpointConfig:
    """DCP checkpoints under ``dir``/step_<N>/ (see nemo_ac/trainer/checkpoint/dcp.py and docs/checkpoints.md)."""

    # Save (every_n_steps, at the last step, and when SIGTERM/SIGINT stops the run). Resuming works whether or not
    # this run saves. The flagship recipes turn it on; the tiny ones leave it off.
    enabled: bool = False
    # Holds step_<N>/ checkpoints, the latest pointer and .step_<N>.partial/ saves. null: <logging.run_dir>/checkpoints
    # (resolved when the recipe is loaded), so every run directory has its own checkpoints.
    dir: str | None = None
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
class WandbConfig:
    """Weights & Biases run (rank 0), beside metrics.jsonl; needs the optional extra: pip install 'nemo_ac[wandb]'."""

    # disabled: no W&B run; offline: a local run directory under run_dir/wandb (`wandb sync` uploads it later);
    # online: streams to the W&B server (needs `wandb login` or WANDB_API_KEY on rank 0's node).
    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "nemo_ac"  # W&B project
    name: str | None = None  # run name (null: the recipe's name)


@dataclass
class LoggingConfig:
    """What rank 0 prints and writes."""

    run_dir: str = "runs/latest"  # rank 0 writes recipe.yaml (resolved), metrics.jsonl and summary.json here
    # Print a metrics line every N steps and at the last one when there is no progress bar (stdout not a terminal).
    log_every: int = 1
    # "auto": a tqdm progress bar (elapsed, ETA, tokens/s, loss) when stdout is a terminal, plain lines otherwise
    # (YAML reads on/off as booleans, hence always/never).
    progress_bar: Literal["auto", "always", "never"] = "auto"
    jsonl: bool = True  # write one JSON record per step to run_dir/metrics.jsonl
    # Also write TensorBoard event files to run_dir/tensorboard (pip install 'nemo_ac[tensorboard]').
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DistConfig:
    """The default process group (a world of one outside torchrun)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA devices, gloo otherwise
    timeout_s: int = 300  # process group timeout in seconds
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available and backend is not gloo, else cpu


@dataclass
class ExtensionsConfig:
    """User modules that the _target_ extension points (train.optimizer, train.scheduler, data.source) may import."""

    # Module prefixes allowed besides the built-in torch.optim. and nemo_ac.: "mypkg." allows every module under
    # mypkg; a module path without the trailing dot ("mypkg.optim") allows that module and its submodules only. The
    # module must be importable on every node (installed, or on PYTHONPATH). Standard-library prefixes are refused.
    allow: list[str] = field(default_factory=list)


@dataclass
class RecipeConfig:
    """A recipe: the top-level keys and one section per part of a run."""

    name: str = "recipe"  # printed in the run's first line
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
    extensions: ExtensionsConfig = field(default_factory=ExtensionsConfig)
