"""CompileAccounting: per-thread compiles, recompiles with reasons, graph breaks, backward graphs, eager fallbacks.

Backends ``eager`` / ``aot_eager``: the accounting observes Dynamo and AOTAutograd events, not generated code.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from nemo_ac.diagnostics.recompiles import CompileAccounting, EagerFallbackWarning

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def run_on_thread(fn) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert not errors, errors


def test_counts_per_thread_with_recompile_reasons_graph_breaks_and_backward_graphs():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    compiled = torch.compile(f, backend="aot_eager", dynamic=False)
    main_threads = torch.get_num_threads()
    other = 1 if main_threads != 1 else 2
    with CompileAccounting() as accounting:
        compiled(torch.randn(4, requires_grad=True)).sum().backward()
        after_first = accounting.metrics()
        compiled(torch.randn(5, requires_grad=True)).sum().backward()  # new shape, dynamic=False: recompile

        def on_other_thread() -> None:
            torch.set_num_threads(other)  # global-state guard: this thread misses the cache
            try:
                compiled(torch.randn(5))
            finally:
                torch.set_num_threads(main_threads)

        run_on_thread(on_other_thread)
        m = accounting.metrics()
    assert after_first["compiles_fwd"] == 2  # the frame up to the graph break and its resume function
    assert after_first["graph_breaks"] == 1 and after_first["bwd_graphs"] == 2
    assert (m["compiles_fwd"], m["recompiles_fwd"], m["compiles_bwd"], m["recompiles_bwd"]) == (4, 2, 2, 2)
    assert m["graph_breaks"] == 3 and accounting.threads["bwd"].graph_breaks == 1
    assert any("size mismatch" in r for r in accounting.threads["fwd"].reasons)
    assert all("num_threads" in r for r in accounting.threads["bwd"].reasons)
    assert m["eager_fallbacks"] == 0
    sources = accounting.metric_sources()
    assert {name: read() for name, read in sources.items()} == m
    summary = accounting.summary()
    assert summary["compiles_bwd"] == 2 and "recompile_reasons_bwd" in summary
    assert "bwd thread(s): 2 compiles (2 recompiles)" in accounting.report()


def test_a_frame_past_its_recompile_limit_is_an_eager_fallback_warned_with_its_thread():
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False, recompile_limit=2)
    with CompileAccounting() as accounting:
        with pytest.warns(
            EagerFallbackWarning, match=r"EAGER FALLBACK on the fwd thread: '<lambda>'.*recompile_limit=2"
        ):
            for n in range(2, 6):
                torch.testing.assert_close(compiled(torch.ones(n)), torch.full((n,), 2.0))
        m = accounting.metrics()
    assert (m["compiles_fwd"], m["recompiles_fwd"], m["eager_fallbacks"]) == (2, 1, 1)
    assert "hit recompile_limit=2" in accounting.summary()["eager_fallback_sites"][0]


def test_close_leaves_torch_as_it_was():
    handler = torch._dynamo.callback_handler
    before = (list(handler.start_callbacks), list(handler.end_callbacks))
    log_handlers = list(logging.getLogger("torch._dynamo.convert_frame").handlers)
    with CompileAccounting():
        assert len(handler.start_callbacks) == len(before[0]) + 1
    assert (list(handler.start_callbacks), list(handler.end_callbacks)) == before
    assert logging.getLogger("torch._dynamo.convert_frame").handlers == log_handlers
