"""The one private-torch technique under nemo_ac's SAC fixes: torch's SAC mode pair, re-classed to let chosen ops
through.

Not a failure of its own; the means by which ``fsdp_hooks_in_sac`` and ``compiled_regions_under_sac`` take ops out of
SAC's counting, caching and replay without copying torch's SAC implementation. ``create_selective_checkpoint_contexts``
returns instances of the private ``_CachingTorchDispatchMode`` / ``_CachedTorchDispatchMode``; each instance is
re-classed (``__class__`` assignment) as a subclass with a mixin in front, so nemo_ac never calls the private
constructors (their signatures change between releases) and every other behaviour stays torch's.

Three private pieces, each in one function below:

- ``_as_passthrough_mode``: the ``__class__`` assignment.
- ``_choose_saved_tensors_hooks``: torch 2.14 added ``checkpoint(..., respect_saved_tensors_hooks=None|True|False)``
  (pytorch/pytorch#190581): whether the tensors SAC caches go through a surrounding ``saved_tensors_hooks`` context
  (``save_on_cpu``, an offloader, a memory spy). ``None``, the default, keeps the old behaviour (they bypass the
  hooks) and warns whenever such hooks are in scope::

      FutureWarning: A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation
      checkpoint region. Tensors that SAC saves currently bypass these hooks, but a future release will route them
      through the hooks like any other saved tensor. [...] passing respect_saved_tensors_hooks=True|False

  and the next step of torch's rollout (pytorch/pytorch#191236) makes ``None`` an error. torch hands the choice to
  the caching mode only when the ``context_fn``'s forward context *is* that mode; nemo_ac composes recompute
  contexts (SAC modes + forward-thread compile context), so the choice is set on the mode itself here, from the
  caller's explicit value (the mode's ``respect_saved_tensors_hooks`` attribute; absent before 2.14: nothing to
  choose).
- ``_inherit_hop_redirects``: torch registers how a higher-order op (``inductor_compiled_code``, ``flex_attention``,
  ``invoke_subgraph``, ...) meets a SAC mode with ``redirect_to_mode(hop, _CachingTorchDispatchMode)``, looked up by
  the mode's *exact* type; a subclass instance otherwise fails with::

      NotImplementedError: There was no rule registered for HigherOrderOperator inductor_compiled_code and mode
      NemoAC_CachingTorchDispatchMode

Relies on: the private _CachingTorchDispatchMode / _CachedTorchDispatchMode classes (re-classed by __class__
assignment) and the higher-order-op redirects registered for them.
Torch versions: checked on 2.13.0 (this tree's tests); nemo_ac supports 2.12 - 2.15 (``workarounds.gates``);
``nemo-ac doctor`` (check ``sac_mode_passthrough``) re-classes the modes on the installed torch and runs a region
through them.
Upstream: pytorch/pytorch#196862 (a scoped SAC bypass context; closed unmerged).
Delete when: the workarounds that use it are deleted, or torch's SAC takes a pass-through predicate itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

PassesThrough = Callable[[Any], bool]  # op -> run it directly, uncounted
ExplainError = Callable[[RuntimeError], BaseException | None]  # a storage error -> a clearer one, or None


class _PassthroughCachingMixin:
    """Forward (caching) mode: ops the predicate names run directly; ``on_region_start`` runs on entry."""

    _nemo_passes_through: PassesThrough = staticmethod(lambda func: False)
    _nemo_on_region_start: Callable[[], None] | None = None

    def __enter__(self):
        if self._nemo_on_region_start is not None:
            self._nemo_on_region_start()
        return super().__enter__()

    # Runs between compiled graphs of an AC(compile(block)) block; without this Dynamo compiles the mode itself
    # (once per thread, the backward thread included).
    @torch._disable_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._nemo_passes_through(func):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _PassthroughCachedMixin:
    """Recompute (cached) mode: the same pass-through; a storage error goes through ``explain`` first."""

    _nemo_passes_through: PassesThrough = staticmethod(lambda func: False)
    _nemo_explain: ExplainError | None = None

    @torch._disable_dynamo
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._nemo_passes_through(func):
            return func(*args, **(kwargs or {}))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as exc:
            explained = self._nemo_explain(exc) if self._nemo_explain is not None else None
            if explained is None:
                raise
            raise explained from exc


@functools.cache
def _region_class(base: type, mixin: type) -> type:
    return type(f"NemoAC{base.__name__}", (mixin, base), {})


def _inherit_hop_redirects(base: type, region_class: type) -> None:
    """Give the subclass torch's higher-order-op handling of its SAC mode. Checked on every region (cheap dict
    lookups) because HOP modules register lazily, on first import."""
    from torch._ops import _higher_order_ops

    for hop in list(_higher_order_ops.values()):
        table = getattr(hop, "python_key_table", {})
        if base in table and region_class not in table:
            hop.py_impl(region_class)(functools.partial(_redirect_hop_to_mode, hop))


def _redirect_hop_to_mode(hop: Any, mode: Any, *args: Any, **kwargs: Any) -> Any:
    return mode.__torch_dispatch__(hop, [], args, kwargs)


def _choose_saved_tensors_hooks(caching_mode: Any, respect: bool | None) -> None:
    """Set torch's SAC choice of whether cached tensors go through saved-tensor hooks (None: leave torch's default)."""
    if respect is not None and hasattr(caching_mode, "respect_saved_tensors_hooks"):
        caching_mode.respect_saved_tensors_hooks = respect


def checkpoint_takes_saved_tensors_hooks_choice() -> bool:
    """Whether ``torch.utils.checkpoint.checkpoint`` takes ``respect_saved_tensors_hooks`` (torch >= 2.14)."""
    return "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters


def _as_passthrough_mode(mode: Any, mixin: type, **attrs: Any) -> Any:
    base = type(mode)
    mode.__class__ = _region_class(base, mixin)
    _inherit_hop_redirects(base, mode.__class__)
    for name, value in attrs.items():
        setattr(mode, name, value)  # instance attributes: plain functions, never bound
    return mode


def is_torch_sac_mode(mode: Any) -> bool:
    """Whether ``mode`` is one of torch's SAC modes (``create_selective_checkpoint_contexts``), re-classed or not."""
    caching, cached = _torch_sac_mode_types()
    return isinstance(mode, (caching, cached))


