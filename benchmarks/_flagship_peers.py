"""transformers 5.x peers of nemo_ac decoder sub-blocks, for side-by-side flagship benchmarks (not a benchmark itself).

``build_peer(kind, ...)`` builds the transformers module that computes what ``nemo_sub_block(kind, ...)`` computes,
copies the nemo_ac weights into it (``load_state_dict``, strict, keys unchanged: nemo_ac's names are transformers'
and in 5.18 all three families store routed experts as the same 3D ``gate_up_proj`` / ``up_proj`` / ``down_proj``
tensors, so no per-expert split is needed) and returns a ``Peer`` whose ``run(h)`` maps ``h [1, S, hidden]`` to the
sub-block output. Both sides see ONE causal document per row (positions 0..S-1).

How the HF side is built and called, as a transformers user's model would:

- the top-level model class of the family (``architectures[0]`` of ``hf_config_dict(model_cfg)``:
  ``Qwen3_5MoeForConditionalGeneration``, ``Glm4MoeForCausalLM``, ``NemotronHForCausalLM``) is built with
  ``_from_config(config, attn_implementation="sdpa", dtype=dtype)`` (what ``AutoModel*.from_config`` calls) on the
  meta device, so ``config._attn_implementation`` / ``config._experts_implementation`` are whatever the model class
  resolves (5.18: ``sdpa`` / ``grouped_mm``); only the sub-block's children of layer ``layer_idx`` are then
  materialized on ``device`` (``to_empty``) in ``dtype``, except what ``from_pretrained`` keeps in fp32
  (``_keep_in_fp32_modules_strict``: the ``e_score_correction_bias`` buffers, fp32 in nemo_ac too);
- rope comes from the family's HF rotary embedding and masks from ``create_causal_mask`` /
  ``create_recurrent_attention_mask`` with ``attention_mask=None`` (for sdpa: no mask tensor, ``is_causal``), both
  computed once per peer, outside ``run``;
- Gated DeltaNet / Mamba-2 / causal-conv1d run whatever transformers resolved at import time (``impl`` names it):
  the reference torch functions when fla / mamba_ssm / causal_conv1d are not installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers.integrations.moe import _can_use_grouped_mm
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask

from nemo_ac.config.hf import hf_config_dict
from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.init import canonical_name
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.mrope import MRotaryEmbedding
from nemo_ac.models.layers.rope import RotaryEmbedding

KINDS = (
    "qwen_linear_mixer",
    "qwen_attention_mixer",
    "qwen_moe_ffn",
    "glm_attention_mixer",
    "glm_dense_ffn",
    "glm_moe_ffn",
    "nemotron_mamba",
    "nemotron_attention",
    "nemotron_moe",
)
_FAMILY = {"qwen": "qwen3_5_moe", "glm": "glm4_moe", "nemotron": "nemotron_h"}
# kind -> the layer children it uses (same names on both sides) and what the nemo_ac layer must be.
_CHILDREN = {
    "qwen_linear_mixer": ("input_layernorm", "linear_attn"),
    "qwen_attention_mixer": ("input_layernorm", "self_attn"),
    "qwen_moe_ffn": ("post_attention_layernorm", "mlp"),
    "glm_attention_mixer": ("input_layernorm", "self_attn"),
    "glm_dense_ffn": ("post_attention_layernorm", "mlp"),
    "glm_moe_ffn": ("post_attention_layernorm", "mlp"),
    "nemotron_mamba": ("norm", "mixer"),
    "nemotron_attention": ("norm", "mixer"),
    "nemotron_moe": ("norm", "mixer"),
}
_NEMOTRON_BLOCK = {"nemotron_mamba": "mamba", "nemotron_attention": "attention", "nemotron_moe": "moe"}


def sub_block_children(kind: str) -> tuple[str, ...]:
    """The decoder layer's children that sub-block ``kind`` uses (same names on both sides)."""
    return _CHILDREN[kind]


