"""The package's dependency rules, read from its imports: what each layer may not import, and no import circle.

The rules (docs/architecture.md): ``config/`` validates a recipe before any process group, so it imports neither
torch.distributed nor the packages that build and run a model; ``models/`` knows nothing of how it is parallelized
or trained; ``distributed/`` nothing of the loop or the data; ``data/`` no model, loop or parallelizer;
``diagnostics/`` is used by ``trainer/`` and ``distributed/`` and uses neither; ``workarounds/`` sits below
everything but ``config/``'s pure types. Every import counts, a lazy one inside a function included; a circle is
looked for among the module-level imports (those under ``if TYPE_CHECKING:`` included).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.factories import PACKAGE_DIR

FORBIDDEN = {
    "config": ("models", "distributed", "trainer", "data", "simulate", "doctor", "compat", "torch.distributed"),
    "models": ("distributed", "trainer", "data", "simulate", "doctor", "compat", "train", "cli"),
    "distributed": ("trainer", "data", "simulate", "doctor", "compat", "train", "cli"),
    "data": ("models", "distributed", "trainer", "simulate", "doctor", "compat"),
    "diagnostics": ("distributed", "trainer", "simulate", "doctor", "compat"),
    "workarounds": ("config", "models", "distributed", "trainer", "data", "simulate", "doctor", "compat"),
}


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(package_dir: Path) -> dict[str, list[tuple[str, bool, int]]]:
    """Module -> (imported name, runs at load, line) for each import of nemo_ac or torch.distributed. ``from pkg
    import submodule`` counts as an import of the submodule alone."""
    modules = {_module_name(path, package_dir): path for path in package_dir.rglob("*.py")}
    found: dict[str, list[tuple[str, bool, int]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        at_load = {
            id(node)
            for top in tree.body
            if not isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            for node in ast.walk(top)
        }
        found[name] = []
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = submodules if all(s in modules for s in submodules) else [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.split(".")[0] == package_dir.name or target.startswith("torch.distributed"):
                    found[name].append((target, id(node) in at_load, node.lineno))
    return found


def layer_violations(package_dir: Path) -> list[str]:
    root = package_dir.name
    violations = []
    for module, imports in sorted(_imports(package_dir).items()):
        layer = module.split(".")[1] if "." in module else ""
        for target, _, line in imports:
            for banned in FORBIDDEN.get(layer, ()):
                full = banned if banned.startswith("torch") else f"{root}.{banned}"
                if target == full or target.startswith(full + "."):
                    violations.append(f"{module}:{line} imports {target} ({layer}/ may not import {banned})")
    return violations


def import_circles(package_dir: Path) -> list[list[str]]:
    """Strongly connected groups of more than one module among the module-level imports."""
    imports = _imports(package_dir)
    graph: dict[str, set[str]] = {module: set() for module in imports}
    for module, targets in imports.items():
        for target, at_load, _ in targets:
            while target and target not in graph:
                target = target.rpartition(".")[0]
            if at_load and target and target != module:
                graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_layer_imports_what_it_may_not():
    assert not layer_violations(PACKAGE_DIR)


def test_no_import_circle():
    assert not import_circles(PACKAGE_DIR)


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """Not blind: data/ importing distributed/ (lazily) and two modules importing each other are both found."""
    package = tmp_path / "nemo_ac"
    for folder in ("data", "distributed", "simulate"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "data" / "medpix.py").write_text("def f():\n    from nemo_ac.distributed.env import once\n")
    (package / "distributed" / "env.py").write_text("once = 1\n")
    (package / "simulate" / "counters.py").write_text("from nemo_ac.simulate.fusion import regions\nop = 1\n")
    (package / "simulate" / "fusion.py").write_text("from nemo_ac.simulate.counters import op\nregions = 1\n")
    assert layer_violations(package) == [
        "nemo_ac.data.medpix:2 imports nemo_ac.distributed.env (data/ may not import distributed)"
    ]
    assert import_circles(package) == [["nemo_ac.simulate.counters", "nemo_ac.simulate.fusion"]]
