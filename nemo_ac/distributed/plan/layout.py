"""The layout rules of one block: its compile layout, its recompute contexts, and the layouts that cannot work.

Reached through ``decide_plan`` on the model built on the meta device: written against what the model holds
(nested FSDP units, modules Dynamo will not trace).

Why the rules: a block whose FSDP hooks run inside its checkpoint (nested units, or AC outside the block's own
fully_shard) or that holds untraceable modules graph-breaks inside the checkpoint. compile(AC(block)) traces the
checkpoint as one higher-order op, cannot split it at a break and runs the whole block eagerly, in silence; so
``auto`` gives such a block AC(compile(block)) and an explicit ``compile_outer`` (or ``fullgraph``) is refused
with the key and the fix.
"""

from __future__ import annotations

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.distributed.plan.vocabulary import ACMode, CompileLayout, NestedUnit, RecomputeContext
from nemo_ac.distributed.untraceable import describe_untraceable


def nested_units(*, moe: bool, router_fp32: bool, separate_experts: bool) -> tuple[NestedUnit, ...]:
    """The block's submodules that get their own fully_shard: the router when kept in fp32 (its own fp32 mixed
    precision policy), the experts when ``moe.separate_fsdp_unit``; none in a dense block."""
    if not moe:
        return ()
    return ((NestedUnit.ROUTER,) if router_fp32 else ()) + ((NestedUnit.EXPERTS,) if separate_experts else ())


def resolve_layout(
    *,
    compile_enabled: bool,
    layout: str,
    ac_mode: ACMode,
    ac_outside_fsdp: bool,
    holds_nested_units: bool,
    untraceable: tuple[tuple[str, int], ...] = (),
) -> CompileLayout | None:
    """The compile layout of one block (None: compile disabled). Without AC there is no checkpoint to be inside
    or outside of: the block is compiled whole (reported as compile_outer). ``auto``: ac_outer for blocks that
    graph-break inside their checkpoint, compile_outer otherwise. ``layout_issues`` refuses what cannot work."""
    if not compile_enabled:
        return None
    if ac_mode is ACMode.NONE:
        return CompileLayout.COMPILE_OUTER
    if layout != "auto":
        return CompileLayout(layout)
    breaks_inside = ac_outside_fsdp or holds_nested_units or bool(untraceable)
    return CompileLayout.AC_OUTER if breaks_inside else CompileLayout.COMPILE_OUTER


def layout_issues(
    *,
    path: str,
    compile_enabled: bool,
    layout: str,
    fullgraph: bool,
    ac_mode: ACMode,
    untraceable: tuple[tuple[str, int], ...],
) -> dict[str, ConfigIssue]:
    """The block's layouts that would run it eagerly in silence or fail at a graph break, by rule name (the plan
    reports each rule once, at the first block that breaks it)."""
    if not compile_enabled:
        return {}
    issues: dict[str, ConfigIssue] = {}
    if fullgraph and untraceable:
        issues["fullgraph_untraceable"] = ConfigIssue(
            "compile.fullgraph",
            f"true fails at the graph breaks in {path} ({describe_untraceable(untraceable)} are not traceable by "
            "Dynamo); set compile.fullgraph=false",
        )
    if layout == CompileLayout.COMPILE_OUTER and ac_mode is not ACMode.NONE and untraceable:
        issues["compile_outer_untraceable"] = ConfigIssue(
            "compile.layout",
            f"compile_outer traces {path}'s checkpoint as one region, and its {describe_untraceable(untraceable)} "
            "graph-break inside it, so Dynamo would run the whole block eagerly; use compile.layout=auto or "
            "ac_outer (the rest of the block compiles around them)",
        )
    return issues


def recompute_contexts(
    *, ac_mode: ACMode, layout: CompileLayout | None, forward_thread: bool, replay_routing: bool, moe: bool
) -> tuple[RecomputeContext, ...]:
    """What a decoder block's checkpoint composes, in order: the SAC modes (selective AC); the forward-thread
    compile context (a checkpointed AC(compile(block)) with ``compile.forward_thread_context``); routing replay
    (a MoE block whose recompute cannot otherwise see the router, ``replay_needed``)."""
    if ac_mode is ACMode.NONE:
        return ()
    contexts = [RecomputeContext.SAC_MODES] if ac_mode is ACMode.SELECTIVE else []
    if forward_thread and layout is CompileLayout.AC_OUTER:
        contexts.append(RecomputeContext.FORWARD_THREAD_COMPILE)
    if replay_routing and moe and replay_needed(ac_mode, layout):
        contexts.append(RecomputeContext.ROUTING_REPLAY)
    return tuple(contexts)


def replay_needed(ac_mode: ACMode, layout: CompileLayout | None) -> bool:
    """Whether a checkpointed MoE block needs the routing-replay context: full AC always (compile(AC(block)) gets
    its SAC-policy form); selective AC only where its policy cannot see the router, inside AC(compile(block))'s
    compiled regions, which its modes recompute whole (the policy saves ``nemo_ac::select_experts`` elsewhere)."""
    if ac_mode is ACMode.FULL:
        return True
    return ac_mode is ACMode.SELECTIVE and layout is CompileLayout.AC_OUTER


def mixer_kernel_between_graphs(ac_mode: ACMode | str, layout: CompileLayout | str | None) -> bool:
    """Whether a block's mixer-kernel ops run between compiled graphs: a checkpointed block compiled inside its
    checkpoint (ac_outer) recomputes whole compiled graphs, so a kernel op traced into one would rerun in every
    recompute (``models.common.mixer_kernels``); between graphs the SAC policy saves it."""
    return ac_mode != ACMode.NONE and layout == CompileLayout.AC_OUTER