@dataclass
class Peer:
    """A transformers sub-block holding a copy of the nemo_ac weights.

    module: the HF module(s) whose parameters the sub-block uses, under the nemo_ac layer's parameter names (an
        ``nn.ModuleDict`` of the HF layer's children, or the whole ``NemotronHBlock``).
    run: ``h [1, S, hidden] -> out [1, S, hidden]``, the same math as ``nemo_sub_block``.
    impl: what transformers runs, e.g. ``"transformers 5.18.0 Glm4MoeMoE, experts_implementation=grouped_mm, ..."``.
    """

    module: nn.Module
    run: Callable[[torch.Tensor], torch.Tensor]
    impl: str


def _check_kind(kind: str, model_cfg: ModelConfig, nemo_layer: nn.Module) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown sub-block kind {kind!r} (known: {', '.join(KINDS)})")
    family = _FAMILY[kind.split("_")[0]]
    if model_cfg.family != family:
        raise ValueError(f"kind {kind!r} needs model.family={family!r}, got {model_cfg.family!r}")
    ok = {
        "qwen_linear_mixer": getattr(nemo_layer, "layer_type", None) == "linear_attention",
        "qwen_attention_mixer": getattr(nemo_layer, "layer_type", None) == "full_attention",
        "qwen_moe_ffn": getattr(nemo_layer, "is_moe", False),
        "glm_attention_mixer": True,
        "glm_dense_ffn": not getattr(nemo_layer, "is_moe", True),
        "glm_moe_ffn": getattr(nemo_layer, "is_moe", False),
    }.get(kind, getattr(nemo_layer, "block_type", None) == _NEMOTRON_BLOCK.get(kind))
    if not ok:
        raise ValueError(f"kind {kind!r} does not fit this layer ({type(nemo_layer).__name__})")


