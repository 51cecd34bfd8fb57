"""What each model family can build, checked on the recipe alone (no torch, no models/ import).

The model builders (``nemo_ac.models.glm4_moe`` / ``nemotron_h``) raise on the same problems, but only after a
process group exists; ``config.validate`` calls ``family_problems`` so a recipe that asks GLM-4.5 for a softmax
router, or Nemotron-H for qk-norm, fails before anything starts, with the key and the value that works. Settings
are rejected rather than silently overridden: a recipe that says ``score_func: softmax`` for GLM would otherwise
train another model than it describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_ac.config.schema import ModelConfig


@dataclass(frozen=True)
class FamilyProblem:
    """``model.<key>`` holds ``value``; the family needs ``want`` (None: the family has no such option)."""

    key: str
    value: Any
    want: Any
    reason: str

    def describe(self) -> str:
        """The builder's short form: ``model.moe.score_func='softmax' (needs 'sigmoid')``."""
        if self.want is None:
            return f"{self.key}={self.value!r} ({self.reason})"
        return f"{self.key}={self.value!r} (needs {self.want!r})"

    def fix(self) -> str:
        """What the recipe should say instead."""
        if self.want is None:
            return f"remove it or set {self.key} to its default"
        return f"set {self.key}: {self.want}"


def _needs(cfg: ModelConfig, family: str, needs: dict[str, tuple[Any, Any]], why: str) -> list[FamilyProblem]:
    return [
        FamilyProblem(f"model.{key}", got, want, f"family {family}: {why}")
        for key, (got, want) in needs.items()
        if got != want
    ]


def _absent(family: str, options: dict[str, Any]) -> list[FamilyProblem]:
    return [FamilyProblem(f"model.{key}", value, None, f"not in {family}") for key, value in options.items() if value]


def glm4_moe_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    """GLM-4.5's router is always sigmoid with a score-correction bias and SwiGLU experts (transformers' Glm4Moe
    has no other mode); options of other families do not exist in it."""
    moe = cfg.moe
    needs = {
        "moe.score_func": (moe.score_func, "sigmoid"),
        "moe.score_correction_bias": (moe.score_correction_bias, True),
        "moe.activation": (moe.activation, "silu"),
    }
    problems = _needs(cfg, "glm4_moe", needs, "transformers' Glm4Moe router/experts have no other mode")
    return problems + _absent(
        "glm4_moe",
        {
            "attn_output_gate": cfg.attn_output_gate,
            "layer_pattern": cfg.layer_pattern,
            "moe.latent_size": moe.latent_size,
            "moe.shared_expert_gate": moe.shared_expert_gate,
            "mlp_bias": cfg.mlp_bias,
        },
    )


def nemotron_h_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    """Nemotron-H attention has no rope, qk-norm or bias; its MoE is sigmoid + correction bias with squared-ReLU
    experts and always-on shared experts; layer types come from ``layer_pattern`` only (its characters and length
    are checked by ``rules_model.check_model_shape``; the builder re-checks them)."""
    moe = cfg.moe
    problems = []
    if not cfg.layer_pattern:
        problems.append(
            FamilyProblem(
                "model.layer_pattern",
                "",
                None,
                "family nemotron_h needs its hybrid_override_pattern, one of M * E - per layer, e.g. 'ME*E'",
            )
        )
    needs = {
        "moe.score_func": (moe.score_func, "sigmoid"),
        "moe.score_correction_bias": (moe.score_correction_bias, True),
        "moe.activation": (moe.activation, "relu2"),
        "qk_norm": (cfg.qk_norm, False),
        "attention_bias": (cfg.attention_bias, False),
        "first_k_dense_replace": (cfg.first_k_dense_replace, 0),
        "attn_output_gate": (cfg.attn_output_gate, False),
        "moe.shared_expert_gate": (moe.shared_expert_gate, False),
    }
    problems += _needs(cfg, "nemotron_h", needs, "transformers' NemotronH has no other mode")
    if "E" in cfg.layer_pattern and moe.shared_expert_intermediate_size <= 0:
        problems.append(
            FamilyProblem(
                "model.moe.shared_expert_intermediate_size",
                moe.shared_expert_intermediate_size,
                None,
                "Nemotron-H MoE layers always have shared experts; set it > 0 (HF moe_shared_expert_intermediate_size)",
            )
        )
    return problems


_CHECKS = {"glm4_moe": glm4_moe_problems, "nemotron_h": nemotron_h_problems}


def family_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    """Everything in ``cfg`` its family cannot build (empty for fine configs and families without a check)."""
    check = _CHECKS.get(cfg.family)
    return check(cfg) if check is not None else []
