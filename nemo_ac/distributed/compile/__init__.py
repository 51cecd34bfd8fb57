"""torch.compile of decoder blocks: the settings they compile under and the in-place compile of each block.

Layouts (``compile.layout``, decided per block by ``distributed.plan.resolve_layout``):

- ``compile_outer`` = compile(AC(block)): Dynamo traces the checkpoint as a higher-order op and the partitioner
  plans the recompute inside one graph (the fast layout). A graph break inside a traced checkpoint cannot be
  split, so Dynamo skips the whole region: a block whose nested FSDP unit (experts / fp32 router) runs FSDP2 hooks
  (``torch._dynamo.disable``-d) would run *entirely eagerly*, silently.
- ``ac_outer`` = AC(compile(block)): the checkpoint runs eagerly around a compiled block; FSDP hooks of nested
  units graph-break into separate compiled pieces. The recompute re-enters Dynamo during backward, i.e. on the
  autograd device thread on GPU: ``workarounds.forward_thread_compile_config`` and
  ``workarounds.compiled_regions_under_sac`` keep that correct.
- ``auto``: ac_outer for blocks that hold a nested FSDP unit (or when AC sits outside the block's fully_shard,
  whose hooks then run inside the checkpoint), compile_outer otherwise.

Per-micro-batch ints are compiled as symbols from the first compile (``workarounds.dynamic_per_batch_ints``).
"""

from nemo_ac.distributed.compile.apply import CompiledBlock, apply_compile, check_backend, compile_kwargs, is_compiled
from nemo_ac.distributed.compile.settings import CompileSettings, use_compile_settings

__all__ = [
    "CompileSettings",
    "CompiledBlock",
    "apply_compile",
    "check_backend",
    "compile_kwargs",
    "is_compiled",
    "use_compile_settings",
]
