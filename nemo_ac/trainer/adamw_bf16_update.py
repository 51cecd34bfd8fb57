"""One AdamW update of a parameter stored in bf16 (or with bf16 moments), as one kernel where CUDA runs it.

``trainer/adamw_low_precision.py``'s eager update makes about twenty passes over memory per parameter (fp32 copies of
the parameter and both moments, the update, the rounding's noise and bit operations, the copies back): 0.20 s of
Qwen3.6-35B-A3B's step on 8 H100s, and on the host (``train.optimizer_offload: full``) the step's largest term. Here
the same arithmetic is one function of the stored tensors, which ``torch.compile`` (inductor) turns into a single
fused kernel: it reads the parameter, its gradient and both moments once, computes in fp32 in registers and writes
the parameter and moments back, rounded; no temporary the size of a parameter.

The rounding noise is a counter-based hash of (the update's key, the element's index), not a ``torch.Generator``
draw: a generator cannot be traced into a kernel, and a hash is the same numbers in eager, in inductor's C++ and in
Triton, on any device. The key mixes (seed, parameter index, step), so a resumed run draws what the uninterrupted
one drew and DCP resume stays bitwise.

The compiled update runs behind a custom op, ``nemo_ac::adamw_bf16_update_``: torch's counters and the dry run
see one op per parameter that reads four tensors and writes three (its fake impl allocates nothing), which is the
fused kernel's traffic; the eager update stays visible op by op.
"""

from __future__ import annotations

import functools

import torch

from nemo_ac.models.kernels.op_flops import register_op_flops, zero_flops

_LOW_BITS = 1 << 16  # the fp32 mantissa bits bf16 drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as int32
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit integer hash's multiplier (28 bits: the products fit int64 without overflow)


def update_key(seed: int, index: int, step: int) -> int:
    """A 32-bit key for one parameter's update at one step: splitmix64 of (seed, index, step), so neighbouring
    steps or parameters get unrelated noise."""
    z = ((seed * 1_000_003 + index) * 1_000_033 + step) & 0xFFFFFFFFFFFFFFFF
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK32


def rounding_noise(numel: int, key: int | torch.Tensor, *, device: torch.device) -> torch.Tensor:
    """``numel`` uniform 16-bit integers (int32) for the elements 0..numel-1 under ``key``: a 32-bit integer hash of
    (index XOR key), in int64 arithmetic whose products stay below 2^60 (the same bits in eager, C++ and Triton)."""
    x = (torch.arange(numel, device=device, dtype=torch.int64) ^ key) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (x >> 16) ^ x
    return (x & (_LOW_BITS - 1)).to(torch.int32)


def stochastic_round_to_bf16(value: torch.Tensor, *, key: int | torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` rounded to bf16, up or down with probability by distance (unbiased): a uniform 16-bit integer
    is added to the low half of each fp32 bit pattern, which is then cut off (exact in bf16). Adding to the bit
    pattern moves the magnitude whatever the sign, and a carry into the exponent is the correct rounding."""
    if value.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 takes fp32, got {value.dtype}")
    noise = rounding_noise(value.numel(), key, device=value.device).view(value.shape)
    bits = value.contiguous().view(torch.int32)
    return ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    key: torch.Tensor,
) -> None:
    """torch's AdamW update of one parameter, in fp32, each stored tensor written back in its own dtype (bf16:
    stochastically rounded under ``key``, the moments' noise keyed apart from the parameter's). ``scalars``: fp32
    [decay, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, -lr / bias correction 1]. Tensors, not
    Python floats, so one compiled kernel serves every step of a schedule."""
    decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size = scalars.unbind()
    value = param.float() * decay
    g = grad.float()
    first = exp_avg.float()
    first = first + (g - first) * one_minus_beta1
    second = exp_avg_sq.float() * beta2 + g * g * one_minus_beta2
    value = value + step_size * first / (second.sqrt() / bias_correction2_sqrt + eps)
    for index, (stored, new) in enumerate(((exp_avg, first), (exp_avg_sq, second), (param, value))):
        if stored.dtype == torch.bfloat16:
            stored.copy_(stochastic_round_to_bf16(new, key=key ^ (index << 29)))
        else:
            stored.copy_(new)


@functools.cache
def _compiled_update():
    return torch.compile(adamw_update, dynamic=True, fullgraph=True)


@torch.library.custom_op("nemo_ac::adamw_bf16_update_", mutates_args=("param", "exp_avg", "exp_avg_sq"))
def fused_adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    key: torch.Tensor,
) -> None:
    """``adamw_update`` compiled into one kernel (one-dimensional contiguous tensors of any length: one graph)."""
    with torch.no_grad():
        _compiled_update()(param, grad, exp_avg, exp_avg_sq, scalars, key)


@fused_adamw_update_.register_fake
def _(param, grad, exp_avg, exp_avg_sq, scalars, key) -> None:
    return None


# An elementwise update: no FLOPs in torch's counting (FlopCounterMode counts matmul-like ops), but a formula, so
# the op is not reported as one whose work a count would miss.
register_op_flops(torch.ops.nemo_ac.adamw_bf16_update_, zero_flops)
