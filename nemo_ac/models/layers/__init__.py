"""The modules a decoder is built of: attention, MoE (router, experts), dense MLP, norms, rotary embeddings, the
Gated DeltaNet and Mamba-2 mixers, the vision tower, the decoder layer and the causal LM around them.

A layer holds parameters under transformers' names and calls its sequence-mixing and expert work through one
swappable op (``Attention.attn_op``, ``GatedDeltaNet.linear_attn_op``, ``Mamba2Mixer.ssm_op``, the MoE's
dispatcher), so the parallelizer and the kernel plan replace the op, never the layer. The ops live in
``nemo_ac.models.kernels``; layers import kernels, never the other way round.
"""
