"""Activation checkpointing of decoder blocks: modes none, full and selective.

Blocks are wrapped with torch's non-reentrant ``checkpoint_wrapper`` (DCP and HF export strip its
``_checkpoint_wrapped_module`` prefix, so checkpoint keys keep the HF names). Every wrapper gets one
``context_fn`` composed from independent recompute contexts (the SAC caching modes, the forward-thread compile
context, ...) so each concern stays in its own module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from nemo_ac.config.schema import ActivationCheckpointingConfig
from nemo_ac.distributed.blocks import decoder_layers

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


def apply_ac(
    model: nn.Module,
    *,
    config: ActivationCheckpointingConfig,
    extra_context_fns: Sequence[ContextFn] = (),
) -> None:
    """Wrap every decoder block in place according to ``config.mode``.

    extra_context_fns: recompute contexts from other concerns (e.g. the forward-thread compile context), composed
    after the mode's own context.
    """
    if config.mode == "none":
        return
    if config.mode == "selective":
        raise NotImplementedError(
            "activation_checkpointing.mode=selective is not available yet (selective AC issue); use mode: full"
        )
    layers = decoder_layers(model)
    for index, block in enumerate(layers):
        layers[index] = wrap_block(block, context_fns=list(extra_context_fns))
