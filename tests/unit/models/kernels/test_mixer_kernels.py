"""The mixer kernels' ops (``backend.linear_attention: fla``, ``backend.mamba: mamba_ssm``) on CPU: registration, fake
shapes, autograd, one compile node, the SAC decision, the plan's choice and validation.

Neither fla nor mamba-ssm runs here (no CUDA). The ops' CPU body is the torch reference (labeled in
``models.mixer_kernels``): these tests check the op PLUMBING (the custom op, its backward op through the
autograd re-run, compile, SAC) against the plain torch op; the kernels themselves are checked against the torch op in
``test_mixer_kernels_cuda.py`` on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from nemo_ac.cli import main
from nemo_ac.config import ConfigError, check_environment, load_recipe, validate_recipe
from nemo_ac.config import mixer_kernels as mk
from nemo_ac.config.schema import BackendConfig, ParallelConfig, SelectiveACConfig
from nemo_ac.distributed import activation_checkpointing as ac
from nemo_ac.distributed.activation_checkpointing import PolicyRules, SelectivePolicy
from nemo_ac.distributed.plan import Chosen, decide_plan
from nemo_ac.distributed.plan.kernels import resolve_mixer_kernel
from nemo_ac.models import build_model
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.kernels import fla_gdn
from nemo_ac.models.kernels import mamba_ssm as mamba_ssm_kernel
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from nemo_ac.models.layers.mamba2 import Mamba2Mixer
from nemo_ac.models.mixer_kernels import set_mixer_kernels
from nemo_ac.workarounds.compiled_regions_under_sac import ac_outer_compile_kwargs
from tests.factories import nemotron_config, qwen3_5_config
from tests.launch import RECIPES

QWEN_TINY = str(RECIPES / "tiny" / "qwen3_6_medpix_tiny.yaml")
NEMOTRON_TINY = str(RECIPES / "tiny" / "nemotron_super_v3_tiny.yaml")
SEQ = 19  # no model dimension equals it (Dynamo duck sizing)


def _attn(batch: int, seq: int) -> AttentionInputs:
    # Three documents in row 0 (one starts inside a conv window and a chunk), two in row 1, padding (-1) at the end.
    doc = torch.tensor([[0] * 5 + [1] * 9 + [2] * (seq - 14), [0] * 11 + [1] * (seq - 14) + [-1] * 3])[:batch]
    return AttentionInputs(document_ids=doc.to(torch.int32), cu_seqlens=torch.zeros(0, dtype=torch.int32), max_seqlen=0)


def _gdn() -> GatedDeltaNet:
    cfg = qwen3_5_config()
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg.hidden_size, cfg.linear_attention)
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 1.0)
    return mixer


def _mamba() -> Mamba2Mixer:
    cfg = nemotron_config()
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba)
    with torch.no_grad():
        for name in ("A_log", "D", "dt_bias"):
            getattr(mixer, name).copy_(mixer.initial_parameter(name, torch.Generator().manual_seed(1)))
    return mixer


MIXERS = {
    "fla": (_gdn, fla_gdn.fla_linear_attn_op, "linear_attn_op", torch.ops.nemo_ac.fla_gated_delta_rule.default),
    "mamba_ssm": (_mamba, mamba_ssm_kernel.mamba_ssm_op, "ssm_op", torch.ops.nemo_ac.mamba_chunk_scan.default),
}


def _run(mixer, x, attn, *, call=None):
    mixer.zero_grad()
    x = x.detach().requires_grad_()
    out = (call if call is not None else mixer)(x, attn=attn)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()}


@pytest.mark.parametrize("kernel", MIXERS)
def test_op_plumbing_matches_the_torch_op_forward_and_gradients(kernel):
    """CPU body = the torch reference: the custom op + its backward op (autograd re-run) give the torch op's output
    and every parameter's gradient."""
    build, op, attr, _ = MIXERS[kernel]
    mixer = build()
    x = torch.randn(2, SEQ, mixer.out_proj.out_features)
    attn = _attn(2, SEQ)
    want = _run(mixer, x, attn)
    setattr(mixer, attr, op)
    got = _run(mixer, x, attn)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_fake_impls_give_the_output_and_gradient_shapes():
    q = torch.empty(2, SEQ, 2, 8, device="meta")
    v = torch.empty(2, SEQ, 4, 6, device="meta")
    g = torch.empty(2, SEQ, 4, device="meta", dtype=torch.float32)
    w = (torch.empty(2, 8, 4, device="meta"), torch.empty(2, 8, 4, device="meta"), torch.empty(4, 6, 4, device="meta"))
    doc = torch.empty(2, SEQ, device="meta", dtype=torch.int32)
    out = torch.ops.nemo_ac.fla_gated_delta_rule(q, q, v.bfloat16(), g, g, *w, doc)
    assert out.shape == (2, SEQ, 4, 6) and out.dtype == torch.bfloat16
    grads = torch.ops.nemo_ac.fla_gated_delta_rule_backward(out, q, q, v, g, g, *w, doc)
    assert [t.shape for t in grads] == [t.shape for t in (q, q, v, g, g, *w)]

    x = torch.empty(2, SEQ, 4, 8, device="meta", dtype=torch.bfloat16)
    bc = torch.empty(2, SEQ, 2, 16, device="meta", dtype=torch.bfloat16)
    dt = torch.empty(2, SEQ, 4, device="meta", dtype=torch.bfloat16)
    conv = (torch.empty(4, 8, 4), torch.empty(4, 8), torch.empty(2, 16, 4), torch.empty(2, 16))
    conv = tuple(t.to("meta") for t in conv + conv[2:])
    heads = torch.empty(4, device="meta")
    y = torch.ops.nemo_ac.mamba_chunk_scan(x, bc, bc, dt, *conv, heads, heads, heads, doc, 8, 0.0, float("inf"))
    assert y.shape == x.shape and y.dtype == torch.float32
    tensors = [x, bc, bc, dt, *conv, heads, heads, heads]
    grads = torch.ops.nemo_ac.mamba_chunk_scan_backward(y, tensors, doc, 8, 0.0, float("inf"))
    assert [t.shape for t in grads] == [t.shape for t in tensors]


