"""Other trainers' selective-AC rules, written out as SAC policies over nemo_ac's op stream (for ``sac_frontier.py``).

Neither trainer is imported: each rule is re-stated from its source, so the frontier measures the *rule* on the same
model, the same kernels and the same inputs as nemo_ac's policy (what a policy decides is the only difference).

- ``torchtitan_policy``: torchtitan's ``SelectiveAC`` (``torchtitan/distributed/activation_checkpoint.py``, main of
  2026-08): saves torch's partitioner compute-intensive ops (``mm``, ``addmm``, ``bmm``, SDPA, ...), ``linear``,
  ``topk``, ``max``, FlexAttention and functional ``reduce_scatter`` / ``all_to_all``; ``mm`` / ``linear`` alternate
  (every second one recomputed, one counter per pass); an ``mm`` whose weight has the router gate's shape is always
  recomputed (``force_recompute_mm_shapes_by_fqns: ["moe.router.gate"]``); ``_grouped_mm`` is not in its list, so
  every grouped expert GEMM is recomputed.
- ``automodel_policy``: NeMo Automodel's ``make_selective_checkpoint_context_fn``
  (``nemo_automodel/components/distributed/activation_checkpointing.py``; the rule is the same on its r0.6.0 release
  branch and on main of 2026-08, which pyproject's tested 0.7.0 sits between): ``mm``, ``linear``, ``_grouped_mm``
  and ``_scaled_grouped_mm`` share one alternating counter (odd saved, even recomputed); partitioner
  compute-intensive ops, ``addmm``, ``bmm``, ``linear``, ``_scaled_mm``, SDPA variants, FlexAttention, ``topk``,
  ``max`` and ``all_to_all`` / ``reduce_scatter`` are always saved; both rules match exact ``OpOverload``\\ s
  (``aten.sort.stable`` or ``aten.max.dim`` are recomputed).

nemo_ac's own custom ops are mapped to what each trainer's model would run in their place: ``nemo_ac::packed_attention``
is its FlexAttention / SDPA call (saved by both), ``nemo_ac::grouped_mm`` (the fp32 grouped GEMM) is
``aten._grouped_mm``, ``nemo_ac::select_experts`` is the router's ``topk`` (saved by both). The Gated DeltaNet /
Mamba-2 kernel ops (``nemo_ac::fla_gated_delta_rule``, ``nemo_ac::mamba_chunk_scan``) are recomputed: both trainers
call fla / mamba-ssm's Triton kernels from Python autograd functions that a SAC policy never sees, so a recompute
reruns them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from nemo_ac.workarounds.partitioner_op_list import compute_intensive_ops

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
Policy = Callable[..., CheckpointPolicy]


def _ops(*names: str) -> frozenset:
    """``ns::name.overload`` strings -> the OpOverloads this torch build has."""
    found = set()
    for name in names:
        namespace, rest = name.split("::")
        op, overload = rest.split(".")
        try:
            found.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def _partitioner_defaults() -> frozenset:
    return frozenset(packet.default for packet in compute_intensive_ops())


# nemo_ac op -> the op a peer's model runs in its place (module docstring).
_AS_PEER = {
    "nemo_ac::packed_attention": aten._scaled_dot_product_flash_attention.default,
    "nemo_ac::grouped_mm": aten._grouped_mm.default,
    "nemo_ac::select_experts": aten.topk.default,
}


def as_peer_op(func: Any) -> Any:
    packet = getattr(func, "overloadpacket", None)
    return _AS_PEER.get(getattr(packet, "_qualified_op_name", ""), func)


_SDPA = (
    "aten::_scaled_dot_product_cudnn_attention.default",
    "aten::_scaled_dot_product_attention_math.default",
    "aten::_scaled_dot_product_fused_attention_overrideable.default",
)
_COMM = (
    "_c10d_functional::reduce_scatter_tensor.default",
    "_c10d_functional::all_to_all_single.default",
)


def torchtitan_policy(*, router_weight_shapes: frozenset[tuple[int, int]]) -> Callable[[], Policy]:
    """A factory of fresh torchtitan-rule policies; ``router_weight_shapes``: the router gates' ``(in, out)``."""
    mm_ops = frozenset({aten.mm.default, aten.linear.default})
    save = _partitioner_defaults() | _ops(*_SDPA, *_COMM, "aten::max.default", "aten::topk.default") | mm_ops

    def factory() -> Policy:
        counts = {False: 0, True: 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            func = as_peer_op(func)
            recompute = bool(getattr(ctx, "is_recompute", False))
            if func in mm_ops:
                shape = tuple(args[1].shape)
                if func is aten.linear.default:
                    shape = shape[::-1]
                if shape in router_weight_shapes:
                    return RECOMPUTE
                counts[recompute] += 1
            if func in save:
                if func in mm_ops and counts[recompute] % 2 == 0:
                    return RECOMPUTE
                return SAVE
            return RECOMPUTE

        return policy

    return factory


def automodel_policy() -> Callable[[], Policy]:
    """A factory of fresh Automodel-rule policies."""
    alternating = _ops(
        "aten::mm.default", "aten::linear.default", "aten::_grouped_mm.default", "aten::_scaled_grouped_mm.default"
    )
    save = _partitioner_defaults() | _ops(
        "aten::addmm.default",
        "aten::bmm.default",
        "aten::linear.default",
        "aten::_scaled_mm.default",
        "aten::_scaled_dot_product_flash_attention_for_cpu.default",
        "aten::scaled_dot_product_attention.default",
        "aten::topk.default",
        "aten::max.default",
        "aten::all_to_all_single.default",
        "aten::reduce_scatter_tensor.default",
        *_SDPA,
        *_COMM,
    )

    def factory() -> Policy:
        counts = {False: 0, True: 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            func = as_peer_op(func)
            recompute = bool(getattr(ctx, "is_recompute", False))
            if func in alternating:
                counts[recompute] += 1
                return RECOMPUTE if counts[recompute] % 2 == 0 else SAVE
            return SAVE if func in save else RECOMPUTE

        return policy

    return factory
