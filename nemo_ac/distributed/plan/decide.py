"""``decide_plan``: the model (on the meta device) and the recipe's sections in, a ``ParallelPlan`` out.

The one place that reads the sections. Each block's facts (its mixers, whether it routes to experts, its nested
FSDP units, what Dynamo will not trace in it) are read once through the model contract into a ``BlockFacts``;
the decoder and vision deciders turn facts into ``BlockPlan``s; the layout rules (``plan.layout``) refuse what
cannot work with a ``ConfigError`` naming the key and the fix, every rule reported once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from nemo_ac.config.deepep import dispatcher_ep_issue
from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import (
    ActivationCheckpointingConfig,
    BackendConfig,
    CompileConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
)
from nemo_ac.distributed.blocks import (
    decoder_layers,
    decoder_layers_path,
    routed_moe,
    sequence_mixers,
    vision_blocks,
)
from nemo_ac.distributed.plan.kernels import KernelPlan, resolve_kernels
from nemo_ac.distributed.plan.layout import (
    layout_issues,
    nested_units,
    ops_between_compiled_graphs,
    recompute_contexts,
    resolve_layout,
)
from nemo_ac.distributed.plan.records import (
    VISION_KIND,
    BlockPlan,
    CompilePlan,
    FSDPPlan,
    ParallelPlan,
    SelectiveACPlan,
    by_block_key,
)
from nemo_ac.distributed.plan.vocabulary import (
    ACMode,
    BlockKind,
    CompileLayout,
    FSDPUnit,
    NestedUnit,
    RecomputeContext,
)
from nemo_ac.distributed.untraceable import untraceable_modules
from nemo_ac.workarounds.registry import workaround


@dataclass(frozen=True)
class BlockFacts:
    """What the plan needs to know about one decoder block, read from the model once."""

    path: str
    mixers: tuple[str, ...]
    moe: bool
    nested_units: tuple[NestedUnit, ...]
    untraceable: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RunChoices:
    """The sections' values every decoder block's decision reads (explicit, so the deciders take no sections)."""

    ac_mode: ACMode
    ac_outside_fsdp: bool
    offload: bool
    replay_routing: bool
    compile_enabled: bool
    layout: str  # compile.layout: auto | compile_outer | ac_outer
    fullgraph: bool
    forward_thread: bool
    cp: int
    cp_type: str
    ep: int
    # activation_checkpointing.by_block: (block kind, mode) pairs overriding ac_mode for blocks of that kind
    by_block: tuple[tuple[str, ACMode], ...] = ()

    def for_block(self, kind: str) -> RunChoices:
        """The choices for a block of ``kind`` (``block_kind``): its AC mode from ``by_block`` where named."""
        mode = dict(self.by_block).get(kind, self.ac_mode)
        return self if mode is self.ac_mode else dataclasses.replace(self, ac_mode=mode)

    @property
    def fsdp_unit(self) -> FSDPUnit:
        return FSDPUnit.BLOCK if self.ac_outside_fsdp and self.ac_mode is not ACMode.NONE else FSDPUnit.WRAPPER


_MIXER_LABELS = {
    "softmax_attention": "softmax attention",
    "linear_attention": "linear attention",
    "ssm": "Mamba-2 scan",
}
# Mixer kinds each CP type has an op for (context_parallel: ring = K/V ring or state passing; ulysses = head shards).
_CP_MIXERS = {
    "ulysses": ("softmax_attention", "linear_attention", "ssm"),
    "ring": ("softmax_attention", "linear_attention", "ssm"),
}


def block_kind(facts: BlockFacts) -> str:
    """The key ``activation_checkpointing.by_block`` names a decoder block by (``records.by_block_key``); the plan's
    block lines print the same words."""
    return by_block_key(facts.mixers, moe=facts.moe)


def by_block_issues(run: RunChoices, kinds: set[str]) -> dict[str, ConfigIssue]:
    """A ``by_block`` key that names no block of this model (a typo would otherwise silently change nothing)."""
    unknown = sorted({kind for kind, _ in run.by_block} - kinds)
    if not unknown:
        return {}
    return {
        "ac_by_block": ConfigIssue(
            "activation_checkpointing.by_block",
            f"{', '.join(map(repr, unknown))} names no block of this model; its blocks are "
            f"{', '.join(sorted(kinds))} (mixer kinds and moe, joined by +)",
        )
    }


def block_facts(block: nn.Module, *, path: str, moe_config: ModelConfig, kernels: KernelPlan) -> BlockFacts:
    """One decoder block's facts (``routed_moe`` and the module walks run once here)."""
    moe = routed_moe(block) is not None
    untraceable = untraceable_modules(
        block, linear=kernels.linear.value, rms_norm=kernels.rms_norm.value, attention=kernels.attention.value
    )
    return BlockFacts(
        path=path,
        mixers=tuple(m.mixer_kind for m in sequence_mixers(block)),
        moe=moe,
        nested_units=nested_units(
            moe=moe,
            router_fp32=moe_config.moe.router_dtype == "float32",
            separate_experts=moe_config.moe.separate_fsdp_unit,
        ),
        untraceable=untraceable,
    )


