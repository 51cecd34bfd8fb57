"""Nemotron-H family: logit parity with transformers 5 ``NemotronHForCausalLM``, packed-document isolation of the
Mamba-2 mixer, the swappable ``ssm_op`` contract (head slicing for ulysses CP) and the parallelizer-facing layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nemo_ac.config.schema import ModelConfig
from nemo_ac.models import build_model
from nemo_ac.models.expert_bias import biased_routers
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, Mamba2Mixer, mamba2_ssm, segment_ids
from tests.factories import nemotron_config


def _model(cfg: ModelConfig, seed: int = 3) -> torch.nn.Module:
    model = materialize_and_init(build_model(cfg), device="cpu", seed=seed).eval()
    with torch.no_grad():
        for router in biased_routers(model):
            router.e_score_correction_bias.copy_(torch.linspace(0.2, -0.2, cfg.moe.num_experts))
    return model


def _forward(model: torch.nn.Module, ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, position_ids=pos, attn=build_attention_inputs(document_ids)).logits


@pytest.mark.parametrize("latent_size", [16, 0])
def test_logits_match_transformers(latent_size: int) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not importable; HF parity needs it")
    cfg = nemotron_config(latent_size)
    model = _model(cfg)
    moe, m = cfg.moe, cfg.mamba
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        hybrid_override_pattern=cfg.layer_pattern,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        mamba_num_heads=m.num_heads,
        mamba_head_dim=m.head_dim,
        ssm_state_size=m.state_size,
        n_groups=m.n_groups,
        conv_kernel=m.conv_kernel,
        chunk_size=m.chunk_size,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_latent_size=latent_size or None,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        layer_norm_epsilon=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    hf = transformers.NemotronHForCausalLM(hf_cfg).eval()
    assert set(model.state_dict()) == set(hf.state_dict())
    hf.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(
        0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0)
    )  # 21: not a chunk multiple
    ours = _forward(model, ids, torch.zeros(2, 21))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lengths", [(7, 9, 5), (8, 13), (3, 16, 2)])
def test_packed_documents_equal_documents_alone(lengths: tuple[int, ...]) -> None:
    """Conv window and SSM state reset at document starts, including starts inside and at chunk edges (chunk 8)."""
    cfg = nemotron_config()
    model = _model(cfg)
    total = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    packed = _forward(model, ids, docs)
    start = 0
    for n in lengths:
        alone = _forward(model, ids[:, start : start + n], torch.zeros(1, n))
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=2e-5, rtol=2e-5)
        start += n
    # Without document ids the later documents would see the earlier ones: the masks do something.
    leaked = _forward(model, ids, torch.zeros(1, total))
    assert (leaked[:, lengths[0] :] - packed[:, lengths[0] :]).abs().max() > 1e-3


def test_segments_are_runs_so_separate_padding_stays_separate() -> None:
    docs = torch.tensor([[0, 0, -1, -1, 1, 1, -1], [2, 2, 2, 2, 2, 2, 2]])
    assert segment_ids(docs).tolist() == [[0, 0, 1, 1, 2, 2, 3], [0] * 7]


def test_ssm_op_runs_per_head_slice_as_ulysses_would() -> None:
    """The op is a per-head function: computing two head halves (with their B/C groups) separately, as a
    head-sharded context-parallel wrapper would, and concatenating equals the whole op."""
    mixer = _model(nemotron_config()).model.layers[0].mixer
    assert isinstance(mixer, Mamba2Mixer)
    calls: list[tuple[int, int]] = []

    def split_heads(
        x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, p: Mamba2CoreParams, a: AttentionInputs
    ) -> torch.Tensor:
        halves = []
        for h, g in ((slice(0, 2), slice(0, 1)), (slice(2, 4), slice(1, 2))):
            calls.append((x[:, :, h].shape[2], B[:, :, g].shape[2]))
            halves.append(mamba2_ssm(x[:, :, h], B[:, :, g], C[:, :, g], dt[:, :, h], p.select(h, g), a))
        return torch.cat(halves, dim=2)

    hidden = torch.randn(2, 19, 48, generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[0] * 10 + [1] * 9, [0] * 19])
    attn = build_attention_inputs(docs)
    with torch.no_grad():
        whole = mixer(hidden, attn=attn)
        mixer.ssm_op = split_heads
        sliced = mixer(hidden, attn=attn)
    assert calls == [(2, 1), (2, 1)]
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
    # The default op never runs on a context-parallel shard (it would restart the recurrence at the shard edge).
    mixer.ssm_op = mamba2_ssm
    with pytest.raises(RuntimeError, match="ulysses ssm_op"):
        mixer(hidden, attn=dataclasses.replace(attn, context_parallel=object()))


def test_layer_contract_and_parallelizer_view() -> None:
    from nemo_ac.distributed.blocks import decoder_layers, routed_moe, sequence_mixers
    from nemo_ac.distributed.plan import decide_plan
    from nemo_ac.models.interfaces import DecoderBlock, ParallelizableModel, RoutedMoE

    cfg = nemotron_config()
    model = build_model(cfg)
    assert isinstance(model, ParallelizableModel)
    layers = decoder_layers(model)
    assert [layer.block_type for layer in layers] == ["mamba", "moe", "attention", "mamba", "mlp", "moe"]
    assert [layer.is_moe for layer in layers] == [False, True, False, False, False, True]
    assert all(isinstance(layer, DecoderBlock) for layer in layers)
    moe_layer = layers[1]
    assert routed_moe(moe_layer) is moe_layer.mixer and isinstance(moe_layer.mixer, RoutedMoE)
    assert [routed_moe(layer) is None for layer in layers] == [True, False, True, True, True, False]
    plan = decide_plan(model)
    assert plan.decoder_blocks()[1].nested_units == ("router", "experts")  # the config's fp32 router + experts
    assert plan.decoder_blocks()[0].nested_units == ()
    assert moe_layer.mixer.router_module() is moe_layer.mixer.gate
    assert moe_layer.mixer.experts_module() is moe_layer.mixer.experts
    assert [m.mixer_kind for m in sequence_mixers(layers[0])] == ["ssm"]
    assert [m.mixer_kind for m in sequence_mixers(layers[2])] == ["softmax_attention"]
    assert sequence_mixers(moe_layer) == [] and hasattr(moe_layer.mixer, "dispatcher")


def test_mamba_init_and_training_step() -> None:
    cfg = nemotron_config()
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    mixer = model.model.layers[0].mixer
    torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1.0, 5.0)))
    torch.testing.assert_close(mixer.D, torch.ones(4))
    dt = F.softplus(mixer.dt_bias)
    assert torch.all(dt >= cfg.mamba.time_step_min * 0.999) and torch.all(dt <= cfg.mamba.time_step_max * 1.001)
    assert torch.all(mixer.norm.weight == 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    out = model(ids, position_ids=torch.arange(13).expand(2, 13), attn=build_attention_inputs(torch.zeros(2, 13)))
    F.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert mixer.A_log.grad.abs().sum() > 0 and mixer.conv1d.weight.grad.abs().sum() > 0


def test_builder_rejects_what_nemotron_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"layer_pattern has 6 layers \(model.num_layers=5\)"):
        build_model(nemotron_config(num_layers=5))
    with pytest.raises(ValueError, match=r"qk_norm=True \(needs False\)"):
        build_model(nemotron_config(qk_norm=True))
    with pytest.raises(ValueError, match=r"moe\.activation"):
        build_model(nemotron_config(moe=dataclasses.replace(nemotron_config().moe, activation="silu")))
