"""Hugging Face safetensors checkpoints <-> nemo_ac models, sharded (FSDP2 / expert parallel) or not.

``load_hf_checkpoint(model, path)`` fills an already materialized model (call it after ``parallelize`` and
``to_empty``, in place of random init; ``materialize_and_load`` does both) from ``*.safetensors`` in a local
directory, with or without ``model.safetensors.index.json`` (``resolve_pretrained`` turns a Hub id into such a
directory when the network is there). ``export_hf_checkpoint(model, out_dir)`` writes the consolidated Hub layout
back (plus ``config.json``), so transformers' ``from_pretrained`` loads it.

Key layout. nemo_ac parameter names equal transformers 5's (wrapper components such as ``_checkpoint_wrapped_module``
are stripped, see ``nemo_ac.models.init.canonical_name``); a family's ``key_renames`` map the Hub's prefixes
(Nemotron-H: ``backbone.`` -> ``model.``). Routed experts are grouped 3D weights in nemo_ac and per-expert matrices on
the Hub; both layouts load, the Hub one is exported::

    P.experts.{e}.gate_proj.weight [I, H] + P.experts.{e}.up_proj.weight [I, H] -> P.experts.gate_up_proj[e] [2I, H]
    P.experts.{e}.up_proj.weight [I, L]   (squared-ReLU experts, no gate)      -> P.experts.up_proj[e]      [I, L]
    P.experts.{e}.down_proj.weight [L, I]                                       -> P.experts.down_proj[e]    [L, I]

Loading is planned from the safetensors headers first (every missing, unexpected or mis-shaped key is reported with
its file before anything is copied), then streams one model tensor at a time, and each rank reads from the files
only the region it keeps: a DTensor's local shard (dense weights sharded by FSDP2 over dim 0, routed experts over
EP and their FSDP mesh) is one box of the global tensor (``local_region``), read with safetensors' lazy
``get_slice`` (per-expert Hub keys: only this rank's experts, only the rows it keeps). No communication, no full
tensor on any device; replicated tensors (non-DTensor, or replicated placements) are read whole. ``ReadStats``
counts the bytes each rank reads. Export gathers one tensor at a time to rank 0, each rank sending only its shard
(a collective: every rank must call), and rank 0 writes shards of at most ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_ac.config.hf import HFFamily, hf_config_dict, hf_family
from nemo_ac.config.pretrained_files import FLOAT_DTYPES, INDEX_FILE, TensorHeader, checkpoint_headers
from nemo_ac.config.schema import ModelConfig
from nemo_ac.models.init import canonical_name, copy_full_into, to_empty_placed
from nemo_ac.models.layers.experts import GroupedExperts
from nemo_ac.trainer.checkpoint.hf_sharded_io import ReadStats, gather_to_writer, local_region

_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Keys some checkpoints carry that are never parameters (rotary caches of older exports).
_ALWAYS_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_MAX_LISTED = 20


class HFCheckpointError(ValueError):
    """The checkpoint does not fit the model; the message lists every offending key with its file."""


@dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor feeding (part of) a model tensor: all of it, or rows of one expert."""

    key: str
    file: str
    expert: int | None = None
    rows: slice | None = None  # rows of that expert's matrix; None = all


@dataclass
class _Target:
    name: str
    tensor: torch.Tensor
    pieces: list[_Piece] = field(default_factory=list)


