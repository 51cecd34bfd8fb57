"""The tests' own layout: unit tests mirror the package, and no test module imports another.

A unit test of ``nemo_ac/<package>/...`` lives in ``tests/unit/<package>/...`` (top-level modules such as
``cli.py`` and ``preflight.py`` at ``tests/unit/``), so the tests of a module are found where the module is; shared
data and builders live in the helper modules at ``tests/`` (``factories.py``, ``launch.py``, ``parity.py``,
``deepep_standin.py``), never in another test module, which would run that module's tests twice and tie two test
files' fates together."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"
# Folders that test what is not a nemo_ac package: the benchmark scripts and the shipped recipes.
NOT_PACKAGES = {"benchmarks", "recipes"}
HELPERS = {"tests.factories", "tests.launch", "tests.parity", "tests.deepep_standin", "tests.chat_data"}


def test_unit_tests_mirror_the_package():
    misplaced = []
    for path in UNIT.rglob("test_*.py"):
        folder = path.parent.relative_to(UNIT)
        if folder.parts and folder.parts[0] in NOT_PACKAGES:
            continue
        if not (ROOT / "nemo_ac" / folder).is_dir():
            misplaced.append(str(path.relative_to(ROOT)))
    assert not misplaced, f"unit tests outside a folder that mirrors nemo_ac/: {misplaced}"
    loose = sorted(p.name for p in UNIT.glob("test_*.py"))
    top_level = {p.stem for p in (ROOT / "nemo_ac").glob("*.py")}
    assert len(loose) <= len(top_level) + 2, f"tests/unit/ holds {loose}: move package tests into their folder"


def test_no_test_module_imports_another():
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if (
                    name.startswith("tests.")
                    and name not in HELPERS
                    and not name.startswith("tests.functional.workers")
                ):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, (
        f"test modules importing other test modules (move the shared part to tests/factories.py): {offenders}"
    )
