"""``data.num_workers``: the background threads per rank that build the next step (``data.batch.StepBatches``).

Every source reads it (synthetic, text, MedPix); before, only MedPix did, and ``data.num_workers: 100000`` on a text
recipe validated and was silently ignored. Rejected here: a negative count, and more than ``MAX_DATA_WORKERS``
(the threads build only the next step, so beyond a few they add memory, never speed: a large value is a typo).
"""

from __future__ import annotations

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import DataConfig

MAX_DATA_WORKERS = 64


def check_data_workers(data: DataConfig) -> list[ConfigIssue]:
    workers = data.num_workers
    if workers < 0:
        return [ConfigIssue("data.num_workers", f"{workers} must be >= 0 (0: no worker threads)")]
    if workers > MAX_DATA_WORKERS:
        return [
            ConfigIssue(
                "data.num_workers",
                f"{workers} threads per rank is more than the {MAX_DATA_WORKERS} allowed; they build only the next "
                f"step, so a few are enough (the MedPix flagship uses 2): set it between 0 and {MAX_DATA_WORKERS}",
            )
        ]
    return []