def _safetensors() -> Any:
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("HF checkpoints need safetensors: pip install 'nemo_ac[hf]'") from err
    return safe_open


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter (tied ones once) or persistent buffer, in module order."""
    out = {canonical_name(n): p for n, p in model.named_parameters()}
    for mod_name, module in model.named_modules():
        for b_name, buf in module._buffers.items():
            if buf is not None and b_name not in module._non_persistent_buffers_set:
                out[canonical_name(f"{mod_name}.{b_name}" if mod_name else b_name)] = buf
    return out


def _expert_pieces(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, int, slice | None]]:
    """Per-expert checkpoint key (nemo_ac prefix) -> (grouped model tensor, expert, rows of that expert)."""
    out: dict[str, tuple[str, int, slice | None]] = {}
    for mod_name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        prefix = canonical_name(mod_name)
        in_name, down_name = f"{prefix}.{module.in_proj_name}", f"{prefix}.down_proj"
        num_experts, in_rows = tensors[in_name].shape[0], tensors[in_name].shape[1]
        for e in range(num_experts):
            if module.activation == "silu":
                half = in_rows // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = (in_name, e, slice(0, half))
                out[f"{prefix}.{e}.up_proj.weight"] = (in_name, e, slice(half, in_rows))
            else:
                out[f"{prefix}.{e}.up_proj.weight"] = (in_name, e, slice(0, in_rows))
            out[f"{prefix}.{e}.down_proj.weight"] = (down_name, e, None)
    return out


def checkpoint_index(path: str | Path) -> dict[str, str]:
    """Checkpoint key -> safetensors file name, from the index file or, without one, from every file's header
    (``config.pretrained_files``: headers only; ``HFCheckpointError`` naming each damaged or missing file)."""
    headers, problems = checkpoint_headers(Path(path))
    _fail(problems, Path(path))
    return {key: header.file for key, header in headers.items()}


def _fail(problems: list[str], path: Path) -> None:
    if problems:
        shown = "\n  ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise HFCheckpointError(f"checkpoint {path} does not match the model:\n  {shown}{more}")


def _dtype_problem(piece: _Piece, header: TensorHeader, target: _Target) -> str | None:
    """Why the checkpoint dtype of ``piece`` cannot fill ``target``: the loader casts floating-point weights between
    F64 / F32 / F16 / BF16 only (an FP8 or integer tensor in their place is a quantized or foreign checkpoint)."""
    if target.tensor.is_floating_point():
        if header.dtype in FLOAT_DTYPES:
            return None
        need = f"one of {', '.join(sorted(FLOAT_DTYPES))} (a quantized checkpoint needs dequantizing first)"
    elif _TORCH_DTYPES.get(header.dtype) == target.tensor.dtype:
        return None
    else:
        need = str(target.tensor.dtype).removeprefix("torch.")
    return f"dtype of {piece.key!r} in {piece.file} is {header.dtype}, model tensor {target.name!r} needs {need}"


def _plan_problems(
    model: nn.Module, root: Path, spec: HFFamily, cfg: ModelConfig, strict: bool
) -> tuple[list[_Target], list[str]]:
    """Sources of every model tensor, and every problem: damaged files, missing, unexpected, mis-shaped and
    mis-typed keys, from the safetensors headers alone (no tensor data is read; the model may be on meta)."""
    headers, problems = checkpoint_headers(root)
    if problems:  # a damaged or missing file: its keys would all read as missing
        return [], problems
    tensors = model_tensors(model)
    targets = {name: _Target(name, t) for name, t in tensors.items()}
    experts = _expert_pieces(model, tensors)
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    for key, header in headers.items():
        name = spec.to_model_key(key)
        if name in targets:
            targets[name].pieces.append(_Piece(key, header.file))
        elif name in experts:
            grouped, e, rows = experts[name]
            targets[grouped].pieces.append(_Piece(key, header.file, e, rows))
        elif not (spec.ignore_key(name, cfg) or _ALWAYS_IGNORED.search(name) or (tied and name == "lm_head.weight")):
            problems.append(f"unexpected key {key!r} in {header.file} (no model tensor {name!r})")
    if not strict:
        problems.clear()

    expected_parts: dict[str, set[str]] = {}
    for part_key, (grouped, _, _) in experts.items():
        expected_parts.setdefault(grouped, set()).add(spec.to_hub_key(part_key))

    for target in targets.values():
        whole = [p for p in target.pieces if p.expert is None]
        parts = {p.key for p in target.pieces if p.expert is not None}
        if not target.pieces:
            hub = spec.to_hub_key(target.name)
            problems.append(f"missing key {hub!r} (model tensor {target.name!r}, shape {list(target.tensor.shape)})")
        elif (whole and parts) or len(whole) > 1:
            sources = [f"{p.key} ({p.file})" for p in target.pieces][:4]
            problems.append(f"{target.name!r} has more than one source in the checkpoint: {sources} ...")
        elif parts and parts != expected_parts[target.name]:
            absent = sorted(expected_parts[target.name] - parts)
            problems.append(f"missing per-expert keys for {target.name!r}: {absent[:4]} ({len(absent)} in all)")
        for piece in target.pieces:
            header = headers[piece.key]
            want = tuple(target.tensor.shape)
            if piece.expert is not None:
                rows = range(want[1])[piece.rows] if piece.rows is not None else range(want[1])
                want = (len(rows), *want[2:])
            if header.shape != want:
                problems.append(
                    f"shape of {piece.key!r} in {piece.file} is {list(header.shape)}, model expects {list(want)}"
                )
            dtype_problem = _dtype_problem(piece, header, target)
            if dtype_problem is not None:
                problems.append(dtype_problem)
    return list(targets.values()), problems


def _plan(model: nn.Module, root: Path, spec: HFFamily, cfg: ModelConfig, strict: bool) -> list[_Target]:
    """Sources of every model tensor, validated against the safetensors headers (no tensor data is read)."""
    targets, problems = _plan_problems(model, root, spec, cfg, strict)
    _fail(problems, root)
    return targets


def checkpoint_problems(
    model: nn.Module, path: str | Path, *, family: str | None = None, strict: bool = True
) -> list[str]:
    """Everything ``load_hf_checkpoint`` would reject about the checkpoint at ``path`` for ``model``, in its words,
    from the safetensors headers alone: the model may be on the meta device (the preflight's check, seconds
    before a weight load that would fail)."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    return _plan_problems(model, Path(path), hf_family(family or cfg.family), cfg, strict)[1]


