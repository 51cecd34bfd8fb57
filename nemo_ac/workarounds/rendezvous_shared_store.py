"""torchrun restarts (``--max-restarts``) that cannot start their process group.

Error prevented (torch 2.13, ``torchrun --standalone`` / ``--rdzv-backend c10d`` with ``--max-restarts`` > 0, after a
rank died)::

    Gloo connectFullMesh failed ... Connection refused

or a hang in ``init_process_group`` (NCCL: a stale unique id).

Why: the c10d rendezvous shares one agent-hosted TCPStore with the workers for the whole job and workers add no
per-attempt prefix, so a restarted attempt can read the killed attempt's gloo addresses; in 2.13
``DynamicRendezvousHandler.next_rendezvous`` creates the shared server once per job, not once per attempt. Seen
here on restarts of the kill test about one time in two.

Fix: start torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt); ``nemo-ac train
--max-restarts`` sets it, and ``elastic_restart_hazard`` warns a worker launched without it. Read from the worker
environment torchrun exports (agent settings are not visible to workers).

Upstream: pytorch/pytorch#135712 (closed: fixed for 2.5 by pytorch/pytorch#135957, a fresh server per retry; the
hazard is back in 2.13 as above, not yet reported). Delete when: the store is per attempt on every supported torch.
"""

from __future__ import annotations

import os


def elastic_restart_hazard() -> str | None:
    """Why a torchrun restart of this job may fail to start its process group, or None."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        "torchrun --max-restarts with its shared TCPStore: a restarted attempt may fail in init_process_group "
        "(stale addresses of the killed attempt, pytorch/pytorch#135712); launch torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (nemo-ac train --max-restarts does)"
    )
