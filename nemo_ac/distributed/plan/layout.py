"""The layout rules of one block: its compile layout, its recompute contexts, and the layouts that cannot work.

The one judge of these rules. ``nemo-ac validate`` (``preflight``) and the run both reach them through
``decide_plan`` on the model built on the meta device, so a rule is written once, against what the model holds
(nested FSDP units, modules Dynamo will not trace), instead of being re-derived from the recipe's keys.

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

NESTED_UNITS_FIX = "model.moe.separate_fsdp_unit=false and model.moe.router_dtype=param"
_EAGER_WHY = (
    "compile_outer traces the activation checkpoint as one region and Dynamo cannot split a region at a graph "
    "break, so the whole block would run eagerly"
)


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


def _te_note(untraceable: tuple[tuple[str, int], ...], te_keys: tuple[str, ...]) -> str:
    if not te_keys or not any(name.startswith("te.") for name, _ in untraceable):
        return ""
    return f"; Transformer Engine's forwards are Dynamo-disabled ({', '.join(f'{key}: te' for key in te_keys)})"


def layout_issues(
    *,
    path: str,
    compile_enabled: bool,
    layout: str,
    fullgraph: bool,
    ac_mode: ACMode,
    ac_outside_fsdp: bool,
    nested: tuple[NestedUnit, ...],
    untraceable: tuple[tuple[str, int], ...],
    te_keys: tuple[str, ...],
) -> dict[str, ConfigIssue]:
    """The block's layouts that would run it eagerly in silence or fail at a graph break, by rule name (the plan
    reports each rule once, at the first block that breaks it)."""
    if not compile_enabled:
        return {}
    issues: dict[str, ConfigIssue] = {}
    units = f"{path}: {', '.join(nested)}"
    if fullgraph and untraceable:
        issues["fullgraph_untraceable"] = ConfigIssue(
            "compile.fullgraph",
            f"true fails at the graph breaks in {path} ({describe_untraceable(untraceable)} are not traceable by "
            f"Dynamo{_te_note(untraceable, te_keys)}); set compile.fullgraph=false",
        )
    if fullgraph and nested:
        issues["fullgraph_nested"] = ConfigIssue(
            "compile.fullgraph",
            f"true fails on the graph breaks at the nested FSDP unit's hooks inside MoE blocks ({units}); set "
            f"compile.fullgraph=false or {NESTED_UNITS_FIX}",
        )
    if layout != CompileLayout.COMPILE_OUTER or ac_mode is ACMode.NONE:
        return issues
    if ac_outside_fsdp:
        issues["compile_outer_placement"] = ConfigIssue(
            "compile.layout",
            "compile_outer with activation_checkpointing.placement=outside puts the block's FSDP2 hooks (never "
            f"traced) inside the checkpoint; {_EAGER_WHY}. Use compile.layout=auto (ac_outer here) or "
            "placement=inside",
        )
    if nested:
        issues["compile_outer_nested"] = ConfigIssue(
            "compile.layout",
            f"compile_outer: MoE blocks hold a nested FSDP unit ({units}) whose hooks graph-break inside the "
            f"checkpoint; {_EAGER_WHY}. Use compile.layout=auto or ac_outer, or set {NESTED_UNITS_FIX}",
        )
    if untraceable:
        issues["compile_outer_untraceable"] = ConfigIssue(
            "compile.layout",
            f"compile_outer traces {path}'s checkpoint as one region, and its {describe_untraceable(untraceable)} "
            f"graph-break inside it{_te_note(untraceable, te_keys)}, so Dynamo would run the whole block eagerly; "
            "use compile.layout=auto or ac_outer (the rest of the block compiles around them)",
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


def ops_between_compiled_graphs(ac_mode: ACMode | str, layout: CompileLayout | str | None) -> bool:
    """Whether a block's custom kernel and communication ops (fla / mamba-ssm, DeepEP's dispatch and combine) run
    between compiled graphs: a checkpointed block compiled inside its checkpoint (ac_outer) recomputes whole
    compiled graphs, so an op traced into one would rerun its kernels or communicate again in every recompute
    (``models.mixer_kernels``, ``expert_parallel.deepep_dispatcher``); between graphs the SAC policy saves it."""
    return ac_mode != ACMode.NONE and layout == CompileLayout.AC_OUTER