def nemo_sub_block(
    kind: str,
    *,
    model_cfg: ModelConfig,
    nemo_layer: nn.Module,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The nemo_ac sub-block ``kind`` of ``nemo_layer`` as ``h [1, seq_len, hidden] -> out``, rope and attention
    metadata (one document, positions 0..seq_len-1) precomputed once:

    - mixers: ``h + layer.<mixer>(layer.input_layernorm(h), [rope=rope,] attn=attn)`` (Qwen3.5 Gated DeltaNet or
      gated attention with M-RoPE from ``MRotaryEmbedding`` on a [3, 1, S] text-position stack; GLM attention with
      partial ``RotaryEmbedding``);
    - FFNs: ``h + layer.mlp(layer.post_attention_layernorm(h))`` (MoE: the output of its ``(out, RouterStats)``);
    - Nemotron-H: the whole block, ``layer(h, rope=None, attn=attn)[0]``.
    """
    _check_kind(kind, model_cfg, nemo_layer)
    layer = nemo_layer
    attn = build_attention_inputs(torch.zeros(1, seq_len, dtype=torch.long, device=device))
    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    if kind.startswith("nemotron"):
        return lambda h: layer(h, rope=None, attn=attn)[0]
    if kind == "qwen_linear_mixer":
        return lambda h: h + layer.linear_attn(layer.input_layernorm(h), attn=attn)
    if kind.endswith("attention_mixer"):
        if kind.startswith("qwen"):
            rotary = MRotaryEmbedding(
                model_cfg.head_dim, model_cfg.rope_theta, model_cfg.partial_rotary_factor, model_cfg.mrope_section
            )
            rope = rotary(pos.unsqueeze(0).expand(3, -1, -1), dtype=dtype)  # the model's text-only [3, B, S] stack
        else:
            rotary = RotaryEmbedding(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.partial_rotary_factor)
            rope = rotary(pos, dtype=dtype)
        return lambda h: h + layer.self_attn(layer.input_layernorm(h), rope=rope, attn=attn)
    if kind == "glm_dense_ffn":
        return lambda h: h + layer.mlp(layer.post_attention_layernorm(h))
    return lambda h: h + layer.mlp(layer.post_attention_layernorm(h))[0]


def hf_model_on_meta(model_cfg: ModelConfig, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """The family's top-level transformers model for ``model_cfg`` on the meta device, built the way
    ``from_config`` builds it (sdpa requested, experts implementation left to transformers' default)."""
    d = hf_config_dict(model_cfg)
    if model_cfg.family == "qwen3_5_moe" and not model_cfg.mrope_section:
        # HF's rotary needs a 3-way split; with text-only positions (all three axes equal) any split is the same.
        rotary_half = int(model_cfg.head_dim * model_cfg.partial_rotary_factor) // 2
        d["text_config"]["rope_parameters"]["mrope_section"] = [rotary_half, 0, 0]
    config = transformers.AutoConfig.for_model(**d)
    model_cls = getattr(transformers, d["architectures"][0])
    with torch.device("meta"):
        return model_cls._from_config(config, attn_implementation="sdpa", dtype=dtype)


def _keep_fp32(module: nn.Module, model_cls: type[transformers.PreTrainedModel], dtype: torch.dtype) -> None:
    """Upcast what ``from_pretrained`` keeps in fp32 under a half dtype (``_keep_in_fp32_modules_strict``: the router
    correction biases), as a user loading a checkpoint gets it and as nemo_ac keeps it."""
    keep = set(model_cls._keep_in_fp32_modules_strict or [])
    if dtype not in (torch.float16, torch.bfloat16) or not keep:
        return
    for owner in module.modules():
        for slots in (owner._parameters, owner._buffers):
            for name, t in slots.items():
                if t is not None and name in keep:
                    slots[name] = nn.Parameter(t.float(), t.requires_grad) if isinstance(t, nn.Parameter) else t.float()


def _resolved(fn: Callable[..., object]) -> str:
    """Which function a transformers ``use_kernel_func_from_hub_with_fallback`` wrapper dispatches to."""
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
    name = f"{impl.__module__}.{impl.__qualname__}"
    return f"{impl.__qualname__} (torch fallback)" if name.startswith("transformers.") else name


def _experts_impl(config: transformers.PretrainedConfig, experts: nn.Module, device: torch.device) -> str:
    impl = str(config._experts_implementation)
    if impl == "grouped_mm":
        w = getattr(experts, "gate_up_proj", None)
        w = w if w is not None else experts.up_proj
        x = torch.zeros(1, w.shape[-1], dtype=w.dtype, device=device)
        offs = torch.ones(w.shape[0], dtype=torch.int32, device=device)
        fast = _can_use_grouped_mm(x, w.transpose(-2, -1), offs)
        impl += " (torch grouped_mm in eager)" if fast else " (transformers' per-expert mm fallback)"
    return f"experts_implementation={impl}"


def build_peer(
    kind: str,
    *,
    model_cfg: ModelConfig,
    nemo_layer: nn.Module,
    layer_idx: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Peer:
    """The transformers peer of ``nemo_sub_block(kind, ...)`` for decoder layer ``layer_idx``, holding a copy of
    ``nemo_layer``'s weights (same names; ``nemo_layer`` may be wrapped by activation checkpointing / compile).

    qwen_*: children of ``Qwen3_5MoeDecoderLayer`` (``Qwen3_5MoeGatedDeltaNet``, ``Qwen3_5MoeAttention``,
    ``Qwen3_5MoeSparseMoeBlock``) with ``Qwen3_5MoeTextRotaryEmbedding``; glm_*: children of
    ``Glm4MoeDecoderLayer`` (``Glm4MoeAttention``, ``Glm4MoeMLP``, ``Glm4MoeMoE``) with ``Glm4MoeRotaryEmbedding``;
    nemotron_*: the whole ``NemotronHBlock`` (Mamba-2 / attention / MoE mixer) called as ``NemotronHModel`` does.
    """
    _check_kind(kind, model_cfg, nemo_layer)
    family = kind.split("_")[0]
    hf_model = hf_model_on_meta(model_cfg, dtype)
    inner = hf_model.model.language_model if family == "qwen" else hf_model.model
    config = inner.config
    hf_layer = inner.layers[layer_idx]
    children = _CHILDREN[kind]
    module = hf_layer if family == "nemotron" else nn.ModuleDict({name: getattr(hf_layer, name) for name in children})
    module.to_empty(device=device)
    _keep_fp32(module, type(hf_model), dtype)
    state = {canonical_name(k): v for k, v in nemo_layer.state_dict().items()}
    module.load_state_dict({k: v for k, v in state.items() if k.split(".")[0] in children}, strict=True)
    module.train(nemo_layer.training)

    embeds = torch.empty(1, seq_len, model_cfg.hidden_size, dtype=dtype, device=device)  # shape / dtype only
    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask_kwargs = {"config": config, "inputs_embeds": embeds, "attention_mask": None, "past_key_values": None}
    causal = create_causal_mask(**mask_kwargs, position_ids=pos)
    recurrent = create_recurrent_attention_mask(**mask_kwargs, position_ids=pos)
    notes = [f"attn_implementation={config._attn_implementation}"] if "attention" in kind else []
    mixer = getattr(hf_layer, children[1])
    run: Callable[[torch.Tensor], torch.Tensor]

    if family == "nemotron":
        mask = {"full_attention": causal, "linear_attention": recurrent}.get(hf_layer.block_type)

        def run(h: torch.Tensor) -> torch.Tensor:
            return hf_layer(h, attention_mask=mask, position_ids=pos)

        if kind == "nemotron_mamba":
            hf_mod = inspect.getmodule(type(mixer))
            notes.append(f"mamba: {_resolved(hf_mod.causal_conv1d_fn)}, {_resolved(hf_mod.mamba2_chunk_scan)}")
    elif kind == "qwen_linear_mixer":

        def run(h: torch.Tensor) -> torch.Tensor:
            x = hf_layer.input_layernorm(h)
            return h + mixer(hidden_states=x, cache_params=None, attention_mask=recurrent)

        hf_mod = inspect.getmodule(type(mixer))
        notes.append(
            f"gated deltanet: {_resolved(hf_mod.causal_conv1d_fn)}, {_resolved(hf_mod.torch_chunk_gated_delta_rule)}"
        )
    elif kind.endswith("attention_mixer"):
        # Text-only positions as the HF text model builds them: [3, B, S] for M-RoPE (Qwen), [B, S] for GLM.
        rope_pos = pos.unsqueeze(0).expand(3, -1, -1) if family == "qwen" else pos
        with torch.device(device):
            rotary = type(inner.rotary_emb)(config)
        rope = rotary(embeds, rope_pos)

        def run(h: torch.Tensor) -> torch.Tensor:
            x = hf_layer.input_layernorm(h)
            out, _ = mixer(hidden_states=x, attention_mask=causal, position_ids=pos, position_embeddings=rope)
            return h + out

    else:

        def run(h: torch.Tensor) -> torch.Tensor:
            out = mixer(hf_layer.post_attention_layernorm(h))
            return h + (out[0] if isinstance(out, tuple) else out)

    moe = getattr(mixer, "experts", None)
    if moe is not None:
        notes.append(_experts_impl(config, moe, device))
        router = "param dtype" if family == "qwen" else "fp32"
        ours = "fp32" if model_cfg.moe.router_dtype == "float32" else "param dtype"
        notes.append(f"router in {router}" + ("" if router == ours else f" (nemo_ac: {ours})"))
    impl = f"transformers {transformers.__version__} {type(mixer).__name__}"
    if family == "nemotron":
        impl += " in NemotronHBlock"
    return Peer(module=module, run=run, impl=", ".join([impl, *notes]))
