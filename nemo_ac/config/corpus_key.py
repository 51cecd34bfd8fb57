"""What a tokenized ``data.kind: text`` corpus depends on, and where its cache entry lives. Pure Python (no torch):
the preflight computes the same key the loader does.

The key holds everything that changes the token stream, and nothing else:

- the dataset: a local file or directory by every file's (relative path, size, mtime_ns), as ``make`` and
  ``datasets`` judge a local file changed; a Hub id by its resolved revision (commit sha), and the split;
- the column and whether rows are chats or plain text;
- the tokenizer: the shipped tiny one by its layout version; a Hugging Face one by the SHA-256 of each of its files
  (``TOKENIZER_FILES``: vocabulary, merges, added tokens, its config and its chat template);
- ``data.chat_template``'s text, when set;
- ``TOKENIZATION_VERSION`` and the on-disk format: bumped whenever the code that turns rows into tokens changes.

``data.seq_len``, the seed, the batch sizes and the parallel layout are not in it: rows are cut from the cached
stream at read time, so one entry serves every layout, every row length and every resume.

Where: ``data.cache_dir``, else ``$NEMO_AC_DATA_CACHE``, else ``~/.cache/nemo_ac/tokenized``. Node-local disk:
built once per node. Shared storage: built once for the whole job (the builder holds a lock file; the others wait),
or beforehand on a login node with ``nemo-ac tokenize RECIPE``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.schema import DataConfig, RecipeConfig

TOKENIZATION_VERSION = 1
TINY_TOKENIZER_VERSION = 1
ENV_CACHE_DIR = "NEMO_AC_DATA_CACHE"
# The files that make a Hugging Face tokenizer what it is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)


def cache_root(data: DataConfig) -> Path:
    configured = data.cache_dir or os.environ.get(ENV_CACHE_DIR) or "~/.cache/nemo_ac/tokenized"
    return Path(configured).expanduser()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _local_files(root: Path) -> list[list[Any]]:
    """(relative path, size, mtime_ns) of every non-hidden file under ``root`` (or of ``root`` itself)."""
    if root.is_file():
        stat = root.stat()
        return [[root.name, stat.st_size, stat.st_mtime_ns]]
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            stat = path.stat()
            files.append([relative.as_posix(), stat.st_size, stat.st_mtime_ns])
    return files


def hub_revision(repo_id: str, *, repo_type: str) -> str | None:
    """The commit sha a Hub repo resolves to now: asked of the Hub, else (offline) the local cache's ``refs/main``;
    None when neither knows (the loader then fails on its own, offline and uncached)."""
    try:
        from huggingface_hub import HfApi, constants
    except ImportError:
        return None
    try:
        info = HfApi().repo_info(repo_id, repo_type=repo_type)
        return str(info.sha)
    except Exception:
        pass
    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = Path(constants.HF_HUB_CACHE) / folder / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


def dataset_identity(data: DataConfig) -> dict[str, Any]:
    local = Path(str(data.path)).expanduser()
    if local.exists():
        return {"local": str(local.resolve()), "split": data.split, "files": _local_files(local)}
    return {"hub": data.path, "split": data.split, "revision": hub_revision(str(data.path), repo_type="dataset")}


def tokenizer_directory(name: str) -> Path:
    """A local tokenizer directory as it is; a Hub id's tokenizer files fetched into (or found in) the HF cache."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=name, allow_patterns=list(TOKENIZER_FILES)))


def tokenizer_identity(data: DataConfig) -> dict[str, Any]:
    if data.tokenizer in (None, "tiny"):
        return {"tiny": TINY_TOKENIZER_VERSION}
    try:
        directory = tokenizer_directory(data.tokenizer)
    except Exception as exc:  # offline and not cached, a typo, a private repo
        raise ConfigError(
            ConfigIssue(
                "data.tokenizer",
                f"{data.tokenizer!r} is no local directory and its tokenizer files cannot be fetched from the Hub "
                f"({type(exc).__name__}: {str(exc)[:200]}); point data.tokenizer at the model's tokenizer directory "
                "or a Hub id this machine can reach (HF_HUB_OFFLINE=1 needs it in the local cache)",
            )
        ) from exc
    files = {name: _sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()}
    return {"name": data.tokenizer, "files": files}


