"""The batch source a recipe's ``data.kind`` (or its own ``data.source``) asks for, for one data-parallel rank.

The sources (and a user's ``data.source``) have the same interface (``batches_for_step``, iteration with a position, ``state_dict`` /
``load_state_dict`` for checkpoints) and the same layout-independent row assignment, so the trainer and the
checkpointer never look at which one they hold. Only configs cross in here (the vision config gives MedPix the
image placeholder ids and patch geometry); no model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from nemo_ac.config.schema import DataConfig, RecipeConfig, VisionConfig
from nemo_ac.config.targets import instantiate
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.data.medpix import MedPixBatches
from nemo_ac.data.text import TextBatches

# What the loop and the checkpointer call on a batch source (plus its ``next_step`` position attribute).
_SOURCE_INTERFACE = ("batches_for_step", "state_dict", "load_state_dict", "__iter__", "__next__")


def build_batches(
    data_cfg: DataConfig,
    *,
    vocab_size: int,
    vision: VisionConfig,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    extensions: Sequence[str] = (),
) -> SyntheticBatches | MedPixBatches | TextBatches | Any:
    """``data.kind: synthetic`` -> packed synthetic tasks; ``medpix`` -> MedPix-VQA chat documents with images;
    ``text`` -> plain-text or chat documents (``nemo_ac.data.text``); ``data.source`` -> the user's ``_target_`` (its module under a prefix in ``extensions``, extensions.allow)."""
    if data_cfg.source is not None:
        source = instantiate(
            data_cfg.source,
            key="data.source",
            allow=extensions,
            data_cfg=data_cfg,
            vocab_size=vocab_size,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
        missing = [name for name in _SOURCE_INTERFACE if not callable(getattr(source, name, None))]
        if missing or not hasattr(source, "next_step"):
            target = data_cfg.source.get("_target_")
            raise TypeError(
                f"data.source._target_: {target!r} returned a {type(source).__name__} without "
                f"{', '.join([*missing, *(['next_step'] if not hasattr(source, 'next_step') else [])])}; a batch "
                "source has the interface of nemo_ac.data.loader.SyntheticBatches"
            )
        return source
    rows = {
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seed": seed,
    }
    if data_cfg.kind == "medpix":
        return MedPixBatches(data_cfg, vision=vision, **rows)
    if data_cfg.kind == "text":
        # Rank 0 of the run says which cache entry it mapped (a builder always says what it built).
        announce = os.environ.get("RANK", "0") == "0"
        return TextBatches(data_cfg, vocab_size=vocab_size, announce=announce, **rows)
    if data_cfg.kind != "synthetic":
        raise ValueError(f"data.kind: unknown {data_cfg.kind!r}; use synthetic, medpix or text")
    return SyntheticBatches(data_cfg, vocab_size=vocab_size, **rows)


def recipe_batches(recipe: RecipeConfig, *, dp_rank: int, dp_size: int) -> Any:
    """``build_batches`` with every argument taken from ``recipe``: the batch source of one dp rank of a run (the
    trainer's) or of its dry run (``nemo_ac.simulate``)."""
    return build_batches(
        recipe.data,
        vocab_size=recipe.model.vocab_size,
        vision=recipe.model.vision,
        global_batch_size=recipe.train.global_batch_size,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=recipe.train.seed,
        extensions=recipe.extensions.allow,
    )
