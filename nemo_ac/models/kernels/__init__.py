"""The work a layer calls, one custom op or autograd function each, with its FLOP formula: packed-document attention
(tiled, SDPA spans, FlexAttention), the gated delta rule's torch core, the fla and mamba-ssm kernels, grouped expert
GEMMs, token dispatch and combine, and the chunked LM head + cross entropy.

Each op is visible to selective activation checkpointing (a policy can save or recompute it by name) and to
``FlopCounterMode`` (``op_flops`` registers every formula), so ``nemo-ac plan`` counts its work. Kernels import no
layer: ``nemo_ac.models.layers`` picks among them.
"""
