"""FlexAttention's block mask, once per micro batch in eager mode (``nemo_ac.models.kernels.flex_attention``): every
layer's call of one micro batch reuses it (host work per layer and recompute otherwise), a new
window or micro batch builds its own, the values stay the tiled op's, the cached mask goes with the micro batch, and
under a dispatch mode (selective AC's) nothing is cached, so a recompute runs exactly the ops its forward ran.

CPU FlexAttention runs forward only (no backward): the tests call the forward."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nemo_ac.models.kernels import flex_attention as flex_module
from nemo_ac.models.layers.attention import build_attention_inputs, flex_packed_attention_op, tiled_packed_attention

pytestmark = pytest.mark.skipif(not flex_module.flex_attention_available(), reason="this torch has no FlexAttention")

SEQ = 88


def _docs(lengths: list[int]) -> torch.Tensor:
    row = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    return row.expand(2, SEQ).contiguous()


def _qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, SEQ, heads, 8, generator=g) for heads in (4, 2, 2))


@pytest.fixture
def masks_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts ``create_block_mask`` calls."""
    flex_attention, create_block_mask, aux_request = flex_module._flex()
    built: list[int] = []

    def counting(*args, **kwargs):
        built.append(1)
        return create_block_mask(*args, **kwargs)

    monkeypatch.setattr(flex_module, "_flex", lambda: (flex_attention, counting, aux_request))
    yield built


def test_one_block_mask_per_micro_batch_and_window_gone_with_the_batch(masks_built: list[int]) -> None:
    q, k, v = _qkv()
    attn = build_attention_inputs(_docs([30, 58]))
    want = tiled_packed_attention(q, k, v, attn)
    for _layer in range(3):
        torch.testing.assert_close(flex_packed_attention_op(q, k, v, attn), want)
    assert len(masks_built) == 1
    narrower = dataclasses.replace(attn, max_seqlen=20)  # the same ids under another window: a mask of its own
    torch.testing.assert_close(flex_packed_attention_op(q, k, v, narrower), tiled_packed_attention(q, k, v, narrower))
    assert len(masks_built) == 2
    other = build_attention_inputs(_docs([10, 78]))
    torch.testing.assert_close(flex_packed_attention_op(q, k, v, other), tiled_packed_attention(q, k, v, other))
    assert len(masks_built) == 3
    assert attn.document_ids in flex_module._BLOCK_MASKS
    del attn, narrower, other
    gc.collect()
    assert len(flex_module._BLOCK_MASKS) == 0


def test_under_selective_ac_every_call_builds_its_mask(masks_built: list[int]) -> None:
    """SAC's forward mode records each op (building the mask runs ``aten.sort``, which nemo_ac's router rule saves)
    and its recompute hands the saved outputs back in order: a mask reused in the recompute but built in the forward
    would hand the router the mask's sort. Under any dispatch mode the mask is built on every call."""
    q, k, v = _qkv()  # no requires_grad: CPU FlexAttention refuses it (the forward mode is entered either way)
    attn = build_attention_inputs(_docs([30, 58]))

    def save_sorts(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.sort.stable else CheckpointPolicy.PREFER_RECOMPUTE

    def two_layers(q, k, v):
        return flex_packed_attention_op(flex_packed_attention_op(q, k, v, attn), k, v, attn)

    out = checkpoint(
        two_layers, q, k, v, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(save_sorts)
    )
    assert len(masks_built) == 2 and len(flex_module._BLOCK_MASKS) == 0
    want = tiled_packed_attention(tiled_packed_attention(q, k, v, attn), k, v, attn)
    torch.testing.assert_close(out, want)
