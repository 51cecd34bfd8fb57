"""torch.compile of decoder blocks: layouts, the forward-thread compile context, and dynamic per-batch ints.

Layouts (``compile.layout``), resolved per block by ``plan_layouts``:

- ``compile_outer`` = compile(AC(block)): Dynamo traces the checkpoint as a higher-order op and the partitioner
  plans the recompute inside one graph (the fast layout). A graph break inside a traced checkpoint cannot be
  split, so Dynamo skips the whole region: a block whose nested FSDP unit (experts / fp32 router) runs FSDP2 hooks
  (``torch._dynamo.disable``-d) would run *entirely eagerly*, silently.
- ``ac_outer`` = AC(compile(block)): the checkpoint runs eagerly around a compiled block; FSDP hooks of nested
  units graph-break into separate compiled pieces. The recompute re-enters Dynamo during backward, i.e. on the
  autograd device thread on GPU.
- ``auto``: ac_outer for blocks that hold a nested FSDP unit (or when AC sits outside the block's fully_shard,
  whose hooks then run inside the checkpoint), compile_outer otherwise.

Blocks are compiled in place by replacing the instance's ``forward`` with ``torch.compile(forward)`` (as
torchtitan's ``block.compile()``, parameter names stay the same: no ``_orig_mod``). Compiling ``forward`` rather
than the module (``nn.Module.compile`` compiles ``_call_impl``) keeps the block's own FSDP2 hooks outside the
compiled frame: with ``activation_checkpointing.placement: outside`` they sit on the compiled module itself and
would otherwise graph-break at the entry and exit of every block.

Why a forward-thread context (torch >= 2.12): ``torch._dynamo.config`` and ``torch.compiler.config`` are per thread
(every key is a ``ContextVar``). On GPU, backward runs on the autograd device thread, so the ac_outer recompute
compiles (after any cache miss, e.g. a global-state guard on that thread's intra-op thread count) with that
thread's *defaults*: recompile_limit 8, capture_scalar_outputs False, no dynamic_sources. Observed on torch 2.13:

- per-batch shapes / ints recompile until the limit, Dynamo runs the block eagerly while the forward ran compiled,
  and the replay fails: ``torch._dynamo hit config.recompile_limit (8)`` then ``CheckpointError:
  torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the
  forward pass.`` (under SAC also "... encountered during backward but not found in storage");
- the experts' ``tokens_per_expert.tolist()`` graph-breaks in the recompute only (capture_scalar_outputs False), so
  the recompute runs other graphs than the forward and even full AC fails with the same ``CheckpointError``.

``forward_thread_compile_context`` captures the forward thread's non-default compile settings when the checkpoint
runs its forward and re-applies them around the recompute, on whatever thread that is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig, MoEConfig
from nemo_ac.distributed.activation_checkpointing import ContextFn
from nemo_ac.distributed.blocks import decoder_layers, holds_nested_fsdp_unit, unwrap_block

Layout = Literal["compile_outer", "ac_outer"]

# --------------------------------------------------------------------------------------------------------------
# dynamic per-batch ints


@dataclass(frozen=True)
class DynamicArg:
    """One per-micro-batch value compiled as a symbol from the first compile.

    name: field or argument name as it appears in a Dynamo source (``L['attn'].max_seqlen``,
        ``L['attn'].context_parallel.max_seqlen_q``, ``L['max_seqlen']``); matched wherever it occurs, so metadata
        that moves into another dataclass (ring CP's inputs in ``AttentionInputs.context_parallel``) stays covered.
    dim: None for a Python int; ``N`` for dim ``N`` of a tensor whose length changes per batch.
    """

    name: str
    dim: int | None
    owner: str


DYNAMIC_INT_ARGS: tuple[DynamicArg, ...] = (
    DynamicArg("max_seqlen", None, "AttentionInputs / UlyssesAttentionInputs: longest document of the micro batch"),
    DynamicArg("cu_seqlens", 0, "AttentionInputs / UlyssesAttentionInputs: one entry per document + 1"),
    DynamicArg("max_seqlen_q", None, "ring CP (AttentionInputs.context_parallel): longest local query document"),
    DynamicArg("max_seqlen_k", None, "ring CP (AttentionInputs.context_parallel): longest key document"),
    DynamicArg("local_k_slice", None, "ring CP (AttentionInputs.context_parallel): first attendable key position"),
)


def dynamic_source_patterns(args: Sequence[DynamicArg] = DYNAMIC_INT_ARGS) -> str:
    """``torch.compiler.config.dynamic_sources`` entries (comma separated regexes, ``:N`` = tensor dim N).

    Why dynamic_sources and not mark_dynamic / mark_unbacked / shapes_spec: ``mark_dynamic`` marks tensor dims only
    (these are Python ints); ``mark_unbacked`` and torch 2.13's ``torch.compile(shapes_spec=)`` make *unbacked*
    symbols, which fail on any Python branch or guard over the value (ring CP slices with them) and need each
    compiled function's exact argument structure. dynamic_sources names sources by regex, marks them backed-dynamic
    on the first compile (so packed batches of any document layout share one graph), also in graph-break resume
    frames (same local names), and is dominant over ``dynamic=False``. Its one flaw, being per-thread config, is
    what the forward-thread context repairs.
    """
    entries = []
    for arg in args:
        name = re.escape(arg.name)
        pattern = rf".*(\.{name}|\['{name}'\])$"
        entries.append(pattern if arg.dim is None else f"{pattern}:{arg.dim}")
    return ",".join(entries)


def _merge_sources(current: str, extra: str) -> str:
    have = [s for s in current.split(",") if s]
    return ",".join(have + [s for s in extra.split(",") if s and s not in have])


# --------------------------------------------------------------------------------------------------------------
# nemo_ac's compile settings, scoped to the compiled blocks (no global config change)


@dataclass(frozen=True)
class CompileSettings:
    """The Dynamo settings nemo_ac's blocks compile under.

    recompile_limit: a block recompiles per distinct shape at most this often before Dynamo runs it eagerly (the
        default 8 is hit by packed variable-length data long before shapes settle).
    capture_scalar_outputs: the experts loop calls ``tokens_per_expert.tolist()``; True traces it into unbacked
        symints instead of a graph break (GroupedExperts impl ``loop``).
    dynamic_sources: ``dynamic_source_patterns()`` when ``compile.dynamic_ints`` (merged with the thread's own).
    """

    recompile_limit: int
    capture_scalar_outputs: bool
    dynamic_sources: str

    @classmethod
    def from_config(cls, config: CompileConfig) -> CompileSettings:
        return cls(
            recompile_limit=config.recompile_limit,
            capture_scalar_outputs=config.capture_scalar_outputs,
            dynamic_sources=dynamic_source_patterns() if config.dynamic_ints else "",
        )


@contextlib.contextmanager
def use_compile_settings(settings: CompileSettings) -> Iterator[None]:
    """Apply ``settings`` on the calling thread for the duration (``config.patch``: thread-local, restored)."""
    dynamo_config = torch._dynamo.config
    compiler_config = torch.compiler.config
    dynamo = {
        key: value
        for key, value in (
            ("recompile_limit", settings.recompile_limit),
            ("capture_scalar_outputs", settings.capture_scalar_outputs),
        )
        if getattr(dynamo_config, key) != value
    }
    merged = _merge_sources(compiler_config.dynamic_sources, settings.dynamic_sources)
    compiler = {"dynamic_sources": merged} if merged != compiler_config.dynamic_sources else {}
    with _patched(dynamo_config, dynamo), _patched(compiler_config, compiler):
        yield


@contextlib.contextmanager
def _patched(module: ModuleType, changes: Mapping[str, Any]) -> Iterator[None]:
    """``module.patch(changes)`` without its cost: ``ConfigModule.patch`` defines a class per call (~0.3 ms, paid
    per block per micro batch here); plain setattr / restore is ~30 us and has the same thread-local effect."""
    if not changes:
        yield
        return
    prior = {key: getattr(module, key) for key in changes}
    try:
        for key, value in changes.items():
            setattr(module, key, value)
        yield
    finally:
        for key, value in prior.items():
            setattr(module, key, value)


# --------------------------------------------------------------------------------------------------------------
# the forward-thread compile context (a recompute context for AC wrappers)

# Config modules whose values are per thread (torch >= 2.12) and shape what a recompute compiles: Dynamo (limits,
# dynamic_sources via torch.compiler, capture_scalar_outputs, skip_fwd_side_effects_in_bwd_under_checkpoint, ...),
# AOTAutograd's partitioner (torch._functorch.config) and Inductor's code generation.
_THREAD_CONFIG_MODULES = (
    "torch._dynamo.config",
    "torch.compiler.config",
    "torch._functorch.config",
    "torch._inductor.config",
)

# If a torch release drops ConfigModule._get_dict, capture at least these (the ones the failure above needs).
_FALLBACK_KEYS = {
    "torch._dynamo.config": (
        "recompile_limit",
        "accumulated_recompile_limit",
        "capture_scalar_outputs",
        "capture_dynamic_output_shape_ops",
        "automatic_dynamic_shapes",
        "assume_static_by_default",
        "specialize_int",
        "allow_unspec_int_on_nn_module",
        "skip_fwd_side_effects_in_bwd_under_checkpoint",
        "fail_on_recompile_limit_hit",
    ),
    "torch.compiler.config": ("dynamic_sources", "unbacked_sources"),
}


@functools.cache
def _config_modules() -> tuple[tuple[str, ModuleType], ...]:
    found = []
    for name in _THREAD_CONFIG_MODULES:
        try:
            found.append((name, importlib.import_module(name)))
        except ImportError:
            continue
    return tuple(found)


def _non_default_values(name: str, module: ModuleType) -> dict[str, Any]:
    """The values this thread changed from their defaults.

    Uses the private ``ConfigModule._get_dict(skip_default=True, readonly_values=True)`` (cached per thread, so a
    capture per checkpoint call costs microseconds); resolved defensively, falling back to an explicit key list.
    """
    get_dict = getattr(module, "_get_dict", None)
    if get_dict is not None:
        try:
            return dict(get_dict(skip_default=True, readonly_values=True))
        except TypeError:
            pass
    return {key: getattr(module, key) for key in _FALLBACK_KEYS.get(name, ()) if hasattr(module, key)}


def capture_thread_compile_config() -> dict[str, dict[str, Any]]:
    """This thread's non-default compile settings, per config module name."""
    return {name: _non_default_values(name, module) for name, module in _config_modules()}


def _differs(module: ModuleType, key: str, value: Any) -> bool:
    try:
        return bool(getattr(module, key) != value)
    except Exception:  # an exotic value without a usable __eq__: set it anyway
        return True


@contextlib.contextmanager
def apply_thread_compile_config(captured: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """Set the captured values on the calling thread (only those that differ) for the duration."""
    modules = dict(_config_modules())
    with contextlib.ExitStack() as stack:
        for name, values in captured.items():
            module = modules.get(name)
            if module is None:
                continue
            changes = {key: value for key, value in values.items() if _differs(module, key, value)}
            stack.enter_context(_patched(module, changes))
        yield


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def forward_thread_compile_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """A checkpoint ``context_fn``: capture now (forward thread), re-apply around the recompute (any thread).

    When the checkpoint itself is being traced (``torch.compiler.is_compiling()``: a compile(AC(...)) region) the
    recompute is planned inside the graph and no thread re-enters Dynamo, so nothing is captured. Under compile
    torch asserts "In torch.compile mode, `context_fn` arg passed to `torch.utils.checkpoint` must generate a
    tuple of two `TorchDispatchMode`s" (2.13), so that case returns the pair Dynamo itself uses for plain AC (every
    op PREFER_RECOMPUTE) instead of null contexts. nemo_ac attaches this context only to ac_outer blocks, where the
    checkpoint runs eagerly (``recompute_context_fns``).
    """
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_always_recompute)
    return contextlib.nullcontext(), apply_thread_compile_config(capture_thread_compile_config())


# --------------------------------------------------------------------------------------------------------------
# layouts and apply_compile


def resolve_layout(
    block: nn.Module, *, config: CompileConfig, moe: MoEConfig, activation_checkpointing: ActivationCheckpointingConfig
) -> Layout | None:
    """The layout of one block (None: compile disabled). Without AC there is no checkpoint to be inside or
    outside of: the block is compiled whole (reported as compile_outer)."""
    if not config.enabled:
        return None
    if activation_checkpointing.mode == "none":
        return "compile_outer"
    if config.layout != "auto":
        return config.layout
    if activation_checkpointing.placement == "outside" or holds_nested_fsdp_unit(block, moe=moe):
        return "ac_outer"
    return "compile_outer"


def plan_layouts(
    model: nn.Module,
    *,
    config: CompileConfig,
    moe: MoEConfig,
    activation_checkpointing: ActivationCheckpointingConfig,
) -> list[Layout | None]:
    """Per-block layouts, decided before AC wraps the blocks (AC needs them: only ac_outer blocks get the
    forward-thread context)."""
    return [
        resolve_layout(block, config=config, moe=moe, activation_checkpointing=activation_checkpointing)
        for block in decoder_layers(model)
    ]


def recompute_context_fns(
    config: CompileConfig, *, layouts: Sequence[Layout | None]
) -> Callable[[int, nn.Module], list[ContextFn]]:
    """Per block (index, block): the recompute contexts this concern adds to its activation checkpoint.

    Only ac_outer blocks re-enter Dynamo in the recompute. A compile_outer block must not get one: any
    ``context_fn`` replaces Dynamo's own plain-AC tagging, and composed with SAC modes it is no
    ``TorchDispatchMode`` pair, which torch rejects under compile (see ``forward_thread_compile_context``).
    """

    def for_block(index: int, block: nn.Module) -> list[ContextFn]:
        if config.enabled and config.forward_thread_context and layouts[index] == "ac_outer":
            return [forward_thread_compile_context]
        return []

    return for_block


def _supports_region_recompile_limit() -> bool:
    """torch 2.13 added ``torch.compile(..., recompile_limit=)``: a per-region limit applied inside Dynamo's frame
    conversion, so it holds on every thread (2.12 has only the per-thread config)."""
    try:
        return "recompile_limit" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return False


def _check_backend(config: CompileConfig) -> None:
    """An unknown backend name fails at parallelize time, naming the key (torch would fail at the first forward)."""
    try:
        known = set(torch._dynamo.list_backends(exclude_tags=()))
    except Exception:  # listing is best effort; torch.compile reports an unknown backend anyway
        return
    if config.backend not in known:
        raise ConfigError(
            ConfigIssue(
                "compile.backend",
                f"{config.backend!r} is not a registered torch.compile backend; use one of {sorted(known)}",
            )
        )


def compile_kwargs(config: CompileConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": config.backend, "fullgraph": config.fullgraph, "dynamic": config.dynamic}
    if _supports_region_recompile_limit():
        kwargs["recompile_limit"] = config.recompile_limit
    return kwargs


def ac_outer_region_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch.compile kwargs for a block compiled *inside* an activation checkpoint (ac_outer).

    Inductor wraps each compiled graph in the ``inductor_compiled_code`` higher-order op
    (``wrap_inductor_compiled_regions``), so the checkpoint's dispatch modes see one opaque op per compiled region
    instead of every op inductor's generated code calls. Without it, selective AC caches *references* to outputs of
    ops inside inductor code (a functional all-to-all, an extern matmul); inductor then reuses or writes those
    buffers in place later in the same graph, and the recompute replays overwritten data. Observed on torch 2.13
    with ring / ulysses CP under ac_outer + selective: wrong gradients without any error (grad norm 3.5% / 10%
    off), or, where a version counter is bumped, ``RuntimeError: Tensor cached during selective activation
    checkpoint has been mutated``. The SAC modes pass the wrapped region through (see activation_checkpointing).
    """
    if kwargs.get("backend") != "inductor":
        return kwargs
    options = {**(kwargs.get("options") or {}), "wrap_inductor_compiled_regions": True}
    return {**kwargs, "options": options}


def _scoped(forward: Callable[..., Any], settings: CompileSettings) -> Callable[..., Any]:
    @functools.wraps(forward)
    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by an enclosing compile: its settings rule, no config writes
            return forward(*args, **kwargs)
        with use_compile_settings(settings):
            return forward(*args, **kwargs)

    return scoped_forward


@dataclass(frozen=True)
class CompiledBlock:
    index: int
    layout: Layout
    compiled: str  # class name of the module whose forward was compiled
    # (co_filename, co_firstlineno) of that forward when it traces a checkpoint (compile(AC(block))), for
    # CompileAccounting's empty-graph check; None otherwise.
    checkpoint_entry: tuple[str, int] | None = None


def apply_compile(model: nn.Module, *, config: CompileConfig, layouts: Sequence[Layout | None]) -> list[CompiledBlock]:
    """Compile every decoder block in place according to ``layouts`` (from ``plan_layouts``; after AC).

    compile_outer: the layer's forward (the AC wrapper's, or the bare block's without AC) is compiled.
    ac_outer: the block under the AC wrapper is compiled; the wrapper stays eager.
    Either way the layer's outer forward runs under ``CompileSettings`` (thread-local ``config.patch``), so the
    forward compiles with them and the forward-thread context captures them for the recompute.
    """
    if not config.enabled:
        return []
    _check_backend(config)
    kwargs = compile_kwargs(config)
    settings = CompileSettings.from_config(config)
    layers = decoder_layers(model)
    if len(layouts) != len(layers):
        raise ValueError(f"{len(layouts)} layouts for {len(layers)} decoder layers")
    report = []
    for index, (outer, layout) in enumerate(zip(layers, layouts)):
        if layout is None:
            continue
        inner = unwrap_block(outer)
        target = inner if layout == "ac_outer" and inner is not outer else outer
        if getattr(target, "_nemo_ac_compiled", False):
            raise RuntimeError(f"model.layers.{index} is already compiled")
        entry = _code_key(target.forward) if target is not inner else None
        region_kwargs = ac_outer_region_kwargs(kwargs) if target is inner and inner is not outer else kwargs
        target.forward = torch.compile(target.forward, **region_kwargs)
        target._nemo_ac_compiled = True
        target._nemo_ac_checkpoint_entry = entry
        outer.forward = _scoped(outer.forward, settings)
        outer._nemo_ac_compile_layout = layout
        report.append(CompiledBlock(index=index, layout=layout, compiled=type(target).__name__, checkpoint_entry=entry))
    return report


def compiled_layouts(model: nn.Module) -> list[Layout | None]:
    """The layout each decoder layer was compiled with (None: not compiled), e.g. for the run's log."""
    return [getattr(layer, "_nemo_ac_compile_layout", None) for layer in decoder_layers(model)]


def compiled_checkpoint_entries(model: nn.Module) -> list[tuple[str, int]]:
    """Code keys of the compile(AC(block)) entry frames, for ``CompileAccounting(watch_checkpoint_entries=)``."""
    return sorted(
        {key for module in model.modules() if (key := getattr(module, "_nemo_ac_checkpoint_entry", None)) is not None}
    )


def _code_key(fn: Callable[..., Any]) -> tuple[str, int] | None:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code is not None else None
