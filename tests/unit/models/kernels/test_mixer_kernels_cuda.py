"""The mixer kernels on a GPU against the torch ops: flash-linear-attention for Gated DeltaNet
(``backend.linear_attention: fla``) and causal-conv1d + mamba-ssm for Mamba-2 (``backend.mamba: mamba_ssm``).

Same weights and inputs, packed rows (several documents per row, one that starts inside a conv window, a row whose
length is no multiple of the kernels' chunk), forward and every gradient, fp32 and bf16, eagerly and compiled.
Skipped without CUDA or without the package, with the reason; ``benchmarks/gpu_check.sh`` runs this file.
fp32 tolerances allow for the kernels' TF32 dots.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from nemo_ac.config.schema import LinearAttentionConfig, MambaConfig
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from nemo_ac.models.layers.mamba2 import Mamba2Mixer
from nemo_ac.models.mixer_kernels import fla_linear_attn_op, mamba_ssm_op


def _missing(*modules: str) -> str:
    """Why the kernels cannot run here ('' when they can)."""
    if not torch.cuda.is_available():
        return "needs CUDA (the kernels are Triton / CUDA code); runs in benchmarks/gpu_check.sh"
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken build raising on import
            return f"{module} does not import here ({type(exc).__name__}: {exc})"
    return ""


FLA = _missing("fla.ops.gated_delta_rule", "fla.modules.causal_conv1d")
MAMBA = _missing("mamba_ssm.ops.triton.ssd_combined", "causal_conv1d")
SEQ = 300  # no multiple of 64
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2}  # relative error of the whole tensor (norm)


def _docs() -> AttentionInputs:
    row0 = [0] * 70 + [1] * 2 + [2] * 150 + [3] * (SEQ - 222)
    row1 = [0] * 131 + [1] * (SEQ - 131 - 9) + [-1] * 9  # padding at the end: a run of its own
    doc = torch.tensor([row0, row1], dtype=torch.int32, device="cuda")
    return AttentionInputs(document_ids=doc, cu_seqlens=torch.zeros(0, dtype=torch.int32), max_seqlen=0)


def _gdn() -> GatedDeltaNet:
    cfg = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=64, value_head_dim=64)
    torch.manual_seed(0)
    mixer = GatedDeltaNet(96, cfg)
    with torch.no_grad():
        mixer.A_log.copy_(mixer.initial_parameter("A_log", torch.Generator().manual_seed(1)))
    return mixer


def _mamba() -> Mamba2Mixer:
    cfg = MambaConfig(num_heads=8, head_dim=32, state_size=64, n_groups=2, conv_kernel=4, chunk_size=64)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(96, cfg)
    with torch.no_grad():
        for name in ("A_log", "D", "dt_bias"):
            getattr(mixer, name).copy_(mixer.initial_parameter(name, torch.Generator().manual_seed(1)))
    return mixer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _run(mixer, x, attn, call=None):
    mixer.zero_grad()
    x = x.detach().requires_grad_()
    out = (call if call is not None else mixer)(x, attn=attn)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _compare(build, attr: str, op, dtype: torch.dtype, *, compiled: bool) -> None:
    mixer = build().to("cuda", dtype)
    x = torch.randn(2, SEQ, 96, device="cuda", dtype=dtype)
    attn = _docs()
    want = _run(mixer, x, attn)
    setattr(mixer, attr, op)
    call = torch.compile(mixer, fullgraph=True) if compiled else None
    got = _run(mixer, x, attn, call)
    limit = TOLERANCE[dtype]
    errors = {"out": _rel(got[0], want[0]), "dx": _rel(got[1], want[1])}
    assert got[2].keys() == want[2].keys()
    errors.update({name: _rel(got[2][name], want[2][name]) for name in want[2]})
    bad = {name: f"{error:.2e}" for name, error in errors.items() if not error < limit}
    assert not bad, f"relative error above {limit} ({dtype}, compiled={compiled}): {bad}"


@pytest.mark.skipif(bool(FLA), reason=FLA or "runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fla_gated_deltanet_matches_the_torch_op(dtype, compiled):
    _compare(_gdn, "linear_attn_op", fla_linear_attn_op, dtype, compiled=compiled)


@pytest.mark.skipif(bool(MAMBA), reason=MAMBA or "runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mamba_ssm_matches_the_torch_op(dtype, compiled):
    _compare(_mamba, "ssm_op", mamba_ssm_op, dtype, compiled=compiled)


@pytest.mark.skipif(bool(FLA), reason=FLA or "runs")
def test_fla_documents_are_isolated():
    """A packed row equals its documents run one by one (the kernel takes cu_seqlens, never a mask)."""
    mixer = _gdn().to("cuda")
    mixer.linear_attn_op = fla_linear_attn_op
    x = torch.randn(1, SEQ, 96, device="cuda")
    attn = _docs()
    row = AttentionInputs(document_ids=attn.document_ids[:1], cu_seqlens=attn.cu_seqlens, max_seqlen=0)
    with torch.no_grad():
        packed = mixer(x, attn=row)
        for start, end in ((0, 70), (70, 72), (72, 222), (222, SEQ)):
            alone_ids = torch.zeros(1, end - start, dtype=torch.int32, device="cuda")
            alone = mixer(x[:, start:end], attn=AttentionInputs(alone_ids, attn.cu_seqlens, 0))
            assert _rel(packed[:, start:end], alone) < 1e-3, (start, end)
