"""The parallel plan: what ``parallelize`` does to every block, decided before anything is applied.

``decide_plan`` (``plan.decide``) reads the recipe's sections once and the model through its contract
(``models.interfaces``) and returns plain, typed data (``plan.records``, words in ``plan.vocabulary``): per block
its nested FSDP units, activation-checkpoint mode and recompute contexts, compile layout, offloading and kernel
labels; for the run the EP / CP / FSDP / compile values, the one ``KernelPlan`` (``plan.kernels``) and the torch
workarounds it switches on. It is also the one judge of the layout rules (``plan.layout``): ``nemo-ac validate``
and the run call the same decision. The ``apply_*`` steps take the plan and explicit values, never config
sections; the run prints ``summary_lines()`` at start and reads what was applied (the offloader, the compiled
checkpoint entries) from ``ParallelPlan.applied``, never from module attributes.

Why a block holds nested FSDP units matters twice: their FSDP2 hooks then run inside the block's checkpoint (the
torch 2.13 SAC desync, ``workarounds.profiler_ops_in_sac`` / ``fsdp_hooks_in_sac``), and ``compile.layout: auto``
compiles such a block as AC(compile(block)), because compile(AC(block)) would run it eagerly (a graph break inside
a traced checkpoint skips the whole region). Blocks holding modules Dynamo will not trace (Transformer Engine's,
``distributed.untraceable``) get ac_outer for the same reason: there the break only splits the compiled block.
"""

from nemo_ac.distributed.plan.decide import BlockFacts, decide_plan
from nemo_ac.distributed.plan.kernels import Chosen, KernelPlan, recipe_kernels, resolve_kernels
from nemo_ac.distributed.plan.layout import ops_between_compiled_graphs, resolve_layout
from nemo_ac.distributed.plan.records import (
    AppliedPlan,
    BlockPlan,
    CompilePlan,
    FSDPPlan,
    ParallelPlan,
    SelectiveACPlan,
)
from nemo_ac.distributed.plan.vocabulary import (
    ACMode,
    BlockKind,
    CompileLayout,
    FSDPUnit,
    NestedUnit,
    RecomputeContext,
)

__all__ = [
    "ACMode",
    "AppliedPlan",
    "BlockFacts",
    "BlockKind",
    "BlockPlan",
    "Chosen",
    "CompileLayout",
    "CompilePlan",
    "FSDPPlan",
    "FSDPUnit",
    "KernelPlan",
    "NestedUnit",
    "ParallelPlan",
    "RecomputeContext",
    "SelectiveACPlan",
    "decide_plan",
    "ops_between_compiled_graphs",
    "recipe_kernels",
    "resolve_kernels",
    "resolve_layout",
]