def cp_issues(facts: BlockFacts, *, cp: int, cp_type: str) -> dict[str, ConfigIssue]:
    """A mixer kind the CP type has no op for (a model a user brought), by rule name."""
    if cp <= 1:
        return {}
    if cp_type not in _CP_MIXERS:
        return {"cp_type": ConfigIssue("parallel.cp_type", f"unknown {cp_type!r}; use ulysses or ring")}
    for kind in facts.mixers:
        if kind not in _CP_MIXERS[cp_type]:
            return {
                f"cp_{kind}": ConfigIssue(
                    "parallel.cp_type",
                    f"{cp_type} has no context-parallel op for {facts.path}'s {_MIXER_LABELS.get(kind, kind)} mixer "
                    f"(kind {kind!r}); supported: {', '.join(_CP_MIXERS[cp_type])}",
                )
            }
    return {}


def block_kernel_labels(
    facts: BlockFacts, *, kernels: KernelPlan, between_graphs: bool, cp: int, cp_type: str, ep: int
) -> tuple[tuple[str, str], ...]:
    """The block's kernels as the printed plan shows them, derived from the run's ``KernelPlan``."""
    labels: list[tuple[str, str]] = []
    cp_note = f", {cp_type} cp{cp}" if cp > 1 else ""
    if "softmax_attention" in facts.mixers:
        labels.append(("attention", f"{kernels.attention.value}{cp_note}"))
    for kind, chosen in (("linear_attention", kernels.linear_attention), ("ssm", kernels.mamba)):
        if kind not in facts.mixers:
            continue
        if cp > 1 and cp_type == "ring":  # always the torch op: it passes the recurrent state between ranks
            labels.append((kind, f"torch, state-passing ring cp{cp}"))
            continue
        label = f"{chosen.value} ({chosen.reason})" if chosen.fallback else chosen.value
        if between_graphs and chosen.value != "torch":
            label += " (between compiled graphs)"
        labels.append((kind, label + cp_note))
    if facts.moe:
        labels.append(("experts", kernels.experts.value))
        labels.append(("dispatch", f"{kernels.dispatcher.value} ep{ep}" if ep > 1 else "local"))
    return tuple(labels)


def decide_decoder_block(
    facts: BlockFacts, *, run: RunChoices, kernels: KernelPlan
) -> tuple[BlockPlan, dict[str, ConfigIssue]]:
    """A decoder block's plan, and the layout rules it breaks (empty when it can run as planned)."""
    issues = cp_issues(facts, cp=run.cp, cp_type=run.cp_type)
    issues |= layout_issues(
        path=facts.path,
        compile_enabled=run.compile_enabled,
        layout=run.layout,
        fullgraph=run.fullgraph,
        ac_mode=run.ac_mode,
        ac_outside_fsdp=run.ac_outside_fsdp,
        nested=facts.nested_units,
        untraceable=facts.untraceable,
        te_keys=kernels.te_keys(),
    )
    layout = resolve_layout(
        compile_enabled=run.compile_enabled,
        layout=run.layout,
        ac_mode=run.ac_mode,
        ac_outside_fsdp=run.ac_outside_fsdp,
        holds_nested_units=bool(facts.nested_units),
        untraceable=facts.untraceable,
    )
    between_graphs = ops_between_compiled_graphs(run.ac_mode, layout)
    plan = BlockPlan(
        path=facts.path,
        kind=BlockKind.DECODER,
        mixers=facts.mixers,
        moe=facts.moe,
        nested_units=facts.nested_units,
        ac=run.ac_mode,
        recompute_contexts=recompute_contexts(
            ac_mode=run.ac_mode,
            layout=layout,
            forward_thread=run.forward_thread,
            replay_routing=run.replay_routing,
            moe=facts.moe,
        ),
        compile_layout=layout,
        offload=run.offload,
        fsdp_unit=run.fsdp_unit,
        ops_between_graphs=between_graphs,
        kernels=block_kernel_labels(
            facts,
            kernels=kernels,
            between_graphs=between_graphs,
            cp=run.cp,
            cp_type=run.cp_type,
            ep=run.ep,
        ),
        untraceable=facts.untraceable,
    )
    return plan, issues


