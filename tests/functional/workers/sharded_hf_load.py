"""torchrun worker: load a Hub-layout safetensors checkpoint into a sharded model and count what each rank reads.

``python sharded_hf_load.py CHECKPOINT_DIR OUT.json key=value ...`` builds the tiny GLM-4.5-Air recipe with the
overrides through the production build (meshes -> model on meta -> parallelize: EP, CP, AC, FSDP2), materializes it
empty and loads the checkpoint with ``load_hf_checkpoint``, counting the bytes this rank reads from the files
(``ReadStats``) against the bytes of what it keeps (its local shards, plus replicated tensors, in the checkpoint's
dtype). Then every rank loads the same checkpoint into an unsharded model and checks every parameter and buffer
(the sharded one gathered with ``full_tensor()``) for equality, and the sharded model is exported back to the Hub
layout (bf16, as written) and compared with the input files byte for byte. Rank 0 writes ``{"ranks": [{"rank", "bytes_read",
"bytes_kept", "checkpoint_bytes", "sharded", "whole"}], "mismatches": [...]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.models import build_model
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_parallel_model
from nemo_ac.trainer.checkpoint.hf_safetensors import ReadStats, export_hf_checkpoint, load_hf_checkpoint, model_tensors
from tests.factories import read_dir

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "glm_4_5_air_tiny.yaml"


def checkpoint_bytes(root: Path) -> tuple[int, int]:
    """(bytes of every tensor in the checkpoint, bytes per element of its weights)."""
    from safetensors import safe_open

    total, itemsize = 0, 0
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                tensor = f.get_slice(key)
                numel = 1
                for n in tensor.get_shape():
                    numel *= n
                size = {"BF16": 2, "F16": 2, "F32": 4}[tensor.get_dtype()]
                total += numel * size
                itemsize = max(itemsize, size) if key.endswith("e_score_correction_bias") is False else itemsize
    return total, itemsize


def kept_bytes(model: torch.nn.Module, *, itemsize: int) -> int:
    """What this rank keeps, counted in the checkpoint's dtype (fp32 buffers at 4 bytes)."""
    total = 0
    for name, tensor in model_tensors(model).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        size = 4 if name.endswith("e_score_correction_bias") else itemsize
        total += local.numel() * size
    return total


def main(checkpoint: str, out_path: str, overrides: list[str]) -> int:
    recipe = load_recipe(str(RECIPE), overrides)
    env = init_distributed(recipe.dist)
    layout = validate_recipe(recipe, world_size=env.world_size)
    root = Path(checkpoint)
    model, _, _ = build_parallel_model(recipe, layout, device=env.device)
    model.to_empty(device=env.device)
    stats = ReadStats()
    load_hf_checkpoint(model, root, stats=stats)
    total, itemsize = checkpoint_bytes(root)
    mine = {
        "rank": env.rank,
        "bytes_read": stats.bytes_read,
        "bytes_kept": kept_bytes(model, itemsize=itemsize),
        "checkpoint_bytes": total,
        "sharded": stats.sharded,
        "whole": stats.whole,
    }
    reference = build_model(recipe.model)
    reference.to_empty(device="cpu")
    load_hf_checkpoint(reference, root)
    expected = model_tensors(reference)
    mismatches = []
    for name, tensor in model_tensors(model).items():  # same order on every rank: full_tensor is a collective
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not torch.equal(full.cpu(), expected[name]):
            mismatches.append(name)
    # Export from the sharded model (each rank sends rank 0 only its shards): the Hub files come back byte-identical.
    exported = Path(out_path).parent / "exported"
    export_hf_checkpoint(model, exported, dtype=torch.bfloat16)
    export_mismatches = []
    if env.rank == 0:
        got, want = read_dir(exported), read_dir(root)
        export_mismatches = sorted(set(got) ^ set(want)) + [
            k for k in want if k in got and not torch.equal(got[k], want[k])
        ]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    if env.rank == 0:
        result = {"ranks": gathered, "mismatches": mismatches, "export_mismatches": export_mismatches}
        Path(out_path).write_text(json.dumps(result | {"layout": str(layout)}))
    destroy_distributed(synchronize=True)
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
