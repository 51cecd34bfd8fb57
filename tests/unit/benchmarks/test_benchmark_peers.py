"""The transformers peers of ``benchmarks/_flagship_peers.py`` compute what nemo_ac's sub-blocks compute: output,
input gradient and every parameter gradient agree (fp32, tiny width) for each sub-block kind."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.factories import (  # noqa: E402
    PEER_LAYER,
    PEER_SEQ,
    PEER_TOL,
    benchmark_module,
    peer_layers,
    rel_err,
    run_side_by_side,
)

pytest.importorskip("transformers", reason="transformers is not importable; the peers need it")
pytest.importorskip("transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe")


def _peers_module() -> ModuleType:
    return benchmark_module("_flagship_peers")


@pytest.mark.parametrize("kind", _peers_module().KINDS)
def test_peer_matches_nemo_sub_block(kind: str) -> None:
    peers = _peers_module()
    family = kind.split("_")[0]
    cfg, layers = peer_layers(family)
    layer, seq = layers[PEER_LAYER[kind]], PEER_SEQ[family]
    common = {"model_cfg": cfg, "nemo_layer": layer, "seq_len": seq, "dtype": torch.float32}
    ours = peers.nemo_sub_block(kind, device=torch.device("cpu"), **common)
    peer = peers.build_peer(kind, layer_idx=PEER_LAYER[kind], device=torch.device("cpu"), **common)
    print(f"{kind}: {peer.impl}")

    runs = {"nemo": (ours, dict(layer.named_parameters())), "hf": (peer.run, dict(peer.module.named_parameters()))}
    results = run_side_by_side(runs, seq=seq, hidden=cfg.hidden_size)
    (out_n, dx_n, g_n), (out_h, dx_h, g_h) = results["nemo"], results["hf"]

    errs = {"out": rel_err(out_n, out_h), "dx": rel_err(dx_n, dx_h)}
    assert set(g_h) == {k for k in g_n if k.split(".")[0] in peers._CHILDREN[kind]}
    for k, grad in g_h.items():
        assert grad is not None and g_n[k] is not None, k
        errs[k] = rel_err(g_n[k], grad)
    assert all(g_n[k] is None for k in g_n.keys() - g_h.keys())  # the sub-block uses nothing else of the layer
    worst = max(errs, key=errs.__getitem__)
    print(f"{kind}: out {errs['out']:.1e}, dx {errs['dx']:.1e}, worst {worst} {errs[worst]:.1e}")
    assert max(errs.values()) <= PEER_TOL, {k: v for k, v in errs.items() if v > PEER_TOL}
    assert dx_h.abs().max() > 0 and out_h.abs().max() > 0
