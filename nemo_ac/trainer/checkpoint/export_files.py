"""What an HF export carries besides config.json and the safetensors: tokenizer / processor files and
generation_config.json, so ``AutoTokenizer`` / ``AutoProcessor`` / ``generate`` work on the exported directory alone.

Sources, first one that has the files wins: ``model.pretrained`` (its tokenizer is the one the weights were trained
with), then ``data.tokenizer`` (what this run tokenized with). A Hub id is read from the local Hugging Face cache
(the run downloaded it) and downloaded only when the cache misses and ``HF_HUB_OFFLINE`` is unset. The tiny byte
tokenizer (``data.tokenizer`` null / tiny) has no HF files: an export of a tiny recipe carries none, and says so.

``generation_config.json`` is copied from the first source that has one; otherwise it is written from the token
ids the model's config.json carries (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``), or the tiny
tokenizer's when that is what the run used. No torch here.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any

from nemo_ac.config.pretrained import load_pretrained_config, looks_like_hub_id
from nemo_ac.config.schema import RecipeConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
GENERATION_CONFIG = "generation_config.json"
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _local_dir(name: str, patterns: tuple[str, ...]) -> Path | None:
    """A local directory holding ``name``'s files matching ``patterns`` (a Hub id: the cache, else a download)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not looks_like_hub_id(name):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    for local_only in (True, False):
        try:
            return Path(snapshot_download(name, allow_patterns=list(patterns), local_files_only=local_only))
        except Exception:  # not cached / offline / unknown repo: try the next way, then give up
            continue
    return None


def _sources(recipe: RecipeConfig) -> list[str]:
    names = [recipe.model.pretrained, recipe.data.tokenizer]
    return [n for i, n in enumerate(names) if n and n != "tiny" and n not in names[:i]]


def _matching(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns))


def _token_ids(recipe: RecipeConfig) -> dict[str, Any]:
    """bos / eos / pad ids from model.pretrained's config.json (top level or text_config), else the tiny
    tokenizer's when the run used it."""
    if recipe.model.pretrained:
        try:
            config = load_pretrained_config(recipe.model.pretrained).config
        except ValueError:  # ConfigError: the checkpoint's config is gone; fall through to the tokenizer
            config = {}
        text = config.get("text_config") or {}
        ids = {k: config.get(k, text.get(k)) for k in _TOKEN_IDS}
        if any(v is not None for v in ids.values()):
            return ids
    if recipe.data.tokenizer in (None, "tiny"):
        from nemo_ac.data.tiny_tokenizer import TinyChatTokenizer

        tiny = TinyChatTokenizer()
        return {"bos_token_id": tiny.im_start_id, "eos_token_id": tiny.im_end_id, "pad_token_id": tiny.pad_id}
    return {}


def write_export_extras(recipe: RecipeConfig, out: Path) -> list[str]:
    """Copy tokenizer / processor files and write generation_config.json into ``out``; returns one line per thing
    done (or missing), for the export's printout."""
    lines = []
    copied_from = None
    generation: Path | None = None
    for name in _sources(recipe):
        root = _local_dir(name, (*TOKENIZER_FILES, GENERATION_CONFIG))
        if root is None:
            lines.append(f"tokenizer: {name} is neither a local directory nor in the Hugging Face cache; skipped")
            continue
        if generation is None and (root / GENERATION_CONFIG).is_file():
            generation = root / GENERATION_CONFIG
        found = _matching(root, TOKENIZER_FILES)
        if found and copied_from is None:
            for file in found:
                shutil.copyfile(file, out / file.name)
            copied_from = name
            lines.append(f"tokenizer: {', '.join(f.name for f in found)} from {name}")
    if copied_from is None:
        lines.append("tokenizer: none (no model.pretrained / data.tokenizer with Hugging Face tokenizer files)")
    ids = {k: v for k, v in _token_ids(recipe).items() if v is not None}
    if generation is not None:
        shutil.copyfile(generation, out / GENERATION_CONFIG)
        lines.append(f"{GENERATION_CONFIG}: copied from {generation.parent}")
    else:
        (out / GENERATION_CONFIG).write_text(json.dumps({**ids, "_from_model_config": True}, indent=2) + "\n")
        lines.append(f"{GENERATION_CONFIG}: written from the token ids {ids or '(none known)'}")
    config_file = out / "config.json"
    if ids and config_file.is_file():  # the model's own special-token ids, as the pretrained config.json says
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**ids, **config}, indent=2) + "\n")
    return lines
