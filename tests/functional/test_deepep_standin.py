"""The DeepEP adapter on 2 gloo ranks with ``GlooDeepEPBufferStandIn`` (a stand-in for ``deep_ep.Buffer``
implementing its documented dispatch / combine semantics over gloo; not DeepEP): the stand-in follows those
semantics; the tiny Nemotron-3 model gives exactly the torch dispatcher's loss and parameter gradients (fp32) under
every AC mode; and selective AC's recompute makes no DeepEP call, where a policy that leaves the ops out makes one
dispatch and one combine per MoE layer. One launch; the checks live in workers/deepep_parity.py.

Exact, not within a tolerance: with top-2 routing every sum the two paths take has at most two non-zero terms
(two slots of a token, or one slot's row and a zero from the other rank), and fp32 addition of two terms does not
depend on their order; rows reach each expert in the same (source rank, token) order on both paths.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, run_script

pytestmark = pytest.mark.functional

WORKER = ROOT / "tests" / "functional" / "workers" / "deepep_parity.py"
MOE_LAYERS = 2  # nemotron_config's layer_pattern "ME*M-E"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("deepep") / "result.json"
    proc = run_script(WORKER, nproc=2, args=[str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def cell(result: dict, dispatcher: str, ac: str) -> dict:
    (found,) = [c for c in result["parity"] if c["dispatcher"] == dispatcher and c["ac"] == ac]
    return found


def test_the_stand_in_follows_deepeps_documented_semantics(result) -> None:
    semantics = result["semantics"]
    assert semantics["sent"] == [4, 0]  # rank 0 routes only to its own experts: an empty split to its peer
    assert semantics["calls"] == {"dispatch": 1, "dispatch(handle)": 1, "combine(topk_weights)": 1}


@pytest.mark.parametrize("ac", ["none", "selective", "selective_without_deepep", "full"])
@pytest.mark.parametrize("kind", ["deepep", "deepep_async"])
def test_deepep_stand_in_equals_the_torch_dispatcher_exactly(result, kind: str, ac: str) -> None:
    """``deepep_async``: the dispatcher as between compiled graphs, every transfer ``async_finish`` with the shared
    expert between start and wait, forward and backward; the same gradients bitwise."""
    reference = cell(result, "torch", "none")
    got = cell(result, kind, ac)
    assert got["adapter"] == "DeepEPDispatcher"
    assert got["params_compared"] == reference["nonzero_grads"] == 45 and got["expert_params"] == 4
    assert got["loss_diff"] == 0.0 and got["max_grad_diff"] == 0.0, got
    assert got["forward_calls"] == {"dispatch": MOE_LAYERS, "combine": MOE_LAYERS}
    if kind == "deepep":
        assert got["waits"] == got["async_backward"] == 0
        return
    # Two transfers per MoE layer forward and two backward, each waited for; a recompute that sends again waits again.
    recomputed = 2 * MOE_LAYERS if ac in ("selective_without_deepep", "full") else 0
    assert got["async_backward"] == 2 * MOE_LAYERS and got["waits"] == 4 * MOE_LAYERS + recomputed, got


def test_selective_recompute_makes_no_deepep_call(result) -> None:
    got = cell(result, "deepep", "selective")
    assert got["recompute_calls"] == {}
    # The backward still communicates: combine of dispatch's gradients, a cached dispatch for combine's.
    assert got["backward_calls"] == {"dispatch(handle)": MOE_LAYERS, "combine(topk_weights)": MOE_LAYERS}


def test_without_the_policy_listing_the_ops_the_recompute_communicates(result) -> None:
    for kind in ("deepep", "deepep_async"):
        for ac in ("selective_without_deepep", "full"):
            got = cell(result, kind, ac)
            assert got["recompute_calls"] == {"dispatch": MOE_LAYERS, "combine": MOE_LAYERS}, (kind, ac, got)
    assert cell(result, "torch", "selective")["max_grad_diff"] == 0.0
