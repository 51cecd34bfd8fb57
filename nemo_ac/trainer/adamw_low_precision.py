"""AdamW for low-precision storage: bf16 or block-wise fp8 moments (``train.optimizer_state_dtype: bfloat16 |
float8``) and bf16 parameters (``train.master_dtype: bfloat16``), each written back with stochastic rounding.

AdamW's ``exp_avg`` and ``exp_avg_sq`` are 8 bytes per trainable parameter in fp32, the largest single term of every
flagship's peak (32.3 GiB of Qwen3.6-35B-A3B's on 8 ranks). Stored in bf16 they are 4 bytes, block-wise in fp8 2.06
(``adamw_fp8_states``); bf16 parameters (the masters FSDP shards, and so their gradients) take another 4 of the 8
bytes fp32 masters and gradients hold: NeMo Automodel's benchmarks train with bf16 parameters and states, 8 bytes
per parameter in all. Each update still computes in fp32 (the moments, the parameter and its gradient read into
fp32); only the write back rounds, and it rounds stochastically: up with probability equal to the distance to the
lower neighbour, so the stored value is the fp32 one in expectation. Round-to-nearest would drop every change smaller
than half a step, 2^-9 of the value in bf16: ``exp_avg_sq`` gains ``(1 - beta2) g^2`` per step, and a weight moves
by about ``lr`` per step; at a fine-tuning learning rate (1e-5) against weights of 0.02 that is 2^-11 of the weight,
below half a step, so plain AdamW on bf16 weights would leave them where they are, every step
(tests/unit/trainer/test_adamw_low_precision.py).

Why not torchao: its ``AdamW(bf16_stochastic_round=True)`` rounds bf16 *parameters* but keeps the states in the
parameter's dtype with no fp32-master / bf16-moment combination, and its low-bit optimizers (``AdamW8bit``,
``AdamWFp8``) quantize the flattened local shard, a layout DCP cannot reshard (``adamw_fp8_states``). What is written
by hand is only the rounding (the bit trick torchao uses too), the fp8 layout and AdamW's update
(``adamw_bf16_update``): with fp32 moments and fp32 parameters the class is bitwise
``torch.optim.AdamW(foreach=False)``, torch's update line for line.

``fused`` (the built-in AdamW on CUDA): each update is one compiled kernel (``adamw_bf16_update``,
``adamw_fp8_states``), where the eager update makes twenty to forty passes over memory. The rounding noise is a hash
of (``seed``, the parameter's index, its step) and the element's index, the same numbers eager or compiled: a resumed
run draws what the uninterrupted one drew, and DCP resume is bitwise with nothing beyond AdamW's own state saved.
bf16 and fp32 moments keep torch's AdamW's keys, shapes and placements (a DTensor parameter gets DTensor moments);
fp8 moments are codes and scales with the parameter's placements. DCP saves and loads either as it does torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nemo_ac.trainer import adamw_fp8_states as fp8
from nemo_ac.trainer.adamw_bf16_update import adamw_update, fused_adamw_update_, update_key

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over a contiguous ``tensor``'s elements that is not a view of it: dynamo guards on a view's base,
    so ``view(-1)`` of a [E, I, H] expert weight and of a [H] norm would compile twice ("tuple index out of range"
    on the base's sizes) where one flat graph serves every parameter."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AdamWLowPrecision(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's bias correction; no amsgrad) with ``exp_avg`` / ``exp_avg_sq`` in
    ``state_dtype``: bf16 (stochastically rounded on every write), ``torch.float8_e4m3fn`` (block-wise codes and
    scales, ``adamw_fp8_states``; one-dim parameters keep fp32 moments) or fp32 (exactly torch's AdamW). A bf16
    parameter is updated in fp32 and written back stochastically rounded; an fp32 one (a router kept in fp32) in
    place."""

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
        fused: bool = False,
    ) -> None:
        if state_dtype not in (torch.bfloat16, torch.float32, fp8.FP8):
            raise ValueError(
                f"AdamWLowPrecision keeps its moments in bfloat16, float8_e4m3fn or float32, not {state_dtype}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.seed = seed
        self.fused = fused

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

    def _quantized(self, param: torch.Tensor) -> bool:
        return self.state_dtype == fp8.FP8 and fp8.quantizable(param)

    def _state_dtypes(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        """The dtype of each state tensor this optimizer keeps for ``param`` (``step`` aside)."""
        if self._quantized(param):
            return {name: torch.float32 if name.endswith("_scale") else fp8.FP8 for name in fp8.QUANTIZED_STATES}
        moments = torch.float32 if self.state_dtype == fp8.FP8 else self.state_dtype
        return dict.fromkeys(MOMENTS, moments)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` casts every floating state to its parameter's dtype; the states are put back
        in their own dtypes. Else fp32 moments of a bf16 parameter would come back rounded to bf16 (the resumed run
        no longer the uninterrupted one), bf16 moments of an fp32 parameter would stay fp32 from then on, twice
        the memory, silently, and fp8 codes would come back as bf16 numbers."""
        saved = {
            key: {name: value for name, value in state.items() if name != "step" and isinstance(value, torch.Tensor)}
            for key, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for key, param in zip(saved_keys, params, strict=True):
            dtypes = self._state_dtypes(param)
            for name, value in saved.get(key, {}).items():
                if name not in dtypes:
                    raise KeyError(
                        f"optimizer state {name!r} is not one AdamWLowPrecision keeps with moments in "
                        f"{self.state_dtype} (it keeps {sorted(dtypes)}): the checkpoint was saved with another "
                        "train.optimizer_state_dtype"
                    )
                self.state[param][name] = value.to(device=param.device, dtype=dtypes[name], copy=True)

    def _update(self, param: torch.Tensor, group: dict[str, Any], index: int) -> None:
        state = self.state[param]
        quantized = self._quantized(param)
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # as torch's non-fused AdamW
            if quantized:
                state.update(fp8.new_states(param))
            else:
                for name, dtype in self._state_dtypes(param).items():
                    state[name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"].item())
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        stored, grad = _local(param), _local(param.grad)
        if stored.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"AdamWLowPrecision updates fp32 or bf16 parameters, got {stored.dtype}")
        if not quantized and stored.dtype == torch.float32 and state["exp_avg"].dtype == torch.float32:
            # torch's single-tensor AdamW, line for line: bitwise torch.optim.AdamW(foreach=False).
            exp_avg, exp_avg_sq = (_local(state[name]) for name in MOMENTS)
            stored.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            stored.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))
            return
        # Something is stored in bf16 or fp8: the update in fp32, written back stochastically rounded.
        correction1, correction2 = 1 - beta1**step, 1 - beta2**step
        scalars = torch.tensor(
            [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, correction2**0.5, eps, -lr / correction1],
            dtype=torch.float32, device=stored.device,
        )  # fmt: skip
        key = torch.tensor(update_key(self.seed, index, step), dtype=torch.int64, device=stored.device)
        names = fp8.QUANTIZED_STATES if quantized else MOMENTS
        tensors = (stored, grad, *(_local(state[name]) for name in names))
        # One kernel where fused; flat, so every parameter shape is the same graph. (FSDP's shards, their gradients
        # and the states made here are contiguous; anything else takes the eager update, the same arithmetic.)
        fused = self.fused and all(t.is_contiguous() for t in tensors)
        if quantized and fused:
            fp8.fused_adamw_fp8_update_(*(_flat_alias(t) for t in tensors), scalars, key, param.shape[-1])
        elif quantized:
            fp8.adamw_fp8_update(*tensors, scalars, key, param.shape[-1])
        elif fused:
            fused_adamw_update_(*(_flat_alias(t) for t in tensors), scalars, key)
        else:
            adamw_update(*tensors, scalars, key)
