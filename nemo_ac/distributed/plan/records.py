"""The plan as data: per block (``BlockPlan``) and for the run (``ParallelPlan``), typed, printable, frozen.

No config section lives here: the apply steps take these records and explicit values only (the selective AC
policy reads ``SelectiveACPlan`` itself: ``activation_checkpointing.policy.SelectiveChoices``), so what a step does
is what the printed plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_ac.distributed.plan.kernels import KernelPlan
from nemo_ac.distributed.plan.vocabulary import (
    ACMode,
    BlockKind,
    CompileLayout,
    FSDPUnit,
    NestedUnit,
    RecomputeContext,
)
from nemo_ac.distributed.untraceable import describe_untraceable

VISION_KIND = "vision"  # the by_block key of every vision block


def by_block_key(mixers: tuple[str, ...], *, moe: bool) -> str:
    """A decoder block's ``activation_checkpointing.by_block`` key: its mixer kinds and ``moe`` where it routes
    experts, joined by ``+`` (``ssm``, ``moe``, ``softmax_attention+moe``), ``mlp`` for neither."""
    return "+".join((*mixers, *(("moe",) if moe else ()))) or "mlp"


@dataclass(frozen=True)
class BlockPlan:
    """What happens to one block.

    path: ``model.layers.3`` (also the SAC region name in desync errors).
    mixers: kinds of its sequence mixers (``SequenceMixer.mixer_kind``), each swapped for its CP op when cp > 1.
    moe: the block has a routed MoE (experts sharded over EP, dispatcher swapped when ep > 1).
    nested_units: submodules fully_shard-ed on their own inside the block, in sharding order.
    ac: the checkpoint mode. recompute_contexts: what its checkpoint composes, in order.
    compile_layout: compile(AC(block)) or AC(compile(block)); None = not compiled.
    offload: the block's saved activations go to host memory.
    fsdp_unit: what the block's ``fully_shard`` wraps.
    ops_between_graphs: its custom kernel and communication ops run between compiled graphs, as graph-breaking calls
        (``plan.layout.ops_between_compiled_graphs``: checkpointed and compiled inside its checkpoint).
    kernels: (what, label) pairs derived from the run's ``KernelPlan``, e.g. ("attention", "tiled, ulysses cp2").
    untraceable: (class name, count) of modules Dynamo will not trace (TE's, or Dynamo-disabled ones): each is a
        graph break in the compiled block, so such a block is never compile(AC(block)).
    """

    path: str
    kind: BlockKind
    mixers: tuple[str, ...]
    moe: bool
    nested_units: tuple[NestedUnit, ...]
    ac: ACMode
    recompute_contexts: tuple[RecomputeContext, ...]
    compile_layout: CompileLayout | None
    offload: bool
    fsdp_unit: FSDPUnit
    ops_between_graphs: bool = False
    kernels: tuple[tuple[str, str], ...] = ()
    untraceable: tuple[tuple[str, int], ...] = ()

    @property
    def index(self) -> int:
        return int(self.path.rsplit(".", 1)[1])

    @property
    def checkpointed(self) -> bool:
        return self.ac is not ACMode.NONE

    @property
    def ac_key(self) -> str:
        """The key ``activation_checkpointing.by_block`` names this block by (``plan.decide.block_kind``)."""
        if self.kind is BlockKind.VISION:
            return VISION_KIND
        return by_block_key(self.mixers, moe=self.moe)

    def describe(self) -> str:
        """Everything but the path, in one line (blocks with equal lines share one summary line)."""
        parts = ["+".join(self.mixers) or "no mixer", "moe" if self.moe else "dense"]
        if self.nested_units:
            parts.append("own FSDP units: " + ", ".join(self.nested_units))
        extra = [c for c in self.recompute_contexts if c is not RecomputeContext.SAC_MODES]  # SAC's own: unsaid
        ac = self.ac if not extra else f"{self.ac} + {', '.join(extra)}"
        parts.append(f"AC {ac}" + (" + offload" if self.offload else ""))
        compiled = f"compile {self.compile_layout}" if self.compile_layout else "eager"
        if self.compile_layout and self.untraceable:
            compiled += f" (graph breaks at {describe_untraceable(self.untraceable)})"
        parts.append(compiled)
        parts.append(self.fsdp_unit.describe())
        parts.extend(f"{what} {choice}" for what, choice in self.kernels)
        return " | ".join(parts)


@dataclass(frozen=True)
class SelectiveACPlan:
    """What the selective AC policy saves (``activation_checkpointing.selective``). Whether nemo_ac's SAC fixes are
    installed is the run's ``workarounds`` (``activation_checkpointing.workarounds`` and the version gate)."""

    save_every_other_mm: bool = True
    matmul_min_flops_per_byte: int = 2048
    save_communication: bool = True
    save_router: bool = True


@dataclass(frozen=True)
class FSDPPlan:
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    forward_prefetch: Literal["none", "explicit"]
    backward_prefetch: Literal["default", "explicit"]
    # train.optimizer_offload: full: FSDP2's CPUOffloadPolicy on every unit (sharded parameters, gradients and the
    # optimizer step on the host), the host memory pinned where a CUDA device copies from it.
    parameters_on_host: bool = False
    pin_host_memory: bool = False
    # train.master_dtype: the dtype the trainable parameters are sharded (and their gradients kept) in; modules the
    # model keeps in fp32 (``keep_fp32``: an fp32 router) stay fp32.
    master_dtype: str = "float32"

    def describe(self) -> str:
        where = " | sharded parameters + gradients + optimizer on host" if self.parameters_on_host else ""
        masters = f" | {self.master_dtype} masters" if self.master_dtype != "float32" else ""
        return (
            f"fsdp {self.param_dtype}/{self.reduce_dtype} prefetch fwd {self.forward_prefetch} "
            f"bwd {self.backward_prefetch}{where}{masters}"
        )


@dataclass(frozen=True)
class CompilePlan:
    backend: str
    fullgraph: bool
    dynamic: bool | None
    recompile_limit: int
    capture_scalar_outputs: bool
    dynamic_ints: bool  # workarounds.dynamic_per_batch_ints
    # Rows vary in length per micro batch (data.fixed_length=false) under automatic dynamic (dynamic null): each
    # compiled block marks the token dims of its inputs dynamic at its eager entry, so the first compile is already
    # dynamic in them instead of static first and recompiled at the first other length (``apply._CompiledForward``).
    dynamic_rows: bool = False
    node_shared_cache: bool = True  # inductor only: workarounds.node_shared_compile

    def node_shared(self) -> bool:
        """Whether each graph compiles once per node (the other ranks load it): inductor with node_shared_cache."""
        return self.backend == "inductor" and self.node_shared_cache


@dataclass(frozen=True)
class AppliedPlan:
    """What applying the plan produced, for the run to read (never stashed on modules)."""

    offloader: Any = None  # distributed.offload.ActivationOffloader, or None
    compiled_checkpoint_entries: tuple[tuple[str, int], ...] = ()  # compile(AC(block)) entry frames
    fsdp_units: int = 0
    fsdp_units_bracketed: int = 0  # workarounds.fsdp_hooks_in_sac


@dataclass(frozen=True)
class ParallelPlan:
    """The whole run's plan. ``applied`` is filled by ``parallelize`` once the plan has been applied."""

    blocks: tuple[BlockPlan, ...]
    ep: int
    cp: int
    cp_type: Literal["ulysses", "ring"]
    kernels: KernelPlan  # every kernel of the run, stored once (block labels derive from it)
    selective: SelectiveACPlan
    fsdp: FSDPPlan
    compile: CompilePlan | None
    workarounds: tuple[str, ...]  # names from workarounds.registry this run switches on
    # Activation offload: blocks whose offloaded tensors may be on the device at once (offload.py); 0: none offload.
    offload_in_flight: int = 0
    applied: AppliedPlan = field(default_factory=AppliedPlan)

    def decoder_blocks(self) -> tuple[BlockPlan, ...]:
        return tuple(b for b in self.blocks if b.kind is BlockKind.DECODER)

    def vision_blocks(self) -> tuple[BlockPlan, ...]:
        return tuple(b for b in self.blocks if b.kind is BlockKind.VISION)

    def dispatcher_between_graphs(self) -> bool:
        """Whether the one expert-parallel dispatcher all MoE blocks share calls its ops between compiled graphs:
        some MoE block's plan says so (DeepEP; the torch dispatcher's functional collectives are always traced)."""
        return any(block.moe and block.ops_between_graphs for block in self.decoder_blocks())

    def compile_layouts(self) -> list[CompileLayout | None]:
        return [b.compile_layout for b in self.decoder_blocks()]

    def collectives_by_mesh_dim(self) -> bool:
        """Whether the CP ops' and the torch EP dispatcher's collectives address their group by its mesh dim
        (``workarounds.shared_group_names``): where graphs compile once per node, so ranks in other groups of the
        dim load them instead of compiling their own."""
        return self.compile is not None and self.compile.node_shared()

    def kernels_line(self) -> str:
        """The ``kernels | ...`` line with only the slots this model uses (``KernelPlan.slots_used`` over the
        blocks' mixer kinds and MoE): no Mamba-2 kernel for a model without Mamba-2 layers."""
        mixers = {kind for block in self.blocks for kind in block.mixers}
        slots = self.kernels.slots_used(mixers=mixers, moe=any(block.moe for block in self.blocks))
        return self.kernels.summary_line(slots)

    def summary_lines(self) -> list[str]:
        """The run's start-up print (also ``nemo-ac validate --plan`` and ``nemo-ac plan``): the kernels the model
        uses, the layout, one line per distinct block plan, the workarounds."""
        lines = [
            self.kernels_line(),
            f"plan | ep {self.ep} ({self.kernels.dispatcher.value}) | cp {self.cp}"
            + (f" ({self.cp_type})" if self.cp > 1 else "")
            + f" | {self.fsdp.describe()}"
            + "".join(f" | {key} te" for key in self.kernels.te_keys())
            + (f" | offload: {self.offload_in_flight} blocks in flight" if self.offload_in_flight else ""),
        ]
        groups: dict[str, list[BlockPlan]] = {}
        for block in self.blocks:
            groups.setdefault(f"{block.kind}:{block.describe()}", []).append(block)
        for blocks in groups.values():
            prefix = blocks[0].path.rsplit(".", 1)[0]
            indices = _ranges([b.index for b in blocks])
            lines.append(f"plan | {prefix}.[{indices}] ({len(blocks)}) | {blocks[0].describe()}")
        lines.append("plan | workarounds: " + (", ".join(self.workarounds) or "none"))
        return lines


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(out)
