"""A small synthetic dataset with the MedPix-VQA layout, generated deterministically (no downloads).

Columns follow ``mmoukouba/MedPix-VQA``: ``image_id`` (the image itself), ``mode``, ``case_id``, ``question``,
``answer``. Each "scan" is a noisy grayscale field whose texture encodes the modality (CT: smooth, MRI: horizontal
bands, X-ray: vertical gradient) with one bright lesion (round or square) in one quadrant, on a few image sizes (so
patch grids differ). Questions ask for the modality, the lesion's location or its shape; the answer is readable from
the image, so a tiny model's loss on answer tokens can fall below the text-only prior.

``synthetic_medpix_records`` returns the rows in memory (what ``data.path: synthetic[:N]`` loads);
``write_synthetic_medpix`` saves them with ``datasets.Dataset.save_to_disk`` so the real loading path
(``datasets.load_from_disk``) is exercised on a local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MODES = ("CT", "MRI", "X-ray")
SHAPES = ("round", "square")
QUADRANTS = ("left upper", "right upper", "left lower", "right lower")
SIZES = ((32, 32), (48, 32), (32, 40), (24, 48))  # (width, height)
QUESTIONS = {
    "mode": "What imaging modality was used?",
    "location": "Where is the lesion located?",
    "shape": "What is the shape of the lesion?",
}


def _scan(mode: int, shape: int, quadrant: int, size: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    width, height = size
    ys = torch.linspace(0, 1, height).view(-1, 1).expand(height, width)
    xs = torch.linspace(0, 1, width).view(1, -1).expand(height, width)
    if mode == 0:
        base = 0.35 + 0.0 * xs
    elif mode == 1:
        base = 0.3 + 0.15 * torch.sin(ys * 25.0)
    else:
        base = 0.15 + 0.4 * ys
    img = base + 0.05 * torch.randn(height, width, generator=gen)
    cy = (0.25 if quadrant < 2 else 0.75) + 0.08 * (torch.rand(1, generator=gen).item() - 0.5)
    cx = (0.25 if quadrant % 2 == 0 else 0.75) + 0.08 * (torch.rand(1, generator=gen).item() - 0.5)
    radius = 0.12 + 0.04 * torch.rand(1, generator=gen).item()
    if shape == 0:
        lesion = ((ys - cy) ** 2 + (xs - cx) ** 2).sqrt() < radius
    else:
        lesion = ((ys - cy).abs() < radius) & ((xs - cx).abs() < radius)
    img = torch.where(lesion, torch.full_like(img, 0.95), img)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def synthetic_medpix_records(num_samples: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    """``num_samples`` rows {image_id: PIL.Image, mode, case_id, question, answer}, a pure function of the seed."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    records = []
    kinds = tuple(QUESTIONS)
    for i in range(num_samples):
        mode, shape, quadrant, size = (
            int(torch.randint(len(options), (1,), generator=gen)) for options in (MODES, SHAPES, QUADRANTS, SIZES)
        )
        gray = _scan(mode, shape, quadrant, SIZES[size], gen)
        image = Image.fromarray(gray.numpy(), mode="L").convert("RGB")
        kind = kinds[i % len(kinds)]
        answer = {"mode": MODES[mode], "location": f"{QUADRANTS[quadrant]} quadrant", "shape": SHAPES[shape]}[kind]
        records.append(
            {
                "image_id": image,
                "mode": MODES[mode],
                "case_id": f"case_{i // 3:04d}",
                "question": QUESTIONS[kind],
                "answer": answer,
            }
        )
    return records


def write_synthetic_medpix(directory: str | Path, *, num_samples: int = 48, seed: int = 0) -> Path:
    """Saves the synthetic rows as a ``datasets`` dataset (``save_to_disk``) under ``directory``; returns it."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("writing the synthetic MedPix sample needs `datasets`: pip install 'nemo_ac[hf]'") from exc
    records = synthetic_medpix_records(num_samples, seed)
    features = datasets.Features(
        {
            "image_id": datasets.Image(),
            "mode": datasets.Value("string"),
            "case_id": datasets.Value("string"),
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    columns = {name: [r[name] for r in records] for name in features}
    out = Path(directory)
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(out))
    return out
