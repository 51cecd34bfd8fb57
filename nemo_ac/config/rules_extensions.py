"""Rules for the extension points: ``_target_`` (optimizer, scheduler, data source) may name only callables under
the built-in module prefixes or under a prefix the recipe lists in ``extensions.allow``.

Same contract as every rule in ``validate.RULES``; ``targets`` uses ``target_allowed`` / ``target_refusal`` again
where the import happens.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import RecipeConfig

# _target_ extension points may only name callables under these module prefixes, or under a prefix the recipe lists
# in extensions.allow.
TARGET_ALLOWLIST = ("torch.optim.", "nemo_ac.")


def prefix_matches(target: str, prefix: str) -> bool:
    """``"mypkg."`` matches everything under mypkg; ``"mypkg.optim"`` matches that module and its submodules."""
    return target.startswith(prefix if prefix.endswith(".") else prefix + ".")


def target_allowed(target: str, allow: Sequence[str] = ()) -> bool:
    return target.startswith(TARGET_ALLOWLIST) or any(prefix_matches(target, p) for p in allow if p.strip())


def target_refusal(target: str, allow: Sequence[str] = ()) -> str:
    """Why ``target`` is refused, naming the key that would allow it."""
    extra = f" or extensions.allow {list(allow)}" if allow else ""
    return (
        f"{target!r} is outside the allowed module prefixes {list(TARGET_ALLOWLIST)}{extra}; to import your own "
        f"module, add its prefix to extensions.allow (e.g. extensions.allow: ['{target.split('.')[0]}.'])"
    )


def check_target(key: str, spec: dict | None, allow: Sequence[str] = ()) -> list[ConfigIssue]:
    if spec is None:
        return []
    target = spec.get("_target_")
    if not isinstance(target, str) or not target:
        return [ConfigIssue(f"{key}._target_", "missing; give a dotted path such as torch.optim.AdamW")]
    if not target_allowed(target, allow):
        return [ConfigIssue(f"{key}._target_", target_refusal(target, allow))]
    return []


def check_extensions(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """extensions.allow holds module prefixes; data.source is a _target_ like train.optimizer."""
    issues = []
    for i, prefix in enumerate(recipe.extensions.allow):
        parts = prefix.removesuffix(".").split(".")
        if not prefix.strip():
            issues.append(ConfigIssue(f"extensions.allow[{i}]", "must not be empty (it would allow every module)"))
        elif not all(part.isidentifier() for part in parts):
            issues.append(
                ConfigIssue(
                    f"extensions.allow[{i}]",
                    f"{prefix!r} is not a module prefix; give a dotted module path ending in '.' ('mypkg.': every "
                    "module under mypkg) or a full module path ('mypkg.optim': that module and its submodules)",
                )
            )
        elif parts[0] in sys.stdlib_module_names:
            issues.append(
                ConfigIssue(
                    f"extensions.allow[{i}]",
                    f"{prefix!r} is in the Python standard library; extensions.allow is for your own modules (an "
                    "optimizer, scheduler or batch source): list their package, e.g. 'mypkg.'",
                )
            )
    data = recipe.data
    issues.extend(check_target("data.source", data.source, recipe.extensions.allow))
    if data.source is not None and data.kind != "synthetic":
        issues.append(
            ConfigIssue("data.kind", f"{data.kind!r} with data.source: the source replaces data.kind; drop one of them")
        )
    return issues
