"""Activation checkpointing of decoder blocks: modes none, full and selective (SAC).

Blocks are wrapped with torch's non-reentrant ``checkpoint_wrapper`` (DCP and HF export strip its
``_checkpoint_wrapped_module`` prefix, so checkpoint keys keep the HF names). Every wrapper gets one
``context_fn`` composed from independent recompute contexts (the SAC caching modes, the forward-thread compile
context, ...) so each concern stays in its own module.

Selective mode saves what is expensive or unstable to recompute and recomputes the rest:

- compute-intensive ops from torch's partitioner list (attention, convolution, ...), every other matmul
  (torchtitan's policy; ``selective.save_every_other_mm: false`` saves all);
- router top-k / sort outputs, so the recompute routes every token to the same experts (with
  ``tokens_per_expert.tolist()`` in the experts loop a different routing would change the op stream itself);
- outputs of functional collectives (all-to-all, reduce-scatter, all-gather; DeepEP dispatch/combine when those
  ops are registered), so the recompute does not communicate again;
- never an op that mutates an input (``aten.copy_``, ``scatter_``, FSDP's copy-out): replaying a cached result
  skips the mutation, e.g. ``inverse_permutation``'s ``inv.scatter_`` or FSDP filling unsharded parameters.

The decision for an op depends only on the op and its position in *this* region invocation (a fresh policy, with
fresh counters, per ``context_fn`` call), so forward and recompute agree. The two FSDP2 workarounds that keep the
op stream itself identical live in ``sac_compat``; the SAC modes here are torch's, subclassed per instance to pass
FSDP's hook ops through and to explain a desync (``nemo_ac.diagnostics.sac_explain``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nemo_ac.config.schema import ActivationCheckpointingConfig, MoEConfig, SelectiveACConfig
from nemo_ac.diagnostics.sac_explain import DecisionLog, explain_sac_desync
from nemo_ac.distributed.blocks import decoder_layers, decoder_layers_path, holds_nested_fsdp_unit, vision_blocks
from nemo_ac.distributed.sac_compat import (
    ensure_profiler_ops_sac_ignored,
    fsdp_hook_running,
    install_fsdp_hooks_outside_sac,
    reset_fsdp_hook_state,
)
from nemo_ac.models.common import grouped_gemm as _registers_grouped_mm_op  # noqa: F401  (torch.ops.nemo_ac.grouped_mm)

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


def compose_context_fns(context_fns: Sequence[ContextFn]) -> ContextFn:
    """One ``context_fn`` that enters each given pair: forward contexts in order, recompute contexts in order."""
    fns = list(context_fns)

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        pairs = [fn() for fn in fns]
        return _enter_all([p[0] for p in pairs]), _enter_all([p[1] for p in pairs])

    return context_fn


def _enter_all(managers: list[AbstractContextManager]) -> AbstractContextManager:
    if not managers:
        return contextlib.nullcontext()
    if len(managers) == 1:
        return managers[0]
    stack = contextlib.ExitStack()

    class _All(contextlib.AbstractContextManager):
        def __enter__(self):
            for manager in managers:
                stack.enter_context(manager)
            return self

        def __exit__(self, *exc):
            return stack.__exit__(*exc)

    return _All()


# ------------------------------------------------------------------------------------------------------------
# SAC policy


def _packets(*qualified: str) -> frozenset:
    """OpOverloadPackets by ``ns::name``, skipping those this torch build lacks (optional kernels, DeepEP)."""
    found = set()
    for name in qualified:
        namespace, op = name.split("::")
        try:
            found.add(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


_MATMULS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "nemo_ac::grouped_mm",  # the traceable fp32 grouped GEMM (nemo_ac.models.common.grouped_gemm)
)
_MATMULS_OPTIONAL = ("aten::_scaled_grouped_mm",)
_ATTENTION = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
)
_ROUTER = ("aten::topk", "aten::sort")
_COMMUNICATION = (
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::all_reduce",
    "_c10d_functional_autograd::all_to_all_single",
    "_c10d_functional_autograd::reduce_scatter_tensor",
    "_c10d_functional_autograd::all_gather_into_tensor",
    # DeepEP dispatch/combine, when an adapter registers them as torch ops.
    "deep_ep::dispatch",
    "deep_ep::combine",
    "nemo_ac::deepep_dispatch",
    "nemo_ac::deepep_combine",
)
# Never cached: profiler ranges and FSDP2's parameter management (see sac_compat) and eager c10d collectives.
_NEVER_CACHED_NAMESPACES = ("profiler", "fsdp", "c10d")


def _compute_intensive_packets() -> frozenset:
    """torch's partitioner list of compute-intensive ops (what its min-cut prefers to save). Private; resolved
    defensively, falling back to the matmul/attention lists above."""
    try:
        from torch._functorch.partitioners import get_default_op_list

        return frozenset(get_default_op_list().compute_intensive_ops)
    except (ImportError, AttributeError):
        return frozenset()


@dataclass(frozen=True)
class PolicyRules:
    """What a selective region saves, resolved once per factory (op lookups are not free)."""

    matmuls: frozenset
    compute_intensive: frozenset
    router: frozenset
    communication: frozenset
    save_every_other_mm: bool
    save_router: bool
    save_communication: bool

    @classmethod
    def build(cls, config: SelectiveACConfig, *, extra_save_ops: Sequence[Any] = ()) -> PolicyRules:
        matmuls = _packets(*_MATMULS, *_MATMULS_OPTIONAL)
        extra = frozenset(getattr(op, "overloadpacket", op) for op in extra_save_ops)
        return cls(
            matmuls=matmuls,
            compute_intensive=(_compute_intensive_packets() | _packets(*_ATTENTION) | extra) - matmuls,
            router=_packets(*_ROUTER),
            communication=_packets(*_COMMUNICATION),
            save_every_other_mm=config.save_every_other_mm,
            save_router=config.save_router,
            save_communication=config.save_communication,
        )


def _is_mutating(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", False))


class SelectivePolicy:
    """The SAC policy of ONE region invocation: ``(ctx, func, *args, **kwargs) -> CheckpointPolicy``.

    A new instance per ``context_fn`` call, so the matmul counter restarts for every block and every micro batch
    (a shared global counter would flip decisions between blocks and between forward and recompute). torch 2.13
    calls the policy only in forward; releases that also call it in recompute get their own counter per pass
    (``ctx.is_recompute``), which gives the same sequence of decisions.
    """

    def __init__(self, *, rules: PolicyRules, region: str = "", log: DecisionLog | None = None) -> None:
        self.rules = rules
        self.region = region
        self.log = log
        self._matmul_count = {False: 0, True: 0}

    def decide(self, func: Any, *, is_recompute: bool = False) -> tuple[CheckpointPolicy, str]:
        rules = self.rules
        packet = getattr(func, "overloadpacket", func)
        namespace = getattr(func, "namespace", "")
        if namespace in _NEVER_CACHED_NAMESPACES:
            return CheckpointPolicy.PREFER_RECOMPUTE, "profiler/FSDP/eager-collective op: never cached"
        if _is_mutating(func):
            return CheckpointPolicy.PREFER_RECOMPUTE, "mutates an input: a cached replay would skip the mutation"
        if packet in rules.communication:
            if rules.save_communication:
                return CheckpointPolicy.MUST_SAVE, "collective output: recompute must not communicate again"
            return CheckpointPolicy.PREFER_RECOMPUTE, "collective (selective.save_communication=false)"
        if packet in rules.router:
            if rules.save_router:
                return CheckpointPolicy.MUST_SAVE, "router top-k/sort: expert assignment stable in recompute"
            return CheckpointPolicy.PREFER_RECOMPUTE, "router op (selective.save_router=false)"
        if packet in rules.matmuls:
            self._matmul_count[is_recompute] += 1
            count = self._matmul_count[is_recompute]
            if rules.save_every_other_mm and count % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE, f"matmul #{count} in region: every other one recomputed"
            return CheckpointPolicy.MUST_SAVE, f"matmul #{count} in region: saved"
        if packet in rules.compute_intensive:
            return CheckpointPolicy.MUST_SAVE, "compute-intensive (torch partitioner list / attention)"
        return CheckpointPolicy.PREFER_RECOMPUTE, "cheap to recompute"

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision, reason = self.decide(func, is_recompute=bool(getattr(ctx, "is_recompute", False)))
        if self.log is not None and self.log.enabled:
            self.log.record(op=str(func), decision=decision.name, reason=reason, region=self.region)
        return decision


# ------------------------------------------------------------------------------------------------------------
# SAC modes: torch's pair, subclassed per instance


def _inductor_compiled_code_op() -> Any:
    try:
        from torch._higher_order_ops.wrap import inductor_compiled_code
    except ImportError:  # torch releases without the HOP cannot wrap compiled regions either
        return None
    return inductor_compiled_code


_INDUCTOR_COMPILED_CODE = _inductor_compiled_code_op()


def _passes_through(func: Any) -> bool:
    """Ops the SAC modes neither count, cache nor replay: FSDP2's hook ops (sac_compat) and whole inductor-compiled
    regions of an ac_outer block (``inductor_compiled_code``, see ``compile.ac_outer_region_kwargs``).

    A compiled region is always recomputed: inductor owns its buffers, and torch keys its storage by the compiled
    callable's id, which changes whenever the recompute recompiles on another thread (the autograd device thread
    on GPU), turning a cached region into ``inductor_compiled_code ... not found in storage``.
    """
    return fsdp_hook_running() or (_INDUCTOR_COMPILED_CODE is not None and func is _INDUCTOR_COMPILED_CODE)


class _RegionCachingMixin:
    """Forward (caching) mode: FSDP2 hook ops and compiled regions pass through uncounted; a fresh region starts
    with no FSDP bracket open."""

    def __enter__(self):
        reset_fsdp_hook_state()
        return super().__enter__()

    # Runs between compiled graphs of an ac_outer block; without this Dynamo compiles the mode itself (once per
    # thread, the backward thread included).
    @torch._disable_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _passes_through(func):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _RegionCachedMixin:
    """Recompute (cached) mode: the same pass-through, and torch's storage error re-raised as SACDesyncError."""

    _nemo_region = ""
    _nemo_workarounds = True

    # Runs between compiled graphs of an ac_outer block; without this Dynamo compiles the mode itself (once per
    # thread, the backward thread included).
    @torch._disable_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _passes_through(func):
            return func(*args, **(kwargs or {}))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as exc:
            explained = explain_sac_desync(
                exc, region=self._nemo_region, torch_version=torch.__version__, workarounds=self._nemo_workarounds
            )
            if explained is None:
                raise
            raise explained from exc


