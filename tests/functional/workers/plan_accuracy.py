"""Worker of tests/functional/test_plan_accuracy.py: several recipes measured in turn in one process group.

    torchrun --nproc-per-node N tests/functional/workers/plan_accuracy.py CASES.json

CASES.json: [{"recipe": path, "overrides": [...], "out": dir}, ...]; each case is ``nemo_ac.simulate.measure``'s step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed, world_size_from_env
from nemo_ac.simulate.measure import measure_step_of


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    first = load_recipe(cases[0]["recipe"], cases[0]["overrides"])
    env = init_distributed(first.dist)
    for case in cases:
        recipe = load_recipe(case["recipe"], case["overrides"])
        layout = validate_recipe(recipe, world_size=world_size_from_env())
        measure_step_of(recipe, layout, env=env, out=Path(case["out"]))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_process(main())
