"""``_target_`` instantiation for extension points (optimizer, scheduler, dataset), limited to an allowlist.

The allowlist is checked again here (not only in validation) because this is where the import happens.
"""

from __future__ import annotations

import importlib
from typing import Any

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.validate import TARGET_ALLOWLIST


def resolve_target(path: str, *, key: str) -> Any:
    if not path.startswith(TARGET_ALLOWLIST):
        raise ConfigError(ConfigIssue(key, f"{path!r} is outside the allowed module prefixes {list(TARGET_ALLOWLIST)}"))
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(ConfigIssue(key, f"cannot import {path!r}: {exc}")) from exc


def instantiate(spec: dict[str, Any], *args: Any, key: str, **kwargs: Any) -> Any:
    """Call ``spec['_target_']`` with positional ``args`` and the spec's other keys merged over ``kwargs``."""
    options = dict(spec)
    target = resolve_target(str(options.pop("_target_", "")), key=f"{key}._target_")
    return target(*args, **{**kwargs, **options})
