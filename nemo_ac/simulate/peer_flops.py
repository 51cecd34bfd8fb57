"""Model FLOPs by NeMo Automodel's own per-model formula, so that a plan's TFLOP/s and MFU compare with the figures
Automodel publishes (its benchmark table divides each of its measured steps by this formula).

nemo_ac's MFU (``StepEstimate.mfu``) divides the FLOPs torch's formulas count over the step's forward and backward
(visible attention pairs, no recompute). Automodel's formulas are per model family from the Hugging Face config:
GEMMs over every token at the full row length, causal attention as half the row, the LM head, times three for
forward and backward. The two differ by what they call model work; a plan prints both, each named.

The formula is Automodel's code, not a copy: ``nemo_automodel.components.utils.flops_utils`` picks it from the
transformers config class that ``hf_config_dict`` (the recipe's model as a ``config.json``) builds. Both packages are
optional (``pip install 'nemo_ac[automodel]'``); without them, or for a model Automodel has no formula for, there is
no such line. Checked: Automodel's Qwen3-30B-A3B row (12,040 tokens/s per GPU at 4,096-token rows) times the formula's
23.006 GFLOP per token is its published 277 TFLOP/s per GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from nemo_ac.config.hf.registry import hf_config_dict
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.trainer.flops import attention_row_length


@dataclass(frozen=True)
class PeerFlops:
    """Automodel's model FLOPs for one token of the recipe's rows."""

    formula: str  # the Automodel function's name, e.g. "qwen3_flops"
    flops_per_token: float
    row_tokens: int  # the row length the formula was given (its attention term)

    def describe(self) -> str:
        return (
            f"NeMo Automodel's {self.formula} ({self.flops_per_token / 1e9:,.2f} GFLOP per token at "
            f"{self.row_tokens:,}-token rows)"
        )


def automodel_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("nemo_automodel", "transformers"))


def automodel_flops(recipe: RecipeConfig) -> PeerFlops | None:
    """Automodel's FLOPs per token for ``recipe``'s model and rows; None without Automodel / transformers installed,
    for a family without a Hugging Face mapping, or a model Automodel has no formula for."""
    if not automodel_available():
        return None
    try:
        config_json = hf_config_dict(recipe.model)
    except NotImplementedError:  # a family without a Hugging Face mapping
        return None
    from nemo_automodel.components.utils.flops_utils import get_flops_formula_for_hf_config
    from transformers import AutoConfig

    row = round(attention_row_length(recipe.data))
    config = AutoConfig.for_model(config_json.pop("model_type"), **config_json)
    formula = get_flops_formula_for_hf_config(config)
    if formula is None:
        return None
    return PeerFlops(
        formula=formula.__name__, flops_per_token=formula(config, gbs=1, seq_len=row) / row, row_tokens=row
    )
