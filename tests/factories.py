"""Tiny model configs and checkpoint helpers shared by the unit and functional tests (one place for them).

Test modules never import each other: what two of them share lives here (or, for fixtures, in ``conftest.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import torch

from nemo_ac.config.schema import LinearAttentionConfig, MambaConfig, ModelConfig, MoEConfig, VisionConfig
from nemo_ac.distributed.activation_checkpointing import ContextFn, sac_region_context_fn, selective_policy_factory
from nemo_ac.distributed.context_parallel.ring import ring_block_update, ring_kernel_step
from nemo_ac.distributed.context_parallel.sharding import ring_attention_inputs, shard_positions
from nemo_ac.models import build_model
from nemo_ac.models.expert_bias import biased_routers
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.layers.attention import build_attention_inputs, packed_causal_attention
from nemo_ac.trainer.checkpoint.hf_safetensors import INDEX_FILE

# --- tiny model configs ----------------------------------------------------------------------------------------


def qwen3_moe_config() -> ModelConfig:
    """A tiny Qwen3-MoE config: one dense layer then one MoE layer."""
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        first_k_dense_replace=1,
        intermediate_size=40,
        head_dim=8,
        moe=MoEConfig(num_experts=4, moe_intermediate_size=12),
    )


def glm_config(**overrides: object) -> ModelConfig:
    """A tiny GLM-4.5-Air-shaped config: dense first layer, grouped sigmoid routing, partial rotary, q/k/v bias."""
    moe = MoEConfig(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,  # n_shared_experts = 2
        score_func="sigmoid",
        score_correction_bias=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        router_dtype="float32",
    )
    base = {
        "family": "glm4_moe",
        "vocab_size": 96,
        "hidden_size": 48,
        "num_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "intermediate_size": 80,
        "first_k_dense_replace": 1,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "qk_norm": False,
        "init_std": 0.1,  # large enough that routing and attention are far from uniform
        "moe": moe,
    }
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def nemotron_config(latent_size: int = 16, **overrides: object) -> ModelConfig:
    """A tiny Nemotron-3-shaped config: every layer type, latent MoE, grouped sigmoid routing, 2 B/C groups."""
    moe = MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        score_func="sigmoid",
        score_correction_bias=True,
        activation="relu2",
        latent_size=latent_size,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        router_dtype="float32",
    )
    base = {
        "family": "nemotron_h",
        "vocab_size": 96,
        "hidden_size": 48,
        "num_layers": 6,
        "layer_pattern": "ME*M-E",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "intermediate_size": 40,
        "qk_norm": False,
        "rms_norm_eps": 1e-5,
        "init_std": 0.1,
        "moe": moe,
        "mamba": MambaConfig(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, chunk_size=8),
    }
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


# A tiny Qwen3.5 vision tower (the ``vision`` overrides of ``qwen3_5_config`` start from it): 4-pixel patches, two
# frames per temporal patch, 2x2 merge, a 3x3 position table; image / vision-start / vision-end token ids 5 / 3 / 4.
QWEN3_5_VISION = VisionConfig(
    depth=1,
    hidden_size=16,
    num_heads=2,
    intermediate_size=24,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=9,
    image_token_id=5,
    vision_start_token_id=3,
    vision_end_token_id=4,
)


def qwen3_5_config(
    *,
    moe: Mapping[str, object] | None = None,
    linear_attention: Mapping[str, object] | None = None,
    vision: Mapping[str, object] | None = None,
    **overrides: object,
) -> ModelConfig:
    """A tiny Qwen3.5-MoE decoder: Gated DeltaNet layer then gated attention layer, partial M-RoPE. ``moe`` /
    ``linear_attention``: fields that differ from this config's sections; ``vision``: a vision tower, the fields
    that differ from ``QWEN3_5_VISION`` (left out: text only); ``overrides``: top-level ``ModelConfig`` fields."""
    base: dict[str, object] = {
        "family": "qwen3_5_moe",
        "vocab_size": 96,
        "hidden_size": 48,
        "num_layers": 2,
        "layer_pattern": "LA",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 1],
        "rms_norm_eps": 1e-6,
        "attn_output_gate": True,
        "init_std": 0.1,
        "moe": MoEConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            shared_expert_gate=True,
            norm_topk_prob=True,
            router_dtype="param",  # transformers' Qwen3.5 router runs in the parameter dtype
        ),
        "linear_attention": LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4, chunk_size=8
        ),
    }
    base["moe"] = dataclasses.replace(base["moe"], **(moe or {}))  # type: ignore[arg-type]
    base["linear_attention"] = dataclasses.replace(
        base["linear_attention"],  # type: ignore[arg-type]
        **(linear_attention or {}),
    )
    if vision is not None:
        base["vision"] = dataclasses.replace(QWEN3_5_VISION, **vision)
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


# HF family (model_type) -> its tiny text-only config, for the config.json and safetensors round trips.
CONFIGS = {
    "qwen3_moe": qwen3_moe_config,
    "glm4_moe": glm_config,
    "nemotron_h": nemotron_config,
}


# --- Hub-layout safetensors checkpoints -----------------------------------------------------------------------


def write_hub_checkpoint(
    cfg: ModelConfig, root: Path, *, dtype: torch.dtype = torch.bfloat16, grouped: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights under the Hub's names (written independently of ``trainer.checkpoint.hf_safetensors``): per-expert
    matrices unless ``grouped``, ``backbone.`` for Nemotron-H, two safetensors files plus an index. Returns
    key -> tensor."""
    import safetensors.torch

    gen = torch.Generator().manual_seed(0)
    hub: dict[str, torch.Tensor] = {}
    for name, meta in build_model(cfg).state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        is_buffer = name.endswith("e_score_correction_bias")
        value = torch.randn(meta.shape, generator=gen).to(torch.float32 if is_buffer else dtype)
        prefix, _, local = name.rpartition(".")
        if not grouped and prefix.endswith(".experts"):
            for e in range(value.shape[0]):
                if local == "gate_up_proj":
                    gate, up = value[e].chunk(2)
                    hub[f"{prefix}.{e}.gate_proj.weight"], hub[f"{prefix}.{e}.up_proj.weight"] = gate, up
                else:  # up_proj (squared-ReLU experts) or down_proj
                    hub[f"{prefix}.{e}.{local}.weight"] = value[e]
        else:
            hub[name] = value
    if cfg.family == "nemotron_h":
        hub = {("backbone." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in hub.items()}
    hub = {k: v.clone().contiguous() for k, v in hub.items()}
    keys = sorted(hub)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    root.mkdir(parents=True, exist_ok=True)
    for file, names in shards.items():
        safetensors.torch.save_file({k: hub[k] for k in names}, str(root / file), metadata={"format": "pt"})
    weight_map = {k: file for file, names in shards.items() for k in names}
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hub


def read_dir(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``root``."""
    import safetensors.torch

    out: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(file)))
    return out


def assert_bytes_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys, and every tensor has the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


# --- SAC ---------------------------------------------------------------------------------------------------------

# The profiler ops workarounds.profiler_ops_in_sac adds to torch's SAC_IGNORED_OPS.
PROFILER_OPS = {
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def unfixed_selective_context_fn(*, region: str = "") -> ContextFn:
    """nemo_ac's SAC context for one region WITHOUT the profiler-op ignore (``workarounds.profiler_ops_in_sac``):
    to observe the torch 2.13 failure the production factory prevents. Run it on a private ``SAC_IGNORED_OPS``
    (the ``private_sac_ignored_ops`` fixture): another test may have installed the ignore in this process."""
    return sac_region_context_fn(selective_policy_factory(region=region), region=region)


# --- benchmark peers (benchmarks/_flagship_peers.py, benchmarks/_automodel_peers.py) ---------------------------

PEER_TOL = 1e-5  # max |nemo - hf| relative to max |hf|
PEER_SEQ = {"qwen": 29, "glm": 21, "nemotron": 21}  # several chunks (8) plus a ragged tail; never a model dimension
# kind -> index of the layer it runs on in the tiny models (``peer_layers``).
PEER_LAYER = {
    "qwen_linear_mixer": 0,
    "qwen_attention_mixer": 1,
    "qwen_moe_ffn": 1,
    "glm_attention_mixer": 1,
    "glm_dense_ffn": 0,
    "glm_moe_ffn": 1,
    "nemotron_mamba": 0,
    "nemotron_attention": 2,
    "nemotron_moe": 1,
}


def peer_layers(family: str) -> tuple[ModelConfig, torch.nn.ModuleList]:
    """(config, decoder layers) of ``family``'s tiny model (``qwen``, ``glm``, ``nemotron``), initialized with 1-D
    parameters and router biases moved off their constant init, for sub-block parity with the benchmark peers."""
    cfg = {"qwen": qwen3_5_config, "glm": glm_config, "nemotron": nemotron_config}[family]()
    model = materialize_and_init(build_model(cfg), device="cpu", seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms, A_log, dt_bias, D start at constants: perturb so parity tests them
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        for router in biased_routers(model):  # a non-zero correction bias must steer selection identically
            router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, cfg.moe.num_experts))
    inner = model.model.language_model if family == "qwen" else model.model
    return cfg, inner.layers


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn(*args)`` runs (saved_tensors_hooks)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as module ``benchmarks.<name>``, loaded once by path (``benchmarks/`` is no package:
    its scripts import each other as top-level modules)."""
    key = f"benchmarks.{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            key, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


def peak_bytes(step) -> int:
    """Peak bytes allocated during ``step()`` and not yet freed, above what existed before it: on CPU, the measure of
    ``benchmarks/_measure.peak_bytes`` (flagship_memory.py's peak; the profiler's allocation events)."""
    return benchmark_module("_measure").peak_bytes(step, device=torch.device("cpu"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_side_by_side(runs: dict, *, seq: int, hidden: int) -> dict[str, tuple]:
    """For each ``name -> (fn, named parameters)``: forward on the same random input, backward of a probe loss (its
    gradient is not all ones); ``name -> (out, d input, {param name: grad})``."""
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(1, seq, hidden, generator=gen)
    probe = torch.randn(1, seq, hidden, generator=gen)
    results = {}
    for name, (fn, params) in runs.items():
        x = h.clone().requires_grad_(True)
        out = fn(x)
        (out * probe).sum().backward()
        results[name] = (out.detach(), x.grad, {k: p.grad for k, p in params.items()})
    return results


def packed_square_loss(model: torch.nn.Module) -> float:
    """One forward + backward of a tiny LM on two packed rows (seeded ids, 7-token documents, vocab 64): the
    mean squared logit (a loss with a gradient everywhere). The same inputs everywhere, so losses compare."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    doc = (torch.arange(40) // 7).expand(2, 40).contiguous()
    out = model(ids, position_ids=(torch.arange(40) % 7).expand(2, 40).contiguous(), attn=build_attention_inputs(doc))
    loss = out.logits.float().square().mean()
    loss.backward()
    return loss.item()


# The config.json of a flagship checkpoint, as published on the Hub (the HF I/O and flagship recipe tests share it).
# zai-org/GLM-4.5-Air config.json as published (transformers 4.54 era: legacy top-level rope keys).
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
}


# The config.json of a flagship checkpoint, as published on the Hub (the HF I/O and flagship recipe tests share it).
QWEN36_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}


# Ring attention emulated in one process (every rank's K/V blocks in ring order), shared by the ring and the
# packed-attention tests.
RING_NH, RING_NKV, RING_HD = 4, 2, 8


def ring_packed_docs(seq_len: int, lengths: list[int], *, pad_tail: int = 0) -> torch.Tensor:
    """Document ids of one row: documents of the given lengths, then ``pad_tail`` padding tokens (-1)."""
    ids = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad_tail
    assert len(ids) == seq_len, (len(ids), seq_len)
    return torch.tensor(ids)


def ring_docs(seq_len: int) -> torch.Tensor:
    """Two rows: short documents with padding, and one long document spanning several chunks."""
    first = ring_packed_docs(seq_len, [3, 5, 1, seq_len - 9 - 2], pad_tail=2)
    second = ring_packed_docs(seq_len, [seq_len - 4, 4])
    return torch.stack((first, second))


def emulated_ring_qkv(b: int, s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, RING_NH, RING_HD, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, RING_NKV, RING_HD, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, RING_NKV, RING_HD, generator=gen, dtype=torch.float64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def emulated_ring(
    q, k, v, docs, *, cp_size: int, meta_override: dict | None = None, kernel: str = "sdpa"
) -> torch.Tensor:
    """Every rank's ring output, scattered back to global positions: [B, S, RING_NH, RING_HD]. kernel: sdpa = the dense
    reference blocks (``ring_block_update``), tiled = the tiled op per step (``ring_kernel_step``)."""
    b, s = docs.shape
    scale = RING_HD**-0.5
    out = torch.zeros_like(q)
    for rank in range(cp_size):
        meta = ring_attention_inputs(docs, cp_size=cp_size, cp_rank=rank)
        if meta_override:
            meta = dataclasses.replace(meta, **meta_override)
        pos = shard_positions(s, cp_size=cp_size, cp_rank=rank, cp_type="ring")
        q_local = q[:, pos].transpose(1, 2)
        state = None
        for step in range(cp_size):
            src = (rank - step) % cp_size
            src_pos = shard_positions(s, cp_size=cp_size, cp_rank=src, cp_type="ring")
            if kernel != "sdpa":
                state = ring_kernel_step(
                    state,
                    q[:, pos],
                    k[:, src_pos],
                    v[:, src_pos],
                    q_doc=docs[:, pos],
                    meta=meta,
                    src=src,
                    cp_rank=rank,
                    cp_size=cp_size,
                    scale=scale,
                    kernel=kernel,
                )
                continue
            state = ring_block_update(
                state,
                q_local,
                k[:, src_pos].transpose(1, 2),
                v[:, src_pos].transpose(1, 2),
                q_doc=docs[:, pos],
                meta=meta,
                src=src,
                cp_rank=rank,
                cp_size=cp_size,
                scale=scale,
            )
        local = (state[0] if kernel != "sdpa" else torch.cat((state[0], state[2]), dim=2)).transpose(1, 2)
        out = out.index_put((torch.arange(b)[:, None], pos[None, :]), local)
    return out


def ring_reference(q, k, v, docs) -> torch.Tensor:
    attn = AttentionInputs(document_ids=docs, cu_seqlens=torch.zeros(1), max_seqlen=0)
    return packed_causal_attention(q, k, v, attn)


# AdamW variants against torch's AdamW (tests/unit/trainer): a few parameters of odd shapes in two groups, one with
# weight decay, trained on seeded gradients.
OPTIMIZER_TEST_SHAPES = [(30, 20), (20,), (7, 3, 5), (64, 8)]


def optimizer_test_params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in OPTIMIZER_TEST_SHAPES]


def optimizer_test_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def mlp_regression_losses(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], *, steps: int = 150
) -> list[float]:
    """The loss per step of a two-layer MLP (16 -> 64 -> 1, tanh) fitting a seeded noisy tanh regression (256 rows),
    the same model and data for every optimizer: the low-precision AdamW policies' loss curves against fp32's."""
    torch.manual_seed(0)
    inputs, weights = torch.randn(256, 16), torch.randn(16, 1)
    targets = torch.tanh(inputs @ weights) + 0.05 * torch.randn(256, 1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class RecordedOps:
    """``with RecordedOps() as ops:`` the names of the aten / custom ops dispatched inside (``ops.names``): what a
    fused optimizer runs in place of the eager elementwise ops."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        names: list[str] = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.names = names
        self._mode = _Mode()

    def __enter__(self) -> RecordedOps:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def train_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    """Seeded gradients per step; a parameter without a gradient on some steps (an optimizer must skip it)."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for index, param in enumerate(params):
            param.grad = None if (step + index) % 5 == 0 else torch.randn(param.shape, generator=generator)
        optimizer.step()


# The recipes the dry-run tests plan (tests/unit/simulate): the tiny Qwen3 MoE and each flagship at the world size
# it ships for.
REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO_ROOT / "nemo_ac"
WORKAROUNDS_DIR = PACKAGE_DIR / "workarounds"
TINY_PLAN_RECIPE = str(REPO_ROOT / "recipes/tiny/qwen3_moe_tiny.yaml")
FLAGSHIPS_AT_WORLD_SIZE = {
    "qwen3_6": (REPO_ROOT / "recipes/qwen3_6_35b_medpix_ep8cp2_4k.yaml", 8),
    "nemotron": (REPO_ROOT / "recipes/nemotron_super_v3_te_deepep.yaml", 64),
    "glm": (REPO_ROOT / "recipes/glm_4_5_air_cp4_ulysses.yaml", 8),
}


def hits_outside_workarounds(scan: Callable[[Path], list[tuple[int, str]]]) -> tuple[tuple[str, int, str], ...]:
    """``(module path, line, name)`` of every hit ``scan`` finds in nemo_ac's modules outside ``workarounds/``: the
    private-torch boundary tests (dotted names, members of torch objects) walk the package this one way."""
    return tuple(
        (str(path.relative_to(REPO_ROOT)), line, name)
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if WORKAROUNDS_DIR not in path.parents
        for line, name in scan(path)
    )
