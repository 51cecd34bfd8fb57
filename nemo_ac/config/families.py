"""What a model family declares to the recipe rules: ``FamilyRules``, one per family, checked on the recipe alone (no
torch, no models/ import).

Each family declares its rules beside its ``config.json`` mapping, in its own module of ``nemo_ac.config.hf``
(``register_family_rules``), and the rules ask the declaration instead of switching on family names: which
settings the family cannot build (``problems``), its ``layer_pattern`` characters, the ``ModelConfig`` sections
only it reads, its recurrent sequence mixers (what context parallel splits and carries over) and whether it has a
vision tower. A family is added by its own model module and its ``config/hf`` module; no rule is edited.

The model builders (``nemo_ac.models.glm4_moe`` / ``nemotron_h``) raise on the same problems, but only after a
process group exists; ``config.rules_model`` asks ``problems`` so a recipe that asks GLM-4.5 for a softmax router,
or Nemotron-H for qk-norm, fails before anything starts, with the key and the value that works. Settings are
rejected rather than silently overridden: a recipe that says ``score_func: softmax`` for GLM would otherwise train
another model than it describes.
"""

from __future__ import annotations

from collections.abc import Callable
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


def family_needs(cfg: ModelConfig, family: str, needs: dict[str, tuple[Any, Any]], why: str) -> list[FamilyProblem]:
    return [
        FamilyProblem(f"model.{key}", got, want, f"family {family}: {why}")
        for key, (got, want) in needs.items()
        if got != want
    ]


def family_lacks(family: str, options: dict[str, Any]) -> list[FamilyProblem]:
    return [FamilyProblem(f"model.{key}", value, None, f"not in {family}") for key, value in options.items() if value]


@dataclass(frozen=True)
class HeadGroup:
    """Heads (or head groups) of a recurrent mixer that Ulysses context parallel splits over the ``cp`` ranks."""

    key: str  # model.<key>
    count: int
    # None: must divide evenly over cp; else what is replicated when fewer than cp ("B/C groups").
    replicated_when_fewer: str | None = None


@dataclass(frozen=True)
class RecurrentMixer:
    """A recurrent sequence mixer, as the context-parallel rules see it: ring CP carries its state and its conv's
    ``conv_kernel - 1`` halo tokens from the previous slice; Ulysses splits its heads."""

    name: str  # "Gated DeltaNet", in messages
    backend_key: str  # backend.<key> picks its kernel
    conv_kernel: int
    head_groups: tuple[HeadGroup, ...]


def _no_problems(cfg: ModelConfig) -> list[FamilyProblem]:
    return []


def _no_recurrent_mixers(cfg: ModelConfig) -> tuple[RecurrentMixer, ...]:
    return ()


@dataclass(frozen=True)
class FamilyRules:
    """What one family declares to the recipe rules (defaults: a plain decoder with nothing of its own)."""

    family: str
    # Everything in a ModelConfig the family cannot build (the builder raises on the same).
    problems: Callable[[ModelConfig], list[FamilyProblem]] = _no_problems
    # The model.layer_pattern characters the family takes ("": it takes no layer_pattern).
    layer_pattern_chars: str = ""
    # ModelConfig sections only this family reads (model.pretrained compares them for it alone).
    sections: tuple[str, ...] = ()
    recurrent_mixers: Callable[[ModelConfig], tuple[RecurrentMixer, ...]] = _no_recurrent_mixers
    vision: bool = False  # a vision tower (model.vision); image data and freeze.vision_* need it
