"""``backend.linear / rms_norm / attention: te``: Transformer Engine modules swapped into the decoder blocks.

UNTESTED HERE: CI machines have neither CUDA nor ``transformer_engine``; tests only check that asking for ``te``
without it fails with the recipe key and the ``pip install 'nemo_ac[te]'`` line, and that the swap leaves torch
backends untouched. Written against TE's public ``transformer_engine.pytorch`` API (``Linear``, ``RMSNorm``,
``DotProductAttention`` with ``qkv_format="thd"``); verify parity against the torch backends on a GPU before
relying on it.

What is swapped, on the meta-device model before parallelization (weights are materialized or loaded afterwards,
so nothing is copied here):

- linear: every plain ``nn.Linear`` inside a decoder block (attention and Mamba projections, dense MLPs, shared
  experts, latent projections) becomes ``te.Linear`` with the same ``weight`` / ``bias`` names, so HF checkpoints
  and DCP keys are unchanged. Routed experts (3-D grouped weights), routers and ``lm_head`` stay torch.
- rms_norm: plain ``RMSNorm`` / ``NemotronHRMSNorm`` modules become ``te.RMSNorm`` (``weight`` name kept). Norms
  with other semantics (zero-centered, Mamba's gated norm) stay torch. TE normalizes and scales in fp32 and casts
  once (Nemotron-H's order; Qwen's casts before the scale), so bf16 outputs differ from HF's in the last bit.
- attention: each ``Attention.attn_op`` becomes a TE ``DotProductAttention`` over the packed rows (``thd`` layout,
  ``padding_causal`` mask from ``cu_seqlens``). Ulysses CP wraps it like the SDPA op (validation rejects ring CP,
  which computes attention itself).

TE modules add an ``_extra_state`` entry (FP8 metadata) to ``state_dict``; DCP checkpoints made with ``te`` carry
it, HF export ignores it (parameters and buffers only).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.models.layers.attention import Attention
from nemo_ac.models.layers.rmsnorm import RMSNorm

_INSTALL_HINT = "pip install 'nemo_ac[te]' on a CUDA machine"


def import_te(key: str) -> Any:
    """``transformer_engine.pytorch``, or a ConfigError naming ``key`` and the install extra."""
    fallback = "sdpa" if key == "backend.attention" else "torch"
    try:
        import transformer_engine.pytorch as te
    except ImportError as exc:
        raise ConfigError(
            ConfigIssue(
                key,
                f"'te' needs the optional package 'transformer_engine' ({exc}): {_INSTALL_HINT}, or set {key}: "
                f"{fallback}",
            )
        ) from exc
    if not torch.cuda.is_available():
        raise ConfigError(ConfigIssue(key, f"'te' runs on CUDA only and no GPU is visible; set {key}: {fallback}"))
    return te


def _norm_classes() -> tuple[type, ...]:
    from nemo_ac.models.nemotron_h import NemotronHRMSNorm

    return (RMSNorm, NemotronHRMSNorm)


def swaps_linear(module: nn.Module) -> bool:
    """``backend.linear: te`` swaps exactly the plain ``nn.Linear`` modules of a block."""
    return type(module) is nn.Linear


def swaps_norm(module: nn.Module) -> bool:
    """``backend.rms_norm: te`` swaps exactly the plain RMS norms (not Mamba's gated or zero-centered norms)."""
    return type(module) in _norm_classes()


def te_swap_counts(block: nn.Module, *, linear: str, rms_norm: str, attention: str) -> dict[str, int]:
    """How many TE modules ``apply_te_backends`` will put into ``block``, by TE class, without importing TE.

    The plan reads this before anything is applied: every TE module's forward is Dynamo-disabled (TE decorates its
    modules' ``forward`` with ``no_torch_dynamo``, i.e. ``torch._dynamo.disable``), so the block's compile layout
    must tolerate graph breaks at each of them (``nemo_ac.distributed.untraceable``).
    """
    modules = list(block.modules())
    counts = {
        "te.Linear": sum(swaps_linear(m) for m in modules) if linear == "te" else 0,
        "te.RMSNorm": sum(swaps_norm(m) for m in modules) if rms_norm == "te" else 0,
        "te.DotProductAttention": sum(isinstance(m, Attention) for m in modules) if attention == "te" else 0,
    }
    return {name: count for name, count in counts.items() if count}


def _swap_children(block: nn.Module, build: Any) -> int:
    """Replace each descendant ``m`` of ``block`` for which ``build(m)`` returns a module; returns the count."""
    swapped = 0
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            replacement = build(child)
            if replacement is not None:
                setattr(parent, name, replacement)
                swapped += 1
    return swapped


def _ones_for_weight(name: str, generator: torch.Generator, *, size: int) -> torch.Tensor | None:
    """``initial_parameter`` hook of a swapped-in TE norm: a norm scale starts at ones."""
    return torch.ones(size) if name == "weight" else None


class TEPackedAttention:
    """``Attention.attn_op`` backed by TE's fused attention over packed documents (a plain callable, not a
    submodule: it holds no parameters and must not add state_dict keys).

    One ``DotProductAttention`` per head layout seen (Ulysses hands the op ``1/cp`` of the heads).
    """

    def __init__(self, te: Any, *, head_dim: int) -> None:
        self.te = te
        self.head_dim = head_dim
        self._modules: dict[tuple[int, int], Any] = {}

    def _module(self, num_heads: int, num_kv_heads: int) -> Any:
        key = (num_heads, num_kv_heads)
        if key not in self._modules:
            self._modules[key] = self.te.DotProductAttention(
                num_attention_heads=num_heads,
                kv_channels=self.head_dim,
                num_gqa_groups=num_kv_heads,
                attn_mask_type="padding_causal",
                qkv_format="thd",
                attention_dropout=0.0,
            )
        return self._modules[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        b, s, nh, hd = q.shape
        nkv = k.shape[2]
        cu = attn.cu_seqlens.to(device=q.device, dtype=torch.int32)
        out = self._module(nh, nkv)(
            q.reshape(b * s, nh, hd),
            k.reshape(b * s, nkv, hd),
            v.reshape(b * s, nkv, hd),
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=attn.max_seqlen,
            max_seqlen_kv=attn.max_seqlen,
        )
        return out.reshape(b, s, nh, hd)


def apply_te_backends(layers: nn.ModuleList, *, linear: str, rms_norm: str, attention: str) -> dict[str, int]:
    """Swap TE modules into ``layers`` (the decoder blocks) for each backend (``backend.linear`` / ``rms_norm`` /
    ``attention``) set to ``te``; returns how many modules were swapped per backend (all zero when nothing asks for
    TE: TE is then never imported)."""
    counts = {"linear": 0, "rms_norm": 0, "attention": 0}
    if linear == "te":
        te = import_te("backend.linear")

        def linear(child: nn.Module) -> nn.Module | None:
            if not swaps_linear(child):
                return None
            return te.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                params_dtype=child.weight.dtype,
                device=child.weight.device,
            )

        counts["linear"] = sum(_swap_children(block, linear) for block in layers)
    if rms_norm == "te":
        te = import_te("backend.rms_norm")

        def norm(child: nn.Module) -> nn.Module | None:
            if not swaps_norm(child):
                return None
            swapped = te.RMSNorm(
                child.weight.shape[0], eps=child.eps, params_dtype=child.weight.dtype, device=child.weight.device
            )
            # nemo_ac's random init recognizes its own norms only; this instance hook (read by
            # models.init.default_init_rule) keeps a TE norm's scale at ones instead of normal(0, std).
            swapped.initial_parameter = functools.partial(_ones_for_weight, size=child.weight.shape[0])
            return swapped

        counts["rms_norm"] = sum(_swap_children(block, norm) for block in layers)
    if attention == "te":
        te = import_te("backend.attention")
        for block in layers:
            for module in block.modules():
                if isinstance(module, Attention):
                    module.attn_op = TEPackedAttention(te, head_dim=module.head_dim)
                    counts["attention"] += 1
    return counts
