"""Every torch failure nemo_ac works around, one module each, with a registry and one version-gate table.

Start at ``registry.WORKAROUNDS``; each module's docstring quotes the error it prevents, the affected torch
releases (``gates.GATES``), the upstream issues and the condition for deleting it. Only this package touches
private torch internals (SAC mode classes, higher-order-op redirects, ``ConfigModule`` internals, fake rules).
Importing it changes no torch state.
"""

from nemo_ac.workarounds.gates import GATES, TorchGate, gate_active, torch_version_release
from nemo_ac.workarounds.registry import (
    WORKAROUNDS,
    Upstream,
    Workaround,
    markdown_table,
    workaround,
)

__all__ = [
    "GATES",
    "WORKAROUNDS",
    "TorchGate",
    "Upstream",
    "Workaround",
    "gate_active",
    "markdown_table",
    "torch_version_release",
    "workaround",
]
