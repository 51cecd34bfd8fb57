"""The one step that installs the plan's kernels (``ParallelPlan.kernels``), before EP and CP wrap the ops.

Softmax attention gets its local op (sdpa / tiled / flex), Gated DeltaNet and Mamba-2 their core's op (fla /
mamba_ssm, in their graph-breaking form in blocks whose compiled graphs selective AC recomputes whole), and the
``backend.*: te`` keys swap Transformer Engine modules in. The experts impl is not installed here: the model was
built with it (``build_model(..., experts_impl=)``). What was installed is read from the plan, never from the modules.
"""

from __future__ import annotations

from torch import nn

from nemo_ac.distributed.blocks import decoder_layers
from nemo_ac.distributed.plan import ParallelPlan
from nemo_ac.models.layers.attention import set_attention_kernel
from nemo_ac.models.mixer_kernels import set_mixer_kernels
from nemo_ac.models.te_backend import apply_te_backends


def apply_kernels(model: nn.Module, *, plan: ParallelPlan) -> None:
    """Install the kernels ``plan.kernels`` names into the decoder blocks, in place."""
    kernels = plan.kernels
    layers = decoder_layers(model)
    set_attention_kernel(layers, kernel=kernels.attention.value)
    for block, block_plan in zip(layers, plan.decoder_blocks(), strict=True):
        set_mixer_kernels(
            block,
            linear_attention=kernels.linear_attention.value,
            mamba=kernels.mamba.value,
            between_compiled_graphs=block_plan.ops_between_graphs,
        )
    apply_te_backends(
        layers, linear=kernels.linear.value, rms_norm=kernels.rms_norm.value, attention=kernels.attention.value
    )
