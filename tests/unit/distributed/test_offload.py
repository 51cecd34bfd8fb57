"""Activation offloading (nemo_ac/distributed/offload.py): the saved-tensor hook runs, every saved block input is
copied into its own host buffer and backward reads that copy, and the loss and gradients equal a run without
offloading. Through ``parallelize`` (FSDP2 at gloo world size 1, full AC) and directly (mode none, hook hygiene).
"""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.config.schema import ActivationCheckpointingConfig
from nemo_ac.distributed.activation_checkpointing import apply_ac
from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.offload import ActivationOffloader, _Kept, _Packed, apply_offload
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.models.init import canonical_name, materialize_and_init
from nemo_ac.models.layers.attention import build_attention_inputs
from nemo_ac.trainer.build import build_parallel_model
from tests.factories import glm_config
from tests.launch import RECIPES

SEQ = 40  # never a model dimension
BATCH = 2


class SpyOffloader(ActivationOffloader):
    """Records, for every copy, the saved tensor's storage and the host buffer's, and what backward got back."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.copies: list[tuple[int, int, tuple[int, ...]]] = []
        self.returned: list[int] = []

    def pack(self, tensor):
        packed = super().pack(tensor)
        if isinstance(packed, _Packed):
            assert packed.host.device.type == "cpu" and packed.host.is_pinned() == (tensor.device.type == "cuda")
        if isinstance(packed, _Packed) and packed.host.data_ptr() not in {c[1] for c in self.copies}:
            self.copies.append((tensor.untyped_storage().data_ptr(), packed.host.data_ptr(), tuple(tensor.shape)))
        return packed

    def unpack(self, packed):
        out = super().unpack(packed)
        if isinstance(packed, _Packed):
            self.returned.append(out.data_ptr())
        return out


def _inputs(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    docs = torch.cat([torch.zeros(BATCH, 17, dtype=torch.long), torch.ones(BATCH, SEQ - 17, dtype=torch.long)], 1)
    positions = torch.cat([torch.arange(17), torch.arange(SEQ - 17)]).expand(BATCH, -1)
    return {
        "input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
        "position_ids": positions,
        "attn": build_attention_inputs(docs),
    }


def _loss_and_grads(model, vocab: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(**_inputs(vocab))
    loss = out.logits.float().logsumexp(-1).mean() + sum(s.prob_sum.sum() for s in out.router_stats) * 1e-3
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[canonical_name(name)] = grad.clone()
    return loss.detach(), grads


# --------------------------------------------------------------------------------------------------------------
# through parallelize: FSDP2 (gloo, world size 1), full AC, the tiny GLM recipe


def _parallelized_glm(offload: bool):
    overrides = ["parallel.cp=1", "activation_checkpointing.mode=full", f"activation_checkpointing.offload={offload}"]
    recipe = load_recipe(str(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml"), overrides)
    layout = validate_recipe(recipe, world_size=1)
    model, _, plan = build_parallel_model(recipe, layout, device=torch.device("cpu"))
    materialize_and_init(model, device="cpu", seed=3)
    return model, recipe, plan.applied.offloader


def test_full_ac_offloads_each_block_input_and_matches_bitwise(world) -> None:
    """parallelize installs the offloader on every AC-wrapped block; under full AC the checkpoint saves one tensor
    per block (its input, [B, S, H]) and that is what moves: one host copy per block, each a separate buffer,
    each returned to backward (the recompute reads the copy). Loss and every gradient are bitwise equal."""
    plain, recipe, none = _parallelized_glm(offload=False)
    assert none is None
    expected_loss, expected = _loss_and_grads(plain, recipe.model.vocab_size)

    model, _, offloader = _parallelized_glm(offload=True)
    assert isinstance(offloader, ActivationOffloader)
    layers = recipe.model.num_layers
    hidden = recipe.model.hidden_size
    loss, grads = _loss_and_grads(model, recipe.model.vocab_size)

    stats = offloader.stats
    assert stats.packed == layers, stats
    assert stats.packed_bytes == layers * BATCH * SEQ * hidden * 4, stats
    assert stats.unpacked == layers, stats  # every copy came back, for the recompute
    assert {name: source() for name, source in offloader.metric_sources().items()} == {
        "offload_tensors": layers,
        "offload_mib": round(layers * BATCH * SEQ * hidden * 4 / 2**20, 3),
    }
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_spy_sees_copies_in_their_own_host_buffers(world) -> None:
    """The same path with a recording offloader installed by hand: the saved tensors are [B, S, H] block inputs,
    each host buffer is a different storage from the tensor it copies, and backward receives exactly those
    buffers."""
    model, recipe, _ = _parallelized_glm(offload=False)
    spy = SpyOffloader()
    for block in decoder_layers(model):
        spy.install(block)
    _loss_and_grads(model, recipe.model.vocab_size)
    assert len(spy.copies) == recipe.model.num_layers
    for original, host, shape in spy.copies:
        assert host != original
        assert shape == (BATCH, SEQ, recipe.model.hidden_size)
    assert sorted(spy.returned) == sorted(host for _, host, _ in spy.copies)


# --------------------------------------------------------------------------------------------------------------
# directly, no process group


def _glm(mode: str, offload: bool, in_flight: int = 2):
    cfg = glm_config()
    model = materialize_and_init(build_model(cfg), device="cpu", seed=1)
    apply_ac(model, plan=decide_plan(model, activation_checkpointing=ActivationCheckpointingConfig(mode=mode)))
    return model, apply_offload(model, enabled=offload, in_flight=in_flight), cfg


class OrderSpy(ActivationOffloader):
    """Numbers each copy by pack order (full AC: block 0, 1, ...) and logs when it comes back and when it is used."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_of: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []

    def pack(self, tensor):
        packed = super().pack(tensor)
        if isinstance(packed, _Packed):
            self.block_of.setdefault(id(packed), len(self.block_of))
        return packed

    def _bring_back(self, packed, *, ahead):
        self.events.append(("prefetch" if ahead else "on demand", self.block_of[id(packed)]))
        return super()._bring_back(packed, ahead=ahead)

    def unpack(self, packed):
        out = super().unpack(packed)
        if isinstance(packed, _Packed):
            self.events.append(("use", self.block_of[id(packed)]))
        return out


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_backward_prefetches_at_most_in_flight_blocks_ahead(in_flight: int) -> None:
    """Full AC: a block's saved input is brought back while a later block's backward runs, never before the blocks
    ``in_flight`` or more after it have used theirs (so at most ``in_flight`` blocks' copies are on the device), and
    with ``in_flight`` >= 2 every block but the first in backward finds its copy already back. 1: all on demand.
    Loss and gradients stay bitwise those of a run without offloading."""
    plain, _, cfg = _glm("full", offload=False)
    expected_loss, expected = _loss_and_grads(plain, cfg.vocab_size)
    model, _, _ = _glm("full", offload=False)
    spy = OrderSpy(in_flight=in_flight)
    for block in decoder_layers(model):
        spy.install(block)
    loss, grads = _loss_and_grads(model, cfg.vocab_size)
    layers = cfg.num_layers
    used: set[int] = set()
    for event, block in spy.events:
        if event == "use":
            used.add(block)
            continue
        assert set(range(block + in_flight, layers)) <= used, (event, block, spy.events)
    brought = {block: event for event, block in spy.events if event != "use"}
    assert len([event for event, _ in spy.events if event != "use"]) == layers  # once each: unpacks share a copy
    if in_flight == 1:
        assert brought == dict.fromkeys(range(layers), "on demand")
    else:  # the block whose backward comes first has nothing before it to overlap with
        assert brought == {**dict.fromkeys(range(layers - 1), "prefetch"), layers - 1: "on demand"}
    assert spy.stats.prefetched + spy.stats.fetched_on_demand == layers
    assert not spy._order  # the backward consumed the prefetch queue
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_without_ac_every_saved_activation_moves_once_and_parameters_stay() -> None:
    """mode none: everything a block saves goes through pack. Activations are copied (a tensor saved by several
    ops, such as the normed input of q/k/v, once), parameters and their views are kept, and loss and gradients are
    bitwise equal: copies keep the saved tensor's strides and its address alignment (MKL picks its GEMM path by
    alignment; a slice copied to an aligned buffer changed the last bits of gradients before)."""
    plain, _, cfg = _glm("none", offload=False)
    expected_loss, expected = _loss_and_grads(plain, cfg.vocab_size)
    model, offloader, _ = _glm("none", offload=True)
    loss, grads = _loss_and_grads(model, cfg.vocab_size)
    stats = offloader.stats
    assert stats.packed > 10 * cfg.num_layers, stats
    assert stats.deduplicated > 0 and stats.kept > 0, stats
    assert stats.unpacked >= stats.packed, stats
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_parameters_and_small_tensors_are_never_copied() -> None:
    offloader = ActivationOffloader(min_bytes=64)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    assert isinstance(offloader.pack(weight), _Kept)
    assert isinstance(offloader.pack(weight.t()), _Kept)  # a view of a parameter (what mm saves)
    assert isinstance(offloader.pack(torch.randn(4)), _Kept)  # 16 bytes < 64
    packed = offloader.pack(torch.randn(8, 8).t())
    assert isinstance(packed, _Packed)
    assert packed.host.stride() == (1, 8)  # dense strides kept: backward takes the same kernel path
    half = offloader.pack(torch.randn(8, 32)[:, 16:])  # one half of a fused projection: a view with gaps
    assert half.host.stride() == (32, 1) and torch.equal(offloader.unpack(half), half.host)
    expanded = offloader.pack(torch.randn(8, 1).expand(8, 64))  # overlapping: copied contiguous
    assert expanded.host.stride() == (64, 1)
    assert offloader.stats.kept == 3 and offloader.stats.packed == 3


