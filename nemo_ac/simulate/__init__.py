"""A full-size dry run of a recipe in one CPU process: ``nemo-ac plan`` (module ``run``; docs/planning.md).

One rank of the real layout under a fake process group, the model parallelized by the real plan, one training step
of the trainer's own code on fake tensors, counted by torch's tools: per-rank peak memory and its breakdown
(``memory``: FSDPMemTracker), FLOPs (``counters``: torch's FLOP formulas), collective bytes per mesh dimension, and
an estimated step time and MFU per GPU (``estimate``, ``gpus``). Everything estimated says so.
"""

from nemo_ac.simulate.run import Simulation, SimulationError, SimulationOptions, simulate

__all__ = ["Simulation", "SimulationError", "SimulationOptions", "simulate"]
