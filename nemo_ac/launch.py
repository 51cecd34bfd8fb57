"""torchrun with one-line endings: what ``nemo-ac train`` execs (``python -m nemo_ac.launch TORCHRUN_ARGS...``).

``nemo-ac train`` replaces itself with this process (``os.execvpe``), so there is no parent in between: a SIGTERM
from a scheduler or the Ctrl-C of a terminal reaches torchrun's agent directly, the agent forwards it to the ranks
and waits for them (``nemo_ac.trainer.stop``: each finishes its step, rank 0 saves and prints one line), and the
shell prompt returns only when they are gone.

What changes against plain ``torchrun``: only the ending. Plain torchrun ends a failed run with its own
``ChildFailedError`` traceback and a failure report (40 lines for a one-key recipe typo: two log lines, its
traceback and the report of every rank), and a signalled run with a ``SignalException`` traceback. Here:

- a failed rank: one line naming the root-cause rank, its exit code, the first line of its error (from the error
  file ``@record`` on ``nemo_ac.train.main`` wrote) and the error file holding the full traceback;
- a signal: nothing beyond rank 0's own line (the checkpoint it saved, or the one that stands when the stop
  deadline ended the ranks: nemo_ac.trainer.stop); exit code 128 + signal number. That also holds when the ranks
  were signalled and torchrun was not: a rank's exit code 143 / 130 without an error file is such a stop;
- torchrun's per-process log lines about closing signals and the death signal are filtered (public ``logging``
  filters on torch's elastic loggers); every other agent message (restarts under ``--max-restarts``) still prints.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

# The start of the log messages filtered (their format strings in torch 2.13; a changed one simply prints again).
_QUIET_PREFIXES = (
    "Sending process ",  # multiprocessing/api.py "Sending process %s closing signal %s": one per rank per shutdown
    "failed (exitcode: ",  # multiprocessing/api.py: the root cause, reported below in one line
    "Received %s death signal",  # agent/server/api.py: a signal's one line is rank 0's (what it saved)
)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_QUIET_PREFIXES))


def _install_filters() -> None:
    quiet = _Quiet()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(quiet)


STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # a rank's exit after a stop that saved nothing new


def failure_line(error: BaseException) -> tuple[str | None, int]:
    """One line for torchrun's ``ChildFailedError`` (the root-cause rank), and the exit code to leave with; no line
    for a rank that stopped on a signal (``STOP_CODES``, no error file): its rank 0 printed the stop's line."""
    rank, failure = error.get_first_failure()  # type: ignore[attr-defined]
    message = failure.message
    if isinstance(message, dict):  # an error file written by @record: {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    first = str(message or "").strip().splitlines()
    code = failure.exitcode
    if code < 0:
        what = f"was killed by {failure.signal_name()}"
        code = 128 - code
    else:
        what = f"exited with code {code}"
    recorded = failure.error_file not in (None, "", "<N/A>") and failure.error_file_data.get("message") != "<NONE>"
    if code in STOP_CODES and failure.exitcode > 0 and not recorded:
        return None, code
    line = f"nemo-ac train: rank {rank} {what}"
    if recorded:
        line += f": {first[0] if first else ''} (traceback in {failure.error_file})"
    elif code == 2:
        line += " (its recipe error is printed above)"
    return line, code or 1


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _install_filters()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as error:
        line, code = failure_line(error)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as error:  # the agent already forwarded it and waited for the ranks
        return 128 + int(getattr(error, "sigval", signal.SIGTERM))
    return 0


if __name__ == "__main__":
    sys.exit(main())
