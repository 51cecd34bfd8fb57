"""Sharded HF loading: each rank reads from the safetensors files only what it keeps (4 gloo ranks, one launch per
layout), the weights equal a full load, and the export from the sharded model (each rank sends rank 0 only its
shards) gives back the input files byte for byte.

Bound: at most 1.25x the bytes of the tensors the rank keeps (its shards plus the replicated tensors); a full read
(what every rank did before) is the whole checkpoint, about 3-4x that here.
"""

from __future__ import annotations

import json

import pytest

from nemo_ac.config import load_recipe
from tests.factories import write_hub_checkpoint
from tests.launch import RECIPES, ROOT, run_script

pytestmark = pytest.mark.functional
WORKER = ROOT / "tests" / "functional" / "workers" / "sharded_hf_load.py"
LAYOUTS = {
    "ep2_x_ep_shard2": ["parallel.cp=1", "parallel.ep=2", "train.micro_batch_size=2"],
    "cp2_x_dp_shard2_ep2": ["parallel.cp=2", "parallel.ep=2"],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    write_hub_checkpoint(load_recipe(RECIPES / "tiny" / "glm_4_5_air_tiny.yaml").model, root)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_only_what_it_keeps(checkpoint, tmp_path, layout):
    out = tmp_path / "out.json"
    proc = run_script(WORKER, nproc=4, args=[str(checkpoint), str(out), *LAYOUTS[layout]], timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(out.read_text())
    assert result["mismatches"] == [] and result["export_mismatches"] == []
    for rank in result["ranks"]:
        ratio = rank["bytes_read"] / rank["bytes_kept"]
        print(
            f"\n{layout} rank {rank['rank']}: read {rank['bytes_read']} B, keeps {rank['bytes_kept']} B "
            f"(x{ratio:.2f}); the checkpoint is {rank['checkpoint_bytes']} B; {rank['sharded']} tensors read as a "
            f"shard, {rank['whole']} whole"
        )
        assert ratio <= 1.25, rank
        assert rank["sharded"] > 0 and rank["bytes_read"] < rank["checkpoint_bytes"] / 2, rank
