"""Give every sequence mixer the op of its resolved kernel: the fla and mamba-ssm kernels as one custom op each, with
the torch op's signature.

``backend.linear_attention: fla`` -> ``kernels.fla_gdn.fla_linear_attn_op`` (``nemo_ac::fla_gated_delta_rule``);
``backend.mamba: mamba_ssm`` -> ``kernels.mamba_ssm.mamba_ssm_op`` (``nemo_ac::mamba_chunk_scan``). The plan resolves
the keys (``nemo_ac.distributed.plan.kernels.resolve_mixer_kernel``) and ``set_mixer_kernels`` gives every mixer its op
before context parallel wraps it, as ``set_attention_kernel`` does for softmax attention. Importing this module
registers the ops and imports neither fla nor mamba-ssm (their imports live in the ops' CUDA bodies). It sits above
``layers/`` and ``kernels/`` because it joins the two.
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_ac.models.kernels.fla_gdn import fla_linear_attn_op
from nemo_ac.models.kernels.mamba_ssm import mamba_ssm_op
from nemo_ac.models.layers.gated_deltanet import GatedDeltaNet
from nemo_ac.models.layers.mamba2 import Mamba2Mixer

__all__ = ["KERNEL_OPS", "fla_linear_attn_op", "mamba_ssm_op", "set_mixer_kernels"]

# backend value -> (the mixer class it applies to, the op it installs); "torch" keeps the mixer's own default op.
KERNEL_OPS = {
    "fla": (GatedDeltaNet, fla_linear_attn_op),
    "mamba_ssm": (Mamba2Mixer, mamba_ssm_op),
}
# The same ops called outside compiled code (a graph break each), for blocks compiled inside their checkpoint
# (AC(compile(block)), compile.layout ac_outer): selective AC recomputes such a block's compiled graphs whole
# (workarounds.compiled_regions_under_sac), so an op traced into one would rerun its kernels in every recompute;
# between graphs the SAC modes see the op and save it. Elsewhere the op is traced as one node.
_BETWEEN_GRAPHS = {kernel: torch.compiler.disable(op) for kernel, (_, op) in KERNEL_OPS.items()}


def set_mixer_kernels(
    layers: nn.Module, *, linear_attention: str = "torch", mamba: str = "torch", between_compiled_graphs: bool = False
) -> int:
    """Give every Gated DeltaNet / Mamba-2 mixer in ``layers`` the op of its resolved kernel; returns how many were
    set. Runs before context parallel wraps the op (the kernel is then Ulysses' inner op on the head shard).
    ``between_compiled_graphs``: install the op's graph-breaking form (see ``_BETWEEN_GRAPHS``)."""
    count = 0
    for choice in (linear_attention, mamba):
        if choice not in KERNEL_OPS:
            continue
        mixer_class, op = KERNEL_OPS[choice]
        op = _BETWEEN_GRAPHS[choice] if between_compiled_graphs else op
        for module in layers.modules():
            if isinstance(module, mixer_class):
                setattr(module, module.mixer_op_name, op)
                count += 1
    return count
