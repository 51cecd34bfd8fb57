"""Model FLOPs per token and the device's peak, for the model-FLOPs utilisation (MFU) of every metrics record.

Model FLOPs (what the model must compute, not what this run executes: recompute under activation checkpointing is
not counted, as in PaLM's and torchtitan's MFU) per trained token::

    6 * N_active + 12 * L_attn * H * d_head * S

N_active: the decoder's parameters a token passes through (the input embedding is a lookup and is left out; routed
experts count ``num_experts_per_tok / num_experts`` of their weights; the vision tower is left out: it runs on image
patches, not on every token). The second term is softmax attention's score and value products, forward and
backward, over full rows (PaLM appendix B; torchtitan's ``get_num_flop_per_token``): packed documents and the
causal mask make the real work smaller, so the term is an upper bound that keeps MFU comparable with those trainers.
Linear-attention and Mamba mixers count through their parameters only.

S is the row length the data produces (``attention_row_length``): ``data.max_length`` for MedPix rows,
``data.seq_len`` for text and fixed-length synthetic rows, and for synthetic rows of varying length the
token-weighted mean over the lengths a step draws from. Reading ``data.seq_len`` for every kind counted the Qwen3.6
MedPix flagship's attention at S=64 (the unused default) instead of its 4096-token rows.

Peak: dense (no sparsity) tensor throughput from NVIDIA's datasheets, keyed by ``torch.cuda.get_device_name()``;
an unknown GPU has no MFU (the run says so once). On CPU there is no datasheet number: ``measure_cpu_peak`` times a
square matmul in the run's compute dtype at start-up, on every rank at once (ranks share the cores, as they do in
training), and the records say ``mfu_peak: measured``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from nemo_ac.config.schema import DataConfig, RecipeConfig
from nemo_ac.data.loader import length_choices

TERA = 1e12

# Dense TFLOP/s per GPU: (bf16/fp16 tensor, tf32 tensor, fp32 non-tensor). Sources: the NVIDIA datasheets
# (H100: "NVIDIA H100 Tensor Core GPU" datasheet, SXM / NVL / PCIe columns, sparsity figures halved; H200: "NVIDIA
# H200 Tensor Core GPU" datasheet, SXM / NVL; A100: "NVIDIA A100 Tensor Core GPU" datasheet; B200 / GB200: the HGX
# B200 and GB200 NVL72 datasheets divided by 8 / 72 GPUs, sparsity halved; L40S, L4, A10: their product datasheets).
# A key matches as a whole word of the name ("L4" not in "L40S", "A10" not in "A10G", "H200" not in "GH200"); the
# first match wins, so more specific names come first ("H100 NVL" before "H100").
GPU_PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("GB200", (2500.0, 1250.0, 80.0)),
    ("B200", (2250.0, 1125.0, 75.0)),
    ("H200 NVL", (835.0, 417.5, 60.0)),
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100 PCIe", (756.5, 378.0, 51.2)),
    ("GH200", (989.4, 494.7, 66.9)),  # the Grace Hopper superchip's GPU: H100 SXM's tensor throughput
    ("H100", (989.4, 494.7, 66.9)),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.05, 183.0, 91.6)),
    ("L40", (181.05, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10", (125.0, 62.5, 31.2)),
)


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one device (one rank)
    source: str  # "datasheet <GPU entry> <dtype>" or "measured <dtype> matmul"


def gpu_peak(device_name: str, dtype: torch.dtype, *, allow_tf32: bool = False) -> Peak | None:
    """The datasheet peak of ``device_name`` for ``dtype`` (None: not in ``GPU_PEAK_TFLOPS``)."""
    for key, (half, tf32, fp32) in GPU_PEAK_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            if dtype in (torch.bfloat16, torch.float16):
                return Peak(half * TERA, f"datasheet {key} {str(dtype).removeprefix('torch.')}")
            if allow_tf32:
                return Peak(tf32 * TERA, f"datasheet {key} tf32")
            return Peak(fp32 * TERA, f"datasheet {key} fp32")
    return None


def measure_cpu_peak(dtype: torch.dtype, *, size: int = 512, seconds: float = 0.3) -> Peak:
    """This process's matmul throughput on CPU: ``size`` x ``size`` products in ``dtype`` for about ``seconds``."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up (allocations, kernel choice)
    count, started = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
    return Peak(2 * size**3 * count / elapsed, f"measured {str(dtype).removeprefix('torch.')} matmul {size}^3")


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[Peak | None, str]:
    """The peak MFU divides by on ``device`` and, when there is none, why (one line for the run's start)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, dtype, allow_tf32=torch.backends.cuda.matmul.allow_tf32)
        if peak is None:
            return None, f"mfu: no datasheet peak for {name!r} (add it to nemo_ac/trainer/flops.py GPU_PEAK_TFLOPS)"
        return peak, ""
    if device.type == "cpu":
        return measure_cpu_peak(dtype), ""
    return None, f"mfu: no peak for device type {device.type!r}"


def _attention_layers(model: nn.Module) -> int:
    from nemo_ac.models.interfaces import SequenceMixer

    return sum(
        1
        for module in model.modules()
        if isinstance(module, SequenceMixer) and getattr(module, "mixer_kind", "") == "softmax_attention"
    )


def attention_row_length(data: DataConfig) -> float:
    """The S of the attention term: the tokens per row ``data`` packs, averaged over tokens where rows vary.

    A row of S tokens costs each of its tokens attention over S positions, so over rows of several lengths a
    token's mean is ``sum(S^2) / sum(S)`` (the synthetic source draws each step's length uniformly from
    ``length_choices``). A ``data.source`` of your own is counted at ``data.seq_len``.
    """
    if data.source is None and data.kind == "medpix":
        return float(data.max_length)
    if data.source is None and data.kind == "synthetic" and not data.fixed_length:
        lengths = length_choices(data.seq_len, data.pad_multiple)
        return sum(length * length for length in lengths) / sum(lengths)
    return float(data.seq_len)


def model_flops_per_token(model: nn.Module, recipe: RecipeConfig) -> float:
    """``6 * N_active + 12 * L_attn * H * d_head * S`` for ``model`` (any device, meta included: only shapes are read;
    call it before parallelization, which shards the experts over EP)."""
    from nemo_ac.models.interfaces import DecoderBlock, ParallelizableModel

    moe = recipe.model.moe
    skip: set[int] = set()
    expert_params: set[int] = set()
    if isinstance(model, ParallelizableModel):
        vision = model.vision_blocks()
        if vision is not None:
            skip.update(id(p) for p in vision.parameters())
        for block in model.decoder_blocks():
            routed = block.routed_moe() if isinstance(block, DecoderBlock) else None
            if routed is not None:
                expert_params.update(id(p) for p in routed.experts_module().parameters())
    embed = getattr(model, "get_input_embeddings", None)
    embedding = embed() if callable(embed) else None
    tied = recipe.model.tie_word_embeddings
    if isinstance(embedding, nn.Module) and not tied:  # a tied table is also lm_head's matmul: keep it
        skip.update(id(p) for p in embedding.parameters())
    active = 0.0
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in skip or (embedding is None and "embed_tokens" in name and not tied):
            continue
        share = moe.num_experts_per_tok / max(moe.num_experts, 1) if id(param) in expert_params else 1.0
        active += param.numel() * share
    cfg = recipe.model
    rows = attention_row_length(recipe.data)
    attention = 12 * _attention_layers(model) * cfg.num_attention_heads * cfg.head_dim * rows
    return 6 * active + attention
