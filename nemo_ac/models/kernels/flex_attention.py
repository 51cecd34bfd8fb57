"""FlexAttention over packed documents (``backend.attention: flex``, what ``auto`` picks on CUDA).

torchtitan's choice for packed rows: a block mask built from the document ids skips every fully masked
(query block, key block) pair inside a fused kernel, and the kernel returns the log-sum-exp the ring merge needs.
The mask is the one the tiled op computes (same document, causal, inside the per-micro-batch window; padding attends
only itself), so the three kernels are interchangeable.

CUDA: the compiled (fused) kernel, forward and backward. CPU: torch 2.13 runs flex_attention's forward unfused in
eager mode (it materializes the scores: a numerics check, not a kernel to train with) and its compiled CPU lowering
supports neither training nor the log-sum-exp, so recipes validate ``flex`` against CUDA (``config.environment``)
and the CPU tests compare the forward with the dense reference.

Under a dispatch mode that makes Dynamo skip frames (torch's ``FlopCounterMode``, its memory trackers, nemo_ac's
``simulate.counters.StepCounter``; SAC's modes do not), FlexAttention cannot run at all: the compiled kernel falls
back to eager flex, which itself runs through ``torch.compile(fullgraph=True)`` and then fails. Seen on an H200
(torch 2.11, ``benchmarks/gpu_check.sh``, ``nemo_ac.simulate.measure`` and the flagship layer benchmark)::

    NotImplementedError: There was no rule registered for HigherOrderOperator flex_attention and mode
    <nemo_ac.simulate.counters.StepCounter object at ...>
    TypeError: no implementation found for 'torch.ops.higher_order.flex_attention' on types that implement
    __torch_function__: [] nor in mode <torch._dynamo._trace_wrapped_higher_order_op.TransformGetItemToIndex ...>

There the call runs as ``nemo_ac::packed_attention`` (the tiled op): the same mask, values and log-sum-exp, an op the
counting modes see with its FLOP formula, and the kernel the dry run already counts for flex (``simulate.run``).

One block mask per micro batch in eager mode: ``create_block_mask`` evaluates the mask over every block pair on the
host, in every layer's call and again in each recompute. On an H200 the eager flex step of a mid-size MoE (8 layers
x 2 micro batches, selective AC) spent 1.6 s more host time than SDPA's for the same kernel time (torch's profiler;
``benchmarks/results/gpu_check_h200.md``); the mask builds are part of that, measured under selective AC, where
they still happen per call (below).
A caller passes ``mask_key``, a tensor that lives exactly as long as the inputs that decide the mask (the local op:
the micro batch's document ids), and eager calls with the same key, sizes and window reuse the first call's mask.
The cache holds the key weakly and the mask holds a copy of the ids, so an entry goes with its micro batch.
Not cached: inside a compiled region (the mask is part of the graph), and under any dispatch mode. Selective AC's
modes record every op of the forward and hand saved outputs back to the recompute in order, per op; building the
mask runs ``aten.sort``, which the router rule saves, so a recompute that skipped the build would hand the router
the mask's sort. Full AC and no AC run under no dispatch mode and reuse the mask (building it saves no tensor for
backward, so full AC's recompute check sees the same saved tensors).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_any_mode_without_ignore_compile_internals, is_in_torch_dispatch_mode
from torch.utils.weak import WeakTensorKeyDictionary

from nemo_ac.models.kernels.packed_attention import UNBOUNDED, packed_attention


@functools.cache
def _flex() -> tuple[Any, Any, Any]:
    from torch.nn.attention import flex_attention as flex

    return flex.flex_attention, flex.create_block_mask, getattr(flex, "AuxRequest", None)


# mask_key -> (the window and sizes the mask was built for, the block mask): see the module docstring.
_BLOCK_MASKS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


@functools.cache
def _compiled_flex() -> Any:
    flex_attention, _, _ = _flex()
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_available() -> bool:
    try:
        _flex()
    except ImportError:
        return False
    return True


def flex_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None = None,
    min_k_pos: int = 0,
    max_back: int = UNBOUNDED,
    mask_key: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed_attention``'s contract on FlexAttention: q [B, Sq, h, d], k / v [B, Sk, hkv, d] ->
    ``(out [B, Sq, h, d], lse [B, h, Sq])``, ``out`` in q's dtype and ``lse`` in fp32. Under a dispatch mode
    that stops Dynamo, the tiled op runs instead. ``mask_key``: reuse the block mask across calls (module
    docstring); only for a key that fixes the ids and positions passed with it."""
    if is_in_any_mode_without_ignore_compile_internals():
        return packed_attention(
            q, k, v, q_doc=q_doc, k_doc=k_doc, q_pos=q_pos, k_pos=k_pos, scale=scale, min_k_pos=min_k_pos,
            max_back=max_back,
        )  # fmt: skip
    flex_attention, create_block_mask, aux_request = _flex()
    b, sq, _, d = q.shape
    sk = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    qp, kp = q_pos.expand(b, sq), k_pos.expand(b, sk)

    cached = mask_key is not None and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()
    signature = (b, sq, sk, max_back, min_k_pos, str(q.device)) if cached else None
    entry = _BLOCK_MASKS.get(mask_key) if cached else None
    if entry is not None and entry[0] == signature:
        block_mask = entry[1]
    else:
        if cached:  # the mask must not hold its own key alive (a weak key): it closes over copies
            q_doc, k_doc = (q_doc.clone(), k_doc.clone()) if q_doc is not k_doc else (q_doc.clone(),) * 2
        block_mask = _document_block_mask(
            create_block_mask, q_doc=q_doc, k_doc=k_doc, qp=qp, kp=kp, max_back=max_back, min_k_pos=min_k_pos
        )
        if cached:
            _BLOCK_MASKS[mask_key] = (signature, block_mask)
    run = _compiled_flex() if q.is_cuda else flex_attention
    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": scale, "enable_gqa": q.shape[2] != k.shape[2]}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        if aux_request is not None:
            out, aux = run(qt, kt, vt, return_aux=aux_request(lse=True), **kwargs)
            return out, aux.lse
        return run(qt, kt, vt, return_lse=True, **kwargs)  # releases before AuxRequest

    if torch.compiler.is_compiling():  # no eager-flex warning to silence, and catch_warnings graph-breaks Dynamo
        out, lse = call()
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out, lse = call()
    acc = torch.promote_types(q.dtype, torch.float32)
    return out.transpose(1, 2), lse.to(acc)


