"""``_target_`` instantiation for extension points (optimizer, scheduler, dataset), limited to an allowlist: the
built-in prefixes (``rules_extensions.TARGET_ALLOWLIST``) plus the recipe's ``extensions.allow``.

The allowlist is checked again here (not only in validation) because this is where the import happens.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.rules_extensions import target_allowed, target_refusal


def resolve_target(path: str, *, key: str, allow: Sequence[str] = ()) -> Any:
    if not target_allowed(path, allow):
        raise ConfigError(ConfigIssue(key, target_refusal(path, allow)))
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        hint = " (is the module installed or on PYTHONPATH on every node?)" if isinstance(exc, ImportError) else ""
        raise ConfigError(ConfigIssue(key, f"cannot import {path!r}: {exc}{hint}")) from exc


def instantiate(spec: dict[str, Any], *args: Any, key: str, allow: Sequence[str] = (), **kwargs: Any) -> Any:
    """Call ``spec['_target_']`` with positional ``args`` and the spec's other keys merged over ``kwargs``."""
    options = dict(spec)
    target = resolve_target(str(options.pop("_target_", "")), key=f"{key}._target_", allow=allow)
    return target(*args, **{**kwargs, **options})
