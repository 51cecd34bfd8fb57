"""``FSDPMemTracker`` at full depth: its per-op cost grows with the number of modules it has seen.

Failure prevented (a performance one: no error, a dry run that does not finish in its budget). torch's
``MemTracker.__torch_dispatch__`` calls ``_update_peak_stats`` after every op, which walks every module tracked so
far (``memory_tracking``, a ``WeakIdKeyDictionary``) to update each active module's local peak. A full-size dry run
of the GLM-4.5-Air recipe (46 blocks, each with its checkpoint wrapper and FSDP units) spent 56% of its time there
(py-spy; ``WeakIdRef.__call__`` and ``ActivationWrapper.__getattr__`` on top), an O(ops x modules) cost.
Seen on torch 2.13.0 (``torch/distributed/_tools/mem_tracker.py``); the same loop is in 2.14.1 and 2.15.0.

Also: ops of DTensor's sharding propagation (global-shape fake tensors, ``workarounds.fake_world``) pass untracked.
And: entering and leaving, ``FSDPMemTracker`` removes FSDP2's forward hooks and registers its own (or FSDP's again)
with ``prepend=True``, in front of nemo_ac's brackets around them (``workarounds.fsdp_hooks_in_sac``): FSDP's
all-gather then runs inside the SAC region again, and a measured step of the tiny Nemotron recipe (explicit
prefetch) failed with ``fsdp.all_gather_copy_in.default encountered during backward but not found in storage``. The
subclass puts the brackets back around whatever hooks are in place after each of the two.

Fix: ``GlobalPeakFSDPMemTracker`` overrides that one private method with its global half (the per-device peak and
its breakdown, exactly as torch computes them) and calls ``on_update`` after each op; the per-module
peaks, which nemo_ac never reads, are not kept; ``on_update`` lets a caller keep what it needs (nemo_ac: the peak of
each phase). Everything else (categories, FSDP instrumentation, optimizer hooks)
is torch's. A test runs both trackers over the same step and compares their global peaks and breakdowns.

Relies on: MemTracker._update_peak_stats (overridden) and the tracker's _curr_mem_snap, _peak_mem, _peak_mem_snap,
_depth and _root_mod (``torch/distributed/_tools``). ``nemo-ac doctor`` (check ``mem_tracker_global_peak``) asks the
installed torch for each.
Upstream: none filed. Delete when: ``MemTracker`` offers a global-only mode or makes the per-module update
proportional to the active modules (``_mod_tracker.parents``) rather than to every module seen.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

_TOTAL = "Total"


class GlobalPeakFSDPMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` keeping only the global peak; ``on_update(snapshot)`` sees the current snapshot after
    every op (not a copy: read it, do not keep it)."""

    def __init__(self, *args: Any, on_update: Callable[[dict[Any, dict[Any, int]]], None] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.on_update = on_update

    def _rebracket(self) -> None:
        from nemo_ac.workarounds.fsdp_hooks_in_sac import install_fsdp_hooks_outside_sac, remove_fsdp_hooks_outside_sac

        if remove_fsdp_hooks_outside_sac(self._root_mod):
            install_fsdp_hooks_outside_sac(self._root_mod)

    def __enter__(self) -> GlobalPeakFSDPMemTracker:
        outermost = self._depth == 0
        super().__enter__()
        if outermost:
            self._rebracket()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            self._rebracket()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from nemo_ac.workarounds.fake_world import in_sharding_propagation

        if in_sharding_propagation():  # DTensor's global-shape metadata ops allocate nothing (fake_world)
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap.get(_TOTAL, 0)  # mem_tracker._TOTAL_KEY
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
        if self.on_update is not None:
            self.on_update(self._curr_mem_snap)


def mem_tracker_internals_missing() -> list[str]:
    """The private names this module relies on that the installed torch's trackers lack (``nemo-ac doctor``)."""
    import inspect

    from torch.distributed._tools.mem_tracker import MemTracker

    missing = [] if callable(getattr(FSDPMemTracker, "_update_peak_stats", None)) else ["_update_peak_stats"]
    tracker = MemTracker()
    missing += [
        name for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "_depth") if not hasattr(tracker, name)
    ]
    if "_root_mod" not in inspect.getsource(FSDPMemTracker.__init__):
        missing.append("_root_mod")
    return missing
