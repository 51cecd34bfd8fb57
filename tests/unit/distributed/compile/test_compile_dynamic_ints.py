"""DYNAMIC_INT_ARGS: per-micro-batch ints (and cu_seqlens' length) are symbolic from the first compile, wherever
they sit: ``AttentionInputs`` fields, or a CP dataclass in ``AttentionInputs.context_parallel`` (here a stand-in
with ring CP's field names), and also on a thread that compiles the recompute (via the forward-thread context)."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from nemo_ac.config.schema import CompileConfig
from nemo_ac.diagnostics.recompiles import CompileAccounting
from nemo_ac.distributed.compile import CompileSettings, use_compile_settings
from nemo_ac.models.interfaces import AttentionInputs
from nemo_ac.workarounds.dynamic_per_batch_ints import DYNAMIC_INT_ARGS, dynamic_source_patterns
from nemo_ac.workarounds.forward_thread_compile_config import (
    apply_thread_compile_config,
    capture_thread_compile_config,
)

pytestmark = [pytest.mark.workaround, pytest.mark.usefixtures("fresh_dynamo")]


@dataclass
class RingStandIn:
    """Ring CP's metadata as it travels in ``AttentionInputs.context_parallel`` (ints only matter here)."""

    document_ids: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: int


def packed_op(x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
    """Uses every declared value the way attention ops do: ints in comparisons, cu_seqlens' length."""
    cp = attn.context_parallel
    pos = torch.arange(x.shape[0])
    window = (pos < cp.max_seqlen_q) & (pos < cp.max_seqlen_k) & (pos >= cp.local_k_slice) & (pos < attn.max_seqlen)
    return x * window + attn.cu_seqlens.float().sum() / attn.cu_seqlens.shape[0]


# (max_seqlen, max_seqlen_q, max_seqlen_k, local_k_slice, number of documents + 1); 0 and 1 included: Dynamo
# specializes those for sizes, and local_k_slice is 0 on the first ring rank.
BATCHES = [(7, 3, 9, 0, 4), (11, 5, 13, 1, 6), (13, 6, 17, 2, 3), (17, 9, 19, 5, 8)]


def attention_inputs(max_seqlen: int, q: int, k: int, local_k_slice: int, cu_len: int) -> AttentionInputs:
    return AttentionInputs(
        document_ids=torch.zeros(2, 10, dtype=torch.int32),
        cu_seqlens=torch.arange(cu_len, dtype=torch.int32) * 3,
        max_seqlen=max_seqlen,
        context_parallel=RingStandIn(torch.zeros(2, 10, dtype=torch.int32), q, k, local_k_slice),
    )


def compile_batches(*, dynamic_ints: bool) -> int:
    settings = CompileSettings.from_config(CompileConfig(enabled=True, dynamic_ints=dynamic_ints))
    compiled = torch.compile(packed_op, backend="eager")
    x = torch.randn(20)
    for values in BATCHES:
        attn = attention_inputs(*values)
        with use_compile_settings(settings):
            out = compiled(x, attn)
        torch.testing.assert_close(out, packed_op(x, attn))
    return counters["stats"]["unique_graphs"]


def test_declared_ints_compile_one_graph_for_every_batch():
    assert compile_batches(dynamic_ints=True) == 1


def test_without_the_declaration_dynamo_compiles_a_specialized_graph_first():
    # Automatic dynamic shapes: a static graph for the first batch, a dynamic one after the first change.
    assert compile_batches(dynamic_ints=False) == 2


def test_patterns_match_the_sources_dynamo_builds_for_these_fields():
    patterns = dynamic_source_patterns().split(",")
    assert len(patterns) == len(DYNAMIC_INT_ARGS)

    def matches(source: str) -> list[str]:
        found = []
        for entry in patterns:
            regex, _, dim = entry.partition("$:")
            regex = regex + "$" if dim else regex
            if re.match(regex, source):
                found.append(entry)
        return found

    for source in (
        "L['attn'].max_seqlen",
        "L['kwargs']['attn'].max_seqlen",  # compile(AC(block)): the wrapper takes **kwargs
        "L['attn'].context_parallel.max_seqlen_q",
        "L['attn'].context_parallel.max_seqlen_k",
        "L['attn'].context_parallel.local_k_slice",
        "L['max_seqlen']",  # an argument / graph-break resume local of that name
        "L['attn'].cu_seqlens",
    ):
        assert len(matches(source)) == 1, source
    for source in (
        "L['ctx'].local_order",  # EP's dispatch context in the frame after the experts' FSDP unit
        "L['ctx'].send_splits[0]",  # list items
        "L['ctx'].recv_splits[1]",
    ):
        assert len(matches(source)) == 1, source
    for source in ("L['attn'].max_seqlen_extra", "L['attn'].document_ids", "L['hidden']", "L['ctx'].send_splits"):
        assert not matches(source), source
    assert [e for e in patterns if e.endswith(":0")] == [p for p in patterns if "cu_seqlens" in p or "local_order" in p]


def test_a_recompute_thread_keeps_the_ints_dynamic_only_with_the_captured_settings():
    """On a thread that compiles (a recompute after a cache miss), the declaration is gone unless re-applied."""
    settings = CompileSettings.from_config(CompileConfig(enabled=True))
    compiled = torch.compile(packed_op, backend="eager")
    x = torch.randn(20)
    with use_compile_settings(settings):
        captured = capture_thread_compile_config()

    other_threads = 1 if torch.get_num_threads() != 1 else 2

    def recompute_all(apply: bool) -> None:
        prior = torch.get_num_threads()
        torch.set_num_threads(other_threads)  # num_threads is in Dynamo's global-state guard: miss the forward's entry
        try:
            for values in BATCHES:
                with apply_thread_compile_config(captured) if apply else use_compile_settings(_NO_SETTINGS):
                    compiled(x, attention_inputs(*values))
        finally:
            torch.set_num_threads(prior)  # it also seeds later threads' count

    results = {}
    for apply in (True, False):
        torch._dynamo.reset()
        with CompileAccounting() as accounting:
            with use_compile_settings(settings):
                compiled(x, attention_inputs(*BATCHES[0]))  # the forward thread's compile
            errors: list[BaseException] = []
            worker = threading.Thread(target=_capture_errors, args=(errors, recompute_all, apply))
            worker.start()
            worker.join()
            assert not errors, errors
            results[apply] = accounting.metrics()
    assert (results[True]["compiles_fwd"], results[True]["compiles_bwd"]) == (1, 1)
    assert results[False]["compiles_bwd"] == 2  # specialized first, then automatic dynamic


_NO_SETTINGS = CompileSettings(recompile_limit=8, capture_scalar_outputs=False, dynamic_sources="")


def _capture_errors(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)
