"""Aux-loss-free bias updates in the loop (``model.moe.bias_update_rate``): the callback receives the step's expert
loads summed over all micro batches and moves each router's bias by ``rate * sign(mean - load)``. That the loads
are also summed over ranks (all-reduced) is proven end to end by tests/functional/test_model_families.py: ws1 and
ws2 runs end with identical biases."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from nemo_ac.config.schema import DataConfig, ModelConfig, MoEConfig, TrainConfig
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.models import build_model
from nemo_ac.models.expert_bias import biased_routers
from nemo_ac.models.init import materialize_and_init
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.expert_balance import expert_bias_callbacks
from nemo_ac.trainer.loop import LoopOptions, Trainer
from nemo_ac.trainer.metrics import MetricsLogger
from nemo_ac.trainer.optim import build_optimizer, build_scheduler
from tests.factories import glm_config

RATE = 0.01


def _trainer(model, *, callbacks, micro_batches: int):
    train = TrainConfig(steps=1, global_batch_size=2 * micro_batches, micro_batch_size=2, warmup_steps=0)
    optimizer = build_optimizer(model, train, device_type="cpu")
    data = SyntheticBatches(
        DataConfig(seq_len=40, min_doc_tokens=3, max_doc_tokens=8),
        vocab_size=model.config.vocab_size,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=3,
    )
    logger = MetricsLogger(
        run_dir="unused", total_steps=1, enabled=False, jsonl=False, progress_bar="never", log_every=1
    )
    options = LoopOptions(steps=1, grad_clip=1.0, aux_loss_coef=0.0, post_step_callbacks=callbacks)
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, train),
        data=data,
        prepare_batch=make_batch_preparer(cp=1),
        device=torch.device("cpu"),
        logger=logger,
        options=options,
    )
    return trainer, data


def test_bias_update_uses_the_loads_of_all_micro_batches() -> None:
    cfg = glm_config(moe=dataclasses.replace(glm_config().moe, bias_update_rate=RATE))
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    reference = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    update = expert_bias_callbacks(model, moe=cfg.moe)
    assert len(update) == 1
    trainer, data = _trainer(
        model, callbacks=[lambda step, info: seen.append(info["expert_load"].clone()), *update], micro_batches=3
    )

    # What the routers of the initial weights assign, micro batch by micro batch.
    per_micro = []
    with torch.no_grad():
        for batch in data.batches_for_step(0):
            prepared = make_batch_preparer(cp=1)(batch)
            stats = reference(**prepared.model_inputs).router_stats
            per_micro.append(torch.stack([s.tokens_per_expert for s in stats]))
    assert len(per_micro) == 3 and not torch.equal(per_micro[0], per_micro[1])
    expected_load = sum(per_micro)

    trainer.train_step()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], expected_load, rtol=0, atol=0)
    expected_delta = RATE * torch.sign(expected_load.mean(dim=-1, keepdim=True) - expected_load)
    assert expected_delta.abs().sum() > 0
    for layer, router in enumerate(biased_routers(model)):
        torch.testing.assert_close(router.e_score_correction_bias, expected_delta[layer], rtol=0, atol=0)


def test_no_callback_without_a_rate_and_a_clear_error_without_biased_routers() -> None:
    cfg = glm_config()
    model = materialize_and_init(build_model(cfg), device="cpu", seed=0)
    assert expert_bias_callbacks(model, moe=cfg.moe) == []  # bias_update_rate 0: nothing to update
    qwen = build_model(ModelConfig(moe=MoEConfig(num_experts=4, moe_intermediate_size=8, bias_update_rate=RATE)))
    with pytest.raises(ValueError, match=r"score_correction_bias: true"):
        expert_bias_callbacks(qwen, moe=qwen.config.moe)
