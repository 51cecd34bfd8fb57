"""Every torch failure nemo_ac works around, in one table: what it prevents, where the fix lives, when it can go.

``nemo-ac doctor`` (each probe names a failure row, each check a technique row; every row has one, and a failure
row's ``delete_when`` names the probe that tells), ``nemo_ac.compat`` (``status`` reads the gates) and the README's
table (``python -m nemo_ac.workarounds --markdown``, checked by a test) read this registry instead of keeping lists
of their own. A new workaround is a module in this package that opens with the error it prevents, the torch versions
affected, the upstream issues and their state and the condition for deleting it, plus one row here.

Two kinds of row. A ``failure`` row is a torch failure nemo_ac prevents (the README's table lists these). A
``technique`` row is a private torch API nemo_ac relies on without a failure of its own (re-classed SAC modes,
Dynamo's compile callbacks, ...): its ``error`` field says what it relies on, its module opens with a ``Relies on:``
line, and ``nemo-ac doctor`` checks on the installed torch that the API is still there and behaves as relied on
(``doctor.checks``). Private torch outside this package fails ``tests/unit/workarounds/test_private_torch_boundary.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from nemo_ac.workarounds.gates import GATES, gate_active


@dataclass(frozen=True)
class Upstream:
    """An upstream issue or pull request and its state when last checked (the date is in ``CHECKED``)."""

    ref: str  # owner/repo#number
    state: str  # open | closed | closed unmerged | merged
    what: str

    @property
    def url(self) -> str:
        repo, number = self.ref.split("#")
        return f"https://github.com/{repo}/issues/{number}"


@dataclass(frozen=True)
class Workaround:
    """One row: a torch failure and nemo_ac's fix for it, or a private torch technique nemo_ac relies on."""

    name: str  # the module under nemo_ac.workarounds, and the key in gates.GATES when gated
    title: str
    error: str  # failure: the error it prevents, short (the module docstring quotes it whole); technique: what it
    # relies on (the module's "Relies on:" line)
    applied: str  # where nemo_ac applies it
    compat: str  # what another FSDP2 trainer calls (nemo_ac.compat), or "" when it is internal to nemo_ac
    upstream: tuple[Upstream, ...]
    delete_when: str
    gated: bool = True  # False: not version gated (asks torch at import, or costs nothing and always applies)
    # For rows that are not version gated but ask torch: "function" in the row's module returning whether it is needed.
    needed_probe: str = ""
    kind: Literal["failure", "technique"] = "failure"

    @property
    def module(self) -> str:
        return f"nemo_ac.workarounds.{self.name}"

    def torch_versions(self) -> str:
        if self.kind == "technique":
            return "checked by nemo-ac doctor"
        if not self.gated:
            return "asked of torch at import" if self.needed_probe else "every release"
        return GATES[self.name].describe()

    def active(self, *, torch_version: str | None = None) -> bool:
        """Whether nemo_ac applies it on ``torch_version`` (default: the running torch). Rows that ask torch answer
        for the running torch; the others that are not gated always apply."""
        if self.gated:
            return gate_active(self.name, torch_version=torch_version)
        if self.needed_probe:
            return bool(getattr(importlib.import_module(self.module), self.needed_probe)())
        return True


CHECKED = "2026-12-01"

