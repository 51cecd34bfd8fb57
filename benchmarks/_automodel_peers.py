"""NeMo Automodel peers of nemo_ac decoder sub-blocks, beside ``_flagship_peers.py``'s transformers ones.

``build_automodel_peer(kind, ...)`` builds NeMo Automodel's own layer for ``nemo_sub_block(kind, ...)`` (0.7.0:
``nemo_automodel.components.models.{qwen3_5_moe,glm4_moe,nemotron_v3}``), copies the nemo_ac weights into it and
returns a ``_flagship_peers.Peer`` whose ``run(h)`` maps ``h [1, S, hidden]`` to the sub-block output, or ``None``
with the reason in ``UNSUPPORTED[kind]`` when Automodel's layer does not run here.

As an Automodel user's model is built (the native backends, not the HF fallback):

- the family's top-level class (``Qwen3_5MoeForCausalLM``: the text-only twin of
  ``Qwen3_5MoeForConditionalGeneration``, same ``Qwen3_5MoeTextModelBackend``; ``Glm4MoeForCausalLM``;
  ``NemotronHForCausalLM``) via ``from_config`` on the meta device, from the HF config of
  ``hf_config_dict(model_cfg)`` with ``dtype`` as its ``torch_dtype``; then layer ``layer_idx``'s children are
  materialized on ``device`` and cast with ``cast_model_to_dtype`` as ``initialize_weights`` does (the
  ``_fp32_params`` SSM holders and ``e_score_correction_bias`` stay fp32);
- ``BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False, dispatcher="torch",
  experts="torch_mm" on CUDA else "torch")``: what its defaults resolve to without TransformerEngine / DeepEP (on
  CPU the experts run Automodel's per-expert loop); the model classes then add their own overrides (GLM and
  Nemotron MoE: ``gate_precision=float32``);
- rope as the model forward computes it (GLM: Automodel's YaRN-capable ``RotaryEmbedding`` through
  ``position_ids_to_freqs_cis``; Qwen3.5: HF's M-RoPE rotary on a [3, 1, S] text-position stack), no mask
  (causal SDPA, one document), computed once per peer outside ``run``.

Weights: nemo_ac's (transformers') names map one to one except routed experts, which Automodel stores transposed
(``gate_and_up_projs [E, H, 2I]`` = ``gate_up_proj [E, 2I, H]``ᵀ, gate half first; ``down_projs [E, I, H]``),
Qwen's ``shared_expert`` (Automodel: ``shared_experts``) and the SSM ``A_log`` / ``dt_bias`` / ``D`` (Automodel:
under ``_fp32_params``). ``to_automodel_state`` does the mapping. Qwen3.5's aux loss (``router_aux_loss_coef``,
taken from ``model_cfg.moe.aux_loss_coef``) is inside Automodel's backward (``MoEAuxLossAutoScaler``), while
nemo_ac adds its own in the loss: the gradients match only with it at 0.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from unittest import mock

import _flagship_peers as peers
import torch
import transformers
from torch import nn

from nemo_ac.config.hf import hf_config_dict
from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.init import canonical_name

# kind -> why Automodel's layer gives no peer here (filled by build_automodel_peer, from the error it raised).
UNSUPPORTED: dict[str, str] = {}
_MODELS = {
    "qwen": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "glm": ("glm4_moe", "Glm4MoeForCausalLM"),
    "nemotron": ("nemotron_v3", "NemotronHForCausalLM"),
}
_EXPERTS = {"gate_up_proj": "gate_and_up_projs", "up_proj": "gate_and_up_projs", "down_proj": "down_projs"}
_SSM = ("A_log", "dt_bias", "D")


def automodel_available() -> bool:
    """Whether NeMo Automodel's model components import here."""
    try:
        importlib.import_module("nemo_automodel.components.models.common")
    except Exception:  # ImportError, or a broken optional dependency raising at import
        return False
    return True


