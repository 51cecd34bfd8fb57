"""The parallel plan: what ``parallelize`` does to every block, decided before anything is applied.

``decide_plan`` reads the recipe's sections once and the model through its contract (``models.interfaces``) and
returns plain data: per block its nested FSDP units, activation-checkpoint mode and recompute contexts, compile
layout, offloading and kernels; for the run the EP / CP / FSDP / compile values and the torch workarounds it
switches on. The ``apply_*`` steps take the plan and explicit values, never config sections; the run prints
``summary_lines()`` at start (one line per distinct block plan) and reads what was applied (the offloader, the
compiled checkpoint entries) from ``ParallelPlan.applied``, never from module attributes.

Why a block holds nested FSDP units matters twice: their FSDP2 hooks then run inside the block's checkpoint (the
torch 2.13 SAC desync, ``workarounds.profiler_ops_in_sac`` / ``fsdp_hooks_in_sac``), and ``compile.layout: auto``
compiles such a block as AC(compile(block)), because compile(AC(block)) would run it eagerly (a graph break inside
a traced checkpoint skips the whole region). Blocks holding modules Dynamo will not trace (Transformer Engine's,
``distributed.untraceable``) get ac_outer for the same reason: there the break only splits the compiled block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.mixer_kernels import resolve_mixer_kernel
from nemo_ac.config.schema import (
    ActivationCheckpointingConfig,
    BackendConfig,
    CompileConfig,
    ModelConfig,
    ParallelConfig,
    SelectiveACConfig,
)
from nemo_ac.distributed.blocks import (
    decoder_layers,
    decoder_layers_path,
    routed_moe,
    sequence_mixers,
    vision_blocks,
)
from nemo_ac.distributed.untraceable import describe_untraceable, untraceable_modules
from nemo_ac.models.common.attention import choose_attention_kernel
from nemo_ac.workarounds.registry import workaround

Layout = Literal["compile_outer", "ac_outer"]
NestedUnit = Literal["router", "experts"]

# Recompute contexts an AC wrapper composes (their order is the composition order).
SAC_MODES = "selective"  # nemo_ac's SAC modes (pass FSDP hook ops and compiled regions through)
FORWARD_THREAD_COMPILE = "forward_thread_compile"  # workarounds.forward_thread_compile_config
ROUTING_REPLAY = "routing_replay"  # models.common.routing_replay: the recompute reuses the forward's expert choice


@dataclass(frozen=True)
class BlockPlan:
    """What happens to one block.

    path: ``model.layers.3`` (also the SAC region name in desync errors).
    mixers: kinds of its sequence mixers (``SequenceMixer.mixer_kind``), each swapped for its CP op when cp > 1.
    moe: the block has a routed MoE (experts sharded over EP, dispatcher swapped when ep > 1).
    nested_units: submodules fully_shard-ed on their own inside the block, in sharding order.
    ac: none | full | selective. recompute_contexts: what its checkpoint composes (SAC_MODES, FORWARD_THREAD_COMPILE,
        ROUTING_REPLAY).
    compile_layout: compile_outer = compile(AC(block)), ac_outer = AC(compile(block)), None = not compiled.
    offload: the block's saved activations go to host memory.
    fsdp_unit: ``wrapper`` = fully_shard(AC(block)) (torchtitan's layout), ``block`` = AC(fully_shard(block)).
    kernels: (what, choice) pairs, e.g. ("attention", "sdpa, ulysses cp2"), ("experts", "grouped_mm").
    untraceable: (class name, count) of modules Dynamo will not trace (TE's, or Dynamo-disabled ones): each is a
        graph break in the compiled block, so such a block is never compile(AC(block)).
    """

    path: str
    kind: Literal["decoder", "vision"]
    mixers: tuple[str, ...]
    moe: bool
    nested_units: tuple[NestedUnit, ...]
    ac: str
    recompute_contexts: tuple[str, ...]
    compile_layout: Layout | None
    offload: bool
    fsdp_unit: Literal["wrapper", "block"]
    kernels: tuple[tuple[str, str], ...] = ()
    untraceable: tuple[tuple[str, int], ...] = ()

    @property
    def index(self) -> int:
        return int(self.path.rsplit(".", 1)[1])

    def describe(self) -> str:
        """Everything but the path, in one line (blocks with equal lines share one summary line)."""
        parts = ["+".join(self.mixers) or "no mixer", "moe" if self.moe else "dense"]
        if self.nested_units:
            parts.append("own FSDP units: " + ", ".join(self.nested_units))
        extra = [c for c in self.recompute_contexts if c != SAC_MODES]  # selective AC's own modes go unsaid
        ac = self.ac if not extra else f"{self.ac} + {', '.join(extra)}"
        parts.append(f"AC {ac}" + (" + offload" if self.offload else ""))
        compiled = f"compile {self.compile_layout}" if self.compile_layout else "eager"
        if self.compile_layout and self.untraceable:
            compiled += f" (graph breaks at {describe_untraceable(self.untraceable)})"
        parts.append(compiled)
        parts.append(f"fully_shard({'AC(block)' if self.fsdp_unit == 'wrapper' else 'block'})")
        parts.extend(f"{what} {choice}" for what, choice in self.kernels)
        return " | ".join(parts)


@dataclass(frozen=True)
class FSDPPlan:
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    forward_prefetch: str  # none | explicit
    backward_prefetch: str  # default | explicit


@dataclass(frozen=True)
class CompilePlan:
    backend: str
    fullgraph: bool
    dynamic: bool | None
    recompile_limit: int
    capture_scalar_outputs: bool
    dynamic_ints: bool  # workarounds.dynamic_per_batch_ints


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
    dispatcher: str
    cp: int
    cp_type: str
    attention_kernel: str  # backend.attention resolved: tiled | flex | sdpa | te (local op and ring step kernel)
    selective: SelectiveACConfig
    ac_workarounds: bool
    fsdp: FSDPPlan
    compile: CompilePlan | None
    backends: tuple[tuple[str, str], ...]  # (linear | rms_norm | attention, torch | sdpa | te)
    workarounds: tuple[str, ...]  # names from workarounds.registry this run switches on
    # backend.linear_attention / backend.mamba resolved: (("linear_attention", torch | fla), ("mamba", torch |
    # mamba_ssm)); apply_plan installs the kernels' ops before CP wraps them.
    mixer_kernels: tuple[tuple[str, str], ...] = (("linear_attention", "torch"), ("mamba", "torch"))
    applied: AppliedPlan = field(default_factory=AppliedPlan)

    def decoder_blocks(self) -> tuple[BlockPlan, ...]:
        return tuple(b for b in self.blocks if b.kind == "decoder")

    def vision_blocks(self) -> tuple[BlockPlan, ...]:
        return tuple(b for b in self.blocks if b.kind == "vision")

    def compile_layouts(self) -> list[Layout | None]:
        return [b.compile_layout for b in self.decoder_blocks()]

    def summary_lines(self) -> list[str]:
        """The run's start-up print: the layout, one line per distinct block plan, the workarounds."""
        lines = [
            f"plan | ep {self.ep} ({self.dispatcher}) | cp {self.cp}"
            + (f" ({self.cp_type})" if self.cp > 1 else "")
            + f" | fsdp {self.fsdp.param_dtype}/{self.fsdp.reduce_dtype} prefetch fwd {self.fsdp.forward_prefetch} "
            f"bwd {self.fsdp.backward_prefetch}"
            + "".join(f" | backend.{key} te" for key, value in self.backends if value == "te")
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


# ------------------------------------------------------------------------------------------------------------
# decisions


def nested_units(block: nn.Module, *, router_fp32: bool, separate_experts: bool) -> tuple[NestedUnit, ...]:
    """The block's submodules that get their own fully_shard: the router when kept in fp32 (its own fp32 mixed
    precision policy), the experts when ``moe.separate_fsdp_unit``."""
    if routed_moe(block) is None:
        return ()
    return (("router",) if router_fp32 else ()) + (("experts",) if separate_experts else ())


def resolve_layout(
    *,
    compile_enabled: bool,
    layout: str,
    ac_mode: str,
    ac_outside_fsdp: bool,
    holds_nested_units: bool,
    untraceable: tuple[tuple[str, int], ...] = (),
    fullgraph: bool = False,
    path: str = "block",
) -> Layout | None:
    """The compile layout of one block (None: compile disabled).

    Without AC there is no checkpoint to be inside or outside of: the block is compiled whole (reported as
    compile_outer). ``auto``: ac_outer for blocks whose FSDP hooks run inside the checkpoint (nested units, or AC
    outside the block's own fully_shard) or that hold modules Dynamo will not trace, compile_outer otherwise.
    An explicit compile_outer (or fullgraph) over untraceable modules is a ConfigError: it would run the block
    eagerly (or fail at the first break), and validation cannot see modules a user put in the model.
    """
    if not compile_enabled:
        return None
    if untraceable and fullgraph:
        raise ConfigError(
            ConfigIssue(
                "compile.fullgraph",
                f"true fails at the graph breaks in {path} ({describe_untraceable(untraceable)} are not traceable by "
                "Dynamo); set compile.fullgraph=false",
            )
        )
    if ac_mode == "none":
        return "compile_outer"
    if layout == "compile_outer" and untraceable:
        raise ConfigError(
            ConfigIssue(
                "compile.layout",
                f"compile_outer traces {path}'s checkpoint as one region, and its {describe_untraceable(untraceable)} "
                "graph-break inside it, so Dynamo would run the whole block eagerly; use compile.layout=auto or "
                "ac_outer (the rest of the block compiles around them)",
            )
        )
    if layout != "auto":
        return layout  # type: ignore[return-value]
    return "ac_outer" if ac_outside_fsdp or holds_nested_units or untraceable else "compile_outer"


def _replay_needed(ac_mode: str, layout: Layout | None) -> bool:
    """Whether a checkpointed MoE block needs the routing-replay context: full AC always (compile(AC(block)) gets
    its SAC-policy form); selective AC only where its policy cannot see the router, inside AC(compile(block))'s
    compiled regions, which its modes recompute whole (the policy saves ``nemo_ac::select_experts`` elsewhere)."""
    if ac_mode == "full":
        return True
    return ac_mode == "selective" and layout == "ac_outer"


def mixer_kernel_between_graphs(ac_mode: str, layout: Layout | None) -> bool:
    """Whether a block's mixer-kernel ops run between compiled graphs: a checkpointed block compiled inside its
    checkpoint (ac_outer) recomputes whole compiled graphs, so a kernel op traced into one would rerun in every
    recompute (``models.common.mixer_kernels``); between graphs the SAC policy saves it."""
    return ac_mode != "none" and layout == "ac_outer"


def _attention_kernel(*, attention_backend: str, cp: int, cp_type: str) -> str:
    return attention_backend if cp == 1 else f"{attention_backend}, {cp_type} cp{cp}"


def _block_kernels(
    block: nn.Module,
    *,
    mixers: tuple[str, ...],
    attention_backend: str,
    mixer_kernels: dict[str, str],
    between_graphs: bool,
    cp: int,
    cp_type: str,
    ep: int,
    dispatcher: str,
) -> tuple[tuple[str, str], ...]:
    kernels: list[tuple[str, str]] = []
    if "softmax_attention" in mixers:
        kernels.append(("attention", _attention_kernel(attention_backend=attention_backend, cp=cp, cp_type=cp_type)))
    for kind in ("linear_attention", "ssm"):
        if kind in mixers:
            label = mixer_kernels[kind]
            if between_graphs and not label.startswith("torch"):
                label += " (between compiled graphs)"
            if cp > 1 and cp_type == "ring":  # always the torch op (config.mixer_kernels): it passes the state
                label = f"torch, state-passing ring cp{cp}"
            elif cp > 1:
                label += f", {cp_type} cp{cp}"
            kernels.append((kind, label))
    moe = routed_moe(block)
    if moe is not None:
        kernels.append(("experts", str(getattr(moe.experts_module(), "impl", "?"))))
        kernels.append(("dispatch", f"{dispatcher} ep{ep}" if ep > 1 else "local"))
    return tuple(kernels)


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


def _check_cp(mixers: tuple[str, ...], *, cp: int, cp_type: str, path: str) -> None:
    if cp > 1 and cp_type not in _CP_MIXERS:
        raise ValueError(f"parallel.cp_type: unknown {cp_type!r}; use ulysses or ring")
    if cp > 1:
        for kind in mixers:
            if kind not in _CP_MIXERS[cp_type]:
                raise ValueError(
                    f"parallel.cp_type: {cp_type} has no context-parallel op for {path}'s "
                    f"{_MIXER_LABELS.get(kind, kind)} mixer (kind {kind!r}); supported: "
                    f"{', '.join(_CP_MIXERS[cp_type])}"
                )


def decide_plan(
    model: nn.Module,
    *,
    model_config: ModelConfig | None = None,
    parallel: ParallelConfig | None = None,
    activation_checkpointing: ActivationCheckpointingConfig | None = None,
    compile: CompileConfig | None = None,
    backend: BackendConfig | None = None,
    ep: int = 1,
    cp: int = 1,
    device_type: str = "cpu",
    torch_version: str | None = None,
) -> ParallelPlan:
    """The plan for ``model`` (on the meta device, nothing applied yet). The one place that reads the sections.

    A section left out is its schema default (``model_config``: the model's own ``config``); ``ep`` / ``cp`` are the
    mesh sizes; ``device_type`` resolves ``auto`` of ``backend.attention`` / ``linear_attention`` / ``mamba``;
    ``torch_version`` decides the workaround gates as if that torch were running.
    """
    model_config = model_config if model_config is not None else model.config
    parallel = parallel if parallel is not None else ParallelConfig()
    ac = activation_checkpointing if activation_checkpointing is not None else ActivationCheckpointingConfig()
    compile = compile if compile is not None else CompileConfig()
    backend = backend if backend is not None else BackendConfig()
    attention_kernel = choose_attention_kernel(backend.attention, device_type=device_type)
    # The mixer cores' kernels (config.mixer_kernels): label per block kind, with auto's reason where it matters.
    mixer_kernels, mixer_labels = {}, {}
    for key, kind, requested in (
        ("linear_attention", "linear_attention", backend.linear_attention),
        ("mamba", "ssm", backend.mamba),
    ):
        kernel, why = resolve_mixer_kernel(key, requested, device_type=device_type, cp=cp, cp_type=parallel.cp_type)
        mixer_kernels[key] = kernel
        mixer_labels[kind] = f"{kernel} ({why})" if why else kernel
    moe = model_config.moe
    ac_outside_fsdp = ac.placement == "outside"
    compile_enabled = compile.enabled
    selective = ac.mode == "selective"
    forward_thread = compile_enabled and compile.forward_thread_context
    decoder_plans = []
    prefix = decoder_layers_path(model)
    for index, block in enumerate(decoder_layers(model)):
        path = f"{prefix}.{index}"
        mixers = tuple(m.mixer_kind for m in sequence_mixers(block))
        _check_cp(mixers, cp=cp, cp_type=parallel.cp_type, path=path)
        units = nested_units(block, router_fp32=moe.router_dtype == "float32", separate_experts=moe.separate_fsdp_unit)
        untraceable = untraceable_modules(
            block, linear=backend.linear, rms_norm=backend.rms_norm, attention=attention_kernel
        )
        layout = resolve_layout(
            compile_enabled=compile_enabled,
            layout=compile.layout,
            ac_mode=ac.mode,
            ac_outside_fsdp=ac_outside_fsdp,
            holds_nested_units=bool(units),
            untraceable=untraceable,
            fullgraph=compile.fullgraph,
            path=path,
        )
        contexts = (
            ((SAC_MODES,) if selective else ())
            + ((FORWARD_THREAD_COMPILE,) if forward_thread and layout == "ac_outer" and ac.mode != "none" else ())
            + (
                (ROUTING_REPLAY,)
                if ac.replay_routing and routed_moe(block) is not None and _replay_needed(ac.mode, layout)
                else ()
            )
        )
        decoder_plans.append(
            BlockPlan(
                path=path,
                kind="decoder",
                mixers=mixers,
                moe=routed_moe(block) is not None,
                nested_units=units,
                ac=ac.mode,
                recompute_contexts=contexts,
                compile_layout=layout,
                offload=ac.offload,
                fsdp_unit="block" if ac_outside_fsdp and ac.mode != "none" else "wrapper",
                kernels=_block_kernels(
                    block,
                    mixers=mixers,
                    attention_backend=attention_kernel,
                    mixer_kernels=mixer_labels,
                    between_graphs=mixer_kernel_between_graphs(ac.mode, layout),
                    cp=cp,
                    cp_type=parallel.cp_type,
                    ep=ep,
                    dispatcher=backend.dispatcher,
                ),
                untraceable=untraceable,
            )
        )
    # Vision blocks: FSDP units, checkpointed with the mode's own context only; never compiled, never CP-sharded.
    vision_plans = [
        BlockPlan(
            path=f"model.visual.blocks.{index}",
            kind="vision",
            mixers=(),
            moe=False,
            nested_units=(),
            ac=ac.mode,
            recompute_contexts=(SAC_MODES,) if selective else (),
            compile_layout=None,
            offload=False,
            fsdp_unit="block" if ac_outside_fsdp and ac.mode != "none" else "wrapper",
        )
        for index, _ in enumerate(vision_blocks(model) or [])
    ]
    blocks = tuple(vision_plans + decoder_plans)
    return ParallelPlan(
        blocks=blocks,
        ep=ep,
        dispatcher=backend.dispatcher,
        cp=cp,
        cp_type=parallel.cp_type,
        attention_kernel=attention_kernel,
        selective=ac.selective,
        ac_workarounds=ac.workarounds,
        fsdp=FSDPPlan(
            param_dtype=parallel.fsdp.param_dtype,
            reduce_dtype=parallel.fsdp.reduce_dtype,
            reshard_after_forward=parallel.fsdp.reshard_after_forward,
            forward_prefetch=parallel.fsdp.forward_prefetch,
            backward_prefetch=parallel.fsdp.backward_prefetch,
        ),
        compile=(
            CompilePlan(
                backend=compile.backend,
                fullgraph=compile.fullgraph,
                dynamic=compile.dynamic,
                recompile_limit=compile.recompile_limit,
                capture_scalar_outputs=compile.capture_scalar_outputs,
                dynamic_ints=compile.dynamic_ints,
            )
            if compile_enabled
            else None
        ),
        backends=(("linear", backend.linear), ("rms_norm", backend.rms_norm), ("attention", attention_kernel)),
        workarounds=_run_workarounds(blocks, compile=compile, ac=ac, torch_version=torch_version),
        mixer_kernels=tuple(mixer_kernels.items()),
    )


def _run_workarounds(
    blocks: tuple[BlockPlan, ...],
    *,
    compile: CompileConfig,
    ac: ActivationCheckpointingConfig,
    torch_version: str | None,
) -> tuple[str, ...]:
    """The registry's workarounds this run switches on (version gate and layout both)."""
    selective_with_fixes = ac.mode == "selective" and ac.workarounds
    ac_outer = any(b.compile_layout == "ac_outer" for b in blocks)
    used = {
        "profiler_ops_in_sac": selective_with_fixes,
        "fsdp_hooks_in_sac": selective_with_fixes,
        "forward_thread_compile_config": any(FORWARD_THREAD_COMPILE in b.recompute_contexts for b in blocks),
        "compiled_regions_under_sac": ac_outer and compile.backend == "inductor",
        "dynamic_per_batch_ints": compile.enabled and compile.dynamic_ints,
    }
    return tuple(
        name for name, needed in used.items() if needed and workaround(name).active(torch_version=torch_version)
    )
