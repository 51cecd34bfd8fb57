"""Activation checkpointing: the selective policy, the recompute contexts (nemo_ac's SAC context factory; other
trainers use ``nemo_ac.compat``'s) and the wrapping of blocks as the parallel plan says."""

from nemo_ac.distributed.activation_checkpointing.contexts import (
    ContextFn,
    compose_context_fns,
    make_selective_checkpoint_context_fn,
    sac_region_context_fn,
    selective_policy_factory,
    selective_region_modes,
)
from nemo_ac.distributed.activation_checkpointing.policy import PolicyRules, SelectivePolicy
from nemo_ac.distributed.activation_checkpointing.wrapping import (
    apply_ac,
    block_context_fns,
    install_sac_fsdp_workarounds,
    wrap_block,
)

__all__ = [
    "ContextFn",
    "PolicyRules",
    "SelectivePolicy",
    "apply_ac",
    "block_context_fns",
    "compose_context_fns",
    "install_sac_fsdp_workarounds",
    "make_selective_checkpoint_context_fn",
    "sac_region_context_fn",
    "selective_policy_factory",
    "selective_region_modes",
    "wrap_block",
]