def decide_vision_block(index: int, *, run: RunChoices) -> BlockPlan:
    """A vision block: an FSDP unit, checkpointed with the mode's own context only; never compiled, never
    CP-sharded (``blocks.vision_blocks`` says why)."""
    run = run.for_block(VISION_KIND)
    return BlockPlan(
        path=f"model.visual.blocks.{index}",
        kind=BlockKind.VISION,
        mixers=(),
        moe=False,
        nested_units=(),
        ac=run.ac_mode,
        recompute_contexts=(RecomputeContext.SAC_MODES,) if run.ac_mode is ACMode.SELECTIVE else (),
        compile_layout=None,
        offload=False,
        fsdp_unit=run.fsdp_unit,
    )


def decide_plan(
    model: nn.Module,
    *,
    model_config: ModelConfig | None = None,
    parallel: ParallelConfig | None = None,
    activation_checkpointing: ActivationCheckpointingConfig | None = None,
    compile: CompileConfig | None = None,
    backend: BackendConfig | None = None,
    data: DataConfig | None = None,
    kernels: KernelPlan | None = None,
    ep: int = 1,
    cp: int = 1,
    device_type: str = "cpu",
    torch_version: str | None = None,
    optimizer_offload: str = "none",
    master_dtype: str = "float32",
) -> ParallelPlan:
    """The plan for ``model`` (on the meta device, nothing applied yet); ``ConfigError`` for a layout that cannot
    work, listing every rule broken.

    A section left out is its schema default (``model_config``: the model's own ``config``; ``data``: whether rows
    vary in length, for the compiled blocks' dynamic token dims); ``ep`` / ``cp`` are the mesh sizes;
    ``optimizer_offload``: ``train.optimizer_offload`` (``full`` puts FSDP's shards on the host); ``master_dtype``:
    ``train.master_dtype`` (the dtype FSDP shards the trainable parameters in); ``kernels``: the
    run's ``KernelPlan`` (the one the model was built with); left out, resolved here from ``backend`` for
    ``device_type``. ``torch_version`` decides the workaround gates as if that torch ran.
    """
    model_config = model_config if model_config is not None else model.config
    parallel = parallel if parallel is not None else ParallelConfig()
    ac = activation_checkpointing if activation_checkpointing is not None else ActivationCheckpointingConfig()
    compile = compile if compile is not None else CompileConfig()
    backend = backend if backend is not None else BackendConfig()
    data = data if data is not None else DataConfig()
    if kernels is None:
        kernels = resolve_kernels(
            model=model_config,
            backend=backend,
            device_type=device_type,
            param_dtype=parallel.fsdp.param_dtype,
            cp=cp,
            cp_type=parallel.cp_type,
        )
    without_ep = dispatcher_ep_issue(kernels.dispatcher.value, ep=ep)
    if without_ep is not None:
        raise ConfigError([without_ep])
    run = run_choices(ac=ac, compile=compile, cp_type=parallel.cp_type, cp=cp, ep=ep)
    vision_count = len(vision_blocks(model) or [])
    decoder = decide_decoder_blocks(
        model,
        model_config=model_config,
        run=run,
        kernels=kernels,
        other_kinds={VISION_KIND} if vision_count else set(),
    )
    vision = tuple(decide_vision_block(index, run=run) for index in range(vision_count))
    blocks = vision + decoder
    return ParallelPlan(
        blocks=blocks,
        ep=ep,
        cp=cp,
        cp_type=parallel.cp_type,
        kernels=kernels,
        selective=selective_plan(ac),
        fsdp=fsdp_plan(
            parallel, optimizer_offload=optimizer_offload, device_type=device_type, master_dtype=master_dtype
        ),
        compile=compile_plan(compile, data=data),
        offload_in_flight=ac.offload_in_flight if any(block.offload for block in blocks) else 0,
        workarounds=run_workarounds(
            blocks,
            compile_backend=compile.backend if compile.enabled else None,
            dynamic_ints=compile.enabled and compile.dynamic_ints,
            selective_fixes=any(block.ac is ACMode.SELECTIVE for block in blocks) and ac.workarounds,
            torch_version=torch_version,
        ),
    )


def run_choices(
    *, ac: ActivationCheckpointingConfig, compile: CompileConfig, cp_type: str, cp: int, ep: int
) -> RunChoices:
    return RunChoices(
        ac_mode=ACMode(ac.mode),
        ac_outside_fsdp=ac.placement == "outside",
        offload=ac.offload,
        replay_routing=ac.replay_routing,
        compile_enabled=compile.enabled,
        layout=compile.layout,
        fullgraph=compile.fullgraph,
        forward_thread=compile.enabled and compile.forward_thread_context,
        cp=cp,
        cp_type=cp_type,
        ep=ep,
        by_block=tuple((kind, ACMode(mode)) for kind, mode in sorted(ac.by_block.items())),
    )


