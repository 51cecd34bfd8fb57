"""AdamW's two moments block-wise in fp8 (``train.optimizer_state_dtype: float8``): about 1 byte per moment.

Each moment of a parameter with two or more dims is stored as float8 e4m3 codes the parameter's shape, and one fp32
scale per block of 128 consecutive elements of a row (the last dim, zero padded to a multiple of 128): 1.03 bytes
per moment where bf16 takes 2 and fp32 4, so 2.06 bytes per parameter for both (fp32: 8). A block's scale maps its
largest magnitude to e4m3's largest (448); e4m3's exponent is the non-linear map that keeps small values in a block
of large ones (a relative step of 2^-3 from 448 down to 2^-6, 2^-9 absolute below).

``exp_avg_sq`` is stored as its square root. AdamW divides by ``sqrt(exp_avg_sq)``, so the root's relative error is
the update's; and the root spans half the binades of the square (gradients whose squares differ by 10^10 fit one
block's range where the squares would flush to zero, leaving ``exp_avg / eps`` for an update).

Every write rounds stochastically (to one of the two e4m3 neighbours, up with probability equal to the distance from
the lower one): e4m3 keeps 3 mantissa bits, and ``exp_avg_sq`` moves by ``1 - beta2`` = 0.1% of itself per step,
far below half a step (6%), so round-to-nearest would never let it decay. The noise is the bf16 rounding's hash
(``adamw_bf16_update.rounding_noise``), keyed by (seed, parameter, step): a resumed run rounds as the uninterrupted
one did and DCP resume is bitwise.

Why blocks within rows: FSDP2 shards a parameter on dim 0 (experts on dim 1), never on the last, so every shard
holds whole rows and whole blocks. Codes and scales are DTensors with the parameter's placements, so DCP saves them
with their global shapes and loads them into any other sharding, as it does torch's moments. torchao's
``AdamWFp8`` / ``AdamW8bit`` (the well-kept implementation) block the flattened local shard instead (a block
crosses rows, its scales belong to one sharding) and decide per rank whether a shard is quantized; written here is
the layout, the rounding and the update, each in plain torch ops.

Parameters with one dim (norms, biases: well under 0.1% of a model) keep fp32 moments, as does a parameter sharded on
its last dim.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nemo_ac.models.kernels.op_flops import register_op_flops, zero_flops
from nemo_ac.trainer.adamw_bf16_update import rounding_noise, stochastic_round_to_bf16

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_FP8_MAX_BITS = 0x7E  # 448; 0x7F is NaN in e4m3fn
BLOCK = 128
_NOISE_SCALE = 1.0 / (1 << 16)

# State keys of a quantized parameter: codes (e4m3, the parameter's shape) and scales (fp32, a block per 128 of a row).
EXP_AVG, EXP_AVG_SCALE = "exp_avg_fp8", "exp_avg_scale"
EXP_AVG_SQ_ROOT, EXP_AVG_SQ_ROOT_SCALE = "exp_avg_sq_root_fp8", "exp_avg_sq_root_scale"
QUANTIZED_STATES = (EXP_AVG, EXP_AVG_SCALE, EXP_AVG_SQ_ROOT, EXP_AVG_SQ_ROOT_SCALE)


def blocks_per_row(width: int) -> int:
    return (width + BLOCK - 1) // BLOCK


def quantizable(param: torch.Tensor) -> bool:
    """Two or more dims, and (a DTensor) not sharded on the last: every shard then holds whole blocks."""
    if param.ndim < 2:
        return False
    if isinstance(param, DTensor):
        return not any(placement.is_shard(param.ndim - 1) for placement in param.placements)
    return True


def new_states(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero codes and scales for ``param`` (a DTensor gets DTensors with its mesh and placements)."""
    scale_shape = (*param.shape[:-1], blocks_per_row(param.shape[-1]))
    states = {}
    for codes, scales in ((EXP_AVG, EXP_AVG_SCALE), (EXP_AVG_SQ_ROOT, EXP_AVG_SQ_ROOT_SCALE)):
        states[codes] = torch.zeros_like(param, dtype=FP8, memory_format=torch.contiguous_format)
        if isinstance(param, DTensor):
            local = param.to_local()
            local_scales = torch.zeros((*local.shape[:-1], scale_shape[-1]), dtype=torch.float32, device=local.device)
            states[scales] = DTensor.from_local(
                local_scales, param.device_mesh, param.placements, run_check=False, shape=torch.Size(scale_shape),
                stride=torch.empty(scale_shape, device="meta").stride(),
            )  # fmt: skip
        else:
            states[scales] = torch.zeros(scale_shape, dtype=torch.float32, device=param.device)
    return states


def _block_index(numel: int, width: int, device: torch.device) -> torch.Tensor:
    """[numel]: each element's block among the flat [rows * blocks] scales. Flat indices, not a [rows, blocks, 128]
    view of padded rows: a view whose dims can be 1 compiles one graph for rows of one block and another for longer
    ones."""
    index = torch.arange(numel, device=device)
    return (index // width) * blocks_per_row(width) + (index % width) // BLOCK


def _block_absmax(values: torch.Tensor, blocks: torch.Tensor, width: int) -> torch.Tensor:
    """[rows * blocks]: each block's largest magnitude."""
    count = values.numel() // width * blocks_per_row(width)
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, blocks, values.abs(), reduce="amax")


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, width: int, *, blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values, ``codes``' shape flattened to one dim (``blocks``: ``_block_index`` of it, where known)."""
    if blocks is None:
        blocks = _block_index(codes.numel(), width, codes.device)
    return codes.float().reshape(-1) * scales.reshape(-1)[blocks]


