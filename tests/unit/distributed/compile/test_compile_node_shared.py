"""``compile.node_shared_cache``: with backend inductor every block compiles through the node-locked inductor backend
(ac_outer blocks keep their inductor options on it); off, or with another backend, torch.compile gets the plain
backend name (the locking itself: tests/unit/workarounds/test_node_shared_compile.py; the cross-rank cache hits:
tests/functional/test_compile_trainer.py)."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.config.schema import ActivationCheckpointingConfig, CompileConfig, ModelConfig, MoEConfig
from nemo_ac.distributed.activation_checkpointing import apply_ac
from nemo_ac.distributed.compile import apply_compile
from nemo_ac.distributed.plan import decide_plan
from nemo_ac.models import build_model
from nemo_ac.workarounds.compiled_regions_under_sac import WRAP_OPTION
from nemo_ac.workarounds.node_shared_compile import NodeSharedInductor


def backends_passed(monkeypatch, compile_config: CompileConfig) -> list[object]:
    seen: list[dict] = []

    def fake_compile(fn, **kwargs):
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = build_model(ModelConfig(num_layers=2, first_k_dense_replace=1, moe=MoEConfig()))
    plan = decide_plan(
        model, compile=compile_config, activation_checkpointing=ActivationCheckpointingConfig(mode="full")
    )
    apply_ac(model, plan=plan)
    apply_compile(model, plan=plan)
    return [(kwargs["backend"], kwargs.get("options")) for kwargs in seen]


def test_inductor_blocks_compile_through_the_node_locked_backend(monkeypatch):
    passed = backends_passed(monkeypatch, CompileConfig(enabled=True, layout="ac_outer"))
    assert passed and all(isinstance(backend, NodeSharedInductor) and options is None for backend, options in passed)
    assert all(backend.options == {WRAP_OPTION: True} for backend, _ in passed)  # the ac_outer option kept


@pytest.mark.parametrize(
    "compile_config",
    [CompileConfig(enabled=True, node_shared_cache=False), CompileConfig(enabled=True, backend="aot_eager")],
    ids=["off", "aot_eager"],
)
def test_off_or_another_backend_passes_the_backend_name(monkeypatch, compile_config):
    passed = backends_passed(monkeypatch, compile_config)
    assert passed and all(backend == compile_config.backend for backend, _ in passed)
