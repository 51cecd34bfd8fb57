"""The recipes shipped in the package (``nemo_ac/recipes``, a link to the repository's ``recipes/``).

``nemo-ac recipes`` lists them; ``nemo-ac train`` and ``validate`` accept a shipped recipe's name
(``tiny/qwen3_moe_tiny``) where a path is expected. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class ShippedRecipe:
    name: str  # path under recipes/ without .yaml, e.g. "tiny/qwen3_moe_tiny"
    path: Path
    description: str  # the first sentence of the recipe's opening comment


def recipes_root() -> Path:
    return Path(str(resources.files("nemo_ac") / "recipes"))


def shipped_data_file(path: str) -> Path | None:
    """The copy shipped with nemo_ac (``nemo_ac/shipped_data``, a link to the repository's ``data/``) of a relative
    ``data/<file>`` path, or None when ``path`` is not of that form or no such file ships."""
    parts = Path(path).parts
    if Path(path).is_absolute() or len(parts) != 2 or parts[0] != "data":
        return None
    candidate = Path(str(resources.files("nemo_ac") / "shipped_data")) / parts[1]
    return candidate.resolve() if candidate.is_file() else None


def _description(path: Path, limit: int = 110) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(part for part in lines if part)
    sentence = text.split(". ", 1)[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def shipped_recipes() -> list[ShippedRecipe]:
    root = recipes_root()
    if not root.is_dir():
        return []
    paths = sorted(root.rglob("*.yaml"), key=lambda p: (len(p.relative_to(root).parts), str(p)))
    return [ShippedRecipe(str(p.relative_to(root).with_suffix("")), p, _description(p)) for p in paths]


def resolve_recipe(arg: str) -> str:
    """A path that exists stays as given; otherwise a shipped recipe's name (with or without ``.yaml``, with or
    without a leading ``recipes/``) becomes its path; anything else is returned unchanged (loading reports it)."""
    if Path(arg).exists():
        return arg
    name = arg.removeprefix("recipes/").removesuffix(".yaml")
    for recipe in shipped_recipes():
        if recipe.name == name:
            return str(recipe.path)
    return arg