def _assemble(
    target: _Target, handles: dict[str, Any], *, region: tuple[slice, ...] | None, stats: ReadStats
) -> torch.Tensor:
    """``region`` of the tensor of ``target`` (all of it when None) in the checkpoint's dtype, reading only what
    falls inside it, piece by piece."""
    pieces = target.pieces
    if pieces[0].expert is None:
        return stats.read(handles[pieces[0].file], pieces[0].key, region)
    box = region if region is not None else tuple(slice(0, n) for n in target.tensor.shape)
    experts, rows, rest = box[0], box[1], box[2:]
    out: torch.Tensor | None = None
    for piece in pieces:
        if not experts.start <= piece.expert < experts.stop:
            continue  # another rank's expert: never read
        piece_rows = piece.rows if piece.rows is not None else slice(0, target.tensor.shape[1])
        start, stop = max(rows.start, piece_rows.start), min(rows.stop, piece_rows.stop)
        if start >= stop:
            continue  # rows this rank does not keep
        part = stats.read(
            handles[piece.file], piece.key, (slice(start - piece_rows.start, stop - piece_rows.start), *rest)
        )
        if out is None:
            out = torch.empty(tuple(s.stop - s.start for s in box), dtype=part.dtype)
        out[piece.expert - experts.start, start - rows.start : stop - rows.start] = part
    if out is None:  # an empty shard
        return torch.empty(tuple(s.stop - s.start for s in box), dtype=target.tensor.dtype)
    return out


def _copy_region_into(dst: torch.Tensor, values: torch.Tensor, *, region: tuple[slice, ...] | None) -> None:
    if region is None:
        copy_full_into(dst, values)
    else:
        local = dst.to_local()
        local.copy_(values.to(device=local.device, dtype=local.dtype))


@torch.no_grad()
def load_hf_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    family: str | None = None,
    strict: bool = True,
    stats: ReadStats | None = None,
) -> list[str]:
    """Loads the safetensors checkpoint at ``path`` into ``model`` (plain, FSDP2 and/or EP-sharded DTensors), each
    rank reading only the regions it keeps.

    ``family`` defaults to ``model.config.family``. ``strict=False`` tolerates unexpected keys (missing keys and
    shape mismatches always raise ``HFCheckpointError``). ``stats``: filled with the bytes read. Returns the model
    tensor names it loaded.
    """
    stats = stats if stats is not None else ReadStats()
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    spec = hf_family(family or cfg.family)
    root = Path(path)
    meta = [n for n, t in model_tensors(model).items() if (t.to_local() if isinstance(t, DTensor) else t).is_meta]
    if meta:
        raise RuntimeError(f"materialize the model (to_empty) before loading weights; still on meta: {meta[:3]} ...")
    targets = _plan(model, root, spec, cfg, strict)
    safe_open = _safetensors()
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for target in targets:
            for piece in target.pieces:
                if piece.file not in handles:
                    try:
                        handles[piece.file] = stack.enter_context(safe_open(str(root / piece.file), framework="pt"))
                    except Exception as exc:  # SafetensorError names no file ("incomplete metadata, ...")
                        raise HFCheckpointError(
                            f"{root / piece.file} cannot be opened: {type(exc).__name__}: {exc}; download or copy "
                            "the file again"
                        ) from exc
            region = local_region(target.tensor)
            stats.sharded += region is not None
            stats.whole += region is None
            values = _assemble(target, handles, region=region, stats=stats)
            _copy_region_into(target.tensor, values, region=region)
    return [t.name for t in targets]


