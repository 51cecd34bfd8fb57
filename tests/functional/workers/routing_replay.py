"""torchrun worker (2 gloo ranks, EP2): full activation checkpointing where the router would choose differently in
the recompute, with and without routing replay.

``python routing_replay.py OUT.json key=value ...`` trains one step of the tiny recipe three times through the
production build: without AC (the reference), with full AC (routing replayed), and with full AC and
``activation_checkpointing.replay_routing=false`` (the old behaviour). A test-only perturbation makes the router
pick each token's experts shifted by one whenever it runs inside backward, i.e. in a checkpoint's recompute. Each
run snapshots every parameter's full gradient just before the optimizer step. Rank 0 writes ``{"replay":
{"max_grad_diff", "loss_diff"}, "no_replay": {"error"} or {"max_grad_diff"}}``; the no-replay run goes last, since
its failure may leave the ranks' collectives out of step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from nemo_ac.config import load_recipe, validate_recipe
from nemo_ac.models.layers import routing_replay
from nemo_ac.runtime import destroy_distributed, exit_process, init_distributed
from nemo_ac.trainer.build import build_trainer, build_training, quiet_logger
from tests.parity import gradient_snapshot, max_gradient_difference

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "tiny" / "qwen3_moe_tiny.yaml"


def reroute_in_backward() -> None:
    real = routing_replay.choose_experts

    def perturbed(scores, bias, **kwargs):
        ids = real(scores, bias, **kwargs)
        if torch._C._current_graph_task_id() != -1:  # inside backward: a checkpoint's recompute
            return (ids + 1) % scores.shape[-1]
        return ids

    routing_replay.choose_experts = perturbed


def one_step(recipe, layout, device) -> tuple[float, dict[str, torch.Tensor]]:
    setup = build_training(recipe, layout, device=device)
    trainer = build_trainer(setup, logger=quiet_logger(recipe))
    snapshot: dict[str, torch.Tensor] = {}
    real_step = setup.optimizer.step

    def step(*args, **kwargs):
        snapshot.update(gradient_snapshot(setup.model))
        return real_step(*args, **kwargs)

    setup.optimizer.step = step
    (metrics,) = trainer.fit()
    return metrics.loss, snapshot


def with_ac(recipe, *, mode: str, replay: bool = True):
    ac = dataclasses.replace(recipe.activation_checkpointing, mode=mode, replay_routing=replay)
    return dataclasses.replace(recipe, activation_checkpointing=ac)


def main(out_path: str, overrides: list[str]) -> int:
    base = load_recipe(str(RECIPE), overrides)
    env = init_distributed(base.dist)
    layout = validate_recipe(base, world_size=env.world_size)
    reroute_in_backward()
    result: dict = {}
    ok = False
    try:
        loss, reference = one_step(with_ac(base, mode="none"), layout, env.device)
        replay_loss, replayed = one_step(with_ac(base, mode="full"), layout, env.device)
        result["replay"] = {
            "max_grad_diff": max_gradient_difference(replayed, reference),
            "loss_diff": abs(replay_loss - loss),
            "parameters": len(reference),
        }
        if env.rank == 0:  # written now: the next run may fail
            Path(out_path).write_text(json.dumps(result))
        try:
            _, rerouted = one_step(with_ac(base, mode="full", replay=False), layout, env.device)
            result["no_replay"] = {"max_grad_diff": max_gradient_difference(rerouted, reference)}
            ok = True
        except Exception as exc:  # the old behaviour's failure, recorded
            result["no_replay"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        return 0
    finally:
        if env.rank == 0 and result:
            Path(out_path).write_text(json.dumps(result))
        destroy_distributed(synchronize=ok)


if __name__ == "__main__":
    exit_process(main(sys.argv[1], sys.argv[2:]))
