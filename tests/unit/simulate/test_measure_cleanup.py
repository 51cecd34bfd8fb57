"""``nemo_ac.simulate.measure``: a measurement that fails leaves no compile callbacks behind (the accuracy tests
measure several recipes in turn in one process, and callbacks left over from a failed one would count the next
recipe's compiles as theirs too)."""

from __future__ import annotations

import pytest

from nemo_ac.config import load_recipe, validate_recipe
from tests.factories import TINY_PLAN_RECIPE


def test_a_failed_measurement_removes_its_compile_callbacks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Qwen3 MoE measured in a real one-rank gloo group, its counted step made to fail: Dynamo's callback
    handler holds the callbacks it held before (without the ``with``, one more start and end callback each)."""
    from nemo_ac.runtime import destroy_distributed, init_distributed
    from nemo_ac.simulate import measure
    from nemo_ac.workarounds.dynamo_compile_events import compile_callback_handler

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    handler = compile_callback_handler()
    before = (len(handler.start_callbacks), len(handler.end_callbacks))

    def fails(*args, **kwargs):
        raise RuntimeError("the counted step failed")

    monkeypatch.setattr(measure, "measure_step", fails)
    recipe = load_recipe(TINY_PLAN_RECIPE, ["dist.device=cpu", "compile.enabled=false"])
    layout = validate_recipe(recipe, world_size=1)
    env = init_distributed(recipe.dist)
    try:
        with pytest.raises(RuntimeError, match="the counted step failed"):
            measure.measure_step_of(recipe, layout, env=env, out=tmp_path)
    finally:
        destroy_distributed()
    assert (len(handler.start_callbacks), len(handler.end_callbacks)) == before
