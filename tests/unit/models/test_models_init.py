"""Deterministic meta-device materialization and the model registry."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_ac.config.schema import ModelConfig, MoEConfig
from nemo_ac.models import build_model, model_dtype
from nemo_ac.models.init import canonical_name, materialize_and_init

CFG = ModelConfig(
    moe=MoEConfig(num_experts=4, moe_intermediate_size=16, score_correction_bias=True, score_func="sigmoid"),
    first_k_dense_replace=1,
)


def _init(seed: int, cfg: ModelConfig = CFG) -> dict[str, torch.Tensor]:
    return materialize_and_init(build_model(cfg), device="cpu", seed=seed).state_dict()


def test_build_on_meta_and_same_seed_same_weights() -> None:
    model = build_model(CFG)
    assert all(p.is_meta for p in model.parameters())
    a, b, c = _init(11), _init(11), _init(12)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["model.layers.1.mlp.experts.gate_up_proj"], c["model.layers.1.mlp.experts.gate_up_proj"])
    # Different tensors of the same shape get different draws.
    assert not torch.equal(a["model.layers.0.self_attn.k_proj.weight"], a["model.layers.0.self_attn.v_proj.weight"])


def test_init_rules() -> None:
    sd = _init(0)
    assert torch.all(sd["model.norm.weight"] == 1) and torch.all(sd["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert torch.all(sd["model.layers.1.mlp.gate.e_score_correction_bias"] == 0)
    w = sd["model.layers.1.mlp.experts.down_proj"]
    assert abs(w.std().item() - CFG.init_std) < 0.2 * CFG.init_std
    model = materialize_and_init(build_model(CFG), device="cpu", seed=0)
    assert (
        model.model.rotary_emb.inv_freq.device.type == "cpu" and torch.isfinite(model.model.rotary_emb.inv_freq).all()
    )


def test_wrapped_names_init_identically() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert (
        canonical_name("model.layers.0._checkpoint_wrapped_module.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
    )
    model = build_model(CFG)
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    wrapped = materialize_and_init(model, device="cpu", seed=5).state_dict()
    plain = _init(5)
    assert {canonical_name(k) for k in wrapped} == set(plain)
    for name, value in wrapped.items():
        assert torch.equal(value, plain[canonical_name(name)]), name


def test_tied_embeddings_stay_tied() -> None:
    cfg = ModelConfig(tie_word_embeddings=True, moe=MoEConfig(num_experts=4, moe_intermediate_size=16))
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_family_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_ac.models import MODEL_BUILDERS

    # Whichever families exist, one without a registered builder fails with the list of implemented ones.
    monkeypatch.delitem(MODEL_BUILDERS, "glm4_moe", raising=False)
    with pytest.raises(NotImplementedError, match=r"glm4_moe.*not implemented yet"):
        build_model(ModelConfig(family="glm4_moe"))
    with pytest.raises(NotImplementedError, match="latent_size"):
        build_model(ModelConfig(moe=MoEConfig(latent_size=8)))
    assert model_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        model_dtype("fp8")


def test_fsdp_sharded_init_matches_plain() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build_model(CFG)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        materialize_and_init(model, device="cpu", seed=9)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        plain = _init(9)
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), plain[name]), name
    finally:
        dist.destroy_process_group()


def test_parameters_and_buffers_placed_apart_for_fsdp_cpu_offload() -> None:
    """``to_empty_placed``: parameters where FSDP2's CPUOffloadPolicy wants them (the host), buffers (RoPE tables,
    router correction biases) on the device the kernels read them from. Here "meta" stands in for the device."""
    from nemo_ac.models.init import to_empty_placed

    model = build_model(CFG)
    buffers = [name for name, _ in model.named_buffers()]
    assert buffers  # the check can fail: the model has buffers to place
    to_empty_placed(model, device="meta", parameter_device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    same = build_model(CFG)
    to_empty_placed(same, device="cpu", parameter_device="cpu")
    assert all(t.device.type == "cpu" for t in [*same.parameters(), *same.buffers()])
