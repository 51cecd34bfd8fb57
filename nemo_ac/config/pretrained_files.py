"""The safetensors files of a local ``model.pretrained`` directory, read without their tensors: the 8-byte header
length and the JSON header of every file, checked the way the safetensors library checks them when it opens one.

Why here, pure and without torch: the loader opened the files only after the process group, the model build and
the parallelization, and a damaged file then failed as ``SafetensorError: Error while deserializing header:
incomplete metadata, file not fully covered``, naming no file. The preflight (``nemo_ac.preflight``) now reads
every header before anything starts (kilobytes per file, however large the tensors) and names the file, the byte
and the fix; the loader plans from the same headers (``trainer.checkpoint.hf_safetensors``), so both report a problem in
the same words. A Hub id is not read here (that would need the network): its files are checked when the run has
downloaded them.

What a header must hold (the safetensors format): ``u64`` little-endian ``N``, then ``N`` bytes of UTF-8 JSON
mapping every tensor name to ``{dtype, shape, data_offsets: [begin, end]}`` (plus an optional ``__metadata__``),
then the tensor bytes; each tensor's span is its shape times its dtype's width, and the last span ends exactly at
the end of the file. A file cut short by a download or a copy fails the last rule.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import RecipeConfig

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers ("header too large")
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# The floating-point dtypes the loader casts between (to the model's parameter dtype); anything else in a
# floating-point parameter's place is a quantized or foreign checkpoint.
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_FIX = "download or copy the file again"


class SafetensorsFileError(ValueError):
    """A safetensors file whose header cannot be read; the message names the file, the byte and the fix."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it."""

    file: str  # the file's name inside the checkpoint directory
    dtype: str  # safetensors' spelling: F32, BF16, I64, ...
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorHeader]:
    """Tensor name -> its header entry, reading only the header of ``path``; ``SafetensorsFileError`` when the file
    is not a complete safetensors file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        first = handle.read(8)
        if len(first) < 8:
            raise SafetensorsFileError(
                f"{path} has {size} bytes, fewer than the 8-byte header length a safetensors file starts with; {_FIX}"
            )
        length = struct.unpack("<Q", first)[0]
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise SafetensorsFileError(
                f"{path}: its first 8 bytes announce a {length:,}-byte header but the file has {size:,} bytes (cut "
                f"short, or no safetensors file); {_FIX}"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFileError(
            f"{path}: its JSON header (bytes 8 to {8 + length:,}) is damaged ({exc}); {_FIX}"
        ) from exc
    if not isinstance(header, dict):
        raise SafetensorsFileError(f"{path}: its header is a JSON {type(header).__name__}, not an object; {_FIX}")
    tensors: dict[str, TensorHeader] = {}
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(n) for n in entry["shape"])
            begin, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsFileError(
                f"{path}: header entry {key!r} is no {{dtype, shape, data_offsets}} ({str(entry)[:80]}); {_FIX}"
            ) from exc
        width = DTYPE_BYTES.get(dtype)
        if width is not None and stop - begin != math.prod(shape) * width:
            raise SafetensorsFileError(
                f"{path}: tensor {key!r} is {dtype} {list(shape)} ({math.prod(shape) * width:,} bytes) but its "
                f"data_offsets span {stop - begin:,} bytes; the header is damaged: {_FIX}"
            )
        end = max(end, stop)
        tensors[key] = TensorHeader(file=path.name, dtype=dtype, shape=shape)
    described = 8 + length + end
    if described > size:
        raise SafetensorsFileError(
            f"{path} is truncated: its header describes {described:,} bytes, the file has {size:,} (a download or "
            f"copy that stopped early); {_FIX}"
        )
    if described < size:
        raise SafetensorsFileError(
            f"{path} has {size - described:,} bytes after the last tensor its header describes (two files written "
            f"into one, or a damaged header); {_FIX}"
        )
    return tensors


def checkpoint_headers(root: Path) -> tuple[dict[str, TensorHeader], list[str]]:
    """Every tensor of the checkpoint directory ``root`` (through ``model.safetensors.index.json`` when there is
    one, else every ``*.safetensors`` file) and every problem found, each naming its file."""
    index = root / INDEX_FILE
    problems: list[str] = []
    weight_map: dict[str, str] | None = None
    if index.is_file():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return {}, [f"{index} is no safetensors index (a JSON object with a weight_map): {exc}; {_FIX}"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (root / name).is_file()]
        if missing:
            problems.append(f"{index} names files that do not exist: {missing}; {_FIX}")
        files = [name for name in files if name not in missing]
    else:
        files = sorted(path.name for path in root.glob("*.safetensors"))
        if not files:
            return {}, [f"{root}: no *.safetensors files and no {INDEX_FILE}"]
    tensors: dict[str, TensorHeader] = {}
    for name in files:
        try:
            header = read_header(root / name)
        except (SafetensorsFileError, OSError) as exc:
            problems.append(str(exc))
            continue
        if weight_map is not None:
            listed = [key for key, file in weight_map.items() if file == name]
            absent = [key for key in listed if key not in header]
            if absent:
                problems.append(f"{index} puts {absent[:3]} ({len(absent)} in all) in {name}, whose header lacks them")
            tensors.update({key: header[key] for key in listed if key in header})
            continue
        for key, tensor in header.items():
            if key in tensors:
                problems.append(f"key {key!r} is in both {tensors[key].file} and {name}")
            tensors[key] = tensor
    return tensors, problems


def local_pretrained_dir(recipe: RecipeConfig) -> Path | None:
    """``model.pretrained`` as a local directory, or None (unset, or a Hub id)."""
    name = recipe.model.pretrained
    path = Path(name).expanduser() if name else None
    return path if path is not None and path.is_dir() else None


def check_pretrained_files(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Before any process group: every safetensors header of a local ``model.pretrained`` directory reads (module
    docstring). A Hub id is skipped: no network in the preflight."""
    root = local_pretrained_dir(recipe)
    if root is None:
        return []
    return [ConfigIssue("model.pretrained", problem) for problem in checkpoint_headers(root)[1]]
