"""nemo_ac.launch's one-line ending for torchrun's ChildFailedError: the root-cause rank, its exit, the first line
of the error ``@record`` wrote and where the traceback is."""

from __future__ import annotations

import json
import os
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from nemo_ac.launch import failure_line


def _failure(tmp_path, *, exitcode: int, error: BaseException | None) -> ChildFailedError:
    error_file = tmp_path / "error.json"
    if error is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        try:
            try:
                raise error
            except type(error) as exc:
                ErrorHandler().record_exception(exc)  # what @record writes on a rank
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
        assert json.loads(error_file.read_text())["message"]["message"].startswith(type(error).__name__)
    failure = ProcessFailure(local_rank=1, pid=1234, exitcode=exitcode, error_file=str(error_file))
    failure.timestamp = int(time.time())
    return ChildFailedError(name="nemo_ac.train", failures={1: failure})


def test_a_crash_is_one_line_with_the_error_and_the_traceback_file(tmp_path):
    line, code = failure_line(_failure(tmp_path, exitcode=1, error=RuntimeError("boom\nsecond line")))
    assert (
        line == f"nemo-ac train: rank 1 exited with code 1: RuntimeError: boom (traceback in {tmp_path / 'error.json'})"
    )
    assert code == 1


def test_a_killed_rank_and_a_recipe_error(tmp_path):
    line, code = failure_line(_failure(tmp_path, exitcode=-signal.SIGKILL, error=None))
    assert line == "nemo-ac train: rank 1 was killed by SIGKILL" and code == 137
    line, code = failure_line(_failure(tmp_path, exitcode=2, error=None))
    assert line == "nemo-ac train: rank 1 exited with code 2 (its recipe error is printed above)" and code == 2
