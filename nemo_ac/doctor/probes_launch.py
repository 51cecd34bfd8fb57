"""torchrun restarts and the rendezvous store, asked of torch's own rendezvous handler without launching torchrun.

A restart (``--max-restarts``) is a new round of the same c10d rendezvous. Where torch shares one agent-hosted
TCPStore with the workers (``use_agent_store``) and creates it once per job, the restarted attempt's workers are
pointed at the store the killed attempt used, keys and all, and may read its gloo addresses::

    Gloo connectFullMesh failed ... Connection refused

(or hang in ``init_process_group``). The probe runs two rounds of a one-node ``DynamicRendezvousHandler`` (the
c10d backend over an in-memory store, this host only; 0.2 to 0.5 s: torch's random start delay and its event records)
and compares the store each round hands its workers. Affected: both rounds name the same store while the workers
are told to use it, and ``elastic_restart_hazard`` (the warning ``train.py`` prints) fires in such a worker's
environment. With the workaround (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, what ``nemo-ac train --max-restarts``
sets): every round gets a store of its own and the warning stays silent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from nemo_ac.doctor.isolation import on_thread
from nemo_ac.doctor.result import ProbeRun, recording
from nemo_ac.workarounds.rendezvous_shared_store import elastic_restart_hazard

# What ``nemo-ac train --max-restarts`` puts in torchrun's environment (nemo_ac/cli.py).
FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STALE_STORE = re.compile(r"a restarted attempt's workers are handed the killed attempt's store")
HOST = "127.0.0.1"


@contextmanager
def _environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables for the scope, then restore them."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rounds(count: int) -> tuple[list[tuple[str, int]], bool]:
    """The bootstrap store ``(addr, port)`` each of ``count`` rounds hands its workers, and ``use_agent_store``."""
    store = dist.HashStore()
    params = RendezvousParameters(
        backend="c10d", endpoint="", run_id="nemo_ac-doctor", min_nodes=1, max_nodes=1, local_addr=HOST
    )
    handler = create_handler(store, C10dRendezvousBackend(store, "nemo_ac-doctor"), params)
    stores = []
    try:
        for _ in range(count):
            info = handler.next_rendezvous()
            stores.append((info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port))
        return stores, handler.use_agent_store
    finally:
        handler.shutdown()


def run_rendezvous_probe(*, workaround: bool, device: str = "cpu") -> ProbeRun:
    """Two rendezvous rounds (the first attempt and its restart); device: unused."""
    run = ProbeRun(workaround=workaround)
    env = {name: (value if workaround else None) for name, value in FRESH_STORE_ENV.items()}
    with _environ(env), recording(run, expected=STALE_STORE):
        # On a fresh thread: torch records each rendezvous step with inspect.stack(), whose cost grows with the
        # caller's stack depth and the modules loaded (off and on: 1.6 s at the end of the
        # doctor's run, 0.6 s on a fresh thread).
        (first, restart), shared = on_thread(lambda: _rounds(2), name="nemo_ac-doctor-rendezvous")
        # What the elastic agent exports to each worker of such a job (local_elastic_agent), with restarts on.
        with _environ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": str(shared)}):
            warned = elastic_restart_hazard() is not None
        run.facts.update(use_agent_store=shared, same_store_after_restart=first == restart, train_py_warns=warned)
        if shared and first == restart:
            if not warned:
                raise AssertionError(
                    "workers use the shared store across restarts, but elastic_restart_hazard is silent"
                )
            raise RuntimeError(
                f"a restarted attempt's workers are handed the killed attempt's store ({first[0]}:{first[1]} in both "
                "rounds): Gloo connectFullMesh failed ... Connection refused, or a hang in init_process_group"
            )
        if warned:
            raise AssertionError("each attempt has a store of its own, yet elastic_restart_hazard warns")
    return run
