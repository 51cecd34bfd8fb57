"""The torch 2.12 / 2.13 FSDP2 + selective AC + compile workarounds, for any FSDP2 trainer.

Two lines for a plain FSDP2 script (docs/doctor_and_compat.md, "The fixes in your own FSDP2 trainer")::

    import nemo_ac.compat as compat
    compat.install()                 # process-wide: profiler ops out of SAC's replay (torch >= 2.13)
    ...                              # fully_shard(...) your units
    compat.protect_fsdp_units(model) # per model: FSDP2 hooks outside the SAC modes (explicit prefetch)
    context_fn = compat.selective_checkpoint_context_fn(policy=my_policy)   # the modes that honour it
    torch.compile(block, **compat.ac_outer_compile_kwargs({"backend": "inductor"}))  # a block compiled inside SAC

Which torch failure each helper works around, and on which releases: ``nemo_ac.workarounds.WORKAROUNDS``.
``nemo-ac doctor`` runs each failure on the installed torch with and without these and says which are needed.
Importing this package changes no torch state; ``install()`` changes ``SAC_IGNORED_OPS`` only when called, and
``installed()`` restores it.
"""

from nemo_ac.compat.install import CompatStatus, install, installed, status, uninstall
from nemo_ac.compat.regions import (
    ContextFn,
    UnprotectedFSDPUnitWarning,
    ac_outer_compile_kwargs,
    add_recompute_context,
    compose_context_fns,
    forward_thread_compile_context,
    protect_fsdp_units,
    regions_with_torch_sac_modes,
    selective_checkpoint_context_fn,
    unprotect_fsdp_units,
    with_forward_thread_compile_context,
)

__all__ = [
    "CompatStatus",
    "ContextFn",
    "UnprotectedFSDPUnitWarning",
    "ac_outer_compile_kwargs",
    "add_recompute_context",
    "compose_context_fns",
    "forward_thread_compile_context",
    "install",
    "installed",
    "protect_fsdp_units",
    "regions_with_torch_sac_modes",
    "selective_checkpoint_context_fn",
    "status",
    "uninstall",
    "unprotect_fsdp_units",
    "with_forward_thread_compile_context",
]