@pytest.mark.parametrize("kernel", MIXERS)
def test_compile_traces_the_op_as_one_node(kernel):
    build, op, attr, overload = MIXERS[kernel]
    mixer = build()
    setattr(mixer, attr, op)
    x = torch.randn(2, SEQ, mixer.out_proj.out_features)
    attn = _attn(2, SEQ)
    want = _run(mixer, x, attn)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mixer, backend=counter, fullgraph=True)
    got = _run(mixer, x, attn, call=compiled)
    assert counter.frame_count == 1
    calls = [
        n
        for n in counter.graphs[0].graph.nodes
        if n.op == "call_function" and n.target in (overload, overload.overloadpacket)
    ]
    assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", MIXERS)
def test_selective_ac_saves_the_op_so_the_recompute_never_reruns_the_kernel(kernel, monkeypatch):
    build, op, attr, overload = MIXERS[kernel]
    policy = SelectivePolicy(rules=PolicyRules.build(SelectiveACConfig()))
    assert policy.decide(overload)[0] == CheckpointPolicy.MUST_SAVE

    module, core = (fla_gdn, "_fla_core") if kernel == "fla" else (mamba_ssm_kernel, "_mamba_core")
    calls = []
    real = getattr(module, core)
    monkeypatch.setattr(module, core, lambda *a: calls.append(1) or real(*a))
    mixer = build()
    setattr(mixer, attr, op)
    x = torch.randn(2, SEQ, mixer.out_proj.out_features, requires_grad=True)
    attn = _attn(2, SEQ)

    def bodies(context_fn) -> int:
        calls.clear()
        out = checkpoint(lambda t: mixer(t, attn=attn), x, use_reentrant=False, context_fn=context_fn)
        out.sum().backward()
        return len(calls)

    # forward + the backward op's one re-run; recomputing the op instead would add a third.
    assert bodies(ac.make_selective_checkpoint_context_fn()) == 2
    assert bodies(ac.sac_region_context_fn(lambda: lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE, region="")) == 3


# --- the plan's choice -----------------------------------------------------------------------------------------


def _kernels(plan) -> dict[str, str]:
    return {what: choice for block in plan.decoder_blocks() for what, choice in block.kernels}


