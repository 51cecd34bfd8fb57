"""The transformers peers of ``benchmarks/_flagship_peers.py`` compute what nemo_ac's sub-blocks compute: output,
input gradient and every parameter gradient agree (fp32, tiny width) for each sub-block kind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nemo_ac.config.schema import LinearAttentionConfig, ModelConfig, MoEConfig
from nemo_ac.models import build_model
from nemo_ac.models.expert_bias import biased_routers
from nemo_ac.models.init import materialize_and_init

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.unit.test_models_glm4_moe import glm_config  # noqa: E402
from tests.unit.test_models_nemotron_h import nemotron_config  # noqa: E402

pytest.importorskip("transformers", reason="transformers is not importable; the peers need it")
pytest.importorskip("transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe")

TOL = 1e-5  # max |nemo - hf| relative to max |hf|
SEQ = {"qwen": 29, "glm": 21, "nemotron": 21}  # several chunks (8) plus a ragged tail; never a model dimension
# kind -> index of the layer it runs on in the tiny models below.
LAYER = {
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


def _peers_module() -> ModuleType:
    name = "benchmarks._flagship_peers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "_flagship_peers.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def qwen_config() -> ModelConfig:
    """A tiny Qwen3.5-MoE text decoder: Gated DeltaNet layer then gated attention layer, partial M-RoPE."""
    return ModelConfig(
        family="qwen3_5_moe",
        vocab_size=96,
        hidden_size=48,
        num_layers=2,
        layer_pattern="LA",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        partial_rotary_factor=0.5,
        mrope_section=[1, 1, 1],
        rms_norm_eps=1e-6,
        attn_output_gate=True,
        init_std=0.1,
        moe=MoEConfig(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            shared_expert_gate=True,
            norm_topk_prob=True,
            router_dtype="param",  # transformers' Qwen3.5 router runs in the parameter dtype
        ),
        linear_attention=LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4, chunk_size=8
        ),
    )


def _nemo_layers(family: str) -> tuple[ModelConfig, torch.nn.ModuleList]:
    cfg = {"qwen": qwen_config, "glm": glm_config, "nemotron": nemotron_config}[family]()
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kind", _peers_module().KINDS)
def test_peer_matches_nemo_sub_block(kind: str) -> None:
    peers = _peers_module()
    family = kind.split("_")[0]
    cfg, layers = _nemo_layers(family)
    layer, seq = layers[LAYER[kind]], SEQ[family]
    common = {"model_cfg": cfg, "nemo_layer": layer, "seq_len": seq, "dtype": torch.float32}
    ours = peers.nemo_sub_block(kind, device=torch.device("cpu"), **common)
    peer = peers.build_peer(kind, layer_idx=LAYER[kind], device=torch.device("cpu"), **common)
    print(f"{kind}: {peer.impl}")

    gen = torch.Generator().manual_seed(2)
    h = torch.randn(1, seq, cfg.hidden_size, generator=gen)
    probe = torch.randn(1, seq, cfg.hidden_size, generator=gen)  # a loss whose gradient is not all ones
    results = {}
    for name, fn, params in (
        ("nemo", ours, dict(layer.named_parameters())),
        ("hf", peer.run, dict(peer.module.named_parameters())),
    ):
        x = h.clone().requires_grad_(True)
        out = fn(x)
        (out * probe).sum().backward()
        results[name] = (out.detach(), x.grad, {k: p.grad for k, p in params.items()})
    (out_n, dx_n, g_n), (out_h, dx_h, g_h) = results["nemo"], results["hf"]

    errs = {"out": _rel(out_n, out_h), "dx": _rel(dx_n, dx_h)}
    assert set(g_h) == {k for k in g_n if k.split(".")[0] in peers._CHILDREN[kind]}
    for k, grad in g_h.items():
        assert grad is not None and g_n[k] is not None, k
        errs[k] = _rel(g_n[k], grad)
    assert all(g_n[k] is None for k in g_n.keys() - g_h.keys())  # the sub-block uses nothing else of the layer
    worst = max(errs, key=errs.__getitem__)
    print(f"{kind}: out {errs['out']:.1e}, dx {errs['dx']:.1e}, worst {worst} {errs[worst]:.1e}")
    assert max(errs.values()) <= TOL, {k: v for k, v in errs.items() if v > TOL}
    assert dx_h.abs().max() > 0 and out_h.abs().max() > 0