def test_copies_keep_the_address_alignment_of_the_original() -> None:
    offloader = ActivationOffloader(min_bytes=0)
    base = torch.randn(4096)
    for start in (0, 1, 3, 16, 17):
        view = base[start : start + 1000]
        packed = offloader.pack(view)
        assert packed.host.data_ptr() % 256 == view.data_ptr() % 256
        assert torch.equal(packed.host, view) and packed.host.untyped_storage().data_ptr() != base.data_ptr()


def test_a_failing_forward_does_not_leave_the_hooks_active() -> None:
    """The exit hook is ``always_call``: a block that raises still pops the saved-tensor hooks, so later code is
    not offloaded by accident."""
    model, offloader, cfg = _glm("full", offload=True)
    bad = _inputs(cfg.vocab_size)
    bad["input_ids"] = bad["input_ids"][:, :-1]  # positions and document ids no longer fit
    with pytest.raises(RuntimeError):
        model(**bad)
    before = offloader.stats.packed
    x = torch.randn(16, 16, requires_grad=True)
    (x * x).sum().backward()  # saves x twice; nothing may reach the offloader now
    assert offloader.stats.packed == before
    assert not offloader._active and not offloader._invocations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory / side-stream path needs a GPU")
@pytest.mark.parametrize("in_flight", [1, 2])
def test_cuda_offload_goes_to_pinned_host_memory_and_matches(in_flight: int) -> None:
    """CUDA: block inputs go to pinned host memory (side stream + event), the device tensors are held for at most
    ``in_flight`` blocks, and come back for the recompute (prefetched on the side stream where ``in_flight`` >= 2);
    loss and gradients equal a run without offloading. Skipped on CPU-only machines (benchmarks/gpu_check.sh)."""

    def run(offload: bool):
        cfg = glm_config()
        model = materialize_and_init(build_model(cfg), device="cuda", seed=1)
        apply_ac(model, plan=decide_plan(model, activation_checkpointing=ActivationCheckpointingConfig(mode="full")))
        spy = SpyOffloader(in_flight=in_flight) if offload else None
        if spy is not None:
            for block in decoder_layers(model):
                spy.install(block)
        inputs = _inputs(cfg.vocab_size)
        inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
        inputs["attn"] = build_attention_inputs(inputs.pop("attn").document_ids.cuda())
        out = model(**inputs)
        loss = out.logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, spy

    expected_loss, expected, _ = run(offload=False)
    loss, grads, spy = run(offload=True)
    layers = glm_config().num_layers
    assert spy.stats.packed == layers == spy.stats.unpacked
    assert spy.stats.most_blocks_held == in_flight
    assert spy.stats.prefetched == (0 if in_flight == 1 else layers - 1)
    assert not spy._held  # the backward waited for every copy to the host and let the device tensors go
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
