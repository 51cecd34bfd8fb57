"""The LM head and the cross entropy in token chunks (``train.loss_chunk_tokens``): the same loss and gradients as
``lm_head(hidden)`` + ``F.cross_entropy`` to fp32 rounding, and no [tokens, vocab] tensor at any time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from nemo_ac.data.batch import IGNORE_INDEX
from nemo_ac.models import build_model
from nemo_ac.models.init import materialize_and_init
from nemo_ac.models.kernels.chunked_cross_entropy import IGNORE_INDEX as OP_IGNORE_INDEX
from nemo_ac.models.kernels.chunked_cross_entropy import chunked_cross_entropy_sum
from nemo_ac.models.layers.attention import build_attention_inputs
from tests.factories import glm_config, qwen3_5_config, rel_err

TOKENS, HIDDEN, VOCAB = (3, 50), 32, 301


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(*TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = (0.2 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, TOKENS, generator=generator)
    labels[0, :7] = IGNORE_INDEX  # a prompt
    labels[2, 40:] = IGNORE_INDEX  # padding
    return hidden, weight, labels


def _plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def test_the_op_ignores_the_data_pipelines_ignore_index() -> None:
    assert OP_IGNORE_INDEX == IGNORE_INDEX


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 150, 1000])
def test_loss_and_gradients_equal_the_whole_logits_path_in_fp32(chunk_tokens: int) -> None:
    hidden, weight, labels = _inputs(torch.float32)
    want = _plain(hidden, weight, labels)
    want_grads = torch.autograd.grad(0.37 * want, (hidden, weight))
    got = chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens)
    got_grads = torch.autograd.grad(0.37 * got, (hidden, weight))
    errors = [rel_err(got, want), *(rel_err(g, w) for g, w in zip(got_grads, want_grads))]
    print(f"chunk {chunk_tokens}: max relative error loss {errors[0]:.1e} d_hidden {errors[1]:.1e} d_W {errors[2]:.1e}")
    assert max(errors) < 5e-6, errors
    assert got_grads[0][0, :7].abs().sum() == 0  # ignored tokens get no gradient


def test_bf16_rounds_the_weight_gradient_once_per_chunk_at_most() -> None:
    """In bf16 the hidden gradient is the plain path's; the weight gradient is accumulated in bf16 over chunks,
    so it may differ from one rounding by a few bf16 steps (2**-8 relative each), no more."""
    hidden, weight, labels = _inputs(torch.bfloat16)
    want_hidden, want_weight = torch.autograd.grad(_plain(hidden, weight, labels), (hidden, weight))
    got_hidden, got_weight = torch.autograd.grad(
        chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=64), (hidden, weight)
    )
    assert rel_err(got_hidden, want_hidden) < 2**-8
    assert rel_err(got_weight, want_weight) < 3 * 2**-8  # 3 chunks: at most 3 roundings


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op produced, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_no_op_makes_a_tokens_by_vocab_tensor(chunk_tokens: int | None) -> None:
    hidden, weight, labels = _inputs(torch.float32)
    with _LargestOutput() as seen:
        if chunk_tokens is None:
            loss = _plain(hidden, weight, labels)
        else:
            loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens)
        loss.backward()
    tokens = hidden.numel() // HIDDEN
    if chunk_tokens is None:  # the plain path: the whole logits (the check can fail)
        assert seen.largest == tokens * VOCAB
    else:  # one chunk's logits, or the weight's gradient, whichever is larger
        assert seen.largest == max(chunk_tokens * VOCAB, VOCAB * HIDDEN) < tokens * VOCAB


def test_flop_counter_sees_the_backward_recompute() -> None:
    """FlopCounterMode counts every matmul of the op: the plain path's six (forward, two gradients) plus one
    recomputed forward matmul in backward, 2 * tokens * hidden * vocab."""
    hidden, weight, labels = _inputs(torch.float32)
    counts = {}
    for name, fn in (
        ("plain", lambda: _plain(hidden, weight, labels)),
        ("chunked", lambda: chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens=32)),
    ):
        with FlopCounterMode(display=False) as counter:
            fn().backward()
        counts[name] = counter.get_total_flops()
    tokens = hidden.numel() // HIDDEN
    assert counts["plain"] == 3 * 2 * tokens * HIDDEN * VOCAB
    assert counts["chunked"] == counts["plain"] + 2 * tokens * HIDDEN * VOCAB


@pytest.mark.parametrize("config", [glm_config, qwen3_5_config], ids=["glm4_moe", "qwen3_5_moe"])
def test_a_model_given_labels_returns_the_loss_and_the_gradients_of_its_logits(config) -> None:
    """Every parameter's gradient (the tied or untied LM head, the embedding, each block) equals the one from the
    model's logits and F.cross_entropy, in fp32."""
    cfg = config()
    model = materialize_and_init(build_model(cfg), device="cpu", seed=3)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    document_ids = torch.zeros_like(ids, dtype=torch.int32)
    document_ids[:, 10:] = 1
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)

    def grads(**head: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(ids, position_ids=positions, attn=build_attention_inputs(document_ids), **head)
        if out.ce_sum is None:
            assert out.logits is not None
            ce_sum = F.cross_entropy(
                out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        else:
            assert out.logits is None
            ce_sum = out.ce_sum
        ce_sum.backward()
        return ce_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = grads()
    got_loss, got = grads(labels=labels, loss_chunk_tokens=5)
    assert rel_err(got_loss, want_loss) < 1e-6
    assert set(got) == set(want) and "lm_head.weight" in got
    worst = max((rel_err(got[name], want[name]), name) for name in want)
    print(f"{cfg.family}: worst per-parameter relative error {worst[0]:.1e} ({worst[1]})")
    assert worst[0] < 1e-5, worst