@functools.cache
def _region_class(base: type, mixin: type) -> type:
    return type(f"NemoAC{base.__name__}", (mixin, base), {})


def _inherit_hop_redirects(base: type, region_class: type) -> None:
    """Give the subclass torch's higher-order-op handling of its SAC mode.

    torch registers how a HOP (``inductor_compiled_code``, ``flex_attention``, ``invoke_subgraph``, ...) meets the
    SAC modes with ``redirect_to_mode(hop, _CachingTorchDispatchMode)``, looked up by the mode's *exact* type; a
    subclass instance otherwise fails with ``NotImplementedError: There was no rule registered for
    HigherOrderOperator inductor_compiled_code and mode NemoAC_CachingTorchDispatchMode``. Checked on every region
    (cheap dict lookups) because HOP modules register lazily, on first import.
    """
    from torch._ops import _higher_order_ops

    for hop in list(_higher_order_ops.values()):
        table = getattr(hop, "python_key_table", {})
        if base in table and region_class not in table:
            hop.py_impl(region_class)(functools.partial(_redirect_hop_to_mode, hop))


def _redirect_hop_to_mode(hop: Any, mode: Any, *args: Any, **kwargs: Any) -> Any:
    return mode.__torch_dispatch__(hop, [], args, kwargs)


def _as_region_mode(mode: Any, mixin: type, **attrs: Any) -> Any:
    """Re-class one of torch's SAC modes (private classes ``_CachingTorchDispatchMode`` /
    ``_CachedTorchDispatchMode``) as a subclass with ``mixin`` in front. Only the instance changes; subclassing the
    returned object instead of constructing the private classes keeps us independent of their constructor
    signatures across torch releases."""
    base = type(mode)
    mode.__class__ = _region_class(base, mixin)
    _inherit_hop_redirects(base, mode.__class__)
    for name, value in attrs.items():
        setattr(mode, name, value)
    return mode


