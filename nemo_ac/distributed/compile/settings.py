"""The Dynamo settings nemo_ac's compiled blocks run under, scoped to the blocks (no global config change).

Scoped because Dynamo's config is per thread since torch 2.12: a thread-local ``patch`` around each block's outer
forward makes the forward compile with them, and the forward-thread context captures them there for the recompute
(``workarounds.forward_thread_compile_config``). The two Dynamo keys live in Dynamo's private config module, reached
only through ``workarounds.dynamo_settings``; ``dynamic_sources`` is public (``torch.compiler.config``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nemo_ac.config.schema import CompileConfig
from nemo_ac.distributed.plan import CompilePlan
from nemo_ac.workarounds.dynamic_per_batch_ints import dynamic_source_patterns, merge_dynamic_sources
from nemo_ac.workarounds.dynamo_settings import dynamo_settings_patched
from nemo_ac.workarounds.forward_thread_compile_config import patched_config


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
    def from_config(cls, config: CompilePlan | CompileConfig) -> CompileSettings:
        """From the plan's compile values (or the ``compile`` section itself: the same fields)."""
        return cls(
            recompile_limit=config.recompile_limit,
            capture_scalar_outputs=config.capture_scalar_outputs,
            dynamic_sources=dynamic_source_patterns() if config.dynamic_ints else "",
        )


@contextlib.contextmanager
def use_compile_settings(settings: CompileSettings) -> Iterator[None]:
    """Apply ``settings`` on the calling thread for the duration (``config.patch``: thread-local, restored)."""
    compiler_config = torch.compiler.config
    dynamo = {"recompile_limit": settings.recompile_limit, "capture_scalar_outputs": settings.capture_scalar_outputs}
    merged = merge_dynamic_sources(compiler_config.dynamic_sources, settings.dynamic_sources)
    compiler = {"dynamic_sources": merged} if merged != compiler_config.dynamic_sources else {}
    with dynamo_settings_patched(dynamo), patched_config(compiler_config, compiler):
        yield