def is_passthrough_mode(mode: Any) -> bool:
    """Whether ``mode`` is one of the pass-through modes this module makes."""
    return isinstance(mode, (_PassthroughCachingMixin, _PassthroughCachedMixin))


@functools.cache
def _torch_sac_mode_types() -> tuple[type, type]:
    caching, cached = create_selective_checkpoint_contexts([])
    return type(caching), type(cached)


def passthrough_sac_modes(
    policy: Callable[..., Any] | Sequence[Any],
    *,
    passes_through: PassesThrough,
    on_region_start: Callable[[], None] | None = None,
    explain_storage_error: ExplainError | None = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> tuple[Any, Any]:
    """torch's SAC ``(caching, cached)`` modes for ``policy`` (what ``create_selective_checkpoint_contexts`` takes),
    in which every op ``passes_through(op)`` accepts runs directly: neither counted, cached nor replayed.

    on_region_start: called when the forward region starts (reset per-thread bracket state).
    explain_storage_error: maps torch's "... not found in storage" RuntimeError to a clearer exception (None: keep).
    respect_saved_tensors_hooks: whether the tensors SAC caches go through surrounding saved-tensor hooks (torch >=
        2.14, see the module docstring); None leaves torch's default (its FutureWarning included).
    """
    caching, cached = create_selective_checkpoint_contexts(policy)
    _choose_saved_tensors_hooks(caching, respect_saved_tensors_hooks)
    return (
        _as_passthrough_mode(
            caching,
            _PassthroughCachingMixin,
            _nemo_passes_through=passes_through,
            _nemo_on_region_start=on_region_start,
        ),
        _as_passthrough_mode(
            cached, _PassthroughCachedMixin, _nemo_passes_through=passes_through, _nemo_explain=explain_storage_error
        ),
    )