def test_plan_auto_takes_the_torch_op_on_cpu_and_the_kernel_where_cuda_and_the_package_are(monkeypatch):
    qwen, nemotron = qwen3_5_config(), nemotron_config()
    with torch.device("meta"):
        models = {"qwen": build_model(qwen), "nemotron": build_model(nemotron)}
    assert _kernels(decide_plan(models["qwen"]))["linear_attention"] == "torch"
    assert _kernels(decide_plan(models["nemotron"]))["ssm"] == "torch"
    monkeypatch.setattr(mk, "missing_modules", lambda kind: ("fla",) if kind == "linear_attention" else ())
    cuda_qwen = decide_plan(models["qwen"], device_type="cuda")
    assert _kernels(cuda_qwen)["linear_attention"] == "torch (auto: fla not installed)"
    assert (cuda_qwen.kernels.linear_attention.value, cuda_qwen.kernels.mamba.value) == ("torch", "mamba_ssm")
    assert cuda_qwen.kernels.linear_attention.reason == "auto: fla not installed"
    cuda_nemotron = decide_plan(models["nemotron"], device_type="cuda", cp=2, parallel=ParallelConfig(cp=2))
    assert _kernels(cuda_nemotron)["ssm"] == "mamba_ssm, ulysses cp2"
    explicit = decide_plan(models["qwen"], backend=BackendConfig(linear_attention="fla"))
    assert _kernels(explicit)["linear_attention"] == "fla"
    assert any("linear_attention fla" in line for line in explicit.summary_lines())


def test_auto_under_ring_cp_resolves_to_the_torch_op_and_says_why(monkeypatch):
    monkeypatch.setattr(mk, "missing_modules", lambda kind: ())
    for kind, kernel in (("linear_attention", "fla"), ("mamba", "mamba_ssm")):
        assert resolve_mixer_kernel(kind, "auto", device_type="cuda", cp=2, cp_type="ulysses") == Chosen(
            kernel, "auto: cuda"
        )
        assert resolve_mixer_kernel(kind, "auto", device_type="cuda", cp=2, cp_type="ring") == Chosen(
            "torch", "auto: ring CP passes the torch op's state", fallback=True
        )
        assert resolve_mixer_kernel(kind, "auto", device_type="cpu", cp=1, cp_type="ring") == Chosen(
            "torch", "auto: cpu"
        )


def test_set_mixer_kernels_installs_the_ops_before_cp_wraps_them():
    with torch.device("meta"):
        qwen, nemotron = build_model(qwen3_5_config()), build_model(nemotron_config())
    assert set_mixer_kernels(qwen, linear_attention="fla", mamba="mamba_ssm") == 1
    assert [m.linear_attn_op for m in qwen.modules() if isinstance(m, GatedDeltaNet)] == [fla_gdn.fla_linear_attn_op]
    mamba_layers = [m for m in nemotron.modules() if isinstance(m, Mamba2Mixer)]
    assert set_mixer_kernels(nemotron, linear_attention="fla", mamba="torch") == 0
    assert set_mixer_kernels(nemotron, mamba="mamba_ssm") == len(mamba_layers) > 0
    assert all(m.ssm_op is mamba_ssm_kernel.mamba_ssm_op for m in mamba_layers)


# --- validation before any process group -----------------------------------------------------------------------


def _issues(path: str, overrides: list[str], world_size: int) -> list:
    with pytest.raises(ConfigError) as info:
        validate_recipe(load_recipe(path, overrides), world_size=world_size)
    return info.value.issues


def _absent(monkeypatch) -> None:
    """fla and mamba-ssm as on the CPU test machines: not installed (stated, not assumed)."""
    monkeypatch.setattr(mk, "missing_modules", lambda kind: mk.MIXER_KERNELS[kind].modules)


def test_an_explicit_kernel_that_does_not_import_here_fails_with_the_key_and_the_install_line(monkeypatch):
    _absent(monkeypatch)
    (issue,) = _issues(QWEN_TINY, ["backend.linear_attention=fla"], 4)
    assert issue.key == "backend.linear_attention"
    assert "pip install 'nemo_ac[fla]'" in issue.message and "backend.linear_attention: torch" in issue.message
    (issue,) = _issues(NEMOTRON_TINY, ["backend.mamba=mamba_ssm"], 2)
    assert issue.key == "backend.mamba" and "pip install --no-build-isolation causal-conv1d mamba-ssm" in issue.message


