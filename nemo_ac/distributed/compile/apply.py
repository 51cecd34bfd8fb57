"""Compiling decoder blocks in place, in the layout the plan gives each block.

Blocks are compiled by replacing the instance's ``forward`` with ``torch.compile(forward)`` (as torchtitan's
``block.compile()``: parameter names stay the same, no ``_orig_mod``). Compiling ``forward`` rather than the module
(``nn.Module.compile`` compiles ``_call_impl``) keeps the block's own FSDP2 hooks outside the compiled frame: with
``activation_checkpointing.placement: outside`` they sit on the compiled module itself and would otherwise
graph-break at the entry and exit of every block.

Blocks of one class share one code object, so Dynamo keeps one cache for all of them: identical blocks reuse the
first block's graph, and a block of another layout (Qwen3.5's Gated DeltaNet block after its attention block)
compiles once more under the same code. Each compiled call names its block's layout
(``diagnostics.recompiles.compiling_layout``: the block class, its submodules' names and classes and the compile
layout), so the compile summary counts that compile as a new layout's first compile, not as a recompile.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.diagnostics.recompiles import compiling_layout
from nemo_ac.distributed.blocks import decoder_layers, unwrap_block
from nemo_ac.distributed.compile.boundaries import mark_unit_boundaries
from nemo_ac.distributed.compile.settings import CompileSettings, use_compile_settings
from nemo_ac.distributed.plan import CompileLayout, CompilePlan, ParallelPlan
from nemo_ac.workarounds.compiled_regions_under_sac import ac_outer_compile_kwargs
from nemo_ac.workarounds.dynamic_per_batch_ints import mark_row_dims
from nemo_ac.workarounds.node_shared_compile import node_shared_compile_kwargs


def _supports_region_recompile_limit() -> bool:
    """torch 2.13 added ``torch.compile(..., recompile_limit=)``: a per-region limit applied inside Dynamo's frame
    conversion, so it holds on every thread (2.12 has only the per-thread config)."""
    try:
        return "recompile_limit" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return False


def check_backend(backend: str) -> None:
    """An unknown backend name fails at parallelize time, naming the key (torch would fail at the first forward)."""
    try:
        known = set(torch.compiler.list_backends(exclude_tags=()))
    except Exception:  # listing is best effort; torch.compile reports an unknown backend anyway
        return
    if backend not in known:
        raise ConfigError(
            ConfigIssue(
                "compile.backend", f"{backend!r} is not a registered torch.compile backend; use one of {sorted(known)}"
            )
        )


def compile_kwargs(plan: CompilePlan) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": plan.backend, "fullgraph": plan.fullgraph, "dynamic": plan.dynamic}
    if _supports_region_recompile_limit():
        kwargs["recompile_limit"] = plan.recompile_limit
    return kwargs


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
    layout: CompileLayout
    compiled: str  # class name of the module whose forward was compiled
    # (co_filename, co_firstlineno) of that forward when it traces a checkpoint (compile(AC(block))), for
    # CompileAccounting's empty-graph check; None otherwise.
    checkpoint_entry: tuple[str, int] | None = None
    # The block layout its compiled calls run under ("block 0 (ac_outer)": the first block of that structure).
    layout_key: str = ""


def apply_compile(model: nn.Module, *, plan: ParallelPlan) -> list[CompiledBlock]:
    """Compile every decoder block in place as the plan says (after AC wrapped them).

    compile_outer: the layer's forward (the AC wrapper's, or the bare block's without AC) is compiled.
    ac_outer: the block under the AC wrapper is compiled, with inductor's compiled regions wrapped
    (``workarounds.compiled_regions_under_sac``); the wrapper stays eager. The calls of its nested FSDP units are
    eager boundaries whose token dims are marked dynamic (``boundaries``, at the block's first call: after
    ``fully_shard``).
    Either way the layer's outer forward runs under ``CompileSettings`` (thread-local), so the forward compiles with
    them and the forward-thread context captures them for the recompute.
    """
    if plan.compile is None:
        return []
    check_backend(plan.compile.backend)
    kwargs = compile_kwargs(plan.compile)
    settings = CompileSettings.from_config(plan.compile)
    layers = decoder_layers(model)
    block_plans = plan.decoder_blocks()
    if len(block_plans) != len(layers):
        raise ValueError(f"the plan has {len(block_plans)} blocks for {len(layers)} decoder layers")
    report = []
    layout_keys: dict[tuple[Any, ...], str] = {}
    for index, (outer, block_plan) in enumerate(zip(layers, block_plans)):
        layout = block_plan.compile_layout
        if layout is None:
            continue
        inner = unwrap_block(outer)
        if block_plan.checkpointed and inner is outer:
            raise RuntimeError(f"{block_plan.path}: the plan checkpoints it, but no AC wrapper was applied")
        # ac_outer compiles the block under its checkpoint; without a checkpoint the two layouts are one.
        compiles_inside_checkpoint = block_plan.checkpointed and layout == CompileLayout.AC_OUTER
        target = inner if compiles_inside_checkpoint else outer
        if is_compiled(target):
            raise RuntimeError(f"{block_plan.path} is already compiled")
        traces_checkpoint = block_plan.checkpointed and not compiles_inside_checkpoint
        entry = _code_key(target.forward) if traces_checkpoint else None
        region_kwargs = ac_outer_compile_kwargs(kwargs) if compiles_inside_checkpoint else kwargs
        if plan.compile.node_shared():  # after the inductor options are set: the backend carries them
            region_kwargs = node_shared_compile_kwargs(region_kwargs)
        layout_key = layout_keys.setdefault(block_structure(target, layout=layout), f"block {index} ({layout})")
        target.forward = _CompiledForward(
            torch.compile(target.forward, **region_kwargs),
            layout_key=layout_key,
            before_first_call=functools.partial(mark_unit_boundaries, inner, block_plan),
            dynamic_rows=plan.compile.dynamic_rows,
        )
        outer.forward = _scoped(outer.forward, settings)
        report.append(
            CompiledBlock(
                index=index,
                layout=layout,
                compiled=type(target).__name__,
                checkpoint_entry=entry,
                layout_key=layout_key,
            )
        )
    return report


def block_structure(module: nn.Module, *, layout: CompileLayout) -> tuple[Any, ...]:
    """What makes two blocks compile to the same graph: the compile layout and every submodule's name and class
    (as built, before ``fully_shard``). Blocks with equal structures share a layout key."""
    return (layout, *((name, type(child).__qualname__) for name, child in module.named_modules()))


class _CompiledForward:
    """A compiled bound forward, recognizable (a second apply_compile on the same block is an error); each call
    runs under its block's layout key for the compile accounting.

    ``dynamic_rows`` (``CompilePlan.dynamic_rows``: rows vary in length): each eager call marks the token dims of
    its inputs dynamic (``workarounds.dynamic_per_batch_ints.mark_row_dims``) before the compiled frame sees them,
    so the block's first compile is dynamic in the row length rather than static and recompiled at the next one.
    The mark is per tensor, and the hidden states are a new tensor at every block, hence every call."""

    def __init__(
        self,
        compiled: Callable[..., Any],
        *,
        layout_key: str,
        before_first_call: Callable[[], Any] | None = None,
        dynamic_rows: bool = False,
    ) -> None:
        self.compiled = compiled
        self.layout_key = layout_key
        self.before_first_call = before_first_call  # after fully_shard: boundaries.mark_unit_boundaries
        self.dynamic_rows = dynamic_rows
        functools.update_wrapper(self, compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by an enclosing compile: no thread-local writes in its graph
            return self.compiled(*args, **kwargs)
        if self.before_first_call is not None:
            self.before_first_call, pending = None, self.before_first_call
            pending()
        if self.dynamic_rows:
            mark_row_dims((args, kwargs))
        with compiling_layout(self.layout_key):
            return self.compiled(*args, **kwargs)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``apply_compile`` compiled this module's forward (possibly under its compile-settings scope)."""
    forward = module.__dict__.get("forward")
    for _ in range(4):  # scoped_forward -> _CompiledForward (functools.wraps keeps the chain in __wrapped__)
        if forward is None or isinstance(forward, _CompiledForward):
            break
        forward = getattr(forward, "__wrapped__", None)
    return isinstance(forward, _CompiledForward)


def _code_key(fn: Callable[..., Any]) -> tuple[str, int] | None:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code is not None else None
