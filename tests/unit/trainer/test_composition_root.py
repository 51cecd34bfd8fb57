"""One composition root: ``trainer.build.build_training`` is the only place in the package that runs the build
steps, and the run (``nemo_ac.train``), the measured step (``simulate.measure``) and the dry run
(``simulate.run``) all build through it. A second sequence elsewhere (the dry run's own freeze -> optimizer ->
scheduler, as it once had) would let the dry run count something a run never builds without any test noticing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.factories import REPO_ROOT

PACKAGE = REPO_ROOT / "nemo_ac"
ROOT = PACKAGE / "trainer" / "build.py"
# The build sequence's steps, in order: the plan, meshes and the parallelized model, weights, frozen groups, the
# optimizer and its scheduler (the data source is not among them: the dry run makes its own micro batches,
# ``simulate.inputs``). ``decide_plan`` is among them: the recipe's sections reach the plan from the root alone.
BUILD_STEPS = frozenset(
    {
        "decide_plan",
        "parallelize",
        "build_parallel_model",
        "materialize_weights",
        "freeze",
        "build_optimizer",
        "build_scheduler",
    }
)
BUILDERS = ("train.py", "simulate/measure.py", "simulate/run.py")


def called_names(path: Path) -> set[str]:
    """Names of the functions ``path`` calls (``f(...)`` and ``module.f(...)``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                names.add(node.func.attr)
    return names


def test_only_the_composition_root_runs_the_build_steps() -> None:
    elsewhere = {
        str(path.relative_to(REPO_ROOT)): sorted(called_names(path) & BUILD_STEPS)
        for path in PACKAGE.rglob("*.py")
        if path != ROOT and called_names(path) & BUILD_STEPS
    }
    assert elsewhere == {}, f"build steps called outside trainer/build.py's build_training: {elsewhere}"
    assert called_names(ROOT) >= BUILD_STEPS


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_run_the_measured_step_and_the_dry_run_build_through_it(builder: str) -> None:
    assert "build_training" in called_names(PACKAGE / builder)
