"""The selective-AC policy: what a region saves and what it recomputes.

Saved: compute-intensive ops from torch's partitioner list (attention, convolution, ...), the mixer kernels' ops
(``nemo_ac::fla_gated_delta_rule``, ``nemo_ac::mamba_chunk_scan``: the whole Gated DeltaNet / Mamba-2 core), the
matmuls (dense and grouped expert GEMMs) whose recompute costs at least ``selective.matmul_min_flops_per_byte``
FLOPs per byte of output held (``matmul_flops_per_byte``: a bf16 projection out of a 2048-wide hidden state is 2048;
0: every other matmul, torchtitan's rule; ``selective.save_every_other_mm: false`` saves all); router top-k / sort
outputs and the router's ``nemo_ac::select_experts`` (``models.layers.routing_replay``, which also covers full AC and
compiled regions), so the recompute routes every token to the same experts (with ``tokens_per_expert.tolist()`` in the
experts loop a different routing would change the op stream itself); outputs of functional collectives (all-to-all,
reduce-scatter, all-gather; DeepEP's dispatch / combine, ``expert_parallel.deepep_ops``), so the recompute does
not communicate again. Never saved: an op that mutates an input (``aten.copy_``, ``scatter_``, FSDP's copy-out):
replaying a cached result skips the mutation, e.g. ``inverse_permutation``'s ``inv.scatter_`` or FSDP filling
unsharded parameters.

The decision for an op depends only on the op and its position in *this* region invocation (a fresh policy, with
fresh counters, per ``context_fn`` call), so forward and recompute agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy

from nemo_ac.diagnostics.sac_explain import DecisionLog
from nemo_ac.distributed.expert_parallel import deepep_ops as _registers_deepep_ops  # noqa: F401  (nemo_ac::deepep_*)
from nemo_ac.models import mixer_kernels as _registers_mixer_kernel_ops  # noqa: F401  (fla / mamba_ssm)
from nemo_ac.models.kernels import bf16x3_linear as _registers_bf16x3_op  # noqa: F401  (nemo_ac::bf16x3_linear)
from nemo_ac.models.kernels import packed_attention as _registers_packed_attention_op  # noqa: F401
from nemo_ac.models.layers import routing_replay as _registers_select_experts_op  # noqa: F401
from nemo_ac.workarounds import grouped_mm_fake_rule as _registers_grouped_mm_op  # noqa: F401  (torch.ops.nemo_ac)
from nemo_ac.workarounds.partitioner_op_list import compute_intensive_ops


def _packets(*qualified: str) -> frozenset:
    """OpOverloadPackets by ``ns::name``, skipping those this torch build lacks (optional kernels, DeepEP)."""
    found = set()
    for name in qualified:
        namespace, op = name.split("::")
        try:
            found.add(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


_MATMULS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "nemo_ac::grouped_mm",  # the traceable fp32 grouped GEMM (nemo_ac.workarounds.grouped_mm_fake_rule)
    "nemo_ac::bf16x3_linear",  # an fp32 router's GEMM on bf16 tensor cores (models.kernels.bf16x3_linear)
)
_MATMULS_OPTIONAL = ("aten::_scaled_grouped_mm",)
# Where the two matrices sit in each matmul's arguments (addmm / baddbmm take the bias first).
_OPERANDS_AT = {"addmm": 1, "baddbmm": 1}
_ATTENTION = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "nemo_ac::packed_attention",  # the tiled packed-document op: saved whole, the recompute never reruns it
    # The mixer cores' GPU kernels (models.mixer_kernels): saved whole like attention, so the recompute never
    # reruns the fla / mamba-ssm kernels (their backward re-runs the kernel forward once, see common.grads_by_rerun).
    "nemo_ac::fla_gated_delta_rule",
    "nemo_ac::mamba_chunk_scan",
)
_ROUTER = ("aten::topk", "aten::sort", "nemo_ac::select_experts")  # the last: models.layers.routing_replay
_COMMUNICATION = (
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::all_reduce",
    "_c10d_functional_autograd::all_to_all_single",
    "_c10d_functional_autograd::reduce_scatter_tensor",
    "_c10d_functional_autograd::all_gather_into_tensor",
    # DeepEP's dispatch / combine (expert_parallel.deepep_ops; DeepEP itself registers no torch ops).
    "nemo_ac::deepep_dispatch",
    "nemo_ac::deepep_combine",
)
# Never cached: profiler ranges and FSDP2's parameter management (workarounds.fsdp_hooks_in_sac) and eager c10d
# collectives.
_NEVER_CACHED_NAMESPACES = ("profiler", "fsdp", "c10d")


class SelectiveChoices(Protocol):
    """What a selective region saves, as the plan decided it (``plan.SelectiveACPlan``; the recipe's
    ``SelectiveACConfig`` has the same fields, for callers outside a plan such as ``nemo_ac.compat``): the policy
    reads the decision itself, no config is rebuilt from the plan."""

    @property
    def save_every_other_mm(self) -> bool: ...

    @property
    def matmul_min_flops_per_byte(self) -> int: ...

    @property
    def save_communication(self) -> bool: ...

    @property
    def save_router(self) -> bool: ...


@dataclass(frozen=True)
class PolicyRules:
    """What a selective region saves, resolved once per factory (op lookups are not free)."""

    matmuls: frozenset
    compute_intensive: frozenset
    router: frozenset
    communication: frozenset
    save_every_other_mm: bool
    matmul_min_flops_per_byte: int
    save_router: bool
    save_communication: bool

    @classmethod
    def build(cls, config: SelectiveChoices, *, extra_save_ops: Sequence[Any] = ()) -> PolicyRules:
        matmuls = _packets(*_MATMULS, *_MATMULS_OPTIONAL)
        extra = frozenset(getattr(op, "overloadpacket", op) for op in extra_save_ops)
        return cls(
            matmuls=matmuls,
            compute_intensive=(compute_intensive_ops() | _packets(*_ATTENTION) | extra) - matmuls,
            router=_packets(*_ROUTER),
            communication=_packets(*_COMMUNICATION),
            save_every_other_mm=config.save_every_other_mm,
            matmul_min_flops_per_byte=config.matmul_min_flops_per_byte,
            save_router=config.save_router,
            save_communication=config.save_communication,
        )


def matmul_flops_per_byte(func: Any, args: Sequence[Any]) -> float | None:
    """Recompute FLOPs per byte of output of matmul ``func`` called with ``args``: ``2 K / output element size`` for
    a contraction of width ``K``, whatever the other sizes. None when the operands are not tensors or ``K`` is
    symbolic (a dynamic length under ``torch.compile``: comparing it would add a guard, a recompile per length); the
    every-other counter decides those.

    Saving an output of ``M x N`` elements holds ``M N b`` bytes and spares ``2 M N K`` FLOPs of recompute, so the
    ratio is the contraction alone: a projection out of the hidden state (``K`` = hidden) is worth its bytes ``hidden /
    expert width`` times more than an expert's down projection (``K`` = expert width), whose output (``top_k`` rows of
    hidden width per token) is the largest activation of an MoE block. Counting matmuls every other saves whichever
    falls on an odd index: at Qwen3.6's width that saved the experts' down projection and recomputed their gate/up,
    and the MoE block held 18.7 MiB per 512 tokens for 19.3 GFLOP of recompute, where this ratio at 2048 holds 11.1
    MiB for 9.7 (``benchmarks/sac_frontier.py``, docs/sac.md). The ratio is read from the operands' shapes and
    dtypes only (the policy sees no output): forward and recompute decide alike.
    """
    at = _OPERANDS_AT.get(getattr(getattr(func, "overloadpacket", func), "__name__", ""), 0)
    if len(args) < at + 2:
        return None
    a, b = args[at], args[at + 1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2:
        return None
    contraction = a.shape[-1]
    if not isinstance(contraction, int):
        return None
    if a.dim() == 2 and b.dim() == 2 and len(args) > at + 2 and isinstance(args[at + 2], torch.Tensor):
        contraction = contraction / max(1, args[at + 2].numel())  # grouped contraction: E outputs share K
    out_dtype = next((arg for arg in args[at + 2 :] if isinstance(arg, torch.dtype)), None)
    return 2 * contraction / (out_dtype or a.dtype).itemsize


def _is_mutating(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", False))


class SelectivePolicy:
    """The SAC policy of ONE region invocation: ``(ctx, func, *args, **kwargs) -> CheckpointPolicy``.

    A new instance per ``context_fn`` call, so the matmul counter restarts for every block and every micro batch
    (a shared global counter would flip decisions between blocks and between forward and recompute). torch 2.13
    calls the policy only in forward; releases that also call it in recompute get their own counter per pass
    (``ctx.is_recompute``), which gives the same sequence of decisions.
    """

    def __init__(self, *, rules: PolicyRules, region: str = "", log: DecisionLog | None = None) -> None:
        self.rules = rules
        self.region = region
        self.log = log
        self._matmul_count = {False: 0, True: 0}

    def decide(
        self, func: Any, *, is_recompute: bool = False, args: Sequence[Any] = ()
    ) -> tuple[CheckpointPolicy, str]:
        rules = self.rules
        packet = getattr(func, "overloadpacket", func)
        namespace = getattr(func, "namespace", "")
        if namespace in _NEVER_CACHED_NAMESPACES:
            return CheckpointPolicy.PREFER_RECOMPUTE, "profiler/FSDP/eager-collective op: never cached"
        if _is_mutating(func):
            return CheckpointPolicy.PREFER_RECOMPUTE, "mutates an input: a cached replay would skip the mutation"
        if packet in rules.communication:
            if rules.save_communication:
                return CheckpointPolicy.MUST_SAVE, "collective output: recompute must not communicate again"
            return CheckpointPolicy.PREFER_RECOMPUTE, "collective (selective.save_communication=false)"
        if packet in rules.router:
            if rules.save_router:
                return CheckpointPolicy.MUST_SAVE, "router top-k/sort: expert assignment stable in recompute"
            return CheckpointPolicy.PREFER_RECOMPUTE, "router op (selective.save_router=false)"
        if packet in rules.matmuls and rules.save_every_other_mm and rules.matmul_min_flops_per_byte > 0:
            ratio = matmul_flops_per_byte(func, args)
            if ratio is not None:
                threshold = rules.matmul_min_flops_per_byte
                if ratio >= threshold:
                    return CheckpointPolicy.MUST_SAVE, f"matmul: {ratio:.0f} FLOP per byte held >= {threshold}: saved"
                return CheckpointPolicy.PREFER_RECOMPUTE, f"matmul: {ratio:.0f} FLOP per byte held < {threshold}"
        if packet in rules.matmuls:
            self._matmul_count[is_recompute] += 1
            count = self._matmul_count[is_recompute]
            if rules.save_every_other_mm and count % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE, f"matmul #{count} in region: every other one recomputed"
            return CheckpointPolicy.MUST_SAVE, f"matmul #{count} in region: saved"
        if packet in rules.compute_intensive:
            return CheckpointPolicy.MUST_SAVE, "compute-intensive (torch partitioner list / attention)"
        return CheckpointPolicy.PREFER_RECOMPUTE, "cheap to recompute"

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision, reason = self.decide(func, is_recompute=bool(getattr(ctx, "is_recompute", False)), args=args)
        if self.log is not None and self.log.enabled:
            self.log.record(op=str(func), decision=decision.name, reason=reason, region=self.region)
        return decision
