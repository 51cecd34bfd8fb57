"""AdamW for bf16 storage: bf16 moments (``train.optimizer_state_dtype: bfloat16``) and bf16 parameters
(``train.master_dtype: bfloat16``), each written back with stochastic rounding.

AdamW's ``exp_avg`` and ``exp_avg_sq`` are 8 bytes per trainable parameter in fp32, the largest single term of every
flagship's peak (32.3 GiB of Qwen3.6-35B-A3B's on 8 ranks). Stored in bf16 they are 4 bytes; bf16 parameters (the
masters FSDP shards, and so their gradients) take another 4 of the 8 bytes fp32 masters and gradients hold: NeMo
Automodel's benchmarks train with bf16 parameters and states, 8 bytes per parameter in all. Each update still
computes in fp32 (the moments, the parameter and its gradient read into fp32); only the write back rounds, and it
rounds stochastically: up with probability equal to the distance to the lower bf16 neighbour, so the stored value
is the fp32 one in expectation. Round-to-nearest would drop every change smaller than half a bf16 step, 2^-9 of the
value: ``exp_avg_sq`` gains ``(1 - beta2) g^2`` per step, and a weight moves by about ``lr`` per step; at a
fine-tuning learning rate (1e-5) against weights of 0.02 that is 2^-11 of the weight, below half a step, so plain
AdamW on bf16 weights would leave them where they are, every step (tests/unit/trainer/test_adamw_bf16.py).

Why not torchao: its ``AdamW(bf16_stochastic_round=True)`` rounds bf16 *parameters* but keeps the states in the
parameter's dtype with no fp32-master / bf16-moment combination, and its low-bit optimizers (``AdamW8bit``,
``AdamWFp8``) quantize block-wise and compile each parameter's update with ``torch.compile``. What is written by hand
here is only the rounding (the bit trick torchao uses too) and AdamW's update, line for line torch's single-tensor
AdamW: with fp32 moments and fp32 parameters the class is bitwise ``torch.optim.AdamW(foreach=False)``.

The rounding noise is drawn from a generator seeded by (``seed``, the parameter's index, its step): the moments'
noise first, then the parameter's, so a resumed run draws the same noise as an uninterrupted one and DCP resume is
bitwise, with nothing beyond AdamW's own state saved. The state keys, shapes and placements are torch's AdamW's (a
DTensor parameter gets DTensor moments), so DCP saves and loads them as it does torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")
_LOW_BITS = 1 << 16  # the fp32 mantissa bits bf16 drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as int32


def stochastic_round_to_bf16(value: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``value`` rounded to bf16, up or down with probability by distance (unbiased): a uniform 16-bit integer
    is added to the low half of each fp32 bit pattern, which is then cut off (exact in bf16). Adding to the bit
    pattern moves the magnitude whatever the sign, and a carry into the exponent is the correct rounding."""
    if value.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 takes fp32, got {value.dtype}")
    noise = torch.randint(
        0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator
    )  # fmt: skip
    bits = value.contiguous().view(torch.int32)
    return ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's bias correction; no amsgrad) with ``exp_avg`` / ``exp_avg_sq`` in
    ``state_dtype`` (bf16: stochastically rounded on every write; fp32: exactly torch's AdamW). A bf16 parameter is
    updated in fp32 and written back stochastically rounded; an fp32 one (a router kept in fp32) in place."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"AdamWBF16 keeps its moments in bfloat16 or float32, not {state_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for param in group["params"]:
                index += 1  # the parameter's place in the optimizer: part of its noise seed
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                self._update(param, group, index)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` casts every floating state to its parameter's dtype; the moments are put back
        as they were saved. Else fp32 moments of a bf16 parameter would come back rounded to bf16 (the resumed run
        no longer the uninterrupted one), and bf16 moments of an fp32 parameter would stay fp32 from then on, twice
        the memory, silently."""
        saved = {
            key: {name: state[name] for name in MOMENTS if name in state} for key, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for key, param in zip(saved_keys, params, strict=True):
            for name, value in saved.get(key, {}).items():
                self.state[param][name] = value.to(device=param.device, dtype=self.state_dtype, copy=True)

    def _update(self, param: torch.Tensor, group: dict[str, Any], index: int) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # as torch's non-fused AdamW
            for name in MOMENTS:
                state[name] = torch.zeros_like(param, dtype=self.state_dtype, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"].item())
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        stored, grad = _local(param), _local(param.grad)
        if stored.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"AdamWBF16 updates fp32 or bf16 parameters, got {stored.dtype}")
        exp_avg, exp_avg_sq = (_local(state[name]) for name in MOMENTS)
        # torch's single-tensor AdamW, line for line, on fp32 copies of whatever is stored in bf16.
        value = stored.float() if stored.dtype != torch.float32 else stored
        grad = grad.float() if grad.dtype != torch.float32 else grad
        first = exp_avg.float() if self.state_dtype != torch.float32 else exp_avg
        second = exp_avg_sq.float() if self.state_dtype != torch.float32 else exp_avg_sq
        value.mul_(1 - lr * weight_decay)
        first.lerp_(grad, 1 - beta1)
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (second.sqrt() / bias_correction2**0.5).add_(eps)
        value.addcdiv_(first, denom, value=-(lr / bias_correction1))
        if self.state_dtype == torch.float32 and stored.dtype == torch.float32:
            return
        generator = torch.Generator(device=value.device)
        generator.manual_seed((self.seed * 1_000_003 + index) * 1_000_033 + step)
        if self.state_dtype != torch.float32:
            exp_avg.copy_(stochastic_round_to_bf16(first, generator=generator))
            exp_avg_sq.copy_(stochastic_round_to_bf16(second, generator=generator))
        if stored.dtype != torch.float32:
            stored.copy_(stochastic_round_to_bf16(value, generator=generator))
