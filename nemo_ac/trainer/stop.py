"""Stop on SIGTERM / SIGINT after the current step, on every rank at the same step.

A cluster's preemption (SIGTERM, which torchrun forwards to every rank) or Ctrl-C (SIGINT to the whole process
group) must not lose the steps since the last checkpoint nor print a traceback per rank. The handler only records
the signal; the loop asks ``StopSignal.agreed()`` before each step, which all-reduces (MAX) one int over the
default process group, so all ranks stop after the same step even when only one of them got the signal. The entry
then saves a checkpoint of that step (when ``checkpoint.enabled``), writes the summary (``stopped_by``) and a
``{"event": "stop"}`` record to metrics.jsonl, prints one line and exits 0: the stop was asked for and its state is
saved. A non-zero exit of the ranks would make torchrun print a ChildFailedError report (a traceback and ~40
lines) and, under ``--max-restarts``, restart the group, which would resume and train on against the signal.
(torchrun itself, when it is the one signalled, still reports its own ``SignalException`` and exits non-zero.)

A second signal exits at once with ``128 + signum`` (143 SIGTERM, 130 SIGINT), nothing saved. A signal that arrives within ``DUPLICATE_WINDOW_S`` of the
first is the same request delivered twice (Ctrl-C reaches a rank from the terminal and again from torchrun, which
forwards the SIGINT it got; a scheduler may signal torchrun and the ranks) and is ignored.

``NEMO_AC_TEST_SIGNAL_AFTER_STEP=N`` (tests only): after step N the last rank sends itself SIGTERM, a
deterministic trigger for the stop path (its peers learn of it only through the all-reduce).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

DUPLICATE_WINDOW_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
TEST_SIGNAL_ENV = "NEMO_AC_TEST_SIGNAL_AFTER_STEP"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignal:
    """Records SIGTERM / SIGINT (``install`` in the main thread); ``agreed`` turns it into a decision of all ranks."""

    def __init__(self) -> None:
        self.received = 0  # the first signal this process got (0: none)
        self.received_at = 0.0
        self.signum = 0  # the signal all ranks agreed to stop on (0: keep training)
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.received_at = signum, now
            return
        if now - self.received_at < DUPLICATE_WINDOW_S:
            return  # the same request delivered twice (terminal + torchrun forwarding)
        rank = os.environ.get("RANK", "0")
        os.write(
            sys.stderr.fileno(),
            f"nemo_ac: second signal ({signal_name(signum)}) on rank {rank}: exiting now, nothing saved\n".encode(),
        )
        os._exit(128 + signum)

    def agreed(self, device: torch.device | None = None) -> bool:
        """True on every rank once any rank got a signal (one int all-reduced over the default group)."""
        if self.signum:
            return True
        local = self.received
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int64, device=device or torch.device("cpu"))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        self.signum = local
        return bool(local)


def maybe_signal_self(step: int) -> None:
    """``NEMO_AC_TEST_SIGNAL_AFTER_STEP``: the last rank SIGTERMs itself after that step (tests only)."""
    wanted = os.environ.get(TEST_SIGNAL_ENV)
    if not wanted or int(wanted) != step:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGTERM)
