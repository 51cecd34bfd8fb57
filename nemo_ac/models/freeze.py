"""Freezing parameter groups (``train.freeze``): set ``requires_grad`` so frozen tensors get no gradient.

The trainer calls ``freeze`` on the parallelized model before building the optimizer and hands the optimizer only
``requires_grad`` parameters, so frozen ones get no optimizer state; FSDP2 reduce-scatters gradients only for
parameters that have one, so they get no gradient reduction either.

Groups are found by module identity, not by parameter-name patterns, so wrappers (activation checkpointing,
torch.compile, FSDP2's dynamic subclasses) do not matter and every family works:

- ``vision_tower``: everything under ``model.model.visual`` except the merger (qwen3_5_moe only);
- ``vision_merger``: ``model.model.visual.merger``, the projector into the text hidden size;
- ``embeddings``: every ``nn.Embedding`` outside the vision tower (the token table; a tied ``lm_head`` is the same
  tensor and follows it);
- ``language_model``: every other parameter (decoder layers, final norm, untied ``lm_head``).
"""

from __future__ import annotations

from torch import nn

GROUPS = ("vision_tower", "vision_merger", "embeddings", "language_model")


def parameter_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Every parameter of ``model`` (each tensor once) in exactly one of ``GROUPS``."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    merger = getattr(visual, "merger", None) if visual is not None else None
    groups: dict[str, list[nn.Parameter]] = {g: [] for g in GROUPS}
    seen: set[int] = set()

    def take(group: str, params: list[nn.Parameter]) -> None:
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                groups[group].append(p)

    if merger is not None:
        take("vision_merger", list(merger.parameters()))
    if visual is not None:
        take("vision_tower", list(visual.parameters()))
    vision_modules = {id(m) for m in visual.modules()} if visual is not None else set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module) not in vision_modules:
            take("embeddings", list(module.parameters()))
    take("language_model", list(model.parameters()))
    return groups


def freeze(
    model: nn.Module,
    *,
    vision_tower: bool = False,
    embeddings: bool = False,
    language_model: bool = False,
    vision_merger: bool = False,
) -> dict[str, int]:
    """Sets ``requires_grad = not frozen`` for every group; returns the number of frozen elements per group.

    Unfrozen groups are set trainable again, so calling it twice with other flags is not cumulative. Raises when
    asked to freeze a vision group of a model without a vision tower (the recipe would silently train text only).
    """
    flags = {
        "vision_tower": vision_tower,
        "vision_merger": vision_merger,
        "embeddings": embeddings,
        "language_model": language_model,
    }
    groups = parameter_groups(model)
    for group in ("vision_tower", "vision_merger"):
        if flags[group] and not groups[group]:
            raise ValueError(f"train.freeze.{group}: {type(model).__name__} has no vision tower")
    frozen: dict[str, int] = {}
    for group, params in groups.items():
        for p in params:
            p.requires_grad_(not flags[group])
        frozen[group] = sum(p.numel() for p in params) if flags[group] else 0
    return frozen
