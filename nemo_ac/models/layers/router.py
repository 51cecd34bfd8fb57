"""Top-k expert router (module name ``gate`` inside an MoE layer, parameter ``weight`` [E, H]).

One router covers Qwen3-MoE (softmax, optional top-k renormalization) and GLM-4.5 / DeepSeek-V3 (sigmoid scores,
``e_score_correction_bias`` used for selection only, grouped top-k, ``routed_scaling_factor``). Scores are always
computed in fp32: with ``router_dtype="float32"`` both the input and the weight are cast to fp32 before the
projection (so an fp32 router works inside a bf16 model), or, with ``fp32_gemm="bf16x3"`` and bf16 hidden states,
the fp32 weight is split into three bf16 pieces for tensor-core GEMMs with the same result
(``kernels.bf16x3_linear``); with ``"param"`` the projection runs in the parameter dtype, as transformers does, and
only the scores are fp32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from nemo_ac.config.schema import MoEConfig
from nemo_ac.models.kernels import bf16x3_linear as _registers_bf16x3_linear  # noqa: F401  (nemo_ac::bf16x3_linear)
from nemo_ac.models.layers.routing_replay import select_experts


class _Float32Linear(torch.autograd.Function):
    """``F.linear(x.float(), weight.float())`` that keeps ``x`` in its own dtype for backward.

    Written with autograd's ops, the linear saved the fp32 copy of a bf16 input: 2x the hidden states' bytes held
    until backward (8 MiB on Qwen3.6's MoE FFN row at 1024 tokens), where a bf16 router keeps nothing extra (its
    input is the layer norm's output, saved anyway). The backward casts inside and computes what autograd computed.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(torch.float32), weight.to(torch.float32))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ weight.to(torch.float32)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            flat = x.reshape(-1, x.shape[-1]).to(torch.float32)
            grad_w = (grad_out.reshape(-1, grad_out.shape[-1]).t() @ flat).to(weight.dtype)
        return grad_x, grad_w


def balanced_expert_ids(
    tokens: int, *, top_k: int, num_experts: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[tokens, top_k] expert ids round robin: token t, slot j -> expert (t * top_k + j) mod num_experts. Expert e
    gets ``P // E + (e < P % E)`` of the ``P = tokens * top_k`` rows (``nemo_ac.simulate.routing`` counts the same)."""
    slots = torch.arange(tokens * top_k, dtype=torch.int64, device=device)
    return (slots % num_experts).view(tokens, top_k)


class TopKRouter(nn.Module):
    """Returns ``(top_scores [T, k] fp32, top_idx [T, k] int64, probs [T, E] fp32)``.

    ``probs`` feeds the load-balancing statistics: the softmax for softmax routing, the sigmoid scores normalized
    to sum to one per token for sigmoid routing (so ``E * sum(f_i * P_i)`` keeps its meaning).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        score_correction_bias: bool = False,
        router_dtype: Literal["float32", "param"] = "param",
        fp32_gemm: Literal["auto", "float32", "bf16x3"] = "float32",
        force_balanced: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if n_group < 1 or num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"invalid grouping: num_experts={num_experts}, n_group={n_group}, topk_group={topk_group}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.router_dtype = router_dtype
        # auto (a model built without a plan, e.g. for export) computes as float32; the plan resolves auto.
        self.fp32_gemm = fp32_gemm
        self.force_balanced = force_balanced
        # The parallelizer reads this to keep the weight fp32 (own FSDP unit with fp32 param dtype).
        self.keep_fp32 = router_dtype == "float32"
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if score_correction_bias:
            # Persistent fp32 buffer (in the checkpoint, as in transformers' GLM); updated by the trainer.
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    @classmethod
    def from_config(cls, hidden_size: int, moe: MoEConfig) -> TopKRouter:
        return cls(
            hidden_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            score_func=moe.score_func,
            norm_topk_prob=moe.norm_topk_prob,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            routed_scaling_factor=moe.routed_scaling_factor,
            score_correction_bias=moe.score_correction_bias,
            router_dtype=moe.router_dtype,
            fp32_gemm=moe.router_gemm,
            force_balanced=moe.force_balanced_routing,
        )

    def initial_buffer(self, name: str) -> torch.Tensor:
        if name != "e_score_correction_bias":
            raise KeyError(name)
        return torch.zeros(self.num_experts, dtype=torch.float32)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in fp32."""
        if self.router_dtype == "float32":
            if self.fp32_gemm == "bf16x3" and x.dtype == torch.bfloat16:
                return torch.ops.nemo_ac.bf16x3_linear(x, self.weight)
            if torch.compiler.is_compiling():  # the partitioner decides what is saved; no AOTAutograd cache bypass
                return F.linear(x.to(torch.float32), self.weight.to(torch.float32))
            return _Float32Linear.apply(x, self.weight)
        return F.linear(x, self.weight.to(x.dtype)).to(torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.logits(x.reshape(-1, self.hidden_size))
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.force_balanced:  # model.moe.force_balanced_routing: deterministic, nothing to record or replay
            top_idx = balanced_expert_ids(
                scores.shape[0], top_k=self.top_k, num_experts=self.num_experts, device=scores.device
            )
        else:
            # One op (no gradient): recorded in a checkpoint's forward, replayed in its recompute (routing_replay).
            top_idx = select_experts(
                scores,
                self.e_score_correction_bias,
                top_k=self.top_k,
                n_group=self.n_group,
                topk_group=self.topk_group,
            )
        top_scores = scores.gather(1, top_idx)
        if self.norm_topk_prob:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            top_scores = top_scores * self.routed_scaling_factor
        return top_scores, top_idx, probs