def automodel_name(name: str) -> str:
    """Automodel's parameter name for nemo_ac's (canonical, transformers-style) ``name`` in a decoder layer."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1] == "experts" and parts[2] in _EXPERTS:
        return f"{parts[0]}.experts.{_EXPERTS[parts[2]]}"
    if len(parts) == 2 and parts[0] in ("linear_attn", "mixer") and parts[1] in _SSM:
        return f"{parts[0]}._fp32_params.{parts[1]}"
    if parts[:2] == ["mlp", "shared_expert"]:
        return ".".join(["mlp", "shared_experts", *parts[2:]])
    return name


def to_automodel_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A nemo_ac layer state (or gradient) dict under Automodel's names and layouts."""
    out = {}
    for name, t in state.items():
        am = automodel_name(name)
        out[am] = t.transpose(1, 2) if am.endswith(("gate_and_up_projs", "down_projs")) else t
    return out


def _hf_config(model_cfg: ModelConfig, dtype: torch.dtype) -> transformers.PretrainedConfig:
    d = hf_config_dict(model_cfg)
    text = d.get("text_config", d)
    if model_cfg.family == "qwen3_5_moe":
        text["router_aux_loss_coef"] = model_cfg.moe.aux_loss_coef
        if not model_cfg.mrope_section:  # as _flagship_peers: with text-only positions any split is the same
            rotary_half = int(model_cfg.head_dim * model_cfg.partial_rotary_factor) // 2
            text["rope_parameters"]["mrope_section"] = [rotary_half, 0, 0]
    config = transformers.AutoConfig.for_model(**d)
    config = getattr(config, "text_config", config)
    config.dtype = dtype  # what Automodel reads as config.torch_dtype for every parameter it allocates
    return config


def _backend(device: torch.device):  # -> BackendConfig
    from nemo_automodel.components.models.common import BackendConfig

    experts = "torch_mm" if torch.device(device).type == "cuda" else "torch"
    return BackendConfig(
        attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False, experts=experts, dispatcher="torch"
    )


@contextlib.contextmanager
def _cuda_device_probe() -> Iterator[None]:
    """``Glm4MoeModel.__init__`` builds its RotaryEmbedding with ``device=cuda:{torch.cuda.current_device()}``,
    an AssertionError on a CPU-only torch; the rotary only keeps that device (it is reset below, as Automodel's
    ``initialize_weights`` does), so on such a torch the probe answers 0 while the model is built."""
    if torch.cuda.is_available():
        yield
    else:
        with mock.patch.object(torch.cuda, "current_device", return_value=0):
            yield


def _am_model_on_meta(family: str, config: transformers.PretrainedConfig, backend: object) -> nn.Module:
    name, cls_name = _MODELS[family]
    cls = getattr(importlib.import_module(f"nemo_automodel.components.models.{name}.model"), cls_name)
    with torch.device("meta"), _cuda_device_probe():
        return cls.from_config(config, backend=backend)