def materialize_and_load(
    model: nn.Module,
    path: str | Path,
    *,
    device: torch.device | str,
    family: str | None = None,
    strict: bool = True,
    parameter_device: torch.device | str | None = None,
) -> nn.Module:
    """``to_empty(device)`` then ``load_hf_checkpoint``: the checkpoint counterpart of ``materialize_and_init``.

    Works before or after fully_shard / expert-parallel sharding; every persistent tensor comes from the
    checkpoint, so no random init runs. ``parameter_device``: as ``materialize_and_init``'s.
    """
    to_empty_placed(model, device=device, parameter_device=parameter_device)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty may replace tied parameters by two separate tensors
    load_hf_checkpoint(model, resolve_pretrained(path), family=family, strict=strict)
    return model


def resolve_pretrained(name_or_path: str | Path) -> Path:
    """A local model directory as is; otherwise a Hub id downloaded (config and safetensors only) through
    ``huggingface_hub`` when it is installed and the network is reachable."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{name_or_path}: not a local directory, and huggingface_hub is not installed to fetch it as a Hub id"
        ) from None
    try:
        local = snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:  # offline, unknown repo, gated model: all mean "not available here"
        raise FileNotFoundError(f"{name_or_path}: not a local directory and not downloadable: {err}") from err
    return Path(local)


def _hub_entries(
    name: str, full: torch.Tensor, experts: dict[str, GroupedExperts], spec: HFFamily
) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint (key, tensor) pairs of one full model tensor: grouped experts split per expert."""
    prefix, _, local = name.rpartition(".")
    module = experts.get(prefix)
    if module is None or local not in (module.in_proj_name, "down_proj"):
        return [(spec.to_hub_key(name), full)]
    out = []
    for e in range(full.shape[0]):
        if local == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", full[e]))
        elif module.activation == "silu":
            gate, up = full[e].chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
        else:
            out.append((f"{prefix}.{e}.up_proj.weight", full[e]))
    return [(spec.to_hub_key(k), v) for k, v in out]


class _ShardWriter:
    """Accumulates tensors into safetensors files of at most ``max_bytes`` (a single tensor may exceed it)."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = tensor.detach().to("cpu").contiguous().clone()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = self.out_dir / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Renames to HF's names (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index)."""
        self.flush()
        n = len(self.files)
        weight_map: dict[str, str] = {}
        final = []
        for i, (tmp, keys) in enumerate(self.files):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.out_dir / name)
            final.append(self.out_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return final


@torch.no_grad()
def export_hf_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 * 2**30,
    write_config: bool = True,
) -> list[Path]:
    """Writes ``model`` as a consolidated Hub-layout checkpoint (per-expert weights) into ``out_dir``.

    Collective when the model holds DTensors: every rank must call it; rank 0 writes and gets the file list, the
    others get ``[]``. ``dtype`` casts floating-point parameters (buffers such as ``e_score_correction_bias`` keep
    their dtype, as transformers keeps them fp32). ``config.json`` comes from ``nemo_ac.config.hf.registry``.
    """
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    spec = hf_family(family or cfg.family)
    distributed = dist.is_available() and dist.is_initialized()
    writer_rank = not distributed or dist.get_rank() == 0
    out = Path(out_dir)
    experts = {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    params = {canonical_name(n) for n, _ in model.named_parameters()}
    writer = _ShardWriter(out, max_shard_bytes) if writer_rank else None
    if writer is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name, tensor in model_tensors(model).items():
        full = gather_to_writer(tensor) if isinstance(tensor, DTensor) else tensor
        if writer is None:
            continue
        if dtype is not None and name in params and full.is_floating_point():
            full = full.to(dtype)
        for key, value in _hub_entries(name, full, experts, spec):
            writer.add(key, value)
    files: list[Path] = []
    if writer is not None:
        files = writer.finish()
        if write_config:
            config = hf_config_dict(cfg)
            config["dtype"] = str(dtype or next(iter(model.parameters())).dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if distributed:
        dist.barrier()
    return files
