"""The plan's words: what a block can be, how it is checkpointed, compiled and sharded.

String enums (``StrEnum``) rather than bare strings: a typo is an ``AttributeError`` where the plan is made, not a
silently untaken branch in an apply step, and each value still prints and compares as the word the recipe and the
printed plan use (``ACMode.FULL == "full"``, ``f"{CompileLayout.AC_OUTER}"`` is ``ac_outer``).
"""

from __future__ import annotations

from enum import StrEnum


class BlockKind(StrEnum):
    """Which tower a block belongs to: decoder blocks are compiled and CP-sharded, vision blocks never."""

    DECODER = "decoder"
    VISION = "vision"


class ACMode(StrEnum):
    """``activation_checkpointing.mode``: keep every activation, recompute the whole block, or SAC."""

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class CompileLayout(StrEnum):
    """compile_outer = compile(AC(block)); ac_outer = AC(compile(block)). A block not compiled has no layout."""

    COMPILE_OUTER = "compile_outer"
    AC_OUTER = "ac_outer"


class RecomputeContext(StrEnum):
    """What a block's checkpoint composes, in composition order (``activation_checkpointing.wrapping``)."""

    SAC_MODES = "selective"  # nemo_ac's SAC modes (pass FSDP hook ops and compiled regions through)
    FORWARD_THREAD_COMPILE = "forward_thread_compile"  # workarounds.forward_thread_compile_config
    ROUTING_REPLAY = "routing_replay"  # models.layers.routing_replay: the recompute reuses the forward's routing


class FSDPUnit(StrEnum):
    """wrapper = fully_shard(AC(block)) (torchtitan's layout); block = AC(fully_shard(block))."""

    WRAPPER = "wrapper"
    BLOCK = "block"

    def describe(self) -> str:
        return "fully_shard(AC(block))" if self is FSDPUnit.WRAPPER else "fully_shard(block)"


class NestedUnit(StrEnum):
    """A submodule of a MoE block that gets its own ``fully_shard``, in sharding order."""

    ROUTER = "router"
    EXPERTS = "experts"
