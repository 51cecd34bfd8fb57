"""The node lock around inductor compiles (``workarounds.node_shared_compile``): two processes contending for one
graph's lock take turns, re-entry on the holding thread does not wait, and the backend swap touches inductor only.
The cross-rank cache hits themselves are asserted on a real 2-rank inductor run (tests/functional/
test_compile_trainer.py)."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
import torch

from nemo_ac.workarounds.node_shared_compile import (
    NodeSharedInductor,
    graph_lock_name,
    node_lock,
    node_shared_compile_kwargs,
)

pytestmark = pytest.mark.workaround


def _hold(directory: str, name: str, held, release) -> None:  # a child process: a rank compiling one graph
    with node_lock(name, directory=Path(directory)):
        held.set()
        release.wait(timeout=60)


def test_a_graph_locked_by_another_process_waits_and_another_graph_does_not(tmp_path):
    context = multiprocessing.get_context("fork")  # cheap: the child only takes a file lock
    held, release = context.Event(), context.Event()
    child = context.Process(target=_hold, args=(str(tmp_path), "graph", held, release))
    child.start()
    try:
        assert held.wait(timeout=60)
        with node_lock("other_graph", directory=tmp_path):  # another graph compiles at the same time
            pass
        entered = threading.Event()

        def take() -> None:
            with node_lock("graph", directory=tmp_path):
                entered.set()

        waiter = threading.Thread(target=take)
        waiter.start()
        assert not entered.wait(timeout=0.5), "took a graph's lock while another process held it"
        release.set()
        waiter.join(timeout=60)
        assert entered.is_set(), "the graph's lock was not free once the other process released it"
    finally:
        release.set()
        child.join(timeout=60)
    assert child.exitcode == 0


def test_the_holding_thread_reenters_without_waiting(tmp_path):
    # a nested compile (the lazy backward under the backend's lock) on the same thread: no self-deadlock
    with node_lock("graph", directory=tmp_path), node_lock("graph", directory=tmp_path):
        pass
    assert (tmp_path / "nemo_ac_compile_locks" / "graph.lock").exists()


def test_the_backend_swap_is_inductor_only_and_keeps_its_options():
    plain = {"backend": "aot_eager", "fullgraph": False}
    assert node_shared_compile_kwargs(plain) is plain
    swapped = node_shared_compile_kwargs({"backend": "inductor", "dynamic": True, "options": {"x": 1}})
    assert swapped["dynamic"] is True and "options" not in swapped
    assert swapped["backend"] == NodeSharedInductor({"x": 1}) != NodeSharedInductor()


def test_equal_graphs_share_a_lock_name():
    def graph(x):
        return x.sin()

    gm = torch.fx.symbolic_trace(graph)
    assert graph_lock_name(gm, [torch.ones(2, 3)]) == graph_lock_name(gm, [torch.zeros(2, 3)])
    assert graph_lock_name(gm, [torch.ones(2, 3)]) != graph_lock_name(gm, [torch.ones(3, 2)])


def test_a_graph_compiled_once_is_compiled_again_without_the_lock(monkeypatch, tmp_path):
    """The ``.done`` marker: a warm run's ranks load a graph at the same time instead of one after another."""
    import torch._inductor.compile_fx as compile_fx

    from nemo_ac.workarounds import node_shared_compile

    locked: list[str] = []
    real_lock = node_shared_compile.node_lock

    def recording_lock(name, **kwargs):
        locked.append(name)
        return real_lock(name, **kwargs)

    monkeypatch.setattr(node_shared_compile, "inductor_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(node_shared_compile, "node_lock", recording_lock)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", lambda gm, inputs, **kwargs: "compiled")
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    assert node_shared_compile._locked_inner_compile(gm, [torch.ones(2)]) == "compiled"
    assert node_shared_compile._locked_inner_compile(gm, [torch.ones(2)]) == "compiled"
    assert len(locked) == 1, "the second compile of a graph that finished once should not take turns"