def corpus_key(data: DataConfig) -> dict[str, Any]:
    """The key of ``data``'s tokenized corpus (module docstring); reads file sizes and the tokenizer's files."""
    template = Path(data.chat_template).expanduser() if data.chat_template else None
    return {
        "tokenization": TOKENIZATION_VERSION,
        "dataset": dataset_identity(data),
        "rows": "chat" if data.messages_column else "text",
        "column": data.messages_column or data.text_column,
        "tokenizer": tokenizer_identity(data),
        "chat_template": _sha256_file(template) if template is not None else None,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.")[:40] or "data"


def entry_name(data: DataConfig, key: dict[str, Any]) -> str:
    """``<dataset>.<split>.<column>.<tokenizer>-<digest>``: readable, and unique per key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    dataset = Path(str(data.path)).name if Path(str(data.path)).exists() else str(data.path)
    tokenizer = Path(data.tokenizer).name if data.tokenizer not in (None, "tiny") else "tiny"
    return ".".join(_slug(part) for part in (dataset, data.split, str(key["column"]), tokenizer)) + f"-{digest}"


def _offline(data: DataConfig) -> bool:
    """Whether the key can be computed without the network (a local dataset and a tiny or local tokenizer)."""
    tokenizer_local = data.tokenizer in (None, "tiny") or Path(str(data.tokenizer)).expanduser().is_dir()
    return bool(data.path) and Path(str(data.path)).expanduser().exists() and tokenizer_local


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except ValueError:
        return False


def check_text_corpus(recipe: RecipeConfig) -> list[ConfigIssue]:
    """Before any process group, for ``data.kind: text`` read offline: ``data.chat_template`` exists; a chat
    recipe's local tokenizer has a chat template; and the cache entry is either complete or can be written."""
    data = recipe.data
    if data.kind != "text" or data.source is not None:
        return []
    issues = []
    if data.chat_template and not Path(data.chat_template).expanduser().is_file():
        issues.append(
            ConfigIssue("data.chat_template", f"{data.chat_template!r} is no file; point it at a Jinja chat template")
        )
    if data.chat_template and data.tokenizer in (None, "tiny"):
        issues.append(
            ConfigIssue(
                "data.chat_template",
                "the tiny tokenizer has its own ChatML layout and takes no chat template; set data.tokenizer to a "
                "Hugging Face tokenizer, or remove data.chat_template",
            )
        )
    local_tokenizer = Path(str(data.tokenizer)).expanduser()
    hf_chat = data.messages_column and not data.chat_template and data.tokenizer not in (None, "tiny")
    if hf_chat and local_tokenizer.is_dir() and not _has_chat_template(local_tokenizer):
        issues.append(
            ConfigIssue(
                "data.tokenizer",
                f"{data.tokenizer!r} has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json), which data.messages_column needs to render the chats: set "
                "data.chat_template to a Jinja file with the model's chat format, or use the model's own tokenizer",
            )
        )
    if issues or not _offline(data):
        return issues
    root = cache_root(data)
    entry = root / entry_name(data, corpus_key(data))
    if (entry / "meta.json").is_file():
        return []  # built: mapped read-only, whatever the directory's permissions
    probe = root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        return [
            ConfigIssue(
                "data.cache_dir",
                f"'{root}' cannot be written ({probe} is not a writable directory) and the tokenized corpus of "
                f"{data.path!r} is not there yet: point data.cache_dir (or ${ENV_CACHE_DIR}) at a writable directory, "
                "or tokenize it once where it can be written (nemo-ac tokenize RECIPE) and copy the entry here",
            )
        ]
    return []