def make_selective_checkpoint_context_fn(
    *,
    config: SelectiveACConfig | None = None,
    region: str = "",
    workarounds: bool = True,
    extra_save_ops: Sequence[Any] = (),
) -> ContextFn:
    """The generic SAC context factory: ``context_fn() -> (caching mode, cached mode)`` for one region.

    workarounds: install the torch 2.13 profiler-op ignore (``ensure_profiler_ops_sac_ignored``); False only to
    observe the torch failure. (The FSDP-hook bracket is installed on the model after fully_shard, see
    ``install_sac_fsdp_workarounds``.)
    """
    config = config if config is not None else SelectiveACConfig()
    if workarounds:
        ensure_profiler_ops_sac_ignored()
    rules = PolicyRules.build(config, extra_save_ops=extra_save_ops)
    log = DecisionLog.from_env()

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        policy = SelectivePolicy(rules=rules, region=region, log=log)
        return selective_region_modes(policy, region=region, workarounds=workarounds)

    return context_fn


def selective_region_modes(
    policy: Callable[..., Any] | Sequence[Any], *, region: str = "", workarounds: bool = True
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """torch's SAC mode pair for ``policy`` (a policy function or a list of ops to save, as
    ``create_selective_checkpoint_contexts`` takes), as nemo_ac's region modes: FSDP2 hook ops (``sac_compat``
    brackets) and compiled regions pass through, and a storage error is re-raised as ``SACDesyncError`` naming
    ``region``. Public so trainers with their own policy get the same modes (``nemo_ac.compat``)."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    return (
        _as_region_mode(caching, _RegionCachingMixin),
        _as_region_mode(cached, _RegionCachedMixin, _nemo_region=region, _nemo_workarounds=workarounds),
    )


def make_moe_block_context_fn(
    *, config: SelectiveACConfig, region: str, workarounds: bool = True, extra_save_ops: Sequence[Any] = ()
) -> ContextFn:
    """SAC context factory for an MoE block that holds a nested FSDP unit (experts / fp32 router sharded on their
    own inside the checkpointed block): the layout whose FSDP2 hooks run inside the region on torch 2.13, so the
    profiler-op ignore is installed here too, explicitly, whatever the generic factory does."""
    if workarounds:
        ensure_profiler_ops_sac_ignored()
    return make_selective_checkpoint_context_fn(
        config=config, region=region, workarounds=workarounds, extra_save_ops=extra_save_ops
    )


# ------------------------------------------------------------------------------------------------------------
# wrapping


def wrap_block(block: nn.Module, *, context_fns: Sequence[ContextFn]) -> nn.Module:
    kwargs = {}
    if context_fns:
        kwargs["context_fn"] = compose_context_fns(context_fns)
    return checkpoint_wrapper(
        block,
        checkpoint_impl=CheckpointImpl.NO_REENTRANT,
        checkpoint_fn=functools.partial(checkpoint, use_reentrant=False),
        **kwargs,
    )


def block_context_fns(
    block: nn.Module,
    *,
    index: int,
    config: ActivationCheckpointingConfig,
    moe: MoEConfig | None,
    prefix: str = "model.layers",
) -> list[ContextFn]:
    """The mode's own recompute context for one block (empty for full AC); ``prefix.index`` names the region in
    SAC desync errors."""
    if config.mode != "selective":
        return []
    region = f"{prefix}.{index}"
    if moe is not None and holds_nested_fsdp_unit(block, moe=moe):
        return [make_moe_block_context_fn(config=config.selective, region=region, workarounds=config.workarounds)]
    return [
        make_selective_checkpoint_context_fn(config=config.selective, region=region, workarounds=config.workarounds)
    ]


def apply_ac(
    model: nn.Module,
    *,
    config: ActivationCheckpointingConfig,
    extra_context_fns: Sequence[ContextFn] | Callable[[int, nn.Module], Sequence[ContextFn]] = (),
    moe: MoEConfig | None = None,
) -> None:
    """Wrap every decoder block in place according to ``config.mode``.

    extra_context_fns: recompute contexts from other concerns (e.g. the forward-thread compile context), composed
    after the mode's own context (full AC: they are the only context). A callable ``(index, block) -> contexts``
    gives them per block (compile attaches its context only to blocks compiled inside the checkpoint).
    moe: the model's MoE config, to recognize blocks holding a nested FSDP unit (the MoE SAC path).
    """
    if config.mode == "none":
        return
    layers = decoder_layers(model)
    prefix = decoder_layers_path(model)
    for index, block in enumerate(layers):
        own = block_context_fns(block, index=index, config=config, moe=moe, prefix=prefix)
        extra = extra_context_fns(index, block) if callable(extra_context_fns) else extra_context_fns
        layers[index] = wrap_block(block, context_fns=[*own, *extra])
    # Vision blocks: the mode's own context only (they are never compiled, so no compile recompute context).
    visual = vision_blocks(model)
    for index, block in enumerate(visual or []):
        own = block_context_fns(block, index=index, config=config, moe=None, prefix="model.visual.blocks")
        visual[index] = wrap_block(block, context_fns=own)


def install_sac_fsdp_workarounds(model: nn.Module, *, config: ActivationCheckpointingConfig) -> int:
    """After fully_shard: run FSDP2's forward hooks outside the SAC modes (sac_compat). Returns the number of
    FSDP units bracketed (0 unless mode is selective with workarounds on)."""
    if config.mode != "selective" or not config.workarounds:
        return 0
    return install_fsdp_hooks_outside_sac(model)