def _document_block_mask(
    create_block_mask: Any,
    *,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    qp: torch.Tensor,
    kp: torch.Tensor,
    max_back: int,
    min_k_pos: int,
) -> Any:
    """The block mask of the packed-document mask (same document, causal, inside the window; padding attends only
    itself) over ``qp`` [B, Sq] x ``kp`` [B, Sk] positions."""
    (b, sq), sk = qp.shape, kp.shape[1]
    # The window's two ints change every micro batch; the mask reads them from a tensor, so no compiled flex
    # (nor the compile inside eager flex) guards on their values: as ints in mask_mod's closure they recompiled
    # flex once per micro batch on an H200 (``block_mask.mask_mod.__closure__[2].cell_contents == 76``), until the
    # recompile limit made it eager.
    window_bounds = torch.tensor((max_back, min_k_pos), dtype=torch.int64, device=qp.device)

    def mask_mod(batch, head, qi, ki):
        back = qp[batch, qi] - kp[batch, ki]
        same = (q_doc[batch, qi] == k_doc[batch, ki]) & (k_doc[batch, ki] >= 0)
        window = (back >= 0) & (back < window_bounds[0]) & (kp[batch, ki] >= window_bounds[1])
        return (same & window) | (back == 0)

    return create_block_mask(mask_mod, b, None, sq, sk, device=qp.device)
