"""The safetensors headers of a local ``model.pretrained`` (``nemo_ac.config.pretrained_files``), read without the
tensors and checked as the safetensors library checks them on open, each problem naming its file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from nemo_ac.config.pretrained_files import SafetensorsFileError, checkpoint_headers, read_header

safetensors_torch = pytest.importorskip("safetensors.torch", reason="writing safetensors needs safetensors")


def write(path: Path, **tensors) -> bytes:
    import torch

    safetensors_torch.save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(path))
    return path.read_bytes()


def test_a_header_is_read_without_the_tensors_and_every_damage_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    data = write(path, a=(4, 4), b=(3,))
    assert {k: (v.dtype, v.shape) for k, v in read_header(path).items()} == {"a": ("F32", (4, 4)), "b": ("F32", (3,))}
    length = struct.unpack("<Q", data[:8])[0]
    cases = {
        data[:5]: "has 5 bytes, fewer than the 8-byte header length",
        struct.pack("<Q", 10**12) + data[8:]: "its first 8 bytes announce a 1,000,000,000,000-byte header",
        data + b"abc": "has 3 bytes after the last tensor its header describes",
        data[:-4]: f"is truncated: its header describes {len(data):,} bytes, the file has {len(data) - 4:,}",
        data[:8] + data[8 : 8 + length].replace(b"[4,4]", b"[4,5]") + data[8 + length :]: (
            "tensor 'a' is F32 [4, 5] (80 bytes) but its data_offsets span 64 bytes"
        ),
    }
    for damaged, message in cases.items():
        path.write_bytes(damaged)
        with pytest.raises(SafetensorsFileError, match=r"download or copy the file again") as info:
            read_header(path)
        assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_the_index_and_the_files_must_agree(tmp_path):
    write(tmp_path / "one.safetensors", a=(2,))
    write(tmp_path / "two.safetensors", a=(2,), b=(2,))
    assert checkpoint_headers(tmp_path)[1] == ["key 'a' is in both one.safetensors and two.safetensors"]
    index = {"weight_map": {"a": "one.safetensors", "b": "one.safetensors", "c": "three.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors, problems = checkpoint_headers(tmp_path)
    assert sorted(tensors) == ["a"]
    assert problems == [
        f"{tmp_path / 'model.safetensors.index.json'} names files that do not exist: ['three.safetensors']; download "
        "or copy the file again",
        f"{tmp_path / 'model.safetensors.index.json'} puts ['b'] (1 in all) in one.safetensors, whose header lacks "
        "them",
    ]
