"""The NeMo Automodel peers of ``benchmarks/_automodel_peers.py`` compute what nemo_ac's sub-blocks compute: output,
input gradient and every parameter gradient agree (fp32, tiny width) for each sub-block kind Automodel runs here;
the others are skipped with the reason the builder recorded."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
for path in (ROOT, ROOT / "benchmarks"):  # the benchmarks import each other as top-level modules
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

pytest.importorskip("nemo_automodel", reason="NeMo Automodel is not installed")
pytest.importorskip("transformers", reason="transformers is not importable; the peers need it")
pytest.importorskip("transformers.models.qwen3_5_moe", reason="this transformers has no qwen3_5_moe")

import _automodel_peers as am  # noqa: E402
import _flagship_peers as peers  # noqa: E402

from tests.factories import PEER_LAYER, PEER_SEQ, PEER_TOL, peer_layers, rel_err, run_side_by_side  # noqa: E402

if not am.automodel_available():
    pytest.skip("nemo_automodel is installed but its model components do not import", allow_module_level=True)


@pytest.mark.parametrize("kind", peers.KINDS)
def test_automodel_peer_matches_nemo_sub_block(kind: str) -> None:
    family = kind.split("_")[0]
    cfg, layers = peer_layers(family)
    # nemo_ac adds its aux loss in the loss, Automodel's Qwen3.5 MoE inside its backward: compare without it.
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=0.0))
    layer, seq = layers[PEER_LAYER[kind]], PEER_SEQ[family]
    common = {"model_cfg": cfg, "nemo_layer": layer, "seq_len": seq, "dtype": torch.float32}
    ours = peers.nemo_sub_block(kind, device=torch.device("cpu"), **common)
    peer = am.build_automodel_peer(kind, layer_idx=PEER_LAYER[kind], device=torch.device("cpu"), **common)
    if peer is None:
        assert am.UNSUPPORTED.get(kind), kind
        pytest.skip(f"{kind}: {am.UNSUPPORTED[kind]}")
    assert kind not in am.UNSUPPORTED
    print(f"{kind}: {peer.impl}")

    runs = {
        "nemo": (ours, dict(layer.named_parameters())),
        "automodel": (peer.run, dict(peer.module.named_parameters())),
    }
    results = run_side_by_side(runs, seq=seq, hidden=cfg.hidden_size)
    (out_n, dx_n, g_n), (out_a, dx_a, g_a) = results["nemo"], results["automodel"]

    errs = {"out": rel_err(out_n, out_a), "dx": rel_err(dx_n, dx_a)}
    used = {k: g for k, g in g_n.items() if k.split(".")[0] in peers.sub_block_children(kind)}
    mapped = am.to_automodel_state(used)
    assert set(mapped) == set(g_a)  # every parameter the sub-block has, under Automodel's names
    for k, grad in g_a.items():
        assert grad is not None and mapped[k] is not None, k
        errs[k] = rel_err(mapped[k], grad)
    worst = max(errs, key=errs.__getitem__)
    print(f"{kind}: out {errs['out']:.1e}, dx {errs['dx']:.1e}, worst {worst} {errs[worst]:.1e}")
    assert max(errs.values()) <= PEER_TOL, {k: v for k, v in errs.items() if v > PEER_TOL}
    assert dx_a.abs().max() > 0 and out_a.abs().max() > 0
