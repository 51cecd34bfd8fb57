"""Stop on SIGTERM / SIGINT: after the current step when it ends in time, at a deadline otherwise; one line always.

A cluster's preemption (SIGTERM, which torchrun forwards to every rank) or Ctrl-C (SIGINT to the whole process
group) must not lose the steps since the last checkpoint nor print a traceback per rank. The handler only records
the signal; the loop asks ``StopSignal.agreed()`` before each step, which all-reduces (MAX) one int over the
default process group, so all ranks stop after the same step even when only one of them got the signal. The entry
then saves a checkpoint of that step (when ``checkpoint.enabled``), writes the summary (``stopped_by``) and a
``{"event": "stop"}`` record to metrics.jsonl, prints one line and exits 0: the stop was asked for and its state is
saved. A non-zero exit of the ranks would make torchrun print a ChildFailedError report (a traceback and ~40
lines) and, under ``--max-restarts``, restart the group, which would resume and train on against the signal.

The deadline. The step boundary may be far away: the first step compiles for minutes on a cold inductor cache,
weights may still be loading, a save may be slow. torchrun forwards the signal, waits 30 s, then SIGKILLs the ranks
(measured before the deadline existed: SIGTERM while step 1 compiled ended in ``Unable to shutdown process ... via
15, forcefully exiting via 9``, exit 143, and no nemo_ac line at all). So the first signal also arms a watchdog
thread: if the process has not printed its stop line ``train.stop_deadline_s`` (default 20 s, under torchrun's 30)
after the signal, rank 0 prints one line saying where the run was (``during step 1 (compiling)``) and which
complete checkpoint stands (``checkpoint_files.find_latest_complete``: a save cut short leaves only its
``.step_<N>.partial``, which is never loaded, so the line names the one before it), every process this rank
started (inductor's compile workers) is killed, and the rank leaves with ``os._exit(128 + signum)``: 143 for
SIGTERM, 130 for SIGINT, what shells and torchrun report for a signalled process, here one that saved nothing new.
An error raised on the way after a signal (torchrun's SIGTERM to the rank's process group also kills the compile
workers a compile is waiting on) ends the same way, at once, instead of as a crash report.

A second signal exits at once the same way. A signal that arrives within ``DUPLICATE_WINDOW_S`` of the first is the
same request delivered twice (Ctrl-C reaches a rank from the terminal and again from torchrun, which forwards the
SIGINT it got; a scheduler may signal torchrun and the ranks) and is ignored.

``NEMO_AC_TEST_SIGNAL_AFTER_STEP=N`` (tests only): after step N the last rank sends itself SIGTERM, a
deterministic trigger for the stop path (its peers learn of it only through the all-reduce).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nemo_ac.config.schema import TrainConfig
from nemo_ac.trainer.checkpoint.files import find_latest_complete

DUPLICATE_WINDOW_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
TEST_SIGNAL_ENV = "NEMO_AC_TEST_SIGNAL_AFTER_STEP"
_CLEAR_LINE = "\r\033[K"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def standing_checkpoint(root: Path, *, resume_auto: bool) -> str:
    """What a stop that saved nothing new leaves: the newest complete checkpoint under ``root``, or none."""
    found = find_latest_complete(root).path
    if found is None:
        return f"nothing saved (no complete checkpoint under {root})"
    how = "rerun the same command" if resume_auto else "resume with checkpoint.resume=auto"
    return f"nothing new saved; the last complete checkpoint is {found} ({how} to continue)"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children (Linux ``/proc``; elsewhere none are found and
    inductor's workers notice the closed pipe of their parent on their own)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            found.extend(_descendants(child))
    return found


def kill_descendants() -> None:
    """SIGKILL the processes this one started (inductor's compile sidecar and its pool workers) so none outlives
    a rank that leaves with ``os._exit``."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signal.SIGKILL)


class StopSignal:
    """Records SIGTERM / SIGINT (``install`` in the main thread); ``agreed`` turns it into a decision of all ranks;
    a watchdog ends the process ``deadline_s`` after the first signal unless ``finish`` ran (module docstring)."""

    def __init__(self, *, deadline_s: float = TrainConfig.stop_deadline_s) -> None:
        self.received = 0  # the first signal this process got (0: none)
        self.received_at = 0.0
        self.signum = 0  # the signal all ranks agreed to stop on (0: keep training)
        self.deadline_s = deadline_s
        self.phase = "start-up"  # where the run is, for the deadline's line: "step 3", "the checkpoint save of ..."
        self.phase_detail: Callable[[], str] = lambda: ""  # e.g. " (compiling)" while a compile runs
        self.standing: Callable[[], str] = lambda: "nothing saved"  # which checkpoint a stop now leaves
        self.is_main = os.environ.get("RANK", "0") == "0"
        self._previous: dict[int, Any] = {}
        self._armed = threading.Event()
        self._final = threading.RLock()  # the stop line is printed once: by the loop's stop or by the deadline
        self._finished = False
        self._watchdog: threading.Thread | None = None

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            # The handler runs between any two bytecodes, inside compiled regions too: Dynamo must not trace it.
            handler = torch.compiler.disable(self._handle)
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, handler)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="nemo_ac-stop-deadline", daemon=True)
            self._watchdog.start()
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def configure(
        self,
        *,
        deadline_s: float | None = None,
        standing: Callable[[], str] | None = None,
        phase_detail: Callable[[], str] | None = None,
    ) -> None:
        """The recipe's ``train.stop_deadline_s`` and what the deadline's line reports, once they are known."""
        if deadline_s is not None:
            self.deadline_s = deadline_s
        if standing is not None:
            self.standing = standing
        if phase_detail is not None:
            self.phase_detail = phase_detail

    def enter(self, phase: str) -> None:
        self.phase = phase

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.received_at = signum, now
            self._armed.set()
            return
        if now - self.received_at < DUPLICATE_WINDOW_S:
            return  # the same request delivered twice (terminal + torchrun forwarding)
        self.exit_now(signum, reason=f"a second signal ({signal_name(signum)}) stops at once")

    def _watch(self) -> None:
        self._armed.wait()
        while (left := self.received_at + self.deadline_s - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))  # re-read: configure() may set the recipe's deadline meanwhile
        self.exit_now(self.received, reason=f"still running train.stop_deadline_s={self.deadline_s:g} s after it")

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

    def finish(self, line: str | None, *, write: Callable[[str], None]) -> bool:
        """Print the run's stop line (rank 0 passes it, the others None) unless the deadline's line came first;
        afterwards the watchdog only exits 0 (the state is saved) should the teardown still hang. False: too late."""
        with self._final:
            if self._finished:
                return False
            if line is not None:
                write(line)
            self._finished = True
            return True

    def stop_line(self, signum: int, *, reason: str) -> str:
        where = f"{self.phase}{self.phase_detail()}"
        return (
            f"nemo_ac: {signal_name(signum)} during {where}: {reason}; {self.standing()}; exiting with {128 + signum}"
        )

    def exit_now(self, signum: int, *, reason: str) -> NoReturn:
        """End this process now with ``128 + signum`` (0 when the stop line was already printed: the state is
        saved), rank 0 printing the one line first. From the watchdog, the signal handler or the entry's error
        path after a signal."""
        code = 128 + signum
        with self._final:
            if self._finished:
                code = 0
            else:
                self._finished = True
                if self.is_main:  # os.write: no lock of sys.stderr that the interrupted main thread may hold
                    clear = _CLEAR_LINE if os.isatty(2) else ""  # the progress bar's line
                    os.write(2, f"{clear}{self.stop_line(signum, reason=reason)}\n".encode())
        kill_descendants()
        os._exit(code)


def maybe_signal_self(step: int) -> None:
    """``NEMO_AC_TEST_SIGNAL_AFTER_STEP``: the last rank SIGTERMs itself after that step (tests only)."""
    wanted = os.environ.get(TEST_SIGNAL_ENV)
    if not wanted or int(wanted) != step:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGTERM)