def test_an_explicit_kernel_is_refused_on_cpu_and_under_ring_cp(monkeypatch):
    monkeypatch.setattr(mk, "missing_modules", lambda kind: ())
    (issue,) = _issues(QWEN_TINY, ["backend.linear_attention=fla", "dist.device=cpu"], 4)
    assert issue.key == "backend.linear_attention" and "CUDA only" in issue.message
    ring = _issues(NEMOTRON_TINY, ["backend.mamba=mamba_ssm", "parallel.cp=2", "parallel.cp_type=ring"], 2)
    (issue,) = [i for i in ring if i.key == "backend.mamba"]
    assert "ring" in issue.message and "parallel.cp_type: ulysses" in issue.message
    recipe = load_recipe(QWEN_TINY, ["backend.linear_attention=fla"])
    (issue,) = [i for i in check_environment(recipe, cuda_available=False) if i.key == "backend.linear_attention"]
    assert "no GPU is visible" in issue.message
    assert not [i for i in check_environment(recipe, cuda_available=None) if i.key == "backend.linear_attention"]


def test_cli_validate_exits_2_naming_the_key(capsys, monkeypatch):
    _absent(monkeypatch)
    assert main(["validate", QWEN_TINY, "--world-size", "4", "backend.linear_attention=fla"]) == 2
    err = capsys.readouterr().err
    assert "backend.linear_attention" in err and "pip install 'nemo_ac[fla]'" in err
    assert main(["validate", NEMOTRON_TINY, "--world-size", "2", "backend.mamba=mamba_ssm"]) == 2
    assert "backend.mamba" in capsys.readouterr().err
    assert main(["validate", QWEN_TINY, "--world-size", "4"]) == 0  # auto: the torch op here


def test_defaults_are_auto():
    backend = BackendConfig()
    assert (backend.linear_attention, backend.mamba) == ("auto", "auto")
    assert dataclasses.replace(backend, linear_attention="torch").linear_attention == "torch"


@pytest.mark.parametrize("between", [False, True], ids=["traced", "between_graphs"])
def test_under_ac_of_compiled_blocks_the_op_runs_between_graphs_so_selective_ac_saves_it(between, monkeypatch):
    """AC(compile(block)) (ac_outer): the SAC modes recompute inductor's compiled regions whole, so a kernel op
    traced into one reruns in the recompute (3 bodies); installed between compiled graphs it is saved (2: the
    forward and the backward op's re-run)."""
    calls = []
    real = fla_gdn._fla_core
    monkeypatch.setattr(fla_gdn, "_fla_core", lambda *a: calls.append(1) or real(*a))
    mixer = _gdn()
    assert set_mixer_kernels(mixer, linear_attention="fla", between_compiled_graphs=between) == 1
    torch._dynamo.reset()
    compiled = torch.compile(mixer, **ac_outer_compile_kwargs({"backend": "inductor"}))  # as apply_compile does
    x = torch.randn(2, SEQ, mixer.out_proj.out_features, requires_grad=True)
    attn = _attn(2, SEQ)
    want = _run(mixer, x, attn)
    calls.clear()
    context_fn = ac.make_selective_checkpoint_context_fn()
    out = checkpoint(lambda t: compiled(t, attn=attn), x, use_reentrant=False, context_fn=context_fn)
    out.square().sum().backward()
    assert len(calls) == (2 if between else 3)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-4, atol=1e-5)


def test_plan_says_when_a_kernel_runs_between_compiled_graphs():
    with torch.device("meta"):
        model = build_model(qwen3_5_config())
    from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig

    kwargs = {"backend": BackendConfig(linear_attention="fla"), "compile": CompileConfig(enabled=True)}
    ac_outer = decide_plan(model, **kwargs, activation_checkpointing=ActivationCheckpointingConfig(mode="selective"))
    assert [b.compile_layout for b in ac_outer.decoder_blocks()] == ["ac_outer", "ac_outer"]
    assert _kernels(ac_outer)["linear_attention"] == "fla (between compiled graphs)"
    no_ac = decide_plan(model, **kwargs, activation_checkpointing=ActivationCheckpointingConfig(mode="none"))
    assert _kernels(no_ac)["linear_attention"] == "fla"