# Torch failures nemo_ac prevents (the README's table).
FAILURES: tuple[Workaround, ...] = (
    Workaround(
        name="profiler_ops_in_sac",
        title="FSDP2 record_function profiler ops inside a SAC region",
        error="profiler._record_function_enter_new.default ... encountered during backward but not found in storage",
        applied="every SAC context factory (activation_checkpointing.contexts)",
        compat="compat.install()",
        upstream=(
            Upstream("pytorch/pytorch#185178", "closed unmerged", "ignore the profiler ops in SAC"),
            Upstream("pytorch/pytorch#196862", "closed unmerged", "FSDP all-gather internals bypass SAC"),
            Upstream("pytorch/torchtitan#3427", "closed", "DeepSeek V3 FSDP+EP selective AC replay mismatch"),
        ),
        delete_when="torch lists the profiler ops in SAC_IGNORED_OPS (doctor: upstream_profiler_ignore fixed)",
    ),
    Workaround(
        name="fsdp_hooks_in_sac",
        title="FSDP2 all-gather inside a SAC region under explicit prefetch",
        error="fsdp.all_gather_copy_in.default encountered during backward but not found in storage",
        applied="parallelize, after fully_shard, selective AC only",
        compat="compat.protect_fsdp_units(model) + compat.selective_checkpoint_context_fn",
        upstream=(Upstream("pytorch/pytorch#196862", "closed unmerged", "scoped SAC bypass around FSDP all-gather"),),
        delete_when="torch keeps FSDP2 runtime ops out of SAC (doctor: sac_fsdp_prefetch passes without it)",
    ),
    Workaround(
        name="forward_thread_compile_config",
        title="AC(compile(block)) recompute compiling with the autograd thread's Dynamo config",
        error="torch._dynamo hit config.recompile_limit (8), then CheckpointError: Recomputed values ... different "
        "metadata",
        applied="checkpoint context of every ac_outer block",
        compat="compat.forward_thread_compile_context / compat.add_recompute_context(model)",
        upstream=(
            Upstream("pytorch/pytorch#186537", "open", "torch 2.12 regression: per-thread compile config"),
            Upstream("pytorch/pytorch#191777", "open", "torch.autograd.graph.AutogradContextVar"),
            Upstream("pytorch/pytorch#186583", "closed", "propagate contextvars to Python autograd functions"),
        ),
        delete_when="backward-thread callbacks see the launching thread's context (doctor: thread_config, "
        "recompute_thread)",
    ),
    Workaround(
        name="compiled_regions_under_sac",
        title="selective AC caching buffers inside inductor-compiled code",
        error="silently wrong gradients, or: Tensor cached during selective activation checkpoint has been mutated",
        applied="torch.compile options of every ac_outer block; SAC modes pass the region through",
        compat="compat.ac_outer_compile_kwargs(kwargs) + compat.selective_checkpoint_context_fn",
        upstream=(),
        delete_when="torch's SAC treats inductor_compiled_code as opaque and uncached by default (doctor: "
        "sac_compiled_regions not affected)",
    ),
    Workaround(
        name="dynamic_per_batch_ints",
        title="per-micro-batch ints (document lengths, ring CP offsets) specialized by Dynamo",
        error="torch._dynamo hit config.recompile_limit (8), then the block runs eagerly (silent)",
        applied="compile settings of every compiled block (compile.dynamic_ints); token dims at nested FSDP unit "
        "calls (distributed.compile.boundaries) and, when rows vary in length (CompilePlan.dynamic_rows), at each "
        "compiled block's entry (distributed.compile.apply)",
        compat="",
        upstream=(),
        delete_when="never as such: it is how Dynamo is told; drop names the model no longer passes (doctor: "
        "dynamic_ints not affected: Dynamo no longer specializes them)",
    ),
    Workaround(
        name="grouped_mm_fake_rule",
        title="aten._grouped_mm's fake rule accepts bf16 only",
        error="Expected inputs of BF16 type but got mat_a.dtype=torch.float32",
        applied="experts impl grouped_mm in fp32 / fp16 (models.kernels.grouped_gemm)",
        compat="",
        upstream=(),
        delete_when="aten_grouped_mm_traceable(torch.float32) on every supported torch (doctor: grouped_mm_fake not "
        "affected)",
        gated=False,
        needed_probe="custom_op_needed",
    ),
    Workaround(
        name="softplus_backward_layout",
        title="compiled softplus_backward assumes a contiguous gradient",
        error="view size is not compatible with input tensor's size and stride",
        applied="Gated DeltaNet's decay (models.layers.gated_deltanet)",
        compat="",
        upstream=(),
        delete_when="a compiled Gated DeltaNet block with F.softplus passes its tests on every supported torch "
        "(doctor: softplus_layout not affected)",
        gated=False,
    ),
    Workaround(
        name="rendezvous_shared_store",
        title="torchrun restarts reading the killed attempt's rendezvous",
        error="Gloo connectFullMesh failed ... Connection refused (or a hang) after --max-restarts",
        applied="nemo-ac train --max-restarts sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; train.py warns",
        compat="",
        upstream=(Upstream("pytorch/pytorch#135712", "closed", "shared store vs restarts; fixed in 2.5 by #135957"),),
        delete_when="the rendezvous store is per attempt on every supported torch (doctor: rendezvous_restart not "
        "affected)",
        gated=False,
    ),
)