def decide_decoder_blocks(
    model: nn.Module,
    *,
    model_config: ModelConfig,
    run: RunChoices,
    kernels: KernelPlan,
    other_kinds: set[str] | None = None,
) -> tuple[BlockPlan, ...]:
    """Every decoder block's plan; one ``ConfigError`` listing each broken rule once (named at its first block).
    ``other_kinds``: the kinds of the model's other blocks (``vision``) a ``by_block`` key may name."""
    prefix = decoder_layers_path(model)
    all_facts = [
        block_facts(block, path=f"{prefix}.{index}", moe_config=model_config, kernels=kernels)
        for index, block in enumerate(decoder_layers(model))
    ]
    kinds = [block_kind(facts) for facts in all_facts]
    issues = by_block_issues(run, set(kinds) | (other_kinds or set()))
    plans: list[BlockPlan] = []
    for facts, kind in zip(all_facts, kinds, strict=True):
        block_plan, broken = decide_decoder_block(facts, run=run.for_block(kind), kernels=kernels)
        plans.append(block_plan)
        for rule, issue in broken.items():
            issues.setdefault(rule, issue)
    if issues:
        raise ConfigError(list(issues.values()))
    return tuple(plans)


def selective_plan(ac: ActivationCheckpointingConfig) -> SelectiveACPlan:
    policy = ac.selective
    return SelectiveACPlan(
        save_every_other_mm=policy.save_every_other_mm,
        matmul_min_flops_per_byte=policy.matmul_min_flops_per_byte,
        save_communication=policy.save_communication,
        save_router=policy.save_router,
    )


def fsdp_plan(
    parallel: ParallelConfig,
    *,
    optimizer_offload: str = "none",
    device_type: str = "cpu",
    master_dtype: str = "float32",
) -> FSDPPlan:
    """``optimizer_offload: full`` puts every unit's shards on the host; pinned where a CUDA device copies them
    (pinning needs CUDA: on a CPU run the host is the device and the copies are no-ops). ``master_dtype``: the dtype
    the sharded trainable parameters are kept in (``train.master_dtype``)."""
    fsdp = parallel.fsdp
    on_host = optimizer_offload == "full"
    return FSDPPlan(
        param_dtype=fsdp.param_dtype,
        reduce_dtype=fsdp.reduce_dtype,
        reshard_after_forward=fsdp.reshard_after_forward,
        forward_prefetch=fsdp.forward_prefetch,
        backward_prefetch=fsdp.backward_prefetch,
        parameters_on_host=on_host,
        pin_host_memory=on_host and device_type == "cuda",
        master_dtype=master_dtype,
    )


def rows_vary(data: DataConfig) -> bool:
    """Whether row lengths change between micro batches: synthetic rows with ``fixed_length`` false (every other
    kind packs or pads each row to a fixed length: ``seq_len``, medpix's ``max_length``)."""
    return data.kind == "synthetic" and not data.fixed_length


def compile_plan(compile: CompileConfig, *, data: DataConfig) -> CompilePlan | None:
    """The compile values of the run. Token dims are marked dynamic at each block's entry when rows vary and
    ``compile.dynamic`` is null (automatic dynamic, which would compile static first and recompile at the next
    length); ``true`` makes every size dynamic already and ``false`` asks for a graph per length."""
    if not compile.enabled:
        return None
    return CompilePlan(
        backend=compile.backend,
        fullgraph=compile.fullgraph,
        dynamic=compile.dynamic,
        recompile_limit=compile.recompile_limit,
        capture_scalar_outputs=compile.capture_scalar_outputs,
        dynamic_ints=compile.dynamic_ints,
        dynamic_rows=compile.dynamic is None and rows_vary(data),
        node_shared_cache=compile.node_shared_cache,
    )


def run_workarounds(
    blocks: tuple[BlockPlan, ...],
    *,
    compile_backend: str | None,
    dynamic_ints: bool,
    selective_fixes: bool,
    torch_version: str | None,
) -> tuple[str, ...]:
    """The registry's workarounds this run switches on (version gate and layout both)."""
    ac_outer = any(b.compile_layout is CompileLayout.AC_OUTER for b in blocks)
    used = {
        "profiler_ops_in_sac": selective_fixes,
        "fsdp_hooks_in_sac": selective_fixes,
        "forward_thread_compile_config": any(
            RecomputeContext.FORWARD_THREAD_COMPILE in b.recompute_contexts for b in blocks
        ),
        "compiled_regions_under_sac": ac_outer and compile_backend == "inductor",
        "dynamic_per_batch_ints": dynamic_ints,
    }
    return tuple(
        name for name, needed in used.items() if needed and workaround(name).active(torch_version=torch_version)
    )
