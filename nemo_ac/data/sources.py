"""The batch source a recipe's ``data.kind`` asks for, for one data-parallel rank.

Both sources have the same interface (``batches_for_step``, iteration with a position, ``state_dict`` /
``load_state_dict`` for checkpoints) and the same layout-independent row assignment, so the trainer and the
checkpointer never look at which one they hold. Only configs cross in here (the vision config gives MedPix the
image placeholder ids and patch geometry); no model.
"""

from __future__ import annotations

from nemo_ac.config.schema import DataConfig, VisionConfig
from nemo_ac.data.loader import SyntheticBatches
from nemo_ac.data.medpix import MedPixBatches
from nemo_ac.data.text import TextBatches


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
) -> SyntheticBatches | MedPixBatches | TextBatches:
    """``data.kind: synthetic`` -> packed synthetic tasks; ``medpix`` -> MedPix-VQA chat documents with images;
    ``text`` -> plain-text or chat documents (``nemo_ac.data.text``)."""
    if data_cfg.kind == "medpix":
        return MedPixBatches(
            data_cfg,
            vision=vision,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
    if data_cfg.kind == "text":
        return TextBatches(
            data_cfg,
            vocab_size=vocab_size,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
    if data_cfg.kind != "synthetic":
        raise ValueError(f"data.kind: unknown {data_cfg.kind!r}; use synthetic, medpix or text")
    return SyntheticBatches(
        data_cfg,
        vocab_size=vocab_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )
