"""Process start-up and end: backend and device from the recipe (``auto``: nccl on CUDA, gloo on CPU), the process
group, once-per-node work and the exit without interpreter teardown.

A module of its own beside ``config/`` rather than inside ``distributed/`` (the parallelizer): ``data/`` waits on
one process per node to tokenize and may know nothing of how a model is parallelized."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from nemo_ac.config.schema import DistConfig

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """The world size torchrun announced (1 for a plain ``python -m``), readable before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device_type(cfg: DistConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() and cfg.backend != "gloo" else "cpu"


def resolve_backend(cfg: DistConfig, device_type: str, *, host_collectives: bool = False) -> str:
    """``auto``: nccl on CUDA, gloo on CPU. ``host_collectives``: some collectives take host tensors (the gradient
    norm over FSDP shards kept on the host, ``train.optimizer_offload: full``), so nccl gets gloo beside it for CPU
    tensors (as torchtitan does for its CPU offload); nccl alone fails them with "No backend type associated with
    device type cpu"."""
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and host_collectives else backend


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_distributed(cfg: DistConfig, *, host_collectives: bool = False) -> DistEnv:
    """Initialize the default process group (a world of 1 when not launched by torchrun); ``host_collectives`` as
    ``resolve_backend``'s."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "MASTER_ADDR" not in os.environ:  # plain `python -m nemo_ac.train`: a real world of one
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
    device_type = resolve_device_type(cfg)
    backend = resolve_backend(cfg, device_type, host_collectives=host_collectives)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def destroy_distributed(*, synchronize: bool = True) -> None:
    """Tear the process group down, after every rank has reached this point when ``synchronize``.

    Without the barrier a fast rank closes its gloo pairs while a slower peer still has a collective in flight;
    the peer's gloo I/O thread then dies at exit with ``terminate called without an active exception`` (SIGABRT,
    seen once in CI on a ring-CP run that had already printed its summary). Pass ``synchronize=False`` on an error
    path, where a peer may never arrive and the barrier would only wait out the timeout.
    """
    if not dist.is_initialized():
        return
    if synchronize:
        if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
            torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Leave a rank's process with ``code`` once its work and its process group are done, without the interpreter's
    teardown.

    After ``destroy_distributed`` every result is written and every rank has passed the barrier; what is left is
    Python's and C++'s static teardown, where a rank still dies now and then with::

        terminate called without an active exception

    (SIGABRT after the run's summary line, so torchrun reports a failed run that in fact finished; seen in CI on a
    ring-CP run and locally on an EP run, about one launch in 40, after the barrier in ``destroy_distributed`` was
    added.) A joinable C++ thread of a static pool is destroyed there. Streams and logging are flushed first; this
    is only for the clean path: errors still raise and print their traceback.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def once_per_node(load: Callable[[], T]) -> T:
    """``load()`` on local rank 0 of each node first, then on the node's other ranks after a barrier: they read the
    cache it filled, so a Hub checkpoint or dataset is downloaded once per node, not once per rank, and no rank reads
    before its node has the files. A failure on local rank 0 still reaches the barrier (the node's other ranks wait
    there) and is raised after it. Without a process group: just ``load()``."""
    if not (dist.is_available() and dist.is_initialized()):
        return load()
    result, error = None, None
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if first:
        try:
            result = load()
        except Exception as err:
            error = err
    dist.barrier()
    if error is not None:
        raise error
    return result if first else load()