def technique(
    *,
    name: str,
    title: str,
    relies_on: str,
    applied: str,
    delete_when: str,
    compat: str = "",
    upstream: tuple[Upstream, ...] = (),
) -> Workaround:
    """A technique row: never version gated (``nemo-ac doctor`` checks the API on the installed torch), ``error``
    holding what it relies on."""
    return Workaround(
        name=name,
        title=title,
        error=relies_on,
        applied=applied,
        compat=compat,
        upstream=upstream,
        delete_when=delete_when,
        gated=False,
        kind="technique",
    )


# Private torch techniques nemo_ac relies on (no failure of their own); nemo-ac doctor checks each (doctor.checks).
TECHNIQUES: tuple[Workaround, ...] = (
    technique(
        name="sac_mode_passthrough",
        title="torch's SAC mode pair re-classed so that chosen ops pass through",
        relies_on="the private _CachingTorchDispatchMode / _CachedTorchDispatchMode classes (re-classed by __class__ "
        "assignment) and the higher-order-op redirects registered for them",
        applied="every nemo_ac SAC region (activation_checkpointing.contexts, compat.selective_checkpoint_context_fn)",
        compat="compat.selective_checkpoint_context_fn",
        upstream=(Upstream("pytorch/pytorch#196862", "closed unmerged", "scoped SAC bypass context"),),
        delete_when="fsdp_hooks_in_sac and compiled_regions_under_sac are deleted, or torch's SAC takes a "
        "pass-through predicate",
    ),
    technique(
        name="autograd_inside_op",
        title="autograd recorded inside a custom op's body",
        relies_on="torch._C._ForceDispatchKeyGuard and the thread's dispatch key sets (lifting the autograd exclusion "
        "torch sets around a custom op's body)",
        applied="backward ops of the fla / mamba-ssm mixer kernels (models.mixer_kernels)",
        delete_when="the kernels' backward is called directly, or torch.library offers a public way",
    ),
    technique(
        name="dynamo_compile_events",
        title="Dynamo's per-compile callbacks, counters and compile metrics",
        relies_on="torch._dynamo.callback_handler, torch._dynamo.utils.counters, "
        "torch._dynamo.utils.get_compilation_metrics",
        applied="diagnostics.recompiles (per-thread compile report), diagnostics.compile_progress, doctor isolation",
        delete_when="torch offers a public per-compile start/end hook and compile metrics",
    ),
    technique(
        name="dynamo_settings",
        title="Dynamo settings only its private config module holds",
        relies_on="torch._dynamo.config.recompile_limit and torch._dynamo.config.capture_scalar_outputs",
        applied="compile settings of every compiled block (compile.settings), doctor thread probes",
        delete_when="both settings are public (torch.compiler.config or torch.compile arguments)",
    ),
    technique(
        name="dynamo_disable_marker",
        title="which functions torch.compiler.disable wrapped",
        relies_on="the _torchdynamo_disable attribute of a Dynamo-disabled wrapper",
        applied="the plan's untraceable modules (distributed.untraceable)",
        delete_when="torch offers a public is_disabled query",
    ),
    technique(
        name="partitioner_op_list",
        title="torch's list of compute-intensive ops",
        relies_on="torch._functorch.partitioners.get_default_op_list().compute_intensive_ops",
        applied="nemo_ac's selective AC policy (activation_checkpointing.policy)",
        delete_when="the policy keeps its own complete list, or torch makes the list public",
    ),
    technique(
        name="fake_world",
        title="the fake process group, fake tensors and graph-task id of the dry run",
        relies_on="torch._subclasses.fake_tensor, torch._C._current_graph_task_id, torch._C._current_autograd_node, "
        "torch.distributed.distributed_c10d._resolve_process_group and DTensor's sharding propagator",
        applied="the full-size dry run (nemo_ac.simulate)",
        delete_when="torch has public equivalents (a documented fake world for estimation)",
    ),
    technique(
        name="node_shared_compile",
        title="one inductor compile per graph per node (the node's other ranks load it from the cache)",
        relies_on="torch._inductor.compile_fx.compile_fx (its inner_compile and config_patches arguments), "
        "compile_fx_inner, torch._inductor.runtime.cache_dir_utils.cache_dir and the fxgraph_cache_hit / "
        "fxgraph_cache_miss counters",
        applied="the torch.compile backend of every compiled block with backend inductor (distributed.compile.apply, "
        "compile.node_shared_cache); the compile summary's per-rank cache line (diagnostics.compile_caches)",
        delete_when="inductor serializes identical concurrent compiles on a node itself, or Dynamo shares one rank's "
        "compile with the node's other ranks",
    ),
    technique(
        name="shared_group_names",
        title="one name per mesh dim for the groups compiled collectives use (graphs equal across EP / CP groups)",
        relies_on="torch._C._distributed_c10d._register_process_group / _unregister_process_group and "
        "torch.distributed.distributed_c10d._resolve_process_group",
        applied="the CP ops' and the torch EP dispatcher's functional collectives when compile.node_shared_cache "
        "applies (distributed.context_parallel.apply_cp, distributed.expert_parallel.build_dispatcher)",
        delete_when="torch names a mesh dim's groups alike on every rank, or keys compiled collectives by an opaque "
        "group input instead of the group's name",
    ),
    technique(
        name="mem_tracker_global_peak",
        title="FSDPMemTracker keeping only the global peak (per-op cost grew with every module seen)",
        relies_on="MemTracker._update_peak_stats (overridden) and the tracker's _curr_mem_snap, _peak_mem, "
        "_peak_mem_snap, _depth and _root_mod",
        applied="the full-size dry run's memory estimate (nemo_ac.simulate)",
        delete_when="MemTracker offers a global-only mode or updates only the active modules' peaks",
    ),
)

WORKAROUNDS: tuple[Workaround, ...] = FAILURES + TECHNIQUES

_BY_NAME = {workaround.name: workaround for workaround in WORKAROUNDS}


def workaround(name: str) -> Workaround:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no workaround named {name!r}; known: {sorted(_BY_NAME)}") from None


def markdown_table() -> str:
    """The README's workaround table (between its ``workarounds`` markers): the failure rows."""
    lines = [
        "| workaround | the error it prevents | torch | upstream | in your own trainer |",
        "| --- | --- | --- | --- | --- |",
    ]
    for w in (row for row in WORKAROUNDS if row.kind == "failure"):
        upstream = ", ".join(f"[{u.ref.split('/')[-1]}]({u.url}) {u.state}" for u in w.upstream) or "none"
        lines.append(
            f"| [`{w.name}`](nemo_ac/workarounds/{w.name}.py): {w.title} | `{w.error}` | {w.torch_versions()} | "
            f"{upstream} | {f'`{w.compat}`' if w.compat else 'internal'} |"
        )
    return "\n".join(lines) + "\n"