def _unsupported(kind: str, err: BaseException, where: str) -> None:
    UNSUPPORTED[kind] = f"{where}: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def build_automodel_peer(
    kind: str,
    *,
    model_cfg: ModelConfig,
    nemo_layer: nn.Module,
    layer_idx: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> peers.Peer | None:
    """The NeMo Automodel peer of ``nemo_sub_block(kind, ...)`` for decoder layer ``layer_idx``, holding a copy of
    ``nemo_layer``'s weights, or ``None`` (reason in ``UNSUPPORTED[kind]``) where Automodel's layer fails here.

    ``module`` is an ``nn.ModuleDict`` of the Automodel block's children (the whole ``NemotronV3Block`` for
    nemotron_*) under Automodel's names (``to_automodel_state`` maps nemo_ac's). ``run`` calls them as the block's
    forward does: qwen_* ``Qwen3_5MoeBlock`` (``CPAwareGatedDeltaNet``, ``_Qwen3_5MoeAttention``, ``MoE``),
    glm_* ``Block`` (``Glm4MoeAttention``, ``MLP``, ``MoE``), nemotron_* ``NemotronV3Block``.
    """
    peers._check_kind(kind, model_cfg, nemo_layer)
    from nemo_automodel.components.models.common.utils import cast_model_to_dtype
    from nemo_automodel.package_info import __version__

    UNSUPPORTED.pop(kind, None)
    family = kind.split("_")[0]
    config = _hf_config(model_cfg, dtype)
    model = _am_model_on_meta(family, config, _backend(device))
    block = model.model.layers[str(layer_idx)]
    children = peers.sub_block_children(kind)
    module = block if family == "nemotron" else nn.ModuleDict({name: getattr(block, name) for name in children})
    module.to_empty(device=device)
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        setattr(module, attr, getattr(model, attr, None))
    cast_model_to_dtype(module, dtype, skip_modules=("_fp32_params",))
    state = {canonical_name(k): v for k, v in nemo_layer.state_dict().items()}
    module.load_state_dict(to_automodel_state({k: v for k, v in state.items() if k.split(".")[0] in children}))
    module.train(nemo_layer.training)

    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mixer = getattr(block, children[1])
    run: Callable[[torch.Tensor], torch.Tensor]
    if family == "nemotron":

        def run(h: torch.Tensor) -> torch.Tensor:
            return block(h, attention_mask=None)

    elif kind == "qwen_linear_mixer":

        def run(h: torch.Tensor) -> torch.Tensor:
            x = block.input_layernorm(h)
            return h + mixer(hidden_states=x, attention_mask=None, position_ids=pos.expand(3, 1, -1))

    elif kind.endswith("attention_mixer"):
        if family == "qwen":  # Qwen3_5MoeTextModelBackend.forward: HF M-RoPE cos / sin -> [cos | sin] halves
            with torch.device(device):
                rotary = type(model.model.rotary_emb)(config)
            embeds = torch.empty(1, seq_len, config.hidden_size, dtype=dtype, device=device)
            cos, sin = rotary(embeds, pos.expand(3, 1, -1))
            half = cos.shape[-1] // 2
            freqs_cis = torch.cat((cos[..., :half], sin[..., :half]), dim=-1)
        else:  # Glm4MoeModel.forward
            from nemo_automodel.components.models.gpt_oss.rope_utils import position_ids_to_freqs_cis

            model.model.rotary_emb.device = device
            freqs_cis = position_ids_to_freqs_cis(
                model.model.rotary_emb, pos, qkv_format="bshd", for_fused_rope=model.backend.rope_fusion
            )

        def run(h: torch.Tensor) -> torch.Tensor:
            return h + mixer(x=block.input_layernorm(h), freqs_cis=freqs_cis, attention_mask=None)

    else:

        def run(h: torch.Tensor) -> torch.Tensor:
            return h + block._mlp(x=block.post_attention_layernorm(h), padding_mask=None)

    try:  # the first call: where a missing kernel (mamba_ssm, CUDA) shows
        with torch.no_grad():
            run(torch.zeros(1, seq_len, model_cfg.hidden_size, dtype=dtype, device=device))
    except (ImportError, AssertionError, NotImplementedError) as err:
        _unsupported(kind, err, f"{type(mixer).__name__}.forward")
        return None

    b = model.backend
    norm = type(getattr(block, children[0])).__name__  # Qwen3.5 always uses Qwen3NextRMSNorm (1 + weight)
    notes = [f"linear={b.linear}, rms_norm={b.rms_norm} ({norm})"]
    if "attention" in kind:
        notes.append(f"attn={b.attn}" + ("" if family == "nemotron" else f", rope_fusion={b.rope_fusion}"))
    moe = getattr(mixer, "experts", None)
    if moe is not None:
        gate = mixer.gate
        notes.append(f"experts={b.experts} ({type(moe).__name__}), dispatcher={b.dispatcher}")
        notes.append(f"router in {gate.gate_precision or 'activation dtype'}, scores in {gate.score_dtype}")
        if gate.aux_loss_coeff > 0:
            notes.append(f"aux loss {gate.aux_loss_coeff:g} in backward")
    if kind == "qwen_linear_mixer":
        conv, rule = (peers._resolved(f) for f in (mixer.causal_conv1d_fn, mixer.chunk_gated_delta_rule))
        notes.append(f"gated deltanet: {conv}, {rule}")
    impl = f"nemo_automodel {__version__} {type(mixer).__name__} in {type(block).__name__}"
    return peers.Peer(module=module, run=run, impl=", ".join([impl, *notes]))