def _decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.uint8).view(FP8).float()


def stochastic_round_to_fp8(value: torch.Tensor, *, key: int | torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` (within +-448) rounded to e4m3, to one of the two neighbours of its magnitude, up with
    probability (distance to the lower) / (distance between them): unbiased. The neighbours are adjacent bit
    patterns (e4m3's magnitudes are ordered as their bits)."""
    magnitude = value.abs().clamp(max=FP8_MAX)
    nearest = magnitude.to(FP8)
    lower_bits = nearest.view(torch.uint8).to(torch.int32) - (nearest.float() > magnitude).to(torch.int32)
    upper_bits = (lower_bits + 1).clamp(max=_FP8_MAX_BITS)
    lower, upper = _decode(lower_bits), _decode(upper_bits)
    gap = upper - lower
    up = torch.where(gap > 0, (magnitude - lower) / torch.where(gap > 0, gap, 1.0), 0.0)
    uniform = (rounding_noise(value.numel(), key, device=value.device).view(value.shape) + 0.5) * _NOISE_SCALE
    bits = torch.where(uniform < up, upper_bits, lower_bits) | ((value < 0).to(torch.int32) << 7)
    return bits.to(torch.uint8).view(FP8)


def quantize_into(
    value: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    width: int,
    key: int | torch.Tensor,
    blocks: torch.Tensor | None = None,
) -> None:
    """Writes fp32 ``value`` (flat) into ``codes`` and ``scales``: each block's largest magnitude maps to 448."""
    if blocks is None:
        blocks = _block_index(value.numel(), width, value.device)
    scale = _block_absmax(value, blocks, width) / FP8_MAX
    per_element = scale[blocks]
    scaled = value / torch.where(per_element > 0, per_element, 1.0)
    codes.view(-1).copy_(stochastic_round_to_fp8(scaled, key=key).reshape(-1))
    scales.view(-1).copy_(scale)


def adamw_fp8_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_root: torch.Tensor,
    exp_avg_sq_root_scale: torch.Tensor,
    scalars: torch.Tensor,
    key: torch.Tensor,
    width: int,
) -> None:
    """torch's AdamW update of one parameter in fp32 (``adamw_bf16_update.adamw_update``'s arithmetic and
    ``scalars``), the moments read from and written back to their codes and scales, the parameter written back in
    its dtype (bf16: stochastically rounded). Contiguous tensors; ``width``: the parameter's last dim."""
    decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size = scalars.unbind()
    value = param.reshape(-1).float() * decay
    g = grad.reshape(-1).float()
    blocks = _block_index(g.numel(), width, g.device)  # once: eagerly, each is an int64 tensor the parameter's size
    first = dequantize(exp_avg, exp_avg_scale, width, blocks=blocks)
    first = first + (g - first) * one_minus_beta1
    root = dequantize(exp_avg_sq_root, exp_avg_sq_root_scale, width, blocks=blocks)
    root = (root * root * beta2 + g * g * one_minus_beta2).sqrt()
    value = value + step_size * first / (root / bias_correction2_sqrt + eps)
    quantize_into(first, exp_avg, exp_avg_scale, width=width, key=key, blocks=blocks)
    quantize_into(root, exp_avg_sq_root, exp_avg_sq_root_scale, width=width, key=key ^ (1 << 29), blocks=blocks)
    if param.dtype == torch.bfloat16:
        param.view(-1).copy_(stochastic_round_to_bf16(value, key=key ^ (2 << 29)))
    else:
        param.view(-1).copy_(value)


@functools.cache
def _compiled_update():
    return torch.compile(adamw_fp8_update, dynamic=True, fullgraph=True)


@torch.library.custom_op(
    "nemo_ac::adamw_fp8_states_update_",
    mutates_args=("param", "exp_avg", "exp_avg_scale", "exp_avg_sq_root", "exp_avg_sq_root_scale"),
)
def fused_adamw_fp8_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_root: torch.Tensor,
    exp_avg_sq_root_scale: torch.Tensor,
    scalars: torch.Tensor,
    key: torch.Tensor,
    width: int,
) -> None:
    """``adamw_fp8_update`` compiled (one-dimensional contiguous tensors of any length and any ``width``: one graph).
    The dry run sees one op that reads the parameter, its gradient and the four state tensors and writes all but the
    gradient back: the fused kernel's traffic."""
    with torch.no_grad():
        _compiled_update()(
            param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root, exp_avg_sq_root_scale, scalars, key, width
        )


@fused_adamw_fp8_update_.register_fake
def _(param, grad, exp_avg, exp_avg_scale, exp_avg_sq_root, exp_avg_sq_root_scale, scalars, key, width) -> None:
    return None


register_op_flops(torch.ops.nemo_ac.adamw_fp8_states_update_, zero_flops)


def moments_in_fp32(states: dict[str, Any], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) of one parameter's quantized states as fp32 local tensors of the codes' shape: what
    torch's AdamW would hold (tests and diagnostics compare against it)."""
    local = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in states.items()}
    shape = local[EXP_AVG].shape
    first = dequantize(local[EXP_AVG], local[EXP_AVG_SCALE], width).view(shape)
    root = dequantize(local[EXP_AVG_SQ_ROOT], local[EXP_AVG_SQ_ROOT_SCALE], width).view(shape)
    return first, root * root
